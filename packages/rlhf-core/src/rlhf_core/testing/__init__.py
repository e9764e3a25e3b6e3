"""Test kit for rlhf and for third-party plugins.

- The ``register_plugin`` pytest fixture (loaded automatically through the ``pytest11`` entry point)
  registers a plugin object for one test: every ``get_plugin_manager()`` made during the test sees it.
- Conformance suites, one per seam, that a plugin's own tests subclass::

      from rlhf_core.testing import AdvantageEstimatorConformance

      class TestMyEstimator(AdvantageEstimatorConformance):
          name = "my_estimator"          # resolved through the installed entry points

  Every test of the suite then runs against that plugin. Rollout engines subclass
  ``RolloutEngineConformance`` and override ``make_engine(model_dir)`` instead; train backends subclass
  ``TrainBackendConformance`` with their registered ``name``.
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

__all__ = ["AdvantageEstimatorConformance", "EnvironmentConformance", "PlacementStrategyConformance",
           "PostProcessorConformance", "RewardSourceConformance", "KLEstimatorConformance",
           "PolicyLossConformance", "RolloutEngineConformance", "TrainBackendConformance", "register_plugin",
           "registered_plugin"]
