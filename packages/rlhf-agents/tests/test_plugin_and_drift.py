"""Registration through the entry point, building from the config, and the re-tokenization drift check."""

from __future__ import annotations

import logging

import pytest

from rlhf_agents import (
    HttpRewardSource,
    MultiTurnAgentExecutor,
    OpenAIServerAgentExecutor,
    PythonFileRewardSource,
    RolloutWorker,
    SingleTurnAgentExecutor,
    build_executor,
    build_reward_source,
    retokenization_drift,
)
from rlhf_agents.executors import AgentExecutorBase
from rlhf_core.plugins import collect, get_plugin_manager
from rlhf_core.types import SamplingParams, Trajectory


def test_builtins_register_through_the_entry_point():
    pm = get_plugin_manager()
    executors = collect(pm, "agent_executors")
    assert {n: r.obj for n, r in executors.items() if r.distribution == "rlhf-agents"} == {
        "single_turn": SingleTurnAgentExecutor,
        "multi_turn": MultiTurnAgentExecutor,
        "openai_server": OpenAIServerAgentExecutor,
    }
    sources = collect(pm, "reward_sources")
    assert {"python_file", "http", "reward_model"} <= set(sources)
    assert sources["http"].distribution == "rlhf-agents"


def test_executor_and_reward_source_from_the_config(tmp_path, cfg_factory):
    executor = build_executor(cfg_factory(train={"env_step_timeout": 7.0}))
    assert isinstance(executor, SingleTurnAgentExecutor) and executor.env_step_timeout == 7.0
    with pytest.raises(ValueError, match="multi_turn needs --train.env NAME"):
        build_executor(cfg_factory(train={"agent_executor": "multi_turn"}))
    assert build_reward_source(cfg_factory()) is None

    reward = tmp_path / "r.py"
    reward.write_text("def reward_func(q, p, l):\n    return [0.0] * len(q)\n")
    assert isinstance(
        build_reward_source(cfg_factory(reward={"remote_url": str(reward)})), PythonFileRewardSource
    )
    explicit = build_reward_source(
        cfg_factory(reward={"remote_url": "http://127.0.0.1:9/r", "source": "http"})
    )
    assert isinstance(explicit, HttpRewardSource)
    with pytest.raises(Exception, match="no reward source accepts 'reward.txt'"):
        build_reward_source(cfg_factory(reward={"remote_url": "reward.txt"}))


def test_no_reward_source_for_single_turn_is_a_clear_error(async_engine, tokenizer, cfg_factory):
    worker = RolloutWorker.from_config(cfg_factory(), async_engine, tokenizer)
    with pytest.raises(ValueError, match="no reward source is configured: set --reward.remote_url"):
        worker.rollout([{"prompt_text": "w1", "prompt_uid": 0}], SamplingParams(max_new_tokens=2), step=0)
    with pytest.raises(ValueError, match="prompt row 1 has neither 'prompt_text' nor 'prompt_ids'"):
        worker.rollout([{"prompt_text": "w1"}, {"text": "w2"}], SamplingParams(max_new_tokens=2), step=0)
    worker.close()


def fused_tokenizer():
    """A BPE tokenizer whose decoder glues tokens together: ``a`` + ``b`` decodes to "ab", which encodes
    to the merged token ``ab``. This is how multi-turn text drifts in real tokenizers."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4, "c": 5}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], unk_token="<pad>"))
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>")


def test_drift_is_found_where_it_starts():
    tok = fused_tokenizer()
    assert tok.encode("ab", add_special_tokens=False) == [4]
    assert retokenization_drift(tok, [5, 4, 5]) is None
    assert retokenization_drift(tok, [5, 2, 3, 5]) == 1


class ScriptedExecutor(AgentExecutorBase):
    """Ends every episode with a model token ``a`` followed by feedback ``b``: text "ab" drifts to [ab]."""

    async def execute(
        self,
        prompt,
        label,
        sampling_params,
        max_length,
        hf_tokenizer,
        llm_engine,
        images=None,
        *,
        prompt_ids=None,
    ):
        return Trajectory(
            prompt_ids=list(prompt_ids),
            response_ids=[2, 3],
            action_mask=[1, 0],
            rollout_logprobs=[-1.0, 0.0],
            reward=1.0,
        )


def test_worker_reports_drift_once_and_counts_it(cfg_factory, caplog):
    class NoEngine:
        async def generate(self, request):
            raise AssertionError("not used")

    cfg = cfg_factory(train={"check_retokenization": True})
    worker = RolloutWorker(NoEngine(), fused_tokenizer(), ScriptedExecutor(), None, cfg)
    with caplog.at_level(logging.WARNING):
        trajs = worker.rollout([{"prompt_ids": [5], "prompt_uid": 0}], SamplingParams(n=3), step=0)
    worker.close()
    assert worker.last_metrics["tokenize/drift_samples"] == 3.0
    assert all(t.extra_logs["tokenize/drift"] == 1.0 for t in trajs)
    warnings = [r.getMessage() for r in caplog.records if "re-tokenizing" in r.getMessage()]
    assert len(warnings) == 1 and "from position 1" in warnings[0]
