"""The hook specifications of every rlhf seam.

Each seam is a *catalog hook*: an implementation receives a ``register(name, obj)`` callback and calls it
once per object it provides. The configuration then picks objects by name (``--algo.advantage.estimator
group_norm``), never by plugin order. Registering a name that another distribution already registered is
an error naming both distributions.

A plugin is a module (or object) with functions decorated by :data:`rlhf_core.hookimpl`, exposed through
the ``rlhf`` entry-point group of its distribution::

    [project.entry-points.rlhf]
    my_plugin = "my_plugin.hooks"

An implementation may accept any subset of the documented parameters (pluggy passes them by name), so new
parameters can be appended to a hook later without breaking existing plugins.

``docs/plugin-hooks.md`` documents each hook with its exact signature; a test keeps the two in step.
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
    """Register advantage estimators (:class:`rlhf_core.types.AdvantageEstimator`), picked by
    ``--algo.advantage.estimator``.

    Built-in names: ``gae``, ``reinforce``, ``reinforce_baseline``, ``rloo``, ``group_norm``, ``dr_grpo``,
    ``opd``.
    """


@hookspec
def rlhf_register_policy_losses(register: Register) -> None:
    """Register policy losses (:class:`rlhf_core.types.PolicyLoss`), picked by ``--actor.policy_loss_type``.

    Built-in names: ``ppo`` (clip, asymmetric clip, dual clip), ``gspo``.
    """


@hookspec
def rlhf_register_kl_estimators(register: Register) -> None:
    """Register per-token KL estimators (:class:`rlhf_core.types.KLEstimator`), picked by
    ``--algo.kl.estimator``.

    Built-in names: ``k1``, ``k2``, ``k3``.
    """


# --- experience collection seams (rlhf-agents registers the built-ins) --------------------------------


@hookspec
def rlhf_register_agent_executors(register: Register) -> None:
    """Register agent executors, picked by name (``--train.agent_executor``) or implied by
    ``--train.agent_func_path``.

    Each object is a class deriving from ``rlhf_agents.AgentExecutorBase``. Its async ``execute(...)``
    turns one prompt into one :class:`rlhf_core.types.Trajectory`, token in and token out.

    Built-in names: ``single_turn``, ``multi_turn``, ``openai_server``.
    """


@hookspec
def rlhf_register_environments(register: Register) -> None:
    """Register multi-turn environments, picked by ``--train.env``.

    Each object is a class deriving from ``rlhf_agents.AgentInstanceBase`` (the OpenRLHF agent API:
    ``reset(states)`` and ``step(states)``), driven by the ``multi_turn`` executor.
    """


@hookspec
def rlhf_register_reward_sources(register: Register) -> None:
    """Register reward sources.

    Each object satisfies :class:`rlhf_core.types.RewardSourceFactory`: ``accepts(cfg) -> bool`` says
    whether the reward configuration (``--reward.remote_url``, ``--reward.model_name_or_path``) is for
    it, and ``create(cfg) -> RewardSource`` builds one whose async ``score(RewardRequest)`` returns a
    :class:`rlhf_core.types.RewardResult`. ``--reward.source NAME`` picks one explicitly. An optional
    ``check(cfg)`` runs in the driver before any worker starts (and in ``--dry-run``): cheap, it starts
    nothing and raises, naming the flag or file, when the configuration cannot work.

    Built-in names: ``python_file``, ``http``, ``reward_model``, ``prm`` (a process reward model trained by
    ``rlhf train prm``; it also fills ``RewardResult.step_scores``).
    """


@hookspec
def rlhf_register_post_processors(register: Register) -> None:
    """Register post-processors for ``rlhf generate`` (:class:`rlhf_core.types.PostProcessor`), picked by
    ``--generate.post_processor``.

    Built-in names: ``rs``, ``iter_dpo``, ``csft`` (rlhf-core).
    """


# --- system seams ---------------------------------------------------------------------------------


@hookspec
def rlhf_register_placement_strategies(register: Register) -> None:
    """Register placement strategies (:class:`rlhf_core.types.PlacementStrategy`), picked by
    ``--train.colocate_*`` (or ``--train.placement NAME``). A plan is pure data: printing it (``--dry-run``)
    starts nothing.

    Built-in names: ``colocate_all``, ``colocate_actor_ref``, ``colocate_critic_reward``, ``separate``.
    """


@hookspec
def rlhf_register_rollout_engines(register: Register) -> None:
    """Register rollout engines (:class:`rlhf_core.types.RolloutEngineFactory`, building a
    :class:`rlhf_core.types.RolloutEngine`), picked by ``--rollout.engine``.

    Built-in names: ``hf`` (rlhf-core), ``vllm`` (rlhf-rollout-vllm).
    """


@hookspec
def rlhf_register_train_backends(register: Register) -> None:
    """Register training backends (:class:`rlhf_core.types.TrainBackend`), picked by ``--train.backend``.

    Built-in name: ``deepspeed`` (rlhf-train-deepspeed).
    """
