"""The PRM loss and the distillation loss against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_algos.distill import distill_cross_entropy, kd_loss
from rlhf_algos.prm import prm_loss, step_scores
from rlhf_core.types import LossAggregation

NAN = float("nan")


def test_prm_hard_labels_hand_computed():
    # softmax rows: [3/4, 1/4] and [1/3, 2/3]
    logits = torch.tensor([[math.log(3), 0.0], [0.0, math.log(2)]], requires_grad=True)
    out = prm_loss(logits, torch.tensor([0, 1]), torch.tensor([NAN, NAN]))
    expected = (math.log(4 / 3) + math.log(3 / 2)) / 2
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert out.metrics["acc"] == 1.0 and out.metrics["prm_loss"] == pytest.approx(expected, rel=1e-6)
    out.loss.backward()  # d l_n / d z = softmax - onehot, divided by N = 2
    torch.testing.assert_close(logits.grad, torch.tensor([[-1 / 8, 1 / 8], [1 / 6, -1 / 6]]))


def test_prm_soft_and_mixed_labels_hand_computed():
    logits = torch.tensor([[math.log(3), 0.0], [0.0, math.log(2)]])
    out = prm_loss(logits, torch.tensor([0, 1]), torch.tensor([0.8, NAN]))
    soft = -(0.8 * math.log(3 / 4) + 0.2 * math.log(1 / 4))
    assert out.loss.item() == pytest.approx((soft + math.log(3 / 2)) / 2, rel=1e-6)
    # p = 0.3 makes the soft step's class 1, which the first row's argmax (0) misses
    out = prm_loss(logits, torch.tensor([0, 1]), torch.tensor([0.3, NAN]))
    assert out.metrics["acc"] == 0.5


def test_prm_full_vocabulary_and_step_count_aggregation():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    out = prm_loss(logits, torch.tensor([2]), torch.tensor([NAN]), LossAggregation(num_tokens=4, dp_size=2))
    lse = math.log(math.exp(1) + math.exp(2) + math.exp(3))
    assert out.loss.item() == pytest.approx((lse - 3.0) * 2 / 4, rel=1e-6)  # sum / N_steps * D


def test_prm_soft_labels_need_two_reward_tokens():
    with pytest.raises(ValueError, match="exactly 2 reward tokens"):
        prm_loss(torch.zeros(1, 3), torch.tensor([0]), torch.tensor([0.5]))


def test_step_scores_are_the_positive_probability():
    torch.testing.assert_close(
        step_scores(torch.tensor([[math.log(3), 0.0], [0.0, 0.0]])), torch.tensor([0.75, 0.5])
    )


def test_kd_loss_hand_computed():
    # token 0: student q = [1/4, 3/4], teacher p = [3/4, 1/4], label 1; token 1 is masked and holds inf/NaN
    s = torch.tensor([[[0.0, math.log(3)], [math.inf, math.nan]]], requires_grad=True)
    t = torch.tensor([[[math.log(3), 0.0], [math.nan, math.inf]]])
    labels, mask = torch.tensor([[1, 0]]), torch.tensor([[True, False]])
    out = kd_loss(s, t, labels, mask, kd_coef=0.4)
    nll = math.log(4 / 3)
    distil = -(0.75 * math.log(0.25) + 0.25 * math.log(0.75))
    assert out.loss.item() == pytest.approx(0.6 * nll + 0.4 * distil, rel=1e-6)
    assert out.metrics["gpt_loss"] == pytest.approx(nll, rel=1e-6)
    assert out.metrics["distil_loss"] == pytest.approx(distil, rel=1e-6)
    assert out.metrics["kl"] == pytest.approx(0.5 * math.log(3), rel=1e-5)  # 3/4 ln 3 - 1/4 ln 3
    out.loss.backward()
    # d/ds: 0.6 (q - onehot(1)) + 0.4 (q - p) = 0.6 [1/4, -1/4] + 0.4 [-1/2, 1/2]
    torch.testing.assert_close(s.grad[0, 0], torch.tensor([-0.05, 0.05]))
    assert torch.equal(s.grad[0, 1], torch.zeros(2))


def test_kd_coefficient_one_is_pure_distillation_and_zero_is_sft():
    s, t = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    labels, mask = torch.randint(0, 5, (2, 3)), torch.tensor([[1, 1, 0], [1, 1, 1]]).bool()
    d = distill_cross_entropy(s, t)
    assert kd_loss(s, t, labels, mask, 1.0).loss.item() == pytest.approx(float(d[mask].mean()), rel=1e-6)
    nll = -torch.log_softmax(s, -1).gather(-1, labels[..., None]).squeeze(-1)
    assert kd_loss(s, t, labels, mask, 0.0).loss.item() == pytest.approx(float(nll[mask].mean()), rel=1e-6)


def test_distillation_skips_infinite_student_logits():
    s = torch.tensor([[0.0, math.log(3), -math.inf]])
    t = torch.tensor([[math.log(3), 0.0, 0.0]])  # p = [3/5, 1/5, 1/5]: the third word has mass
    expected = -(0.6 * math.log(0.25) + 0.2 * math.log(0.75))
    assert distill_cross_entropy(s, t).item() == pytest.approx(expected, rel=1e-6)


def test_distillation_minus_teacher_entropy_is_kl():
    s, t = torch.randn(4, 7), torch.randn(4, 7)
    p = torch.softmax(t, -1)
    kl = (p * (torch.log_softmax(t, -1) - torch.log_softmax(s, -1))).sum(-1)
    entropy = -(p * torch.log_softmax(t, -1)).sum(-1)
    torch.testing.assert_close(distill_cross_entropy(s, t) - entropy, kl, atol=1e-5, rtol=0)
