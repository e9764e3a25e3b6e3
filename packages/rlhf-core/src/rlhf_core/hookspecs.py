"""The hook specifications of every rlhf seam: *catalog hooks*, whose implementations call ``register(name,
obj)`` once per object they provide, for the configuration to pick by name.

``docs/plugin-hooks.md`` says how to write and test a plugin and documents each hook with its exact signature
(a test keeps the two in step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT = "rlhf"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[[str, Any], None]


# --- algorithm seams (rlhf-algos registers the built-ins) ---------------------------------------------


@hookspec
def rlhf_register_advantage_estimators(register: Register) -> None:
    """Advantage estimators (:class:`rlhf_core.types.AdvantageEstimator`): ``--algo.advantage.estimator``."""


@hookspec
def rlhf_register_policy_losses(register: Register) -> None:
    """Policy losses (:class:`rlhf_core.types.PolicyLoss`), picked by ``--actor.policy_loss_type``."""


@hookspec
def rlhf_register_kl_estimators(register: Register) -> None:
    """Per-token KL estimators (:class:`rlhf_core.types.KLEstimator`), picked by ``--algo.kl.estimator``."""


# --- experience collection seams (rlhf-agents registers the built-ins) --------------------------------


@hookspec
def rlhf_register_agent_executors(register: Register) -> None:
    """Agent executors: subclasses of ``rlhf_agents.AgentExecutorBase``, whose async ``execute(...)`` turns
    one prompt into one :class:`rlhf_core.types.Trajectory`. Picked by ``--train.agent_executor``."""


@hookspec
def rlhf_register_environments(register: Register) -> None:
    """Multi-turn environments: subclasses of ``rlhf_agents.AgentInstanceBase`` (OpenRLHF's ``reset(states)``
    and ``step(states)``), driven by the ``multi_turn`` executor. Picked by ``--train.env``."""


@hookspec
def rlhf_register_reward_sources(register: Register) -> None:
    """Reward sources (:class:`rlhf_core.types.RewardSourceFactory`): the one whose ``accepts(cfg)`` is true,
    or ``--reward.source NAME``."""


@hookspec
def rlhf_register_tool_parsers(register: Register) -> None:
    """Tool-call parsers of the agents' OpenAI endpoint: classes with ``markers``, ``parse(text)`` and
    ``opening(name)`` (``rlhf_agents.tool_parsers``). Picked by ``--train.tool_parser``, else by the chat
    template."""


@hookspec
def rlhf_register_post_processors(register: Register) -> None:
    """Post-processors of ``rlhf generate`` (:class:`rlhf_core.types.PostProcessor`), picked by
    ``--generate.post_processor``."""


# --- system seams ---------------------------------------------------------------------------------


@hookspec
def rlhf_register_placement_strategies(register: Register) -> None:
    """Placement strategies (:class:`rlhf_core.types.PlacementStrategy`), picked by ``--train.colocate_*`` (or
    ``--train.placement NAME``)."""


@hookspec
def rlhf_register_rollout_engines(register: Register) -> None:
    """Rollout engine factories (:class:`rlhf_core.types.RolloutEngineFactory`): ``--rollout.engine``."""


@hookspec
def rlhf_register_train_backends(register: Register) -> None:
    """Training backends (:class:`rlhf_core.types.TrainBackend`), picked by ``--train.backend``."""
