"""Tool calls on the OpenAI endpoint: agent code using the real ``openai`` client offers tools, gets
``tool_calls`` back, answers with ``role: "tool"`` messages, and the episode is still one token-exact
trajectory (``examples/agent_tool_calculator.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from rlhf_agents import OpenAIServerAgentExecutor, RolloutWorker
from rlhf_agents.loading import load_module
from rlhf_agents.openai_server import parse_tool_calls
from rlhf_core.rollout.async_engine import AsyncEngine
from rlhf_core.rollout.hf_engine import HFEngine
from rlhf_core.types import SamplingParams

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "agent_tool_calculator.py"
WARM_START = EXAMPLE.with_name("agent_tool_grpo.py")
QUESTION = "What is 37 * 12?"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 12"}}\n</tool_call>'
FINAL = "37 * 12 = 444"


def test_parse_tool_calls_reads_hermes_blocks_and_leaves_the_rest_as_content():
    text = 'Let me compute.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>[{"name": "g", "arguments": "{}"}]</tool_call>'
    content, calls = parse_tool_calls(text, "call_a")
    assert content == "Let me compute."
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("call_a_0", "f", {"x": 1}),
        ("call_a_1", "g", {}),
    ]
    assert all(c["type"] == "function" for c in calls)
    # a block that is not a call stays text; a reply without blocks is unchanged
    bad = '<tool_call>{not json}</tool_call> and <tool_call>{"arguments": {}}</tool_call>'
    assert parse_tool_calls(bad, "c") == (bad, [])
    assert parse_tool_calls("just text", "c") == ("just text", [])
    assert parse_tool_calls('<tool_call>{"name": "f"}</tool_call>', "c")[0] is None  # nothing but the call


@pytest.fixture(scope="module")
def tool_policy(tmp_path_factory, smollm2):
    """A tiny Llama with SmolLM2's tokenizer and chat template whose replies to ``QUESTION`` are the calculator
    call and then, after the tool's result, ``FINAL`` (``examples/agent_tool_grpo.py``'s warm start)."""
    path = tmp_path_factory.mktemp("tool_policy")
    model, tok, (ids,) = load_module(str(WARM_START), "agent_tool_grpo").warm_start(
        path, [(37, 12)], guessed=[]
    )
    assert tok.decode(ids).endswith(
        CALL + "<|im_end|>\n<|im_start|>tool\n444<|im_end|>\n<|im_start|>assistant\n" + FINAL + "<|im_end|>"
    )
    return path, model, tok, ids


@pytest.mark.real_model
def test_the_openai_client_calls_a_tool_and_the_episode_stays_token_exact(
    tool_policy, cfg_factory, check_tokens
):
    path, model, tok, ids = tool_policy
    engine = AsyncEngine(HFEngine(str(path), dtype="float32"))
    cfg = cfg_factory(train={"agent_func_path": str(EXAMPLE)}, data={"max_len": 256})
    worker = RolloutWorker.from_config(cfg, engine, tok)
    (traj,) = worker.rollout(
        [{"prompt_text": QUESTION, "label": "444", "prompt_uid": 0}],
        SamplingParams(n=1, max_new_tokens=48, temperature=0.0),
        step=0,
    )
    worker.close()

    assert traj.error is None, traj.error
    assert traj.reward == 1.0 and traj.extra_logs["tool_calls"] == 1.0 and traj.extra_logs["num_turns"] == 2.0
    # the prompt carries the tools (this template ignores them, so the endpoint's Hermes block does), and
    # the episode is the whole conversation: call, the tool's answer as feedback, final reply
    assert traj.prompt_ids + traj.response_ids == ids
    mask = traj.action_mask
    feedback = [k for k in range(len(mask)) if mask[k] == 0]
    assert (
        tok.decode([traj.response_ids[k] for k in feedback])
        == "\n<|im_start|>tool\n444<|im_end|>\n<|im_start|>assistant\n"
    )
    check_tokens(traj, model)
    assert (
        worker.last_metrics.get("error/prefix_violation", 0.0) == 0.0 and not traj.segments
    )  # one trajectory


class ForcedStreamingCall(OpenAIServerAgentExecutor):
    """Streams a call forced by a named ``tool_choice`` with the ``openai`` client, assembles the call from its
    deltas, answers it, and reads the final reply."""

    async def run_agent(self, base_url, prompt, label):
        calculator = load_module(str(EXAMPLE), "agent_tool_calculator")
        messages = [{"role": "user", "content": prompt}]
        async with openai.AsyncOpenAI(base_url=base_url, api_key="none") as client:
            stream = await client.chat.completions.create(
                model="policy",
                messages=messages,
                tools=calculator.TOOLS,
                tool_choice={"type": "function", "function": {"name": "calculator"}},
                stream=True,
            )
            self.chunks = [c async for c in stream]
            calls = [d for c in self.chunks for d in c.choices[0].delta.tool_calls or []]
            call = {"id": calls[0].id, "type": "function", "function": calls[0].function.model_dump()}
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "444"})
            reply = await client.chat.completions.create(
                model="policy", messages=messages, tools=calculator.TOOLS
            )
            self.final = reply.choices[0].message.content
        return 1.0


@pytest.mark.real_model
def test_a_named_tool_choice_is_written_as_the_call_opening_and_streamed_as_a_call(
    tool_policy, cfg_factory, check_tokens
):
    path, model, tok, ids = tool_policy
    engine = AsyncEngine(HFEngine(str(path), dtype="float32"))
    agent = ForcedStreamingCall()
    worker = RolloutWorker(engine, tok, agent, None, cfg_factory(data={"max_len": 256}))
    (traj,) = worker.rollout(
        [{"prompt_text": QUESTION, "prompt_uid": 0}],
        SamplingParams(max_new_tokens=48, temperature=0.0),
        step=0,
    )
    worker.close()
    assert traj.error is None, traj.error
    deltas = [c.choices[0] for c in agent.chunks if c.choices]
    (call,) = [d for c in deltas for d in c.delta.tool_calls or []]
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {
        "expression": "37 * 12"
    }
    assert deltas[-1].finish_reason == "tool_calls" and agent.final == FINAL
    # the opening the endpoint wrote is input (the prompt's end, not the policy's tokens); the model wrote the
    # rest of the call, and the episode is still the one conversation the warm start memorised
    assert tok.decode(traj.prompt_ids).endswith('<tool_call>\n{"name": "calculator", "arguments":')
    assert traj.prompt_ids + traj.response_ids == ids and not traj.segments
    check_tokens(traj, model)


class ResponsesAgent(OpenAIServerAgentExecutor):
    """The calculator conversation over the Responses API with the ``openai`` client: the first call streamed,
    the second sent the first's output items and the tool's answer."""

    async def run_agent(self, base_url, prompt, label):
        function = load_module(str(EXAMPLE), "agent_tool_calculator").TOOLS[0]["function"]
        tools = [{"type": "function", **function}]
        async with openai.AsyncOpenAI(base_url=base_url, api_key="none") as client:
            stream = await client.responses.create(model="policy", input=prompt, tools=tools, stream=True)
            self.events = [e async for e in stream]
            first = self.events[-1].response
            (call,) = [item for item in first.output if item.type == "function_call"]
            self.call = (call.name, json.loads(call.arguments))
            items = [{"role": "user", "content": prompt}, call.model_dump(exclude_none=True)]
            items.append({"type": "function_call_output", "call_id": call.call_id, "output": "444"})
            second = await client.responses.create(model="policy", input=items, tools=tools)
            self.final = second.output_text
        return 1.0


@pytest.mark.real_model
def test_the_responses_api_streams_a_function_call_and_the_episode_stays_token_exact(
    tool_policy, cfg_factory, check_tokens
):
    path, model, tok, ids = tool_policy
    agent = ResponsesAgent()
    worker = RolloutWorker(
        AsyncEngine(HFEngine(str(path), dtype="float32")),
        tok,
        agent,
        None,
        cfg_factory(data={"max_len": 256}),
    )
    (traj,) = worker.rollout(
        [{"prompt_text": QUESTION, "prompt_uid": 0}],
        SamplingParams(max_new_tokens=48, temperature=0.0),
        step=0,
    )
    worker.close()
    assert traj.error is None, traj.error
    kinds = [e.type for e in agent.events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds
    assert agent.call == ("calculator", {"expression": "37 * 12"}) and agent.final == FINAL
    assert (
        traj.prompt_ids + traj.response_ids == ids and not traj.segments
    )  # the same conversation, one trace
    check_tokens(traj, model)
