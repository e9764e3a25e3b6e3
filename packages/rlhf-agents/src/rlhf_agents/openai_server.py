"""An OpenAI-compatible endpoint backed by the rollout engine, so that agent code written against an OpenAI
client yields token-level trajectories: each episode gets its own session URL, and every call's input and
output token ids are recorded. The package README ("Agents written against an OpenAI client", "Tool calls",
"Per-call samples") has the contract."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import socket
import time
import uuid
from typing import Any

from rlhf_agents.checks import check_reward_value, log_failure_once, numeric_logs
from rlhf_agents.executors import (
    AgentExecutorBase,
    EpisodeFailure,
    TokenTrace,
    describe_class,
    encode,
    turn_params,
)
from rlhf_agents.tool_parsers import Hermes, parser_for_template, split_reasoning
from rlhf_core.types import GenerationOutput, GenerationRequest, SamplingParams, Trajectory, derive_seed

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 16 * 1024 * 1024
PER_CALL_SAMPLES = ("auto", "always", "never")


class _BadRequest(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass
class _Session:
    """One episode's calls and their token traces."""

    tokenizer: Any
    engine: Any
    params: SamplingParams
    max_length: int
    per_call: str
    agent: str
    """The executor's class name, for the messages."""
    warned: set[str]
    """What the executor has warned about (once each)."""
    segments: list[TokenTrace] = dataclasses.field(default_factory=list)
    """The episode's token traces: one while each call extends the conversation so far, else one per run of
    calls that do (``per_call`` ``auto``) or one per call (``always``)."""
    violation: str | None = None
    truncated: bool = False
    finish: str = "stop"
    calls: int = 0
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    parser: Any = Hermes
    """The tool-call parser (``rlhf_agents.tool_parsers``)."""
    replies: dict[Any, str] = dataclasses.field(default_factory=dict)
    """The original text of each reply returned as other text (tool calls, reasoning, a stop string), by its
    first call's id, else by ``("content", its content)``."""
    responses: dict[str, list[dict]] = dataclasses.field(default_factory=dict)
    """Each ``/responses`` call's conversation (its input and its reply), by response id: what a later call's
    ``previous_response_id`` continues."""

    async def generate(self, ids: list[int], body: dict) -> tuple[GenerationOutput, str, str]:
        """Generate for one call and record it in the token traces: ``(output, text, original)``. The output
        ends at the first token that completes one of the request's ``stop`` strings (the engine's tokens and
        log-probs up to there, unchanged); ``text`` is the reply as returned (cut where the stop string
        starts), ``original`` the kept tokens' text with special tokens, which re-renders to them."""
        async with self.lock:
            room = self.max_length - len(ids)
            if room <= 0:  # the context budget is spent: answer empty, as a length stop (and record nothing)
                self.truncated, self.finish = True, "length"
                if not self.segments:
                    self.segments.append(TokenTrace(prompt_ids=list(ids)))
                return GenerationOutput([], [], "length"), "", ""
            self._record_input(ids)
            asked = body.get("max_completion_tokens") or body.get("max_tokens") or self.params.max_new_tokens
            params = turn_params(self.params, self.calls, min(asked, self.params.max_new_tokens, room))
            if (
                body.get("seed") is not None
            ):  # mixed into the episode's own seed: a group's episodes still differ
                own = "unseeded" if params.seed is None else params.seed
                params = dataclasses.replace(params, seed=derive_seed(own, "request", body["seed"]))
            (out,) = await self.engine.generate(GenerationRequest(prompt_ids=list(ids), params=params))
            out, text, original = cut_reply(self.tokenizer, out, stop_strings(body), body)
            self.calls += 1
            self.finish = out.finish_reason
            self.truncated = out.finish_reason == "length"
            if self.violation is None:
                self.segments[-1].add_action(out)
            return out, text, original

    def _record_input(self, ids: list[int]) -> None:
        """Append a call's input to the last trace when it extends it, else start a new trace (a per-call
        sample) or, with ``per_call`` ``never``, record the prefix violation."""
        if self.violation is not None:
            return
        if not self.segments:
            self.segments.append(TokenTrace(prompt_ids=list(ids)))
            return
        so_far = self.segments[-1].all_ids()
        if self.per_call != "always" and ids[: len(so_far)] == so_far:
            self.segments[-1].add_feedback(ids[len(so_far) :])
            return
        if self.per_call == "never":
            self.violation = self._violation(so_far, ids)
            return
        if self.per_call == "auto" and "per_call" not in self.warned:
            self.warned.add("per_call")
            logger.warning(
                "%s: model call %d of an episode does not extend the conversation so far (a chat template that "
                "drops earlier turns' content, or edited history), so such episodes are trained as one sample per "
                "call, all sharing the episode's reward (--train.per_call_samples auto; 'never' makes them "
                "unscorable). This is logged once.",
                self.agent,
                self.calls + 1,
            )
        self.segments.append(TokenTrace(prompt_ids=list(ids)))

    def _violation(self, so_far: list[int], ids: list[int]) -> str:
        pos = next((k for k, (a, b) in enumerate(zip(so_far, ids)) if a != b), min(len(so_far), len(ids)))
        decode = self.tokenizer.decode
        message = (
            f"prefix violation at call {self.calls + 1}: its {len(ids)} input tokens do not extend the "
            f"{len(so_far)} tokens of the conversation so far; they differ at token {pos} (expected "
            f"{decode(so_far[pos : pos + 8])!r}, got {decode(ids[pos : pos + 8])!r}). Re-rendering earlier "
            f"turns changed their tokens (chat template or re-tokenized replies): send the assistant replies "
            f"back unchanged, or call /v1/completions with token ids"
        )
        log_failure_once(logger, self.agent, message)
        return message


ROLES = ("system", "user", "assistant", "tool", "developer")


def _content_text(content: Any) -> Any:
    """OpenAI message content as a string (a list of ``{"type": "text"}`` parts is joined)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise _BadRequest(f"{field}: {message}")


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_request(body: dict) -> None:
    """The sampling fields both endpoints share, checked; what the engine cannot honour is refused naming
    the field (package README, "What the endpoint serves")."""
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(key)
        _require(value is None or (_integer(value) and value >= 1), key, "must be a positive integer")
    _require(
        body.get("n", 1) in (1, None),
        "n",
        "only 1 is served: each call is one step of this episode's single token trace (a GRPO group is made "
        "of episodes: --rollout.n_samples_per_prompt)",
    )
    _require(body.get("stream") in (None, True, False), "stream", "must be true or false")
    stream_options = body.get("stream_options")
    _require(
        stream_options is None or isinstance(stream_options, dict), "stream_options", "must be an object"
    )
    seed = body.get("seed")
    _require(seed is None or _integer(seed), "seed", "must be an integer")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    _require(
        stop is None or (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)),
        "stop",
        "must be a non-empty string or a list of them",
    )
    fmt = body.get("response_format")
    _require(
        fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"),
        "response_format",
        f"{json.dumps(fmt)} is not served: the engine has no constrained decoding (and constraining would "
        "sample off the policy's distribution); only {'type': 'text'}",
    )


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    return [stop] if isinstance(stop, str) else list(stop or [])


def cut_reply(
    tokenizer: Any, out: GenerationOutput, stops: list[str], body: dict
) -> tuple[GenerationOutput, str, str]:
    """``(output, text, original)`` of one call (see :meth:`_Session.generate`). The final stop token (EOS)
    is left out of the text; other special tokens are kept unless ``skip_special_tokens``. A stop string
    that ends inside a token keeps that whole token in the output; the text is cut where the string starts."""
    ids = list(out.token_ids)
    body_ids = ids[:-1] if out.finish_reason == "stop" and ids else ids
    skip = bool(body.get("skip_special_tokens", False))
    original = tokenizer.decode(body_ids)
    if not any(s in original for s in stops):
        return out, (tokenizer.decode(body_ids, skip_special_tokens=True) if skip else original), original
    low, high = 0, len(body_ids) - 1  # the first token whose text completes a stop string
    while low < high:
        mid = (low + high) // 2
        low, high = (
            (low, mid) if any(s in tokenizer.decode(body_ids[: mid + 1]) for s in stops) else (mid + 1, high)
        )
    kept = body_ids[: low + 1]
    out = GenerationOutput(token_ids=kept, logprobs=list(out.logprobs[: low + 1]), finish_reason="stop")
    original = tokenizer.decode(kept)
    text = tokenizer.decode(kept, skip_special_tokens=skip)
    return out, text[: min((text.find(s) for s in stops if s in text), default=len(text))], original


def check_messages(messages: Any) -> list[dict]:
    """The chat messages, checked: 400 naming the first field that is wrong."""
    _require(isinstance(messages, list) and bool(messages), "messages", "must be a non-empty list")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        _require(isinstance(m, dict), where, "must be an object")
        role = m.get("role")
        _require(role in ROLES, f"{where}.role", f"{json.dumps(role)} is not one of {', '.join(ROLES)}")
        content = m.get("content")
        calls = m.get("tool_calls")
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                _require(
                    kind == "text" and isinstance(part.get("text"), str),
                    f"{where}.content[{j}]",
                    f"type {json.dumps(kind)} is not served: only text parts ({{'type': 'text', 'text': ...}})",
                )
        else:
            _require(
                isinstance(content, str) or (content is None and role == "assistant" and calls),
                f"{where}.content",
                "must be a string or a list of text parts (null only in an assistant message with tool_calls)",
            )
        if calls is not None:
            _require(
                role == "assistant", f"{where}.tool_calls", "only an assistant message carries tool calls"
            )
            _require(
                isinstance(calls, list) and bool(calls), f"{where}.tool_calls", "must be a non-empty list"
            )
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                _require(
                    isinstance(fn, dict)
                    and isinstance(fn.get("name"), str)
                    and isinstance(call.get("id"), str),
                    f"{where}.tool_calls[{j}]",
                    "must be {'id': str, 'type': 'function', 'function': {'name': str, 'arguments': str}}",
                )
        if role == "tool":
            _require(
                isinstance(m.get("tool_call_id"), str), f"{where}.tool_call_id", "a tool message needs one"
            )
    return messages


def request_tools(body: dict) -> tuple[list | None, Any]:
    """The request's tools and ``tool_choice``: ``"none"``, ``"auto"``, ``"required"`` or a function's name.
    Required and named calls are honoured without constrained decoding: the endpoint writes the call's opening
    at the start of the reply (input tokens, not the policy's) and the model writes the rest."""
    tools = body.get("tools") or None
    if tools is not None:
        _require(isinstance(tools, list), "tools", "must be a list of tool objects")
        for k, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            _require(
                isinstance(fn, dict) and isinstance(fn.get("name"), str),
                f"tools[{k}]",
                "must be {'type': 'function', 'function': {'name': str, 'parameters': {...}}}",
            )
    choice = body.get("tool_choice", "auto" if tools else "none")
    if isinstance(choice, dict):
        name = (
            (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        )
        names = [t["function"]["name"] for t in tools or []]
        _require(
            name in names,
            "tool_choice",
            f"names function {json.dumps(name)}, which is not among the tools ({', '.join(names) or 'none given'})",
        )
        return tools, name
    _require(
        choice in ("auto", "none", "required"),
        "tool_choice",
        f"{json.dumps(choice)} is not one of 'none', 'auto', 'required' or {{'type': 'function', 'function': "
        "{'name': ...}}",
    )
    _require(choice != "required" or bool(tools), "tool_choice", "'required' needs tools")
    return tools, choice


def parse_tool_calls(text: str, call_id: str, parser: Any = Hermes) -> tuple[str | None, list[dict]]:
    """Split a reply into OpenAI ``(content, tool_calls)`` with ``parser`` (``rlhf_agents.tool_parsers``; the
    Hermes/Qwen ``<tool_call>{json}</tool_call>`` format by default): each call becomes ``{"id", "type":
    "function", "function": {"name", "arguments": <JSON string>}}``, ids ``f"{call_id}_{k}"``; the text outside
    the calls is the content (None when blank). A call that does not parse stays in the content."""
    content, calls = parser.parse(text)
    tool_calls = [
        {"id": f"{call_id}_{k}", "type": "function", "function": {"name": name, "arguments": arguments}}
        for k, (name, arguments) in enumerate(calls)
    ]
    return (content.strip() if calls else content) or None, tool_calls


def hermes_tools_block(tools: list) -> str:
    """The system text that describes ``tools`` to a model whose chat template ignores them."""
    listed = "\n".join(json.dumps(t) for t in tools)
    return (
        "You may call one or more functions to assist with the user query. The functions are:\n<tools>\n"
        f"{listed}\n</tools>\nTo call a function, reply with a JSON object inside tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def render_chat(session: _Session, messages: list[dict], tools: list | None) -> str:
    """The chat template's text for ``messages``: an assistant message this session returned (found by its
    first tool call's id, or by its content) is rendered as the reply's original text (token-exact, whatever
    the template does with ``tool_calls`` or reasoning); a ``developer`` message as a system one; ``tools`` go
    to the template, or into the system message as a Hermes block when the template ignores them."""
    rendered = []
    for m in messages:
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        key = calls[0]["id"] if calls else ("content", _content_text(m.get("content")))
        if m.get("role") == "assistant" and key in session.replies:
            m = {"role": "assistant", "content": session.replies[key]}
        else:
            role = "system" if m["role"] == "developer" else m["role"]
            m = {**m, "role": role, "content": _content_text(m.get("content")) or ""}
        rendered.append(m)

    def template(msgs: list[dict], with_tools: list | None) -> str:
        try:
            return session.tokenizer.apply_chat_template(
                msgs, tools=with_tools, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:
            raise _BadRequest(
                f"the chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from None

    text = template(rendered, tools)
    if tools and text == template(rendered, None):  # the template ignores tools: describe them itself
        block = hermes_tools_block(tools)
        if rendered[0].get("role") == "system":
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{block}"}
        else:
            rendered.insert(0, {"role": "system", "content": block})
        text = template(rendered, None)
    return text


def token_pieces(tokenizer: Any, ids: list[int], text: str) -> list[str]:
    """The deltas of a stream: one piece of ``text`` per token of ``ids`` (empty for tokens past its end, the
    stop token say) when the pieces add up to text that starts with it, else ``[text]``. Each piece is what
    the token adds to the decoded text of the few tokens before it (decoding every prefix would cost
    quadratic time); a character split across tokens comes with its last one."""
    pieces: list[str] = []
    done = 0  # ids[:done] are in the pieces
    for k in range(len(ids)):
        context = max(0, done - 4)
        now = tokenizer.decode(ids[context : k + 1])
        if now.endswith("\ufffd"):  # a character split across tokens: its bytes go out with its last token
            pieces.append("")
            continue
        pieces.append(now[len(tokenizer.decode(ids[context:done])) :])
        done = k + 1
    if not pieces or not "".join(pieces).startswith(text):
        return [text]
    kept, size = [], 0
    for piece in pieces:
        kept.append(piece[: max(0, len(text) - size)])
        size += len(kept[-1])
    return kept


def chat_logprobs(tokenizer: Any, out: GenerationOutput) -> dict:
    """OpenAI's ``logprobs`` of a chat choice: every generated token (its stop token too) with the engine's
    log-prob, that of the sampling distribution (``softmax(logits / temperature)``, before top-p)."""
    tokens = [tokenizer.decode([t]) for t in out.token_ids]
    return {
        "content": [
            {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
            for s, lp in zip(tokens, out.logprobs)
        ]
    }


def completion_logprobs(tokenizer: Any, out: GenerationOutput) -> dict:
    """The legacy completions ``logprobs``: tokens, their log-probs and character offsets."""
    tokens = [tokenizer.decode([t]) for t in out.token_ids]
    offsets = [sum(len(s) for s in tokens[:k]) for k in range(len(tokens))]
    return {
        "tokens": tokens,
        "token_logprobs": list(out.logprobs),
        "top_logprobs": None,
        "text_offset": offsets,
    }


def _usage(ids: list[int], out_ids: list[int]) -> dict:
    return {
        "prompt_tokens": len(ids),
        "completion_tokens": len(out_ids),
        "total_tokens": len(ids) + len(out_ids),
    }


def openai_response(
    id_prefix: str, kind: str, body: dict, ids: list[int], out_ids: list[int], choice: dict
) -> Any:
    """An OpenAI response object of ``kind`` with one choice."""
    from aiohttp import web

    return web.json_response(
        {
            "id": f"{id_prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": body.get("model", "policy"),
            "choices": [{"index": 0, **choice}],
            "usage": _usage(ids, out_ids),
        }
    )


async def event_stream(request: Any, kind: str, body: dict, chunks: list[dict], usage: dict) -> Any:
    """Server-sent events: each of ``chunks`` as one choice's chunk object, then the usage chunk when
    ``stream_options.include_usage``, then ``data: [DONE]``. The engine returns a whole sample, so the events
    go out when it is done."""
    from aiohttp import web

    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    head = {"id": f"{kind}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time())}
    head["model"] = body.get("model", "policy")
    with_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    events = [{**head, "choices": [{"index": 0, **c}]} for c in chunks]
    if with_usage:
        events = [{**e, "usage": None} for e in events] + [{**head, "choices": [], "usage": usage}]
    for event in events:
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def chat_turn(session: _Session, body: dict) -> tuple[list[int], GenerationOutput, dict, str]:
    """One checked chat call, generated and recorded: ``(input ids, output, assistant message, finish
    reason)``. The message has ``content``, and ``reasoning_content`` and ``tool_calls`` when the reply has them."""
    messages = check_messages(body.get("messages"))
    _require(body.get("logprobs") in (None, False, True), "logprobs", "must be true or false")
    _require(
        not body.get("top_logprobs"),
        "top_logprobs",
        "only 0 is served: the rollout engine returns the sampled token's log-prob, not the top alternatives",
    )
    if session.tokenizer.chat_template is None:
        raise _BadRequest("the tokenizer has no chat template; use /v1/completions")
    tools, choice = request_tools(body)
    forced = choice not in ("auto", "none")
    opening = session.parser.opening(None if choice == "required" else choice) if forced else ""
    ids = encode(session.tokenizer, render_chat(session, messages, tools) + opening)
    out, text, original = await session.generate(ids, body)
    finish = out.finish_reason
    reasoning, text = split_reasoning(opening + text, session.tokenizer.chat_template)
    content, tool_calls = text, []
    if tools and choice != "none":
        content, tool_calls = parse_tool_calls(text, f"call_{uuid.uuid4().hex[:12]}", session.parser)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
        finish = "tool_calls" if finish == "stop" else finish
    key = tool_calls[0]["id"] if tool_calls else ("content", content or "")
    if opening + original != (content or ""):  # the client will send back other text than the tokens'
        session.replies[key] = opening + original
    return ids, out, message, finish


def _input_text(content: Any) -> Any:
    """Responses content (a string, or ``input_text`` / ``output_text`` parts) as chat content."""
    if not isinstance(content, list):
        return content
    return [
        {"type": "text", "text": p.get("text")}
        if isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
        else p
        for p in content
    ]


def responses_messages(body: dict) -> list[dict]:
    """The chat messages of a Responses request: ``instructions`` as a system message, message items as they
    are, ``function_call`` items as the tool calls of an assistant message (the one before them, when it is
    the same reply's text), ``function_call_output`` items as tool messages; reasoning items are left out (a
    reply this session returned is rendered back from its original text)."""
    items = body.get("input")
    items = [{"role": "user", "content": items}] if isinstance(items, str) else items
    _require(
        isinstance(items, list) and bool(items), "input", "must be a string or a non-empty list of items"
    )
    messages = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    for k, item in enumerate(items):
        _require(isinstance(item, dict), f"input[{k}]", "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _input_text(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function"}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments")}
            last = messages[-1] if messages else {}
            if last.get("role") == "assistant" and not isinstance(last.get("content"), list):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")}
            )
        else:
            _require(kind == "reasoning", f"input[{k}].type", f"{json.dumps(kind)} is not served")
    return messages


def responses_tools(body: dict) -> dict:
    """A Responses request's ``tools`` and ``tool_choice`` (function tools are flat there) in chat form."""
    tools = body.get("tools")
    if tools is not None:
        _require(isinstance(tools, list), "tools", "must be a list of tool objects")
        for k, t in enumerate(tools):
            _require(
                isinstance(t, dict) and t.get("type") == "function",
                f"tools[{k}].type",
                f"{json.dumps(t.get('type') if isinstance(t, dict) else t)} is not served: only function tools",
            )
        fields = ("name", "description", "parameters")
        tools = [{"type": "function", "function": {f: t[f] for f in fields if f in t}} for t in tools]
    out: dict[str, Any] = {"tools": tools}
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        out["tool_choice"] = choice
    return out


def response_output(message: dict, out: GenerationOutput, tokenizer: Any) -> list[dict]:
    """The Responses ``output`` items of one reply: reasoning, the message text (with log-probs), and one
    ``function_call`` per tool call."""
    items: list[dict] = []
    if message.get("reasoning_content") is not None:
        text = {"type": "reasoning_text", "text": message["reasoning_content"]}
        items.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "content": [text]})
    if message["content"]:
        lps = [
            {"token": c["token"], "logprob": c["logprob"], "bytes": c["bytes"], "top_logprobs": []}
            for c in chat_logprobs(tokenizer, out)["content"]
        ]
        part = {"type": "output_text", "text": message["content"], "annotations": [], "logprobs": lps}
        items.append(
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": "completed",
                "role": "assistant",
                "content": [part],
            }
        )
    for call in message.get("tool_calls", []):
        fn = call["function"]
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{call['id']}",
                "call_id": call["id"],
                "name": fn["name"],
                "arguments": fn["arguments"],
                "status": "completed",
            }
        )
    return items


async def responses_stream(request: Any, response: dict) -> Any:
    """The Responses API's server-sent events for a finished ``response``: created, each output item added
    (text and arguments as one delta each) and done, completed."""
    from aiohttp import web

    stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await stream.prepare(request)
    events = [("response.created", {"response": {**response, "status": "in_progress", "output": []}})]
    for k, item in enumerate(response["output"]):
        where = {"output_index": k, "item_id": item["id"]}
        if item["type"] == "message":
            text = item["content"][0]["text"]
            events.append(
                ("response.output_item.added", {"output_index": k, "item": {**item, "content": []}})
            )
            empty = {"type": "output_text", "text": "", "annotations": []}
            events.append(("response.content_part.added", {**where, "content_index": 0, "part": empty}))
            events.append(
                ("response.output_text.delta", {**where, "content_index": 0, "delta": text, "logprobs": []})
            )
            events.append(
                ("response.output_text.done", {**where, "content_index": 0, "text": text, "logprobs": []})
            )
            events.append(
                ("response.content_part.done", {**where, "content_index": 0, "part": item["content"][0]})
            )
        elif item["type"] == "function_call":
            events.append(
                ("response.output_item.added", {"output_index": k, "item": {**item, "arguments": ""}})
            )
            events.append(("response.function_call_arguments.delta", {**where, "delta": item["arguments"]}))
            events.append(
                ("response.function_call_arguments.done", {**where, "arguments": item["arguments"]})
            )
        else:
            events.append(("response.output_item.added", {"output_index": k, "item": item}))
        events.append(("response.output_item.done", {"output_index": k, "item": item}))
    events.append(("response.completed", {"response": response}))
    for n, (kind, data) in enumerate(events):
        await stream.write(
            f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': n, **data})}\n\n".encode()
        )
    await stream.write_eof()
    return stream


class _Endpoint:
    """The local OpenAI-compatible server: each session is served at its own URL; every request is checked and
    its call recorded in its session."""

    def __init__(self) -> None:
        self.sessions: dict[str, _Session] = {}
        self.runner: Any = None
        self.port: int | None = None
        self.start_lock = asyncio.Lock()
        self.warned: set[str] = set()

    @contextlib.asynccontextmanager
    async def serving(self, session: _Session, host: str) -> Any:
        """``session``'s base URL while the context lasts (the server starts on first use)."""
        await self._start(host)
        sid = uuid.uuid4().hex
        self.sessions[sid] = session
        try:
            yield f"http://{host}:{self.port}/sessions/{sid}/v1"
        finally:
            del self.sessions[sid]

    async def _start(self, host: str) -> None:
        from aiohttp import web

        @web.middleware
        async def bad_requests(request: Any, handler: Any) -> Any:  # a _BadRequest as OpenAI's error object
            try:
                return await handler(request)
            except _BadRequest as exc:
                error = {"message": str(exc), "type": "invalid_request_error"}
                return web.json_response({"error": error}, status=exc.status)

        async with self.start_lock:
            if self.runner is not None:
                return
            app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=[bad_requests])
            app.router.add_post("/sessions/{sid}/v1/chat/completions", self._chat)
            app.router.add_post("/sessions/{sid}/v1/completions", self._completions)
            app.router.add_post("/sessions/{sid}/v1/responses", self._responses)
            app.router.add_get("/sessions/{sid}/v1/models", self._models)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            await web.SockSite(runner, sock).start()
            self.port = sock.getsockname()[1]
            self.runner = runner

    async def aclose(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def _read(self, request: Any) -> tuple[_Session, dict]:
        session = self.sessions.get(request.match_info["sid"])
        if session is None:
            raise _BadRequest("unknown or finished session", status=404)
        try:
            body = await request.json()
        except ValueError as exc:
            raise _BadRequest(f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise _BadRequest("the body must be a JSON object")
        check_request(body)
        for key in ("temperature", "top_p"):
            value, used = body.get(key), getattr(session.params, key)
            if value is not None and value != used and key not in self.warned:
                self.warned.add(key)
                logger.warning(
                    "the agent asked for %s=%s; the run's %s=%s is used (the trainer recomputes log-probs with it)",
                    key,
                    value,
                    key,
                    used,
                )
        return session, body

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response(
            {"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "rlhf"}]}
        )

    async def _chat(self, request: Any) -> Any:
        session, body = await self._read(request)
        ids, out, message, finish = await chat_turn(session, body)
        logprobs = chat_logprobs(session.tokenizer, out) if body.get("logprobs") else None
        if not body.get("stream"):
            choice_out = {
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish,
                "token_ids": out.token_ids,
            }
            return openai_response("chatcmpl", "chat.completion", body, ids, out.token_ids, choice_out)
        content, tool_calls = message["content"], message.get("tool_calls", [])
        chunks: list[dict] = [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
        if "reasoning_content" in message:
            chunks.append(
                {"delta": {"reasoning_content": message["reasoning_content"]}, "finish_reason": None}
            )
        pieces = token_pieces(session.tokenizer, out.token_ids, content) if content else []
        per_token = logprobs is not None and len(pieces) == len(out.token_ids)
        for k, piece in enumerate(pieces):
            if not piece and not per_token:
                continue
            lp = {"content": logprobs["content"][k : k + 1]} if per_token else None
            chunks.append({"delta": {"content": piece}, "logprobs": lp, "finish_reason": None})
        for k, call in enumerate(tool_calls):
            chunks.append({"delta": {"tool_calls": [{"index": k, **call}]}, "finish_reason": None})
        last = {"delta": {}, "finish_reason": finish, "token_ids": out.token_ids}
        chunks.append({**last, "logprobs": None if per_token else logprobs})
        return await event_stream(request, "chat.completion.chunk", body, chunks, _usage(ids, out.token_ids))

    async def _responses(self, request: Any) -> Any:
        session, body = await self._read(request)
        previous = body.get("previous_response_id")
        _require(
            previous is None or previous in session.responses,
            "previous_response_id",
            f"{json.dumps(previous)} is not a response of this episode",
        )
        fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
        _require(
            fmt is None or fmt.get("type") == "text",
            "text.format",
            f"{json.dumps(fmt)} is not served: the engine has no constrained decoding; only {{'type': 'text'}}",
        )
        messages = responses_messages(body)
        if previous is not None:
            messages = session.responses[previous] + messages
        chat_body = {**body, **responses_tools(body), "messages": messages, "stream": False}
        chat_body["max_tokens"] = body.get("max_output_tokens")
        ids, out, message, finish = await chat_turn(session, chat_body)
        rid = f"resp_{uuid.uuid4().hex}"
        session.responses[rid] = messages + [message]
        output = response_output(message, out, session.tokenizer)
        response = {
            "id": rid,
            "object": "response",
            "created_at": int(time.time()),
            "status": "incomplete" if finish == "length" else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "model": body.get("model", "policy"),
            "output": output,
            "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": True,
            "usage": {
                "input_tokens": len(ids),
                "output_tokens": len(out.token_ids),
                "total_tokens": len(ids) + len(out.token_ids),
            },
            "token_ids": out.token_ids,
        }
        if not body.get("stream"):
            from aiohttp import web

            return web.json_response(response)
        return await responses_stream(request, response)

    async def _completions(self, request: Any) -> Any:
        session, body = await self._read(request)
        want = body.get("logprobs")
        _require(
            want in (None, False, True, 0),
            "logprobs",
            f"{json.dumps(want)}: only 0 (the sampled token's log-prob) is served; the rollout engine does "
            "not return the top alternatives",
        )
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = encode(session.tokenizer, prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)  # token ids in, used verbatim
        else:
            raise _BadRequest("'prompt' must be a string or a list of token ids")
        out, text, _ = await session.generate(ids, body)
        logprobs = None if want is None or want is False else completion_logprobs(session.tokenizer, out)
        if not body.get("stream"):
            choice = {
                "text": text,
                "finish_reason": out.finish_reason,
                "logprobs": logprobs,
                "token_ids": out.token_ids,
            }
            return openai_response("cmpl", "text_completion", body, ids, out.token_ids, choice)
        chunks = [{"text": text, "logprobs": logprobs, "finish_reason": None}]
        chunks.append(
            {"text": "", "logprobs": None, "finish_reason": out.finish_reason, "token_ids": out.token_ids}
        )
        return await event_stream(request, "text_completion", body, chunks, _usage(ids, out.token_ids))


def pick_tool_parser(name: str | None, template: str | None) -> Any:
    """The registered tool-call parser ``name`` (``--train.tool_parser``), or the one ``template`` picks when
    None (``rlhf_agents.tool_parsers.parser_for_template``)."""
    from rlhf_core.plugins import collect, get_plugin_manager, resolve

    pm = get_plugin_manager()
    if name is None:
        name = parser_for_template({n: r.obj for n, r in collect(pm, "tool_parsers").items()}, template)
    return resolve(pm, "tool_parsers", name, flag="--train.tool_parser")


def read_agent_result(result: Any, where: str) -> tuple[float | None, float | None, dict, str | None]:
    """(reward, score, extra_logs, error) from what ``run_agent`` returned; a None reward (no error) means the
    run's reward source scores the sample."""
    if not isinstance(result, dict):
        result = {"reward": result}
    extra = numeric_logs(result.get("extra_logs"), logger, where)
    raw = result.get("reward", result.get("rewards"))
    if raw is None:
        return None, None, extra, None
    reward, why = check_reward_value(raw)
    if why is not None:
        return None, None, extra, f"{where} returned a bad reward: {why}"
    raw_score = result.get("score", result.get("scores"))
    score, why = (reward, None) if raw_score is None else check_reward_value(raw_score, "score")
    if why is not None:
        return None, None, extra, f"{where} returned a bad score: {why}"
    return reward, score, extra, None


class OpenAIServerAgentExecutor(AgentExecutorBase):
    """Runs :meth:`run_agent` against a local OpenAI-compatible server (127.0.0.1 only) and returns its token
    trace. Subclass it and implement ``async run_agent(base_url, prompt, label)``, returning the reward, a dict
    with ``reward``/``score``/``extra_logs``, or None (package README, "Agents written against an OpenAI
    client")."""

    host = "127.0.0.1"
    per_call_samples: str = "auto"
    """``auto``, ``always`` or ``never`` (set from ``--train.per_call_samples``; see the package README)."""
    tool_parser: str | None = None
    """A registered tool-call parser's name (``--train.tool_parser``); None: the chat template picks one."""

    def __init__(self) -> None:
        self._endpoint = _Endpoint()
        self._parsers: dict[str | None, Any] = {}

    def _parser(self, template: str | None) -> Any:
        if template not in self._parsers:
            self._parsers[template] = pick_tool_parser(self.tool_parser, template)
        return self._parsers[template]

    async def run_agent(self, base_url: str, prompt: str, label: Any) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} must implement async run_agent(base_url, prompt, label) (subclass "
            f"rlhf_agents.OpenAIServerAgentExecutor in the --train.agent_func_path file)"
        )

    async def aclose(self) -> None:
        await self._endpoint.aclose()

    def agent_name(self) -> str:
        """How errors name the agent: ``Class (path/to/file.py).run_agent``."""
        return f"{describe_class(type(self))}.run_agent"

    async def run_bounded(self, base_url: str, prompt: str, label: Any) -> Any:
        """:meth:`run_agent` within ``--train.env_step_timeout``."""
        try:
            return await asyncio.wait_for(self.run_agent(base_url, prompt, label), self.env_step_timeout)
        except asyncio.TimeoutError:
            raise EpisodeFailure(
                "env_timeout",
                f"{self.agent_name()} took longer than --train.env_step_timeout {self.env_step_timeout:g} s",
            ) from None

    async def execute(
        self,
        prompt: str,
        label: Any,
        sampling_params: SamplingParams,
        max_length: int,
        hf_tokenizer: Any,
        llm_engine: Any,
        images: Any = None,
        *,
        prompt_ids: list[int] | None = None,
    ) -> Trajectory:
        session = _Session(
            hf_tokenizer,
            llm_engine,
            sampling_params,
            max_length,
            self.per_call_samples,
            type(self).__name__,
            self._endpoint.warned,
            parser=self._parser(hf_tokenizer.chat_template),
        )
        where = self.agent_name()
        reward = score = error = kind = None
        extra: dict[str, float] = {}
        async with self._endpoint.serving(session, self.host) as base_url:
            try:
                reward, score, extra, error = read_agent_result(
                    await self.run_bounded(base_url, prompt, label), where
                )
                kind = "agent_invalid" if error else None
            except EpisodeFailure as failure:
                error, kind = str(failure), failure.kind
            except Exception as exc:
                error, kind = f"{where} raised {type(exc).__name__}: {exc}", "agent_error"
                log_failure_once(logger, where, error, exc)
        if session.violation is not None:
            error, kind = session.violation, "prefix_violation"
        if not session.segments:
            ids = list(prompt_ids) if prompt_ids is not None else encode(hf_tokenizer, prompt)
            session.segments.append(TokenTrace(prompt_ids=ids))
            if error is None:
                error, kind = f"{where} made no completion request", "agent_invalid"
        if error is not None:
            reward = score = None
            extra[f"error/{kind}"] = 1.0
        segments = [s.to_trajectory() for s in session.segments] if len(session.segments) > 1 else []
        if segments:
            extra["per_call/samples"] = float(len(segments))
        return session.segments[-1].to_trajectory(
            reward=reward,
            score=score,
            finish_reason=session.finish,
            truncated=session.truncated,
            prompt_text=prompt,
            label=label,
            error=error,
            extra_logs={**extra, "num_turns": float(session.calls)},
            segments=segments,
        )
