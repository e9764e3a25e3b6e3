"""Conformance suites for the algorithm seams: advantage estimators, policy losses, KL estimators.

Subclass one and set ``name`` to the registered name; the object is resolved through a fresh plugin
manager, so the suite also proves the plugin is discoverable.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from rlhf_core.plugins import get_plugin_manager, resolve
from rlhf_core.types import (
    AGGREGATION_MODES,
    AdvantageInput,
    AdvantageOutput,
    LossAggregation,
    LossOutput,
    PolicyLossInput,
)


def _random_mask(b: int, t: int, gen: torch.Generator) -> torch.Tensor:
    """``[b, t]`` right-padded masks with lengths 1..t (every row has at least one action token)."""
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    return torch.arange(t)[None, :] < lengths[:, None]


class AdvantageEstimatorConformance:
    """Behaviour every advantage estimator must show, whatever its formula."""

    name: ClassVar[str]
    n_samples_per_prompt: ClassVar[int] = 4

    def estimator(self) -> Any:
        return resolve(get_plugin_manager(), "advantage_estimators", self.name)

    def make_batch(self, seed: int = 0, groups: int = 3, t: int = 7) -> AdvantageInput:
        est = self.estimator()
        gen = torch.Generator().manual_seed(seed)
        n = max(self.n_samples_per_prompt, est.min_samples_per_prompt)
        b = groups * n
        mask = _random_mask(b, t, gen)
        return AdvantageInput(
            rewards=torch.randn(b, generator=gen),
            action_mask=mask,
            n_samples_per_prompt=n,
            kl=torch.rand(b, t, generator=gen) * 0.1 * mask,
            kl_coef=0.05,
            values=torch.randn(b, t, generator=gen) * mask if est.needs_critic else None,
        )

    def test_declares_its_needs(self):
        est = self.estimator()
        assert isinstance(est.needs_critic, bool)
        assert isinstance(est.min_samples_per_prompt, int) and est.min_samples_per_prompt >= 1

    def test_shapes_and_masking(self):
        batch = self.make_batch()
        out = self.estimator()(batch)
        assert isinstance(out, AdvantageOutput)
        for t in (out.advantages, out.returns):
            assert t.shape == batch.action_mask.shape
            assert torch.isfinite(t).all() and (t[~batch.action_mask] == 0).all()

    def test_does_not_modify_its_input(self):
        batch = self.make_batch(seed=1)
        before = (batch.rewards.clone(), batch.kl.clone())
        self.estimator()(batch)
        assert torch.equal(batch.rewards, before[0]) and torch.equal(batch.kl, before[1])

    def test_deterministic(self):
        a = self.estimator()(self.make_batch(seed=2))
        b = self.estimator()(self.make_batch(seed=2))
        assert torch.equal(a.advantages, b.advantages) and torch.equal(a.returns, b.returns)

    def test_applies_the_in_reward_kl_penalty(self):
        """The estimator owns the in-reward KL: ``-kl_coef * kl`` on the action tokens (``--algo.kl.init_coef``
        without ``--algo.kl.use_loss``). Rows 0 and 1 are made identical, then row 0 gets more KL on
        every token: its advantage at its first token must fall below row 1's. Whatever the baseline or a
        positive rescaling of the batch, identical rows stay tied unless the KL is applied."""
        batch = self.make_batch(seed=5)
        for field in ("rewards", "action_mask", "kl", "values"):
            if (t := getattr(batch, field)) is not None:
                t = t.clone()
                t[1] = t[0]
                setattr(batch, field, t)
        batch.kl[0] += batch.action_mask[0]
        out = self.estimator()(batch)
        assert out.advantages[0, 0] < out.advantages[1, 0], "the KL penalty in AdvantageInput.kl was ignored"
        # with kl_coef 0 the kl tensor must not matter
        zero = self.estimator()(dataclasses.replace(batch, kl_coef=0.0))
        none = self.estimator()(dataclasses.replace(batch, kl=None, kl_coef=0.0))
        torch.testing.assert_close(zero.advantages, none.advantages)

    def test_applies_reward_clip(self):
        """``reward_clip`` (``--reward.clip_range``) bounds the group-shaped sequence reward: a range that
        clips some of this batch's rewards changes the advantages, one wider than every reward does not."""
        batch = dataclasses.replace(self.make_batch(seed=6), kl=None, kl_coef=0.0)
        batch.rewards = batch.rewards * 100  # far outside the clip range, whatever the group shaping
        plain = self.estimator()(batch)
        wide = self.estimator()(dataclasses.replace(batch, reward_clip=(-1e30, 1e30)))
        tight = self.estimator()(dataclasses.replace(batch, reward_clip=(-0.01, 0.01)))
        torch.testing.assert_close(wide.advantages, plain.advantages)
        assert not torch.allclose(tight.advantages, plain.advantages), (
            "AdvantageInput.reward_clip was ignored"
        )

    def test_invalid_samples_get_zero_advantage(self):
        batch = self.make_batch(seed=3)
        batch.valid = torch.arange(len(batch.rewards)) != 1  # sample 1 is invalid
        batch.rewards = batch.rewards.clone()
        batch.rewards[1] = float("nan")  # an unscorable sample must not poison the others
        out = self.estimator()(batch)
        assert (out.advantages[1] == 0).all()
        assert torch.isfinite(out.advantages).all()


class PolicyLossConformance:
    """Behaviour every policy loss must show."""

    name: ClassVar[str]

    def loss(self) -> Any:
        return resolve(get_plugin_manager(), "policy_losses", self.name)

    def make_batch(self, seed: int = 0, b: int = 6, t: int = 9) -> PolicyLossInput:
        gen = torch.Generator().manual_seed(seed)
        mask = _random_mask(b, t, gen)
        old = -torch.rand(b, t, generator=gen) * 3
        new = (old + torch.randn(b, t, generator=gen) * 0.3).requires_grad_(True)
        adv = torch.randn(b, t, generator=gen) * mask
        return PolicyLossInput(
            logprobs=new,
            old_logprobs=old,
            advantages=adv,
            action_mask=mask,
            rollout_logprobs=old + torch.randn(b, t, generator=gen) * 0.01,
        )

    def test_scalar_loss_and_float_metrics(self):
        out = self.loss()(self.make_batch())
        assert isinstance(out, LossOutput)
        assert out.loss.dim() == 0 and torch.isfinite(out.loss)
        assert all(isinstance(v, float) for v in out.metrics.values())

    def test_gradient_only_on_action_tokens(self):
        batch = self.make_batch(seed=1)
        self.loss()(batch).loss.backward()
        grad = batch.logprobs.grad
        assert grad is not None
        assert (grad[~batch.action_mask] == 0).all()
        assert grad[batch.action_mask].abs().sum() > 0

    def test_padding_values_do_not_matter(self):
        a = self.make_batch(seed=2)
        b = self.make_batch(seed=2)
        with torch.no_grad():
            b.logprobs[~b.action_mask] = 123.0
            b.old_logprobs[~b.action_mask] = -55.0
            b.advantages[~b.action_mask] = 9.0
        la, lb = self.loss()(a).loss, self.loss()(b).loss
        torch.testing.assert_close(la, lb)

    def test_default_aggregation_is_a_known_mode(self):
        """``default_loss_agg_mode`` is optional; when set it must be a mode the trainer can aggregate with."""
        mode = getattr(self.loss(), "default_loss_agg_mode", "token_mean")
        assert mode in AGGREGATION_MODES, (
            f"policy loss {self.name!r}: default_loss_agg_mode {mode!r} is not a LossAggregation mode"
        )
        batch = self.make_batch(seed=5)
        batch.aggregation = LossAggregation(mode=mode, max_len=batch.action_mask.shape[1])
        assert torch.isfinite(self.loss()(batch).loss)

    def test_token_mean_splits_add_up(self):
        """With the step's global token count, two half-batches sum to the whole batch."""
        full = self.make_batch(seed=4)
        agg = LossAggregation(
            mode="token_mean",
            num_tokens=float(full.action_mask.sum()),
            num_sequences=float(full.action_mask.shape[0]),
        )

        def loss(rows: slice) -> torch.Tensor:
            fields = {k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in full.__dict__.items()}
            return self.loss()(PolicyLossInput(**{**fields, "aggregation": agg})).loss

        torch.testing.assert_close(loss(slice(0, 6)), loss(slice(0, 3)) + loss(slice(3, 6)))


class KLEstimatorConformance:
    """Behaviour every KL estimator must show."""

    name: ClassVar[str]

    def kl(self) -> Any:
        return resolve(get_plugin_manager(), "kl_estimators", self.name)

    def test_zero_when_equal(self):
        lp = -torch.rand(3, 5) * 4
        assert torch.allclose(self.kl()(lp, lp.clone()), torch.zeros(3, 5))

    def test_shape_and_finite(self):
        gen = torch.Generator().manual_seed(0)
        lp, ref = -torch.rand(4, 6, generator=gen) * 30, -torch.rand(4, 6, generator=gen) * 30
        out = self.kl()(lp, ref)
        assert out.shape == (4, 6) and torch.isfinite(out).all()
