"""DPO / IPO / cDPO, the NLL term, KTO, the reward-model loss and the SFT loss."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_algos.preference import dpo_loss, kto_loss, nll_loss, rm_loss
from rlhf_algos.sft import sft_loss
from rlhf_core.types import LossAggregation


def _softplus(x):
    return math.log1p(math.exp(x))


def _dpo_inputs():
    pc = torch.tensor([-1.0], requires_grad=True)
    pr = torch.tensor([-3.0], requires_grad=True)
    return pc, pr, torch.tensor([-2.0]), torch.tensor([-2.5])  # x = 2 - 0.5 = 1.5


def test_dpo_hand_computed():
    pc, pr, rc, rr = _dpo_inputs()
    out = dpo_loss(pc, pr, rc, rr, beta=0.1)
    torch.testing.assert_close(out.loss, torch.tensor(_softplus(-0.15)))  # -log sigmoid(0.15)
    assert out.metrics["chosen_reward"] == pytest.approx(0.1)
    assert out.metrics["rejected_reward"] == pytest.approx(-0.05)
    assert out.metrics["reward_margin"] == pytest.approx(0.15)
    assert out.metrics["reward_accuracy"] == 1.0
    out.loss.backward()
    dx = -0.1 / (1 + math.exp(0.15))  # d/dx -log sigmoid(beta x) = -beta sigmoid(-beta x)
    assert pc.grad.item() == pytest.approx(dx) and pr.grad.item() == pytest.approx(-dx)


def test_cdpo_and_ipo_hand_computed():
    pc, pr, rc, rr = _dpo_inputs()
    cdpo = dpo_loss(pc, pr, rc, rr, beta=0.1, label_smoothing=0.1).loss
    torch.testing.assert_close(cdpo, torch.tensor(0.9 * _softplus(-0.15) + 0.1 * _softplus(0.15)))
    ipo = dpo_loss(pc, pr, rc, rr, beta=0.1, ipo=True).loss
    torch.testing.assert_close(ipo, torch.tensor((1.5 - 5.0) ** 2))


def test_dpo_is_a_mean_over_pairs():
    pc, pr = torch.tensor([-1.0, 0.0]), torch.tensor([-3.0, 0.0])
    rc, rr = torch.tensor([-2.0, 0.0]), torch.tensor([-2.5, 0.0])
    out = dpo_loss(pc, pr, rc, rr, beta=0.1)
    torch.testing.assert_close(out.loss, torch.tensor((_softplus(-0.15) + math.log(2)) / 2))
    assert out.metrics["reward_accuracy"] == 0.5  # the tie does not count as correct


def test_nll_loss_hand_computed():
    torch.testing.assert_close(nll_loss(torch.tensor([-4.0, -9.0]), torch.tensor([2, 3])), torch.tensor(2.5))


def _sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_kto_hand_computed():
    policy = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])  # log-ratios 0.5, -1
    desirable = torch.tensor([True, False])
    out = kto_loss(policy, ref, desirable, kl=0.2, beta=0.5, desirable_weight=1.0, undesirable_weight=1.5)
    l_c = 1 - _sigmoid(0.5 * (0.5 - 0.2))
    l_r = 1 - _sigmoid(0.5 * (0.2 + 1.0))
    torch.testing.assert_close(out.loss, torch.tensor((l_c + 1.5 * l_r) / 2))
    assert out.metrics["kl"] == pytest.approx(0.2)
    assert out.metrics["chosen_reward"] == pytest.approx(0.25)
    assert out.metrics["rejected_reward"] == pytest.approx(-0.5)


def test_kto_reference_point_is_clamped_and_detached():
    policy, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    desirable = torch.tensor([True, False])
    kl = torch.tensor(-0.3, requires_grad=True)
    clamped = kto_loss(policy, ref, desirable, kl).loss
    torch.testing.assert_close(clamped, kto_loss(policy, ref, desirable, 0.0).loss)
    p = policy.clone().requires_grad_(True)
    kto_loss(p, ref, desirable, kl * -1).loss.backward()
    assert kl.grad is None and p.grad is not None


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 8))
def test_kto_equals_the_concatenated_form(seed, b):
    gen = torch.Generator().manual_seed(seed)
    policy, ref = -torch.rand(b, generator=gen) * 5, -torch.rand(b, generator=gen) * 5
    desirable = torch.rand(b, generator=gen) > 0.5
    kl, beta, wd, wu = 0.3, 0.2, 1.0, 1.33
    logr = policy - ref
    l_c = wd * (1 - torch.sigmoid(beta * (logr[desirable] - kl)))
    l_r = wu * (1 - torch.sigmoid(beta * (kl - logr[~desirable])))
    expected = torch.cat([l_c, l_r]).mean()
    torch.testing.assert_close(kto_loss(policy, ref, desirable, kl, beta, wd, wu).loss, expected)


def test_rm_loss_hand_computed():
    rc, rr = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])  # differences 1 and -1
    out = rm_loss(rc, rr)
    torch.testing.assert_close(out.loss, torch.tensor((_softplus(-1.0) + _softplus(1.0)) / 2))
    assert out.metrics == {"accuracy": 0.5, "reward_margin": 0.0}
    with_margin = rm_loss(rc, rr, margin=torch.tensor([0.5, 0.0])).loss
    torch.testing.assert_close(with_margin, torch.tensor((_softplus(-0.5) + _softplus(1.0)) / 2))
    logexp = rm_loss(rc, rr, margin=torch.tensor([0.5, 0.0]), loss_type="logexp").loss
    torch.testing.assert_close(logexp, with_margin)
    with pytest.raises(ValueError, match="loss_type"):
        rm_loss(rc, rr, loss_type="hinge")


def test_rm_logexp_does_not_overflow():
    out = rm_loss(torch.tensor([0.0]), torch.tensor([100.0]), loss_type="logexp")
    torch.testing.assert_close(out.loss, torch.tensor(100.0))  # log(1 + e^100) ~ 100; exp(100) overflows fp32


def test_sft_loss_hand_computed_and_grad_accumulation():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    torch.testing.assert_close(sft_loss(logp, mask), torch.tensor((1 + 2 + 5 + 6) / 4))
    torch.testing.assert_close(sft_loss(logp, mask, LossAggregation(num_tokens=1)), torch.tensor(14.0))
    # micro-batches of 2 and 2 tokens vs 3 and 1: the global count makes the sum equal the whole either way
    agg = LossAggregation(num_tokens=4)
    mask2 = torch.tensor([[1, 1, 1], [0, 0, 1]], dtype=torch.bool)
    for m in (mask, mask2):
        parts = sft_loss(logp[:1], m[:1], agg) + sft_loss(logp[1:], m[1:], agg)
        torch.testing.assert_close(parts, sft_loss(logp, m))
    sft_loss(logp, mask).backward()
    torch.testing.assert_close(logp.grad, -mask.float() / 4)
