"""Files of a run directory (``--ckpt.output_dir``) that more than one trainer writes."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

from rlhf_core.checkpoint import write_atomic

log = logging.getLogger(__name__)


def read_metrics(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl file; a torn last line (a crash mid-write) is skipped."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def prepare_metrics_file(path: Path, resume_step: int) -> Path | None:
    """Make ``metrics.jsonl`` at ``path`` ready for a run that continues after step ``resume_step``: a resumed
    run keeps the rows up to it (those after are steps it redoes), a fresh one (0) moves an earlier run's
    file aside to ``metrics.<n>.jsonl`` rather than mix or delete its rows. Returns where it went, or None.
    """
    if not path.exists() or path.stat().st_size == 0:
        return None
    if resume_step > 0:
        kept = [row for row in read_metrics(path) if row.get("step", 0) <= resume_step]
        write_atomic(path, "".join(json.dumps(row) + "\n" for row in kept))
        return None
    n = 1
    while (aside := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    path.rename(aside)
    log.warning("%s held an earlier run's metrics; kept as %s", path, aside.name)
    return aside


class MetricsWriter:
    """A run's per-step metrics: a line of ``metrics.jsonl`` (flushed, so a crash loses at most the line being
    written), TensorBoard scalars and, with ``--logger.wandb.key``, W&B. Steps are logged every
    ``--logger.logging_steps`` steps, and the first and the last step always.

    ``config``: the run's configuration as :func:`rlhf_core.config_parser.shown_config` gives it (secrets
    hidden), recorded as the W&B run config. ``bare_prefix`` goes before TensorBoard tags without a ``/``.
    """

    def __init__(
        self,
        run_dir: str | Path,
        logger,
        total_steps: int,
        start_step: int = 0,
        config: dict | None = None,
        bare_prefix: str = "",
    ):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        prepare_metrics_file(self.dir / "metrics.jsonl", start_step)
        self.file = open(self.dir / "metrics.jsonl", "a")  # noqa: SIM115 - closed in close()
        self.every = max(1, logger.logging_steps)
        self.total_steps = total_steps
        self.bare_prefix = bare_prefix
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(logger.tensorboard_dir or str(self.dir / "tensorboard"))
        self.wandb = None
        w = logger.wandb
        if w.key:
            import wandb  # only when asked for

            wandb.login(key=w.key)
            self.wandb = wandb.init(
                project=w.project,
                entity=w.org,
                group=w.group,
                name=w.run_name,
                dir=str(self.dir),
                config=config,
                resume="allow",
            )

    def log(self, step: int, metrics: dict) -> bool:
        """Record ``metrics`` of ``step`` if it is due; returns whether it was."""
        if step % self.every and step not in (1, self.total_steps):
            return False
        row = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        for k, v in row.items():
            if isinstance(v, (int, float)) and k not in ("step", "time"):
                self.tb.add_scalar(k if "/" in k else self.bare_prefix + k, v, step)
        if self.wandb is not None:
            self.wandb.log(row, step=step)
        return True

    def close(self) -> None:
        self.file.close()
        self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _plain(v):
    """JSON-safe scalars: tensors become floats, non-finite floats become null."""
    v = v.item() if hasattr(v, "item") else v
    return None if isinstance(v, float) and not math.isfinite(v) else v
