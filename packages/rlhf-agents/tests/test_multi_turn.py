"""Multi-turn rollouts with the HF engine: feedback tokens, masks, log-probs, drift, env failures, loading."""

from __future__ import annotations

import asyncio
import logging
import textwrap
import time

import pytest

from rlhf_agents import (
    AgentInstanceBase,
    MultiTurnAgentExecutor,
    RolloutFailureError,
    RolloutWorker,
    UserCodeError,
    build_executor,
    retokenization_drift,
)
from rlhf_agents.loading import load_module
from rlhf_core import hookimpl
from rlhf_core.plugins import PluginError
from rlhf_core.types import SamplingParams


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """``(value, start, end)`` for each maximal run of equal values in ``mask``."""
    out, start = [], 0
    for k in range(1, len(mask) + 1):
        if k == len(mask) or mask[k] != mask[start]:
            out.append((mask[start], start, k))
            start = k
    return out


def test_multistep_example_appends_feedback_tokens_verbatim(
    async_engine, tokenizer, cfg_factory, check_tokens, examples_dir
):
    path = str(examples_dir / "agent_multistep.py")
    example = load_module(path, "test")
    cfg = cfg_factory(train={"agent_func_path": path, "check_retokenization": True}, data={"max_len": 96})
    worker = RolloutWorker.from_config(cfg, async_engine, tokenizer)
    assert worker.reward_source is None  # the environment gives the rewards
    prompts = [{"prompt_text": f"w{i} w{i + 1} w{i + 2}", "label": "-1", "prompt_uid": i} for i in range(3)]
    trajs = worker.rollout(prompts, SamplingParams(n=2, max_new_tokens=5), step=0)
    worker.close()

    feedback_ids = tokenizer.encode(example.RETRY_FEEDBACK, add_special_tokens=False)
    for t in trajs:
        check_tokens(t)  # log-probs at action positions = teacher-forced forward over prompt + response
        segments = runs(t.action_mask)
        # -1 is never the last number of a reply: three wrong attempts, retry feedback after the first two
        assert [v for v, _, _ in segments] == [1, 0, 1, 0, 1]
        for value, start, end in segments:
            if value == 0:
                assert t.response_ids[start:end] == feedback_ids
            else:
                assert 1 <= end - start <= 5
        assert t.reward == 0.0 and t.score == 0.0 and t.error is None
        assert t.extra_logs == {"attempts": 3.0, "num_turns": 3.0}
        assert retokenization_drift(tokenizer, t.prompt_ids + t.response_ids) is None
    assert worker.last_metrics["tokenize/drift_samples"] == 0.0


def test_multistep_example_rewards_a_correct_answer(examples_dir):
    example = load_module(examples_dir / "agent_multistep.py", "test")
    agent = example.AgentInstance()

    async def episode():
        await agent.reset({"observation": "q", "label": "12"})
        wrong = await agent.step({"action_text": "it is 7 </s>", "label": "12", "observation_text": "q"})
        right = await agent.step({"action_text": "so 12 </s>", "label": "12", "observation_text": "q"})
        return wrong, right

    wrong, right = asyncio.run(episode())
    assert (wrong["rewards"], wrong["done"], wrong["environment_feedback"]) == (
        0.0,
        False,
        example.RETRY_FEEDBACK,
    )
    assert right["rewards"] == pytest.approx(0.9) and right["done"] and right["scores"] == 1.0


class CountingEnv(AgentInstanceBase):
    """Async __init__ (OpenRLHF cannot construct these); ends after two turns with reward 0.5 per turn."""

    async def __init__(self):
        await asyncio.sleep(0)
        self.turns = 0

    async def step(self, states, **kwargs):
        self.turns += 1
        return {
            "rewards": 0.5,
            "environment_feedback": " w40 w41",
            "done": self.turns == 2,
            "sampling_params": {"max_new_tokens": 2},  # a dict changes fields for the next turn
        }


def test_registered_environment_with_async_init(
    register_plugin, async_engine, tokenizer, cfg_factory, check_tokens
):
    class Plugin:
        @staticmethod
        @hookimpl
        def rlhf_register_environments(register):
            register("counting", CountingEnv)

    register_plugin(Plugin, name="third-party-env")
    cfg = cfg_factory(train={"env": "counting"})
    worker = RolloutWorker.from_config(cfg, async_engine, tokenizer)
    assert isinstance(worker.executor, MultiTurnAgentExecutor)
    trajs = worker.rollout(
        [{"prompt_text": "w1 w2", "prompt_uid": 0}], SamplingParams(n=2, max_new_tokens=6), step=0
    )
    worker.close()
    for t in trajs:
        check_tokens(t)
        segments = runs(t.action_mask)
        assert [v for v, _, _ in segments] == [1, 0, 1, 0]
        assert segments[2][2] - segments[2][1] <= 2  # the second turn used the returned sampling params
        assert t.response_ids[segments[1][1] : segments[1][2]] == tokenizer.encode(
            " w40 w41", add_special_tokens=False
        )
        assert t.reward == 1.0 and t.extra_logs["num_turns"] == 2.0


def test_unknown_environment_lists_the_registered_ones(cfg_factory):
    with pytest.raises(PluginError, match="no environment named 'nope'.*--train.env"):
        build_executor(cfg_factory(train={"env": "nope"}))


ENV_FILE = """
import asyncio
from rlhf_agents import AgentInstanceBase, MultiTurnAgentExecutor

class AgentInstance(AgentInstanceBase):
    async def step(self, states, **kwargs):
        label = states["label"]
        if label == "hang":
            await asyncio.sleep(30)
        if label == "raise":
            raise ValueError("the environment broke")
        if label == "bad":
            return {"rewards": 1.0, "environment_feedback": ""}
        if label == "nan":
            return {"rewards": float("nan"), "environment_feedback": "", "done": True}
        return {"rewards": 1.0, "environment_feedback": "", "done": True}

class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


def test_failing_environments_end_only_their_own_episode(
    tmp_path, async_engine, tokenizer, cfg_factory, caplog
):
    path = tmp_path / "env.py"
    path.write_text(ENV_FILE)
    # 3 s: an "ok" step is instant, but on 2 loaded cores (load 11 seen) one exceeded a 0.5 s limit
    cfg = cfg_factory(
        train={"agent_func_path": str(path), "env_step_timeout": 3.0}, reward={"max_failure_fraction": 0.9}
    )
    worker = RolloutWorker.from_config(cfg, async_engine, tokenizer)
    labels = ["ok", "hang", "raise", "bad", "nan", "ok"]
    prompts = [{"prompt_text": "w1", "label": label, "prompt_uid": i} for i, label in enumerate(labels)]
    with caplog.at_level(logging.ERROR):
        trajs = worker.rollout(prompts, SamplingParams(n=2, max_new_tokens=3), step=0)
    worker.close()
    by_label = {t.label: t for t in trajs}
    assert by_label["ok"].reward == 1.0 and by_label["ok"].error is None
    assert "took longer than --train.env_step_timeout 3 s" in by_label["hang"].error
    assert (
        "ValueError: the environment broke" in by_label["raise"].error
        and str(path) in by_label["raise"].error
    )
    assert "without ['done']" in by_label["bad"].error and str(path) in by_label["bad"].error
    assert "reward is nan" in by_label["nan"].error
    for label in ("hang", "raise", "bad", "nan"):
        assert by_label[label].reward is None and len(by_label[label].response_ids) > 0  # tokens are kept
    m = worker.last_metrics
    assert (m["error/env_timeout"], m["error/env_error"], m["error/env_invalid"]) == (2.0, 2.0, 4.0)
    assert m["reward/unscorable"] == 8.0
    tracebacks = [
        r for r in caplog.records if "environment broke" in r.getMessage() and "Traceback" in r.getMessage()
    ]
    assert len(tracebacks) == 1  # two samples raise from the same line: one traceback


HANGING_AGENT = """
import asyncio
from rlhf_agents import AgentInstanceBase, MultiTurnAgentExecutor

class AgentInstance(AgentInstanceBase):
    async def step(self, states, **kwargs):
        return {"rewards": 1.0, "environment_feedback": "", "done": True}

class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)

    async def execute(self, prompt, label, *args, **kwargs):
        if label == "hang":  # outside any environment call: only the episode timeout ends it
            await asyncio.sleep(30)
        return await super().execute(prompt, label, *args, **kwargs)
"""


class SlowEngine:
    """The engine answering each request 3 s late: time waited for the engine is not the agent's."""

    def __init__(self, engine):
        self.engine = engine

    async def generate(self, request):
        await asyncio.sleep(3.0)
        return await self.engine.generate(request)


def test_an_agent_that_hangs_outside_its_environment_is_ended_by_the_episode_timeout(
    tmp_path, async_engine, tokenizer, cfg_factory
):
    path = tmp_path / "agent.py"
    path.write_text(HANGING_AGENT)
    # 1.5 s: the "ok" episode's own time is milliseconds, but loaded CI cores stretch it
    cfg = cfg_factory(
        train={"agent_func_path": str(path), "episode_timeout": 1.5}, reward={"max_failure_fraction": 0.5}
    )
    worker = RolloutWorker.from_config(cfg, SlowEngine(async_engine), tokenizer)
    prompts = [
        {"prompt_text": "w1", "label": label, "prompt_uid": i} for i, label in enumerate(["ok", "hang"])
    ]
    start = time.monotonic()
    trajs = worker.rollout(prompts, SamplingParams(n=2, max_new_tokens=3), step=0)
    assert time.monotonic() - start < 15  # the hanging episodes sleep 30 s
    ok, hung = trajs[0], trajs[2]
    assert ok.reward == 1.0 and ok.error is None  # it waited 3 s for the engine, over the 1.5 s limit
    assert (
        hung.reward is None
        and "longer than --train.episode_timeout 1.5 s" in hung.error
        and str(path) in hung.error
    )
    m = worker.last_metrics
    assert m["error/episode_timeout"] == 2.0 and m["reward/unscorable"] == 2.0
    worker.max_failure_fraction = 0.25  # the unscorable threshold counts them like any failure
    with pytest.raises(RolloutFailureError, match="'episode_timeout': 2"):
        worker.rollout(prompts, SamplingParams(n=2, max_new_tokens=3), step=1)
    worker.close()


def test_too_many_environment_failures_stop_the_run_naming_the_file(
    tmp_path, async_engine, tokenizer, cfg_factory
):
    path = tmp_path / "env.py"
    path.write_text(ENV_FILE)
    cfg = cfg_factory(train={"agent_func_path": str(path)}, reward={"max_failure_fraction": 0.25})
    worker = RolloutWorker.from_config(cfg, async_engine, tokenizer)
    prompts = [
        {"prompt_text": "w1", "label": label, "prompt_uid": i} for i, label in enumerate(["ok", "raise"])
    ]
    with pytest.raises(
        RolloutFailureError, match=r"step 4: 2 of 4 samples.*max_failure_fraction 0.25"
    ) as info:
        worker.rollout(prompts, SamplingParams(n=2, max_new_tokens=2), step=4)
    worker.close()
    assert f"agent file: {path}" in str(info.value) and "the environment broke" in str(info.value)


def test_agent_file_errors_name_path_and_symbol(tmp_path, cfg_factory):
    def build(text):
        path = tmp_path / f"agent_{abs(hash(text))}.py"
        path.write_text(textwrap.dedent(text))
        return build_executor(cfg_factory(train={"agent_func_path": str(path)})), path

    with pytest.raises(UserCodeError, match=r"--train.agent_func_path .*missing.py: no such file"):
        build_executor(cfg_factory(train={"agent_func_path": str(tmp_path / "missing.py")}))
    with pytest.raises(UserCodeError, match=r"defines no 'AgentExecutor'; it defines: Helper, x"):
        build("x = 1\nclass Helper: pass\n")
    with pytest.raises(
        UserCodeError, match=r"AgentExecutor is a int .*expected a subclass of rlhf_agents.AgentExecutorBase"
    ):
        build("AgentExecutor = 5\n")
    with pytest.raises(UserCodeError, match=r"importing the file raised ZeroDivisionError"):
        build("1 / 0\n")


OPENRLHF_AGENT = """
from typing import Any, Dict

import torch

from rlhf_agents import AgentInstanceBase, MultiTurnAgentExecutor  # was: from openrlhf.utils.agent import ...


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.step_idx = 0

    async def reset(self, states: dict, **kwargs) -> dict:
        self.step_idx = 0
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> Dict[str, Any]:
        self.step_idx += 1
        done = self.step_idx >= 3
        reward = torch.tensor(1.0) if done else torch.tensor(0.0)
        environment_feedback = (
            "\\n\\nHuman: [CORRECT]\\n</s>"
            if done
            else "\\n\\nHuman: [INCORRECT]\\nPlease analyze the issues and try again.\\n</s>\\n\\nAssistant: "
        )
        return {
            "rewards": reward,
            "scores": reward,
            "environment_feedback": environment_feedback,
            "done": done,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {"step": self.step_idx},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


def test_an_openrlhf_agent_file_runs_with_only_its_import_changed(
    tmp_path, async_engine, tokenizer, cfg_factory, check_tokens
):
    path = tmp_path / "agent_func.py"
    path.write_text(OPENRLHF_AGENT)
    cfg = cfg_factory(train={"agent_func_path": str(path)}, data={"max_len": 128})
    worker = RolloutWorker.from_config(cfg, async_engine, tokenizer)
    (t,) = worker.rollout(
        [{"prompt_text": "w1 w2", "prompt_uid": 0}], SamplingParams(max_new_tokens=4), step=0
    )
    worker.close()
    check_tokens(t)
    retry = tokenizer.encode(
        "\n\nHuman: [INCORRECT]\nPlease analyze the issues and try again.\n</s>\n\nAssistant: ",
        add_special_tokens=False,
    )
    final = tokenizer.encode("\n\nHuman: [CORRECT]\n</s>", add_special_tokens=False)
    segments = runs(t.action_mask)
    assert [v for v, _, _ in segments] == [1, 0, 1, 0, 1, 0]
    assert [t.response_ids[s:e] for v, s, e in segments if v == 0] == [retry, retry, final]
    assert t.reward == 1.0 and t.score == 1.0 and t.extra_logs == {"step": 3.0, "num_turns": 3.0}
