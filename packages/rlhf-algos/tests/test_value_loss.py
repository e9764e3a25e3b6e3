"""The clipped value loss."""

from __future__ import annotations

import pytest
import torch

from rlhf_algos.value_loss import value_loss
from rlhf_core.types import LossAggregation


def test_clipped_hand_computed():
    v = torch.tensor([[1.0, 2.0, 0.0, 42.0]], requires_grad=True)
    old = torch.tensor([[0.0, 2.0, 0.0, -7.0]])
    ret = torch.tensor([[2.0, 0.0, 0.3, 1e9]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    out = value_loss(v, old, ret, mask, value_clip=0.5)
    # t0: V_clip = 0.5, (0.5-2)^2 = 2.25 > (1-2)^2 = 1;  t1: 4 vs 4;  t2: 0.09 vs 0.09
    torch.testing.assert_close(out.loss, torch.tensor(0.5 * (2.25 + 4.0 + 0.09) / 3))
    assert out.metrics["value_clip_ratio"] == pytest.approx(1 / 3)
    out.loss.backward()
    # t0: the clipped branch wins and its clamp is active -> no gradient;  t1: (V - R) / 3;  t2: -0.3 / 3
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, 2.0 / 3, -0.1, 0.0]]))


def test_the_clip_only_removes_gradient_that_would_reduce_the_error():
    # V moved beyond the clip but *away* from the return: the unclipped error is larger and keeps gradient
    v = torch.tensor([[2.0]], requires_grad=True)
    out = value_loss(v, torch.tensor([[0.0]]), torch.tensor([[-1.0]]), torch.ones(1, 1, dtype=torch.bool))
    torch.testing.assert_close(out.loss, torch.tensor(0.5 * 9.0))
    out.loss.backward()
    torch.testing.assert_close(v.grad, torch.tensor([[3.0]]))


def test_unclipped_and_aggregation():
    v = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    ret = torch.tensor([[0.0, 0.0], [1.0, 5.0]])
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    out = value_loss(v, torch.zeros(2, 2), ret, mask, value_clip=None)
    torch.testing.assert_close(out.loss, torch.tensor(0.5 * (1 + 4 + 4) / 3))
    assert out.metrics == {}
    seq = value_loss(v, torch.zeros(2, 2), ret, mask, None, LossAggregation("seq_mean_token_mean"))
    torch.testing.assert_close(seq.loss, torch.tensor(0.5 * ((1 + 4) / 2 + 4) / 2))
