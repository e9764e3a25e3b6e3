"""What the RL loop (``rlhf_cli.rl``) and the supervised loop (``rlhf_train_deepspeed.trainers``) share: the
checkpoint to resume from and the checkpoint of a step, the non-finite-step rule, and the metrics with the
progress bar."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from tqdm import tqdm

from rlhf_core.checkpoint import CheckpointError, CheckpointManager
from rlhf_core.config_parser import shown_config
from rlhf_core.handles import wait
from rlhf_core.rundir import MetricsWriter


class NonFiniteSteps:
    """The one non-finite rule (docs/fault-handling.md): an optimizer step whose loss was not finite on every
    rank is skipped, and the run stops after ``limit`` (``--train.max_nonfinite_steps``) such steps in a row,
    at the first one with 0. ``count`` (the steps in a row so far) goes into the checkpoint."""

    def __init__(self, limit: int, error: type[Exception]):
        self.limit = limit
        self.error = error
        self.count = 0

    def count_step(self, skipped: bool, what: str) -> None:
        """Count one optimizer step of ``what`` (``policy``, ``sft``, ...); raise ``error`` past the limit."""
        self.count = self.count + 1 if skipped else 0
        if skipped and self.count >= self.limit:
            raise self.error(
                f"{self.count} {what} steps in a row had a non-finite loss (skipped on every rank); "
                "stopping with the last good checkpoint kept (--train.max_nonfinite_steps)"
            )


def open_checkpoints(cfg, run_dir: Path) -> tuple[CheckpointManager, Path | None, dict | None]:
    """The run's checkpoints and, with ``--ckpt.load_enable``, the one to resume from and its client state
    (damaged ones fail here, before any worker starts); one saved with ``--ckpt.disable_ds`` is refused."""
    ckpt = cfg.ckpt
    checkpoints = CheckpointManager(ckpt.path or run_dir / "checkpoints", ckpt.max_num, ckpt.max_mem)
    latest = checkpoints.latest() if ckpt.load_enable else None
    state = checkpoints.load_client_state(latest) if latest is not None else None
    if ckpt.load_enable and latest is None:
        print(
            f"--ckpt.load_enable: no checkpoint under {checkpoints.root}; starting from scratch",
            file=sys.stderr,
        )
    elif latest is not None and not state.get("has_ds_state", True):
        raise CheckpointError(
            f"cannot resume from {latest}: it was saved with --ckpt.disable_ds (HF weights only, no optimizer "
            "state)"
        )
    return checkpoints, latest, state


def save_checkpoint(checkpoints: CheckpointManager, step: int, ckpt, models: dict, state: dict) -> None:
    """Checkpoint ``step``: each of ``models`` (subdirectory name: a learner; ``""`` for the top) with its
    state (``save_state``) unless ``--ckpt.disable_ds``, the first one's HF export under ``hf/`` with
    ``--ckpt.save_hf``, and the loop's client ``state`` with ``has_ds_state``."""

    def write(path: Path) -> None:
        if not ckpt.disable_ds:
            for name, group in models.items():
                wait(group.save_state(str(path / name)))
        if ckpt.save_hf:
            wait(next(iter(models.values())).export(str(path / "hf")))

    checkpoints.save(step, write, {**state, "has_ds_state": not ckpt.disable_ds})


class MetricsLogger:
    """Per-step metrics (:class:`rlhf_core.rundir.MetricsWriter`: ``metrics.jsonl``, TensorBoard, W&B when
    asked) and a progress bar (off with ``RLHF_NO_PROGRESS=1``) showing the metrics ``shown`` names
    (label: key) with ``digits`` decimals."""

    def __init__(
        self,
        cfg,
        total_steps: int,
        start_step: int = 0,
        mode: str = "ppo",
        shown: dict[str, str] | None = None,
        digits: int = 3,
        bare_prefix: str = "",
    ):
        self.writer = MetricsWriter(
            cfg.ckpt.output_dir,
            cfg.logger,
            total_steps,
            start_step,
            config=shown_config(cfg, mode),
            bare_prefix=bare_prefix,
        )
        self.shown = shown or {"reward": "reward/mean", "eval": "eval/pass1", "kl": "kl/mean"}
        self.digits = digits
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
        shown = {label: metrics.get(key) for label, key in self.shown.items()}
        self.bar.set_postfix(
            {k: f"{v:.{self.digits}f}" for k, v in shown.items() if v is not None and math.isfinite(v)},
            refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        self.writer.close()
