"""The policy and critic updates of one RL step."""

from __future__ import annotations

import math

import torch

from rlhf_cli.rl.experience import Experience, micro_batch_cuts, sequence_batches
from rlhf_cli.rl.groups import Groups, RLRunError, dead_worker_reported
from rlhf_core.batches import CriticMicroBatch, PolicyMicroBatch, PolicyStepConfig, SequenceBatch
from rlhf_core.plugins import get_plugin_manager, resolve
from rlhf_core.types import derive_seed


def _crop(t: torch.Tensor | None, rows, seq: SequenceBatch) -> torch.Tensor | None:
    """``t``'s ``rows`` (``[b, T]``), cropped to the micro-batch's own response width."""
    return None if t is None else t[rows][:, : seq.num_response_positions].contiguous()


def _mean_finite(steps: list[dict[str, float]]) -> dict[str, float]:
    """Each metric's mean over the optimizer steps where it is a finite number."""
    values: dict[str, list[float]] = {}
    for metrics in steps:
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                values.setdefault(k, []).append(v)
    return {k: sum(v) / len(v) for k, v in values.items()}


class PolicyStep:
    """Trains the policy (and the critic) on a step's experience; stops the run after
    ``--train.max_nonfinite_steps`` optimizer steps in a row whose loss was not finite."""

    def __init__(self, cfg, groups: Groups, pad_token_id: int):
        self.cfg = cfg
        self.groups = groups
        self.pad = pad_token_id
        self.policy_loss = resolve(get_plugin_manager(), "policy_losses", cfg.actor.policy_loss_type)
        self.consecutive_nonfinite = 0

    def config(self, kl_coef: float) -> PolicyStepConfig:
        actor, cfg = self.cfg.actor, self.cfg
        low, high = actor.eps_clip_low_high or (actor.eps_clip, actor.eps_clip)
        adv = cfg.algo.advantage
        return PolicyStepConfig(
            loss=actor.policy_loss_type,
            temperature=cfg.rollout.temperature,
            eps_clip_low=low,
            eps_clip_high=high,
            dual_clip=actor.dual_clip,
            is_correction=adv.is_correction_type if adv.is_correction_enable else None,
            is_threshold=tuple(adv.is_correction_threshold),
            agg_mode=actor.loss_agg_mode or getattr(self.policy_loss, "default_loss_agg_mode", "token_mean"),
            max_len=cfg.rollout.max_new_tokens,
            entropy_coef=actor.entropy_coef,
            kl_coef=kl_coef if cfg.algo.kl.use_loss else 0.0,
            kl_estimator=cfg.algo.kl.estimator,
        )

    def train(self, exp: Experience, step: int, kl_coef: float) -> dict[str, float]:
        """``train.max_epochs`` passes over the experience, one optimizer step per ``train.batch_size``
        sequences, in a seeded order per epoch; micro-batches cut for each group's ranks
        (:func:`~rlhf_cli.rl.experience.micro_batch_cuts`)."""
        cfg = self.cfg
        actor, critic = self.groups.actor, self.groups.critic
        b = len(exp.sequences)
        micro = cfg.train.micro_batch_size
        max_tokens = cfg.train.max_tokens_per_gpu if cfg.train.dynamic_batch_enable else None
        unit = actor.dp_size * (micro if max_tokens is None else 1)
        # a short final batch (data ran out) trains on the largest whole number of micro-batches per rank
        # (with dynamic batching: of rows per rank)
        per_step = cfg.train.batch_size if b >= cfg.train.batch_size else b // unit * unit
        if per_step == 0:
            return {"train/skipped_rows": float(b)}
        train_actor = step > cfg.critic.freezing_steps or critic is None
        policy_cfg = self.config(kl_coef)
        # with --ds.shared_prefix whole groups are shuffled, so that a micro-batch runs each prompt once
        n = cfg.rollout.n_samples_per_prompt
        group = n if cfg.ds.shared_prefix and b % n == 0 and exp.episode_of is None else 1
        steps: list[dict[str, float]] = []
        for epoch in range(cfg.train.max_epochs):
            seed = derive_seed(cfg.train.seed, step, epoch) % 2**62
            groups = torch.randperm(b // group, generator=torch.Generator().manual_seed(seed))
            order = (groups[:, None] * group + torch.arange(group)).reshape(-1)
            for s in range(0, b - per_step + 1, per_step):
                part = exp.rows(order[s : s + per_step].tolist())
                cuts = micro_batch_cuts(part, actor, micro, max_tokens, cfg)
                seqs = sequence_batches(part, cuts, self.pad)
                if train_actor:
                    mbs = [
                        PolicyMicroBatch(
                            sq,
                            _crop(part.old_logprobs, c, sq),
                            _crop(part.advantages, c, sq),
                            _crop(part.rollout_logprobs, c, sq),
                            _crop(part.ref_logprobs, c, sq),
                        )
                        for sq, c in zip(seqs, cuts)
                    ]
                    m = self.call(actor, "train_policy_step", mbs, policy_cfg, what="policy")
                    steps.append({f"policy/{k}": v for k, v in m.items()})
                if critic is not None:
                    critic_cuts = micro_batch_cuts(part, critic, micro, max_tokens, cfg)
                    # dynamic batching cuts for each group's number of ranks
                    critic_seqs = (
                        seqs if critic_cuts == cuts else sequence_batches(part, critic_cuts, self.pad)
                    )
                    mbs = [
                        CriticMicroBatch(sq, _crop(part.values, c, sq), _crop(part.returns, c, sq))
                        for sq, c in zip(critic_seqs, critic_cuts)
                    ]
                    m = self.call(critic, "train_critic_step", mbs, cfg.critic.value_clip, what="critic")
                    steps.append({f"critic/{k}": v for k, v in m.items()})
        out = _mean_finite(steps)
        out["train/skipped_rows"] = float(b % per_step)
        return out

    def call(self, group, method: str, mbs: list, arg, what: str) -> dict[str, float]:
        """``group.method(mbs, arg)``: one optimizer step, counted when every rank skipped it (non-finite)."""
        with dead_worker_reported(f"a {what} worker died"):
            metrics = getattr(group, method)(mbs, arg)
        if metrics.get("skipped"):
            self.consecutive_nonfinite += 1
            if self.consecutive_nonfinite >= self.cfg.train.max_nonfinite_steps:
                raise RLRunError(
                    f"{self.consecutive_nonfinite} {what} steps in a row had a non-finite loss (skipped on every "
                    f"rank); stopping with the last good checkpoint kept (--train.max_nonfinite_steps)"
                )
        else:
            self.consecutive_nonfinite = 0
        return metrics
