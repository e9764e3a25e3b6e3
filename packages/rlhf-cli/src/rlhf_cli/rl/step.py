"""One RL step, top to bottom (:func:`rl_step`), and its policy and critic updates (:class:`PolicyStep`)."""

from __future__ import annotations

import math
import time

import torch

from rlhf_cli.rl.experience import Experience, micro_batch_cuts, sequence_batches
from rlhf_cli.rl.groups import Groups, RLRunError, dead_worker_reported, trainers_asleep, wait_for
from rlhf_cli.rl.rollout import Batch
from rlhf_core.batches import CriticMicroBatch, PolicyMicroBatch, PolicyStepConfig, SequenceBatch
from rlhf_core.handles import wait
from rlhf_core.plugins import get_plugin_manager, resolve
from rlhf_core.runloop import NonFiniteSteps
from rlhf_core.types import derive_seed


def rl_step(ctl, batch: Batch | None) -> dict[str, float] | None:
    """Step ``ctl.step + 1`` of the run (``ctl``: its :class:`~rlhf_cli.rl.controller.RLController`): generation, experience, policy and critic updates, weight sync; its
    metrics, or None when the data ran out before its batch was full. ``batch`` is the one the async
    pipeline's thread generated for it (``schedule.BatchSchedule``); None: generate it here."""
    cfg = ctl.cfg
    # the sync pipeline: generate the batch now, the trainers' state off the devices meanwhile (hybrid)
    if batch is None:
        hybrid_sleep = cfg.train.colocate_all and cfg.ds.enable_sleep
        t0 = time.perf_counter()
        with trainers_asleep(ctl.schedule.trainers, hybrid_sleep):
            ctl.rollout.trainers_asleep = hybrid_sleep
            batch = ctl.rollout.collect(ctl.step + 1)
            ctl.rollout.trainers_asleep = False
        if batch is None:
            return None
        batch.rollout_metrics["timing/generation"] = time.perf_counter() - t0
    ctl.step += 1
    sleep_engines = cfg.train.colocate_all and cfg.vllm.enable_sleep
    t0 = time.perf_counter()
    exp = ctl.experience.make(batch.trajectories, ctl.kl_ctl.value)  # log-probs, values, rewards, advantages
    t1 = time.perf_counter()
    if sleep_engines:
        wait_for([a.sleep() for a in ctl.groups.rollout], "rollout")
    train_metrics = ctl.policy.train(exp, ctl.step, ctl.kl_ctl.value)
    t2 = time.perf_counter()
    if sleep_engines:
        wait_for([a.wake_up() for a in ctl.groups.rollout], "rollout")
    waited = time.perf_counter()
    if not cfg.train.partial_rollout_enable:  # async: the batches due from the weights before this step's
        ctl.schedule.wait_generated(ctl.step + cfg.train.async_queue_size)
    waited = time.perf_counter() - waited
    ctl.sync.to_engines()
    t3 = time.perf_counter()
    ctl.kl_ctl.update(exp.info["kl/mean"], len(exp.sequences))
    generation = batch.rollout_metrics.get("timing/generation")
    total = time.perf_counter() - t0 + (generation or 0.0)
    rows = [p for t in batch.trajectories for p in (t.segments or [t])]
    metrics = {
        **exp.info,
        **batch.rollout_metrics,
        **train_metrics,
        "timing/make_experience": t1 - t0,
        "timing/ppo_train": t2 - t1,
        "timing/broadcast": t3 - t2 - waited,
        "timing/sync_wait": waited,
        "timing/generation": math.nan if generation is None else generation,
        "timing/step_total": total,
        "perf/tokens_per_s_train": sum(len(s) for s in exp.sequences) / max(t2 - t0, 1e-9),
        # verl-style throughput: prompt + response tokens of the step over its wall time
        "perf/tokens_per_s": sum(len(p.prompt_ids) + len(p.response_ids) for p in rows) / total,
        "rollout/prompts_used": batch.prompts_used,
        "rollout/engine_restarts": float(ctl.rollout.engine_restarts),
        "async/max_queue_size": float(ctl.schedule.max_queue_size_seen),
    }
    if generation:
        metrics["perf/gen_tokens_per_s"] = sum(sum(p.action_mask) for p in rows) / generation
    return metrics


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
    ``--train.max_nonfinite_steps`` optimizer steps in a row whose loss was not finite (:class:`NonFiniteSteps`)."""

    def __init__(self, cfg, groups: Groups, pad_token_id: int):
        self.cfg = cfg
        self.groups = groups
        self.pad = pad_token_id
        self.policy_loss = resolve(get_plugin_manager(), "policy_losses", cfg.actor.policy_loss_type)
        self.nonfinite = NonFiniteSteps(cfg.train.max_nonfinite_steps, RLRunError)

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
        max_tokens = cfg.train.max_tokens_per_gpu
        dynamic = cfg.train.dynamic_batch_enable
        unit = actor.dp_size * (1 if dynamic else micro)
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
                cuts = micro_batch_cuts(part, actor, None if dynamic else micro, max_tokens, cfg)
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
                    m = self.train_step(actor, mbs, "policy", policy_cfg, "policy")
                    steps.append({f"policy/{k}": v for k, v in m.items()})
                if critic is not None:
                    critic_cuts = micro_batch_cuts(part, critic, None if dynamic else micro, max_tokens, cfg)
                    # dynamic batching cuts for each group's number of ranks
                    critic_seqs = (
                        seqs if critic_cuts == cuts else sequence_batches(part, critic_cuts, self.pad)
                    )
                    mbs = [
                        CriticMicroBatch(sq, _crop(part.values, c, sq), _crop(part.returns, c, sq))
                        for sq, c in zip(critic_seqs, critic_cuts)
                    ]
                    m = self.train_step(critic, mbs, "value", cfg.critic.value_clip, "critic")
                    steps.append({f"critic/{k}": v for k, v in m.items()})
        out = _mean_finite(steps)
        out["train/skipped_rows"] = float(b % per_step)
        return out

    def train_step(self, learner, mbs: list, loss: str, loss_cfg, what: str) -> dict[str, float]:
        """One optimizer step of ``loss`` over ``mbs`` on ``learner`` (``forward_backward``, ``optim_step``),
        counted when every rank skipped it (non-finite)."""
        with dead_worker_reported(f"a {what} worker died"):
            wait(learner.forward_backward(mbs, loss, loss_cfg))
            metrics = wait(learner.optim_step())
        self.nonfinite.count_step(bool(metrics.get("skipped")), what)
        return metrics
