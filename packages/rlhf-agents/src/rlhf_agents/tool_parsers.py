"""Tool-call parsers: each model family writes its calls in its own text format, and the OpenAI endpoint turns a
reply in that format back into ``tool_calls``. A parser is a class registered under
``rlhf_register_tool_parsers`` (``--train.tool_parser NAME``; by default the chat template picks one) with:

- ``markers``: strings whose presence in a chat template means the family's format (all of them must appear);
- ``parse(text) -> (content, [(name, arguments_json)])``: the reply's calls and the text outside them (the text
  unchanged when there is no call; a call that does not parse stays text, as a user would read it);
- ``opening(name) -> str``: the text that starts a call (to ``name``, or to any function when None), which the
  endpoint writes at the start of the reply for ``tool_choice`` "required" or a named function.

They work on the reply's text with special tokens kept; docs/tool-use.md says why these are our own short
parsers rather than vLLM's or another package's."""

from __future__ import annotations

import json
import re
from typing import Any

Calls = list[tuple[str, str]]


def _call(obj: Any, args_key: str = "arguments") -> tuple[str, str] | None:
    """``(name, arguments as a JSON string)`` from ``{"name": ..., args_key: {...}}``, else None."""
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
        return None
    arguments = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _value(text: str) -> Any:
    """A parameter written as plain text (Qwen3-Coder, GLM): JSON when it reads as JSON, else the string."""
    parsed = _json(text)
    return text if parsed is None else parsed


def _blocks(text: str, pattern: re.Pattern, read: Any) -> tuple[str, Calls]:
    """Calls from every ``pattern`` match that ``read(match)`` turns into a list of calls (None: not a call,
    the block stays text); the content is the text outside the calls, stripped."""
    calls: Calls = []
    kept, end = [], 0
    for match in pattern.finditer(text):
        found = read(match)
        if not found:
            continue
        kept.append(text[end : match.start()])
        end = match.end()
        calls += found
    return (("".join(kept) + text[end:]).strip() if calls else text), calls


class Hermes:
    """Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (a JSON list inside
    one block also counts)."""

    markers = ("<tool_call>",)
    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    @staticmethod
    def read(match: re.Match) -> Calls | None:
        parsed = _json(match.group(1))
        items = [_call(c) for c in (parsed if isinstance(parsed, list) else [parsed])]
        return items if items and all(items) else None

    @classmethod
    def parse(cls, text: str) -> tuple[str, Calls]:
        return _blocks(text, cls.BLOCK, cls.read)

    @staticmethod
    def opening(name: str | None) -> str:
        return "<tool_call>\n" + ("" if name is None else f'{{"name": {json.dumps(name)}, "arguments":')


class Llama3Json:
    """Llama 3.1-3.3 with custom tools: the whole reply is ``{"name": ..., "parameters": {...}}`` (several joined
    by ``;``), bare or after ``<|python_tag|>``."""

    markers = ("<|python_tag|>",)

    @staticmethod
    def parse(text: str) -> tuple[str, Calls]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        calls = [_call(_json(part), "parameters") for part in body.split(";")] if body.startswith("{") else []
        return ("", calls) if calls and all(calls) else (text, [])

    @staticmethod
    def opening(name: str | None) -> str:
        return '{"name": ' + ("" if name is None else f'{json.dumps(name)}, "parameters":')


class Mistral:
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (tokenizer v3), or
    ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11 and later); the text before the first ``[TOOL_CALLS]`` is
    the content."""

    markers = ("[TOOL_CALLS]",)

    @staticmethod
    def parse(text: str) -> tuple[str, Calls]:
        if "[TOOL_CALLS]" not in text:
            return text, []
        content, *parts = text.split("[TOOL_CALLS]")
        calls: list[Any] = []
        for part in parts:
            if "[ARGS]" in part:
                name, _, args = part.partition("[ARGS]")
                calls.append((name.strip(), args.strip()) if _json(args) is not None else None)
            else:
                parsed = _json(part.strip())
                calls += [_call(c) for c in (parsed if isinstance(parsed, list) else [parsed])]
        return (content.strip(), calls) if calls and all(calls) else (text, [])

    @staticmethod
    def opening(name: str | None) -> str:
        return "[TOOL_CALLS]" + ("" if name is None else f' [{{"name": {json.dumps(name)}, "arguments":')


class DeepSeekV3:
    """DeepSeek V3 (``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``)
    and V3.1 (``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``), inside
    ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>``."""

    markers = ("<｜tool▁calls▁begin｜>",)
    BLOCK = re.compile(r"<｜tool▁calls▁begin｜>(.*?)(?:<｜tool▁calls▁end｜>|$)", re.DOTALL)
    CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
    V3_ARGS = re.compile(r"(.*?)\n```(?:json)?\n(.*?)\n```", re.DOTALL)

    @classmethod
    def read(cls, match: re.Match) -> Calls | None:
        calls: list[Any] = []
        for head, rest in cls.CALL.findall(match.group(1)):
            if head.strip() == "function" and (v3 := cls.V3_ARGS.fullmatch(rest.strip())):
                head, rest = v3.groups()
            calls.append((head.strip(), rest.strip()) if _json(rest) is not None else None)
        return calls if calls and all(calls) else None

    @classmethod
    def parse(cls, text: str) -> tuple[str, Calls]:
        return _blocks(text, cls.BLOCK, cls.read)

    @staticmethod
    def opening(name: str | None) -> str:
        return "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>" + (
            "" if name is None else f"{name}<｜tool▁sep｜>"
        )


class _KeyValueCalls:
    """The XML-ish formats: ``BLOCK`` matches one call (group 1 the name, group 2 its arguments) and ``ARG``
    each key and value in it; a value is JSON when it reads as JSON, else a string."""

    BLOCK: re.Pattern
    ARG: re.Pattern

    @classmethod
    def read(cls, match: re.Match) -> Calls:
        args = {key.strip(): _value(value) for key, value in cls.ARG.findall(match.group(2))}
        return [(match.group(1).strip(), json.dumps(args))]

    @classmethod
    def parse(cls, text: str) -> tuple[str, Calls]:
        return _blocks(text, cls.BLOCK, cls.read)


class Qwen3Coder(_KeyValueCalls):
    """Qwen3-Coder's XML: ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>...
    </function>\\n</tool_call>``; a value is JSON when it reads as JSON, else a string."""

    markers = ("<tool_call>", "<function=", "<parameter=")
    BLOCK = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
    ARG = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    @staticmethod
    def opening(name: str | None) -> str:
        return "<tool_call>\n<function=" + ("" if name is None else f"{name}>\n")


class Glm45(_KeyValueCalls):
    """GLM-4.5 / 4.6: ``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>...</tool_call>``;
    a value is JSON when it reads as JSON, else a string."""

    markers = ("<tool_call>", "<arg_key>")
    BLOCK = re.compile(r"<tool_call>([^<\n]+)(.*?)</tool_call>", re.DOTALL)
    ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    @staticmethod
    def opening(name: str | None) -> str:
        return "<tool_call>" + ("" if name is None else f"{name}\n")


class Harmony:
    """gpt-oss (the harmony format): a call is a ``commentary`` message addressed ``to=functions.NAME`` whose
    body is the JSON arguments; the content is the ``final`` channel's message (the ``analysis`` channel is
    reasoning, split off before parsing)."""

    markers = ("<|channel|>",)
    CALL = re.compile(
        r"(?:<\|start\|>assistant)?<\|channel\|>commentary to=functions\.([^\s<]+)[^<]*(?:<\|constrain\|>\w+)?"
        r"<\|message\|>(.*?)(?:<\|call\|>|<\|end\|>|$)",
        re.DOTALL,
    )
    FINAL = re.compile(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|return\|>|<\|end\|>|$)", re.DOTALL)

    @classmethod
    def parse(cls, text: str) -> tuple[str, Calls]:
        calls = [(n, a.strip()) for n, a in cls.CALL.findall(text) if _json(a) is not None]
        final = cls.FINAL.search(text)
        if not calls:
            return (final.group(1) if final else text), []
        return (final.group(1) if final else ""), calls

    @staticmethod
    def opening(name: str | None) -> str:
        return "<|channel|>commentary to=functions." + (
            "" if name is None else f"{name} <|constrain|>json<|message|>"
        )


# Checked in this order when the chat template picks the parser: more specific markers first.
BUILTIN = {
    "harmony": Harmony,
    "qwen3_coder": Qwen3Coder,
    "glm45": Glm45,
    "deepseek_v3": DeepSeekV3,
    "mistral": Mistral,
    "llama3_json": Llama3Json,
    "hermes": Hermes,
}


def parser_for_template(parsers: dict[str, Any], template: str | None) -> str:
    """The name of the first parser whose markers all appear in ``template`` (builtins in ``BUILTIN``'s order,
    then plugins'), else ``hermes``: the format the endpoint describes to a template that ignores tools."""
    names = [n for n in BUILTIN if n in parsers] + [n for n in parsers if n not in BUILTIN]
    return next((n for n in names if template and all(m in template for m in parsers[n].markers)), "hermes")


THINK_END = "</think>"
HARMONY_ANALYSIS = re.compile(
    r"<\|channel\|>analysis<\|message\|>(.*?)<\|end\|>(?:<\|start\|>assistant)?", re.DOTALL
)


def split_reasoning(text: str, template: str | None) -> tuple[str | None, str]:
    """``(reasoning, rest)`` of a reply: the text up to ``</think>`` (its ``<think>`` dropped) when the chat
    template has thinking (its generation prompt may already hold ``<think>``), or a harmony ``analysis``
    message; ``(None, text)`` otherwise."""
    if template and THINK_END in template and THINK_END in text:
        reasoning, _, rest = text.partition(THINK_END)
        return reasoning.strip().removeprefix("<think>").strip(), rest.lstrip()
    if template and "<|channel|>" in template and (match := HARMONY_ANALYSIS.search(text)):
        return match.group(1), text[: match.start()] + text[match.end() :]
    return None, text
