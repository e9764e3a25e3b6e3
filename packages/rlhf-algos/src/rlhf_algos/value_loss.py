"""The critic's loss, with PPO-style value clipping."""

from __future__ import annotations

import torch

from rlhf_algos.aggregation import aggregate
from rlhf_core.types import LossAggregation, LossOutput


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    value_clip: float | None = 0.5,
    aggregation: LossAggregation | None = None,
) -> LossOutput:
    """Clipped value loss, all inputs ``[B, T]`` (``values`` carries gradients)::

        V_clip = V_old + clamp(V - V_old, -eps, eps)
        loss   = 0.5 * aggregate(max((V_clip - R)^2, (V - R)^2), mask)
        without clipping (value_clip None): 0.5 * aggregate((V - R)^2, mask)

    ``eps`` is ``--critic.value_clip`` (0.5). Taking the max makes the clip pessimistic: it only removes
    gradient where a step would move V further than ``eps`` *and* that move reduces the error.
    Metrics: ``value_clip_ratio``, the fraction of action tokens where the clipped term is the larger one.
    """
    mask = action_mask.bool()
    v = torch.where(mask, values.float(), 0.0)
    v_old = torch.where(mask, old_values.float(), 0.0)
    ret = torch.where(mask, returns.float(), 0.0)
    unclipped = (v - ret).square()
    metrics = {}
    if value_clip is None:
        per_token = unclipped
    else:
        clipped = (v_old + (v - v_old).clamp(-value_clip, value_clip) - ret).square()
        per_token = torch.maximum(clipped, unclipped)
        with torch.no_grad():
            metrics["value_clip_ratio"] = aggregate((clipped > unclipped).float(), mask).item()
    return LossOutput(loss=0.5 * aggregate(per_token, mask, aggregation), metrics=metrics)
