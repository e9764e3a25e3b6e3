"""PPO and GSPO losses, IS correction, metrics, entropy term."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_algos.policy_loss import entropy_loss, gspo_loss, ppo_loss, rollout_correction_weights
from rlhf_core.types import LossAggregation, PolicyLossInput

LOG = math.log


def _batch(ratios, adv, mask=None, **kw):
    """Policy log-probs ``log(ratio)`` against old log-probs 0, so ``exp(logp - old)`` is ``ratio``."""
    ratios = torch.tensor(ratios, dtype=torch.float32)
    logp = ratios.log().clone().requires_grad_(True)
    mask = torch.ones_like(ratios, dtype=torch.bool) if mask is None else torch.tensor(mask, dtype=torch.bool)
    return PolicyLossInput(
        logprobs=logp,
        old_logprobs=torch.zeros_like(ratios),
        advantages=torch.tensor(adv),
        action_mask=mask,
        **kw,
    )


def test_ppo_symmetric_clip_hand_computed():
    batch = _batch([[1.5, 0.5, 1.1]], [[1.0, -1.0, 2.0]])
    out = ppo_loss(batch)
    # token 0: min(1.5, 1.2) -> -1.2 (clipped);  token 1: min(-0.5, -0.8) -> 0.8 (clipped);  token 2: -2.2
    torch.testing.assert_close(out.loss, torch.tensor((-1.2 + 0.8 - 2.2) / 3))
    assert out.metrics["clip_ratio"] == pytest.approx(2 / 3)
    assert out.metrics["ppo_kl"] == pytest.approx(-(LOG(1.5) + LOG(0.5) + LOG(1.1)) / 3, abs=1e-6)
    assert "rollout_kl" not in out.metrics and "is_weight_mean" not in out.metrics
    out.loss.backward()
    # clipped tokens pass no gradient; d(-r A / 3)/d logp = -r A / 3 on the others
    torch.testing.assert_close(batch.logprobs.grad, torch.tensor([[0.0, 0.0, -1.1 * 2.0 / 3]]))


def test_ppo_asymmetric_clip_hand_computed():
    out = ppo_loss(_batch([[1.5, 0.5, 1.1]], [[1.0, -1.0, 2.0]], eps_clip_low=0.2, eps_clip_high=0.28))
    torch.testing.assert_close(out.loss, torch.tensor((-1.28 + 0.8 - 2.2) / 3))
    out = ppo_loss(_batch([[1.25, 0.75]], [[1.0, -1.0]], eps_clip_low=0.3, eps_clip_high=0.28))
    # neither is clipped now: 1.25 < 1.28 and 0.75 > 0.7
    torch.testing.assert_close(out.loss, torch.tensor((-1.25 + 0.75) / 2))
    assert out.metrics["clip_ratio"] == 0.0


def test_dual_clip_hand_computed():
    batch = _batch([[5.0, 2.0, 5.0]], [[-1.0, -1.0, 1.0]], dual_clip=3.0)
    out = ppo_loss(batch)
    # token 0: max(min(-5, -1.2), -3) = -3 -> 3;  token 1: max(-2, -3) = -2 -> 2
    # token 2: min(5, 1.2) -> -1.2
    torch.testing.assert_close(out.loss, torch.tensor((3.0 + 2.0 - 1.2) / 3))
    assert out.metrics["dual_clip_ratio"] == pytest.approx(1 / 3)
    out.loss.backward()
    torch.testing.assert_close(batch.logprobs.grad, torch.tensor([[0.0, 2.0 / 3, 0.0]]))
    without = ppo_loss(_batch([[5.0, 2.0, 5.0]], [[-1.0, -1.0, 1.0]]))
    torch.testing.assert_close(without.loss, torch.tensor((5.0 + 2.0 - 1.2) / 3))
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_loss(_batch([[1.0]], [[1.0]], dual_clip=0.9))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    eps=st.sampled_from([(0.2, 0.2), (0.2, 0.28), (0.1, 0.4)]),
    dual=st.sampled_from([None, 3.0]),
)
def test_gradient_vanishes_exactly_where_the_clip_binds(seed, eps, dual):
    gen = torch.Generator().manual_seed(seed)
    ratio = torch.exp(torch.randn(4, 8, generator=gen) * 0.6)
    adv = torch.randn(4, 8, generator=gen)
    batch = _batch(ratio.tolist(), adv.tolist(), eps_clip_low=eps[0], eps_clip_high=eps[1], dual_clip=dual)
    ppo_loss(batch).loss.backward()
    r = batch.logprobs.detach().exp()
    clipped = ((adv > 0) & (r > 1 + eps[1])) | ((adv < 0) & (r < 1 - eps[0]))
    if dual is not None:
        clipped |= (adv < 0) & (r > dual)
    grad = batch.logprobs.grad
    assert (grad[clipped] == 0).all()
    # elsewhere the gradient is that of -r A / N
    torch.testing.assert_close(grad[~clipped], (-r * adv / adv.numel())[~clipped])


def test_rollout_kl_metric():
    batch = _batch([[1.0, 1.0, 1.0]], [[1.0, 1.0, 1.0]], mask=[[1, 1, 0]])
    batch.rollout_logprobs = torch.tensor([[0.3, -0.1, 50.0]])
    assert ppo_loss(batch).metrics["rollout_kl"] == pytest.approx(0.1)


def _is_batch(kind, rho, mask=None):
    """Ratio 1 and advantage 1 everywhere, so the per-token loss is -w_t."""
    rho = torch.tensor(rho)
    batch = _batch(torch.ones_like(rho).tolist(), torch.ones_like(rho).tolist(), mask, is_correction=kind)
    batch.rollout_logprobs = -rho.log()  # old 0 - rollout = log rho
    return batch


def test_tis_hand_computed():
    batch = _is_batch("tis", [[0.3, 1.0, 7.0]])
    out = ppo_loss(batch)
    torch.testing.assert_close(out.loss, torch.tensor(-(0.5 + 1.0 + 5.0) / 3))
    assert out.metrics["is_weight_mean"] == pytest.approx(6.5 / 3)
    assert out.metrics["is_weight_min"] == pytest.approx(0.5)
    assert out.metrics["is_weight_max"] == pytest.approx(5.0)
    assert out.metrics["is_truncated_ratio"] == pytest.approx(2 / 3) and out.metrics["is_masked_ratio"] == 0.0
    out.loss.backward()
    torch.testing.assert_close(batch.logprobs.grad, -torch.tensor([[0.5, 1.0, 5.0]]) / 3)


def test_icepop_hand_computed():
    out = ppo_loss(_is_batch("icepop", [[0.3, 1.0, 7.0, 2.0]]))
    torch.testing.assert_close(out.loss, torch.tensor(-(1.0 + 2.0) / 4))
    assert out.metrics["is_masked_ratio"] == pytest.approx(0.5)


def test_seq_mask_tis_truncates_token_weights():
    # row 0: geometric mean (0.3 * 1 * 7)^(1/3) = 1.28 is in range: kept, token weights clamped to [0.5, 5]
    #        (OpenRLHF would use 0.3, 1, 7 here)
    # row 1: (8 * 9)^(1/2) = 8.49 > 5: the whole sequence is masked
    out = ppo_loss(_is_batch("seq-mask-tis", [[0.3, 1.0, 7.0], [8.0, 9.0, 1.0]], mask=[[1, 1, 1], [1, 1, 0]]))
    torch.testing.assert_close(out.loss, torch.tensor(-(0.5 + 1.0 + 5.0) / 5))
    assert out.metrics["is_masked_ratio"] == pytest.approx(2 / 5)
    assert out.metrics["is_truncated_ratio"] == pytest.approx(2 / 5)


def test_is_weights_ignore_padding_and_are_detached():
    old = torch.tensor([[0.0, 0.0, 0.0]], requires_grad=True)
    rollout = torch.tensor([[0.1, -0.2, float("nan")]])
    mask = torch.tensor([[True, True, False]])
    for kind in ("tis", "icepop", "seq-mask-tis"):
        w, metrics = rollout_correction_weights(old, rollout, mask, kind)
        assert not w.requires_grad and w[0, 2] == 0 and torch.isfinite(w).all()
        assert all(math.isfinite(v) for v in metrics.values())


def test_is_correction_errors():
    batch = _batch([[1.0]], [[1.0]], is_correction="tis")
    with pytest.raises(ValueError, match="rollout_logprobs"):
        ppo_loss(batch)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        gspo_loss(batch)
    batch.rollout_logprobs, batch.is_correction = torch.zeros(1, 1), "vtrace"
    with pytest.raises(ValueError, match="is_correction_type"):
        ppo_loss(batch)


def test_gspo_hand_computed():
    # row 0: log-ratios 0.2, -0.1, 0.5 -> mean 0.2 -> s = e^0.2 = 1.2214 > 1.2: clipped, loss -1.2 per token
    # row 1: log-ratios 0.1, 0.0 (third token padding) -> s = e^0.05, inside the clip
    logp = torch.tensor([[0.2, -0.1, 0.5], [0.1, 0.0, 3.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    batch = PolicyLossInput(
        logprobs=logp, old_logprobs=torch.zeros(2, 3), advantages=torch.ones(2, 3), action_mask=mask
    )
    s = math.exp(0.05)
    out = gspo_loss(batch)
    torch.testing.assert_close(out.loss, torch.tensor((3 * -1.2 + 2 * -s) / 5))
    assert out.metrics["clip_ratio"] == pytest.approx(3 / 5)
    out.loss.backward()
    # d/d logp_t of -(2/5) s with s = exp(mean of 2 log-ratios): -(2/5) s / 2
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 0.0], [-s / 5, -s / 5, 0.0]]))
    per_seq = LossAggregation("seq_mean_token_mean")
    seq = gspo_loss(PolicyLossInput(**{**batch.__dict__, "aggregation": per_seq}))
    torch.testing.assert_close(seq.loss, torch.tensor((-1.2 - s) / 2))
    assert gspo_loss.default_loss_agg_mode == "seq_mean_token_mean"
    assert ppo_loss.default_loss_agg_mode == "token_mean"


def test_gspo_with_is_correction_takes_the_ratio_against_the_engine():
    logp = torch.tensor([[0.1, 0.1]], requires_grad=True)
    batch = PolicyLossInput(
        logprobs=logp,
        old_logprobs=torch.tensor([[5.0, 5.0]]),  # ignored for the ratio
        advantages=torch.ones(1, 2),
        action_mask=torch.ones(1, 2, dtype=torch.bool),
        rollout_logprobs=torch.tensor([[0.0, 0.1]]),
        is_correction="tis",
    )
    torch.testing.assert_close(gspo_loss(batch).loss, torch.tensor(-math.exp(0.05)))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), loss=st.sampled_from([ppo_loss, gspo_loss]))
def test_split_invariance_for_every_mode(seed, loss):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.arange(7)[None, :] < torch.randint(1, 8, (6,), generator=gen)[:, None]
    old = -torch.rand(6, 7, generator=gen)
    full = PolicyLossInput(
        logprobs=old + 0.2 * torch.randn(6, 7, generator=gen),
        old_logprobs=old,
        advantages=torch.randn(6, 7, generator=gen),
        action_mask=mask,
    )
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        agg = LossAggregation(mode, num_tokens=float(mask.sum()), num_sequences=6.0, max_len=7)

        def rows(sl, agg=agg):
            fields = {k: v[sl] if isinstance(v, torch.Tensor) else v for k, v in full.__dict__.items()}
            return PolicyLossInput(**{**fields, "aggregation": agg})

        whole = loss(rows(slice(0, 6))).loss
        parts = sum(loss(rows(sl)).loss for sl in (slice(0, 1), slice(1, 4), slice(4, 6)))
        torch.testing.assert_close(whole, parts)


def test_entropy_loss_hand_computed():
    h = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    term = entropy_loss(h, mask, entropy_coef=0.01)
    torch.testing.assert_close(term, torch.tensor(-0.01 * 6.0 / 3))
    term.backward()
    # minimising the term raises entropy: its gradient is negative on action tokens, zero elsewhere
    torch.testing.assert_close(h.grad, torch.tensor([[-0.01 / 3, -0.01 / 3], [-0.01 / 3, 0.0]]))
