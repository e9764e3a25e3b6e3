"""A run joined to a Ray cluster it did not start (``$RAY_ADDRESS``) and killed with SIGKILL leaves none of
its processes behind, and ends nothing of the cluster's other jobs: Ray ends the dead driver's actors, its
reaper ends the rest (the agent programs' children), and another job's actor keeps running."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_cli.reaper import descendants

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("reaper_joined"),
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the reaper reads /proc"),
]

# another job on the cluster: an actor that prints its pid, then the driver waits
OTHER_JOB = """import os, time, ray
ray.init()
@ray.remote(num_cpus=0)
class Other:
    def pid(self):
        return os.getpid()
actor = Other.remote()
print(ray.get(actor.pid.remote()), flush=True)
time.sleep(10**6)
"""

# an episode that never ends: the program waits on a child of its own (Ray does not end grandchildren)
AGENT = 'touch "$PIDS/$$"\nsleep 1000000\n'


def _alive(procs: set[tuple[int, int]]) -> set[tuple[int, int]]:
    alive = set()
    for pid, started in procs:
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if int(text[text.rindex(")") + 2 :].split()[19]) == started:
            alive.add((pid, started))
    return alive


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _wait(what: str, until, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not until():
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds:g} s"
        time.sleep(0.5)


def test_a_killed_driver_on_a_joined_cluster_leaves_its_processes_only_behind(tmp_path):
    from rlhf_core.testing.tiny import make_tiny_llama

    model = make_tiny_llama(tmp_path / "model", num_words=100, hidden_size=32, intermediate_size=64)
    (tmp_path / "prompts.jsonl").write_text("".join(f'{{"input": "w{i} w{i + 1}"}}\n' for i in range(8)))
    (tmp_path / "agent.sh").write_text(AGENT)
    (tmp_path / "other.py").write_text(OTHER_JOB)
    pids = tmp_path / "pids"
    pids.mkdir()
    port, client_port, agent_port = free_ports(3)  # not Ray's defaults, which another cluster here may hold
    env = {**os.environ, "RLHF_NO_PROGRESS": "1", "DS_ACCELERATOR": "cpu", "RAY_USAGE_STATS_ENABLED": "0"}
    env["RAY_ADDRESS"], env["PIDS"] = f"127.0.0.1:{port}", str(pids)
    started = []

    def start(cmd, **kwargs):
        started.append(subprocess.Popen(cmd, env=env, start_new_session=True, **kwargs))
        return started[-1]

    # the cluster's processes are the descendants of `ray start --block`: ended by pid after the test, not by
    # `ray stop`, which ends every Ray cluster of the user on this machine
    cluster = start(
        [Path(sys.executable).parent / "ray", "start", "--head", "--block", "--port", str(port)]
        + ["--ray-client-server-port", str(client_port), "--dashboard-agent-listen-port", str(agent_port)]
        + ["--num-cpus", "4", "--include-dashboard", "false", "--disable-usage-stats"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        other = start([sys.executable, str(tmp_path / "other.py")], stdout=subprocess.PIPE, text=True)
        other_actor = int(other.stdout.readline())
        driver = start(
            [sys.executable, "-m", "rlhf_cli.main", "train", "ppo", "--actor.model_name_or_path", model]
            + ["--data.prompt_dataset", str(tmp_path / "prompts.jsonl"), "--train.placement", "separate"]
            + ["--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "2"]
            + ["--rollout.batch_size", "2", "--rollout.max_new_tokens", "4", "--data.max_len", "16"]
            + ["--train.batch_size", "4", "--train.micro_batch_size", "4", "--ds.param_dtype", "fp32"]
            + ["--train.agent_command", f"sh {tmp_path / 'agent.sh'}", "--train.env_step_timeout", "1000"]
            + ["--ckpt.output_dir", str(tmp_path / "run")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait("the run's 4 episodes starting", lambda: len(list(pids.iterdir())) == 4, 240)
        time.sleep(1.5)  # the reaper polls once a second
        on_cluster = descendants(cluster.pid)
        ours = {
            p
            for p in on_cluster
            if _cmdline(p[0]).startswith(("ray::TrainWorker", "ray::RolloutActor", "sh ", "sleep "))
        }
        kinds = {_cmdline(pid).split(".")[0].split()[0] for pid, _ in ours}
        assert kinds == {"ray::TrainWorker", "ray::RolloutActor", "sh", "sleep"}
        assert _cmdline(other_actor).startswith("ray::Other")
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        _wait("the killed run's processes ending", lambda: not _alive(ours), 30)
        assert _cmdline(other_actor).startswith("ray::Other") and other.poll() is None  # it runs on
    finally:
        for group in pids.iterdir():  # the agent programs, should the test fail
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(group.name), signal.SIGKILL)
        for proc in reversed(started):  # the cluster last, with everything it started
            tree = descendants(proc.pid)
            for pid in [proc.pid, *(pid for pid, _ in tree)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
