"""Policy losses ``ppo`` and ``gspo``, rollout/train mismatch correction, and the entropy term. Positions
outside ``action_mask`` are replaced before any arithmetic, so padding may hold anything and gets no
gradient. The metrics are listed in ``docs/algorithms.md`` §4.3.
"""

from __future__ import annotations

import torch

from rlhf_algos.aggregation import aggregate
from rlhf_core.types import LossAggregation, LossOutput, PolicyLossInput

IS_CORRECTION_TYPES = ("tis", "icepop", "seq-mask-tis")


def rollout_correction_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    kind: str,
    threshold: tuple[float, float] = (0.5, 5.0),
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights ``[B, T]`` (detached) correcting for the rollout engine's sampling distribution.

    With ``rho_t = exp(old_logp_t - rollout_logp_t)`` and ``(lo, hi) = threshold``:

    - ``tis`` (truncated IS):    ``w_t = clamp(rho_t, lo, hi)``
    - ``icepop``:                ``w_t = rho_t * 1[lo <= rho_t <= hi]``        (tokens outside are dropped)
    - ``seq-mask-tis``:          ``w_t = clamp(rho_t, lo, hi) * 1[lo <= s <= hi]``, with
      ``s = exp(mean_t(old_logp - rollout_logp))`` the sequence's geometric-mean ratio. OpenRLHF's code
      multiplies by the unclamped ``rho_t`` although its comment says truncated; we truncate.

    Returns ``(w, metrics)``: ``is_weight_mean/min/max`` over action tokens, ``is_masked_ratio`` (tokens
    zeroed by icepop or the sequence mask) and ``is_truncated_ratio`` (tokens whose ``rho`` was clamped).
    """
    if kind not in IS_CORRECTION_TYPES:
        raise ValueError(
            f"unknown IS correction {kind!r} (--algo.advantage.is_correction_type); "
            f"choose one of {', '.join(IS_CORRECTION_TYPES)}"
        )
    lo, hi = threshold
    mask = action_mask.bool()
    with torch.no_grad():
        log_rho = torch.where(mask, old_logprobs.float() - rollout_logprobs.float(), 0.0)
        rho = log_rho.exp()
        in_range = (rho >= lo) & (rho <= hi)
        if kind == "tis":
            w, keep = rho.clamp(lo, hi), torch.ones_like(mask)
        elif kind == "icepop":
            w, keep = torch.where(in_range, rho, 0.0), in_range
        else:
            seq = (log_rho.sum(-1) / mask.sum(-1).clamp(min=1)).exp()
            keep = ((seq >= lo) & (seq <= hi))[:, None].expand_as(mask)
            w = torch.where(keep, rho.clamp(lo, hi), 0.0)
        w = torch.where(mask, w, 0.0)
        n = mask.sum().clamp(min=1)
        metrics = {
            "is_weight_mean": float(w.sum() / n),
            "is_weight_min": float(torch.where(mask, w, torch.inf).min()) if mask.any() else 0.0,
            "is_weight_max": float(torch.where(mask, w, -torch.inf).max()) if mask.any() else 0.0,
            "is_masked_ratio": float((mask & ~keep).sum() / n),
            "is_truncated_ratio": float((mask & keep & ~in_range).sum() / n) if kind != "icepop" else 0.0,
        }
    return w, metrics


def _clipped_surrogate(
    batch: PolicyLossInput, ratio: torch.Tensor, weights: torch.Tensor | None, metrics: dict[str, float]
) -> LossOutput:
    """The clipped surrogate ``-min(r A, clip(r) A)``, dual clip, weights, aggregation (both losses)."""
    mask = batch.action_mask.bool()
    adv = torch.where(mask, batch.advantages.float(), 0.0)
    s1 = ratio * adv
    s2 = ratio.clamp(1 - batch.eps_clip_low, 1 + batch.eps_clip_high) * adv
    surrogate = torch.minimum(s1, s2)
    if batch.dual_clip is not None:
        if batch.dual_clip <= 1:
            raise ValueError(f"--actor.dual_clip must be > 1, got {batch.dual_clip}")
        # for negative advantages the ratio is unbounded above; cap the loss at c * |A| (Ye et al. 2020)
        floored = torch.maximum(surrogate, batch.dual_clip * adv)
        with torch.no_grad():
            metrics["dual_clip_ratio"] = aggregate(((adv < 0) & (floored > surrogate)).float(), mask).item()
        surrogate = torch.where(adv < 0, floored, surrogate)
    loss = -surrogate
    if weights is not None:
        loss = loss * weights
    with torch.no_grad():
        metrics["clip_ratio"] = aggregate((s2 < s1).float(), mask).item()
        metrics["ppo_kl"] = aggregate(batch.old_logprobs.float() - batch.logprobs.float(), mask).item()
        if batch.rollout_logprobs is not None:
            rollout_kl = batch.rollout_logprobs.float() - batch.old_logprobs.float()
            metrics["rollout_kl"] = aggregate(rollout_kl, mask).item()
    return LossOutput(loss=aggregate(loss, mask, batch.aggregation), metrics=metrics)


def ppo_loss(batch: PolicyLossInput) -> LossOutput:
    """PPO clipped surrogate (Schulman et al. 2017, https://arxiv.org/abs/1707.06347), per token::

        r_t  = exp(clamp(logp_t - old_logp_t, -20, 20))
        L_t  = -min(r_t A_t, clamp(r_t, 1 - eps_low, 1 + eps_high) A_t)
        dual clip c > 1 (Ye et al. 2020, https://arxiv.org/abs/1912.09729):
        L_t  = -max(min(...), c A_t)   where A_t < 0
        IS correction (batch.is_correction): L_t *= w_t from :func:`rollout_correction_weights`
        loss = aggregate(L, action_mask, batch.aggregation)

    Asymmetric bounds (``eps_clip_low != eps_clip_high``) give DAPO's clip-higher
    (https://arxiv.org/abs/2503.14476).
    """
    mask = batch.action_mask.bool()
    log_ratio = torch.where(mask, batch.logprobs.float() - batch.old_logprobs.float(), 0.0)
    ratio = log_ratio.clamp(-20.0, 20.0).exp()
    weights, metrics = None, {}
    if batch.is_correction is not None:
        if batch.rollout_logprobs is None:
            raise ValueError("IS correction (--algo.advantage.is_correction_enable) needs rollout_logprobs")
        weights, metrics = rollout_correction_weights(
            batch.old_logprobs, batch.rollout_logprobs, mask, batch.is_correction, batch.is_threshold
        )
    return _clipped_surrogate(batch, ratio, weights, metrics)


def gspo_loss(batch: PolicyLossInput) -> LossOutput:
    """GSPO (Zheng et al. 2025, https://arxiv.org/abs/2507.18071): the PPO clip on a sequence-level ratio::

        s_i = exp(clamp(sum_t m_it (logp_it - base_it) / max(sum_t m_it, 1), -20, 20))
        base = rollout_logp when batch.is_correction is set, else old_logp     (as OpenRLHF)
        L_it = -min(s_i A_it, clamp(s_i, 1 - eps_low, 1 + eps_high) A_it)

    Every token of a sequence shares ``s_i``; the gradient reaching each token is ``s_i A / |y_i|``. With IS
    correction the ratio is taken against the engine's log-probs directly, so no extra weight is applied.
    OpenRLHF always aggregates GSPO per sequence: the registered object's ``default_loss_agg_mode`` is
    ``seq_mean_token_mean`` for the trainer to use when ``--actor.loss_agg_mode`` is not given.
    """
    mask = batch.action_mask.bool()
    if batch.is_correction is not None and batch.rollout_logprobs is None:
        raise ValueError("IS correction (--algo.advantage.is_correction_enable) needs rollout_logprobs")
    base = batch.rollout_logprobs if batch.is_correction is not None else batch.old_logprobs
    log_ratio = torch.where(mask, batch.logprobs.float() - base.float(), 0.0)
    seq_log_ratio = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)
    ratio = seq_log_ratio.clamp(-20.0, 20.0).exp()[:, None].expand_as(log_ratio)
    return _clipped_surrogate(batch, ratio, None, {})


ppo_loss.default_loss_agg_mode = "token_mean"  # type: ignore[attr-defined]
gspo_loss.default_loss_agg_mode = "seq_mean_token_mean"  # type: ignore[attr-defined]

POLICY_LOSSES = {"ppo": ppo_loss, "gspo": gspo_loss}


def entropy_loss(
    entropy: torch.Tensor,
    action_mask: torch.Tensor,
    entropy_coef: float,
    aggregation: LossAggregation | None = None,
) -> torch.Tensor:
    """The entropy bonus as a term to *add* to the loss: ``-entropy_coef * aggregate(H, mask)``.

    ``entropy`` ``[B, T]`` comes from :func:`rlhf_algos.logits.entropy_from_logits` (with gradients);
    use the policy loss's ``aggregation`` so grad-accumulation stays exact. ``--actor.entropy_coef``;
    with coefficient 0 the trainer only logs ``aggregate(H)``.
    """
    return -entropy_coef * aggregate(entropy, action_mask, aggregation)
