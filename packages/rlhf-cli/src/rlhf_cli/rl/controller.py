"""The single-controller RL loop (its steps: packages/rlhf-cli/README.md, "The loop"): :class:`RLController`
wires the job modules of ``rl/``, runs the steps and holds what a checkpoint needs.
"""

from __future__ import annotations

import math
import time

from rlhf_algos.kl import make_kl_controller
from rlhf_cli.rl.evaluation import Evaluation
from rlhf_cli.rl.experience import ExperienceMaker
from rlhf_cli.rl.groups import Groups, RLRunError, wait_for
from rlhf_cli.rl.prompts import Prompt, PromptStream
from rlhf_cli.rl.rollout import Batch, Rollout, WaitingGroup
from rlhf_cli.rl.schedule import BatchSchedule
from rlhf_cli.rl.step import PolicyStep
from rlhf_cli.rl.sync import WeightSync

# Batch and WaitingGroup stay importable here: checkpoints written before the split pickled them as this module's
__all__ = ["Batch", "Groups", "RLController", "RLRunError", "WaitingGroup"]


class RLController:
    def __init__(
        self,
        cfg,
        groups: Groups,
        stream: PromptStream,
        pad_token_id: int,
        checkpoints=None,
        logger=None,
        eval_prompts: list[Prompt] | None = None,
        image_processing=None,
    ):
        self.cfg = cfg
        self.groups = groups
        self.stream = stream
        self.checkpoints = checkpoints
        self.logger = logger
        self.step = 0
        self.kl_ctl = make_kl_controller(cfg.algo.kl)
        self.sync = WeightSync(cfg, groups)
        self.rollout = Rollout(cfg, groups, stream, self.sync, image_processing)
        self.experience = ExperienceMaker(cfg, groups, pad_token_id, stream.prompts)
        self.policy = PolicyStep(cfg, groups, pad_token_id)
        self.evaluation = Evaluation(cfg, self.rollout, groups.actor, eval_prompts or [])
        self.schedule = BatchSchedule(cfg, self.rollout, groups.trainers())

    def total_steps(self) -> int:
        steps = self.stream.total_steps(self.cfg.rollout.batch_size)
        return min(steps, self.cfg.train.max_steps) if self.cfg.train.max_steps > 0 else steps

    def fit(self) -> dict[str, float]:
        """Run every step; returns the last step's metrics."""
        last: dict[str, float] = {}
        for batch in self.schedule.batches(self.step, self.total_steps()):
            self.step += 1
            metrics = self.run_step(batch)
            metrics.update(self.evaluation.maybe_evaluate(self.step, self.total_steps()))
            self.maybe_checkpoint()
            if self.logger is not None:
                self.logger.log(self.step, metrics)
            last = metrics
        return last

    def run_step(self, batch: Batch) -> dict[str, float]:
        """Experience, policy and critic updates, and the weight sync of one step; the step's metrics."""
        sleep_engines = self.cfg.train.colocate_all and self.cfg.vllm.enable_sleep
        t0 = time.perf_counter()
        exp = self.experience.make(batch.trajectories, self.kl_ctl.value)
        t1 = time.perf_counter()
        if sleep_engines:
            wait_for([a.sleep() for a in self.groups.rollout], "rollout")
        train_metrics = self.policy.train(exp, self.step, self.kl_ctl.value)
        t2 = time.perf_counter()
        if sleep_engines:
            wait_for([a.wake_up() for a in self.groups.rollout], "rollout")
        waited = time.perf_counter()
        if not self.cfg.train.partial_rollout_enable:  # the batches due from the weights before this step's
            self.schedule.wait_generated(self.step + self.cfg.train.async_queue_size)
        waited = time.perf_counter() - waited
        self.sync.to_engines()
        t3 = time.perf_counter()
        self.kl_ctl.update(exp.info["kl/mean"], len(exp.sequences))
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
            "rollout/engine_restarts": float(self.rollout.engine_restarts),
            "async/max_queue_size": float(self.schedule.max_queue_size_seen),
        }
        if generation:
            metrics["perf/gen_tokens_per_s"] = sum(sum(p.action_mask) for p in rows) / generation
        return metrics

    # --- checkpoints -------------------------------------------------------------------------------------

    def client_state(self) -> dict:
        """What the run needs to go on exactly, beyond the model state (docs/async.md, "Exact resume"); taken
        between steps, when the async thread is idle (``maybe_checkpoint``)."""
        return {
            "step": self.step,
            "stream": self.stream.state_dict(),
            "kl_ctl": self.kl_ctl.state_dict(),
            "best_metric": self.evaluation.best_metric,
            "policy_version": self.sync.policy_version,
            "consecutive_nonfinite": self.policy.consecutive_nonfinite,
            "waiting": list(self.rollout.waiting),
            "ready": list(self.schedule.ready),
            "requeued": list(self.rollout.requeued),
        }

    def load_client_state(self, state: dict) -> None:
        self.step = state["step"]
        self.stream.load_state_dict(state["stream"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.evaluation.best_metric = state["best_metric"]
        self.sync.policy_version = state["policy_version"]
        self.policy.consecutive_nonfinite = state["consecutive_nonfinite"]
        # checkpoints from before these were saved hold the stream position of the last trained prompt instead
        self.rollout.waiting, self.schedule.ready = state.get("waiting", []), state.get("ready", [])
        self.rollout.requeued = state.get("requeued", [])

    def maybe_checkpoint(self) -> None:
        ckpt = self.cfg.ckpt
        if self.checkpoints is None or ckpt.save_steps <= 0 or self.step % ckpt.save_steps:
            return
        # partial rollout: the batches due before the next step may still be generating; finish them (the
        # thread then waits for this step to end), so that the checkpoint holds them whole
        self.schedule.wait_generated(self.step + self.cfg.train.async_queue_size)

        def save(path):
            if not ckpt.disable_ds:
                self.groups.actor.save_checkpoint(str(path / "actor"))
                if self.groups.critic is not None:
                    self.groups.critic.save_checkpoint(str(path / "critic"))
            if ckpt.save_hf:
                self.groups.actor.export_hf(str(path / "hf"))

        self.checkpoints.save(self.step, save, {**self.client_state(), "has_ds_state": not ckpt.disable_ds})
