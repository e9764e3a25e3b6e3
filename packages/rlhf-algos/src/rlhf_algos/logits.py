"""Per-token quantities from model logits: the log-prob of the taken token, and the entropy."""

from __future__ import annotations

import torch


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[label]``: ``[B, T, V]`` logits and ``[B, T]`` labels -> ``[B, T]`` float32.

    Computed as ``logits[label] - logsumexp(logits)`` in float32, without materialising the full
    log-softmax. Divide ``logits`` by the sampling temperature first, so the result is comparable with the
    engine's log-probs.
    """
    logits = logits.float()
    picked = logits.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per position: ``[B, T, V] -> [B, T]`` float32, differentiable.

    ``H = logsumexp(z) - sum_v softmax(z)_v z_v``, which equals ``-sum p log p`` and stays finite when some
    probabilities underflow to 0 (where ``p log p`` would give ``0 * -inf``). Logits must be finite.
    """
    z = logits.float()
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)
