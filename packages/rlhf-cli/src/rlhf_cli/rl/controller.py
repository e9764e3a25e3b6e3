"""The single-controller RL loop (its steps: packages/rlhf-cli/README.md, "The loop"): :class:`RLController`
wires the job modules of ``rl/``, runs the steps (one step: ``step.rl_step``), evaluates, checkpoints and logs
them, and holds what a checkpoint needs.
"""

from __future__ import annotations

from rlhf_algos.kl import make_kl_controller
from rlhf_cli.rl.evaluation import Evaluation
from rlhf_cli.rl.experience import ExperienceMaker
from rlhf_cli.rl.groups import Groups, RLRunError
from rlhf_cli.rl.prompts import Prompt, PromptStream
from rlhf_cli.rl.rollout import Batch, Rollout, WaitingGroup
from rlhf_cli.rl.schedule import BatchSchedule
from rlhf_cli.rl.step import PolicyStep, rl_step
from rlhf_cli.rl.sync import WeightSync
from rlhf_core.runloop import save_checkpoint

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
        """Run every step (:func:`~rlhf_cli.rl.step.rl_step`), each evaluated, checkpointed and logged; returns
        the last step's metrics."""
        last: dict[str, float] = {}
        for batch in self.schedule.batches(self.step, self.total_steps()):
            metrics = rl_step(self, batch)
            if metrics is None:  # the data ran out
                break
            metrics.update(self.evaluation.maybe_evaluate(self.step, self.total_steps()))
            self.maybe_checkpoint()
            if self.logger is not None:
                self.logger.log(self.step, metrics)
            last = metrics
        return last

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
            "consecutive_nonfinite": self.policy.nonfinite.count,
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
        self.policy.nonfinite.count = state["consecutive_nonfinite"]
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

        models = {"actor": self.groups.actor, "critic": self.groups.critic}
        models = {name: g for name, g in models.items() if g is not None}
        save_checkpoint(self.checkpoints, self.step, ckpt, models, self.client_state())
