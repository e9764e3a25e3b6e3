"""Crash-safe checkpoints: write into a temporary directory, fsync, rename, then move the ``latest`` pointer.

Layout under the checkpoint root (``--ckpt.path``, default ``<output_dir>/checkpoints``)::

    latest                   one line: the name of the newest complete checkpoint (replaced atomically)
    step_00000012/           a complete checkpoint: whatever the save function wrote + client_state.pt
                             + manifest.json (every file's size)
    .tmp-step_00000016-*/    a save in progress (or one that crashed: removed at the next start)

A crash at any point leaves ``latest`` naming a complete checkpoint (or nothing, before the first one); old
checkpoints are deleted only after the new one is committed. Damage found later, ``save_fn`` and
``client_state``: rlhf-train-deepspeed's README.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlhf_core.errors import UserError

POINTER = "latest"
CLIENT_STATE = "client_state.pt"
MANIFEST = "manifest.json"
_NAME = re.compile(r"^step_(\d+)$")


def fault_point(site: str, step: int) -> None:
    """Exit the process abruptly when ``RLHF_FAULT=<site>:<step>`` names this point (crash tests).

    Sites used by the trainers: ``after_step`` (after step N, including its checkpoint) and ``mid_save``
    (inside the save of step N, after the model state is written and before it is committed).
    """
    if os.environ.get("RLHF_FAULT") == f"{site}:{step}":
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


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a temporary file, fsynced, renamed over it."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_text(text, encoding="utf-8")
    _fsync_path(tmp)
    os.replace(tmp, path)
    _fsync_path(path.parent)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class CheckpointError(UserError):
    """No checkpoint can be resumed from: the message names each damaged file and the way out."""


def damage(path: Path) -> str | None:
    """Why checkpoint ``path`` cannot be resumed from, naming the file, or None when it looks intact; loads
    nothing (checks: rlhf-train-deepspeed's README); one saved before manifests gets the zip check only."""
    if not path.is_dir():
        return f"{path} is missing"
    if not (path / CLIENT_STATE).is_file():
        return f"{path / CLIENT_STATE} is missing"
    manifest = path / MANIFEST
    if manifest.exists():
        try:
            sizes = json.loads(manifest.read_text())["files"]
        except (ValueError, KeyError, TypeError) as exc:
            return f"{manifest} cannot be read ({exc})"
        for name, size in sizes.items():
            f = path / name
            if not f.is_file():
                return f"{f} is missing"
            if f.stat().st_size != size:
                return (
                    f"{f} has {f.stat().st_size} bytes where the save wrote {size} (truncated or overwritten)"
                )
    for f in sorted(path.rglob("*.pt")):
        # torch.save writes a zip archive holding <name>/data.pkl; its directory is at the end of the file
        try:
            with zipfile.ZipFile(f) as z:
                readable = any(n.endswith("/data.pkl") for n in z.namelist())
        except (zipfile.BadZipFile, OSError):
            readable = False
        if not readable:
            return f"{f} is not a readable torch file (overwritten or truncated)"
    return None


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def committed(root: Path) -> list[Path]:
    """The committed checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def resume_point(root: Path) -> Path | None:
    """The checkpoint under ``root`` to resume from: the one ``latest`` points to or, when that one is missing
    or damaged (:func:`damage`), the newest older one that is intact, with a warning naming what was skipped
    and why. None when nothing was saved yet; :class:`CheckpointError` when checkpoints exist and none is
    intact. Reads only (``--dry-run`` uses it too)."""
    pointer = root / POINTER
    newest_first = committed(root)[::-1]
    if not pointer.exists():
        if not newest_first:
            return None
        _warn(f"{pointer} is missing although {len(newest_first)} checkpoint(s) exist")
        candidates = newest_first
    else:
        name = pointer.read_text().strip()
        # step names are zero-padded: older ones sort first; a garbled pointer leaves every one a candidate
        candidates = [root / name] + [p for p in newest_first if p.name < name or not _NAME.match(name)]
    skipped = []
    for path in candidates:
        if (reason := damage(path)) is None:
            if skipped:
                _warn(
                    f"resuming from {path.name}, the newest intact checkpoint; skipped "
                    + "; ".join(skipped)
                    + ". A later save of the same step replaces a damaged one."
                )
            return path
        skipped.append(f"{path.name} ({reason})")
    raise CheckpointError(
        f"no intact checkpoint under {root}: {'; '.join(skipped)}. Restore the damaged "
        "files, or start from scratch without --ckpt.load_enable (or with another "
        "--ckpt.path)."
    )


class CheckpointManager:
    def __init__(self, root: str | Path, max_num: int = 3, max_mem_gb: float | None = None):
        if max_num < 1:
            raise ValueError(f"--ckpt.max_num must be at least 1, got {max_num}")
        self.root, self.max_num, self.max_mem_gb = Path(root), max_num, max_mem_gb
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp-*"):  # saves that never committed
            shutil.rmtree(stale, ignore_errors=True)

    def checkpoints(self) -> list[Path]:
        """Committed checkpoints, oldest first."""
        return committed(self.root)

    def latest(self) -> Path | None:
        """The checkpoint to resume from: see :func:`resume_point`."""
        return resume_point(self.root)

    def save(self, step: int, save_fn: Callable[[Path], None], client_state: dict[str, Any]) -> Path:
        """Write checkpoint ``step``: ``save_fn(tmp_dir)`` then ``client_state``; commit; prune old ones."""
        name = f"step_{step:08d}"
        tmp = self.root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        save_fn(tmp)
        fault_point("mid_save", step)
        torch.save(client_state, tmp / CLIENT_STATE)
        sizes = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
        (tmp / MANIFEST).write_text(json.dumps({"files": sizes}, indent=1))
        fsync_tree(tmp)
        final = self.root / name
        if final.exists():  # a checkpoint of the same step from an earlier attempt: replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_path(self.root)
        write_atomic(self.root / POINTER, name + "\n")
        older = [p for p in self.checkpoints() if p != final]  # pruned only once the new one is committed
        while older and (
            len(older) >= self.max_num
            or self.max_mem_gb is not None
            and sum(map(_dir_bytes, [final, *older])) > self.max_mem_gb * (1 << 30)
        ):
            shutil.rmtree(older.pop(0))
        return final

    def load_client_state(self, path: Path) -> dict[str, Any]:
        try:
            return torch.load(path / CLIENT_STATE, weights_only=False)
        except Exception as exc:  # unpickling garbage raises anything
            raise CheckpointError(
                f"{path / CLIENT_STATE} cannot be loaded: {type(exc).__name__}: {exc}"
            ) from exc
