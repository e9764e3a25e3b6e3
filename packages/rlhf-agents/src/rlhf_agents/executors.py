"""Agent executors: how one prompt becomes one token-level :class:`~rlhf_core.types.Trajectory`, with
OpenRLHF's agent API (``AgentInstanceBase.reset/step``, ``MultiTurnAgentExecutor(cls)``) plus two fixes:
``async def __init__`` works, and a failing or hanging environment ends only its own episode. The package
README ("Token in, token out", "Writing an agent", "Vision-language models") has the contract."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import inspect
import logging
import os
import threading
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from rlhf_agents.checks import check_reward_value, describe, log_failure_once, numeric_logs
from rlhf_core.types import (
    GenerationOutput,
    GenerationRequest,
    ImageInput,
    SamplingParams,
    Trajectory,
    derive_seed,
)

logger = logging.getLogger(__name__)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` on its own: no BOS/EOS added (they belong to templates, not to feedback)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def describe_class(cls: type) -> str:
    """``Name (path/to/file.py)``: how errors point at user classes."""
    try:
        return f"{cls.__qualname__} ({inspect.getsourcefile(cls)})"
    except TypeError:
        return cls.__qualname__


async def call_user(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a sync or async user function without blocking the event loop (sync ones run in a thread)."""
    sync = not inspect.iscoroutinefunction(fn)
    result = await (in_daemon_thread(fn, *args, **kwargs) if sync else fn(*args, **kwargs))
    return await result if inspect.isawaitable(result) else result


# user threads at once per event loop, as asyncio's default pool allowed: the rest wait (within their timeout)
USER_THREADS = min(32, (os.cpu_count() or 1) + 4)
_user_slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def in_daemon_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a daemon thread of its own: user code that never returns (given up on after
    its timeout) cannot keep the process from exiting, as a thread of asyncio's default pool would, since
    Python joins those at exit (docs/fault-handling.md, "Code that hangs"). A thread holds one of the loop's
    USER_THREADS slots until it returns."""
    loop = asyncio.get_running_loop()
    slots = _user_slots.setdefault(loop, asyncio.Semaphore(USER_THREADS))
    await slots.acquire()
    future = loop.create_future()
    context = contextvars.copy_context()

    def settle(value: Any, exc: BaseException | None) -> None:
        slots.release()
        if not future.done():  # not given up on (a timeout cancels the future)
            future.set_result(value) if exc is None else future.set_exception(exc)

    def target() -> None:
        try:
            value, exc = context.run(fn, *args, **kwargs), None
        except BaseException as error:
            value, exc = None, error
        with contextlib.suppress(RuntimeError):  # the loop closed while it ran: nobody waits any more
            loop.call_soon_threadsafe(settle, value, exc)

    try:
        threading.Thread(
            target=target, name=f"rlhf-user-{getattr(fn, '__name__', 'call')}", daemon=True
        ).start()
    except BaseException:
        slots.release()
        raise
    return await future


async def new_instance(cls: type) -> Any:
    """``cls()``, also when ``cls`` defines ``async def __init__`` (plain ``cls()`` raises TypeError then); a
    plain ``__init__`` runs in a thread: environments may do slow set-up there."""
    if inspect.iscoroutinefunction(cls.__init__):
        obj = cls.__new__(cls)
        await obj.__init__()
        return obj
    return await in_daemon_thread(cls)


def turn_params(params: SamplingParams, turn: int, max_new_tokens: int) -> SamplingParams:
    """The sampling parameters of an episode's model call number ``turn``: one sample, seeded per turn."""
    seed = None if params.seed is None else derive_seed(params.seed, "turn", turn)
    return dataclasses.replace(params, n=1, max_new_tokens=max_new_tokens, seed=seed)


@dataclass
class TokenTrace:
    """The token ids of one episode as it grows: the prompt, then model actions and environment feedback."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routed_experts: Any = None
    """The last action's ``GenerationOutput.routed_experts``: its input was the whole trace (router replay)."""

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def add_action(self, out: GenerationOutput) -> None:
        if len(out.token_ids) != len(out.logprobs):
            raise ValueError(
                f"the rollout engine returned {len(out.token_ids)} tokens but {len(out.logprobs)} log-probs"
            )
        self.response_ids += list(out.token_ids)
        self.action_mask += [1] * len(out.token_ids)
        self.logprobs += [float(x) for x in out.logprobs]
        self.routed_experts = out.routed_experts

    def add_feedback(self, ids: list[int]) -> None:
        self.response_ids += list(ids)
        self.action_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def to_trajectory(self, **kwargs: Any) -> Trajectory:
        return Trajectory(
            prompt_ids=list(self.prompt_ids),
            response_ids=list(self.response_ids),
            action_mask=list(self.action_mask),
            rollout_logprobs=list(self.logprobs),
            routed_experts=self.routed_experts,
            **kwargs,
        )


class AgentExecutorBase(ABC):
    """Turns one prompt into one :class:`Trajectory`, token in and token out. ``llm_engine`` has
    ``async generate(GenerationRequest) -> list[GenerationOutput]``
    (``rlhf_core.rollout.async_engine.AsyncEngine`` or a Ray engine handle wrapped the same way).
    ``prompt_ids`` are the prompt's token ids when the caller already has them (the rollout worker always
    passes them); they are used verbatim. A trajectory whose ``reward`` is None and ``error`` is None is
    scored afterwards by the run's reward source, in batches."""

    env_step_timeout: float | None = None
    """Seconds an environment call may take (set from ``--train.env_step_timeout``); None: no limit."""
    image_processing: Any = None
    """A vision-language model's ``rlhf_core.vision.ImageProcessing`` (set by the rollout worker); None for a
    text model."""
    max_images: int = 0
    """Most images in one episode (``--data.max_images_per_prompt``; 0: no limit); environment images past it
    are dropped."""

    @abstractmethod
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
    ) -> Trajectory: ...

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release what the executor holds (servers, connections)."""


class SingleTurnAgentExecutor(AgentExecutorBase):
    """Generate once; the reward source scores the result (in batches, after the episodes finish)."""

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
        ids = list(prompt_ids) if prompt_ids is not None else encode(hf_tokenizer, prompt)
        trace = TokenTrace(prompt_ids=ids)
        if len(ids) >= max_length:  # no room to generate: unscorable
            return trace.to_trajectory(
                finish_reason="length",
                truncated=True,
                prompt_text=prompt,
                label=label,
                error=f"the prompt has {len(ids)} tokens, which leaves no room under max_len {max_length}",
                extra_logs={"error/overlong_prompt": 1.0},
            )
        max_new = min(sampling_params.max_new_tokens, max_length - len(ids))
        params = dataclasses.replace(sampling_params, n=1, max_new_tokens=max_new)
        images = list(images or [])
        (out,) = await llm_engine.generate(GenerationRequest(prompt_ids=ids, params=params, images=images))
        trace.add_action(out)
        return trace.to_trajectory(
            finish_reason=out.finish_reason,
            truncated=out.finish_reason == "length",
            prompt_text=prompt,
            label=label,
            images=images,
        )


class AgentInstanceBase(ABC):
    """One environment episode (OpenRLHF's agent API). A new instance is made for every sample.

    ``__init__`` may be ``async def``. ``reset`` and ``step`` may be sync or async.

    - ``reset(states)`` gets ``{"observation": prompt, "label": label}`` and returns ``{"observation": str}``;
      an observation that differs from the prompt replaces it (and is tokenized once).
    - ``step(states)`` gets ``observation_text`` (the context so far as text), ``action_text`` (the model's
      reply, special tokens kept), ``label``, ``sampling_params``, and, token-in-token-out,
      ``observation_ids`` and ``action_ids``. It returns ``rewards`` (a number or one-element tensor; summed
      over turns), ``environment_feedback`` (str, appended with action_mask 0), ``done`` (bool), and
      optionally ``scores`` (last one kept; default: the summed reward), ``sampling_params`` (for the next
      turn: a SamplingParams or a dict of fields to change), ``extra_logs`` (numbers; last one wins) and,
      for a vision-language model, ``environment_images`` (PIL images, one placeholder each in the feedback).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: B027 - OpenRLHF subclasses call super()
        pass

    async def reset(self, states: dict, **kwargs: Any) -> dict:
        return {"observation": states["observation"]}

    @abstractmethod
    async def step(self, states: dict, **kwargs: Any) -> dict: ...


class EpisodeFailure(Exception):
    """Ends one episode; the sample becomes unscorable with this message, counted under ``error/<kind>``."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class MultiTurnAgentExecutor(AgentExecutorBase):
    """Drives an :class:`AgentInstanceBase` subclass: generate, ``step``, append feedback, until done, within
    the turn and episode token budgets of the package README ("Token in, token out")."""

    def __init__(self, agent_instance_cls: type):
        if not (isinstance(agent_instance_cls, type) and issubclass(agent_instance_cls, AgentInstanceBase)):
            raise TypeError(
                "MultiTurnAgentExecutor needs a subclass of rlhf_agents.AgentInstanceBase, got "
                f"{describe(agent_instance_cls)}"
            )
        self.agent_instance_cls = agent_instance_cls
        self.where = describe_class(agent_instance_cls)

    async def _env(self, method: str, fn: Any, *args: Any) -> Any:
        try:
            return await asyncio.wait_for(call_user(fn, *args), self.env_step_timeout)
        except asyncio.TimeoutError:
            raise EpisodeFailure(
                "env_timeout",
                f"{self.where}.{method} took longer than "
                f"--train.env_step_timeout {self.env_step_timeout:g} s; the episode "
                "was ended",
            ) from None
        except Exception as exc:
            message = f"{method} raised {type(exc).__name__}: {exc}"
            log_failure_once(logger, self.where, message, exc)
            raise EpisodeFailure("env_error", f"{self.where}.{message}") from exc

    def _invalid(self, method: str, what: str) -> EpisodeFailure:
        message = f"{self.where}.{method} {what}"
        log_failure_once(logger, self.where, message)
        return EpisodeFailure("env_invalid", message)

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
        ids = list(prompt_ids) if prompt_ids is not None else encode(hf_tokenizer, prompt)
        trace = TokenTrace(prompt_ids=ids)
        state = {
            "reward": 0.0,
            "score": None,
            "extra": {},
            "turns": 0,
            "finish": "stop",
            "truncated": False,
            "images": list(images or []),
        }
        instance, error = None, None
        try:
            instance = await self._env("__init__", new_instance, self.agent_instance_cls)
            await self._run(
                instance, trace, state, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine
            )
        except EpisodeFailure as failure:
            error = str(failure)
            state["extra"][f"error/{failure.kind}"] = 1.0
        finally:
            close = getattr(instance, "aclose", None) or getattr(instance, "close", None)
            if close is not None:
                try:
                    await call_user(close)
                except Exception as exc:  # a failing cleanup must not lose the episode
                    log_failure_once(logger, self.where, f"close raised {type(exc).__name__}: {exc}", exc)
        scored = error is None
        return trace.to_trajectory(
            reward=state["reward"] if scored else None,
            score=(state["reward"] if state["score"] is None else state["score"]) if scored else None,
            finish_reason=state["finish"],
            truncated=state["truncated"],
            prompt_text=prompt,
            label=label,
            error=error,
            extra_logs={**state["extra"], "num_turns": float(state["turns"])},
            images=state["images"],
        )

    async def _run(
        self,
        instance: Any,
        trace: TokenTrace,
        state: dict,
        prompt: str,
        label: Any,
        params: SamplingParams,
        max_length: int,
        tokenizer: Any,
        engine: Any,
    ) -> None:
        reset = await self._env("reset", instance.reset, {"observation": prompt, "label": label})
        observation_text = reset.get("observation") if isinstance(reset, dict) else None
        if not isinstance(observation_text, str):
            raise self._invalid(
                "reset", f"returned {describe(reset)}; expected a dict with an 'observation' string"
            )
        if observation_text != prompt:
            trace.prompt_ids = encode(tokenizer, observation_text)
            if state["images"]:  # the prompt's images keep their places in the new observation
                try:
                    trace.prompt_ids = self.image_processing.expand(trace.prompt_ids, state["images"])
                except ValueError as exc:
                    raise self._invalid(
                        "reset", f"returned an observation that does not fit the prompt's images: {exc}"
                    ) from None
        if len(trace) >= max_length:
            state["truncated"], state["finish"] = True, "length"
            raise EpisodeFailure(
                "overlong_prompt",
                f"the prompt has {len(trace)} tokens, which leaves no room under max_len {max_length}",
            )
        while True:
            context = trace.all_ids()
            request = GenerationRequest(
                prompt_ids=context,
                params=turn_params(
                    params, state["turns"], min(params.max_new_tokens, max_length - len(trace))
                ),
                images=list(state["images"]),
            )
            (out,) = await engine.generate(request)
            trace.add_action(out)
            state["turns"] += 1
            state["finish"] = out.finish_reason
            action_text = tokenizer.decode(out.token_ids, skip_special_tokens=False)
            result = await self._env(
                "step",
                instance.step,
                {
                    "observation_text": observation_text,
                    "action_text": action_text,
                    "label": label,
                    "sampling_params": params,
                    "observation_ids": context,
                    "action_ids": list(out.token_ids),
                },
            )
            done, feedback, params = self._read_step(result, state, params)
            observation_text += action_text + feedback
            feedback_ids = encode(tokenizer, feedback)
            room = max_length - len(trace)
            pictures = list(result.get("environment_images") or [])
            new_images = await self._feedback_images(pictures, feedback_ids, state)
            if new_images:
                feedback_ids = self.image_processing.expand(feedback_ids, new_images)
            kept_ids, kept_images = fit_feedback(feedback_ids, new_images, room, self._image_token_id())
            trace.add_feedback(kept_ids)
            state["images"] += kept_images
            if dropped := len(pictures) - len(kept_images):  # past --data.max_images_per_prompt, or max_len
                state["extra"]["images_dropped"] = state["extra"].get("images_dropped", 0.0) + dropped
            if done:
                state["truncated"] = out.finish_reason == "length"
                return
            if len(feedback_ids) >= room:  # no room left for another turn
                state["truncated"], state["finish"] = True, "length"
                return

    def _image_token_id(self) -> int | None:
        return None if self.image_processing is None else self.image_processing.image_token_id

    async def _feedback_images(
        self, pictures: list, feedback_ids: list[int], state: dict
    ) -> list[ImageInput]:
        """A step's ``environment_images`` (``pictures``), processed, with the placeholders past ``max_images``
        removed from ``feedback_ids`` (in place) and their images dropped."""
        token = self._image_token_id()
        found = 0 if token is None else feedback_ids.count(token)
        if not pictures and not found:
            return []
        if token is None:
            raise self._invalid(
                "step", "returned environment_images, but the model is not a vision-language model"
            )
        if found != len(pictures):
            raise self._invalid(
                "step",
                f"returned {len(pictures)} environment_images but its environment_feedback "
                f"has {found} image placeholders (one per image)",
            )
        room = max(0, self.max_images - len(state["images"])) if self.max_images else len(pictures)
        if len(pictures) > room:
            drop = [k for k, t in enumerate(feedback_ids) if t == token][room:]
            for k in reversed(drop):
                del feedback_ids[k]
            pictures = pictures[:room]
        try:
            return await asyncio.to_thread(self.image_processing.process, pictures)
        except Exception as exc:
            raise self._invalid(
                "step",
                f"returned environment_images that could not be processed: {type(exc).__name__}: {exc}",
            ) from None

    def _read_step(
        self, result: Any, state: dict, params: SamplingParams
    ) -> tuple[bool, str, SamplingParams]:
        """Check a ``step`` result and fold it into ``state``; returns (done, feedback, next params)."""
        if not isinstance(result, dict):
            raise self._invalid("step", f"returned {describe(result)}; expected a dict")
        missing = [k for k in ("rewards", "environment_feedback", "done") if k not in result]
        if missing:
            raise self._invalid("step", f"returned a dict without {missing} (it has {sorted(result)})")
        reward, why = check_reward_value(result["rewards"])
        if why is not None:
            raise self._invalid("step", f"returned bad 'rewards': {why}")
        state["reward"] += reward
        if result.get("scores") is not None:
            score, why = check_reward_value(result["scores"], "score")
            if why is not None:
                raise self._invalid("step", f"returned bad 'scores': {why}")
            state["score"] = score
        feedback = "" if result["environment_feedback"] is None else result["environment_feedback"]
        if not isinstance(feedback, str):
            raise self._invalid(
                "step", f"returned 'environment_feedback' as {describe(feedback)}; expected a str"
            )
        state["extra"].update(numeric_logs(result.get("extra_logs"), logger, f"{self.where}.step"))
        new_params = result.get("sampling_params")
        if isinstance(new_params, dict):
            try:
                new_params = dataclasses.replace(params, **new_params)
            except TypeError as exc:
                raise self._invalid("step", f"returned unknown sampling_params fields: {exc}") from None
        elif new_params is None:
            new_params = params
        elif not isinstance(new_params, SamplingParams):
            raise self._invalid(
                "step",
                f"returned sampling_params as {describe(new_params)}; expected "
                "rlhf_core.types.SamplingParams or a dict",
            )
        try:
            done = bool(result["done"])
        except Exception as exc:
            raise self._invalid("step", f"returned 'done' that is not a bool: {exc}") from None
        return done, feedback, new_params


def fit_feedback(
    ids: list[int], images: list[ImageInput], room: int, image_token_id: int | None
) -> tuple[list[int], list[ImageInput]]:
    """The longest prefix of ``ids`` (image tokens expanded) within ``room`` tokens that cuts no image in two,
    and the images whose tokens it holds: an image that does not fit ends the prefix before it."""
    if not images:
        return ids[:room], []
    kept: list[ImageInput] = []
    end = 0  # the prefix is ids[:end]
    while end < min(len(ids), room):
        if ids[end] != image_token_id:
            end += 1
            continue
        image = images[len(kept)]
        if end + image.num_tokens > room:
            break
        kept.append(image)
        end += image.num_tokens
    return ids[:end], kept
