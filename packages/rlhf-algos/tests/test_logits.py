"""Log-probs and entropy from logits."""

from __future__ import annotations

import math

import torch

from rlhf_algos.logits import entropy_from_logits, logprobs_from_logits


def test_logprobs_hand_computed():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])
    out = logprobs_from_logits(logits, torch.tensor([[2, 0]]))
    lse = math.log(math.e + math.e**2 + math.e**3)
    torch.testing.assert_close(out, torch.tensor([[3.0 - lse, -math.log(3)]]))


def test_logprobs_in_bf16_are_computed_in_fp32():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 50, generator=gen) * 4
    labels = torch.randint(0, 50, (2, 4), generator=gen)
    expected = torch.log_softmax(logits.bfloat16().double(), -1).gather(-1, labels[..., None]).squeeze(-1)
    out = logprobs_from_logits(logits.bfloat16(), labels)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_entropy_hand_computed():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [math.log(3), 0.0, -1e4, -1e4], [100.0, 0.0, 0.0, 0.0]]])
    h = entropy_from_logits(logits)
    p = (0.75, 0.25)  # the -1e4 entries have probability 0 (underflow) and contribute nothing
    torch.testing.assert_close(
        h, torch.tensor([[math.log(4), -sum(x * math.log(x) for x in p), 0.0]]), atol=1e-6, rtol=1e-6
    )


def test_entropy_matches_definition_and_has_gradient():
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 5, 11, generator=gen) * 3).requires_grad_(True)
    p = torch.softmax(logits.detach().double(), -1)
    h = entropy_from_logits(logits)
    torch.testing.assert_close(h.double(), -(p * p.log()).sum(-1), atol=1e-5, rtol=1e-5)
    entropy_from_logits(logits).sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    # dH/dz_v = -p_v (log p_v + H)
    h = -(p * p.log()).sum(-1, keepdim=True)
    torch.testing.assert_close(logits.grad.double(), -p * (p.log() + h), atol=1e-5, rtol=1e-5)
