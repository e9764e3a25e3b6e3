"""The rollout worker: runs every episode of a batch of prompts concurrently, then scores them in batches.
It is a plain class; the RL trainer hosts one per rollout engine inside a Ray actor (``arollout`` for an
async actor, ``rollout`` otherwise). Nothing here imports Ray."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Sequence
from typing import Any

from rlhf_agents.checks import describe, log_failure_once
from rlhf_agents.executors import AgentExecutorBase, TokenTrace, encode
from rlhf_agents.plugin import build_executor
from rlhf_agents.rewards import build_reward_source
from rlhf_core.config import distills_only
from rlhf_core.errors import UserError
from rlhf_core.plugins import get_plugin_manager
from rlhf_core.rollout.async_engine import AsyncEngine
from rlhf_core.types import RewardRequest, RewardResult, RewardSource, SamplingParams, Trajectory, derive_seed
from rlhf_core.vision import collapse_image_tokens

logger = logging.getLogger(__name__)

PromptRow = tuple[str, list[int], Any, Any, list]
"""A prompt as the worker reads it: ``(text, ids, label, uid, images)``."""


class RolloutFailureError(UserError, RuntimeError):
    """Too many samples of one step could not be scored (``--reward.max_failure_fraction``)."""


def retokenization_drift(tokenizer: Any, ids: list[int]) -> int | None:
    """Where re-tokenizing the decoded text of ``ids`` first differs from ``ids``; None when it does not.
    Decoding keeps special tokens and encoding adds none, so only genuine text-level drift (merges across
    turn boundaries, normalisation, lost bytes) shows up."""
    again = encode(tokenizer, tokenizer.decode(ids, skip_special_tokens=False))
    if again == ids:
        return None
    return next((k for k, (a, b) in enumerate(zip(ids, again)) if a != b), min(len(ids), len(again)))


async def _gather_all(jobs: Sequence[Awaitable[Trajectory]]) -> list[Trajectory]:
    """Run ``jobs`` concurrently; on the first failure cancel the rest and raise it."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class EngineClock:
    """The rollout engine as one episode sees it, timing how long the episode waits for it: the rest of the
    episode's time is its agent's own (:meth:`RolloutWorker._bounded_episode` bounds that)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.waited, self.since = 0.0, 0.0
        # generate calls of the episode not yet answered (an agent may make several at once)
        self.in_flight = 0

    async def generate(self, request: Any) -> Any:
        if self.in_flight == 0:
            self.since = time.monotonic()
        self.in_flight += 1
        try:
            return await self.engine.generate(request)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.waited += time.monotonic() - self.since

    def agent_seconds(self, start: float) -> float:
        """Seconds since ``start`` not spent waiting for the engine."""
        now = time.monotonic()
        return now - start - self.waited - (now - self.since if self.in_flight else 0.0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def read_prompt_row(row: Any, row_index: int, tokenizer: Any) -> PromptRow:
    """A prompt row as a :data:`PromptRow`: the text is tokenized, or the ids decoded."""
    if not isinstance(row, dict):
        raise TypeError(
            f"prompt row {row_index} is a {describe(row)}; expected a dict with 'prompt_text' or 'prompt_ids'"
        )
    text, ids = row.get("prompt_text"), row.get("prompt_ids")
    if text is None and ids is None:
        raise ValueError(
            f"prompt row {row_index} has neither 'prompt_text' nor 'prompt_ids' (keys: {sorted(row)})"
        )
    if ids is None:
        ids = encode(tokenizer, text)
    elif text is None:
        text = tokenizer.decode(ids, skip_special_tokens=False)
    return (
        text,
        list(ids),
        row.get("label"),
        row.get("prompt_uid", row_index),
        list(row.get("images") or []),
    )


def rollout_metrics(
    trajectories: list[Trajectory], drifted: int | None, generate_s: float, reward_s: float
) -> dict[str, float]:
    """The metrics of one rollout call: means over samples, and counts of the per-sample flags."""
    n = len(trajectories)
    rewards = [t.reward for t in trajectories if t.reward is not None]
    metrics = {
        "rollout/samples": float(n),
        "rollout/response_length": _mean([len(t.response_ids) for t in trajectories]),
        "rollout/action_tokens": _mean([sum(t.action_mask) for t in trajectories]),
        "rollout/truncated_fraction": _mean([float(t.truncated) for t in trajectories]),
        "reward/mean": _mean(rewards),
        "score/mean": _mean([t.score for t in trajectories if t.score is not None]),
        "reward/unscorable": float(n - len(rewards)),
        "reward/unscorable_fraction": (n - len(rewards)) / n if n else 0.0,
        "timing/generate_s": generate_s,
        "timing/reward_s": reward_s,
    }
    if drifted is not None:
        metrics["tokenize/drift_samples"] = float(drifted)
    logged: dict[str, list[float]] = {}
    for t in trajectories:
        for key, value in t.extra_logs.items():
            logged.setdefault(key, []).append(value)
    for key, values in logged.items():
        # error/* and tokenize/drift are per-sample flags: their sum is the count
        metrics[key] = float(sum(values)) if key.startswith(("error/", "tokenize/")) else _mean(values)
    return metrics


def reward_request(pending: list[Trajectory], tokenizer: Any, image_processing: Any) -> RewardRequest:
    """The reward request for ``pending``: each query is its prompt and response as text, special tokens kept
    (a vision-language model's image tokens collapsed to one placeholder per image, as in the prompt text)."""
    decode = tokenizer.decode

    def query(t: Trajectory) -> str:
        ids = t.prompt_ids + t.response_ids
        if image_processing is not None:
            ids = collapse_image_tokens(ids, image_processing.image_token_id)
        return decode(ids, skip_special_tokens=False)

    return RewardRequest(
        queries=[query(t) for t in pending],
        prompts=[t.prompt_text for t in pending],
        labels=[t.label for t in pending],
        prompt_ids=[list(t.prompt_ids) for t in pending],
        response_ids=[list(t.response_ids) for t in pending],
        finish_reasons=[t.finish_reason for t in pending],
        responses=[decode(t.response_ids, skip_special_tokens=True) for t in pending],
    )


def apply_rewards(pending: list[Trajectory], result: RewardResult, where: str) -> None:
    """Write reward source ``where``'s ``result`` into ``pending``; a sample it gave no reward gets its error."""
    if len(result.rewards) != len(pending) or len(result.scores) != len(pending):
        raise ValueError(
            f"reward source {where} returned {len(result.rewards)} rewards and "
            f"{len(result.scores)} scores for {len(pending)} samples"
        )
    for k, traj in enumerate(pending):
        traj.reward = result.rewards[k]
        if traj.reward is None:
            traj.error = (result.errors[k] if result.errors else None) or f"{where} gave no reward"
            traj.extra_logs["error/reward"] = 1.0
        else:
            traj.score = result.scores[k] if result.scores[k] is not None else traj.reward
        logs = result.extra_logs.items()
        traj.extra_logs.update({key: float(values[k]) for key, values in logs if values[k] is not None})


def check_failures(
    trajectories: list[Trajectory], step: int, max_fraction: float, sources: list[str]
) -> None:
    """Raise :class:`RolloutFailureError` when more than ``max_fraction`` of the samples could not be scored,
    with their causes, first errors and ``sources`` (what produced them)."""
    failed = [t for t in trajectories if t.reward is None]
    if not trajectories or len(failed) / len(trajectories) <= max_fraction:
        return
    causes = Counter(k.removeprefix("error/") for t in failed for k in t.extra_logs if k.startswith("error/"))
    first_errors = list(dict.fromkeys(t.error for t in failed if t.error))[:3]
    raise RolloutFailureError(
        f"step {step}: {len(failed)} of {len(trajectories)} samples could not be scored, more than "
        f"--reward.max_failure_fraction {max_fraction:g}"
        + (f" ({'; '.join(sources)})" if sources else "")
        + f". Causes: {dict(causes) or 'unknown'}. First errors:\n  "
        + "\n  ".join(first_errors)
    )


class RolloutWorker:
    """Collects experience: ``rollout(prompts, sampling, step) -> list[Trajectory]``, ``sampling.n`` samples
    per prompt (the package README, "Using the worker", gives their seeds and order). ``engine`` has ``async
    generate(GenerationRequest) -> list[GenerationOutput]``; a synchronous ``RolloutEngine`` is wrapped in
    ``AsyncEngine``. Each prompt row is a dict with ``prompt_text`` and/or ``prompt_ids`` (ids are used
    verbatim; text is tokenized once without special tokens), and optionally ``label``, ``prompt_uid`` and
    ``images`` (the prompt's ``ImageInput`` s, shared by all its samples). ``last_metrics`` holds the metrics
    of the latest call."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        executor: AgentExecutorBase,
        reward_source: RewardSource | None,
        cfg: Any,
        image_processing: Any = None,
    ):
        if not inspect.iscoroutinefunction(getattr(engine, "generate", None)):
            engine = AsyncEngine(engine)
        self.engine = engine
        self.tokenizer = tokenizer
        self.executor = executor
        self.reward_source = reward_source
        if executor.env_step_timeout is None:
            executor.env_step_timeout = cfg.train.env_step_timeout
        executor.image_processing = image_processing
        self.max_len = cfg.data.max_len
        self.seed = cfg.train.seed
        self.max_failure_fraction = cfg.reward.max_failure_fraction
        self.check_retokenization = cfg.train.check_retokenization
        self.agent_file = cfg.train.agent_func_path
        self.agent_command = cfg.train.agent_command
        self.episode_timeout = cfg.train.episode_timeout
        self.distills_only = distills_only(cfg)
        self.last_metrics: dict[str, float] = {}
        self._drift_warned = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_config(
        cls,
        cfg: Any,
        engine: Any,
        tokenizer: Any,
        pm: Any = None,
        reward_model_handle: Any = None,
        image_processing: Any = None,
    ) -> RolloutWorker:
        """Executor and reward source resolved by name through the plugins of this process;
        ``image_processing``: a vision-language model's ``rlhf_core.vision.ImageProcessing``."""
        pm = pm if pm is not None else get_plugin_manager()
        reward_source = build_reward_source(cfg, pm, reward_model_handle=reward_model_handle)
        return cls(engine, tokenizer, build_executor(cfg, pm), reward_source, cfg, image_processing)

    # --- the public calls ---------------------------------------------------------------------------

    def rollout(self, prompts: Sequence[dict], sampling: SamplingParams, step: int) -> list[Trajectory]:
        """:meth:`arollout` on the worker's own event loop (kept between calls: sessions and servers live on it)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(self.arollout(prompts, sampling, step))

    async def arollout(
        self, prompts: Sequence[dict], sampling: SamplingParams, step: int
    ) -> list[Trajectory]:
        start = time.perf_counter()
        rows = [read_prompt_row(row, row_index, self.tokenizer) for row_index, row in enumerate(prompts)]
        trajectories = await _gather_all(
            [
                self._episode(
                    row, i, dataclasses.replace(sampling, n=1, seed=derive_seed(self.seed, step, row[3], i))
                )
                for row in rows
                for i in range(sampling.n)
            ]
        )
        generated = time.perf_counter()
        await self._score(trajectories)
        scored = time.perf_counter()
        drifted = sum(self._check_drift(t) for t in trajectories) if self.check_retokenization else None
        self.last_metrics = rollout_metrics(trajectories, drifted, generated - start, scored - generated)
        sources = [f"reward source: {self._reward_source_name()}"] if self.reward_source is not None else []
        agent = (("file", self.agent_file), ("command", self.agent_command))
        sources += [f"agent {what}: {value}" for what, value in agent if value]
        check_failures(trajectories, step, self.max_failure_fraction, sources)
        return trajectories

    def close(self) -> None:
        if self._loop is not None:
            self._loop.run_until_complete(self.aclose())
            self._loop.close()
            self._loop = None

    async def aclose(self) -> None:
        await self.executor.aclose()
        if self.reward_source is not None:
            await self.reward_source.aclose()

    # --- the steps ----------------------------------------------------------------------------------

    async def _episode(self, row: PromptRow, index: int, params: SamplingParams) -> Trajectory:
        text, ids, label, uid, images = row
        with_images = (
            {"images": images} if images else {}
        )  # executors written for text models need not take them
        engine = EngineClock(self.engine) if self.episode_timeout else self.engine
        episode = self.executor.execute(
            text, label, params, self.max_len, self.tokenizer, engine, prompt_ids=list(ids), **with_images
        )
        if self.episode_timeout:
            episode = self._bounded_episode(episode, engine, row)
        traj = await episode
        if not isinstance(traj, Trajectory):
            raise TypeError(
                f"{type(self.executor).__name__}.execute returned a {describe(traj)}; expected "
                "an rlhf_core.types.Trajectory"
            )
        traj.prompt_uid, traj.sample_index = uid, index
        traj.prompt_text = traj.prompt_text or text
        traj.label = label if traj.label is None else traj.label
        return traj

    async def _bounded_episode(self, episode: Awaitable[Any], clock: EngineClock, row: PromptRow) -> Any:
        """The executor's ``episode`` of prompt ``row`` (on ``clock``), ended once its own time (not counting its
        waits for the engine) passes ``--train.episode_timeout``: then unscorable, counted in
        ``error/episode_timeout``."""
        text, ids, label, _, images = row
        start = time.monotonic()
        task = asyncio.ensure_future(episode)
        while (left := self.episode_timeout - clock.agent_seconds(start)) > 0:
            done, _ = await asyncio.wait({task}, timeout=left)
            if done:
                return task.result()
        task.cancel()
        where = f"agent file {self.agent_file}" if self.agent_file else type(self.executor).__name__
        message = (
            f"{where}: an episode ran longer than --train.episode_timeout {self.episode_timeout:g} s "
            f"outside the rollout engine; it was ended"
        )
        log_failure_once(logger, where, message)
        return TokenTrace(list(ids)).to_trajectory(
            finish_reason="abort",
            prompt_text=text,
            label=label,
            error=message,
            extra_logs={"error/episode_timeout": 1.0},
            images=list(images),
        )

    async def _score(self, trajectories: list[Trajectory]) -> None:
        """Score, in one batched call, every sample that has neither a reward nor an error yet."""
        pending = [t for t in trajectories if t.reward is None and t.error is None]
        if not pending:
            return
        if self.reward_source is None and self.distills_only:
            for traj in pending:  # on-policy distillation without a task reward: the teacher is the signal
                traj.reward = traj.score = 0.0
            return
        if self.reward_source is None:
            raise ValueError(
                f"{len(pending)} samples need a reward but no reward source is configured: set "
                f"--reward.remote_url (a reward .py file or http URLs) or --reward.model_name_or_path"
            )
        result = await self.reward_source.score(
            reward_request(pending, self.tokenizer, self.executor.image_processing)
        )
        apply_rewards(pending, result, self._reward_source_name())

    def _reward_source_name(self) -> str:
        return getattr(self.reward_source, "description", type(self.reward_source).__name__)

    def _check_drift(self, traj: Trajectory) -> bool:
        ids = traj.prompt_ids + traj.response_ids
        pos = retokenization_drift(self.tokenizer, ids)
        if pos is None:
            return False
        traj.extra_logs["tokenize/drift"] = 1.0
        if not self._drift_warned:
            self._drift_warned = True
            again = encode(self.tokenizer, self.tokenizer.decode(ids, skip_special_tokens=False))
            shown, redone = ids[pos : pos + 6], again[pos : pos + 6]
            logger.warning(
                "re-tokenizing the text of sample %s/%s changes its tokens from position %d (prompt has %d): "
                "ids %s became %s, i.e. %r became %r. Training uses the rollout's token ids, so this only "
                "matters for code that works on text (reward functions, chat templates). Further drift is "
                "counted in tokenize/drift_samples, not logged.",
                traj.prompt_uid,
                traj.sample_index,
                pos,
                len(traj.prompt_ids),
                shown,
                redone,
                self.tokenizer.decode(shown),
                self.tokenizer.decode(redone),
            )
        return True
