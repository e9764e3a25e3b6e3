"""From finished trajectories to the tensors of one RL step.

Shapes: ``B`` trajectories, rows of the same prompt consecutive (groups of ``n``); ``T`` response positions,
right-padded. The prompt + response token ids travel as lists (the workers pad or pack them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from rlhf_algos.shaping import overlong_penalty, stop_properly_penalty
from rlhf_core.types import AdvantageInput, ImageInput, Trajectory


@dataclass
class Experience:
    """One RL step's training data."""

    sequences: list[list[int]]
    """Prompt + response ids of each trajectory."""
    prompt_lens: list[int]
    action_mask: torch.Tensor
    """``[B, T]`` bool: the policy produced this response token."""
    rollout_logprobs: torch.Tensor
    """``[B, T]`` the engine's log-probs (0 off the action mask)."""
    rewards: torch.Tensor
    """``[B]`` rewards after length penalties; NaN where unscorable."""
    valid: torch.Tensor
    """``[B]`` bool: the sample was scored; unscorable ones stay out of baselines and the loss."""
    scores: torch.Tensor
    """``[B]`` task scores (metrics, dynamic filtering); NaN where unscorable."""
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    info: dict[str, float] = field(default_factory=dict)
    images: list[list[ImageInput]] | None = None
    """Vision-language models: each trajectory's images (shared by the samples of a prompt); None: text."""

    @property
    def num_action_tokens(self) -> int:
        return int((self.action_mask & self.valid[:, None]).sum())

    def rows(self, index: list[int] | slice) -> Experience:
        """A sub-batch (micro-batches, data-parallel shards)."""
        idx = list(range(len(self.sequences)))[index] if isinstance(index, slice) else index
        pick = torch.tensor(idx, dtype=torch.long)

        def cut(t):
            return None if t is None else t[pick]

        return Experience(
            [self.sequences[i] for i in idx], [self.prompt_lens[i] for i in idx], cut(self.action_mask),
            cut(self.rollout_logprobs), cut(self.rewards), cut(self.valid), cut(self.scores),
            cut(self.old_logprobs), cut(self.ref_logprobs), cut(self.values), cut(self.advantages),
            cut(self.returns), images=None if self.images is None else [self.images[i] for i in idx],
        )


def pad_right(rows: list[list], value: float = 0.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out


def _finite_or_nan(x: float | None) -> float:
    return float(x) if x is not None and math.isfinite(x) else math.nan


def build_experience(trajs: list[Trajectory], cfg) -> Experience:
    """Tensors of ``trajs`` with the reward shaping that precedes the estimator (length penalties).

    Order, as OpenRLHF: DAPO overlong penalty, then the stop-properly penalty; group shaping, clipping and
    KL belong to the estimator. Unscorable samples (reward None or non-finite) get ``valid`` False.
    """
    rewards = torch.tensor([_finite_or_nan(t.reward) for t in trajs], dtype=torch.float32)
    scores = torch.tensor([_finite_or_nan(t.score if t.score is not None else t.reward) for t in trajs])
    valid = torch.isfinite(rewards)
    action_mask = pad_right([t.action_mask for t in trajs], 0, torch.bool)
    lengths = action_mask.sum(-1)
    r = cfg.reward
    if r.overlong_buffer_len:
        rewards = overlong_penalty(rewards, lengths, cfg.rollout.max_new_tokens, r.overlong_buffer_len,
                                   r.overlong_penalty_factor)
    if r.stop_properly_penalty_coef is not None:
        truncated = torch.tensor([t.finish_reason == "length" or t.truncated for t in trajs])
        rewards = stop_properly_penalty(rewards, truncated, r.stop_properly_penalty_coef)
    return Experience(
        sequences=[t.prompt_ids + t.response_ids for t in trajs],
        prompt_lens=[len(t.prompt_ids) for t in trajs],
        action_mask=action_mask,
        rollout_logprobs=pad_right([t.rollout_logprobs for t in trajs]),
        rewards=rewards,
        valid=valid,
        scores=scores,
        images=[t.images for t in trajs] if any(t.images for t in trajs) else None,
    )


def advantage_input(exp: Experience, cfg, kl: torch.Tensor | None, kl_coef: float) -> AdvantageInput:
    """The estimator's input for ``exp``; ``kl`` ``[B, T]`` is folded into the reward unless KL is a loss."""
    a = cfg.algo.advantage
    return AdvantageInput(
        rewards=exp.rewards,
        action_mask=exp.action_mask,
        n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
        valid=exp.valid,
        kl=None if cfg.algo.kl.use_loss else kl,
        kl_coef=0.0 if cfg.algo.kl.use_loss else kl_coef,
        values=exp.values,
        gamma=a.gamma,
        lambd=a.lambd,
        reward_clip=tuple(cfg.reward.clip_range),
        no_std_norm=a.no_std_norm,
        task_reward_coef=cfg.algo.opd.task_reward_coef,
    )
