"""Reward shaping before the advantage estimator: length penalties, normalisation, dynamic filtering, in the
order of ``docs/algorithms.md`` §1. All functions return new tensors and leave their inputs alone.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def overlong_penalty(
    rewards: torch.Tensor,
    response_lengths: torch.Tensor,
    max_new_tokens: int,
    buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong punishment (https://arxiv.org/abs/2503.14476), ``[B] -> [B]``::

        exceed = min(len - (max_new_tokens - buffer_len), buffer_len)
        r      = r - exceed / buffer_len * penalty_factor        where exceed > 0

    ``response_lengths`` ``[B]`` counts generated (action) tokens. Flags: ``--reward.overlong_buffer_len``,
    ``--reward.overlong_penalty_factor``, ``--rollout.max_new_tokens``.
    """
    if not 0 < buffer_len <= max_new_tokens:
        raise ValueError(
            f"--reward.overlong_buffer_len must be in (0, max_new_tokens = {max_new_tokens}], "
            f"got {buffer_len}"
        )
    exceed = (response_lengths.float() - (max_new_tokens - buffer_len)).clamp(max=buffer_len)
    return rewards.float() - exceed.clamp(min=0) / buffer_len * penalty_factor


def stop_properly_penalty(rewards: torch.Tensor, truncated: torch.Tensor, coef: float) -> torch.Tensor:
    """ProRL's penalty for samples cut off at the length limit (https://arxiv.org/abs/2505.24864), ``[B]``::

        coef in [0, 1]:  r = coef * r     where truncated (finish_reason == "length")
        coef < 0:        r = coef         where truncated

    Flag: ``--reward.stop_properly_penalty_coef``. A coefficient above 1 would reward truncation: refused.
    """
    if coef > 1:
        raise ValueError(f"--reward.stop_properly_penalty_coef must be <= 1 (or negative), got {coef}")
    r = rewards.float()
    penalised = r * coef if coef >= 0 else torch.full_like(r, coef)
    return torch.where(truncated.bool(), penalised, r)


def dynamic_filter(
    scores: torch.Tensor,
    n_samples_per_prompt: int,
    score_range: tuple[float, float] = (0.0, 1.0),
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """DAPO dynamic sampling: indices ``[G']`` (int64, ascending) of the prompt groups to keep.

    ``scores`` ``[B]``, rows ``[g*n, (g+1)*n)`` forming group ``g``. A group is kept when the mean score of
    its valid samples lies strictly inside ``score_range`` (``lo < mean < hi``): groups that are all
    solved or all failed carry no signal for group baselines. Invalid samples (``valid`` False, or a
    non-finite score) are left out of the mean; a group without a valid sample is dropped. The pass rate
    ``len(kept) / G`` is what OpenRLHF logs as ``dynamic_filtering_pass_rate``.
    Flags: ``--algo.dynamic_filtering_enable``, ``--algo.dynamic_filtering_range``.
    """
    n = n_samples_per_prompt
    if scores.numel() % n:
        raise ValueError(f"{scores.numel()} scores do not form groups of n_samples_per_prompt = {n}")
    v = torch.isfinite(scores) if valid is None else valid.bool() & torch.isfinite(scores)
    s, v = torch.where(v, scores.double(), 0.0).view(-1, n), v.view(-1, n)
    k = v.sum(-1)
    mean = s.sum(-1) / k.clamp(min=1)
    lo, hi = score_range
    keep = (k > 0) & (mean > lo) & (mean < hi)
    return keep.nonzero().flatten()


class RunningMeanStd:
    """Running mean and standard deviation of a stream of scalars (e.g. rewards), for normalisation.

    ``update`` merges a batch with Chan et al.'s parallel formula in float64; non-finite values (the NaN
    of unscorable samples) are ignored. ``normalize(x) = (x - mean) / max(std, eps)``, std being the
    population std. ``state_dict()`` is ``{"count", "mean", "var"}``; a fixed normaliser (as a reward
    model's eval-set statistics under ``--reward.normalize_enable``) is
    ``load_state_dict({"count": 1, "mean": mu, "var": sigma**2})`` and no further ``update``.
    """

    def __init__(self, eps: float = 1e-8):
        self.count = 0.0
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the mean
        self.eps = eps

    @property
    def var(self) -> float:
        """Population variance of everything seen (0 before anything was)."""
        return self.m2 / self.count if self.count > 0 else 0.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().double().flatten()
        x = x[torch.isfinite(x)]
        n = x.numel()
        if n == 0:
            return
        batch_mean = float(x.mean())
        batch_m2 = float((x - batch_mean).square().sum())
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / max(self.std, self.eps)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean, "var": self.var}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count, self.mean = float(state["count"]), float(state["mean"])
        self.m2 = float(state["var"]) * self.count
