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
import re
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
from rlhf_core.types import GenerationRequest, SamplingParams, Trajectory

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 16 * 1024 * 1024
PER_CALL_SAMPLES = ("auto", "always", "never")
TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


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
    replies: dict[str, str] = dataclasses.field(default_factory=dict)
    """The text of each reply that made tool calls, by its first call's id."""

    async def generate(self, ids: list[int], body: dict) -> tuple[list[int], str]:
        """Generate for one call and record it in the token traces: ``(output ids, finish reason)``."""
        async with self.lock:
            room = self.max_length - len(ids)
            if room <= 0:  # the context budget is spent: answer empty, as a length stop (and record nothing)
                self.truncated, self.finish = True, "length"
                if not self.segments:
                    self.segments.append(TokenTrace(prompt_ids=list(ids)))
                return [], "length"
            self._record_input(ids)
            asked = body.get("max_completion_tokens") or body.get("max_tokens") or self.params.max_new_tokens
            if not isinstance(asked, int) or asked < 1:
                raise _BadRequest("max_tokens must be a positive integer")
            params = turn_params(self.params, self.calls, min(asked, self.params.max_new_tokens, room))
            (out,) = await self.engine.generate(GenerationRequest(prompt_ids=list(ids), params=params))
            self.calls += 1
            self.finish = out.finish_reason
            self.truncated = out.finish_reason == "length"
            if self.violation is None:
                self.segments[-1].add_action(out)
            return list(out.token_ids), out.finish_reason

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

    def reply_text(self, out_ids: list[int], finish: str, body: dict) -> str:
        """The reply as text: without its final stop token, and with any other special token kept (so that
        sending the reply back re-renders it to the same tokens) unless ``skip_special_tokens`` is true."""
        ids = out_ids[:-1] if finish == "stop" and out_ids else out_ids
        return self.tokenizer.decode(ids, skip_special_tokens=bool(body.get("skip_special_tokens", False)))


def _content_text(content: Any) -> Any:
    """OpenAI message content as a string (a list of ``{"type": "text"}`` parts is joined)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content


def parse_tool_calls(text: str, call_id: str) -> tuple[str | None, list[dict]]:
    """Split a reply in the Hermes/Qwen tool-call format into OpenAI ``(content, tool_calls)``. Each
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block (a JSON object, or a list of them)
    becomes a ``{"id", "type": "function", "function": {"name", "arguments": <JSON string>}}`` entry, ids
    ``f"{call_id}_{k}"``; the text outside the blocks is the content (None when blank). A block that is not
    such JSON stays in the content, so a malformed call reads as text, as it would to a user."""
    calls: list[dict] = []
    kept: list[str] = []
    end = 0
    for match in TOOL_CALL_BLOCK.finditer(text):
        try:
            parsed = json.loads(match.group(1))
        except ValueError:
            continue
        items = parsed if isinstance(parsed, list) else [parsed]
        if not items or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in items):
            continue
        kept.append(text[end : match.start()])
        end = match.end()
        for c in items:
            arguments = c.get("arguments", c.get("parameters", {}))
            arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
            calls.append(
                {
                    "id": f"{call_id}_{len(calls)}",
                    "type": "function",
                    "function": {"name": c["name"], "arguments": arguments},
                }
            )
    content = ("".join(kept) + text[end:]).strip() if calls else text
    return (content or None), calls


def hermes_tools_block(tools: list) -> str:
    """The system text that describes ``tools`` to a model whose chat template ignores them."""
    listed = "\n".join(json.dumps(t) for t in tools)
    return (
        "You may call one or more functions to assist with the user query. The functions are:\n<tools>\n"
        f"{listed}\n</tools>\nTo call a function, reply with a JSON object inside tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def request_tools(body: dict) -> tuple[list | None, bool]:
    """The request's tools and whether to parse tool calls out of the reply. ``tool_choice`` "required" or a
    named function would need constrained decoding, which changes the distribution the samples come from (the
    trainer's log-probs would not match), so it is refused."""
    tools = body.get("tools") or None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise _BadRequest("'tools' must be a list of tool objects")
    choice = body.get("tool_choice", "auto" if tools else "none")
    if choice not in ("auto", "none"):
        raise _BadRequest(
            f"tool_choice={json.dumps(choice)} is not supported: forcing a call would sample the policy off its "
            "own distribution; use 'auto' (the model decides) or 'none'"
        )
    return tools, bool(tools) and choice == "auto"


def render_chat(session: _Session, messages: list[dict], tools: list | None) -> str:
    """The chat template's text for ``messages``: an assistant message that carries tool calls this session
    returned is rendered as the reply's original text (token-exact, whatever the template does with
    ``tool_calls``); ``tools`` go to the template, or into the system message as a Hermes block when the
    template ignores them."""
    rendered = []
    for m in messages:
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        first_id = (
            calls[0].get("id") if isinstance(calls, list) and calls and isinstance(calls[0], dict) else None
        )
        if first_id in session.replies:
            m = {"role": "assistant", "content": session.replies[first_id]}
        else:
            m = {**m, "content": _content_text(m.get("content")) or ""}
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
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": len(out_ids),
                "total_tokens": len(ids) + len(out_ids),
            },
        }
    )


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
        if body.get("stream"):
            raise _BadRequest("stream=true is not supported")
        if body.get("n", 1) != 1:
            raise _BadRequest("only n=1 is supported (each sample is its own episode)")
        if body.get("stop"):
            raise _BadRequest("stop strings are not supported: the engine stops on token ids (EOS)")
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
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _BadRequest("'messages' must be a non-empty list")
        if session.tokenizer.chat_template is None:
            raise _BadRequest("the tokenizer has no chat template; use /v1/completions")
        tools, parse_calls = request_tools(body)
        text = render_chat(session, [m for m in messages if isinstance(m, dict)], tools)
        ids = encode(session.tokenizer, text)
        out_ids, finish = await session.generate(ids, body)
        content = session.reply_text(out_ids, finish, body)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if parse_calls:
            parsed, tool_calls = parse_tool_calls(content, f"call_{uuid.uuid4().hex[:12]}")
            if tool_calls:
                session.replies[tool_calls[0]["id"]] = content
                message = {"role": "assistant", "content": parsed, "tool_calls": tool_calls}
                finish = "tool_calls" if finish == "stop" else finish
        choice = {"message": message, "finish_reason": finish, "token_ids": out_ids}
        return openai_response("chatcmpl", "chat.completion", body, ids, out_ids, choice)

    async def _completions(self, request: Any) -> Any:
        session, body = await self._read(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = encode(session.tokenizer, prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)  # token ids in, used verbatim
        else:
            raise _BadRequest("'prompt' must be a string or a list of token ids")
        out_ids, finish = await session.generate(ids, body)
        text = session.reply_text(out_ids, finish, body)
        choice = {"text": text, "finish_reason": finish, "logprobs": None, "token_ids": out_ids}
        return openai_response("cmpl", "text_completion", body, ids, out_ids, choice)


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

    def __init__(self) -> None:
        self._endpoint = _Endpoint()

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
