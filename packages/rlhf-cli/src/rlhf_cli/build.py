"""The primitives of an RL run (``rlhf_core.primitives``), built for a loop of one's own: the README's
"Python API" and ``examples/custom_grpo_loop.py``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

from rlhf_cli.api import check, parse
from rlhf_cli.rl.prompts import load_prompts
from rlhf_cli.rl.run import _optimizer_steps, build_groups
from rlhf_cli.rl.sync import WeightSync
from rlhf_core import handles
from rlhf_core.handles import Future, Handle, Joined, share
from rlhf_core.primitives import Learner, Sampler, Sync
from rlhf_core.types import GenerationRequest


class EngineSampler:
    """:class:`rlhf_core.primitives.Sampler` over a run's rollout engines (``RolloutActor`` handles): each
    engine gets a contiguous share of the requests."""

    def __init__(self, engines: list[Handle]):
        self.engines = engines

    def sample(self, requests: list[GenerationRequest]) -> Future:
        per = -(-len(requests) // len(self.engines))
        shares = [requests[i : i + per] for i in range(0, len(requests), per)]
        outputs = [engine.generate(share) for engine, share in zip(self.engines, shares)]
        return Joined(outputs, lambda parts: [samples for part in parts for samples in part])

    def load_weights(self, weights: dict) -> Future:
        return self._every("update_weights", share(weights))

    def sleep(self) -> Future:
        return self._every("sleep")

    def wake_up(self) -> Future:
        return self._every("wake_up")

    def _every(self, method: str, *args) -> Future:
        return Joined([getattr(engine, method)(*args) for engine in self.engines], lambda _: None)


class EngineSync:
    """:class:`rlhf_core.primitives.Sync` of a run's policy and sampler: ``rlhf_cli.rl.sync.WeightSync`` (the
    broadcast group, the object store, or the copy into engines hosted in the policy's ranks)."""

    def __init__(self, weight_sync: WeightSync, learner: Learner, sampler: Sampler):
        self.weight_sync, self.learner, self.sampler = handles.local(weight_sync), learner, sampler

    def __call__(self, learner: Learner, sampler: Sampler) -> Future:
        if learner is not self.learner or sampler is not self.sampler:
            raise ValueError("this sync joins the policy learner and the sampler it was built with")
        return self.weight_sync.to_engines()


class Primitives(NamedTuple):
    learner: Learner
    """The policy."""
    sampler: Sampler
    sync: Sync
    tokenizer: Any


@contextlib.contextmanager
def primitives(config: Any = None, *, reward_func: Any = None, **overrides: Any) -> Iterator[Primitives]:
    """The policy learner, the sampler over the rollout engines, their sync and the tokenizer of the run
    that ``rlhf_cli.train("ppo", config, **overrides)`` would make: the same config, checks and placement
    (the driver's process when the run fits it, else Ray, with the placement flags), the learning-rate
    schedule spanning the steps that run would take; everything is shut down on leaving the block."""
    from rlhf_core.data import load_tokenizer

    cfg, notes = parse("ppo", config, overrides, reward_func)
    asm = check("ppo", cfg, notes)
    tokenizer = load_tokenizer(cfg.actor.model_name_or_path, cfg.data)
    num_prompts = len(load_prompts(cfg, tokenizer)) if cfg.data.prompt_dataset else cfg.rollout.batch_size
    pools, own_ray, groups = {}, False, None
    if not asm.single_process:  # started as rlhf_cli.rl.run.run_rl starts it
        import ray

        from rlhf_cli.ray_launch import create_pools, init_ray, remove_pools

        own_ray = not ray.is_initialized()
        init_ray(cfg, asm.plan)
        pools = create_pools(asm.plan)
    try:
        groups = build_groups(asm, pools, _optimizer_steps(cfg, num_prompts), tokenizer.pad_token_id or 0)
        sampler = EngineSampler(groups.rollout)
        yield Primitives(
            groups.actor, sampler, EngineSync(WeightSync(cfg, groups), groups.actor, sampler), tokenizer
        )
    finally:
        if groups is not None:
            for group in (groups.actor, groups.ref, groups.critic, groups.reward):
                if group is not None:
                    group.shutdown()
            for engine in groups.rollout:  # an engine hosted in a rank ends with the rank
                handles.kill(engine)
        if not asm.single_process:
            remove_pools(pools)
            if own_ray:
                ray.shutdown()
