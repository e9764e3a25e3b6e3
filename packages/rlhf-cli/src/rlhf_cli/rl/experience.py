"""From finished trajectories to the tensors of one RL step: rewards, the policy's, reference's and critic's
forward passes, advantages; and the one place where micro-batches are cut.

Shapes: ``B`` rows, ``T`` response positions, right-padded. A row is a trajectory, rows of the same prompt
consecutive (groups of ``n``), except for an episode trained as per-call samples (``Trajectory.segments``),
which has one row per segment, consecutive. The prompt + response token ids travel as lists (the workers
pad or pack them).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field, fields

import torch

from rlhf_algos.shaping import overlong_penalty, stop_properly_penalty
from rlhf_cli.rl.groups import Groups, dead_worker_reported
from rlhf_core.batches import SequenceBatch, make_sequence_batch, token_budget_micro_batches
from rlhf_core.config import opd_teachers
from rlhf_core.handles import wait
from rlhf_core.plugins import get_plugin_manager, resolve
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
    routed_experts: list[torch.Tensor] | None = None
    """Router replay (``--actor.router_replay``): each row's ``Trajectory.routed_experts``; None: no replay."""

    def rows(self, index: list[int] | slice) -> Experience:
        """A sub-batch (micro-batches, data-parallel shards), without ``info``."""
        idx = list(range(len(self.sequences)))[index] if isinstance(index, slice) else index
        pick = torch.tensor(idx, dtype=torch.long)

        def cut(v):
            return v[pick] if isinstance(v, torch.Tensor) else None if v is None else [v[i] for i in idx]

        return Experience(**{f.name: cut(getattr(self, f.name)) for f in fields(self) if f.name != "info"})

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
        out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out


def _finite_or_nan(x: float | None) -> float:
    return float(x) if x is not None and math.isfinite(x) else math.nan


def build_experience(trajs: list[Trajectory], cfg) -> Experience:
    """Tensors of ``trajs`` with the reward shaping that precedes the estimator: the length penalties, in
    OpenRLHF's order (docs/algorithms.md, section 1). Unscorable samples (reward None or non-finite) get
    ``valid`` False. An episode with ``segments`` becomes one row per segment, each with the episode's reward,
    score and validity; its length for the penalties is the action tokens of all its segments.
    """
    rows = [(e, part) for e, t in enumerate(trajs) for part in (t.segments or [t])]
    episode_of = torch.tensor([e for e, _ in rows], dtype=torch.long)
    rewards = torch.tensor([_finite_or_nan(t.reward) for t in trajs], dtype=torch.float32)
    scores = torch.tensor([_finite_or_nan(t.score if t.score is not None else t.reward) for t in trajs])
    valid = torch.isfinite(rewards)
    action_mask = pad_right([part.action_mask for _, part in rows], 0, torch.bool)
    lengths = torch.zeros(len(trajs), dtype=torch.long).index_add_(0, episode_of, action_mask.sum(-1))
    shaping = cfg.reward
    if shaping.overlong_buffer_len:
        rewards = overlong_penalty(
            rewards,
            lengths,
            cfg.rollout.max_new_tokens,
            shaping.overlong_buffer_len,
            shaping.overlong_penalty_factor,
        )
    routed = None
    if cfg.actor.router_replay:
        routed = [t.routed_experts for _, t in rows]  # None: no engine call (an overlong prompt)
        if any(r is None and valid[e] for r, (e, _) in zip(routed, rows)):
            raise ValueError(
                "--actor.router_replay: a scored sample came without the engine's routing (an agent whose "
                "samples are not the engine's outputs, e.g. per-call samples)"
            )
    if shaping.stop_properly_penalty_coef is not None:
        truncated = torch.tensor([t.finish_reason == "length" or t.truncated for t in trajs])
        rewards = stop_properly_penalty(rewards, truncated, shaping.stop_properly_penalty_coef)
    return Experience(
        sequences=[part.prompt_ids + part.response_ids for _, part in rows],
        prompt_lens=[len(part.prompt_ids) for _, part in rows],
        action_mask=action_mask,
        rollout_logprobs=pad_right([part.rollout_logprobs for _, part in rows]),
        rewards=rewards[episode_of],
        valid=valid[episode_of],
        scores=scores[episode_of],
        images=[trajs[e].images for e, _ in rows] if any(t.images for t in trajs) else None,
        episode_of=episode_of if len(rows) > len(trajs) else None,  # per-call samples
        routed_experts=routed,
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


def estimate_advantages(
    estimator, exp: Experience, cfg, kl: torch.Tensor | None, kl_coef: float
) -> AdvantageOutput:
    """``estimator``'s advantages and returns ``[B, T]`` for ``exp``. With per-call samples the estimator sees
    each episode as one row holding the action tokens of all its calls in order (:func:`episode_positions`),
    and the results are put back on the rows (why: docs/algorithms.md, "Per-call samples")."""
    batch = advantage_input(exp, cfg, kl, kl_coef)
    if exp.episode_of is None:
        return estimator(batch)
    rows, cols, mask = episode_positions(exp.action_mask, exp.episode_of)
    first = exp.episode_rows()

    def gather(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else torch.where(mask, x[rows, cols], 0.0)

    out = estimator(
        dataclasses.replace(
            batch,
            rewards=batch.rewards[first],
            valid=batch.valid[first],
            action_mask=mask,
            kl=gather(batch.kl),
            values=gather(batch.values),
        )
    )

    def scatter(y: torch.Tensor) -> torch.Tensor:
        back = torch.zeros(exp.action_mask.shape, dtype=y.dtype)
        back[rows[mask], cols[mask]] = y[mask]
        return back

    return AdvantageOutput(advantages=scatter(out.advantages), returns=scatter(out.returns))


def advantage_input(exp: Experience, cfg, kl: torch.Tensor | None, kl_coef: float) -> AdvantageInput:
    """The estimator's input for ``exp``; ``kl`` ``[B, T]`` is folded into the reward unless KL is a loss."""
    advantage, as_loss = cfg.algo.advantage, cfg.algo.kl.use_loss
    return AdvantageInput(
        rewards=exp.rewards,
        action_mask=exp.action_mask,
        valid=exp.valid,
        values=exp.values,
        n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
        kl=None if as_loss else kl,
        kl_coef=0.0 if as_loss else kl_coef,
        gamma=advantage.gamma,
        lambd=advantage.lambd,
        reward_clip=tuple(cfg.reward.clip_range),
        no_std_norm=advantage.no_std_norm,
        task_reward_coef=cfg.algo.opd.task_reward_coef,
    )


def micro_batch_cuts(exp: Experience, group, rows: int | None, max_tokens: int | None, cfg) -> list:
    """The micro-batches of ``exp`` for ``group``'s ranks, each a row slice or a list of row indices: ``rows``
    rows each, in order, as long as each fits ``max_tokens`` (None: any size); else, or with ``rows`` None
    (dynamic batching, packages/rlhf-cli/README.md), as many rows as fit ``max_tokens`` per rank times the
    group's ring-attention size (its ranks each hold a slice of a micro-batch), a prompt's samples together
    under ``--ds.shared_prefix``. Tokens are counted as the forward runs them: packed (no padding), a shared
    prompt once for its rows (each row charged an equal share); padded rows x the longest otherwise."""
    n = len(exp.sequences)
    packed = cfg.ds.packing_samples or cfg.ds.shared_prefix
    lengths = [len(q) for q in exp.sequences]
    keys = None
    if cfg.ds.shared_prefix and not cfg.ds.packing_samples:
        keys = [tuple(seq[:pl]) for seq, pl in zip(exp.sequences, exp.prompt_lens)]
        share = Counter(keys)
        lengths = [m - pl + -(-pl // share[k]) for m, pl, k in zip(lengths, exp.prompt_lens, keys)]
    if rows is not None:
        cuts = [slice(s, s + rows) for s in range(0, n, rows)]
        cost = [sum(lengths[c]) if packed else len(lengths[c]) * max(lengths[c]) for c in cuts]
        if max_tokens is None or max(cost) <= max_tokens * group.ring_size:
            return cuts
    return token_budget_micro_batches(lengths, group.dp_size, max_tokens * group.ring_size, packed, keys)


def sequence_batches(exp: Experience, cuts: list, pad_token_id: int) -> list[SequenceBatch]:
    """One SequenceBatch per cut (:func:`micro_batch_cuts`); unscorable rows keep their tokens but no action
    mask."""
    out = []
    for part in map(exp.rows, cuts):
        rows = list(zip(part.sequences, part.prompt_lens, (part.action_mask & part.valid[:, None]).long()))
        out.append(
            make_sequence_batch(
                [seq[:pl] for seq, pl, _ in rows],
                [seq[pl:] for seq, pl, _ in rows],
                pad_token_id,
                [m[: len(seq) - pl].tolist() for seq, pl, m in rows],
                part.images,
                part.routed_experts,
            )
        )
    return out


def _nanmean(x: torch.Tensor) -> float:
    x = x[torch.isfinite(x)]
    return float(x.mean()) if x.numel() else math.nan


class ExperienceMaker:
    """A step's trajectories to its :class:`Experience`: the forward passes of the policy (old log-probs), the
    reference or the OPD teachers and the critic, side by side on their groups; then KL and advantages."""

    def __init__(self, cfg, groups: Groups, pad_token_id: int, prompts: list):
        self.cfg = cfg
        self.groups = groups
        self.pad = pad_token_id
        # multi-teacher OPD: each prompt's teacher (a column of the prompt data), by prompt uid
        self.teacher_of = {p.uid: p.teacher for p in prompts} if opd_teachers(cfg) else None
        plugins = get_plugin_manager()
        self.estimator = resolve(plugins, "advantage_estimators", cfg.algo.advantage.estimator)
        self.kl_fn = resolve(plugins, "kl_estimators", cfg.algo.kl.estimator)

    def make(self, trajs: list[Trajectory], kl_coef: float) -> Experience:
        cfg, actor, ref, critic = self.cfg, self.groups.actor, self.groups.ref, self.groups.critic
        exp = build_experience(trajs, cfg)
        b = len(exp.sequences)
        budget = cfg.rollout.max_tokens_per_gpu or cfg.train.max_tokens_per_gpu
        rows = None if cfg.train.dynamic_batch_enable else cfg.rollout.micro_batch_size
        cuts = micro_batch_cuts(exp, actor, rows, budget, cfg)
        mbs = sequence_batches(exp, cuts, self.pad)
        # router replay: the recorded experts are the policy's own, not the reference's or the critic's
        plain = (
            mbs if exp.routed_experts is None else [dataclasses.replace(m, routed_experts=None) for m in mbs]
        )
        width = exp.action_mask.shape[1]

        def stack(parts: list[torch.Tensor], order=cuts) -> torch.Tensor:
            """The results of micro-batches cut as ``order``, as ``[B, T]`` rows in ``exp``'s order."""
            restore = torch.cat([torch.arange(b)[c] for c in order]).argsort()
            return torch.cat([torch.nn.functional.pad(p.float(), (0, width - p.shape[1])) for p in parts])[
                restore
            ]

        # On-policy step (one epoch, one optimizer step over the whole batch, no KL folded into the reward):
        # the old log-probs are the current policy's, so the policy step uses its own, detached, and this
        # forward pass is skipped (TRL does the same with one iteration).
        on_policy = (
            cfg.train.max_epochs == 1 and b <= cfg.train.batch_size and (ref is None or cfg.algo.kl.use_loss)
        )
        calls = {}  # Experience field: (its role's name, the forward passes' futures, order of the rows)
        temperature = cfg.rollout.temperature
        if not on_policy:
            calls["old_logprobs"] = "policy", [actor.forward(mbs, temperature)], cuts
        if ref is not None and self.teacher_of:
            # multi-teacher OPD: each teacher scores the rows of its prompts, cut on their own
            teacher = torch.tensor([self.teacher_of[t.prompt_uid] for t in trajs])
            if exp.episode_of is not None:  # per-call samples: rows of one episode share its prompt's teacher
                teacher = teacher[exp.episode_of]
            futures, order = [], []
            for k in teacher.unique().tolist():
                rows = (teacher == k).nonzero().flatten().tolist()
                part = exp.rows(rows)
                part_cuts = micro_batch_cuts(part, ref, cfg.rollout.micro_batch_size, budget, cfg)
                futures.append(
                    ref.forward(sequence_batches(part, part_cuts, self.pad), temperature, teacher=k)
                )
                order += [rows[c] for c in part_cuts]
            calls["ref_logprobs"] = "teacher", futures, order
        elif ref is not None:
            calls["ref_logprobs"] = "reference", [ref.forward(plain, temperature)], cuts
        if critic is not None:
            calls["values"] = "critic", [critic.forward(plain, head="values")], cuts
        mask = exp.action_mask & exp.valid[:, None]
        for field_name, (role, futures, order) in calls.items():
            with dead_worker_reported(f"a {role} worker died"):
                results = [x for part in wait(futures) for x in part]
            setattr(exp, field_name, stack(results, order) * mask)
        kl = None
        if exp.ref_logprobs is not None:
            # on-policy, the engine's log-probs of the same weights stand in for the old ones (KL as a loss:
            # this KL is only reported, and steers an adaptive coefficient)
            policy = exp.rollout_logprobs if exp.old_logprobs is None else exp.old_logprobs
            kl = self.kl_fn(policy, exp.ref_logprobs) * mask
        out = estimate_advantages(self.estimator, exp, cfg, kl, kl_coef)
        exp.advantages, exp.returns = out.advantages, out.returns
        lengths = exp.action_mask.sum(-1).float()
        episodes = exp.episode_rows()  # reward statistics count an episode of per-call samples once
        rewards, valid = exp.rewards[episodes], exp.valid[episodes]
        exp.info = {
            "reward/mean": _nanmean(rewards),
            "reward/std": float(rewards[valid].std()) if int(valid.sum()) > 1 else 0.0,
            "score/mean": _nanmean(exp.scores[episodes]),
            "reward/unscorable": float((~valid).sum()),
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "truncated/frac": sum(t.finish_reason == "length" or t.truncated for t in trajs) / len(trajs),
            "kl/mean": float((kl.sum(-1) / mask.sum(-1).clamp(min=1)).mean()) if kl is not None else 0.0,
            "kl/coef": kl_coef,
            "advantages/mean": float(exp.advantages[mask].mean()) if mask.any() else 0.0,
        }
        if exp.old_logprobs is not None:  # on-policy steps get it from the policy step instead
            exp.info["policy/rollout_train_logprob_gap"] = float(
                ((exp.old_logprobs - exp.rollout_logprobs).abs() * mask).sum() / mask.sum().clamp(min=1)
            )
        return exp
