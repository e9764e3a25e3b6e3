"""Turning per-token losses into one scalar: the single ``aggregate`` every loss in this package uses."""

from __future__ import annotations

import torch

from rlhf_core.types import AGGREGATION_MODES, LossAggregation


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: LossAggregation | None = None) -> torch.Tensor:
    """Reduce per-token ``values`` ``[B, T]`` over the tokens where ``mask`` ``[B, T]`` is true.

    With ``m`` the mask, ``L_i = sum_t m_it`` and ``D = agg.dp_size``:

    - ``token_mean``:              ``D * sum_it v_it m_it / N_tok``, ``N_tok = agg.num_tokens``
      (default: ``sum m`` of this batch, at least 1).
    - ``seq_mean_token_mean``:     ``D * sum_i (sum_t v_it m_it / max(L_i, 1)) / N_seq``,
      ``N_seq = agg.num_sequences`` (default: ``B``).
    - ``seq_mean_token_sum_norm``: ``D * sum_it v_it m_it / (N_seq * max_len)``, ``max_len = agg.max_len``
      (default: ``T``); Dr. GRPO uses a constant ``max_len`` (the generation budget).

    ``num_tokens``/``num_sequences`` are the counts of the whole optimizer step, summed over data-parallel
    ranks (``docs/algorithms.md`` §6 says why, and what an engine dividing by the accumulation steps needs).

    Returns a 0-dim tensor in float32 (or the dtype of ``values`` if wider). Values at masked positions are
    ignored entirely, NaN included, and receive no gradient.
    """
    agg = agg or LossAggregation()
    mask = mask.bool()
    # where(), not multiplication: padding may hold inf/NaN (e.g. an exp of garbage log-probs)
    v = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    v = v.float() if v.dtype in (torch.float16, torch.bfloat16) else v
    n_seq = agg.num_sequences if agg.num_sequences is not None else mask.shape[0]
    if agg.mode == "token_mean":
        out = v.sum() / (agg.num_tokens if agg.num_tokens is not None else mask.sum().clamp(min=1))
    elif agg.mode == "seq_mean_token_mean":
        out = (v.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / n_seq
    elif agg.mode == "seq_mean_token_sum_norm":
        out = v.sum() / (n_seq * (agg.max_len if agg.max_len is not None else mask.shape[-1]))
    else:
        raise ValueError(
            f"unknown loss aggregation mode {agg.mode!r} (--actor.loss_agg_mode); "
            f"choose one of {', '.join(AGGREGATION_MODES)}"
        )
    return out * agg.dp_size
