"""The single-controller RL loop.

One step: prompts -> rollout actors (executor + reward) -> experience (old / reference log-probs, values) ->
advantages (estimator plugin) -> policy and critic updates -> weight sync to the engines. The sync
pipeline runs these in turn (with ``--train.colocate_all`` the engines sleep while the trainers work); the
async pipeline generates the next batches in a thread while the trainers work, on a fixed schedule
(``_async_batches``) that keeps the run reproducible and its checkpoints exact.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf_algos.kl import make_kl_controller
from rlhf_algos.shaping import dynamic_filter
from rlhf_cli.rl.experience import Experience, build_experience, estimate_advantages
from rlhf_cli.rl.prompts import Prompt, PromptStream
from rlhf_core import inline
from rlhf_core.batches import (
    CriticMicroBatch,
    PolicyMicroBatch,
    PolicyStepConfig,
    make_sequence_batch,
    token_budget_micro_batches,
)
from rlhf_core.config import opd_teachers
from rlhf_core.errors import UserError
from rlhf_core.plugins import get_plugin_manager, resolve
from rlhf_core.types import SamplingParams, TrainGroup, Trajectory, derive_seed


class RLRunError(UserError, RuntimeError):
    """The run cannot go on; the message names the worker, file or setting at fault."""


@dataclass
class Groups:
    """The Ray worker groups of a run (None where the run does not need the role)."""

    actor: TrainGroup
    rollout: list  # RolloutActor handles
    ref: TrainGroup | None = None
    critic: TrainGroup | None = None
    reward: TrainGroup | None = None
    rollout_in_actor: bool = False
    """Engine ``i`` lives in actor rank ``i``'s process (``rlhf_cli.placement.roles_in_actor``)."""
    new_engine: Callable[[int], Any] | None = None
    """Starts a fresh engine actor ``i`` on engine ``i``'s placement, to replace a dead one; None where an engine
    cannot be replaced (hosted in a rank, or no Ray)."""


@dataclass
class WaitingGroup:
    """The samples of one prompt, generated and not yet trained on."""

    trajectories: list[Trajectory]
    policy_version: int
    came_back: bool = False
    """Dynamic filtering dropped this prompt's group once already and it was generated again."""


@dataclass
class Batch:
    """Trajectories of one step, with where they came from."""

    trajectories: list[Trajectory]
    prompts_used: int
    rollout_metrics: dict[str, float] = field(default_factory=dict)


def _worker_died() -> type[BaseException] | tuple:
    """Ray's error for a dead worker, to catch; nothing where Ray was never imported (a single-process run,
    whose workers live in this process, imports no Ray: the GPU image may not have it)."""
    ray = sys.modules.get("ray")
    return ray.exceptions.RayActorError if ray is not None else ()


def _get(refs, what: str):
    """``ray.get`` that names the role whose worker died."""
    try:
        return inline.get(refs)
    except _worker_died() as exc:
        raise RLRunError(f"a {what} worker died: {exc}") from exc


class RLController:
    def __init__(self, cfg, groups: Groups, stream: PromptStream, pad_token_id: int, checkpoints=None,
                 logger=None, eval_prompts: list[Prompt] | None = None, image_processing=None):
        self.cfg = cfg
        self.image_processing = image_processing  # a VLM's: turns the prompts' images into model inputs
        self.groups = groups
        self.stream = stream
        self.pad = pad_token_id
        self.checkpoints = checkpoints
        self.logger = logger
        self.eval_prompts = eval_prompts or []
        pm = get_plugin_manager()
        self.estimator = resolve(pm, "advantage_estimators", cfg.algo.advantage.estimator)
        self.kl_fn = resolve(pm, "kl_estimators", cfg.algo.kl.estimator)
        self.policy_loss = resolve(pm, "policy_losses", cfg.actor.policy_loss_type)
        self.kl_ctl = make_kl_controller(cfg.algo.kl.init_coef, cfg.algo.kl.target, cfg.algo.kl.horizon)
        self.step = 0
        self.waiting: list[WaitingGroup] = []  # generated groups, oldest first (over-generation)
        # prompts to generate again, oldest first: (uid, whether dynamic filtering dropped its group once already)
        self.requeued: list[tuple[int, bool]] = []
        self.ready: list[Batch] = []  # async: batches generated for the steps after this one, in step order
        # async schedule (see _async_batches), guarded by _cv: the last step generated, whether the thread runs
        self._cv = threading.Condition()
        self._generated = 0
        self._producing = False
        self.policy_version = 0
        self.best_metric: float | None = None
        # multi-teacher OPD: each prompt's teacher (a column of the prompt data), by prompt uid
        self.teacher_of = {p.uid: p.teacher for p in stream.prompts} if opd_teachers(cfg) else None
        self.consecutive_nonfinite = 0
        self.max_queue_size_seen = 0
        self._sync_address: tuple[str, int] | None = None
        self._sync_ranks: list[int] | None = None  # broadcast-group ranks of each engine; a 0: object store
        restarts = cfg.rollout.max_engine_restarts
        self.max_engine_restarts = restarts if restarts is not None else 0 if cfg.train.async_enable else 3
        self.engine_restarts = 0
        self.trainers_asleep = False  # the sync pipeline's hybrid engine, while the engines generate

    # --- rollout ---------------------------------------------------------------------------------------

    def sampling(self, eval_mode: bool = False) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            n=self.cfg.eval.n_samples_per_prompt if eval_mode else r.n_samples_per_prompt,
            temperature=self.cfg.eval.temperature if eval_mode else r.temperature,
            top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens, min_new_tokens=r.min_new_tokens,
        )

    def generate(self, prompts: list[Prompt], step: int, eval_mode: bool = False) -> tuple[list[Trajectory], dict]:
        """Spread ``prompts`` over the rollout actors (whole prompts, so groups stay together)."""
        actors = self.groups.rollout
        rows = [{"prompt_ids": p.ids, "prompt_text": p.text, "label": p.label, "prompt_uid": p.uid,
                 "images": p.image_inputs(self.image_processing)} for p in prompts]
        per = math.ceil(len(rows) / len(actors))
        sampling = self.sampling(eval_mode)
        seed_step = f"eval{step}" if eval_mode else step
        chunks = {i: rows[i * per:(i + 1) * per] for i in range(len(actors)) if rows[i * per:(i + 1) * per]}
        refs = {i: actors[i].rollout.remote(chunk, sampling, seed_step) for i, chunk in chunks.items()}
        results = []
        for i, chunk in chunks.items():
            while True:
                try:
                    results.append(inline.get(refs[i]))
                    break
                except _worker_died() as exc:
                    # the samples' seeds depend on the step, prompt and sample index only: the replacement
                    # draws the same samples from the same weights
                    refs[i] = self._replace_engine(i, exc).rollout.remote(chunk, sampling, seed_step)
        trajs = [t for ts, _ in results for t in ts]
        metrics: dict[str, float] = {}
        for _, m in results:
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + v / len(results)
        return trajs, metrics

    def _replace_engine(self, i: int, exc: BaseException):
        """A new engine ``i`` in place of the dead one, holding the current policy weights (through the object
        store; the next ``sync_weights`` builds a new broadcast group, since the old one has a dead rank).
        Raises :class:`RLRunError` when the engine cannot be replaced or ``--rollout.max_engine_restarts`` is
        spent."""
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if self.groups.new_engine is None:
            raise RLRunError(f"rollout engine {i} died: {cause}") from exc
        if self.max_engine_restarts == 0:
            raise RLRunError(f"rollout engine {i} died: {cause} (--rollout.max_engine_restarts 0: a dead engine "
                             "stops the run)") from exc
        if self.engine_restarts >= self.max_engine_restarts:
            raise RLRunError(f"rollout engine {i} died after {self.engine_restarts} engine restart(s), the most "
                             f"--rollout.max_engine_restarts allows ({self.max_engine_restarts}): {cause}") from exc
        self.engine_restarts += 1
        print(f"rlhf: rollout engine {i} died ({cause}); starting a new one (restart {self.engine_restarts} of "
              f"--rollout.max_engine_restarts {self.max_engine_restarts})", file=sys.stderr)
        inline.kill(self.groups.rollout[i])  # whatever is left of it
        engine = self.groups.new_engine(i)
        _get(engine.ping.remote(), "new rollout")
        import ray

        if self.trainers_asleep:  # their ZeRO-3 state is off the GPU: gather the weights from it awake
            self.groups.actor.wake_up()
        weights = ray.put(self.groups.actor.get_state_dict_for_engines())
        if self.trainers_asleep:
            self.groups.actor.sleep()
        _get(engine.update_weights.remote(weights), "new rollout")
        self.groups.rollout[i] = engine
        self._sync_address = None
        return engine

    def collect(self, step: int) -> Batch | None:
        """One step's trajectories: ``rollout.batch_size`` prompt groups.

        A generation round takes ``rollout.vllm_generate_batch_size`` prompts (default: the batch size; more
        is over-generation, async only), refilled when dynamic filtering drops groups; the groups beyond this
        step wait for the next steps, which then generate nothing. Step k trains policy version k - 1 (one
        weight sync per step): with ``--train.max_staleness N`` a waiting group generated by version v is
        dropped when k - 1 - v > N and its prompt generated again in this step's round. Accepted groups are
        kept even when the data runs out (unlike OpenRLHF #1310).
        """
        want = self.cfg.rollout.batch_size
        trained_at = step - 1
        limit = self.cfg.train.max_staleness
        counts: dict[str, float] = {}
        if limit is not None:
            stale = [g for g in self.waiting if trained_at - g.policy_version > limit]
            self.waiting = [g for g in self.waiting if trained_at - g.policy_version <= limit]
            self.requeued[:0] = [(g.trajectories[0].prompt_uid, g.came_back) for g in stale]  # before others
            counts["stale"] = float(len(stale))
        metrics: dict[str, float] = {}
        used = attempt = 0
        # more than one round only when the data ran out and prompts that filtering dropped are due again
        while len(self.waiting) < want and (self.requeued or not self.stream.exhausted):
            taken, attempt, metrics = self._generate_round(step, self.cfg.rollout.vllm_generate_batch_size or want,
                                                           attempt, counts)
            used += taken
        if not self.waiting:
            return None
        served, self.waiting = self.waiting[:want], self.waiting[want:]
        kept = [t for g in served for t in g.trajectories]
        if limit is not None:
            metrics["async/stale_groups_requeued"] = counts["stale"]
        if self.cfg.algo.dynamic_filtering_enable and "seen" in counts:  # a round ran
            metrics["dynamic_filtering_pass_rate"] = counts["kept"] / max(counts["seen"], 1)
            metrics["rollout/filtered_requeued"], metrics["rollout/filtered_lost"] = counts["requeued"], counts["lost"]
        lags = [trained_at - g.policy_version for g in served]
        metrics["policy_version_lag"] = float(max(lags))
        metrics["policy_version_lag_mean"] = sum(lags) / len(lags)
        # which prompts this step trained on, as one number: resumed and uninterrupted runs must agree
        metrics["rollout/prompt_digest"] = float(derive_seed(*sorted({t.prompt_uid for t in kept})) % 2**52)
        return Batch(kept, used, metrics)

    def _generate_round(self, step: int, size: int, attempt: int, counts: dict[str, float]
                        ) -> tuple[int, int, dict[str, float]]:
        """Generate until ``size`` prompt groups pass the filter (or the prompts run out) and queue them in
        ``self.waiting``; re-queued prompts come first, then the stream's. A group that dynamic filtering drops
        is re-queued for the next round (a later step, so a newer policy), once: dropped again, it is lost.
        Adds the round's group counts to ``counts``; returns the prompts used, the next attempt number (each
        generate call of a step samples with its own seeds) and the engines' metrics."""
        n = self.cfg.rollout.n_samples_per_prompt
        filtering = self.cfg.algo.dynamic_filtering_enable
        backlog, self.requeued = self.requeued, []
        kept: list[WaitingGroup] = []
        metrics: dict[str, float] = {}
        taken = 0
        for key in ("seen", "kept", "requeued", "lost"):
            counts.setdefault(key, 0.0)
        while len(kept) < size:
            entries, backlog = backlog[:size - len(kept)], backlog[size - len(kept):]
            entries += [(p.uid, False) for p in self.stream.take(size - len(kept) - len(entries))]
            if not entries:
                break
            taken += len(entries)
            prompts = [self.stream.prompts[uid] for uid, _ in entries]
            trajs, metrics = self.generate(prompts, step if attempt == 0 else f"{step}.{attempt}")
            attempt += 1
            keep = set(range(len(entries)))
            if filtering:
                scores = torch.tensor([_score(t) for t in trajs])
                keep = set(dynamic_filter(torch.nan_to_num(scores), n, tuple(self.cfg.algo.dynamic_filtering_range),
                                          torch.isfinite(scores)).tolist())
            for i, (uid, came_back) in enumerate(entries):
                if i in keep:
                    kept.append(WaitingGroup(trajs[i * n:(i + 1) * n], self.policy_version, came_back))
                elif came_back:
                    counts["lost"] += 1
                else:
                    self.requeued.append((uid, True))
                    counts["requeued"] += 1
            counts["seen"] += len(entries)
        counts["kept"] += len(kept)
        self.requeued[:0] = backlog  # what this round did not reach stays first in line
        self.waiting += kept
        return taken, attempt, metrics

    # --- experience ----------------------------------------------------------------------------------

    def micro_batches(self, exp: Experience, cuts: list) -> list:
        """One SequenceBatch per cut (a row slice or a list of row indices); unscorable rows keep their tokens
        but no action mask."""
        out = []
        for cut in cuts:
            rows = exp.rows(cut)
            masks = (rows.action_mask & rows.valid[:, None]).long()
            out.append(make_sequence_batch(
                [seq[:pl] for seq, pl in zip(rows.sequences, rows.prompt_lens)],
                [seq[pl:] for seq, pl in zip(rows.sequences, rows.prompt_lens)],
                self.pad, [m[: len(seq) - pl].tolist() for m, seq, pl in zip(masks, rows.sequences, rows.prompt_lens)],
                rows.images,
            ))
        return out

    def prompt_keys(self, exp: Experience) -> list[tuple] | None:
        """Each row's prompt ids, for token-budget micro-batches to keep a prompt's samples together where
        ``--ds.shared_prefix`` runs the prompt once for them (not with packing, which does not share)."""
        if not self.cfg.ds.shared_prefix or self.cfg.ds.packing_samples:
            return None
        return [tuple(seq[:pl]) for seq, pl in zip(exp.sequences, exp.prompt_lens)]

    def make_experience(self, batch: Batch) -> Experience:
        cfg = self.cfg
        exp = build_experience(batch.trajectories, cfg)
        b = len(exp.sequences)
        if cfg.train.dynamic_batch_enable:
            # a ring-attention group of R ranks splits each micro-batch R ways: R budgets per micro-batch
            budget = (cfg.rollout.max_tokens_per_gpu or cfg.train.max_tokens_per_gpu) * self.groups.actor.ring_size
            cuts = token_budget_micro_batches([len(q) for q in exp.sequences], self.groups.actor.dp_size, budget,
                                              cfg.ds.packing_samples, self.prompt_keys(exp))
        else:
            size = cfg.rollout.micro_batch_size
            cuts = [slice(s, s + size) for s in range(0, b, size)]
        mbs = self.micro_batches(exp, cuts)
        width = exp.action_mask.shape[1]
        # the stacked results hold the rows in the order of the cuts; ``restore`` puts row i back at position i

        def stack(parts: list[torch.Tensor], order=cuts) -> torch.Tensor:
            restore = torch.cat([torch.arange(b)[c] for c in order]).argsort()
            return torch.cat([torch.nn.functional.pad(p.float(), (0, width - p.shape[1])) for p in parts])[restore]

        # On-policy step (one epoch, one optimizer step over the whole batch, no KL folded into the reward):
        # the old log-probs are the current policy's, so the policy step uses its own, detached, and this
        # forward pass is skipped (TRL does the same with one iteration).
        on_policy = (cfg.train.max_epochs == 1 and b <= cfg.train.batch_size
                     and (self.groups.ref is None or cfg.algo.kl.use_loss))
        refs = {}
        if not on_policy:
            refs["old"] = self.groups.actor.call_sharded_async("compute_logprobs", mbs, cfg.rollout.temperature, False)
        teacher_calls = []  # multi-teacher OPD: each teacher scores the rows of its prompts, cut on their own
        if self.groups.ref is not None and self.teacher_of:
            teacher = torch.tensor([self.teacher_of[t.prompt_uid] for t in batch.trajectories])
            if exp.episode_of is not None:  # per-call samples: rows of one episode share its prompt's teacher
                teacher = teacher[exp.episode_of]
            for k in teacher.unique().tolist():
                rows = (teacher == k).nonzero().flatten().tolist()
                size = cfg.rollout.micro_batch_size
                tcuts = [rows[s:s + size] for s in range(0, len(rows), size)]
                teacher_calls.append((tcuts, self.groups.ref.call_sharded_async(
                    "compute_logprobs", self.micro_batches(exp, tcuts), cfg.rollout.temperature, False, teacher=k)))
        elif self.groups.ref is not None:
            refs["ref"] = self.groups.ref.call_sharded_async("compute_logprobs", mbs, cfg.rollout.temperature, False)
        if self.groups.critic is not None:
            refs["values"] = self.groups.critic.call_sharded_async("compute_values", mbs)
        role = {"old": self.groups.actor, "ref": self.groups.ref, "values": self.groups.critic}
        names = {"old": "policy", "ref": "reference", "values": "critic"}
        got = {}
        for key, (r, real) in refs.items():
            try:
                got[key] = stack(role[key].gather_sharded(r, real))
            except _worker_died() as exc:
                raise RLRunError(f"a {names[key]} worker died: {exc}") from exc
        if teacher_calls:
            parts = []
            try:
                for _, (r, real) in teacher_calls:
                    parts += self.groups.ref.gather_sharded(r, real)
            except _worker_died() as exc:
                raise RLRunError(f"a teacher worker died: {exc}") from exc
            got["ref"] = stack(parts, [c for tcuts, _ in teacher_calls for c in tcuts])
        mask = exp.action_mask & exp.valid[:, None]
        exp.old_logprobs = got["old"] * mask if "old" in got else None
        exp.ref_logprobs = got["ref"] * mask if "ref" in got else None
        exp.values = got["values"] * mask if "values" in got else None
        kl = None
        if exp.ref_logprobs is not None:
            # on-policy, the engine's log-probs of the same weights stand in for the old ones (KL as a loss:
            # this KL is only reported, and steers an adaptive coefficient)
            policy = exp.rollout_logprobs if exp.old_logprobs is None else exp.old_logprobs
            kl = self.kl_fn(policy, exp.ref_logprobs) * mask
        out = estimate_advantages(self.estimator, exp, cfg, kl, self.kl_ctl.value)
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
            "truncated/frac": sum(t.finish_reason == "length" or t.truncated for t in batch.trajectories)
            / len(batch.trajectories),
            "kl/mean": float((kl.sum(-1) / mask.sum(-1).clamp(min=1)).mean()) if kl is not None else 0.0,
            "kl/coef": self.kl_ctl.value,
            "advantages/mean": float(exp.advantages[mask].mean()) if mask.any() else 0.0,
        }
        if exp.old_logprobs is not None:  # on-policy steps get it from the policy step instead
            exp.info["policy/rollout_train_logprob_gap"] = float(
                ((exp.old_logprobs - exp.rollout_logprobs).abs() * mask).sum() / mask.sum().clamp(min=1))
        return exp

    # --- training ------------------------------------------------------------------------------------

    def policy_step_config(self) -> PolicyStepConfig:
        a, c = self.cfg.actor, self.cfg
        low, high = a.eps_clip_low_high or (a.eps_clip, a.eps_clip)
        adv = c.algo.advantage
        return PolicyStepConfig(
            loss=a.policy_loss_type, temperature=c.rollout.temperature, eps_clip_low=low, eps_clip_high=high,
            dual_clip=a.dual_clip, is_correction=adv.is_correction_type if adv.is_correction_enable else None,
            is_threshold=tuple(adv.is_correction_threshold),
            agg_mode=a.loss_agg_mode or getattr(self.policy_loss, "default_loss_agg_mode", "token_mean"),
            max_len=c.rollout.max_new_tokens, entropy_coef=a.entropy_coef,
            kl_coef=self.kl_ctl.value if c.algo.kl.use_loss else 0.0, kl_estimator=c.algo.kl.estimator,
        )

    def train(self, exp: Experience, step: int) -> dict[str, float]:
        """``train.max_epochs`` passes over the experience, one optimizer step per ``train.batch_size``
        sequences, in a seeded order per epoch. Micro-batches hold ``train.micro_batch_size`` rows, or with
        ``train.dynamic_batch_enable`` as many as fit ``train.max_tokens_per_gpu`` tokens per rank (times the
        ring-attention size, whose ranks each hold a slice of the micro-batch)."""
        cfg = self.cfg
        b = len(exp.sequences)
        micro = cfg.train.micro_batch_size
        dynamic = cfg.train.dynamic_batch_enable
        unit = self.groups.actor.dp_size * (1 if dynamic else micro)
        # a short final batch (data ran out) trains on the largest whole number of micro-batches per rank
        # (with dynamic batching: of rows per rank)
        per_step = cfg.train.batch_size if b >= cfg.train.batch_size else b // unit * unit
        if per_step == 0:
            return {"train/skipped_rows": float(b)}
        train_critic = self.groups.critic is not None
        train_actor = step > cfg.critic.freezing_steps or not train_critic
        pcfg = self.policy_step_config()
        # with --ds.shared_prefix whole groups are shuffled, so that a micro-batch runs each prompt once
        n = cfg.rollout.n_samples_per_prompt
        group = n if cfg.ds.shared_prefix and b % n == 0 and exp.episode_of is None else 1
        totals: dict[str, list[float]] = {}
        for epoch in range(cfg.train.max_epochs):
            seed = derive_seed(cfg.train.seed, step, epoch) % 2**62
            groups = torch.randperm(b // group, generator=torch.Generator().manual_seed(seed))
            order = (groups[:, None] * group + torch.arange(group)).reshape(-1)
            for s in range(0, b - per_step + 1, per_step):
                part = exp.rows(order[s:s + per_step].tolist())
                if dynamic:
                    lengths = [len(q) for q in part.sequences]
                    cuts = token_budget_micro_batches(lengths, self.groups.actor.dp_size,
                                                      cfg.train.max_tokens_per_gpu * self.groups.actor.ring_size,
                                                      cfg.ds.packing_samples, self.prompt_keys(part))
                else:
                    cuts = [slice(k, k + micro) for k in range(0, per_step, micro)]
                seqs = self.micro_batches(part, cuts)
                if train_actor:
                    old = part.old_logprobs
                    mbs = [PolicyMicroBatch(sq, None if old is None else _fit(old[c], sq), _fit(part.advantages[c], sq),
                                            _fit(part.rollout_logprobs[c], sq),
                                            None if part.ref_logprobs is None else _fit(part.ref_logprobs[c], sq))
                           for sq, c in zip(seqs, cuts)]
                    m = self._train_call(self.groups.actor, "train_policy_step", mbs, pcfg, what="policy")
                    _acc(totals, {f"policy/{k}": v for k, v in m.items()})
                if train_critic:
                    ccuts, cseqs = cuts, seqs
                    if dynamic and self.groups.critic.dp_size != self.groups.actor.dp_size:
                        ccuts = token_budget_micro_batches(lengths, self.groups.critic.dp_size,
                                                           cfg.train.max_tokens_per_gpu * self.groups.critic.ring_size,
                                                           cfg.ds.packing_samples)
                        cseqs = self.micro_batches(part, ccuts)
                    cmbs = [CriticMicroBatch(sq, _fit(part.values[c], sq), _fit(part.returns[c], sq))
                            for sq, c in zip(cseqs, ccuts)]
                    m = self._train_call(self.groups.critic, "train_critic_step", cmbs, cfg.critic.value_clip,
                                         what="critic")
                    _acc(totals, {f"critic/{k}": v for k, v in m.items()})
        out = {k: s / n for k, (s, n) in totals.items()}
        out["train/skipped_rows"] = float(b % per_step)
        return out

    def _train_call(self, group, method: str, mbs: list, arg, what: str) -> dict[str, float]:
        try:
            metrics = getattr(group, method)(mbs, arg)
        except _worker_died() as exc:
            raise RLRunError(f"a {what} worker died: {exc}") from exc
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

    def sync_weights(self) -> None:
        """Policy weights to every engine: broadcast from the policy's rank 0 through a torch.distributed
        group that the engines join themselves (gloo on CPU, NCCL on GPU; one rank per tensor-parallel
        worker; ZeRO-3 parameters gathered bucket by bucket), or through Ray's object store with
        ``--vllm.sync_with_ray`` or an engine that cannot join a group. A stalled sync raises after
        ``--vllm.sync_timeout``. Engines that live in the actor ranks' processes get an in-process copy."""
        engines = self.groups.rollout
        if self.groups.rollout_in_actor:  # each rank copies its weights into the engine in its process
            try:
                self.groups.actor.push_weights_to_hosted("rollout")
            except _worker_died() as exc:
                raise RLRunError(f"a policy worker died during the weight sync: {exc}") from exc
            self.policy_version += 1
            return
        import ray

        if self._sync_ranks is None:
            # NCCL cannot join two processes on one GPU: an engine colocated with the ranks on GPUs (vLLM) takes
            # the object store (CUDA IPC would avoid the copy through host memory; untested, see docs/gpu.md)
            same_gpu = self.cfg.train.colocate_all and torch.cuda.is_available()
            self._sync_ranks = [0] * len(engines) if self.cfg.vllm.sync_with_ray or same_gpu else _get(
                [a.weight_sync_ranks.remote() for a in engines], "rollout")
        if not all(self._sync_ranks):
            ref = ray.put(self.groups.actor.get_state_dict_for_engines())
            _get([a.update_weights.remote(ref) for a in engines], "rollout")
        else:
            backend = self.cfg.vllm.sync_backend if torch.cuda.is_available() else "gloo"
            world, timeout = 1 + sum(self._sync_ranks), self.cfg.vllm.sync_timeout
            if self._sync_address is None:
                self._sync_address = self.groups.actor.weight_sync_address()
                addr, port = self._sync_address
                firsts = [1 + sum(self._sync_ranks[:i]) for i in range(len(engines))]
                joins = [a.init_weight_sync.remote(master_addr=addr, master_port=port, first_rank=first,
                                                   world_size=world, backend=backend, timeout_s=timeout)
                         for a, first in zip(engines, firsts, strict=True)]
            else:
                addr, port = self._sync_address
                joins = []
            receives = [a.receive_weights.remote() for a in engines]
            sends = self.groups.actor.broadcast_weights_to_engines_async(addr, port, world, backend, timeout)
            try:
                _get(joins + receives, "rollout")
                ray.get(sends)
            except _worker_died() as exc:
                raise RLRunError(f"a policy worker died during the weight sync: {exc}") from exc
        self.policy_version += 1

    # --- the loop --------------------------------------------------------------------------------------

    def run_step(self, batch: Batch) -> dict[str, float]:
        t0 = time.perf_counter()
        exp = self.make_experience(batch)
        t1 = time.perf_counter()
        if self.cfg.train.colocate_all and self.cfg.vllm.enable_sleep:
            _get([a.sleep.remote() for a in self.groups.rollout], "rollout")
        train_metrics = self.train(exp, self.step)
        t2 = time.perf_counter()
        if self.cfg.train.colocate_all and self.cfg.vllm.enable_sleep:
            _get([a.wake_up.remote() for a in self.groups.rollout], "rollout")
        waited = time.perf_counter()
        if not self.cfg.train.partial_rollout_enable:  # the batches due from the weights before this step's
            self._wait_generated(self.step + self.cfg.train.async_queue_size)
        waited = time.perf_counter() - waited
        self.sync_weights()
        t3 = time.perf_counter()
        self.kl_ctl.update(exp.info["kl/mean"], len(exp.sequences))
        tokens = sum(len(s) for s in exp.sequences)
        return {**exp.info, **batch.rollout_metrics, **train_metrics,
                "timing/make_experience": t1 - t0, "timing/ppo_train": t2 - t1, "timing/broadcast": t3 - t2 - waited,
                "timing/sync_wait": waited,
                "perf/tokens_per_s_train": tokens / max(t2 - t0, 1e-9),
                "rollout/prompts_used": batch.prompts_used, "rollout/engine_restarts": float(self.engine_restarts)}

    def total_steps(self) -> int:
        steps = self.stream.total_steps(self.cfg.rollout.batch_size)
        return min(steps, self.cfg.train.max_steps) if self.cfg.train.max_steps > 0 else steps

    def fit(self) -> dict[str, float]:
        """Run every step; returns the last step's metrics."""
        last: dict[str, float] = {}
        if self.cfg.train.async_enable:
            batches = self._async_batches()
        else:
            batches = self._sync_batches()
        for batch in batches:
            self.step += 1
            t0 = time.perf_counter()
            metrics = self.run_step(batch)
            metrics["timing/generation"] = batch.rollout_metrics.get("timing/generation", math.nan)
            total = time.perf_counter() - t0 + batch.rollout_metrics.get("timing/generation", 0.0)
            metrics["timing/step_total"] = total
            # verl-style throughput: prompt + response tokens of the step over its wall time
            rows = [p for t in batch.trajectories for p in (t.segments or [t])]
            metrics["perf/tokens_per_s"] = sum(len(p.prompt_ids) + len(p.response_ids) for p in rows) / total
            gen = batch.rollout_metrics.get("timing/generation")
            if gen:
                metrics["perf/gen_tokens_per_s"] = sum(sum(p.action_mask) for p in rows) / gen
            metrics["async/max_queue_size"] = float(self.max_queue_size_seen)
            metrics.update(self.maybe_evaluate())
            self.maybe_checkpoint()
            if self.logger is not None:
                self.logger.log(self.step, metrics)
            last = metrics
        return last

    def trainers(self) -> list:
        return [g for g in (self.groups.actor, self.groups.critic, self.groups.ref) if g is not None]

    def _sync_batches(self):
        hybrid_sleep = self.cfg.train.colocate_all and self.cfg.ds.enable_sleep
        while self.step < self.total_steps():
            if self.ready:  # resumed from an async run's checkpoint: its batches first
                yield self.ready.pop(0)
                continue
            t0 = time.perf_counter()
            if hybrid_sleep:  # the trainers' state leaves the devices while the engines generate
                for g in self.trainers():
                    g.sleep()
                self.trainers_asleep = True
            batch = self.collect(self.step + 1)
            if hybrid_sleep:
                for g in self.trainers():
                    g.wake_up()
                self.trainers_asleep = False
            if batch is None:
                return
            batch.rollout_metrics["timing/generation"] = time.perf_counter() - t0
            yield batch

    def _async_batches(self):
        """Generate in a thread, ``train.async_queue_size`` (Q) batches ahead of training, on a fixed schedule:
        batch k is generated by policy version k-1-Q (the weights after step k-1-Q), so step k trains on
        samples min(k-1, Q) versions old, whatever the speeds. The thread starts batch k once step k-1-Q is
        finished (trained, synced, evaluated, checkpointed), and the weight sync after step v waits until batch
        v+Q is generated (``run_step``). So two runs generate and train the same samples, and at a checkpoint
        the thread is idle: what it generated is all in ``waiting`` and ``ready``, which the checkpoint holds.
        Generation of batch k+Q overlaps training of step k. With ``--train.partial_rollout_enable`` the sync
        does not wait: weights land while batch v+Q is generated (timing decides which tokens see them); the
        checkpoint waits for that batch instead. With ``--train.colocate_all --ds.enable_sleep`` the trainers
        sleep whenever they wait for a batch."""
        hybrid_sleep = self.cfg.train.colocate_all and self.cfg.ds.enable_sleep
        ahead = self.cfg.train.async_queue_size
        target = self.total_steps()
        cv = self._cv
        errors: list[BaseException] = []
        stop = threading.Event()
        finished = self.step  # steps trained, synced and checkpointed
        self._generated = self.step + len(self.ready)
        self._producing = True

        def produce():
            try:
                while self._generated < target:
                    with cv:
                        cv.wait_for(lambda: stop.is_set() or finished >= self._generated - ahead)
                    if stop.is_set():
                        break
                    t0 = time.perf_counter()
                    batch = self.collect(self._generated + 1)
                    if batch is None:
                        break
                    batch.rollout_metrics["timing/generation"] = time.perf_counter() - t0
                    with cv:
                        self.ready.append(batch)
                        self._generated += 1
                        cv.notify_all()
            except BaseException as exc:  # surfaced in the training thread
                errors.append(exc)
            finally:
                with cv:
                    self._producing = False
                    cv.notify_all()

        thread = threading.Thread(target=produce, name="rlhf-rollout", daemon=True)
        thread.start()
        try:
            while True:
                with cv:
                    finished = self.step
                    cv.notify_all()
                    self.max_queue_size_seen = max(self.max_queue_size_seen, len(self.ready))
                    asleep = hybrid_sleep and not self.ready  # a waiting batch is trained on at once: no sleep
                if asleep:
                    for g in self.trainers():
                        g.sleep()
                with cv:
                    cv.wait_for(lambda: self.ready or not self._producing)
                    batch = self.ready.pop(0) if self.ready else None
                if asleep:
                    for g in self.trainers():
                        g.wake_up()
                if batch is None:
                    break
                yield batch
            if errors:
                raise errors[0]
        finally:
            stop.set()
            with cv:
                cv.notify_all()
            thread.join(timeout=30)

    def _wait_generated(self, step: int) -> None:
        """Wait until the async thread has generated the batch of ``step`` (or stopped); at once otherwise."""
        with self._cv:
            self._cv.wait_for(lambda: self._generated >= step or not self._producing)

    # --- evaluation and checkpoints -----------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """pass@1 (mean score) and pass@k (mean over prompts of the best of k scores) on the eval prompts."""
        trajs, _ = self.generate(self.eval_prompts, self.step, eval_mode=True)
        k = self.cfg.eval.n_samples_per_prompt
        scores = torch.tensor([_score(t) for t in trajs]).nan_to_num(0.0).view(-1, k)
        return {"eval/pass1": float(scores.mean()), f"eval/pass{k}": float(scores.max(-1).values.mean()),
                "eval/response_length": sum(sum(t.action_mask) for t in trajs) / len(trajs)}

    def maybe_evaluate(self) -> dict[str, float]:
        e = self.cfg.eval
        if not self.eval_prompts:
            return {}
        due = (e.steps > 0 and self.step % e.steps == 0) or self.step == self.total_steps()
        if not due:
            return {}
        metrics = self.evaluate()
        key = self.cfg.ckpt.best_metric_key or "eval/pass1"
        value = metrics.get(key)
        if value is not None and (self.best_metric is None or value > self.best_metric):
            self.best_metric = value
            metrics["eval/best"] = value
            self.groups.actor.export_hf(f"{self.cfg.ckpt.output_dir}/best_model")
        return metrics

    def client_state(self) -> dict:
        """What the run needs to go on exactly, beyond the model state: with every group generated and not yet
        trained on (over-generation, the async thread's batches) and the prompts to generate again, so that a
        resumed run trains the very samples the uninterrupted one does. Taken between steps, when the async
        thread is idle (``maybe_checkpoint``)."""
        return {"step": self.step, "stream": self.stream.state_dict(),
                "kl_ctl": self.kl_ctl.state_dict(), "best_metric": self.best_metric,
                "policy_version": self.policy_version, "consecutive_nonfinite": self.consecutive_nonfinite,
                "waiting": list(self.waiting), "ready": list(self.ready), "requeued": list(self.requeued)}

    def load_client_state(self, state: dict) -> None:
        self.step = state["step"]
        self.stream.load_state_dict(state["stream"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.best_metric = state["best_metric"]
        self.policy_version = state["policy_version"]
        self.consecutive_nonfinite = state["consecutive_nonfinite"]
        # checkpoints from before these were saved hold the stream position of the last trained prompt instead
        self.waiting, self.ready = state.get("waiting", []), state.get("ready", [])
        self.requeued = state.get("requeued", [])

    def maybe_checkpoint(self) -> None:
        every = self.cfg.ckpt.save_steps
        if self.checkpoints is None or every <= 0 or self.step % every:
            return
        # partial rollout: the batches due before the next step may still be generating; finish them (the
        # thread then waits for this step to end), so that the checkpoint holds them whole
        self._wait_generated(self.step + self.cfg.train.async_queue_size)

        ckpt = self.cfg.ckpt

        def save(path):
            if not ckpt.disable_ds:
                self.groups.actor.save_checkpoint(str(path / "actor"))
                if self.groups.critic is not None:
                    self.groups.critic.save_checkpoint(str(path / "critic"))
            if ckpt.save_hf:
                self.groups.actor.export_hf(str(path / "hf"))

        self.checkpoints.save(self.step, save, {**self.client_state(), "has_ds_state": not ckpt.disable_ds})


def _score(t: Trajectory) -> float:
    v = t.score if t.score is not None else t.reward
    return float(v) if v is not None and math.isfinite(v) else math.nan


def _nanmean(x: torch.Tensor) -> float:
    x = x[torch.isfinite(x)]
    return float(x.mean()) if x.numel() else math.nan


def _fit(t: torch.Tensor, seq) -> torch.Tensor:
    """Crop a ``[b, T]`` tensor to the micro-batch's own response width."""
    return t[:, : seq.num_response_positions].contiguous()


def _acc(totals: dict[str, list[float]], metrics: dict[str, float]) -> None:
    for k, v in metrics.items():
        if isinstance(v, (int, float)) and math.isfinite(v):
            t = totals.setdefault(k, [0.0, 0])
            t[0] += v
            t[1] += 1
