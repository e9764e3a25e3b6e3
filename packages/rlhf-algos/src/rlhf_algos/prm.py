"""The process reward model (PRM) loss: a causal LM learns to emit a reward token after every step marker."""

from __future__ import annotations

import torch

from rlhf_algos.aggregation import aggregate
from rlhf_core.types import LossAggregation, LossOutput


def prm_loss(
    step_logits: torch.Tensor,
    classes: torch.Tensor,
    soft_labels: torch.Tensor,
    aggregation: LossAggregation | None = None,
) -> LossOutput:
    """Cross-entropy at the ``N`` step markers of a micro-batch, over ``K`` candidate next tokens.

    ``step_logits`` ``[N, K]``: the LM's logits *at* each placeholder position (the prediction of the token
    after it), restricted to the reward tokens (``K`` = their number; the whole vocabulary when none are
    given). ``classes`` ``[N]`` long: the index of the labelled token among the ``K``. ``soft_labels``
    ``[N]`` float: NaN for a hard label, else the probability ``p`` in [0, 1] of the first (positive) of
    exactly two reward tokens. With ``q = log_softmax(step_logits)``::

        hard step:  l_n = -q[n, classes_n]
        soft step:  l_n = -(p_n q[n, 0] + (1 - p_n) q[n, 1])
        loss = aggregate(l, all steps, aggregation)     (default: the mean over the N steps)

    ``aggregation.num_tokens`` set to the step count of the whole optimizer step gives exact gradient
    accumulation. Metrics: ``acc``, the fraction of steps whose argmax over the ``K`` logits is the labelled
    class (for a soft label: class 0 when ``p >= 0.5``, else 1), and ``prm_loss`` (the plain step mean).
    """
    q = torch.log_softmax(step_logits.float(), dim=-1)  # [N, K]
    hard = -q.gather(1, classes.long()[:, None]).squeeze(1)
    soft = torch.isfinite(soft_labels)
    per_step = hard
    if bool(soft.any()):
        if q.shape[1] != 2:
            raise ValueError(
                f"soft PRM labels need exactly 2 reward tokens (positive, negative); got {q.shape[1]}"
            )
        p = torch.where(soft, soft_labels, torch.zeros_like(soft_labels)).float()
        per_step = torch.where(soft, -(p * q[:, 0] + (1 - p) * q[:, 1]), hard)
    loss = aggregate(per_step[None, :], torch.ones_like(per_step, dtype=torch.bool)[None, :], aggregation)
    with torch.no_grad():
        target = torch.where(soft, (soft_labels < 0.5).long(), classes.long())
        n = max(per_step.numel(), 1)
        metrics = {
            "acc": float((step_logits.argmax(-1) == target).float().sum()) / n,
            "prm_loss": float(per_step.sum()) / n,
        }
    return LossOutput(loss=loss, metrics=metrics)


def step_scores(step_logits: torch.Tensor) -> torch.Tensor:
    """The PRM's score of each step: ``softmax(step_logits)[:, 0]``, the probability of the positive (first)
    reward token among the ``K`` reward tokens; ``[N, K] -> [N]`` float32."""
    return torch.softmax(step_logits.float(), dim=-1)[:, 0]
