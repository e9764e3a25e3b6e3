"""A supervised run keeps the rules an RL run keeps: `--train.max_nonfinite_steps` stops it the same way
(docs/fault-handling.md), and on Ray its driver's SIGKILL leaves no Ray process behind (the reaper of
`rlhf_cli.ray_launch.init_ray`, which starts Ray for both loops)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_reaper import _started, command_names

from rlhf_cli.reaper import descendants


def sft_args(tmp_path: Path, model: str, *extra: str) -> list[str]:
    (tmp_path / "sft.jsonl").write_text(
        "".join(json.dumps({"input": f"w{i} w{i + 1}", "output": f"w{i % 7}"}) + "\n" for i in range(32))
    )
    return [
        sys.executable,
        "-m",
        "rlhf_cli.main",
        "train",
        "sft",
        "--model.model_name_or_path",
        model,
        "--data.dataset",
        str(tmp_path / "sft.jsonl"),
        "--data.input_key",
        "input",
        "--data.output_key",
        "output",
        "--data.max_len",
        "8",
        "--train.batch_size",
        "8",
        "--train.micro_batch_size",
        "4",
        "--ds.param_dtype",
        "fp32",
        "--ckpt.output_dir",
        str(tmp_path / "out"),
        *extra,
    ]


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory) -> str:
    """A tiny Llama whose final norm holds a NaN: every loss it computes is NaN."""
    import torch
    from safetensors.torch import load_file, save_file

    from rlhf_core.testing.tiny import make_tiny_llama

    path = Path(make_tiny_llama(tmp_path_factory.mktemp("nan_model"), num_words=30, hidden_size=32))
    weights = load_file(path / "model.safetensors")
    weights["model.norm.weight"][0] = torch.nan
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("limit, stops_at", [(2, 2), (0, 1)])
def test_nonfinite_losses_stop_a_supervised_run_as_they_stop_an_rl_run(nan_model, tmp_path, limit, stops_at):
    """Every step's loss is NaN, so every step is skipped: the run stops at the `limit`-th skipped step in a
    row (at the first for 0, as RL does), with RL's message and exit code, after logging the steps before."""
    done = subprocess.run(
        sft_args(tmp_path, nan_model, "--train.max_nonfinite_steps", str(limit)),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "RLHF_NO_PROGRESS": "1"},
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert (
        f"rlhf train sft: {stops_at} sft steps in a row had a non-finite loss (skipped on every rank); "
        "stopping with the last good checkpoint kept (--train.max_nonfinite_steps)"
    ) in done.stderr
    assert "Traceback" not in done.stderr
    metrics = tmp_path / "out" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    assert [(r["step"], r["skipped"]) for r in rows] == [(s, 1.0) for s in range(1, stops_at)]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the reaper reads /proc")
def test_sigkill_of_a_supervised_driver_on_ray_leaves_no_ray_process_behind(tiny_model, tmp_path):
    cmd = sft_args(tmp_path, tiny_model, "--ray.single_process", "false", "--train.max_epochs", "10000")
    driver = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RLHF_NO_PROGRESS": "1"},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        wanted = ("raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::TrainWorker")
        while time.monotonic() < deadline:  # until the cluster's agents and the rank run
            names = " ".join(command_names(descendants(driver.pid)))
            if all(k in names for k in wanted):
                break
            assert driver.poll() is None, "the run ended before its Ray cluster was up"
            time.sleep(1)
        else:
            pytest.fail(f"the Ray cluster did not come up in time; the driver's processes: {names}")
        time.sleep(1.5)  # the reaper polls once a second
        left = descendants(driver.pid)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 10  # Ray's own agents outlived an SFT driver by 60 s and more
        while time.monotonic() < deadline:
            alive = {p for p in left if Path(f"/proc/{p[0]}").exists() and _started(p[0]) == p[1]}
            if not alive:
                break
            time.sleep(0.5)
        assert not alive, f"left behind 10 s after the driver's SIGKILL: {command_names(alive)}"
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
