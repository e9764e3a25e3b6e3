"""``aggregate``: hand-worked values, agreement between modes, split and data-parallel invariance."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_algos.aggregation import aggregate
from rlhf_core.types import LossAggregation

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)


def _agg(*args, **kwargs):
    return aggregate(VALUES, MASK, LossAggregation(*args, **kwargs)).item()


def test_hand_computed():
    # action tokens: 1, 2 (row 0) and 4 (row 1)
    assert _agg() == pytest.approx(7 / 3)
    assert _agg("seq_mean_token_mean") == pytest.approx((1.5 + 4) / 2)
    assert _agg("seq_mean_token_sum_norm") == pytest.approx(7 / 6)
    assert _agg("seq_mean_token_sum_norm", max_len=10) == pytest.approx(7 / 20)
    assert _agg(num_tokens=14) == pytest.approx(0.5)
    assert _agg(dp_size=2) == pytest.approx(14 / 3)
    assert _agg("seq_mean_token_mean", num_sequences=5) == pytest.approx(5.5 / 5)
    with pytest.raises(ValueError, match="--actor.loss_agg_mode"):
        aggregate(VALUES, MASK, LossAggregation("token_sum"))


def test_masked_positions_contribute_nothing_not_even_nan():
    v = VALUES.clone().requires_grad_(True)
    poisoned = torch.where(MASK, v, torch.tensor(float("nan")))
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        out = aggregate(poisoned, MASK, LossAggregation(mode))
        assert torch.isfinite(out)
        torch.testing.assert_close(out, aggregate(VALUES, MASK, LossAggregation(mode)))
    aggregate(poisoned, MASK).backward()
    assert (v.grad[~MASK] == 0).all() and (v.grad[MASK] == 1 / 3).all()


def test_empty_mask_gives_zero():
    empty = torch.zeros(2, 3, dtype=torch.bool)
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        assert aggregate(VALUES, empty, LossAggregation(mode)).item() == 0.0


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 6), t=st.integers(1, 8), length=st.integers(1, 8), seed=st.integers(0, 10_000))
def test_equal_lengths_make_token_and_sequence_means_agree(b, t, length, seed):
    length = min(length, t)
    v = torch.randn(b, t, generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(t) < length).expand(b, t)
    tok = aggregate(v, mask)
    torch.testing.assert_close(tok, aggregate(v, mask, LossAggregation("seq_mean_token_mean")))
    # with max_len = the common length, Dr. GRPO's normaliser is the token count too
    dr_grpo = aggregate(v, mask, LossAggregation("seq_mean_token_sum_norm", max_len=length))
    torch.testing.assert_close(tok, dr_grpo)


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(2, 8),
    t=st.integers(1, 8),
    cut=st.integers(1, 7),
    mode=st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]),
    seed=st.integers(0, 10_000),
)
def test_micro_batches_with_global_counts_add_up(b, t, cut, mode, seed):
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(b, t, generator=gen)
    mask = torch.rand(b, t, generator=gen) > 0.4
    cut = min(cut, b - 1)
    agg = LossAggregation(mode, num_tokens=float(mask.sum().clamp(min=1)), num_sequences=float(b), max_len=t)
    local = LossAggregation(mode)
    whole = aggregate(v, mask, local)
    parts = aggregate(v[:cut], mask[:cut], agg) + aggregate(v[cut:], mask[cut:], agg)
    torch.testing.assert_close(parts, whole)


def test_data_parallel_mean_of_rank_gradients_is_the_global_gradient():
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(4, 5, generator=gen, requires_grad=True)
    mask = torch.rand(4, 5, generator=gen) > 0.3
    aggregate(v, mask).backward()
    expected = v.grad.clone()
    v.grad = None
    # two ranks, each with two micro-batches of one row; DP averages the summed rank gradients
    agg = LossAggregation("token_mean", num_tokens=float(mask.sum()), dp_size=2)
    rank_grads = []
    for rank_rows in ((0, 1), (2, 3)):
        for row in rank_rows:
            aggregate(v[row : row + 1], mask[row : row + 1], agg).backward()
        rank_grads.append(v.grad.clone())
        v.grad = None
    torch.testing.assert_close(sum(rank_grads) / 2, expected)
