"""A third-party rlhf plugin: copy this package to start your own.

It registers one advantage estimator, ``group_median``, and one multi-turn environment,
``guess_number``. rlhf finds them through the ``rlhf`` entry point in pyproject.toml; nothing in rlhf
imports this package by name.
"""

from __future__ import annotations

import torch
from rlhf_core import hookimpl
from rlhf_core.types import AdvantageInput, AdvantageOutput


class GroupMedianEstimator:
    """Advantage = reward - median reward of the prompt's group, on every action token.

    The median is a baseline that one outlier sample cannot drag. Rewards ``[B]`` in groups of ``n``
    consecutive rows; output ``[B, T]``. Unscorable samples (``valid`` False) are left out of the median and
    get zero advantage.
    """

    needs_critic = False
    min_samples_per_prompt = 2

    def __call__(self, batch: AdvantageInput) -> AdvantageOutput:
        n = batch.n_samples_per_prompt
        valid = batch.valid if batch.valid is not None else torch.ones_like(batch.rewards, dtype=torch.bool)
        rewards = torch.where(valid, batch.rewards, torch.nan).view(-1, n)
        baseline = rewards.nanmedian(dim=1, keepdim=True).values
        shaped = torch.nan_to_num(rewards - baseline, nan=0.0).view(-1)
        mask = batch.action_mask.to(shaped.dtype)
        advantages = shaped[:, None] * mask
        return AdvantageOutput(advantages=advantages, returns=advantages.clone())


@hookimpl
def rlhf_register_advantage_estimators(register):
    register("group_median", GroupMedianEstimator())
