"""Preference losses: DPO / IPO / cDPO (+ NLL term), KTO, and the pairwise reward-model loss. Every log-prob
argument is ``[B]``, the **sum** over one response's tokens, and every loss the mean over the ``B`` pairs (or
samples) of the micro-batch (``docs/algorithms.md`` §9).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf_core.types import LossOutput


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    ipo: bool = False,
) -> LossOutput:
    """DPO (https://arxiv.org/abs/2305.18290), cDPO and IPO (https://arxiv.org/abs/2310.12036)::

        x    = (pi_c - pi_r) - (ref_c - ref_r)
        DPO  = -log sigmoid(beta x)                                              label_smoothing = 0
        cDPO = -(1 - eps) log sigmoid(beta x) - eps log sigmoid(-beta x)          eps = label_smoothing
        IPO  = (x - 1 / (2 beta))^2                                               ipo = True
        loss = mean over the B pairs

    Flags: ``--model.beta``, ``--model.label_smoothing``, ``--model.ipo_enable``. Metrics: implicit rewards
    ``beta (pi - ref)`` averaged (``chosen_reward``, ``rejected_reward``), ``reward_margin``,
    ``reward_accuracy`` (fraction of pairs whose chosen reward is the larger).
    """
    x = (policy_chosen_logps.float() - policy_rejected_logps.float()) - (
        ref_chosen_logps.float() - ref_rejected_logps.float()
    )
    if ipo:
        losses = (x - 1 / (2 * beta)).square()
    else:
        eps = label_smoothing
        losses = -F.logsigmoid(beta * x) * (1 - eps) - F.logsigmoid(-beta * x) * eps
    with torch.no_grad():
        chosen = beta * (policy_chosen_logps.float() - ref_chosen_logps.float())
        rejected = beta * (policy_rejected_logps.float() - ref_rejected_logps.float())
        metrics = {
            "chosen_reward": chosen.mean().item(),
            "rejected_reward": rejected.mean().item(),
            "reward_margin": (chosen - rejected).mean().item(),
            "reward_accuracy": (chosen > rejected).float().mean().item(),
        }
    return LossOutput(loss=losses.mean(), metrics=metrics)


def nll_loss(chosen_logps: torch.Tensor, chosen_num_tokens: torch.Tensor) -> torch.Tensor:
    """The NLL term of DPO (``--model.nll_loss_coef``): ``-mean_i(chosen_logps_i / chosen_num_tokens_i)``.

    ``chosen_logps`` ``[B]`` summed log-probs of the chosen responses, ``chosen_num_tokens`` ``[B]`` their
    lengths: the negative mean per-token log-likelihood. The trainer adds ``nll_loss_coef * nll_loss``.
    """
    return -(chosen_logps.float() / chosen_num_tokens.float().clamp(min=1)).mean()


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor | float,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> LossOutput:
    """KTO (Ethayarajh et al. 2024, https://arxiv.org/abs/2402.01306)::

        z      = clamp(kl, min=0)            (detached)
        logr_i = pi_i - ref_i
        L_i    = w_d * (1 - sigmoid(beta (logr_i - z)))      desirable_i
        L_i    = w_u * (1 - sigmoid(beta (z - logr_i)))      otherwise
        loss   = mean_i L_i

    ``desirable`` ``[B]`` bool. ``kl`` is the reference point: the mean of ``pi_KL - ref_KL`` over
    mismatched (prompt, completion) pairs of the batch. This function does no communication: the caller
    computes the local mean, all-reduces it (sum / world size) across data-parallel ranks, and passes the
    result, as OpenRLHF's removed KTO trainer did. Flags: ``--model.beta``, ``--model.desirable_weight``,
    ``--model.undesirable_weight``.
    """
    z = torch.as_tensor(kl, dtype=torch.float32, device=policy_logps.device).detach().clamp(min=0)
    logr = policy_logps.float() - ref_logps.float()
    desirable = desirable.bool()
    losses = torch.where(
        desirable,
        desirable_weight * (1 - torch.sigmoid(beta * (logr - z))),
        undesirable_weight * (1 - torch.sigmoid(beta * (z - logr))),
    )
    with torch.no_grad():
        rewards = beta * logr
        metrics = {
            "kl": float(z),
            "chosen_reward": rewards[desirable].mean().item() if desirable.any() else 0.0,
            "rejected_reward": rewards[~desirable].mean().item() if (~desirable).any() else 0.0,
        }
    return LossOutput(loss=losses.mean(), metrics=metrics)


def rm_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    margin: torch.Tensor | None = None,
    loss_type: str = "sigmoid",
) -> LossOutput:
    """Pairwise (Bradley-Terry) reward-model loss on scalar rewards ``[B]``::

        d       = r_c - r_r - margin                 (margin [B], 0 when None)
        sigmoid = mean(-log sigmoid(d))
        logexp  = mean(log(1 + exp(-d)))             computed as softplus(-d)

    The two are the same function of ``d``; both names are kept for ``--model.loss_type``. Unlike
    OpenRLHF, ``logexp`` honours the margin (OpenRLHF drops it) and cannot overflow (OpenRLHF evaluates
    ``exp`` directly). Pass ``margin`` only with ``--model.margin_loss_enable``. Metrics: ``accuracy``
    (fraction with ``r_c > r_r``) and ``reward_margin`` (mean ``r_c - r_r``).
    """
    if loss_type not in ("sigmoid", "logexp"):
        raise ValueError(f"unknown reward-model loss {loss_type!r} (--model.loss_type): sigmoid or logexp")
    diff = chosen_rewards.float() - rejected_rewards.float()
    d = diff - margin.float() if margin is not None else diff
    losses = -F.logsigmoid(d) if loss_type == "sigmoid" else F.softplus(-d)
    with torch.no_grad():
        metrics = {"accuracy": (diff > 0).float().mean().item(), "reward_margin": diff.mean().item()}
    return LossOutput(loss=losses.mean(), metrics=metrics)
