"""One RL step wired the way the trainer does it, through the plugin names."""

from __future__ import annotations

import torch

from rlhf_algos import (
    check_n_samples_per_prompt,
    entropy_from_logits,
    entropy_loss,
    kl_loss,
    logprobs_from_logits,
    make_kl_controller,
    overlong_penalty,
    stop_properly_penalty,
    value_loss,
)
from rlhf_core import get_plugin_manager, resolve
from rlhf_core.config import KLConfig
from rlhf_core.types import AdvantageInput, LossAggregation, PolicyLossInput


def test_micro_batched_step_equals_the_full_batch_step():
    gen = torch.Generator().manual_seed(0)
    n, groups, t, vocab = 4, 2, 6, 11
    b = n * groups
    pm = get_plugin_manager()
    estimator = resolve(pm, "advantage_estimators", "reinforce_baseline")
    check_n_samples_per_prompt("reinforce_baseline", estimator.min_samples_per_prompt, n)
    policy_loss = resolve(pm, "policy_losses", "ppo")
    k1 = resolve(pm, "kl_estimators", "k1")

    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    labels = torch.randint(0, vocab, (b, t), generator=gen)
    logits = torch.randn(b, t, vocab, generator=gen, requires_grad=True)
    old_logp = logprobs_from_logits(logits.detach() + 0.1 * torch.randn(b, t, vocab, generator=gen), labels)
    ref_logp = old_logp + 0.05 * torch.randn(b, t, generator=gen)

    r = torch.randint(0, 2, (b,), generator=gen).float()
    r = overlong_penalty(r, lengths, max_new_tokens=t, buffer_len=2)
    r = stop_properly_penalty(r, lengths == t, coef=0.5)
    ctl = make_kl_controller(KLConfig(init_coef=0.02, target=0.1, horizon=100))
    adv = estimator(
        AdvantageInput(
            rewards=r, action_mask=mask, n_samples_per_prompt=n, kl=k1(old_logp, ref_logp), kl_coef=ctl.value
        )
    )

    def step_loss(rows, agg):
        logp = logprobs_from_logits(logits[rows], labels[rows])
        batch = PolicyLossInput(
            logprobs=logp,
            old_logprobs=old_logp[rows],
            advantages=adv.advantages[rows],
            action_mask=mask[rows],
            aggregation=agg,
        )
        out = policy_loss(batch)
        h = entropy_from_logits(logits[rows])
        return (
            out.loss
            + 0.1 * kl_loss(logp, ref_logp[rows], mask[rows], "k3", agg)
            + entropy_loss(h, mask[rows], 0.01, agg)
        )

    step_loss(slice(0, b), LossAggregation()).backward()
    full_grad = logits.grad.clone()
    logits.grad = None
    agg = LossAggregation(num_tokens=float(mask.sum()), num_sequences=float(b))
    for rows in (slice(0, 3), slice(3, 8)):
        step_loss(rows, agg).backward()
    torch.testing.assert_close(logits.grad, full_grad)
    assert (logits.grad[~mask] == 0).all()

    values = torch.randn(b, t, generator=gen, requires_grad=True)
    value_loss(values, values.detach() + 0.1, adv.returns, mask).loss.backward()
    assert (values.grad[~mask] == 0).all() and values.grad[mask].abs().sum() > 0
    ctl.update(current_kl=0.2, n_steps=b)
    assert ctl.value > 0.02  # KL above target: the coefficient grows
