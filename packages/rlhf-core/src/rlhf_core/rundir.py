"""Files of a run directory (``--ckpt.output_dir``) that more than one trainer writes."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def prepare_metrics_file(path: Path, resume_step: int) -> Path | None:
    """Make ``metrics.jsonl`` at ``path`` ready for a run that continues after step ``resume_step``.

    A resumed run keeps the rows up to ``resume_step`` (later ones belong to steps it redoes; a torn last line
    from a crash goes too). A fresh run (``resume_step`` 0) moves an earlier run's file aside to
    ``metrics.<n>.jsonl`` instead of mixing its rows into the new ones or deleting them. Returns where the
    earlier file went, or None.
    """
    if not path.exists() or path.stat().st_size == 0:
        return None
    if resume_step > 0:
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= resume_step:
                    kept.append(line + "\n")
            except json.JSONDecodeError:
                pass
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
        return None
    n = 1
    while (aside := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    path.rename(aside)
    logger.warning("%s held an earlier run's metrics; kept as %s", path, aside.name)
    return aside
