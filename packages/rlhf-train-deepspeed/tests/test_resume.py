"""Kill a training run (a driver subprocess) mid-way, resume it, and get the uninterrupted run's weights."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from safetensors.torch import load_file

from rlhf_core.checkpoint import CheckpointError, damage
from rlhf_core.config import SupervisedConfig
from rlhf_train_deepspeed.testing import sft_rows, write_jsonl
from rlhf_train_deepspeed.trainers import run_supervised

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

DRIVER = textwrap.dedent(
    """
    import json, sys
    from rlhf_core.config import SupervisedConfig
    from rlhf_train_deepspeed.backend import DeepSpeedBackend

    cfg = SupervisedConfig()
    for dotted, value in json.loads(sys.argv[1]).items():
        *parents, leaf = dotted.split(".")
        section = cfg
        for p in parents:
            section = getattr(section, p)
        setattr(section, leaf, value)
    DeepSpeedBackend().run_trainer("sft", cfg)
    """
)


def settings(tiny_llama, data, out) -> dict:
    return {
        "model.model_name_or_path": tiny_llama,
        "model.num_gpus_per_node": 2,
        "model.lr_warmup_ratio": 0.25,  # a schedule that moves: the resumed run must restore it
        "data.dataset": [data],
        "data.output_key": "output",
        "data.max_len": 32,
        "train.batch_size": 16,
        "train.micro_batch_size": 4,
        "train.max_epochs": 2,  # 4 steps per epoch: the kill at step 5 is in the second epoch
        "ds.zero_stage": 3,
        "ds.param_dtype": "fp32",
        "ckpt.output_dir": out,
        "ckpt.save_steps": 2,
        "ckpt.max_num": 1,
    }


def to_cfg(values: dict) -> SupervisedConfig:
    cfg = SupervisedConfig()
    cfg.model.adam.lr = 5e-3
    for dotted, value in values.items():
        *parents, leaf = dotted.split(".")
        section = cfg
        for p in parents:
            section = getattr(section, p)
        setattr(section, leaf, value)
    return cfg


def start_driver(values: dict, fault: str, ray_address: str) -> subprocess.Popen:
    values = {**values, "model.adam.lr": 5e-3}
    env = {**os.environ, "RLHF_FAULT": fault, "RAY_ADDRESS": ray_address}
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, json.dumps(values)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return proc.returncode, err


def test_killed_and_resumed_runs_end_with_the_uninterrupted_weights(
    ray_cluster, reused_groups, tiny_llama, tmp_path
):
    data = write_jsonl(tmp_path / "sft.jsonl", sft_rows(64))
    factory = reused_groups[2]
    full = to_cfg(settings(tiny_llama, data, str(tmp_path / "full")))
    run_supervised("sft", full, factory)
    want = load_file(tmp_path / "full" / "model.safetensors")

    address = ray_cluster.get_runtime_context().gcs_address
    # 1. killed after step 5: the checkpoint of step 4 is the latest
    # 2. crashed while saving step 4 (max_num=1): step 2 stays the latest and loadable
    # The two drivers (separate output dirs, 2 ranks each) run side by side: most of each is start-up.
    killed = settings(tiny_llama, data, str(tmp_path / "killed"))
    crashed = settings(tiny_llama, data, str(tmp_path / "crashed"))
    procs = [start_driver(killed, "after_step:5", address), start_driver(crashed, "mid_save:4", address)]
    (killed_rc, killed_err), (crashed_rc, crashed_err) = [finish(p) for p in procs]
    assert killed_rc == 137, killed_err[-3000:]
    assert (tmp_path / "killed" / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    assert crashed_rc == 137, crashed_err[-3000:]
    assert (tmp_path / "crashed" / "checkpoints" / "latest").read_text().strip() == "step_00000002"

    for name, values in (("killed", killed), ("crashed", crashed)):
        cfg = to_cfg({**values, "ckpt.load_enable": True})
        run_supervised("sft", cfg, factory)
        got = load_file(tmp_path / name / "model.safetensors")
        assert set(got) == set(want)
        for key in want:
            assert (got[key] - want[key]).abs().max().item() <= 1e-6, (name, key)
        lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in lines if "loss" in m] == list(range(1, 9))
    full_losses = [
        json.loads(x)["loss"] for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
    ]
    resumed = [
        json.loads(x)["loss"] for x in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    ]
    assert resumed == pytest.approx(full_losses, abs=1e-6)

    # 3. DeepSpeed's real files, damaged: the driver names the file before any worker is asked for
    root = tmp_path / "killed" / "checkpoints"
    newest = root / (root / "latest").read_text().strip()  # the only one (max_num 1)
    assert damage(newest) is None
    model_states = sorted(newest.rglob("*model_states.pt"))[0]
    model_states.unlink()

    def no_workers(*args):
        raise AssertionError("a worker group was started for a damaged checkpoint")

    cfg = to_cfg({**killed, "ckpt.load_enable": True})
    with pytest.raises(CheckpointError, match=re.escape(f"{model_states} is missing")):
        run_supervised("sft", cfg, no_workers)
