"""The pieces both run loops share (rlhf_core.runloop): the resume check and the non-finite rule."""

from __future__ import annotations

import pytest

from rlhf_core.checkpoint import CheckpointError
from rlhf_core.config import RLConfig
from rlhf_core.runloop import NonFiniteSteps, open_checkpoints, save_checkpoint


def test_a_checkpoint_without_deepspeed_state_is_refused_before_any_worker_starts(tmp_path, capsys):
    cfg = RLConfig()
    cfg.ckpt.load_enable, cfg.ckpt.disable_ds, cfg.ckpt.save_hf = True, True, False
    checkpoints, latest, state = open_checkpoints(cfg, tmp_path)
    assert (latest, state) == (None, None)
    assert f"no checkpoint under {tmp_path / 'checkpoints'}; starting from scratch" in capsys.readouterr().err
    # --ckpt.disable_ds without --ckpt.save_hf: no model is written, only the loop's state
    save_checkpoint(checkpoints, 2, cfg.ckpt, {"": None}, {"step": 2})
    with pytest.raises(CheckpointError, match="step_00000002: it was saved with --ckpt.disable_ds"):
        open_checkpoints(cfg, tmp_path)


def test_the_run_stops_after_the_allowed_non_finite_steps_in_a_row():
    rule = NonFiniteSteps(2, RuntimeError)
    for skipped in (True, False, True):  # a finite step resets the count
        rule.count_step(skipped, "sft")
    assert rule.count == 1
    with pytest.raises(RuntimeError, match="^2 sft steps in a row had a non-finite loss"):
        rule.count_step(True, "sft")
    with pytest.raises(RuntimeError, match="^1 policy steps in a row"):  # 0: the first one stops the run
        NonFiniteSteps(0, RuntimeError).count_step(True, "policy")
