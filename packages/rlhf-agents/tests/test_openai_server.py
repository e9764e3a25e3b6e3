"""The OpenAI-compatible executor: agent code over HTTP yields token-level trajectories."""

from __future__ import annotations

import aiohttp

from rlhf_agents import OpenAIServerAgentExecutor, RolloutWorker
from rlhf_agents.loading import load_module
from rlhf_core.types import SamplingParams


def test_openai_client_example_yields_a_token_trajectory(
    async_engine, tokenizer, cfg_factory, check_tokens, examples_dir
):
    path = str(examples_dir / "agent_openai_client.py")
    cfg = cfg_factory(train={"agent_func_path": path, "check_retokenization": True}, data={"max_len": 96})
    worker = RolloutWorker.from_config(cfg, async_engine, tokenizer)
    prompts = [
        {"prompt_text": "w5 w6 w7", "label": "3", "prompt_uid": 0},
        {"prompt_text": "w9", "label": "9", "prompt_uid": 1},
    ]
    trajs = worker.rollout(prompts, SamplingParams(n=2, max_new_tokens=8), step=0)
    worker.close()

    example = load_module(path, "test")
    for t in trajs:
        assert t.error is None, t.error
        first = [{"role": "user", "content": t.prompt_text}]
        rendered = tokenizer.apply_chat_template(first, tokenize=False, add_generation_prompt=True)
        assert t.prompt_ids == tokenizer.encode(rendered, add_special_tokens=False)
        check_tokens(t)
        mask = t.action_mask
        starts = [k for k in range(len(mask)) if mask[k] == 1 and (k == 0 or mask[k - 1] == 0)]
        assert len(starts) == 2 and starts[0] == 0  # two calls: reply, feedback (mask 0), reply
        first_reply = t.response_ids[: mask.index(0)]
        # the second call's input is the whole conversation so far, rendered again by the template
        reply_text = tokenizer.decode(
            first_reply[:-1] if first_reply[-1] == tokenizer.eos_token_id else first_reply
        )
        second = first + [
            {"role": "assistant", "content": reply_text},
            {"role": "user", "content": "check your work . what is the final answer ?"},
        ]
        rendered = tokenizer.apply_chat_template(second, tokenize=False, add_generation_prompt=True)
        second_input = tokenizer.encode(rendered, add_special_tokens=False)
        assert (t.prompt_ids + t.response_ids)[: len(second_input)] == second_input
        assert len(t.prompt_ids) + starts[1] == len(second_input)
        final_text = tokenizer.decode(t.response_ids[starts[1] :], skip_special_tokens=True)
        answer = example.last_number(final_text)
        assert t.reward == (1.0 if answer is not None and answer == float(t.label) else 0.0)
        assert t.extra_logs["num_turns"] == 2.0
    assert worker.last_metrics["tokenize/drift_samples"] == 0.0


class EditsHistory(OpenAIServerAgentExecutor):
    """Sends the first reply back changed, so the second call does not extend the first."""

    async def run_agent(self, base_url, prompt, label):
        async with aiohttp.ClientSession() as http:
            messages = [{"role": "user", "content": prompt}]
            async with http.post(f"{base_url}/chat/completions", json={"messages": messages}) as resp:
                reply = (await resp.json())["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": "w99 " + reply}, {"role": "user", "content": "w1"}]
            async with http.post(f"{base_url}/chat/completions", json={"messages": messages}) as resp:
                assert resp.status == 200
        return 1.0


def test_a_turn_that_does_not_extend_the_prefix_is_reported(async_engine, tokenizer, cfg_factory):
    """With --train.per_call_samples never (auto trains such episodes per call: test_per_call_samples.py)."""
    cfg = cfg_factory(reward={"max_failure_fraction": 1.0})
    agent = EditsHistory()
    agent.per_call_samples = "never"
    worker = RolloutWorker(async_engine, tokenizer, agent, None, cfg)
    (t,) = worker.rollout(
        [{"prompt_text": "w5 w6", "prompt_uid": 0}], SamplingParams(max_new_tokens=4), step=0
    )
    worker.close()
    assert t.reward is None
    assert t.error.startswith("prefix violation at call 2")
    assert "got 'w99 " in t.error  # what the request had where the recorded reply was expected
    assert worker.last_metrics["error/prefix_violation"] == 1.0


class TokenIdsAgent(OpenAIServerAgentExecutor):
    """Uses /v1/completions with token ids (token in, token out), and checks request validation."""

    async def run_agent(self, base_url, prompt, label):
        async with aiohttp.ClientSession() as http:
            for bad in ({"prompt": "w1", "logprobs": 2}, {"prompt": "w1", "n": 2}, {"prompt": {"x": 1}}):
                async with http.post(f"{base_url}/completions", json=bad) as resp:
                    assert resp.status == 400, bad
            ids = label["prompt_ids"]
            async with http.post(f"{base_url}/completions", json={"prompt": ids, "max_tokens": 3}) as resp:
                out = (await resp.json())["choices"][0]
            assert 1 <= len(out["token_ids"]) <= 3
            ids = ids + out["token_ids"] + label["tool_ids"]
            async with http.post(f"{base_url}/completions", json={"prompt": ids, "max_tokens": 3}) as resp:
                assert resp.status == 200
        return None  # let the reward source score it


def test_completions_with_token_ids_and_a_reward_source(
    tmp_path, async_engine, tokenizer, cfg_factory, check_tokens
):
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def reward_func(q, p, labels, response_ids):\n    return [float(len(r)) for r in response_ids]\n"
    )
    cfg = cfg_factory(reward={"remote_url": str(reward)})
    worker = RolloutWorker.from_config(cfg, async_engine, tokenizer)
    worker.executor = TokenIdsAgent()
    prompt_ids, tool_ids = [7, 8, 9], [40, 41, 42, 43]
    label = {"prompt_ids": prompt_ids, "tool_ids": tool_ids}
    (t,) = worker.rollout(
        [{"prompt_ids": prompt_ids, "label": label, "prompt_uid": 0}],
        SamplingParams(max_new_tokens=8),
        step=0,
    )
    worker.close()
    check_tokens(t)
    assert t.error is None and t.prompt_ids == prompt_ids
    first = t.action_mask.index(0)
    assert t.response_ids[first : first + 4] == tool_ids and t.action_mask[first : first + 4] == [0] * 4
    assert t.reward == float(len(t.response_ids))
