"""pass@k on the eval prompts, and the best model by it."""

from __future__ import annotations

import torch

from rlhf_cli.rl.prompts import Prompt
from rlhf_cli.rl.rollout import Rollout, score
from rlhf_core.handles import wait


class Evaluation:
    def __init__(self, cfg, rollout: Rollout, actor, prompts: list[Prompt]):
        self.cfg = cfg
        self.rollout = rollout
        self.actor = actor
        self.prompts = prompts
        self.best_metric: float | None = None

    def maybe_evaluate(self, step: int, total_steps: int) -> dict[str, float]:
        """Every ``--eval.steps`` steps and after the last: pass@1 (mean score) and pass@k (mean over prompts of
        the best of k scores) on the eval prompts; a new best (``--ckpt.best_metric_key``) goes to ``best_model``."""
        every = self.cfg.eval.steps
        if not self.prompts or not ((every > 0 and step % every == 0) or step == total_steps):
            return {}
        trajs, _ = self.rollout.generate(self.prompts, step, eval_mode=True)
        k = self.cfg.eval.n_samples_per_prompt
        scores = torch.tensor([score(t) for t in trajs]).nan_to_num(0.0).view(-1, k)
        metrics = {
            "eval/pass1": float(scores.mean()),
            f"eval/pass{k}": float(scores.max(-1).values.mean()),
            "eval/response_length": sum(sum(t.action_mask) for t in trajs) / len(trajs),
        }
        value = metrics.get(self.cfg.ckpt.best_metric_key or "eval/pass1")
        if value is not None and (self.best_metric is None or value > self.best_metric):
            self.best_metric = value
            metrics["eval/best"] = value
            wait(self.actor.export(f"{self.cfg.ckpt.output_dir}/best_model"))
        return metrics
