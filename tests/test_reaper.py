"""A driver killed with SIGKILL leaves no process behind: the processes of the local Ray cluster it started
(raylet, GCS, Ray's dashboard and runtime-env agents, the actors) are ended by its reaper."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_cli.reaper import descendants

REWARD = "def reward_func(queries, prompts, labels, **kw):\n    return [float(len(q) % 3) for q in queries]\n"


def command_names(procs: set[tuple[int, int]]) -> list[str]:
    names = []
    for pid, _ in procs:
        try:
            names.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
        except OSError:
            pass
    return names


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the reaper reads /proc")
def test_sigkill_of_a_multi_process_driver_leaves_no_process_behind(tmp_path):
    from rlhf_core.testing.tiny import make_tiny_llama

    model = make_tiny_llama(tmp_path / "model", num_words=20)
    (tmp_path / "reward.py").write_text(REWARD)
    (tmp_path / "prompts.jsonl").write_text("".join(f'{{"input": "w{k} w3"}}\n' for k in range(64)))
    cmd = [
        sys.executable,
        "-m",
        "rlhf_cli.main",
        "train",
        "ppo",
        "--pretrain",
        model,
        "--remote_rm_url",
        str(tmp_path / "reward.py"),
        "--prompt_data",
        str(tmp_path / "prompts.jsonl"),
        "--input_key",
        "input",
        "--advantage_estimator",
        "group_norm",
        "--n_samples_per_prompt",
        "2",
        "--rollout_batch_size",
        "2",
        "--train_batch_size",
        "4",
        "--micro_train_batch_size",
        "2",
        "--generate_max_len",
        "4",
        "--train.placement",
        "separate",
        "--ds.param_dtype",
        "fp32",
        "--save_path",
        str(tmp_path / "out"),
    ]
    driver = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "RLHF_NO_PROGRESS": "1"},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # until the cluster's agents and an actor run
            names = " ".join(command_names(descendants(driver.pid)))
            if all(
                k in names
                for k in ("raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::TrainWorker")
            ):
                break
            assert driver.poll() is None, "the run ended before its Ray cluster was up"
            time.sleep(1)
        else:
            pytest.fail(f"the Ray cluster did not come up in time; the driver's processes: {names}")
        time.sleep(1.5)  # the reaper polls once a second
        left = descendants(driver.pid)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            alive = {p for p in left if Path(f"/proc/{p[0]}").exists() and _started(p[0]) == p[1]}
            if not alive:
                break
            time.sleep(0.5)
        assert not alive, f"left behind 30 s after the driver's SIGKILL: {command_names(alive)}"
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)


def _started(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2 :].split()[19])
