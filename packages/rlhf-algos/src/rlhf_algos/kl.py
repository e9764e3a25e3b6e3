"""KL(policy || reference) per token, as a loss term, and the KL coefficient controllers
(``docs/algorithms.md`` §3 compares the estimators). The estimators do not mask: padding positions hold
whatever the inputs give, and the consumers (the estimator's reward folding, :func:`kl_loss`) ignore them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlhf_algos.aggregation import aggregate
from rlhf_core.config import KLConfig
from rlhf_core.types import LossAggregation

KL_CLAMP = 10.0


def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``clamp(logp - ref_logp, -10, 10)``; ``[B, T] -> [B, T]``."""
    return (logprobs.float() - ref_logprobs.float()).clamp(-KL_CLAMP, KL_CLAMP)


def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``clamp((logp - ref_logp)**2 / 2, -10, 10)``; ``[B, T] -> [B, T]``."""
    return ((logprobs.float() - ref_logprobs.float()).square() / 2).clamp(-KL_CLAMP, KL_CLAMP)


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``clamp(exp(-d) - 1 + d, -10, 10)`` with ``d = logp - ref_logp``; ``[B, T] -> [B, T]``.

    ``d`` is clamped to ``[-20, 20]`` before the exponential. This changes no value (``k3`` already
    exceeds 10 for ``d < -2.6`` or ``d > 11``) but keeps ``exp`` finite, so the gradient stays 0 instead
    of ``0 * inf = NaN`` where the output is clamped (OpenRLHF lets it overflow: issue #525).
    """
    d = (logprobs.float() - ref_logprobs.float()).clamp(-20.0, 20.0)
    return (torch.exp(-d) - 1 + d).clamp(-KL_CLAMP, KL_CLAMP)


KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: dict[str, KLFn] = {"k1": k1, "k2": k2, "k3": k3}


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    estimator: str | KLFn = "k3",
    aggregation: LossAggregation | None = None,
) -> torch.Tensor:
    """KL as a loss term (``--algo.kl.use_loss``): ``aggregate(k(logp, ref_logp), mask)``, a scalar.

    The trainer adds ``kl_coef * kl_loss(...)`` to the policy loss, with the same ``aggregation`` as the
    policy loss. ``estimator`` is a built-in name or any registered KL estimator.
    """
    fn = KL_ESTIMATORS[estimator] if isinstance(estimator, str) else estimator
    return aggregate(fn(logprobs, ref_logprobs), action_mask, aggregation)


class FixedKLController:
    """A constant KL coefficient (``--algo.kl.init_coef`` without ``--algo.kl.target``)."""

    def __init__(self, init_coef: float):
        self.value = float(init_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Does nothing; present so the trainer treats both controllers alike."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """The proportional controller of Ziegler et al. 2019 (https://arxiv.org/abs/1909.08593).

    After each rollout batch, with ``current_kl`` the measured mean KL per sequence and ``n_steps`` the
    number of samples in the batch::

        e = clip(current_kl / target - 1, -0.2, 0.2)
        value *= 1 + e * n_steps / horizon

    Flags: ``--algo.kl.init_coef`` (initial value), ``--algo.kl.target``, ``--algo.kl.horizon``.
    """

    def __init__(self, init_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target} and {horizon}")
        super().__init__(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        # load_state_dict (inherited) reads the coefficient only: target and horizon stay as configured
        return {"value": self.value, "target": self.target, "horizon": self.horizon}


def make_kl_controller(kl: KLConfig) -> FixedKLController | AdaptiveKLController:
    """The controller of the ``--algo.kl.*`` section: adaptive when ``target`` is set, else fixed, as OpenRLHF
    chooses."""
    if kl.target:
        return AdaptiveKLController(kl.init_coef, kl.target, kl.horizon)
    return FixedKLController(kl.init_coef)
