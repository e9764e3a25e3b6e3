"""A process reward model (trained by ``rlhf train prm``) as a reward source: it scores every step of a
response, and the sample's reward aggregates the step scores (``--reward.prm_aggregation``: ``min`` by
default, as a chain of steps is as sound as its weakest one). docs/prm-and-distillation.md ("A PRM as a
reward source") has the data flow; the PRM runs in the process that scores, not on Ray workers."""

from __future__ import annotations

import asyncio
import itertools
import math
from typing import Any

import torch

from rlhf_agents.reward_model import right_padded
from rlhf_agents.rewards import empty_result, fail_samples, remote_entries
from rlhf_core.config import resolve_param_dtype
from rlhf_core.supervised import (
    PLACEHOLDER_KEY,
    PRM_AGGREGATIONS,
    REWARD_TOKENS_KEY,
    SetupError,
    is_prm_model,
    prm_tokens,
)
from rlhf_core.types import RewardRequest, RewardResult, RewardSource


def aggregate_steps(scores: list[float], how: str) -> float:
    """One reward from the step scores ``s_1..s_n`` (n >= 1): ``min s``, ``s_n``, ``mean s`` or ``prod s``."""
    ways = {"min": min, "last": lambda s: s[-1], "mean": lambda s: sum(s) / len(s), "prod": math.prod}
    if how not in ways:
        raise ValueError(f"--reward.prm_aggregation {how!r}: choose one of {', '.join(PRM_AGGREGATIONS)}")
    return ways[how](scores)


def mark_steps(response: str, separator: str, placeholder: str) -> str:
    """``response`` with ``" " + placeholder`` after every non-empty step (separators kept); unchanged when
    it already holds a marker."""
    if placeholder in response:
        return response
    parts = response.split(separator) if separator else [response]
    return separator.join(f"{p.rstrip()} {placeholder}" if p.strip() else p for p in parts)


class ProcessRewardModel:
    """A PRM in this process: ``step_scores(prompts, responses)`` gives each response's step scores."""

    def __init__(
        self,
        path: str,
        step_separator: str = "\n",
        max_len: int = 2048,
        batch_size: int = 8,
        dtype: str = "fp32",
        device: str | None = None,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rlhf_core.rollout.hf_engine import parse_dtype

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(dtype))
        config = self.model.config
        placeholder, reward_tokens = (
            getattr(config, PLACEHOLDER_KEY, None),
            getattr(config, REWARD_TOKENS_KEY, None),
        )
        if not placeholder:
            raise SetupError(
                f"--reward.model_name_or_path {path}: not a PRM trained by rlhf train prm (its config "
                f"has no {PLACEHOLDER_KEY})"
            )
        if not reward_tokens:
            raise SetupError(
                f"--reward.model_name_or_path {path}: this PRM was trained without --prm.reward_tokens, "
                "so it has no positive token whose probability would score a step"
            )
        self.tokens = prm_tokens(self.tokenizer, placeholder, reward_tokens)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model.to(self.device).eval()
        self.separator, self.max_len, self.batch_size = step_separator, max_len, batch_size
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def step_scores(self, prompts: list[str], responses: list[str]) -> list[list[float]]:
        """Per response, the score of each of its steps (an empty list when it has no step)."""
        seqs, marks = [], []
        for prompt, response in zip(prompts, responses, strict=True):
            head = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
            marked = mark_steps(response, self.separator, self.tokens.placeholder)
            tail = list(self.tokenizer(marked, add_special_tokens=False)["input_ids"])
            ids = (head + tail)[-self.max_len :]
            start = len(ids) - len(tail)  # markers of the prompt (e.g. few-shot examples) are not scored
            seqs.append(ids)
            marks.append([i for i in range(max(start, 0), len(ids)) if ids[i] == self.tokens.placeholder_id])
        out: list[list[float]] = []
        for k in range(0, len(seqs), self.batch_size):
            out += self._score(seqs[k : k + self.batch_size], marks[k : k + self.batch_size])
        return out

    def _score(self, seqs: list[list[int]], marks: list[list[int]]) -> list[list[float]]:
        from rlhf_algos.prm import step_scores

        ids, mask = right_padded(seqs, self.pad_id, self.device)
        rows = torch.tensor([i for i, m in enumerate(marks) for _ in m], dtype=torch.long)
        cols = torch.tensor([p for m in marks for p in m], dtype=torch.long)
        with torch.no_grad():
            logits = self.model(input_ids=ids, attention_mask=mask).logits
            scores = step_scores(logits[rows, cols][:, self.tokens.reward_ids]).tolist()  # [N]
        flat = iter(scores)
        return [list(itertools.islice(flat, len(m))) for m in marks]


class PRMRewardSource(RewardSource):
    """Scores samples with a :class:`ProcessRewardModel`; a sample without a step is unscorable."""

    def __init__(self, prm: ProcessRewardModel, aggregation: str = "min", description: str = "PRM"):
        aggregate_steps([0.0], aggregation)  # an unknown name fails here, before any sample is scored
        self.prm, self.aggregation, self.description = prm, aggregation, description

    async def score(self, request: RewardRequest) -> RewardResult:
        n = len(request.queries)
        result = empty_result(n)
        responses = (
            request.responses
            if len(request.responses) == n
            else [q[len(p) :] if q.startswith(p) else q for q, p in zip(request.queries, request.prompts)]
        )
        try:
            # in a thread: the forward must not block the rollout's event loop
            steps = await asyncio.to_thread(self.prm.step_scores, list(request.prompts), list(responses))
        except Exception as exc:
            return fail_samples(
                result,
                range(n),
                self.description,
                f"{self.description} failed: {type(exc).__name__}: {exc}",
                exc,
            )
        result.step_scores = steps
        logs = {k: [None] * n for k in ("prm/steps", "prm/min_step", "prm/mean_step", "prm/last_step")}
        for i, s in enumerate(steps):
            logs["prm/steps"][i] = float(len(s))
            if not s:
                result.errors[i] = f"{self.description}: the response has no step to score"
                continue
            result.rewards[i] = result.scores[i] = aggregate_steps(s, self.aggregation)
            logs["prm/min_step"][i], logs["prm/mean_step"][i], logs["prm/last_step"][i] = (
                min(s),
                sum(s) / len(s),
                s[-1],
            )
        result.extra_logs = logs
        return result


class PRMRewardFactory:
    """``--reward.model_name_or_path`` naming a PRM trained by ``rlhf train prm`` (or ``--reward.source prm``)."""

    def accepts(self, cfg: Any) -> bool:
        return not remote_entries(cfg.reward) and is_prm_model(cfg.reward.model_name_or_path)

    def create(self, cfg: Any) -> RewardSource:
        r = cfg.reward
        separator = r.prm_step_separator.encode("latin-1", "backslashreplace").decode("unicode_escape")
        prm = ProcessRewardModel(
            r.model_name_or_path,
            step_separator=separator,
            max_len=cfg.data.max_len,
            batch_size=cfg.rollout.micro_batch_size,
            dtype=resolve_param_dtype(cfg.ds.param_dtype),
        )
        return PRMRewardSource(prm, r.prm_aggregation, description=f"PRM {r.model_name_or_path}")
