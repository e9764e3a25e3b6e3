"""Prompts to trajectories on the rollout engines, and each step's batch of them."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import torch

from rlhf_algos.shaping import dynamic_filter
from rlhf_cli.rl.groups import Groups, RLRunError, wait_for
from rlhf_cli.rl.prompts import Prompt, PromptStream
from rlhf_cli.rl.sync import WeightSync
from rlhf_core.handles import Handle, kill, wait, worker_died
from rlhf_core.types import SamplingParams, Trajectory, derive_seed


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


def score(t: Trajectory) -> float:
    """The sample's task score (its reward where it has none); NaN where unscorable."""
    v = t.score if t.score is not None else t.reward
    return float(v) if v is not None and math.isfinite(v) else math.nan


class Rollout:
    """Generation on the engines (a dead engine replaced) and the collection of each step's batch: dynamic
    filtering, over-generation, re-queued and stale groups."""

    def __init__(self, cfg, groups: Groups, stream: PromptStream, sync: WeightSync, image_processing=None):
        self.cfg = cfg
        self.groups = groups
        self.stream = stream
        self.sync = sync
        self.image_processing = image_processing  # a VLM's: turns the prompts' images into model inputs
        self.waiting: list[WaitingGroup] = []  # generated groups, oldest first (over-generation)
        # prompts to generate again, oldest first: (uid, whether dynamic filtering dropped its group once already)
        self.requeued: list[tuple[int, bool]] = []
        restarts = cfg.rollout.max_engine_restarts
        self.max_engine_restarts = restarts if restarts is not None else 0 if cfg.train.async_enable else 3
        self.engine_restarts = 0
        self.trainers_asleep = False  # the sync pipeline's hybrid engine, while the engines generate

    def sampling(self, eval_mode: bool = False) -> SamplingParams:
        rollout, evaluation = self.cfg.rollout, self.cfg.eval
        return SamplingParams(
            n=evaluation.n_samples_per_prompt if eval_mode else rollout.n_samples_per_prompt,
            temperature=evaluation.temperature if eval_mode else rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            max_new_tokens=rollout.max_new_tokens,
            min_new_tokens=rollout.min_new_tokens,
        )

    def generate(self, prompts: list[Prompt], step, eval_mode: bool = False) -> tuple[list[Trajectory], dict]:
        """Spread ``prompts`` over the rollout actors (whole prompts, so groups stay together)."""
        actors = self.groups.rollout
        rows = [
            {
                "prompt_ids": p.ids,
                "prompt_text": p.text,
                "label": p.label,
                "prompt_uid": p.uid,
                "images": p.image_inputs(self.image_processing),
            }
            for p in prompts
        ]
        per = math.ceil(len(rows) / len(actors))
        sampling = self.sampling(eval_mode)
        seed_step = f"eval{step}" if eval_mode else step
        chunks = {
            i: rows[i * per : (i + 1) * per] for i in range(len(actors)) if rows[i * per : (i + 1) * per]
        }
        futures = {i: actors[i].rollout(chunk, sampling, seed_step) for i, chunk in chunks.items()}
        results = []
        for i, chunk in chunks.items():
            while True:
                try:
                    results.append(wait(futures[i]))
                    break
                except worker_died() as exc:
                    # the samples' seeds depend on the step, prompt and sample index only: the replacement
                    # draws the same samples from the same weights
                    futures[i] = self._replace_engine(i, exc).rollout(chunk, sampling, seed_step)
        keys = dict.fromkeys(k for _, m in results for k in m)  # the engines' metrics, averaged over them
        return [t for ts, _ in results for t in ts], {
            k: sum(m.get(k, 0.0) / len(results) for _, m in results) for k in keys
        }

    def _replace_engine(self, i: int, exc: BaseException) -> Handle:
        """A new engine ``i`` in place of the dead one, holding the current policy weights. Raises
        :class:`RLRunError` when the engine cannot be replaced or ``--rollout.max_engine_restarts`` is spent."""
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if self.groups.new_engine is None:
            raise RLRunError(f"rollout engine {i} died: {cause}") from exc
        if self.max_engine_restarts == 0:
            raise RLRunError(
                f"rollout engine {i} died: {cause} (--rollout.max_engine_restarts 0: a dead engine "
                "stops the run)"
            ) from exc
        if self.engine_restarts >= self.max_engine_restarts:
            raise RLRunError(
                f"rollout engine {i} died after {self.engine_restarts} engine restart(s), the most "
                f"--rollout.max_engine_restarts allows ({self.max_engine_restarts}): {cause}"
            ) from exc
        self.engine_restarts += 1
        print(
            f"rlhf: rollout engine {i} died ({cause}); starting a new one (restart {self.engine_restarts} of "
            f"--rollout.max_engine_restarts {self.max_engine_restarts})",
            file=sys.stderr,
        )
        kill(self.groups.rollout[i])  # whatever is left of it
        engine = self.groups.new_engine(i)
        wait_for(engine.ping(), "new rollout")
        self.sync.to_new_engine(engine, self.trainers_asleep)
        self.groups.rollout[i] = engine
        return engine

    def collect(self, step: int) -> Batch | None:
        """One step's trajectories: ``rollout.batch_size`` prompt groups, from those over-generation left
        waiting and rounds of ``rollout.vllm_generate_batch_size`` prompts; stale and filtered groups as
        docs/async.md says. Accepted groups are kept even when the data runs out (unlike OpenRLHF #1310)."""
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
            taken, attempt, metrics = self._generate_round(
                step, self.cfg.rollout.vllm_generate_batch_size or want, attempt, counts
            )
            used += taken
        if not self.waiting:
            return None
        served, self.waiting = self.waiting[:want], self.waiting[want:]
        kept = [t for g in served for t in g.trajectories]
        if limit is not None:
            metrics["async/stale_groups_requeued"] = counts["stale"]
        if self.cfg.algo.dynamic_filtering_enable and "seen" in counts:  # a round ran
            metrics["dynamic_filtering_pass_rate"] = counts["kept"] / max(counts["seen"], 1)
            metrics["rollout/filtered_requeued"], metrics["rollout/filtered_lost"] = (
                counts["requeued"],
                counts["lost"],
            )
        lags = [trained_at - g.policy_version for g in served]
        metrics["policy_version_lag"] = float(max(lags))
        metrics["policy_version_lag_mean"] = sum(lags) / len(lags)
        # which prompts this step trained on, as one number: resumed and uninterrupted runs must agree
        metrics["rollout/prompt_digest"] = float(derive_seed(*sorted({t.prompt_uid for t in kept})) % 2**52)
        return Batch(kept, used, metrics)

    def _generate_round(
        self, step: int, size: int, attempt: int, counts: dict[str, float]
    ) -> tuple[int, int, dict[str, float]]:
        """Generate until ``size`` prompt groups pass the filter (or the prompts run out) and queue them in
        ``self.waiting``, re-queued prompts first (a dropped group comes back once: docs/async.md). Adds the
        round's group counts to ``counts``; returns the prompts used, the next attempt number (each generate
        call of a step samples with its own seeds) and the engines' metrics."""
        n = self.cfg.rollout.n_samples_per_prompt
        filtering = self.cfg.algo.dynamic_filtering_enable
        backlog, self.requeued = self.requeued, []
        kept: list[WaitingGroup] = []
        metrics: dict[str, float] = {}
        taken = 0
        for key in ("seen", "kept", "requeued", "lost"):
            counts.setdefault(key, 0.0)
        while len(kept) < size:
            entries, backlog = backlog[: size - len(kept)], backlog[size - len(kept) :]
            entries += [(p.uid, False) for p in self.stream.take(size - len(kept) - len(entries))]
            if not entries:
                break
            taken += len(entries)
            prompts = [self.stream.prompts[uid] for uid, _ in entries]
            trajs, metrics = self.generate(prompts, step if attempt == 0 else f"{step}.{attempt}")
            attempt += 1
            keep = set(range(len(entries)))
            if filtering:
                scores = torch.tensor([score(t) for t in trajs])
                keep = set(
                    dynamic_filter(
                        torch.nan_to_num(scores),
                        n,
                        tuple(self.cfg.algo.dynamic_filtering_range),
                        torch.isfinite(scores),
                    ).tolist()
                )
            for i, (uid, came_back) in enumerate(entries):
                if i in keep:
                    kept.append(WaitingGroup(trajs[i * n : (i + 1) * n], self.sync.policy_version, came_back))
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
