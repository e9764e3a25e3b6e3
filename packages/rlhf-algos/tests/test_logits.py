"""Log-probs and entropy from logits."""

from __future__ import annotations

import math

import torch

from rlhf_algos.logits import entropy_from_logits, logprobs_and_entropy, logprobs_from_logits


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


def test_logprobs_and_entropy_in_one_pass_match_both_and_torch_autograd():
    """Values against the two separate functions; gradients of any mix of the two outputs against a float64
    autograd reference; an unused entropy adds nothing; bf16 logits get bf16 gradients."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, 11, generator=gen) * 3
    logits[0, 0, 4] = -1e4  # a probability that underflows to 0 stays finite, as in entropy_from_logits
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    w_lp, w_h = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    lp, h = logprobs_and_entropy(logits, labels)
    torch.testing.assert_close(lp, logprobs_from_logits(logits, labels), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(h, entropy_from_logits(logits), atol=1e-5, rtol=1e-5)

    for a, b in ((1.0, 0.0), (0.0, 1.0), (1.0, 0.5)):
        ref = logits.double().requires_grad_(True)
        logp = torch.log_softmax(ref, -1)
        want_h = -(logp.exp() * logp).sum(-1)
        (a * (logp.gather(-1, labels[..., None]).squeeze(-1) * w_lp).sum() + b * (want_h * w_h).sum()).backward()
        z = logits.clone().requires_grad_(True)
        lp, h = logprobs_and_entropy(z, labels)
        loss = a * (lp * w_lp).sum() + (b * (h * w_h).sum() if b else 0.0)
        loss.backward()
        torch.testing.assert_close(z.grad.double(), ref.grad, atol=1e-5, rtol=1e-5)

    z = logits.bfloat16().requires_grad_(True)
    lp, h = logprobs_and_entropy(z, labels)
    (lp.sum() + h.detach().sum()).backward()
    assert lp.dtype == h.dtype == torch.float32 and z.grad.dtype == torch.bfloat16
