"""Advantage estimators: hand-worked cases, independent reference implementations, invariants."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    ESTIMATOR_NAMES,
    GROUP_ESTIMATORS,
    check_n_samples_per_prompt,
    compute_advantages,
    gae_advantages,
    group_shaped_rewards,
    normalize_advantages,
    opd_advantages,
    token_level_rewards,
)
from rlhf_core.types import AdvantageInput

NAN = float("nan")
FAST = settings(max_examples=40, deadline=None)


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def b(x):
    return torch.tensor(x, dtype=torch.bool)


# --- group shaping ------------------------------------------------------------------------------------


def test_group_shaping_hand_computed():
    r = t([1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 1.0, 1.0])
    # rloo, group 1: sum 12, leave-one-out means 11/3, 10/3, 9/3, 6/3
    torch.testing.assert_close(group_shaped_rewards(r, 4, "rloo")[:4], t([1 - 11 / 3, 2 - 10 / 3, 0.0, 4.0]))
    # group 2: sum 2 -> means 2/3, 2/3, 1/3, 1/3
    torch.testing.assert_close(group_shaped_rewards(r, 4, "rloo")[4:], t([-2 / 3, -2 / 3, 2 / 3, 2 / 3]))
    for name in ("reinforce_baseline", "dr_grpo"):
        torch.testing.assert_close(group_shaped_rewards(r, 4, name), t([-2, -1, 0, 3, -0.5, -0.5, 0.5, 0.5]))
    std1 = math.sqrt(14 / 3)  # deviations -2,-1,0,3: squares sum to 14, unbiased over 3
    std2 = math.sqrt(1 / 3)  # deviations +-0.5: squares sum to 1
    torch.testing.assert_close(
        group_shaped_rewards(r, 4, "group_norm"),
        t([-2 / std1, -1 / std1, 0, 3 / std1, -0.5 / std2, -0.5 / std2, 0.5 / std2, 0.5 / std2]),
    )
    for name in ("gae", "reinforce"):
        torch.testing.assert_close(group_shaped_rewards(r, 4, name), r)


def test_group_shaping_with_invalid_samples():
    r = t([1.0, NAN, 3.0, 5.0])
    valid = b([True, False, True, True])
    # 3 valid: sum 9; leave-one-out means (9-1)/2, (9-3)/2, (9-5)/2
    torch.testing.assert_close(group_shaped_rewards(r, 4, "rloo", valid), t([1 - 4, 0, 3 - 3, 5 - 2]))
    torch.testing.assert_close(group_shaped_rewards(r, 4, "dr_grpo", valid), t([-2, 0, 0, 2]))
    # mean 3, deviations -2, 0, 2, unbiased var 8/2 = 4, std 2
    torch.testing.assert_close(group_shaped_rewards(r, 4, "group_norm", valid), t([-1, 0, 0, 1]))
    torch.testing.assert_close(group_shaped_rewards(r, 4, "reinforce", valid), t([1, 0, 3, 5]))


@pytest.mark.parametrize("name", ESTIMATOR_NAMES)
@pytest.mark.parametrize("bad", [NAN, float("inf"), -float("inf")])
def test_a_non_finite_reward_is_invalid_without_a_valid_mask(name, bad):
    """With ``valid`` None a NaN or Inf reward is left out exactly as an invalid sample is."""
    r = t([1.0, bad, 3.0, 5.0, 0.0, 1.0, 1.0, 2.0])
    want = group_shaped_rewards(r, 4, name, b([True, False, True, True] + [True] * 4))
    got = group_shaped_rewards(r, 4, name)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_group_with_one_valid_sample_gets_zero(name):
    r = t([2.0, NAN, NAN, NAN, 1.0, 0.0, 1.0, 1.0])
    valid = b([True, False, False, False, True, True, True, True])
    out = group_shaped_rewards(r, 4, name, valid)
    assert torch.equal(out[:4], torch.zeros(4))
    assert (out[4:] != 0).all()  # the other group is untouched by the degenerate one


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_group_with_equal_rewards_gets_exactly_zero(name):
    # float rounding gives r - mean(r) ~ 6e-8 here; OpenRLHF's group_norm turns that into ~0.91
    r = torch.full((7,), 0.7312)
    assert torch.equal(group_shaped_rewards(r, 7, name), torch.zeros(7))


def _rloo_loop(rewards, valid, n):
    out = []
    for g in range(len(rewards) // n):
        idx = range(g * n, (g + 1) * n)
        live = [i for i in idx if valid[i]]
        for i in idx:
            others = [rewards[j] for j in live if j != i]
            if not valid[i] or not others or len({rewards[j] for j in live}) == 1:
                out.append(0.0)
            else:
                out.append(rewards[i] - sum(others) / len(others))
    return out


@FAST
@given(
    n=st.integers(2, 6),
    groups=st.integers(1, 4),
    seed=st.integers(0, 10_000),
    p_invalid=st.sampled_from([0.0, 0.3]),
)
def test_rloo_equals_leave_one_out_loop(n, groups, seed, p_invalid):
    gen = torch.Generator().manual_seed(seed)
    r = torch.randint(-3, 4, (n * groups,), generator=gen).float() / 2  # ties happen on purpose
    valid = torch.rand(n * groups, generator=gen) >= p_invalid
    r_in = torch.where(valid, r, NAN)
    expected = _rloo_loop(r.tolist(), valid.tolist(), n)
    torch.testing.assert_close(group_shaped_rewards(r_in, n, "rloo", valid), t(expected))


@FAST
@given(n=st.integers(2, 6), groups=st.integers(1, 4), seed=st.integers(0, 10_000))
def test_group_baselines_sum_to_zero(n, groups, seed):
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(n * groups, generator=gen)
    valid = torch.rand(n * groups, generator=gen) > 0.25
    for name in GROUP_ESTIMATORS:
        shaped = group_shaped_rewards(torch.where(valid, r, NAN), n, name, valid).view(groups, n)
        # Float32 error of the sum: n roundings of its terms, plus the roundings of the inputs and their mean
        # (about n roundings of |r|) scaled by the estimator's gain over r - mean (1 / std for group_norm,
        # which two close rewards make large). The gain is measured in float64 from the result itself.
        rv = torch.where(valid, r, 0.0).view(groups, n).double()
        count = valid.view(groups, n).sum(-1, keepdim=True).clamp(min=1)
        centred = torch.where(valid.view(groups, n), rv - rv.sum(-1, keepdim=True) / count, 0.0)
        gain = shaped.double().abs().amax(-1) / centred.abs().amax(-1).clamp(min=1e-30)
        terms = shaped.double().abs().sum(-1) + gain * rv.abs().sum(-1)
        bound = 4 * n * 2.0**-24 * terms + 1e-7
        assert (shaped.sum(-1).abs() <= bound).all(), (name, shaped.sum(-1), bound)
    # group_norm: each informative group has unbiased std 1 over its valid samples
    shaped = group_shaped_rewards(r, n, "group_norm").view(groups, n)
    torch.testing.assert_close(shaped.std(-1), torch.ones(groups), atol=1e-4, rtol=0)


# --- per-token rewards --------------------------------------------------------------------------------


def test_token_level_rewards_hand_computed():
    mask = b([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    kl = t([[0.1, 0.2, 0.3, 9.0], [0.5, 9.0, 0.25, 9.0], [1.0, 1.0, 1.0, 1.0]])
    out = token_level_rewards(t([2.0, -1.0, 5.0]), mask, kl, kl_coef=0.5, reward_clip=(-1.5, 1.5))
    expected = t(
        [
            [-0.05, -0.1, -0.15 + 1.5, 0.0],  # reward 2 clipped to 1.5 on the last action token
            [-0.25, 0.0, -0.125 - 1.0, 0.0],  # the hole at t=1 is skipped; last action token is t=2
            [0.0, 0.0, 0.0, 0.0],  # no action token, no reward
        ]
    )
    torch.testing.assert_close(out, expected)
    no_kl = token_level_rewards(t([2.0, -1.0, 5.0]), mask)
    torch.testing.assert_close(no_kl, t([[0, 0, 2, 0], [0, 0, -1, 0], [0, 0, 0, 0]]))


# --- GAE and returns -----------------------------------------------------------------------------------


def test_gae_hand_computed():
    rew, values, mask = t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]]), b([[1, 1, 1]])
    adv, ret = gae_advantages(rew, mask, values, gamma=0.9, lambd=0.8)
    # t=2: 1 - 0.7 = 0.3;  t=1: 0.9*0.7 - 0.6 + 0.72*0.3 = 0.246;  t=0: 0.9*0.6 - 0.5 + 0.72*0.246
    torch.testing.assert_close(adv, t([[0.21712, 0.246, 0.3]]))
    torch.testing.assert_close(ret, t([[0.71712, 0.846, 1.0]]))


def test_gae_skips_positions_outside_the_mask():
    rew, values, mask = t([[0.0, 99.0, 1.0]]), t([[0.5, 99.0, 0.7]]), b([[1, 0, 1]])
    adv, ret = gae_advantages(rew, mask, values, gamma=0.9, lambd=0.8)
    # t=2: 0.3;  t=0 bootstraps from V at t=2: 0.9*0.7 - 0.5 + 0.72*0.3 = 0.346
    torch.testing.assert_close(adv, t([[0.346, 0.0, 0.3]]))
    torch.testing.assert_close(ret, t([[0.846, 0.0, 1.0]]))


def _gae_loop(rewards, values, mask, gamma, lambd):
    """A plain-python GAE over the action positions of one row."""
    steps = [i for i, m in enumerate(mask) if m]
    adv = [0.0] * len(mask)
    running = 0.0
    for k in reversed(range(len(steps))):
        i = steps[k]
        next_v = values[steps[k + 1]] if k + 1 < len(steps) else 0.0
        running = rewards[i] + gamma * next_v - values[i] + gamma * lambd * running
        adv[i] = running
    ret = [adv[i] + values[i] if mask[i] else 0.0 for i in range(len(mask))]
    return adv, ret


def _random_masks(gen, b_, t_, holes):
    lengths = torch.randint(0, t_ + 1, (b_,), generator=gen)
    mask = torch.arange(t_)[None, :] < lengths[:, None]
    if holes:
        mask &= torch.rand(b_, t_, generator=gen) > 0.3
    return mask


@FAST
@given(
    b_=st.integers(1, 5),
    t_=st.integers(1, 9),
    gamma=st.sampled_from([1.0, 0.95, 0.5]),
    lambd=st.sampled_from([1.0, 0.9, 0.0]),
    holes=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_gae_matches_python_loop(b_, t_, gamma, lambd, holes, seed):
    gen = torch.Generator().manual_seed(seed)
    mask = _random_masks(gen, b_, t_, holes)
    rew = torch.randn(b_, t_, generator=gen)
    values = torch.randn(b_, t_, generator=gen)
    adv, ret = gae_advantages(rew, mask, values, gamma, lambd)
    for i in range(b_):
        e_adv, e_ret = _gae_loop(
            (rew[i] * mask[i]).tolist(), (values[i] * mask[i]).tolist(), mask[i].tolist(), gamma, lambd
        )
        torch.testing.assert_close(adv[i], t(e_adv), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ret[i], t(e_ret), atol=1e-5, rtol=1e-5)


@FAST
@given(b_=st.integers(1, 5), t_=st.integers(1, 9), seed=st.integers(0, 10_000))
def test_gae_with_unit_gamma_lambda_and_zero_values_is_the_return(b_, t_, seed):
    gen = torch.Generator().manual_seed(seed)
    mask = _random_masks(gen, b_, t_, holes=True)
    rew = torch.randn(b_, t_, generator=gen) * mask
    expected = torch.stack([torch.tensor([rew[i, j:].sum() for j in range(t_)]) for i in range(b_)]) * mask
    adv, ret = gae_advantages(rew, mask, torch.zeros(b_, t_), gamma=1.0, lambd=1.0)
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, expected, atol=1e-5, rtol=1e-5)
    fast_adv, fast_ret = gae_advantages(rew, mask, None, gamma=1.0, lambd=1.0)  # cumulative-sum path
    torch.testing.assert_close(fast_adv, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast_ret, expected, atol=1e-5, rtol=1e-5)


def test_gae_lambda_limits():
    gen = torch.Generator().manual_seed(0)
    rew, values = torch.randn(3, 6, generator=gen), torch.randn(3, 6, generator=gen)
    mask = torch.ones(3, 6, dtype=torch.bool)
    gamma = 0.9
    next_v = torch.cat([values[:, 1:], torch.zeros(3, 1)], dim=1)
    td, _ = gae_advantages(rew, mask, values, gamma, lambd=0.0)
    torch.testing.assert_close(td, rew + gamma * next_v - values)  # one-step TD error
    mc, _ = gae_advantages(rew, mask, values, gamma, lambd=1.0)
    disc = torch.tensor([[gamma**k for k in range(6)]])
    mc_return = torch.stack([(rew[:, j:] * disc[:, : 6 - j]).sum(-1) for j in range(6)], dim=1)
    torch.testing.assert_close(mc, mc_return - values, atol=1e-5, rtol=1e-5)  # Monte-Carlo minus baseline


def test_normalize_hand_computed():
    adv = t([[1.0, 1.0, 1.0], [0.0, 0.0, 7.0]])
    mask = b([[1, 1, 1], [1, 1, 0]])
    # tokens 1,1,1,0,0: mean 0.6, biased var (3*0.16 + 2*0.36)/5 = 0.24
    s = math.sqrt(0.24)
    torch.testing.assert_close(normalize_advantages(adv, mask), t([[0.4 / s] * 3, [-0.6 / s, -0.6 / s, 0]]))
    centred = normalize_advantages(adv, mask, no_std_norm=True)
    torch.testing.assert_close(centred, t([[0.4] * 3, [-0.6, -0.6, 0]]))
    # a constant batch: var clamped to 1e-8 instead of dividing by zero
    flat = normalize_advantages(torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bool))
    assert torch.equal(flat, torch.zeros(2, 2))


# --- whole estimators ---------------------------------------------------------------------------------


def test_reinforce_end_to_end():
    mask = b([[1, 1, 1], [1, 1, 0]])
    batch = AdvantageInput(rewards=t([1.0, 0.0]), action_mask=mask)
    out = ADVANTAGE_ESTIMATORS["reinforce"](batch)
    torch.testing.assert_close(out.returns, t([[1, 1, 1], [0, 0, 0]]))
    s = math.sqrt(0.24)  # as in test_normalize_hand_computed
    torch.testing.assert_close(out.advantages, t([[0.4 / s] * 3, [-0.6 / s, -0.6 / s, 0]]))
    batch.no_std_norm = True
    centred = ADVANTAGE_ESTIMATORS["reinforce"](batch).advantages
    torch.testing.assert_close(centred, t([[0.4] * 3, [-0.6, -0.6, 0]]))


def test_reinforce_discounts_and_group_estimators_ignore_gamma():
    mask = b([[1, 1, 1], [1, 1, 1]])
    batch = AdvantageInput(rewards=t([1.0, 0.0]), action_mask=mask, gamma=0.5, n_samples_per_prompt=2)
    torch.testing.assert_close(
        compute_advantages(batch, "reinforce").returns, t([[0.25, 0.5, 1.0], [0, 0, 0]])
    )
    for name in GROUP_ESTIMATORS:
        with_gamma = compute_advantages(batch, name)
        batch_1 = AdvantageInput(rewards=t([1.0, 0.0]), action_mask=mask, gamma=1.0, n_samples_per_prompt=2)
        torch.testing.assert_close(with_gamma.advantages, compute_advantages(batch_1, name).advantages)


def test_group_norm_end_to_end_with_kl_in_reward():
    batch = AdvantageInput(
        rewards=t([1.0, 0.0]),
        action_mask=torch.ones(2, 2, dtype=torch.bool),
        n_samples_per_prompt=2,
        kl=torch.full((2, 2), 0.1),
        kl_coef=0.5,
    )
    out = compute_advantages(batch, "group_norm")
    a = 0.5 / math.sqrt(0.5)  # deviations +-0.5, unbiased std sqrt(0.5)
    # KL penalty -0.05 on every token; no batch normalisation for group_norm
    expected = t([[a - 0.1, a - 0.05], [-a - 0.1, -a - 0.05]])
    torch.testing.assert_close(out.returns, expected)
    torch.testing.assert_close(out.advantages, expected)


def test_opd_hand_computed():
    """Each action token's advantage is -kl_coef times its own KL (no sum over later tokens), plus the task
    reward's group-normalised advantage times its coefficient; padding and invalid rows get 0."""
    student = t([[-1.0, -2.0, -0.5], [-0.2, -3.0, 0.0], [-1.0, -1.0, -1.0], [-0.1, -0.1, 0.0]])
    teacher = t([[-1.5, -0.5, -0.5], [-0.2, -1.0, 0.0], [-2.0, -0.5, -1.0], [-0.3, -0.2, 0.0]])
    kl = student - teacher  # k1: [[.5, -1.5, 0], [0, -2, 0], [1, -.5, 0], [.2, .1, 0]]
    mask = b([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 0]])
    only_kl = opd_advantages(kl, 2.0, mask)
    torch.testing.assert_close(
        only_kl, t([[-1.0, 3.0, 0.0], [0.0, 4.0, 0.0], [-2.0, 1.0, 0.0], [-0.4, -0.2, 0.0]])
    )
    # two groups of 2: rewards (1, 0) and (1, 1); group_norm gives +-0.5 / sqrt(0.5) = +-sqrt(0.5), and 0
    g = math.sqrt(0.5)
    mixed = opd_advantages(kl, 2.0, mask, t([1.0, 0.0, 1.0, 1.0]), 2, task_reward_coef=0.5)
    want = t(
        [[-1.0 + g / 2, 3.0 + g / 2, g / 2], [-g / 2, 4.0 - g / 2, 0.0], [-2.0, 1.0, 0.0], [-0.4, -0.2, 0.0]]
    )
    torch.testing.assert_close(mixed, want)
    # an invalid sample: its row is 0, and its group has one valid sample left (no task advantage)
    invalid = opd_advantages(kl, 2.0, mask, t([1.0, NAN, 1.0, 0.0]), 2, 0.5, valid=b([1, 0, 1, 1]))
    torch.testing.assert_close(invalid[:2], t([[-1.0, 3.0, 0.0], [0.0, 0.0, 0.0]]))
    # --reward.clip_range clamps the group-normalised task reward (+-0.707 -> +-0.5), not the KL term
    clipped = opd_advantages(kl, 2.0, mask, t([1.0, 0.0, 1.0, 1.0]), 2, 0.5, reward_clip=(-0.5, 0.5))
    torch.testing.assert_close(clipped[0], t([-1.0 + 0.25, 3.0 + 0.25, 0.25]))
    # through the registered estimator: the same numbers, returns equal to the advantages
    out = ADVANTAGE_ESTIMATORS["opd"](
        AdvantageInput(
            rewards=t([1.0, 0.0, 1.0, 1.0]),
            action_mask=mask,
            n_samples_per_prompt=2,
            kl=kl,
            kl_coef=2.0,
            task_reward_coef=0.5,
            gamma=0.5,
        )
    )  # gamma is not read: there is no return over tokens
    torch.testing.assert_close(out.advantages, want)
    torch.testing.assert_close(out.returns, want)
    assert not ADVANTAGE_ESTIMATORS["opd"].needs_critic
    with pytest.raises(
        ValueError, match=r"n_samples_per_prompt >= 2 \(got 1\)"
    ):  # a task reward needs groups
        compute_advantages(
            AdvantageInput(
                rewards=t([0.0]), action_mask=mask[:1], kl=kl[:1], kl_coef=1.0, task_reward_coef=1.0
            ),
            "opd",
        )


def test_dr_grpo_is_mean_centred_without_any_scaling():
    batch = AdvantageInput(
        rewards=t([3.0, 1.0, 0.0, 0.0]),
        action_mask=torch.ones(4, 3, dtype=torch.bool),
        n_samples_per_prompt=2,
    )
    out = compute_advantages(batch, "dr_grpo")
    torch.testing.assert_close(out.advantages, t([[1.0] * 3, [-1.0] * 3, [0.0] * 3, [0.0] * 3]))


def test_reinforce_baseline_is_batch_normalised():
    gen = torch.Generator().manual_seed(0)
    mask = _random_masks(gen, 8, 6, holes=False) | (torch.arange(6) == 0)
    batch = AdvantageInput(rewards=torch.randn(8, generator=gen), action_mask=mask, n_samples_per_prompt=4)
    adv = compute_advantages(batch, "reinforce_baseline").advantages
    torch.testing.assert_close(adv[mask].mean(), torch.tensor(0.0), atol=1e-5, rtol=0)
    torch.testing.assert_close(adv[mask].var(unbiased=False), torch.tensor(1.0), atol=1e-4, rtol=0)


def test_reward_clip_applies_after_group_shaping():
    batch = AdvantageInput(
        rewards=t([10.0, 5.0]),
        action_mask=torch.ones(2, 1, dtype=torch.bool),
        n_samples_per_prompt=2,
        reward_clip=(-1.0, 1.0),
    )
    # shaped first: [5, -5], then clipped to [1, -1] (clipping first would give [0, 0])
    torch.testing.assert_close(compute_advantages(batch, "rloo").advantages, t([[1.0], [-1.0]]))


def test_invalid_rows_are_left_out_of_batch_statistics():
    mask = b([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    valid_only = AdvantageInput(rewards=t([1.0, 0.5]), action_mask=mask[:2])
    with_invalid = AdvantageInput(rewards=t([1.0, 0.5, NAN]), action_mask=mask, valid=b([True, True, False]))
    for name in ("reinforce", "gae"):
        if name == "gae":
            valid_only.values = t([[0.2, 0.1, 0.0], [0.3, 0.3, 0.3]])
            with_invalid.values = t([[0.2, 0.1, 0.0], [0.3, 0.3, 0.3], [NAN, 5.0, 5.0]])
        a, c = compute_advantages(valid_only, name), compute_advantages(with_invalid, name)
        torch.testing.assert_close(c.advantages[:2], a.advantages)
        torch.testing.assert_close(c.returns[:2], a.returns)
        assert torch.equal(c.advantages[2], torch.zeros(3)) and torch.equal(c.returns[2], torch.zeros(3))


@FAST
@given(
    name=st.sampled_from(sorted(ADVANTAGE_ESTIMATORS)),
    n=st.integers(2, 4),
    groups=st.integers(1, 3),
    t_=st.integers(1, 6),
    holes=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_padding_and_invalid_rows_do_not_leak(name, n, groups, t_, holes, seed):
    gen = torch.Generator().manual_seed(seed)
    bsz = n * groups
    mask = _random_masks(gen, bsz, t_, holes)
    valid = torch.rand(bsz, generator=gen) > 0.3
    rewards = torch.randn(bsz, generator=gen)
    kl, values = torch.rand(bsz, t_, generator=gen), torch.randn(bsz, t_, generator=gen)

    def batch(fill):
        # the same numbers on live rows and tokens, `fill` everywhere else
        return AdvantageInput(
            rewards=torch.where(valid, rewards, fill),
            action_mask=mask,
            n_samples_per_prompt=n,
            valid=valid,
            kl=torch.where(mask, kl, fill),
            kl_coef=0.1,
            values=torch.where(mask, values, fill) if name == "gae" else None,
            gamma=0.9,
            lambd=0.95,
        )

    a = ADVANTAGE_ESTIMATORS[name](batch(NAN))
    c = ADVANTAGE_ESTIMATORS[name](batch(1e6))
    assert torch.isfinite(a.advantages).all() and torch.isfinite(a.returns).all()
    torch.testing.assert_close(a.advantages, c.advantages)
    torch.testing.assert_close(a.returns, c.returns)
    live = mask & valid[:, None]
    assert (a.advantages[~live] == 0).all() and (a.returns[~live] == 0).all()


def test_nan_reward_counts_as_invalid_even_if_marked_valid():
    mask = torch.ones(4, 2, dtype=torch.bool)
    kl = dict(kl=torch.full((4, 2), 0.3), kl_coef=0.1, task_reward_coef=0.5)  # opd reads all three
    marked = AdvantageInput(rewards=t([1.0, NAN, 0.0, 0.5]), action_mask=mask, n_samples_per_prompt=4, **kl)
    explicit = AdvantageInput(
        rewards=t([1.0, 0.0, 0.0, 0.5]), action_mask=mask, n_samples_per_prompt=4, valid=b([1, 0, 1, 1]), **kl
    )
    for name in ADVANTAGE_ESTIMATORS:
        if name == "gae":
            continue
        torch.testing.assert_close(
            compute_advantages(marked, name).advantages, compute_advantages(explicit, name).advantages
        )


# --- configuration errors -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_group_estimators_refuse_one_sample_per_prompt(name):
    est = ADVANTAGE_ESTIMATORS[name]
    assert est.min_samples_per_prompt == 2 and not est.needs_critic
    with pytest.raises(ValueError, match=rf"{name}.*--rollout\.n_samples_per_prompt >= 2 \(got 1\)"):
        check_n_samples_per_prompt(name, est.min_samples_per_prompt, 1)
    check_n_samples_per_prompt(name, est.min_samples_per_prompt, 2)
    batch = AdvantageInput(rewards=t([1.0, 0.0]), action_mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="--rollout.n_samples_per_prompt"):
        est(batch)


def test_ragged_groups_and_missing_critic_are_refused():
    batch = AdvantageInput(
        rewards=t([1.0, 0.0, 2.0]), action_mask=torch.ones(3, 2, dtype=torch.bool), n_samples_per_prompt=2
    )
    with pytest.raises(ValueError, match="groups"):
        compute_advantages(batch, "rloo")
    with pytest.raises(ValueError, match="critic values"):
        compute_advantages(batch, "gae")
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages(batch, "grpo")
    gae = ADVANTAGE_ESTIMATORS["gae"]
    assert gae.needs_critic and gae.min_samples_per_prompt == 1
