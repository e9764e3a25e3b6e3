"""An inference node without the training stack hosts the rollout side of ``rlhf train ppo``.

A two-node Ray cluster on this machine: the head from this environment, the second node from a venv that
has no deepspeed and no rlhf-train-deepspeed (nor rlhf-cli), offering the custom resource ``rollout_node``.
``--rollout.node_resource rollout_node`` puts the engine there; the run trains and syncs weights to it.

The venv is built cheaply: its site-packages links every third-party entry of this environment's
site-packages except deepspeed, and the editable installs of rlhf-core, rlhf-algos (rlhf-agents' dependency),
rlhf-agents and rlhf-rollout-vllm only.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest

ROLLOUT_PACKAGES = ("rlhf_core", "rlhf_algos", "rlhf_agents", "rlhf_rollout_vllm")
REWARD = """
def reward_func(queries, prompts, labels, **kwargs):
    return [float(len(q) % 3 == 0) for q in queries]
"""


def is_rollout_node_entry(name: str) -> bool:
    """Whether a site-packages entry of this environment goes into the inference node's: everything but
    deepspeed and the rlhf packages other than ROLLOUT_PACKAGES (their dist-info, and the .pth / finder
    files of their editable installs)."""
    key = name.lower().replace("-", "_")
    if key.startswith("deepspeed"):
        return False
    if "rlhf" not in key:
        return True
    return any(pkg in key for pkg in ROLLOUT_PACKAGES)


def make_rollout_venv(root: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = root / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if is_rollout_node_entry(entry.name) and not (site / entry.name).exists():
            (site / entry.name).symlink_to(entry)
    return root / "bin" / "python"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start_node(python: Path, args: list[str], log: Path, temp_dir: Path) -> subprocess.Popen:
    """``ray start --block`` in a session of its own: its raylet dies with it (Ray's fate sharing), and the
    whole session is ended by its id at the end. ``temp_dir`` is short: Ray's socket paths must fit 107 bytes."""
    agent, grpc, runtime_env, metrics, manager, objects = free_ports(6)
    cmd = [
        str(python),
        "-m",
        "ray.scripts.scripts",
        "start",
        "--block",
        "--node-ip-address",
        "127.0.0.1",
        "--dashboard-agent-listen-port",
        str(agent),
        "--dashboard-agent-grpc-port",
        str(grpc),
        "--runtime-env-agent-port",
        str(runtime_env),
        "--metrics-export-port",
        str(metrics),
        "--node-manager-port",
        str(manager),
        "--object-manager-port",
        str(objects),
        "--temp-dir",
        str(temp_dir),
        "--disable-usage-stats",
        *args,
    ]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "DS_ACCELERATOR": "cpu"}
    return subprocess.Popen(
        cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def stop_node(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=20)
            return
        except subprocess.TimeoutExpired:
            continue


def wait_for_nodes(address: str, count: int, nodes: list[subprocess.Popen], timeout: float = 120.0) -> None:
    probe = (
        "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
        "print(sum(n['Alive'] for n in ray.nodes()))"
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in nodes), "a ray node exited; see its log in the test's tmp_path"
        out = subprocess.run([sys.executable, "-c", probe, address], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(count)]:
            return
        time.sleep(2)
    raise TimeoutError(f"the cluster at {address} did not reach {count} nodes in {timeout:.0f} s")


def test_node_resource_pins_the_rollout_pool_and_is_refused_when_the_engines_share_devices(tmp_path):
    from rlhf_cli.assemble import RunConfigError, assemble
    from rlhf_core.config_parser import parse_config
    from rlhf_core.testing.tiny import make_tiny_llama

    model = make_tiny_llama(tmp_path / "model", num_words=20)
    (tmp_path / "reward.py").write_text(REWARD)
    args = [
        "--pretrain",
        model,
        "--remote_rm_url",
        str(tmp_path / "reward.py"),
        "--advantage_estimator",
        "group_norm",
        "--n_samples_per_prompt",
        "2",
        "--init_kl_coef",
        "0",
        "--vllm_num_engines",
        "2",
        "--actor_num_gpus_per_node",
        "2",
        "--rollout.node_resource",
        "rollout_node",
    ]
    plan = assemble("ppo", parse_config("ppo", args)[0], gpus=True).plan
    bundles = {p.name: p.bundles for p in plan.pools}
    assert bundles["rollout"] == [{"GPU": 1.0, "CPU": 1.0, "rollout_node": 1.0}] * 2
    assert all("rollout_node" not in b for b in bundles["actor"])
    with pytest.raises(
        RunConfigError, match="--rollout.node_resource rollout_node .* shares their devices with actor "
    ):
        assemble("ppo", parse_config("ppo", args + ["--colocate_all_models"])[0], gpus=True)


@pytest.mark.slow
@pytest.mark.xdist_group("rollout_node")
def test_the_rollout_engine_runs_and_syncs_on_a_node_without_deepspeed(tmp_path):
    python = make_rollout_venv(tmp_path / "rollout-venv")
    # the inference node's environment: the rollout packages import, the training stack does not
    check = (
        "import importlib, sys\n"
        "for m in ('rlhf_core', 'rlhf_agents', 'rlhf_rollout_vllm', 'rlhf_agents.rollout_actor', 'ray'):\n"
        "    importlib.import_module(m)\n"
        "for m in ('deepspeed', 'rlhf_train_deepspeed', 'rlhf_cli'):\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except ImportError:\n"
        "        continue\n"
        "    sys.exit(f'{m} is importable')\n"
    )
    out = subprocess.run([str(python), "-c", check], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr

    from rlhf_core.testing.tiny import make_tiny_llama

    model = make_tiny_llama(tmp_path / "model", num_words=100)
    with (tmp_path / "prompts.jsonl").open("w") as f:
        for i in range(8):
            f.write(json.dumps({"input": f"w{i} w{i * 7 % 100}"}) + "\n")
    (tmp_path / "reward.py").write_text(REWARD)

    temp = Path(tempfile.mkdtemp(prefix="rn", dir="/tmp"))
    port, client = free_ports(2)
    address = f"127.0.0.1:{port}"
    # the head has room for every worker: without --rollout.node_resource Ray puts the engine there too
    nodes = [
        start_node(
            Path(sys.executable),
            [
                "--head",
                "--port",
                str(port),
                "--ray-client-server-port",
                str(client),
                "--include-dashboard=false",
                "--num-cpus",
                "8",
            ],
            tmp_path / "head.log",
            temp / "head",
        )
    ]
    try:
        time.sleep(3)  # the head's GCS first
        nodes.append(
            start_node(
                python,
                ["--address", address, "--num-cpus", "1", "--resources", json.dumps({"rollout_node": 1})],
                tmp_path / "node.log",
                temp / "node",
            )
        )
        wait_for_nodes(address, 2, nodes)
        out_dir = tmp_path / "run"
        run = subprocess.run(
            [
                str(Path(sys.executable).parent / "rlhf"),
                "train",
                "ppo",
                "--actor.model_name_or_path",
                model,
                "--reward.remote_url",
                str(tmp_path / "reward.py"),
                "--data.prompt_dataset",
                str(tmp_path / "prompts.jsonl"),
                "--algo.advantage.estimator",
                "group_norm",
                "--rollout.n_samples_per_prompt",
                "4",
                "--rollout.batch_size",
                "2",
                "--rollout.max_new_tokens",
                "4",
                "--rollout.engine",
                "hf",
                "--rollout.node_resource",
                "rollout_node",
                "--train.batch_size",
                "8",
                "--train.micro_batch_size",
                "4",
                "--ds.zero_stage",
                "0",
                "--ds.param_dtype",
                "fp32",
                "--algo.kl.init_coef",
                "0",  # one rank
                "--actor.adam.lr",
                "1e-3",
                "--train.max_steps",
                "2",
                "--ckpt.output_dir",
                str(out_dir),
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "RAY_ADDRESS": address, "RLHF_NO_PROGRESS": "1"},
            timeout=600,
        )
        assert run.returncode == 0, run.stderr[-3000:]
    finally:
        for proc in reversed(nodes):
            stop_node(proc)
        shutil.rmtree(temp, ignore_errors=True)
    # the engine ran in the inference node's Python
    assert f"1 rollout engine(s) on {socket.gethostname()} ({python})" in run.stderr, run.stderr[-3000:]
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # step 2 sampled from the weights synced after step 1: the engine's log-probs are the trainer's (fp32)
    assert rows[1]["policy/rollout_train_logprob_gap"] < 1e-4
    assert rows[1]["policy/skipped"] == 0
