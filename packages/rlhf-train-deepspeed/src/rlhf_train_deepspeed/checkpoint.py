"""Crash-safe checkpoints: write into a temporary directory, fsync, rename, then move the ``latest`` pointer.

Layout under the checkpoint root (``--ckpt.path``, default ``<output_dir>/checkpoints``)::

    latest                   one line: the name of the newest complete checkpoint (replaced atomically)
    step_00000012/           a complete checkpoint: whatever the save function wrote + client_state.pt
    .tmp-step_00000016-*/    a save in progress (or one that crashed: removed at the next start)

A crash at any point leaves ``latest`` naming a complete checkpoint (or nothing, before the first one).
Old checkpoints are deleted only after the new one is committed, keeping at most ``max_num`` (and under
``max_mem`` GB). The manager knows nothing about models: the caller's ``save_fn(dir)`` writes the model
state (e.g. every DeepSpeed rank) and ``client_state`` holds everything else the trainer needs to
continue exactly (step, data position, RNG, and for RL: KL controller, best metric...); the policy EMA
lives in the per-rank files the save function writes.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

POINTER = "latest"
CLIENT_STATE = "client_state.pt"
_NAME = re.compile(r"^step_(\d+)$")


def fault_point(site: str, step: int) -> None:
    """Exit the process abruptly when ``RLHF_FAULT=<site>:<step>`` names this point (crash tests).

    Sites used by the trainers: ``after_step`` (after step N, including its checkpoint) and ``mid_save``
    (inside the save of step N, after the model state is written and before it is committed).
    """
    spec = os.environ.get("RLHF_FAULT", "")
    if spec and spec == f"{site}:{step}":
        print(f"RLHF_FAULT: exiting at {site}:{step}", flush=True)
        os._exit(137)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (and ``root`` itself)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class CheckpointManager:
    def __init__(self, root: str | Path, max_num: int = 3, max_mem_gb: float | None = None):
        if max_num < 1:
            raise ValueError(f"--ckpt.max_num must be at least 1, got {max_num}")
        self.root = Path(root)
        self.max_num = max_num
        self.max_mem_gb = max_mem_gb
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp-*"):  # saves that never committed
            shutil.rmtree(stale, ignore_errors=True)

    def checkpoints(self) -> list[Path]:
        """Committed checkpoints, oldest first."""
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` points to, or None when there is none yet."""
        pointer = self.root / POINTER
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        if not (path / CLIENT_STATE).exists():
            raise FileNotFoundError(f"{pointer} names {path.name}, which is missing or incomplete")
        return path

    def save(self, step: int, save_fn: Callable[[Path], None], client_state: dict[str, Any]) -> Path:
        """Write checkpoint ``step``: ``save_fn(tmp_dir)`` then ``client_state``; commit; prune old ones."""
        name = f"step_{step:08d}"
        tmp = self.root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        save_fn(tmp)
        fault_point("mid_save", step)
        torch.save(client_state, tmp / CLIENT_STATE)
        fsync_tree(tmp)
        final = self.root / name
        if final.exists():  # a checkpoint of the same step from an earlier attempt: replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_path(self.root)
        _write_atomic(self.root / POINTER, name + "\n")
        self._prune(keep=final)
        return final

    def load_client_state(self, path: Path) -> dict[str, Any]:
        return torch.load(path / CLIENT_STATE, weights_only=False)

    def _prune(self, keep: Path) -> None:
        older = [p for p in self.checkpoints() if p != keep]
        while len(older) + 1 > self.max_num:
            shutil.rmtree(older.pop(0))
        if self.max_mem_gb is not None:
            limit = self.max_mem_gb * (1 << 30)
            while older and _dir_bytes(keep) + sum(_dir_bytes(p) for p in older) > limit:
                shutil.rmtree(older.pop(0))
