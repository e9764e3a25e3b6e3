"""Length penalties, dynamic filtering, running reward normalisation."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_algos.shaping import RunningMeanStd, dynamic_filter, overlong_penalty, stop_properly_penalty

NAN = float("nan")


def test_overlong_penalty_hand_computed():
    rewards = torch.ones(5)
    lengths = torch.tensor([70, 80, 90, 100, 120])
    # expected length 100 - 20 = 80; exceed -10, 0, 10, 20, min(40, 20)
    out = overlong_penalty(rewards, lengths, max_new_tokens=100, buffer_len=20)
    torch.testing.assert_close(out, torch.tensor([1.0, 1.0, 0.5, 0.0, 0.0]))
    out = overlong_penalty(rewards, lengths, max_new_tokens=100, buffer_len=20, penalty_factor=2.0)
    torch.testing.assert_close(out, torch.tensor([1.0, 1.0, 0.0, -1.0, -1.0]))
    assert torch.equal(rewards, torch.ones(5))  # input untouched
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_penalty(rewards, lengths, max_new_tokens=10, buffer_len=20)


def test_stop_properly_penalty_hand_computed():
    rewards = torch.tensor([1.0, 0.5, 1.0])
    truncated = torch.tensor([False, True, True])
    torch.testing.assert_close(stop_properly_penalty(rewards, truncated, 0.5), torch.tensor([1.0, 0.25, 0.5]))
    torch.testing.assert_close(stop_properly_penalty(rewards, truncated, 0.0), torch.tensor([1.0, 0.0, 0.0]))
    fixed = stop_properly_penalty(rewards, truncated, -0.5)
    torch.testing.assert_close(fixed, torch.tensor([1.0, -0.5, -0.5]))
    with pytest.raises(ValueError, match="stop_properly_penalty_coef"):
        stop_properly_penalty(rewards, truncated, 1.5)


def test_penalties_compose_in_openrlhf_order():
    # a truncated sample at the limit: overlong first (1 - 0.5), then the stop-properly scale (x 0.5)
    r = overlong_penalty(torch.tensor([1.0]), torch.tensor([100]), 100, 20, penalty_factor=0.5)
    r = stop_properly_penalty(r, torch.tensor([True]), 0.5)
    torch.testing.assert_close(r, torch.tensor([0.25]))


def test_dynamic_filter_is_strict():
    scores = torch.tensor([1.0, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0.5, 0.5, 0.5, 0.5])
    assert dynamic_filter(scores, 4).tolist() == [2, 3]
    assert dynamic_filter(scores, 4, (0.25, 1.0)).tolist() == [3]  # mean 0.25 is not strictly inside
    assert dynamic_filter(scores, 4, (-0.1, 1.1)).tolist() == [0, 1, 2, 3]
    assert dynamic_filter(scores, 4).dtype == torch.int64


def test_dynamic_filter_ignores_invalid_samples():
    scores = torch.tensor([1.0, NAN, 0, 1, NAN, NAN, NAN, NAN, 1, NAN, 1, 1])
    valid = torch.isfinite(scores)
    # group 0: valid mean 2/3 kept;  group 1: no valid sample, dropped;  group 2: valid mean 1, dropped
    # (counting the invalid sample as 0 would give 0.75 and keep group 2)
    assert dynamic_filter(scores, 4, valid=valid).tolist() == [0]
    assert dynamic_filter(scores, 4).tolist() == [0]  # NaN scores are invalid without being told
    with pytest.raises(ValueError, match="groups"):
        dynamic_filter(scores, 5)


def test_running_mean_std_matches_the_whole_stream():
    gen = torch.Generator().manual_seed(0)
    chunks = [torch.randn(n, generator=gen) * 3 + 1 for n in (5, 1, 17, 40)]
    rms = RunningMeanStd()
    for c in chunks:
        rms.update(c)
    rms.update(torch.tensor([NAN, float("inf")]))  # unscorable values are ignored
    everything = torch.cat(chunks).double()
    assert rms.count == 63
    assert rms.mean == pytest.approx(float(everything.mean()))
    assert rms.var == pytest.approx(float(everything.var(unbiased=False)))

    restored = RunningMeanStd()
    restored.load_state_dict(rms.state_dict())
    x = torch.tensor([0.0, 2.0])
    torch.testing.assert_close(restored.normalize(x), rms.normalize(x))
    restored.update(torch.tensor([5.0]))
    rms.update(torch.tensor([5.0]))
    assert restored.mean == pytest.approx(rms.mean) and restored.var == pytest.approx(rms.var)


def test_running_mean_std_hand_computed_and_fixed_normaliser():
    rms = RunningMeanStd()
    rms.update(torch.tensor([1.0, 2.0, 3.0]))
    assert rms.mean == 2.0 and rms.var == pytest.approx(2 / 3)
    torch.testing.assert_close(rms.normalize(torch.tensor([3.0])), torch.tensor([1 / math.sqrt(2 / 3)]))
    fixed = RunningMeanStd()
    fixed.load_state_dict({"count": 1, "mean": 0.5, "var": 0.25})
    torch.testing.assert_close(fixed.normalize(torch.tensor([1.5])), torch.tensor([2.0]))
    constant = RunningMeanStd()
    constant.update(torch.tensor([4.0, 4.0]))
    assert torch.isfinite(constant.normalize(torch.tensor([5.0]))).all()  # std floored at eps
