"""A third-party rlhf plugin: copy this package to start your own.

It registers one advantage estimator, ``group_median``, and one multi-turn environment,
``guess_number``. rlhf finds them through the ``rlhf`` entry point in pyproject.toml; nothing in rlhf
imports this package by name.
"""

from __future__ import annotations

import importlib.metadata

import torch

from rlhf_agents import AgentInstanceBase
from rlhf_algos.advantages import gae_advantages, token_level_rewards
from rlhf_core import hookimpl
from rlhf_core.types import AdvantageInput, AdvantageOutput

# The version is written once, in pyproject.toml; the installed distribution reports it.
__version__ = importlib.metadata.version("rlhf-example-plugin")


class GroupMedianEstimator:
    """Advantage = reward - median reward of the prompt's group, plus the in-reward KL penalty.

    The median is a baseline that one outlier sample cannot drag. Rewards ``[B]`` in groups of ``n``
    consecutive rows; output ``[B, T]``. Per row, with ``r`` the median-shaped reward::

        R_t = -kl_coef * kl_t + (t == last action token ? clamp(r, *reward_clip) : 0)
        A_t = returns_t = sum_{t' >= t} R_t'             over action tokens

    Every estimator owns the KL penalty and ``reward_clip`` of its input (``--algo.kl.init_coef`` without
    ``--algo.kl.use_loss``, ``--reward.clip_range``); rlhf-algos' helpers apply them as its built-ins do.
    Unscorable samples (``valid`` False, or a non-finite reward) are left out of the median and get zero
    advantage.
    """

    needs_critic = False
    min_samples_per_prompt = 2

    def __call__(self, batch: AdvantageInput) -> AdvantageOutput:
        n = batch.n_samples_per_prompt
        valid = torch.isfinite(batch.rewards)
        if batch.valid is not None:
            valid &= batch.valid.bool()
        rewards = torch.where(valid, batch.rewards.float(), torch.nan).view(-1, n)
        baseline = rewards.nanmedian(dim=1, keepdim=True).values
        shaped = torch.nan_to_num(rewards - baseline, nan=0.0).view(-1)
        live = batch.action_mask.bool() & valid[:, None]
        token_rewards = token_level_rewards(shaped, live, batch.kl, batch.kl_coef, batch.reward_clip)
        advantages, returns = gae_advantages(token_rewards, live)  # no critic, gamma 1: reward-to-go
        return AdvantageOutput(advantages=advantages, returns=returns)


@hookimpl
def rlhf_register_advantage_estimators(register):
    register("group_median", GroupMedianEstimator())


class GuessNumber(AgentInstanceBase):
    """A multi-turn environment: guess the secret digit (the label) in at most four tries.

    Each wrong guess gets ``higher`` or ``lower`` as feedback; the reward is 1.0 for a first-try hit,
    0.25 less per extra try, 0.0 when every try misses. The last digit in the reply is the guess.
    """

    max_tries = 4

    def __init__(self, *args, **kwargs):
        self.tries = 0

    async def reset(self, states, **kwargs):
        self.tries = 0
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.tries += 1
        digits = [c for c in states["action_text"] if c.isdigit()]
        guess, secret = (int(digits[-1]) if digits else None), int(states["label"])
        hit = guess == secret
        done = hit or self.tries >= self.max_tries
        if hit or done:
            feedback = ""
        else:
            feedback = " higher" if guess is None or guess < secret else " lower"
        return {
            "rewards": 1.0 - 0.25 * (self.tries - 1) if hit else 0.0,
            "scores": 1.0 if hit else 0.0,
            "environment_feedback": feedback,
            "done": done,
            "extra_logs": {"tries": float(self.tries)},
        }


@hookimpl
def rlhf_register_environments(register):
    register("guess_number", GuessNumber)


class AboveMean:
    """A post-processor for ``rlhf generate``: every sample that beats its prompt's mean reward, as SFT rows.

    Rejection sampling that keeps more than one sample per prompt: of rewards r_1..r_n, sample j is kept
    when r_j > mean(r). A prompt whose samples all score the same gives nothing.
    """

    def check(self, options):
        pass  # no options

    def __call__(self, batch):
        rows = []
        for group in batch.groups:
            mean = sum(s.reward for s in group) / len(group)
            rows += [
                {"input": s.input, "output": s.output, "reward": s.reward} for s in group if s.reward > mean
            ]
        return rows


@hookimpl
def rlhf_register_post_processors(register):
    register("above_mean", AboveMean())
