"""Per-step metrics of an RL run: :class:`rlhf_core.rundir.MetricsWriter` (``metrics.jsonl``, TensorBoard, W&B
when asked) and a progress bar."""

from __future__ import annotations

import math
import os

from tqdm import tqdm

from rlhf_core.config_parser import shown_config
from rlhf_core.rundir import MetricsWriter


class MetricsLogger:
    def __init__(self, cfg, total_steps: int, start_step: int = 0, mode: str = "ppo"):
        self.writer = MetricsWriter(
            cfg.ckpt.output_dir, cfg.logger, total_steps, start_step, config=shown_config(cfg, mode)
        )
        self.bar = tqdm(
            total=total_steps,
            initial=start_step,
            desc=f"rlhf {mode}",
            unit="step",
            dynamic_ncols=True,
            disable=os.environ.get("RLHF_NO_PROGRESS") == "1",
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.writer.log(step, metrics)
        shown = {
            "reward": metrics.get("reward/mean"),
            "eval": metrics.get("eval/pass1"),
            "kl": metrics.get("kl/mean"),
        }
        self.bar.set_postfix(
            {k: f"{v:.3f}" for k, v in shown.items() if v is not None and math.isfinite(v)}, refresh=False
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        self.writer.close()
