"""The checkpoint manager: atomic commit, retention after commit, crash in the middle of a save."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from rlhf_train_deepspeed.checkpoint import CheckpointManager


def _writer(payload: str):
    def write(tmp):
        (tmp / "model.bin").write_text(payload)

    return write


def test_keeps_the_newest_max_num_and_points_latest_at_the_newest(tmp_path):
    mgr = CheckpointManager(tmp_path, max_num=2)
    assert mgr.latest() is None
    for step in (1, 2, 3, 4):
        mgr.save(step, _writer(f"weights {step}"), {"step": step})
    assert [p.name for p in mgr.checkpoints()] == ["step_00000003", "step_00000004"]
    latest = mgr.latest()
    assert latest.name == "step_00000004"
    assert (latest / "model.bin").read_text() == "weights 4"
    assert mgr.load_client_state(latest) == {"step": 4}
    assert (tmp_path / "latest").read_text().strip() == "step_00000004"


def test_a_crash_in_the_middle_of_a_save_leaves_the_previous_checkpoint_latest(tmp_path):
    script = textwrap.dedent(
        f"""
        from rlhf_train_deepspeed.checkpoint import CheckpointManager
        mgr = CheckpointManager({str(tmp_path)!r}, max_num=1)
        for step in (1, 2, 3):
            mgr.save(step, lambda tmp, s=step: (tmp / "model.bin").write_text(f"weights {{s}}"), {{"step": step}})
        """
    )
    env = {**os.environ, "RLHF_FAULT": "mid_save:3"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 137, proc.stderr
    # max_num=1: step 2 is the only committed checkpoint and must have survived the crash of step 3
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-step_00000003")]
    assert leftovers, "the interrupted save should have left its temporary directory"
    mgr = CheckpointManager(tmp_path, max_num=1)
    assert mgr.latest().name == "step_00000002"
    assert (mgr.latest() / "model.bin").read_text() == "weights 2"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]  # cleaned at start


def test_a_pointer_to_a_missing_checkpoint_is_an_error(tmp_path):
    mgr = CheckpointManager(tmp_path)
    (tmp_path / "latest").write_text("step_00000009\n")
    with pytest.raises(FileNotFoundError, match="names step_00000009, which is missing or incomplete"):
        mgr.latest()
