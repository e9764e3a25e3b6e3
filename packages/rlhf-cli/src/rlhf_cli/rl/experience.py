"""From finished trajectories to the tensors of one RL step.

Shapes: ``B`` rows, ``T`` response positions, right-padded. A row is a trajectory, rows of the same prompt
consecutive (groups of ``n``), except for an episode trained as per-call samples (``Trajectory.segments``),
which has one row per segment, consecutive. The prompt + response token ids travel as lists (the workers
pad or pack them).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from rlhf_algos.shaping import overlong_penalty, stop_properly_penalty
from rlhf_core.types import AdvantageInput, AdvantageOutput, ImageInput, Trajectory


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
    episode_of: torch.Tensor | None = None
    """``[B]`` long: the trajectory each row comes from, when some episode has per-call samples; None when
    every row is a trajectory of its own."""

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
            episode_of=cut(self.episode_of),
        )

    def episode_rows(self) -> torch.Tensor:
        """``[E]`` the first row of each episode (per-episode rewards, scores and validity live there)."""
        if self.episode_of is None:
            return torch.arange(len(self.sequences))
        starts = torch.ones(len(self.sequences), dtype=torch.bool)
        starts[1:] = self.episode_of[1:] != self.episode_of[:-1]
        return starts.nonzero().flatten()


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
    KL belong to the estimator. Unscorable samples (reward None or non-finite) get ``valid`` False. An
    episode with ``segments`` becomes one row per segment, each with the episode's reward, score and
    validity; its length for the penalties is the action tokens of all its segments.
    """
    rows = [(e, part) for e, t in enumerate(trajs) for part in (t.segments or [t])]
    episode_of = torch.tensor([e for e, _ in rows], dtype=torch.long)
    rewards = torch.tensor([_finite_or_nan(t.reward) for t in trajs], dtype=torch.float32)
    scores = torch.tensor([_finite_or_nan(t.score if t.score is not None else t.reward) for t in trajs])
    valid = torch.isfinite(rewards)
    action_mask = pad_right([part.action_mask for _, part in rows], 0, torch.bool)
    lengths = torch.zeros(len(trajs), dtype=torch.long).index_add_(0, episode_of, action_mask.sum(-1))
    r = cfg.reward
    if r.overlong_buffer_len:
        rewards = overlong_penalty(rewards, lengths, cfg.rollout.max_new_tokens, r.overlong_buffer_len,
                                   r.overlong_penalty_factor)
    if r.stop_properly_penalty_coef is not None:
        truncated = torch.tensor([t.finish_reason == "length" or t.truncated for t in trajs])
        rewards = stop_properly_penalty(rewards, truncated, r.stop_properly_penalty_coef)
    per_call = len(rows) > len(trajs)
    return Experience(
        sequences=[part.prompt_ids + part.response_ids for _, part in rows],
        prompt_lens=[len(part.prompt_ids) for _, part in rows],
        action_mask=action_mask,
        rollout_logprobs=pad_right([part.rollout_logprobs for _, part in rows]),
        rewards=rewards[episode_of],
        valid=valid[episode_of],
        scores=scores[episode_of],
        images=[trajs[e].images for e, _ in rows] if any(t.images for t in trajs) else None,
        episode_of=episode_of if per_call else None,
    )


def episode_positions(action_mask: torch.Tensor, episode_of: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Where each episode's action tokens are, in order, for an estimator to see an episode as one row.

    ``action_mask`` ``[B, T]``, ``episode_of`` ``[B]`` (an episode's rows consecutive, in call order). Episode
    ``e``'s ``k``-th action token (row-major over its rows) is at ``(rows[e, k], cols[e, k])``, for ``k`` below
    its count; ``mask`` ``[E, W]`` says which ``k`` exist (``W``: the most action tokens of an episode).
    Returns ``(rows, cols, mask)``, all ``[E, W]``.
    """
    hits = action_mask.bool().nonzero()  # [N, 2], row-major: by episode, then call, then position
    episode = episode_of[hits[:, 0]]
    num_episodes = int(episode_of.max()) + 1 if episode_of.numel() else 0
    counts = torch.bincount(episode, minlength=num_episodes)
    k = torch.arange(len(hits)) - (counts.cumsum(0) - counts)[episode]
    width = max(int(counts.max()) if num_episodes else 0, 1)  # an estimator needs one position
    rows = torch.zeros(num_episodes, width, dtype=torch.long)
    cols = torch.zeros(num_episodes, width, dtype=torch.long)
    mask = torch.zeros(num_episodes, width, dtype=torch.bool)
    rows[episode, k], cols[episode, k], mask[episode, k] = hits[:, 0], hits[:, 1], True
    return rows, cols, mask


def estimate_advantages(estimator, exp: Experience, cfg, kl: torch.Tensor | None, kl_coef: float) -> AdvantageOutput:
    """``estimator``'s advantages and returns ``[B, T]`` for ``exp``.

    With per-call samples the estimator sees each episode as one row holding the action tokens of all its
    calls in order (:func:`episode_positions`), so group baselines and normalisation count the episode once,
    and each call's tokens get what they would get in one trajectory of the whole episode: with outcome
    rewards and KL as a loss (or none), every action token of every call gets the episode's shaped reward; KL
    folded into the reward adds the KL of the episode's later tokens, across calls, as it would in one
    trajectory. The results are put back on the rows.
    """
    batch = advantage_input(exp, cfg, kl, kl_coef)
    if exp.episode_of is None:
        return estimator(batch)
    rows, cols, mask = episode_positions(exp.action_mask, exp.episode_of)
    first = exp.episode_rows()

    def gather(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else torch.where(mask, x[rows, cols], 0.0)

    out = estimator(dataclasses.replace(
        batch, rewards=batch.rewards[first], valid=batch.valid[first], action_mask=mask,
        kl=gather(batch.kl), values=gather(batch.values),
    ))

    def scatter(y: torch.Tensor) -> torch.Tensor:
        back = torch.zeros(exp.action_mask.shape, dtype=y.dtype)
        back[rows[mask], cols[mask]] = y[mask]
        return back

    return AdvantageOutput(advantages=scatter(out.advantages), returns=scatter(out.returns))


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
