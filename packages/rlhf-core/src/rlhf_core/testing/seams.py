"""Conformance suites for environments, reward sources and placement strategies.

Subclass one and set ``name`` (and, where the suite asks, a way to build the object); every test then runs
against the plugin registered under that name, resolved through the installed entry points.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import math
from typing import Any, ClassVar

from rlhf_core.plugins import get_plugin_manager, resolve
from rlhf_core.types import (
    PlacementPlan,
    PostProcessInput,
    PostProcessOptions,
    RewardRequest,
    RewardResult,
    RoleDemand,
    ScoredSample,
)


def _run(value):
    return asyncio.run(value) if inspect.isawaitable(value) else value


async def _maybe_await(value):
    return await value if inspect.isawaitable(value) else value


class EnvironmentConformance:
    """A multi-turn environment (OpenRLHF's ``AgentInstanceBase`` API) must answer every step with the
    documented keys and types, and end an episode of unhelpful actions within ``max_turns``."""

    name: ClassVar[str]
    prompt: ClassVar[str] = "question"
    label: ClassVar[Any] = "0"
    max_turns: ClassVar[int] = 16

    def make(self) -> Any:
        cls = resolve(get_plugin_manager(), "environments", self.name)
        instance = cls.__new__(cls)
        _run(cls.__init__(instance))  # an async __init__ is allowed
        return instance

    def test_reset_gives_an_observation(self):
        out = _run(self.make().reset({"observation": self.prompt, "label": self.label}))
        assert isinstance(out, dict) and isinstance(out["observation"], str)

    def test_steps_answer_with_the_documented_keys_and_end(self):
        async def episode():
            env = self.make()
            obs = (await _maybe_await(env.reset({"observation": self.prompt, "label": self.label})))[
                "observation"
            ]
            for turn in range(self.max_turns):
                out = await _maybe_await(
                    env.step(
                        {
                            "observation_text": obs,
                            "action_text": "???",
                            "label": self.label,
                            "sampling_params": None,
                        }
                    )
                )
                assert {"rewards", "environment_feedback", "done"} <= set(out), (
                    f"turn {turn}: keys {sorted(out)}"
                )
                assert math.isfinite(float(out["rewards"]))
                assert isinstance(out["environment_feedback"], str) and isinstance(out["done"], bool)
                if out["done"]:
                    return turn + 1
                obs += "???" + out["environment_feedback"]
            return None

        turns = asyncio.run(episode())
        assert turns is not None, f"an episode of unhelpful actions did not end within {self.max_turns} turns"


class RewardSourceConformance:
    """A reward source must score a batch in order, one entry per sample, None only for unscorable ones."""

    name: ClassVar[str]

    def make_config(self, tmp_path) -> Any:
        """A config whose reward section this source accepts."""
        raise NotImplementedError

    def request(self) -> RewardRequest:
        return RewardRequest(
            queries=["1 + 1 = 2", "1 + 1 = 3", "2 + 2 = 4"],
            prompts=["1 + 1 ="] * 2 + ["2 + 2 ="],
            labels=["2", "2", "4"],
        )

    def test_accepts_its_config_and_scores_in_order(self, tmp_path):
        factory = resolve(get_plugin_manager(), "reward_sources", self.name)
        cfg = self.make_config(tmp_path)
        assert factory.accepts(cfg)
        source = factory.create(cfg)

        async def score():
            try:
                return await source.score(self.request())
            finally:
                await source.aclose()

        result = asyncio.run(score())
        assert isinstance(result, RewardResult)
        assert len(result.rewards) == len(result.scores) == 3
        assert all(r is None or math.isfinite(r) for r in result.rewards)


class PlacementStrategyConformance:
    """A placement strategy must place every role it is given, once, on pools that exist and can hold it."""

    name: ClassVar[str]

    def roles(self) -> dict[str, RoleDemand]:
        return {
            "actor": RoleDemand(2),
            "ref": RoleDemand(2),
            "critic": RoleDemand(2),
            "reward": RoleDemand(1),
            "rollout": RoleDemand(2),
        }

    def make_config(self) -> Any:
        from rlhf_core.config import RLConfig

        return RLConfig()

    def test_every_role_placed_once_on_an_existing_pool(self):
        strategy = resolve(get_plugin_manager(), "placement_strategies", self.name)
        roles = self.roles()
        for gpus in (True, False):
            plan = strategy.plan(roles, self.make_config(), gpus)
            assert isinstance(plan, PlacementPlan)
            assert sorted(g.role for g in plan.groups) == sorted(roles)
            pools = {p.name: p for p in plan.pools}
            for g in plan.groups:
                assert g.pool in pools, f"{g.role} is on pool {g.pool!r}, which the plan does not create"
                assert g.num_workers == roles[g.role].num_workers
                share = g.num_gpus_per_worker if gpus else g.num_cpus_per_worker
                most = max(b.get("GPU" if gpus else "CPU", 0) for b in pools[g.pool].bundles)
                assert 0 < share <= most * roles[g.role].gpus_per_worker
            assert plan.describe()


class PostProcessorConformance:
    """A post-processor of ``rlhf generate`` must accept its default options, return JSON-serialisable
    dict rows, leave its input alone, give the same rows for the same samples, and nothing for no samples.

    Override ``options()`` when the processor needs settings, and ``batch()`` to feed it other samples.
    """

    name: ClassVar[str]

    def options(self) -> PostProcessOptions:
        return PostProcessOptions()

    def batch(self) -> PostProcessInput:
        rewards = [[0.5, -1.0, 2.0, 2.0], [1.0, 1.0], [0.25], [3.0, -3.0, 0.0]]
        groups = [
            [
                ScoredSample(
                    input=f"prompt {p}",
                    output=f"answer {p}.{j}",
                    reward=r,
                    prompt_index=p,
                    sample_index=j,
                    label=str(p),
                )
                for j, r in enumerate(rs)
            ]
            for p, rs in enumerate(rewards)
        ]
        return PostProcessInput(groups, self.options())

    def processor(self) -> Any:
        return resolve(get_plugin_manager(), "post_processors", self.name)

    def test_accepts_its_options(self):
        self.processor().check(self.options())

    def test_rows_are_json_objects(self):
        rows = self.processor()(self.batch())
        assert isinstance(rows, list)
        for row in rows:
            assert isinstance(row, dict), f"a row is a {type(row).__name__}, not a dict"
            assert json.loads(json.dumps(row)) == row, f"row {row!r} does not survive JSON"

    def test_same_samples_same_rows_and_input_untouched(self):
        batch = self.batch()
        before = copy.deepcopy(batch)
        first = self.processor()(batch)
        assert batch == before, "the post-processor changed its input"
        assert self.processor()(copy.deepcopy(before)) == first

    def test_no_samples_no_rows(self):
        assert self.processor()(PostProcessInput([], self.options())) == []
