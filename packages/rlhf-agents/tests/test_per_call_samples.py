"""Per-call samples: an episode whose model calls do not extend one another (a chat template that drops earlier
assistant content) is trained as one sample per call instead of being lost."""

from __future__ import annotations

import copy
import logging

import aiohttp
import pytest

from rlhf_agents import OpenAIServerAgentExecutor, RolloutWorker
from rlhf_core.types import SamplingParams

# The tiny tokenizer's template, except that earlier assistant turns lose their content, as templates that
# drop a reasoning model's earlier thinking do: call k+1's input never extends call k's input and output.
STRIPPING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {% if m['role'] != 'assistant' %}{{ m['content'] }} {% endif %}"
    "</s> {% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


class ThreeCalls(OpenAIServerAgentExecutor):
    """Three chat calls, each reply sent back as it came with a user turn after it; records each call's
    messages and the token ids the engine returned."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, list[tuple[list, list[int]]]] = {}

    async def run_agent(self, base_url, prompt, label):
        messages = [{"role": "user", "content": prompt}]
        made = self.calls.setdefault(prompt, [])
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                async with http.post(
                    f"{base_url}/chat/completions", json={"messages": messages, "max_tokens": 3}
                ) as resp:
                    choice = (await resp.json())["choices"][0]
                made.append((list(messages), choice["token_ids"]))
                messages += [
                    {"role": "assistant", "content": choice["message"]["content"]},
                    {"role": "user", "content": "w1 w2"},
                ]
        return float(len(label))


def rollout(tokenizer, async_engine, cfg, per_call):
    executor = ThreeCalls()
    executor.per_call_samples = per_call
    worker = RolloutWorker(async_engine, tokenizer, executor, None, cfg)
    rows = [
        {"prompt_text": "w5 w6", "label": "ab", "prompt_uid": 0},
        {"prompt_text": "w7", "label": "abc", "prompt_uid": 1},
    ]
    trajs = worker.rollout(rows, SamplingParams(max_new_tokens=3), step=0)
    worker.close()
    return trajs, executor.calls, worker.last_metrics


@pytest.fixture
def stripping_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = STRIPPING_TEMPLATE
    return tok


def test_a_template_that_strips_earlier_replies_gives_one_sample_per_call(
    stripping_tokenizer, async_engine, cfg_factory, check_tokens, caplog
):
    tok = stripping_tokenizer
    cfg = cfg_factory(data={"max_len": 64}, reward={"max_failure_fraction": 1.0})

    # without per-call samples the episodes cannot be scored
    trajs, _, metrics = rollout(tok, async_engine, cfg, "never")
    assert all(t.reward is None and t.error.startswith("prefix violation at call 2") for t in trajs)
    assert metrics["error/prefix_violation"] == 2.0 and all(not t.segments for t in trajs)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlhf_agents.openai_server"):
        trajs, calls, metrics = rollout(tok, async_engine, cfg, "auto")
    assert [r.getMessage() for r in caplog.records if "one sample per call" in r.getMessage()] != []
    assert len(caplog.records) == 1  # once, not per episode
    assert metrics["reward/unscorable"] == 0.0 and metrics["per_call/samples"] == 3.0
    for t in trajs:
        assert t.error is None and t.reward == float(len(t.label))
        assert len(t.segments) == 3
        for seg, (messages, engine_ids) in zip(t.segments, calls[t.prompt_text]):
            rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            assert seg.prompt_ids == tok.encode(
                rendered, add_special_tokens=False
            )  # what the model was given
            assert seg.response_ids == engine_ids and seg.action_mask == [1] * len(
                engine_ids
            )  # what it generated
            check_tokens(seg)  # the engine's log-probs, in that call's context
        last = t.segments[-1]  # the episode's own ids: the final conversation, for a reward function
        assert (t.prompt_ids, t.response_ids) == (last.prompt_ids, last.response_ids)


def test_calls_that_extend_one_another_stay_one_trajectory_unless_asked(tokenizer, async_engine, cfg_factory):
    cfg = cfg_factory(data={"max_len": 64})
    trajs, _, _ = rollout(tokenizer, async_engine, cfg, "auto")
    assert all(t.error is None and not t.segments for t in trajs)
    whole = trajs
    trajs, calls, _ = rollout(tokenizer, async_engine, cfg, "always")
    for t, w in zip(trajs, whole):
        assert [s.response_ids for s in t.segments] == [ids for _, ids in calls[t.prompt_text]]
        # the same calls (seeded), cut at each call: the last segment is the whole episode's ids
        assert t.segments[-1].prompt_ids + t.segments[-1].response_ids == w.prompt_ids + w.response_ids
