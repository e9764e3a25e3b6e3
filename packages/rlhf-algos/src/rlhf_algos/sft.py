"""The supervised fine-tuning loss."""

from __future__ import annotations

import torch

from rlhf_algos.aggregation import aggregate
from rlhf_core.types import LossAggregation


def sft_loss(
    logprobs: torch.Tensor, loss_mask: torch.Tensor, aggregation: LossAggregation | None = None
) -> torch.Tensor:
    """Negative log-likelihood of the target tokens: ``aggregate(-logp, loss_mask, aggregation)``, a scalar.

    ``logprobs`` ``[B, T]`` per-token log-probs of the labels (from
    :func:`rlhf_algos.logits.logprobs_from_logits`); ``loss_mask`` ``[B, T]`` true on the trained tokens
    (responses, or everything in pretrain mode).

    - default: the token mean over this micro-batch, ``-sum(logp m) / sum(m)``;
    - exact gradient accumulation: ``LossAggregation(num_tokens=<masked tokens of the whole step, all
      ranks>, dp_size=<ranks>)``, so micro-batches with different token counts weigh every token alike;
    - plain sum: ``LossAggregation(num_tokens=1)``.
    """
    return aggregate(-logprobs.float(), loss_mask, aggregation)
