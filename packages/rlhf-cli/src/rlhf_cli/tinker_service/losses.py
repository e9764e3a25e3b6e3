"""The Tinker SDK's built-in losses (``forward_backward(data, loss_fn=...)``) as pure functions of per-token
tensors, and the ``tinker`` loss that runs them inside the learner's ranks (registered in
``rlhf_train_deepspeed.losses.LOSSES`` on import).

Shapes: ``lp`` ``[B, T]`` the model's log-probs of each datum's target tokens (zero past a datum's end),
``mask`` ``[B, T]`` 1 on a datum's positions, and the datum inputs padded the same way: ``weights``,
``logprobs`` (the sampler's, ``q``), ``advantages`` ``A``. Every loss is a sum over tokens, not a mean:
Tinker's convention (the client scales its weights or advantages to normalise)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_core.batches import SequenceBatch

INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
}
"""Each served loss and the ``loss_fn_inputs`` it takes (all of them required)."""
CONFIG = {"ppo": {"clip_low_threshold", "clip_high_threshold"}, "dro": {"beta"}}
CONFIG["cispo"] = CONFIG["ppo"]
REFUSED = {
    "gspo": "its sequence-level ratio (and the sequence_ratio_mask input) is not specified precisely enough "
    "to reproduce Tinker's numbers; write it with forward_backward_custom",
    "stable_reinforce": "it needs the sampler's stability records, which this service does not keep",
    "custom": "server-side custom losses are not served; forward_backward_custom runs them in the client",
}


def cross_entropy(lp: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``-sum(weights * lp)``."""
    return -(weights * lp).sum()


def importance_sampling(lp, q, adv, mask) -> torch.Tensor:
    """REINFORCE corrected for the sampler: ``-sum(exp(lp - q) * A)``."""
    return -(torch.exp(lp - q) * adv * mask).sum()


def ppo(lp, q, adv, mask, low: float, high: float) -> torch.Tensor:
    """Token-wise clipped objective with absolute ratio bounds ``r = exp(lp - q)``:
    ``-sum(min(r * A, clamp(r, low, high) * A))``."""
    ratio = torch.exp(lp - q)
    return -(torch.minimum(ratio * adv, ratio.clamp(low, high) * adv) * mask).sum()


def cispo(lp, q, adv, mask, low: float, high: float) -> torch.Tensor:
    """The clipped ratio as a constant weight on the log-likelihood: ``-sum(sg(clamp(r, low, high)) * lp * A)``."""
    weight = torch.exp(lp - q).clamp(low, high).detach()
    return -(weight * lp * adv * mask).sum()


def dro(lp, q, adv, mask, beta: float) -> torch.Tensor:
    """``-sum(lp * A - beta / 2 * (lp - q)^2)``."""
    return -((lp * adv - 0.5 * beta * (lp - q) ** 2) * mask).sum()


@dataclass
class TinkerLossConfig:
    name: str
    clip_low_threshold: float = 0.8
    clip_high_threshold: float = 1.2
    beta: float | None = None


def tinker_objective(cfg: TinkerLossConfig, lp, mask, weights, q, adv) -> torch.Tensor:
    """The loss ``cfg.name`` of log-probs ``lp`` (the module docstring's shapes)."""
    if cfg.name == "cross_entropy":
        return cross_entropy(lp, weights)
    if cfg.name == "importance_sampling":
        return importance_sampling(lp, q, adv, mask)
    if cfg.name == "dro":
        return dro(lp, q, adv, mask, cfg.beta)
    clipped = {"ppo": ppo, "cispo": cispo}[cfg.name]
    return clipped(lp, q, adv, mask, cfg.clip_low_threshold, cfg.clip_high_threshold)


@dataclass
class TinkerBatch:
    """Datums as one ``SequenceBatch`` whose response is each datum's target tokens (the prompt is its first
    input token), with their per-token inputs ``[B, T]`` (None where the loss takes none)."""

    seq: SequenceBatch
    weights: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    logprobs_out: list | None = None
    """The loss appends the micro-batch's log-probs here: the learner is in the service's process, and the
    micro-batch reaches the loss with this same list (``to_device`` moves tensors only)."""


def batch_objective(cfg: TinkerLossConfig, lp: torch.Tensor, mb: TinkerBatch) -> torch.Tensor:
    """The loss of the micro-batch ``mb`` given its ``[B, T]`` log-probs ``lp``."""
    mask = mb.seq.response_mask().to(lp.dtype)
    return tinker_objective(cfg, lp, mask, mb.weights, mb.logprobs, mb.advantages)


def tinker(model, mb: TinkerBatch, cfg: TinkerLossConfig, counts: dict[str, float] | None):
    """A ``LOSSES`` entry: the loss summed over the micro-batch, times the data-parallel size so that the
    gradients DeepSpeed averages over ranks are those of the sum."""
    from rlhf_train_deepspeed.models import response_logprobs

    lp, _, mask = response_logprobs(model.engine, mb.seq, 1.0, model.packing, ring=model.ring)
    if mb.logprobs_out is not None:
        mb.logprobs_out.append(lp.detach().cpu())
    return batch_objective(cfg, lp, mb) * (model.dp_size if counts is not None else 1), {}, float(mask.sum())


def register() -> None:
    from rlhf_train_deepspeed.losses import LOSSES

    LOSSES["tinker"] = tinker
