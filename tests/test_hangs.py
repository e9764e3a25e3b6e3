"""User code that hangs does not hang the command (docs/fault-handling.md, "Code that hangs"): a reward
function, an agent's environment step and an agent program that never return are given up on after their
timeouts, and the run stops with their message and exit code 1; code that leaves a thread running forever
cannot keep the process from exiting either. Each run is the real ``rlhf`` command in a subprocess; the four
start together and each must end by itself."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("hangs")]

HANGING_REWARD = "import time\ndef reward_func(queries, prompts, labels, **kw):\n    time.sleep(10**6)\n"

# a library's thread pool whose task never ends: Python waits for the pool's threads at exit
THREAD_LEFT_RUNNING = """import concurrent.futures, time
pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="library")
def reward_func(queries, prompts, labels, **kw):
    pool.submit(time.sleep, 10**6)
    return [1.0] * len(queries)
"""

HANGING_AGENT = """import time
from rlhf_agents import AgentInstanceBase, MultiTurnAgentExecutor

class AgentInstance(AgentInstanceBase):
    def step(self, states, **kwargs):
        time.sleep(10**6)

class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""

# records its process group (its own: the run starts it in a new session) and sleeps in a child
HANGING_PROGRAM = 'touch "$PIDS/$$"\nsleep 1000000\n'


def test_code_that_hangs_ends_the_run_with_its_message(tmp_path):
    from rlhf_core.testing.tiny import make_tiny_llama

    model = make_tiny_llama(tmp_path / "model", num_words=100, hidden_size=32, intermediate_size=64)
    (tmp_path / "prompts.jsonl").write_text("".join(f'{{"input": "w{i} w{i + 1}"}}\n' for i in range(8)))
    files = {
        "hang.py": HANGING_REWARD,
        "thread.py": THREAD_LEFT_RUNNING,
        "agent.py": HANGING_AGENT,
        "agent.sh": HANGING_PROGRAM,
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "pids").mkdir()
    server = socket.create_server(("127.0.0.1", 0))  # a reward server that takes requests and never answers
    url = f"http://127.0.0.1:{server.getsockname()[1]}/reward"
    common = [
        *("--actor.model_name_or_path", model, "--data.prompt_dataset", str(tmp_path / "prompts.jsonl")),
        *("--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "2"),
        *("--rollout.batch_size", "2", "--rollout.max_new_tokens", "4", "--data.max_len", "16"),
        *("--train.batch_size", "4", "--train.micro_batch_size", "4", "--ds.param_dtype", "fp32"),
        *("--train.colocate_all", "--train.max_steps", "1", "--train.env_step_timeout", "3"),
    ]
    runs = {
        "reward": ["--reward.remote_url", str(tmp_path / "hang.py"), "--reward.timeout", "3"],
        "agent": ["--train.agent_func_path", str(tmp_path / "agent.py")],
        # on Ray: the program runs in the rollout actor's process
        "program": ["--train.agent_command", f"sh {tmp_path / 'agent.sh'}", "--ray.single_process", "false"],
        "thread": ["--reward.remote_url", str(tmp_path / "thread.py"), "--ckpt.save_steps", "1"],
        "server": [
            *("--reward.remote_url", url),
            *("--reward.timeout", "3", "--reward.max_retries", "2"),
        ],
    }
    env = {**os.environ, "RLHF_NO_PROGRESS": "1", "DS_ACCELERATOR": "cpu", "PIDS": str(tmp_path / "pids")}
    env.pop("RAY_ADDRESS", None)
    started = time.monotonic()
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "rlhf_cli.main", "train", "ppo", *common, *flags]
            + ["--ckpt.output_dir", str(tmp_path / name)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        for name, flags in runs.items()
    }
    results = {}
    try:
        for name, proc in procs.items():
            # a bound far above a run's ~30 s (four start at once on a shared machine), far below "never"
            _, err = proc.communicate(timeout=max(1.0, 400 - (time.monotonic() - started)))
            results[name] = (proc.returncode, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        server.close()

    code, err = results["reward"]
    assert code == 1, err[-3000:]
    assert f"reward_func in {tmp_path / 'hang.py'} took longer than --reward.timeout 3 s" in err
    assert "rlhf train ppo: step 1: 4 of 4 samples could not be scored" in err

    code, err = results["agent"]
    assert code == 1, err[-3000:]
    assert (
        f"AgentInstance ({tmp_path / 'agent.py'}).step took longer than --train.env_step_timeout 3 s; the "
        "episode was ended"
    ) in err

    code, err = results["program"]
    assert code == 1, err[-3000:]
    assert "ran longer than --train.env_step_timeout 3 s and was killed" in err
    groups = [int(p.name) for p in (tmp_path / "pids").iterdir()]
    assert len(groups) == 4  # one program per episode, each in its own process group, all killed
    for group in groups:
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)

    code, err = results["thread"]
    assert code == 0, err[-3000:]
    (line,) = [line for line in err.splitlines() if line.startswith("rlhf: thread(s) ")]
    assert "library_0" in line and "still running 10 s after the command ended" in line
    rows = [json.loads(line) for line in (tmp_path / "thread" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["reward/mean"] == 1.0
    checkpoints = tmp_path / "thread" / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_00000001"

    code, err = results["server"]
    assert code == 1, err[-3000:]
    assert (
        f"reward server request failed after 2 attempts; last attempt: {url}: no answer within "
        "--reward.timeout 3 s"
    ) in err
