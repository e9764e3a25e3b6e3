"""The checkpoint manager: atomic commit, retention after commit, crash in the middle of a save."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch

from rlhf_core.checkpoint import CheckpointError, CheckpointManager, damage


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
        from rlhf_core.checkpoint import CheckpointManager
        mgr = CheckpointManager({str(tmp_path)!r}, max_num=1)
        for step in (1, 2, 3):
            mgr.save(step, lambda tmp, s=step: (tmp / "model.bin").write_text(f"weights {{s}}"), {{"step": step}})
        """
    )
    env = {**os.environ, "RLHF_FAULT": "mid_save:3"}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 137, proc.stderr
    # max_num=1: step 2 is the only committed checkpoint and must have survived the crash of step 3
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-step_00000003")]
    assert leftovers, "the interrupted save should have left its temporary directory"
    mgr = CheckpointManager(tmp_path, max_num=1)
    assert mgr.latest().name == "step_00000002"
    assert (mgr.latest() / "model.bin").read_text() == "weights 2"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]  # cleaned at start


def test_a_pointer_to_a_missing_checkpoint_is_an_error_when_there_is_no_other(tmp_path):
    mgr = CheckpointManager(tmp_path)
    (tmp_path / "latest").write_text("step_00000009\n")
    with pytest.raises(CheckpointError, match="step_00000009 is missing"):
        mgr.latest()


# --- damaged checkpoints: found before anything loads, named, skipped for the newest intact one ----------

MODEL = "actor/engine/mp_rank_00_model_states.pt"  # DeepSpeed's names, as the RL trainer lays them out
OPTIM = "actor/engine/zero_pp_rank_0_mp_rank_00_optim_states.pt"
RNG = "actor/rng_rank1.pt"


def _torch_writer(step: int):
    def write(tmp):
        for name in (MODEL, OPTIM, RNG):
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            torch.save({"step": step, "w": torch.arange(100.0)}, tmp / name)

    return write


def _two_checkpoints(root):
    mgr = CheckpointManager(root, max_num=3)
    for step in (2, 4):
        mgr.save(step, _torch_writer(step), {"step": step})
    return mgr


def _garble(path):
    path.write_bytes(os.urandom(path.stat().st_size))  # same size: only the content tells


DAMAGE = {  # what is done to step 4, the file named, why
    "model states missing": (lambda d: (d / MODEL).unlink(), MODEL, "is missing"),
    "optimizer states garbage": (lambda d: _garble(d / OPTIM), OPTIM, "is not a readable torch file"),
    "model states truncated": (
        lambda d: os.truncate(d / MODEL, 40),
        MODEL,
        "has 40 bytes where the save wrote",
    ),
    "client state garbage": (
        lambda d: _garble(d / "client_state.pt"),
        "client_state.pt",
        "is not a readable torch file",
    ),
    "client state missing": (lambda d: (d / "client_state.pt").unlink(), "client_state.pt", "is missing"),
    "rng file missing": (lambda d: (d / RNG).unlink(), RNG, "is missing"),
    "checkpoint directory gone": (lambda d: shutil.rmtree(d), "", "is missing"),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_latest_checkpoint_is_skipped_for_the_newest_intact_one(tmp_path, capsys, kind):
    mgr = _two_checkpoints(tmp_path)
    assert mgr.latest().name == "step_00000004" and capsys.readouterr().err == ""
    damage_fn, culprit, why = DAMAGE[kind]
    damage_fn(tmp_path / "step_00000004")
    assert mgr.latest().name == "step_00000002"
    err = capsys.readouterr().err
    assert "resuming from step_00000002, the newest intact checkpoint; skipped step_00000004" in err
    assert f"{tmp_path / 'step_00000004' / culprit} {why}" in err
    assert torch.load(mgr.latest() / MODEL)["step"] == 2


def test_no_intact_checkpoint_is_an_error_naming_each_damaged_file(tmp_path):
    mgr = _two_checkpoints(tmp_path)
    (tmp_path / "step_00000004" / MODEL).unlink()
    _garble(tmp_path / "step_00000002" / "client_state.pt")
    with pytest.raises(CheckpointError) as err:
        mgr.latest()
    msg = str(err.value)
    assert f"step_00000004 ({tmp_path / 'step_00000004' / MODEL} is missing)" in msg
    assert f"{tmp_path / 'step_00000002' / 'client_state.pt'} is not a readable torch file" in msg
    assert "without --ckpt.load_enable" in msg


def test_a_pointer_to_a_missing_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    mgr = _two_checkpoints(tmp_path)
    (tmp_path / "latest").write_text("step_00000009\n")  # a step that was never written
    assert mgr.latest().name == "step_00000004"
    assert f"skipped step_00000009 ({tmp_path / 'step_00000009'} is missing)" in capsys.readouterr().err


def test_an_unreadable_client_state_names_its_file(tmp_path):
    mgr = _two_checkpoints(tmp_path)
    path = tmp_path / "step_00000004"
    with zipfile.ZipFile(path / "client_state.pt", "a") as z:  # a torch zip whose pickle is garbage
        z.writestr("archive/data.pkl", b"garbage")
    with pytest.raises(CheckpointError, match=r"client_state.pt cannot be loaded: "):
        mgr.load_client_state(path)


def test_a_checkpoint_without_manifest_is_still_checked(tmp_path):
    """Checkpoints saved before manifests existed: the torch files' structure is still checked."""
    mgr = _two_checkpoints(tmp_path)
    for step in (2, 4):
        (tmp_path / f"step_0000000{step}" / "manifest.json").unlink()
    assert damage(tmp_path / "step_00000004") is None
    _garble(tmp_path / "step_00000004" / OPTIM)
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt is not a readable torch file" in damage(
        tmp_path / "step_00000004"
    )
    assert mgr.latest().name == "step_00000002"


def test_the_cli_backend_refuses_a_damaged_checkpoint_before_starting_workers(
    tiny_llama, tmp_path, monkeypatch
):
    """`rlhf train sft --ckpt.load_enable` with no intact checkpoint: a CheckpointError (a UserError, which the
    CLI prints as one line) naming the damage, before a worker group is made."""
    import rlhf_train_deepspeed.group
    import rlhf_train_deepspeed.trainers
    from rlhf_core.checkpoint import CheckpointError
    from rlhf_core.config import SupervisedConfig
    from rlhf_core.errors import UserError
    from rlhf_train_deepspeed.backend import DeepSpeedBackend
    from rlhf_train_deepspeed.testing import sft_rows, write_jsonl

    cfg = SupervisedConfig()
    cfg.model.model_name_or_path, cfg.data.dataset = (
        tiny_llama,
        [write_jsonl(tmp_path / "sft.jsonl", sft_rows(16))],
    )
    cfg.data.output_key, cfg.train.batch_size, cfg.train.micro_batch_size = "output", 8, 4
    cfg.ckpt.output_dir, cfg.ckpt.load_enable = str(tmp_path / "out"), True
    mgr = _two_checkpoints(tmp_path / "out" / "checkpoints")
    for step in (2, 4):
        (mgr.root / f"step_0000000{step}" / OPTIM).unlink()
    started = []
    monkeypatch.setattr(
        rlhf_train_deepspeed.group, "create_worker_group", lambda *a, **k: started.append("group")
    )
    with pytest.raises(CheckpointError) as error:
        DeepSpeedBackend().run_trainer("sft", cfg)
    assert isinstance(error.value, UserError)
    assert str(error.value).startswith(f"no intact checkpoint under {mgr.root}: step_00000004 (")
    assert started == []
