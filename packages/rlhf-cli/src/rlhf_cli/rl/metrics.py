"""Per-step metrics: ``metrics.jsonl`` in the run directory, TensorBoard, wandb when asked, and a progress bar."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from tqdm import tqdm

from rlhf_core.rundir import prepare_metrics_file


class MetricsLogger:
    """Writes one JSON line per step (flushed, so a crash loses at most the line being written)."""

    def __init__(self, cfg, total_steps: int, start_step: int = 0, mode: str = "ppo"):
        self.dir = Path(cfg.ckpt.output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        prepare_metrics_file(self.dir / "metrics.jsonl", start_step)
        self.file = open(self.dir / "metrics.jsonl", "a")  # noqa: SIM115 - closed in close()
        self.every = max(1, cfg.logger.logging_steps)
        tb_dir = cfg.logger.tensorboard_dir or str(self.dir / "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(tb_dir)
        self.wandb = None
        if cfg.logger.wandb.key:
            import wandb  # only when asked for

            wandb.login(key=cfg.logger.wandb.key)
            w = cfg.logger.wandb
            self.wandb = wandb.init(project=w.project, entity=w.org, group=w.group, name=w.run_name,
                                    dir=str(self.dir), resume="allow")
        self.bar = tqdm(total=total_steps, initial=start_step, desc=f"rlhf {mode}", unit="step",
                        dynamic_ncols=True, disable=os.environ.get("RLHF_NO_PROGRESS") == "1")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        if step % self.every == 0 or step == 1:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
            for k, v in row.items():
                if isinstance(v, (int, float)) and k not in ("step", "time"):
                    self.tb.add_scalar(k, v, step)
            if self.wandb is not None:
                self.wandb.log(row, step=step)
        shown = {"reward": metrics.get("reward/mean"), "eval": metrics.get("eval/pass1"),
                 "kl": metrics.get("kl/mean")}
        self.bar.set_postfix({k: f"{v:.3f}" for k, v in shown.items() if v is not None and math.isfinite(v)},
                             refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        self.file.close()
        self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _plain(v):
    """JSON-safe scalars: tensors become floats, non-finite floats become null."""
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
