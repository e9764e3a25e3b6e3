"""Test kit for rlhf and for third-party plugins: the ``register_plugin`` pytest fixture (loaded through the
``pytest11`` entry point) and one conformance suite per seam, for a plugin's tests to subclass
(``docs/plugin-hooks.md``, "Testing a plugin", says what each subclass provides).
"""

from rlhf_core.testing.algos import (
    AdvantageEstimatorConformance,
    KLEstimatorConformance,
    PolicyLossConformance,
)
from rlhf_core.testing.engines import RolloutEngineConformance
from rlhf_core.testing.fixtures import register_plugin, registered_plugin
from rlhf_core.testing.seams import (
    EnvironmentConformance,
    PlacementStrategyConformance,
    PostProcessorConformance,
    RewardSourceConformance,
)
from rlhf_core.testing.train import TrainBackendConformance

__all__ = [
    "AdvantageEstimatorConformance",
    "EnvironmentConformance",
    "PlacementStrategyConformance",
    "PostProcessorConformance",
    "RewardSourceConformance",
    "KLEstimatorConformance",
    "PolicyLossConformance",
    "RolloutEngineConformance",
    "TrainBackendConformance",
    "register_plugin",
    "registered_plugin",
]
