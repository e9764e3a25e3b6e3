"""Tool-call parsers, one per model family: each family's chat template (the tool-call part of the model's
published template, written here since no tokenizer can be had offline) renders an assistant turn with tool
calls, and the family's parser, picked from the template, reads the same calls back out of that text; then a
tiny policy that memorised each family's call round-trips it through the endpoint, and a thinking template's
reply comes back as `reasoning_content`."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from rlhf_agents import OpenAIServerAgentExecutor, RolloutWorker
from rlhf_agents.openai_server import pick_tool_parser
from rlhf_agents.tool_parsers import BUILTIN, Harmony, parser_for_template, split_reasoning
from rlhf_core import hookimpl
from rlhf_core.plugins import collect, get_plugin_manager
from rlhf_core.rollout.async_engine import AsyncEngine
from rlhf_core.rollout.hf_engine import HFEngine
from rlhf_core.types import SamplingParams

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Oslo", "days": 1})]

# Each template: system/tools, user turns, and assistant turns with ``tool_calls`` written as the family writes
# them (arguments as a mapping); ``END`` is the family's end-of-call token, which the engine's stop token is.
FAMILIES = {
    "hermes": (  # Qwen2.5 / Hermes 2 Pro
        "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
        "</tools>\nFor each function call, return a json object within <tool_call></tool_call> XML tags<|im_end|>\n"
        "{%- endif %}{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
        '{%- for c in m.tool_calls %}\n<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
        "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n{%- else %}<|im_start|>"
        "{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}",
        "<|im_end|>",
    ),
    "llama3_json": (  # Llama 3.1 / 3.2 / 3.3, custom tools in the user turn
        "<|begin_of_text|>{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}"
        "<|start_header_id|>assistant<|end_header_id|>\n\n{%- for c in m.tool_calls %}"
        '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
        "{%- if not loop.last %}; {% endif %}{%- endfor %}<|eot_id|>{%- else %}<|start_header_id|>{{ m.role }}"
        "<|end_header_id|>\n\n{%- if tools and m.role == 'user' %}Given the following functions, respond with a "
        'JSON for a function call with its proper arguments.\nRespond in the format {"name": function name, '
        '"parameters": dictionary of argument name and its value}.\n{% for t in tools %}{{ t | tojson }}\n'
        "{% endfor %}{%- endif %}{{ m.content }}<|eot_id|>{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
        "{# <|python_tag|> opens built-in tool calls #}",
        "<|eot_id|>",
    ),
    "mistral": (  # Mistral 7B v0.3 / Nemo (tokenizer v3)
        "<s>{%- for m in messages %}{%- if m.role == 'user' %}{%- if tools and loop.first %}[AVAILABLE_TOOLS] "
        "{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}[INST] {{ m.content }}[/INST]{%- elif m.tool_calls %}"
        '[TOOL_CALLS] [{%- for c in m.tool_calls %}{"name": "{{ c.function.name }}", "arguments": '
        "{{ c.function.arguments | tojson }}}{%- if not loop.last %}, {% endif %}{%- endfor %}]</s>{%- else %}"
        "{{ m.content }}</s>{%- endif %}{%- endfor %}",
        "</s>",
    ),
    "deepseek_v3": (  # DeepSeek V3.1
        "<｜begin▁of▁sentence｜>{%- if tools %}## Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{%- endif %}"
        "{%- for m in messages %}{%- if m.role == 'user' %}<｜User｜>{{ m.content }}{%- elif m.tool_calls %}"
        "<｜Assistant｜></think><｜tool▁calls▁begin｜>{%- for c in m.tool_calls %}<｜tool▁call▁begin｜>"
        "{{ c.function.name }}<｜tool▁sep｜>{{ c.function.arguments | tojson }}<｜tool▁call▁end｜>{%- endfor %}"
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>{%- else %}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>"
        "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<｜Assistant｜></think>{%- endif %}",
        "<｜end▁of▁sentence｜>",
    ),
    "qwen3_coder": (  # Qwen3-Coder
        "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n<function>\n<name>"
        "{{ t.function.name }}</name>\n</function>{% endfor %}\n</tools>\n<tool_call>\n<function=example>\n"
        "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "{%- endif %}{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>"
        "assistant\n{%- for c in m.tool_calls %}{{ '\\n<tool_call>\\n<function=' ~ c.function.name ~ '>' }}"
        "{%- for k, v in c.function.arguments.items() %}{{ '\\n<parameter=' ~ k ~ '>\\n' ~ v ~ '\\n</parameter>' }}"
        "{%- endfor %}{{ '\\n</function>\\n</tool_call>' }}{%- endfor %}<|im_end|>\n{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "<|im_end|>\n{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}",
        "<|im_end|>",
    ),
    "glm45": (  # GLM-4.5 / 4.6
        "[gMASK]<sop>{%- if tools %}<|system|>\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
        "\n</tools>\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}"
        "</arg_value>\n</tool_call>{%- endif %}{%- for m in messages %}{%- if m.role == 'assistant' and "
        "m.tool_calls %}<|assistant|>\n<think></think>{%- for c in m.tool_calls %}{{ '\\n<tool_call>' ~ c.function.name }}"
        "{%- for k, v in c.function.arguments.items() %}{{ '\\n<arg_key>' ~ k ~ '</arg_key>\\n<arg_value>' ~ v ~ "
        "'</arg_value>' }}{%- endfor %}{{ '\\n</tool_call>' }}{%- endfor %}{%- else %}<|{{ m.role }}|>\n"
        "{{ m.content }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|assistant|>\n{%- endif %}",
        "<|user|>",
    ),
    "harmony": (  # gpt-oss
        "<|start|>system<|message|>Reasoning: medium<|end|>{%- if tools %}<|start|>developer<|message|># Tools\n"
        "namespace functions {\n{%- for t in tools %}type {{ t.function.name }} = (_: any) => any;\n{%- endfor %}"
        "} // namespace functions<|end|>{%- endif %}{%- for m in messages %}{%- if m.role == 'assistant' and "
        "m.tool_calls %}{%- for c in m.tool_calls %}<|start|>assistant<|channel|>commentary to=functions."
        "{{ c.function.name }} <|constrain|>json<|message|>{{ c.function.arguments | tojson }}<|call|>"
        "{%- endfor %}{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}",
        "<|call|>",
    ),
}


def assistant_calls(calls):
    return {
        "role": "assistant",
        "tool_calls": [
            {"id": f"c{k}", "type": "function", "function": {"name": n, "arguments": a}}
            for k, (n, a) in enumerate(calls)
        ],
    }


def rendered_reply(tok, template, calls):
    """What the model writes for ``calls`` under ``template``: the rendered turn after the generation prompt,
    without its end-of-call token."""
    user = [{"role": "user", "content": "Weather in Paris and Oslo?"}]
    prompt = tok.apply_chat_template(
        user, tools=TOOLS, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    full = tok.apply_chat_template(
        user + [assistant_calls(calls)], tools=TOOLS, chat_template=template, tokenize=False
    )
    assert full.startswith(prompt)
    return prompt, full[len(prompt) :]


@pytest.fixture(scope="module")
def smol_tok(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_template_picks_its_parser_which_reads_the_rendered_calls_back(smol_tok, family):
    template, end = FAMILIES[family]
    assert parser_for_template(BUILTIN, template) == family
    parser = BUILTIN[family]
    # harmony writes one message per call; the others may hold several calls in one reply
    calls = CALLS[:1] if family in ("harmony",) else CALLS
    _, reply = rendered_reply(smol_tok, template, calls)
    reply = reply.removesuffix(end)
    _, rest = split_reasoning(reply, template)  # GLM writes an empty <think></think> first
    content, parsed = parser.parse(rest)
    assert [(n, json.loads(a)) for n, a in parsed] == calls, reply
    assert not content.strip(), content
    assert parser.parse("no call here") == ("no call here", [])
    # the opening of a named call is how the template starts that call
    assert parser.opening("get_weather") in reply and rest.lstrip().startswith(parser.opening(None).strip())


def test_parsers_keep_text_around_calls_and_leave_malformed_calls_as_text():
    hermes = BUILTIN["hermes"]
    assert hermes.parse('Sure.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>') == (
        "Sure.",
        [("f", "{}")],
    )
    assert hermes.parse("<tool_call>{oops}</tool_call>")[1] == []
    assert BUILTIN["llama3_json"].parse('<|python_tag|>{"name": "f", "parameters": {"x": 1}}') == (
        "",
        [("f", '{"x": 1}')],
    )
    assert BUILTIN["llama3_json"].parse('{"name": 3}')[1] == []
    mistral = BUILTIN["mistral"]
    assert mistral.parse('Let me look.[TOOL_CALLS]f[ARGS]{"x": 1}') == ("Let me look.", [("f", '{"x": 1}')])
    v3 = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"x": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    assert BUILTIN["deepseek_v3"].parse(v3) == ("", [("f", '{"x": 1}')])
    assert BUILTIN["qwen3_coder"].parse(
        "<tool_call>\n<function=f>\n<parameter=s>\nhi there\n</parameter>\n</function>\n</tool_call>"
    ) == ("", [("f", '{"s": "hi there"}')])
    oss = '<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"x": 1}'
    reasoning, rest = split_reasoning(oss, FAMILIES["harmony"][0])
    assert reasoning == "Need weather." and Harmony.parse(rest) == ("", [("f", '{"x": 1}')])
    assert Harmony.parse("<|channel|>final<|message|>It is sunny.<|return|>") == ("It is sunny.", [])


def test_reasoning_is_split_only_for_templates_that_think():
    thinking = "{{ '<think>' }}{% for m in messages %}{{ m.content }}{% endfor %}{{ '</think>' }}"
    assert split_reasoning("<think>\nplan\n</think>\n\nanswer", thinking) == ("plan", "answer")
    assert split_reasoning("plan\n</think>answer", thinking) == ("plan", "answer")  # the prompt opened it
    assert split_reasoning("no end tag", thinking) == (None, "no end tag")
    assert split_reasoning("a</think>b", "{{ messages }}") == (None, "a</think>b")


class ThirdPartyParser:
    """A format of its own: ``CALL name {json}`` lines."""

    markers = ("CALL name",)

    @staticmethod
    def parse(text):
        calls = [tuple(line[5:].split(" ", 1)) for line in text.splitlines() if line.startswith("CALL ")]
        return ("", calls) if calls else (text, [])

    @staticmethod
    def opening(name):
        return "CALL " + (name or "")


def test_hook_rlhf_register_tool_parsers(register_plugin):
    class Plugin:
        @staticmethod
        @hookimpl
        def rlhf_register_tool_parsers(register):
            register("call_lines", ThirdPartyParser)

    register_plugin(Plugin, name="thirdparty")
    found = collect(get_plugin_manager(), "tool_parsers")
    assert {n: r.distribution for n, r in found.items() if n in BUILTIN} == dict.fromkeys(
        BUILTIN, "rlhf-agents"
    )
    assert found["call_lines"].obj is ThirdPartyParser
    assert pick_tool_parser("call_lines", None) is ThirdPartyParser  # --train.tool_parser call_lines
    assert pick_tool_parser(None, "... CALL name {args} ...") is ThirdPartyParser  # picked by the template
    assert pick_tool_parser(None, FAMILIES["glm45"][0]) is BUILTIN["glm45"]
    assert pick_tool_parser(None, "{{ messages }}") is BUILTIN["hermes"]


# Qwen3's way with thinking: the reply opens with <think>, and earlier turns are rendered without it.
THINKING = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{%- if m.role == 'assistant' %}"
    "{{ m.content.split('</think>')[-1].lstrip('\\n') }}{%- else %}{{ m.content }}{%- endif %}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    "{# <think> ... </think> #}"
)
THOUGHT, ANSWER = "The user greets me; greet back.", "Hello to you!"
USER = "Weather in Paris and Oslo?"


@pytest.fixture(scope="module")
def family_policy(tmp_path_factory, smollm2):
    """The tiny policy, saved, and one tokenizer per family (its template set): rows are what the endpoint
    renders for the first call, then the memorised reply and EOS."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("family_policy")
    toks, rows = {}, []
    for family, (template, _) in [*FAMILIES.items(), ("thinking", (THINKING, None))]:
        tok = AutoTokenizer.from_pretrained(smollm2)
        tok.chat_template = template
        toks[family] = tok
        if family == "thinking":
            prompt = tok.apply_chat_template(
                [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
            )
            reply = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
        else:
            prompt, reply = rendered_reply(tok, template, CALLS[:1])
            reply = reply.removesuffix(FAMILIES[family][1])
        first = tok.encode(prompt, add_special_tokens=False)
        rows.append((first, tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]))
    tok = toks["hermes"]
    tok.save_pretrained(str(path))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), tok.eos_token_id)
    target = torch.zeros_like(ids, dtype=torch.bool)
    for k, (p, r) in enumerate(rows):
        ids[k, : len(p) + len(r)] = torch.tensor(p + r)
        target[k, len(p) : len(p) + len(r)] = True
    predicts = target[:, 1:]
    labels = ids[:, 1:][predicts]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(1000):  # until every reply token is the model's greedy choice with room to spare
        hidden = model.model(ids).last_hidden_state[:, :-1][predicts]
        nll = torch.nn.functional.cross_entropy(model.lm_head(hidden), labels, reduction="none")
        if nll.max() < 0.02:
            break
        opt.zero_grad()
        nll.mean().backward()
        opt.step()
    else:
        raise RuntimeError("the family policy did not memorise its replies")
    model.save_pretrained(str(path))
    return path, model.eval(), toks


class CallsTheTool(OpenAIServerAgentExecutor):
    async def run_agent(self, base_url, prompt, label):
        messages = [{"role": "user", "content": prompt}]
        async with openai.AsyncOpenAI(base_url=base_url, api_key="none") as client:
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            self.first = reply.choices[0]
            calls = [c.model_dump() for c in self.first.message.tool_calls or []]
            messages += [{"role": "assistant", "content": None, "tool_calls": calls}]
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": "sunny"} for c in calls]
            await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=2)
        return 1.0


@pytest.mark.real_model
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_round_trips_a_tool_call_through_the_endpoint(
    family_policy, family, cfg_factory, check_tokens
):
    path, model, toks = family_policy
    agent = CallsTheTool()
    worker = RolloutWorker(
        AsyncEngine(HFEngine(str(path), dtype="float32")),
        toks[family],
        agent,
        None,
        cfg_factory(data={"max_len": 512}),
    )
    (t,) = worker.rollout(
        [{"prompt_text": USER, "prompt_uid": 0}], SamplingParams(max_new_tokens=160, temperature=0.0), step=0
    )
    worker.close()
    assert t.error is None, t.error
    ((name, args),) = CALLS[:1]
    (call,) = agent.first.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (name, args)
    assert agent.first.finish_reason == "tool_calls"
    check_tokens(t, model)  # each segment's (or the one trajectory's) log-probs are the model's
    for s in t.segments:
        check_tokens(s, model)
    # the call's tokens are the first action tokens of the episode, as generated
    first = t.segments[0] if t.segments else t
    assert first.action_mask[0] == 1


class Thinks(OpenAIServerAgentExecutor):
    async def run_agent(self, base_url, prompt, label):
        async with openai.AsyncOpenAI(base_url=base_url, api_key="none") as client:
            messages = [{"role": "user", "content": "Hi"}]
            reply = await client.chat.completions.create(model="policy", messages=messages)
            self.message = reply.choices[0].message
            messages += [self.message.model_dump(exclude_none=True), {"role": "user", "content": "Bye"}]
            await client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
        return 1.0


@pytest.mark.real_model
def test_a_reasoning_turn_returns_reasoning_content_and_keeps_it_in_the_tokens(
    family_policy, cfg_factory, check_tokens
):
    path, model, toks = family_policy
    agent = Thinks()
    tok = toks["thinking"]
    worker = RolloutWorker(
        AsyncEngine(HFEngine(str(path), dtype="float32")),
        tok,
        agent,
        None,
        cfg_factory(data={"max_len": 512}),
    )
    (t,) = worker.rollout(
        [{"prompt_text": "Hi", "prompt_uid": 0}], SamplingParams(max_new_tokens=40, temperature=0.0), step=0
    )
    worker.close()
    assert t.error is None, t.error
    assert agent.message.content == ANSWER
    assert agent.message.model_extra["reasoning_content"] == THOUGHT
    # the template drops the thinking from the history, so the second call does not extend the first: two
    # per-call samples, the first holding the thinking as the model wrote it
    first, second = t.segments
    assert tok.decode(first.response_ids) == f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}<|im_end|>"
    assert all(first.action_mask)
    assert THOUGHT not in tok.decode(second.prompt_ids)
    for s in t.segments:
        check_tokens(s, model)
