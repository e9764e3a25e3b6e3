"""Reward sources: a Python reward file, HTTP reward servers, a reward model, and weighted combinations. Every
source scores a whole :class:`~rlhf_core.types.RewardRequest` (a batch) and returns one entry per sample; a
sample it cannot score gets ``reward`` None and an ``error`` (package README, "Writing a reward function")."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import inspect
import json
import logging
import math
import random
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import urlparse

from rlhf_agents.checks import check_reward_value, describe, log_failure_once, to_float
from rlhf_agents.executors import call_user
from rlhf_agents.loading import UserCodeError, load_symbol
from rlhf_agents.reward_model import RewardModelScorer
from rlhf_core.config_parser import ConfigError, redact_text
from rlhf_core.plugins import PluginError, collect, get_plugin_manager, resolve
from rlhf_core.supervised import is_prm_model
from rlhf_core.types import RewardRequest, RewardResult, RewardSource

logger = logging.getLogger(__name__)


class RewardContractError(Exception):
    """A reward call's output cannot be matched to its samples (wrong length or type)."""


class RewardRequestError(Exception):
    """An HTTP reward request failed for good (a 4xx answer, or every attempt failed)."""


# --- checking outputs -------------------------------------------------------------------------------------


def _as_list(value: Any, n: int, where: str, key: str) -> list[Any]:
    if hasattr(value, "tolist") and hasattr(value, "shape"):  # torch tensor or numpy array
        value = value.reshape(-1).tolist()
    elif isinstance(value, (list, tuple)):
        value = list(value)
    else:
        raise RewardContractError(
            f"{where}: {key!r} is a {describe(value)}; expected a list or 1-d tensor of {n} numbers"
        )
    if len(value) != n:
        raise RewardContractError(
            f"{where} returned {len(value)} {key} for a batch of {n} samples (expected {n})"
        )
    return value


def parse_reward_output(
    raw: Any, n: int, where: str
) -> tuple[list[Any], list[Any] | None, dict[str, list[Any]]]:
    """Split a reward call's output into per-sample ``rewards``, ``scores`` (or None) and ``extra_logs``.
    Accepts OpenRLHF's ``{"rewards": [n], "scores": [n], "extra_logs": {key: [n]}}`` (lists, tensors or
    arrays) or a bare list/tensor of rewards. Raises RewardContractError on a wrong length or type; per-sample
    values are checked later (None/NaN make only their sample unscorable)."""
    if isinstance(raw, dict):
        if "rewards" not in raw:
            raise RewardContractError(
                f"{where} returned a dict without 'rewards' (keys: {sorted(raw)}); expected "
                f"{{'rewards': [{n} numbers], 'scores': [...], 'extra_logs': {{...}}}}"
            )
        rewards = _as_list(raw["rewards"], n, where, "rewards")
        scores = None if raw.get("scores") is None else _as_list(raw["scores"], n, where, "scores")
        extra_raw = raw.get("extra_logs") or {}
    elif isinstance(raw, (list, tuple)) or hasattr(raw, "shape"):
        rewards, scores, extra_raw = _as_list(raw, n, where, "rewards"), None, {}
    else:
        raise RewardContractError(
            f"{where} returned a {describe(raw)}; expected a dict with 'rewards' (a list or tensor of {n} "
            "numbers)"
        )
    extra: dict[str, list[Any]] = {}
    if not isinstance(extra_raw, dict):
        log_failure_once(
            logger, where, f"'extra_logs' is a {describe(extra_raw)}, not a dict; it is not logged"
        )
        extra_raw = {}
    for key, values in extra_raw.items():
        try:
            extra[key] = _as_list(values, n, where, f"extra_logs[{key!r}]")
        except RewardContractError as exc:  # a logging problem must not cost the rewards
            log_failure_once(logger, where, f"{exc}; it is not logged")
    return rewards, scores, extra


def empty_result(n: int) -> RewardResult:
    return RewardResult(rewards=[None] * n, scores=[None] * n, extra_logs={}, errors=[None] * n)


def fail_samples(
    result: RewardResult, indices: Iterable[int], where: str, message: str, exc: BaseException | None = None
) -> RewardResult:
    """Make the samples ``indices`` of ``result`` unscorable with ``message``, logged once per ``where``."""
    log_failure_once(logger, where, message, exc)
    for i in indices:
        result.errors[i] = message
    return result


def fill_result(
    result: RewardResult,
    indices: Sequence[int],
    parsed: tuple[list[Any], list[Any] | None, dict[str, list[Any]]],
    where: str,
) -> None:
    """Write parsed outputs for the samples ``indices`` of ``result``; None/NaN/Inf/non-numbers become errors."""
    rewards, scores, extra = parsed
    n_total = len(result.rewards)
    for j, i in enumerate(indices):
        reward, why = check_reward_value(rewards[j])
        score, why_score = (reward, None) if scores is None else check_reward_value(scores[j], "score")
        why = why or why_score
        if why is not None:
            result.errors[i] = f"{where}: {why}"
            log_failure_once(logger, where, why)
            continue
        result.rewards[i], result.scores[i] = reward, score
        for key, values in extra.items():
            with contextlib.suppress(TypeError):  # non-numeric log values are dropped
                result.extra_logs.setdefault(key, [None] * n_total)[i] = to_float(values[j])


def subset(request: RewardRequest, indices: Sequence[int]) -> RewardRequest:
    """The samples ``indices`` of ``request`` (list fields that are empty stay empty)."""
    n = len(request.queries)
    return RewardRequest(
        **{
            k: [v[i] for i in indices] if isinstance(v, list) and len(v) == n else v
            for k, v in vars(request).items()
        }
    )


# --- a Python reward file -------------------------------------------------------------------------------------


class PythonFileRewardSource(RewardSource):
    """``reward_func(queries, prompts, labels, **kwargs)`` from a Python file (or the function itself,
    ``func``: the Python API's ``reward_func=``), called on batches as the package README ("Writing a reward
    function") describes: the kwargs its signature names, and a batch that raises retried in halves."""

    KWARGS = ("prompt_ids", "response_ids", "finish_reasons", "responses")

    def __init__(
        self,
        path: str | None,
        timeout: float | None = None,
        flag: str = "--reward.remote_url",
        func: Any = None,
    ):
        self.path = path
        self.timeout = timeout
        if func is None:
            func = load_symbol(path, "reward_func", flag)
            where, self.description = f"{flag} {path}: reward_func", f"reward_func in {path}"
        elif callable(func):
            where = self.description = (
                f"reward_func= {getattr(func, '__qualname__', type(func).__qualname__)}"
            )
        else:
            where = "reward_func="
        if not callable(func):
            raise UserCodeError(f"{where} is a {describe(func)}, not a function")
        self.func = func
        sig = inspect.signature(func)
        params = sig.parameters.values()
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
        named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        self.kwargs = [k for k in self.KWARGS if takes_any or k in named]
        try:
            sig.bind([], [], [], **dict.fromkeys(self.kwargs, []))
        except TypeError as exc:
            raise UserCodeError(
                f"{where}{sig} cannot be called as reward_func(queries, prompts, labels, **kwargs) with kwargs "
                f"from {list(self.KWARGS)}: {exc}"
            ) from None

    async def score(self, request: RewardRequest) -> RewardResult:
        result = empty_result(len(request.queries))
        if request.queries:
            await self._score_part(request, list(range(len(request.queries))), result)
        return result

    async def _score_part(self, request: RewardRequest, indices: list[int], result: RewardResult) -> None:
        part, where = subset(request, indices), self.description
        split = False  # whether the batch raised and is scored again in halves
        call = call_user(
            self.func, part.queries, part.prompts, part.labels, **{k: getattr(part, k) for k in self.kwargs}
        )
        try:
            parsed = parse_reward_output(await asyncio.wait_for(call, self.timeout), len(indices), where)
        except RewardContractError as exc:
            fail_samples(result, indices, where, str(exc))
        except asyncio.TimeoutError:
            fail_samples(
                result, indices, where, f"{where} took longer than --reward.timeout {self.timeout:g} s"
            )
        except Exception as exc:
            split = len(indices) > 1
            if not split:
                fail_samples(result, indices, where, f"{where} raised {type(exc).__name__}: {exc}", exc)
        else:
            fill_result(result, indices, parsed, where)
        # The batch raised: find the samples that raise, the rest still get scored. Outside the except block,
        # so that the exception of one sample is not chained to those of the batch and of every half above it.
        if split:
            half = len(indices) // 2
            await self._score_part(request, indices[:half], result)
            await self._score_part(request, indices[half:], result)


# --- HTTP reward servers --------------------------------------------------------------------------------------

RETRIED_4XX = (408, 429)  # 4xx answers that mean "try again later" (request timeout, rate limit)


class HttpRewardSource(RewardSource):
    """POSTs ``{"query", "prompts", "labels"}`` to reward servers and reads ``{"rewards", "scores",
    "extra_logs"}``, in requests of at most ``request_batch_size`` samples, each to the URL with the fewest in
    flight, retried on another URL when there is one (batching and retries: package README, "Other sources")."""

    def __init__(
        self,
        urls: Sequence[str],
        timeout: float = 180.0,
        max_attempts: int = 5,
        max_concurrency: int = 32,
        request_batch_size: int = 64,
        backoff_base: float = 0.5,
        backoff_max: float = 30.0,
    ):
        if not urls:
            raise ValueError("HttpRewardSource needs at least one URL")
        for url in urls:
            if urlparse(url).scheme not in ("http", "https"):
                raise ValueError(f"--reward.remote_url {redact_text(url)}: not an http(s) URL")
        self.urls = list(urls)
        self.description = ", ".join(redact_text(u) for u in self.urls)  # for messages: no credentials
        self.timeout = timeout
        self.max_attempts = max(1, max_attempts)
        self.max_concurrency = max(1, max_concurrency)
        self.request_batch_size = max(1, request_batch_size)
        self.backoff_base, self.backoff_max = backoff_base, backoff_max
        self._in_flight = dict.fromkeys(self.urls, 0)
        self._turn = 0
        self._session: Any = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None

    def _client(self) -> Any:
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session_loop = loop  # a session belongs to the loop it was made on
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                connector=aiohttp.TCPConnector(limit=self.max_concurrency),
            )
            self._slots = asyncio.Semaphore(self.max_concurrency)
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def score(self, request: RewardRequest) -> RewardResult:
        n = len(request.queries)
        result = empty_result(n)
        size = max(1, min(self.request_batch_size, math.ceil(n / len(self.urls))))
        chunks = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
        await asyncio.gather(*(self._score_chunk(request, chunk, result) for chunk in chunks))
        return result

    async def _score_chunk(self, request: RewardRequest, indices: list[int], result: RewardResult) -> None:
        part = subset(request, indices)
        payload = {"query": part.queries, "prompts": part.prompts, "labels": part.labels}
        try:
            raw, url = await self.post(payload)
            parsed = parse_reward_output(raw, len(indices), f"reward server {redact_text(url)}")
        except (RewardRequestError, RewardContractError, TypeError) as exc:  # TypeError: labels not JSON
            fail_samples(result, indices, self.description, str(exc))
            return
        fill_result(result, indices, parsed, f"reward server {redact_text(url)}")

    def _pick_url(self, avoid: str | None) -> str:
        candidates = [u for u in self.urls if u != avoid] or self.urls
        least = min(self._in_flight[u] for u in candidates)
        ties = [u for u in candidates if self._in_flight[u] == least]
        self._turn += 1
        return ties[self._turn % len(ties)]

    async def post(self, payload: dict) -> tuple[Any, str]:
        """POST ``payload`` with retries; returns the decoded JSON answer and the URL that gave it."""
        import aiohttp

        session = self._client()
        assert self._slots is not None
        body = json.dumps(payload)
        url: str | None = None
        last = ""
        for attempt in range(self.max_attempts):
            url = self._pick_url(avoid=url)
            shown = redact_text(url)
            self._in_flight[url] += 1
            status = None
            try:
                async with self._slots:
                    async with session.post(
                        url, data=body, headers={"Content-Type": "application/json"}
                    ) as resp:
                        status, text = resp.status, await resp.text()
            except asyncio.TimeoutError:
                last = f"{shown}: no answer within --reward.timeout {self.timeout:g} s"
            except aiohttp.ClientError as exc:
                last = f"{shown}: {type(exc).__name__}: {redact_text(str(exc))}"
            finally:
                self._in_flight[url] -= 1
            if status is not None:
                if status < 400:
                    try:
                        return json.loads(text), url
                    except ValueError:
                        raise RewardRequestError(
                            f"reward server {shown} answered {status} with a body that "
                            f"is not JSON: {text[:200]!r}"
                        ) from None
                last = f"{shown}: status {status}: {text[:200]!r}"
                if status < 500 and status not in RETRIED_4XX:
                    raise RewardRequestError(
                        f"reward server {shown} refused the request (not retried): "
                        f"status {status}: {text[:200]!r}"
                    )
            if attempt + 1 < self.max_attempts:
                await asyncio.sleep(random.uniform(0, min(self.backoff_max, self.backoff_base * 2**attempt)))
        raise RewardRequestError(
            f"reward server request failed after {self.max_attempts} attempts; last attempt: {last}"
        )


# --- a reward model -----------------------------------------------------------------------------------------


class RewardModelSource(RewardSource):
    """Scores token ids (prompt + response, never re-tokenized) with ``handle.compute_rewards(list[list[int]])
    -> list[float]``: the RL trainer's Ray reward-model workers, or a :class:`RewardModelScorer` in-process."""

    def __init__(self, handle: Any, description: str = "reward model"):
        if not callable(getattr(handle, "compute_rewards", None)):
            raise TypeError(f"a reward-model handle needs a compute_rewards method; got {describe(handle)}")
        self.handle = handle
        self.description = description

    async def score(self, request: RewardRequest) -> RewardResult:
        n = len(request.queries)
        result = empty_result(n)
        if len(request.prompt_ids) != n or len(request.response_ids) != n:
            raise ValueError(
                f"{self.description} scores token ids: the request must carry prompt_ids and response_ids"
            )
        sequences = [list(p) + list(r) for p, r in zip(request.prompt_ids, request.response_ids)]
        try:
            raw = await call_user(self.handle.compute_rewards, sequences)
            parsed = parse_reward_output(raw, n, self.description)
        except Exception as exc:
            return fail_samples(
                result,
                range(n),
                self.description,
                f"{self.description} failed: {type(exc).__name__}: {exc}",
                exc,
            )
        fill_result(result, range(n), parsed, self.description)
        return result


# --- several sources, weighted -----------------------------------------------------------------------------


class WeightedRewardSource(RewardSource):
    """``reward = sum_k w_k * r_k`` (and likewise the score) over named sources, each logged on its own as
    ``extra_logs["reward/<name>"]``. A sample that any source cannot score is unscorable."""

    def __init__(self, parts: Sequence[tuple[str, float, RewardSource]]):
        self.parts = list(parts)
        self.description = " + ".join(
            f"{w:g} * {getattr(src, 'description', name)}" for name, w, src in self.parts
        )

    async def score(self, request: RewardRequest) -> RewardResult:
        results = await asyncio.gather(*(src.score(request) for _, _, src in self.parts))
        n = len(request.queries)
        out = empty_result(n)
        for (name, _, _), res in zip(self.parts, results):
            out.extra_logs[f"reward/{name}"] = list(res.rewards)
            out.extra_logs.update({f"{name}/{key}": list(values) for key, values in res.extra_logs.items()})
        for i in range(n):
            total, total_score = 0.0, 0.0
            for (name, weight, _), res in zip(self.parts, results):
                if res.rewards[i] is None:
                    out.errors[i] = f"reward source {name!r}: {res.errors[i] if res.errors else 'no reward'}"
                    break
                total += weight * res.rewards[i]
                total_score += weight * (res.rewards[i] if res.scores[i] is None else res.scores[i])
            else:
                out.rewards[i], out.scores[i] = total, total_score
        return out

    async def aclose(self) -> None:
        for _, _, src in self.parts:
            await src.aclose()


# --- factories (what rlhf-agents registers) and building from the config --------------------------------------


def remote_entries(reward_cfg: Any) -> list[str]:
    """The comma-separated entries of ``--reward.remote_url``."""
    return [e.strip() for e in (reward_cfg.remote_url or "").split(",") if e.strip()]


def is_http(entry: str) -> bool:
    return entry.startswith(("http://", "https://"))


class PythonFileRewardFactory:
    """``--reward.remote_url path/to/reward.py``, or the Python API's ``reward_func=`` (``reward.func``)."""

    def accepts(self, cfg: Any) -> bool:
        entries = remote_entries(cfg.reward)
        return cfg.reward.func is not None or (len(entries) == 1 and entries[0].endswith(".py"))

    def create(self, cfg: Any) -> RewardSource:
        path = None if cfg.reward.func is not None else remote_entries(cfg.reward)[0]
        return PythonFileRewardSource(path, timeout=cfg.reward.timeout, func=cfg.reward.func)

    def check(self, cfg: Any) -> None:
        self.create(cfg)  # imports the file and checks reward_func's signature: cheap, starts nothing


class HttpRewardFactory:
    """``--reward.remote_url http://host:port/get_reward[,http://...]``: one server's replicas, load-balanced."""

    def accepts(self, cfg: Any) -> bool:
        entries = remote_entries(cfg.reward)
        return bool(entries) and all(is_http(e) for e in entries)

    def create(self, cfg: Any) -> RewardSource:
        r = cfg.reward
        return HttpRewardSource(
            remote_entries(r),
            timeout=r.timeout,
            max_attempts=r.max_retries,
            max_concurrency=r.max_concurrency,
            request_batch_size=r.request_batch_size,
        )

    def check(self, cfg: Any) -> None:
        self.create(cfg)  # checks the URLs; no connection is made before the first request


class RewardModelFactory:
    """``--reward.model_name_or_path``: the RL trainer's reward-model workers, or the model in-process."""

    def accepts(self, cfg: Any) -> bool:
        path = cfg.reward.model_name_or_path
        return (
            bool(path) and not remote_entries(cfg.reward) and not is_prm_model(path)
        )  # a PRM has its own source

    def create(self, cfg: Any, reward_model_handle: Any = None) -> RewardSource:
        handle = RewardModelScorer.from_config(cfg) if reward_model_handle is None else reward_model_handle
        return RewardModelSource(handle, description=f"reward model {cfg.reward.model_name_or_path}")


def _create(factory: Any, cfg: Any, reward_model_handle: Any) -> RewardSource:
    if (
        reward_model_handle is not None
        and "reward_model_handle" in inspect.signature(factory.create).parameters
    ):
        return factory.create(cfg, reward_model_handle=reward_model_handle)
    return factory.create(cfg)


def _pick(factories: dict[str, Any], cfg: Any) -> Any:
    accepted = [name for name, reg in factories.items() if reg.obj.accepts(cfg)]
    what = redact_text(
        cfg.reward.remote_url or f"--reward.model_name_or_path {cfg.reward.model_name_or_path}"
    )
    if not accepted:
        raise PluginError(
            f"no reward source accepts {what!r} (registered: {', '.join(sorted(factories)) or 'none'}); a "
            f"reward file must end in .py and a reward server URL start with http:// or https://"
        )
    if len(accepted) > 1:
        raise PluginError(
            f"reward sources {accepted} all accept {what!r}; pick one with --reward.source NAME"
        )
    return factories[accepted[0]].obj


def _entry_name(entry: str | None, taken: set[str]) -> str:
    if entry is None:
        base = "reward_model"
    elif is_http(entry):
        host = urlparse(entry)
        base = f"{host.hostname}:{host.port}" if host.port else str(host.hostname)  # not user:password@
    else:
        base = entry.rsplit("/", 1)[-1].removesuffix(".py")
    name, k = base, 2
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


def reward_plan(cfg: Any, pm: Any = None) -> list[tuple[str | None, float | None, Any, Any]]:
    """The reward sources the config names, as ``(name, weight, factory, cfg for it)``; empty when it names none
    (e.g. agents that reward themselves). Raises, naming the flag at fault, when they cannot be told apart.

    - ``--reward.source NAME``: that registered source.
    - ``--reward.remote_url``: a ``.py`` reward file, or http(s) URLs of one reward server (load-balanced).
    - ``--reward.model_name_or_path``: a reward model.
    - ``--reward.weights w1,w2,...``: each remote_url entry (then the reward model, when set) is its own
      source, combined as a weighted sum; name and weight are None for a single unweighted source."""
    pm = pm if pm is not None else get_plugin_manager()
    reward = cfg.reward
    if reward.func is not None:
        other = [
            f"--reward.{k}" for k in ("remote_url", "model_name_or_path", "source") if getattr(reward, k)
        ]
        if other:
            raise ConfigError(
                f"reward_func= and {other[0]} both give the reward: give one (a reward function may "
                "call another source itself)"
            )
        return [(None, None, _pick(collect(pm, "reward_sources"), cfg), cfg)]
    if reward.source:
        return [(None, None, resolve(pm, "reward_sources", reward.source, flag="--reward.source"), cfg)]
    entries: list[str | None] = list(remote_entries(reward))
    if reward.model_name_or_path:
        if entries and reward.weights is None:
            logger.warning(
                "--reward.remote_url is the reward source; --reward.model_name_or_path is not "
                "scored (give --reward.weights to combine them)"
            )
        else:
            entries.append(None)  # the reward model
    if not entries:
        return []
    factories = collect(pm, "reward_sources")
    if reward.weights is None:
        if len(entries) > 1 and not all(e is not None and is_http(e) for e in entries):
            raise ConfigError(
                f"--reward.remote_url {redact_text(reward.remote_url)} lists {len(entries)} reward sources: give "
                f"--reward.weights with one weight each to combine them (several http URLs of one reward "
                f"server are load-balanced and need no weights)"
            )
        return [(None, None, _pick(factories, cfg), cfg)]
    if len(reward.weights) != len(entries):
        raise ConfigError(
            f"--reward.weights has {len(reward.weights)} weights for {len(entries)} reward sources "
            f"({', '.join(e or '--reward.model_name_or_path' for e in entries)})"
        )
    plan, taken = [], set()
    for entry, weight in zip(entries, reward.weights):
        sub = copy.copy(cfg)
        model = reward.model_name_or_path if entry is None else None
        sub.reward = dataclasses.replace(reward, remote_url=entry, model_name_or_path=model, weights=None)
        plan.append((_entry_name(entry, taken), float(weight), _pick(factories, sub), sub))
    return plan


def check_reward_config(cfg: Any, pm: Any = None) -> None:
    """Check in the driver, before any worker starts (and in ``--dry-run``), that the reward sources the config
    names exist and can be built: each factory's optional ``check(cfg)`` (the reward file is imported and
    ``reward_func``'s signature read; URLs are parsed). Raises a UserError naming the flag or file at fault."""
    for _, _, factory, sub in reward_plan(cfg, pm):
        if hasattr(factory, "check"):
            factory.check(sub)


def build_reward_source(cfg: Any, pm: Any = None, reward_model_handle: Any = None) -> RewardSource | None:
    """The reward source of :func:`reward_plan`, or None when the config names none; a reward model uses
    ``reward_model_handle`` (the trainer's reward-model workers) when given, else loads in this process."""
    sources = [
        (name, weight, _create(factory, sub, reward_model_handle))
        for name, weight, factory, sub in reward_plan(cfg, pm)
    ]
    if len(sources) == 1 and sources[0][1] is None:  # one source, unweighted
        return sources[0][2]
    return WeightedRewardSource(sources) if sources else None
