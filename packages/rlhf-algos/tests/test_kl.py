"""KL estimators, the KL loss term and the KL controllers."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    k1,
    k2,
    k3,
    kl_loss,
    make_kl_controller,
)
from rlhf_core.config import KLConfig
from rlhf_core.types import LossAggregation


def test_estimators_hand_computed():
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])  # d = 0.5, -1
    torch.testing.assert_close(k1(logp, ref), torch.tensor([[0.5, -1.0]]))
    torch.testing.assert_close(k2(logp, ref), torch.tensor([[0.125, 0.5]]))
    torch.testing.assert_close(k3(logp, ref), torch.tensor([[math.exp(-0.5) - 0.5, math.e - 2.0]]))


def test_estimators_are_clamped_to_ten():
    d = torch.tensor([[15.0, -15.0, 5.0, -3.0]])
    zero = torch.zeros_like(d)
    torch.testing.assert_close(k1(d, zero), torch.tensor([[10.0, -10.0, 5.0, -3.0]]))
    torch.testing.assert_close(k2(d, zero), torch.tensor([[10.0, 10.0, 10.0, 4.5]]))
    # k3(-3) = e^3 - 4 > 10; k3(5) = e^-5 + 4; k3(15) = 14 + e^-15 > 10
    torch.testing.assert_close(k3(d, zero), torch.tensor([[10.0, 10.0, math.exp(-5) + 4, 10.0]]))


def test_k3_matches_its_formula_wherever_it_is_not_clamped():
    d = torch.linspace(-2.6, 11.0, 500, dtype=torch.float64)
    expected = (torch.exp(-d) - 1 + d).clamp(-10, 10)
    torch.testing.assert_close(k3(d.float()[None], torch.zeros(1, 500)), expected.float()[None])


def test_k3_gradient_stays_finite_at_extreme_ratios():
    logp = torch.tensor([[-100.0, 0.0, 60.0, -0.3]], requires_grad=True)
    out = k3(logp, torch.zeros(1, 4))
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(logp.grad).all()
    # clamped entries pass no gradient; the last one has d k3/d d = 1 - exp(-d)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 0.0, 1 - math.exp(0.3)]]))


def test_k1_and_k3_are_unbiased_k2_is_not_negative():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.2, 0.2, 0.1])
    q = torch.tensor([0.3, 0.3, 0.2, 0.2])
    true_kl = float((p * (p / q).log()).sum())
    samples = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    logp, logq = p.log()[samples][None], q.log()[samples][None]
    assert abs(float(k1(logp, logq).mean()) - true_kl) < 0.01
    assert abs(float(k3(logp, logq).mean()) - true_kl) < 0.01
    assert (k2(logp, logq) >= 0).all() and (k3(logp, logq) >= 0).all()


def test_kl_loss_aggregates_over_action_tokens():
    logp = torch.tensor([[0.0, -1.0, 7.0], [-2.0, 9.0, 9.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    loss = kl_loss(logp, ref, mask, "k1")
    torch.testing.assert_close(loss, torch.tensor((1.0 + 0.0 - 2.0) / 3))
    loss.backward()
    torch.testing.assert_close(logp.grad, mask.float() / 3)
    seq = kl_loss(logp, ref, mask, k2, LossAggregation(mode="seq_mean_token_mean"))
    torch.testing.assert_close(seq, torch.tensor(((0.5 + 0.0) / 2 + 2.0 / 1) / 2))


def test_fixed_controller():
    ctl = make_kl_controller(KLConfig(init_coef=0.05))
    assert isinstance(ctl, FixedKLController)
    ctl.update(current_kl=100.0, n_steps=1000)
    assert ctl.value == 0.05
    other = FixedKLController(0.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05


def test_adaptive_controller_hand_computed_and_checkpointed():
    ctl = make_kl_controller(KLConfig(init_coef=0.1, target=6.0, horizon=10000))
    assert isinstance(ctl, AdaptiveKLController)
    ctl.update(current_kl=9.0, n_steps=1000)  # error 0.5 clipped to 0.2: x (1 + 0.2 * 0.1)
    assert ctl.value == pytest.approx(0.102)
    ctl.update(current_kl=5.4, n_steps=1000)  # error -0.1: x (1 - 0.01)
    assert ctl.value == pytest.approx(0.102 * 0.99)
    ctl.update(current_kl=0.0, n_steps=500)  # error -1 clipped to -0.2: x (1 - 0.01)
    assert ctl.value == pytest.approx(0.102 * 0.99 * 0.99)

    resumed = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    resumed.load_state_dict(ctl.state_dict())
    for c in (ctl, resumed):
        c.update(current_kl=7.0, n_steps=2000)
    assert resumed.value == ctl.value
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=0.0, horizon=10)
