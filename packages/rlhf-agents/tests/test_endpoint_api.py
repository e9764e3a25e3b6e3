"""The OpenAI endpoint as clients use it: streaming, stop strings, log-probs, seeds and strict validation, with
the real ``openai`` client and with raw HTTP, each checked against the episode's token trace."""

from __future__ import annotations

import json

import aiohttp
import openai

from rlhf_agents import OpenAIServerAgentExecutor, RolloutWorker
from rlhf_agents.openai_server import cut_reply, token_pieces
from rlhf_core.types import GenerationOutput, SamplingParams


def rollout(agent, async_engine, tokenizer, cfg_factory, params, prompt="w5 w6", n=1):
    worker = RolloutWorker(
        async_engine, tokenizer, agent, None, cfg_factory(reward={"max_failure_fraction": 0.0})
    )
    trajs = worker.rollout([{"prompt_text": prompt, "prompt_uid": 0}], params, step=0)
    worker.close()
    return trajs


class StreamingClient(OpenAIServerAgentExecutor):
    """Two streamed chat calls with the ``openai`` client, asking for log-probs and usage."""

    async def run_agent(self, base_url, prompt, label):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none")
        messages = [{"role": "user", "content": prompt}]
        self.calls = []
        for _ in range(2):
            stream = await client.chat.completions.create(
                model="policy",
                messages=messages,
                stream=True,
                stream_options={"include_usage": True},
                logprobs=True,
            )
            chunks = [c async for c in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            logprobs = [
                lp.logprob
                for c in chunks
                if c.choices and c.choices[0].logprobs
                for lp in c.choices[0].logprobs.content
            ]
            self.calls.append((chunks, text, logprobs))
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "w1"}]
        await client.close()
        return 1.0


def test_streamed_chat_with_logprobs_matches_the_token_trace(
    async_engine, tokenizer, cfg_factory, check_tokens
):
    agent = StreamingClient()
    (t,) = rollout(agent, async_engine, tokenizer, cfg_factory, SamplingParams(max_new_tokens=6))
    assert t.error is None and not t.segments, t.error  # one trajectory: the streamed text re-renders exactly
    check_tokens(t)
    actions = [k for k, m in enumerate(t.action_mask) if m]
    first_len = (
        next(k for k in range(len(actions)) if k + 1 == len(actions) or actions[k + 1] != actions[k] + 1) + 1
    )
    chunks, text, logprobs = agent.calls[0]
    first = [t.response_ids[k] for k in actions[:first_len]]
    assert logprobs == [t.rollout_logprobs[k] for k in actions[:first_len]]  # one per token, the trace's
    eos = [tokenizer.eos_token_id] if first[-1] == tokenizer.eos_token_id else []
    assert text == tokenizer.decode(first[: len(first) - len(eos)])
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(first)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == len(first) - len(eos)


class RawHTTP(OpenAIServerAgentExecutor):
    """Raw HTTP: the refusals (each names its field and records nothing), a stop string that ends inside a
    token, completions log-probs and an SSE stream read by hand."""

    async def run_agent(self, base_url, prompt, label):
        user = {"role": "user", "content": prompt}
        self.refused = {}
        async with aiohttp.ClientSession() as http:
            for name, body in {
                "wizard": {
                    "messages": [
                        user,
                        {"role": "assistant", "content": "w1"},
                        {"role": "wizard", "content": "x"},
                    ]
                },
                "image": {
                    "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
                },
                "no_content": {"messages": [{"role": "user"}]},
                "n": {"messages": [user], "n": 2},
                "top_logprobs": {"messages": [user], "logprobs": True, "top_logprobs": 2},
                "json": {"messages": [user], "response_format": {"type": "json_object"}},
                "stop": {"messages": [user], "stop": [""]},
                "unknown_tool": {
                    "messages": [user],
                    "tools": [{"type": "function", "function": {"name": "f"}}],
                    "tool_choice": {"type": "function", "function": {"name": "g"}},
                },
                "tool_message": {"messages": [user, {"role": "tool", "content": "1"}]},
            }.items():
                async with http.post(f"{base_url}/chat/completions", json=body) as resp:
                    self.refused[name] = (resp.status, (await resp.json())["error"]["message"])
            # greedy: the same prompt gives the same tokens, so the second call can stop inside the third
            ids = prompt
            async with http.post(f"{base_url}/completions", json={"prompt": ids, "logprobs": 0}) as resp:
                self.full = (await resp.json())["choices"][0]
            words = self.full["text"].split(" ")
            self.stop = f"{words[1]} {words[2][:-1]}"
            body = {"prompt": ids, "stop": ["never", self.stop], "logprobs": 0, "stream": True}
            async with http.post(f"{base_url}/completions", json=body) as resp:
                self.content_type = resp.headers["Content-Type"]
                self.events = [line async for line in resp.content if line.strip()]
        return 1.0


def test_refusals_a_stop_inside_a_token_and_an_sse_stream_over_raw_http(async_engine, tokenizer, cfg_factory):
    agent = RawHTTP()
    params = SamplingParams(max_new_tokens=6, min_new_tokens=6, temperature=0.0)
    (t,) = rollout(agent, async_engine, tokenizer, cfg_factory, params)
    assert t.error is None, t.error
    refused = agent.refused
    assert all(status == 400 for status, _ in refused.values()), refused
    assert (
        refused["wizard"][1]
        == 'messages[2].role: "wizard" is not one of system, user, assistant, tool, developer'
    )
    assert refused["image"][1].startswith('messages[0].content[0]: type "image_url" is not served')
    assert refused["no_content"][1].startswith("messages[0].content: must be a string")
    assert refused["n"][1].startswith("n: only 1 is served")
    assert refused["top_logprobs"][1].startswith("top_logprobs: only 0 is served")
    assert refused["json"][1].startswith('response_format: {"type": "json_object"} is not served')
    assert refused["stop"][1].startswith("stop: must be a non-empty string")
    assert refused["unknown_tool"][1].startswith(
        'tool_choice: names function "g", which is not among the tools (f)'
    )
    assert refused["tool_message"][1] == "messages[1].tool_call_id: a tool message needs one"

    full = agent.full
    assert len(full["token_ids"]) == 6 and full["logprobs"]["tokens"] == [
        tokenizer.decode([i]) for i in full["token_ids"]
    ]
    events = [e.decode().strip() for e in agent.events]
    assert agent.content_type.startswith("text/event-stream") and events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    # the stop string ends inside the third token: that token is kept (the engine's, with its log-prob), the
    # text is cut where the stop string starts
    assert text == full["text"].split(" ")[0] + " "
    stopped = chunks[-1]["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["token_ids"] == full["token_ids"][:3]
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == full["logprobs"]["token_logprobs"][:3]
    # the second call does not extend the first (same prompt): a per-call sample of its own, 3 tokens
    (first, second) = t.segments
    assert second.response_ids == full["token_ids"][:3] and second.action_mask == [1, 1, 1]
    assert second.rollout_logprobs == full["logprobs"]["token_logprobs"][:3]


def test_cut_reply_on_a_real_tokenizer_keeps_the_token_that_completes_the_stop_string(smollm2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    ids = tok.encode("Thought: add them\nObservation: 5", add_special_tokens=False)
    out = GenerationOutput(ids, [-0.5] * len(ids), "length")
    cut, text, original = cut_reply(tok, out, ["Observ"], {})
    assert text == "Thought: add them\n" and cut.finish_reason == "stop"
    assert tok.decode(cut.token_ids) == original == "Thought: add them\nObservation"  # 'Obs' 'ervation'
    assert cut.logprobs == [-0.5] * len(cut.token_ids)
    assert cut_reply(tok, out, ["nowhere"], {}) == (out, tok.decode(ids), tok.decode(ids))


class Seeded(OpenAIServerAgentExecutor):
    seed = None

    async def run_agent(self, base_url, prompt, label):
        async with aiohttp.ClientSession() as http:
            body = {"messages": [{"role": "user", "content": prompt}], "seed": self.seed}
            async with http.post(f"{base_url}/chat/completions", json=body) as resp:
                assert resp.status == 200
        return 1.0


def test_a_request_seed_is_mixed_into_the_episode_seed(async_engine, tokenizer, cfg_factory):
    def samples(seed):
        agent = Seeded()
        agent.seed = seed
        params = SamplingParams(n=2, max_new_tokens=8, min_new_tokens=8, seed=7)
        return [t.response_ids for t in rollout(agent, async_engine, tokenizer, cfg_factory, params)]

    a, b = samples(1), samples(2)
    assert a == samples(1)  # the same seeds draw the same tokens (a resumed run repeats them)
    assert a != b and a[0] != a[1]  # the request seed matters, and a group's episodes still differ


class ResponsesText(OpenAIServerAgentExecutor):
    """The Responses API with text: instructions, a streamed reply, a second call continuing it by
    ``previous_response_id``, and its refusals."""

    async def run_agent(self, base_url, prompt, label):
        async with openai.AsyncOpenAI(base_url=base_url, api_key="none") as client:
            stream = await client.responses.create(
                model="policy", instructions="w3", input=prompt, stream=True
            )
            self.events = [e async for e in stream]
            first = self.events[-1].response
            second = await client.responses.create(model="policy", input="w1", previous_response_id=first.id)
            self.texts = (first.output_text, second.output_text)
            self.refused = []
            for bad in (
                {"text": {"format": {"type": "json_object"}}},
                {"tools": [{"type": "web_search"}]},
                {"previous_response_id": "resp_nope"},
                {"input": [{"type": "image_generation_call"}]},
            ):
                try:
                    await client.responses.create(model="policy", **{"input": prompt, **bad})
                except openai.BadRequestError as exc:
                    self.refused.append(exc.body["message"])
        return 1.0


def test_the_responses_api_streams_text_and_continues_a_previous_response(
    async_engine, tokenizer, cfg_factory, check_tokens
):
    agent = ResponsesText()
    (t,) = rollout(
        agent, async_engine, tokenizer, cfg_factory, SamplingParams(max_new_tokens=6, min_new_tokens=6)
    )
    assert t.error is None and not t.segments, t.error  # the second call extends the first: one trace
    check_tokens(t)
    kinds = [e.type for e in agent.events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    first, second = agent.texts
    assert tokenizer.decode(t.prompt_ids) == "<|system|> w3 </s> <|user|> w5 w6 </s> <|assistant|>"
    assert tokenizer.decode(t.response_ids).startswith(first) and tokenizer.decode(t.response_ids).endswith(
        second
    )
    assert [m.split(":")[0] for m in agent.refused] == [
        "text.format",
        "tools[0].type",
        "previous_response_id",
        "input[0].type",
    ]


def test_stream_pieces_are_one_per_token_and_keep_split_characters_whole(smollm2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    ids = tok.encode("Tokyo is 東京 🎉, and that is all.", add_special_tokens=False) + [tok.eos_token_id]
    text = tok.decode(ids[:-1])
    pieces = token_pieces(tok, ids, text)
    assert (
        len(pieces) == len(ids) and "".join(pieces) == text and pieces[-1] == ""
    )  # the stop token adds none
    assert "\ufffd" not in "".join(pieces) and "" in pieces[:-1]  # a split character waits for its last byte
    assert token_pieces(tok, ids, "other text") == ["other text"]
