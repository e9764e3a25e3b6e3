"""Single-process runs (`--ray.single_process`): a run whose one training rank hosts everything else lives in
the driver's process and starts no Ray, and computes what the same run computes on Ray.

The end-to-end cases run the real command in subprocesses (an inline rank changes its process: torch threads,
the process group, the allocator), once in the driver and once on a local Ray cluster, and compare.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core import handles
from rlhf_core.config import RLConfig

# counts ray.init calls made by the command (ray_launch and the trainers call it through the module)
WRAPPER = """
import json, sys
import ray
calls = []
real_init = ray.init
def counting_init(*args, **kwargs):
    calls.append(kwargs.get("address"))
    return real_init(*args, **kwargs)
ray.init = counting_init
if sys.argv[2] == "--api":  # argv: --api REWARD_FILE FLAGS: reward_func a function of this script, as in a notebook
    from rlhf_cli import train
    from rlhf_core.config_parser import parse_config
    exec(open(sys.argv[3]).read())
    train("ppo", parse_config("ppo", sys.argv[4:])[0], reward_func=reward_func)
    code = 0
else:
    from rlhf_cli.main import main
    code = main(sys.argv[2:])
json.dump({"code": code, "ray_init_calls": len(calls)}, open(sys.argv[1], "w"))
"""


def _cfg(setting="auto", address=None, dashboard=False):
    cfg = RLConfig()
    cfg.ray.single_process, cfg.ray.address, cfg.ray.dashboard = setting, address, dashboard
    return cfg


def test_single_process_decision(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert handles.single_process(_cfg(), 1)
    assert not handles.single_process(_cfg(), 2)
    assert not handles.single_process(_cfg("false"), 1)
    assert not handles.single_process(_cfg(), 1, backend_can=False)
    assert not handles.single_process(_cfg(address="ray://head:10001"), 1)
    assert not handles.single_process(_cfg(dashboard=True), 1)
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")
    assert not handles.single_process(_cfg(), 1)
    with pytest.raises(ValueError, match=r"\$RAY_ADDRESS head:6379") as err:
        handles.single_process(_cfg("true"), 3)
    assert "needs 3 worker processes" in str(err.value)
    monkeypatch.delenv("RAY_ADDRESS")
    with pytest.raises(ValueError, match="--train.backend deepspeed cannot run its rank"):
        handles.single_process(_cfg("true"), 1, backend_can=False)
    with pytest.raises(ValueError, match="expected auto, true or false"):
        handles.single_process(_cfg("yes"), 1)


def test_auto_uses_a_ray_session_the_process_already_has(monkeypatch):
    class FakeRay:
        @staticmethod
        def is_initialized():
            return True

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setitem(sys.modules, "ray", FakeRay)
    assert not handles.single_process(_cfg(), 1)  # a test's or notebook's session: the run uses it
    assert handles.single_process(_cfg("true"), 1)


# the dry runs of a test, one after another in one fresh process (no Ray session; each start imports torch,
# transformers and DeepSpeed for seconds): argv = JSON list of command lines; prints their results as JSON
DRY_RUNS = """
import contextlib, io, json, sys
from rlhf_cli.main import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    results.append({"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(results))
"""


def dry_runs(*commands: list[str]) -> list[subprocess.CompletedProcess]:
    """``rlhf COMMAND`` for each command line, as its exit code, stdout and stderr."""
    env = {**os.environ, "RLHF_NO_PROGRESS": "1", "DS_ACCELERATOR": "cpu"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-c", DRY_RUNS, json.dumps(commands)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [
        subprocess.CompletedProcess(argv, r["returncode"], r["stdout"], r["stderr"])
        for argv, r in zip(commands, json.loads(done.stdout.splitlines()[-1]), strict=True)
    ]


def test_dry_run_says_single_process_and_true_is_refused_when_the_run_needs_more(tmp_path, tiny_model):
    reward = tmp_path / "reward.py"
    reward.write_text("def reward_func(queries, prompts, labels, **kw):\n    return [0.0] * len(queries)\n")
    common = [
        "train",
        "ppo",
        "--dry-run",
        "--actor.model_name_or_path",
        tiny_model,
        "--reward.remote_url",
        str(reward),
        "--algo.advantage.estimator",
        "group_norm",
        "--rollout.n_samples_per_prompt",
        "2",
        "--ckpt.output_dir",
        str(tmp_path / "run"),
    ]
    colocated, default, separate, two_ranks, zero3, refused, generate = dry_runs(
        [*common, "--train.colocate_all", "--algo.kl.init_coef", "0.01"],
        [*common, "--algo.kl.init_coef", "0.01"],
        [*common, "--algo.kl.init_coef", "0.01", "--train.placement", "separate", "--bf16"],
        [*common, "--actor.num_gpus_per_node", "2"],
        [*common, "--ds.zero_stage", "3"],
        [*common, "--ray.single_process", "true", "--actor.num_gpus_per_node", "2", "--train.colocate_all"],
        ["generate", "--ray.single_process", "true", "--dry-run"],
    )
    out = colocated
    assert out.returncode == 0, out.stderr
    assert "single process: the one training rank runs in this process; no Ray cluster starts" in out.stdout
    # no placement or precision flag on CPU: colocated into one process, in fp32, and the plan says both
    out = default
    assert out.returncode == 0, out.stderr
    assert "# placement: colocate_all by default (no placement flag; on CPU" in out.stdout
    assert "single process: the one training rank runs in this process" in out.stdout
    assert "# precision: fp32 (--ds.param_dtype auto on CPU: bf16 on GPUs, fp32 on CPU)" in out.stdout
    assert "  param_dtype: fp32\n" in out.stdout and "colocate_all: true" in out.stdout
    assert "# ZeRO stage: 0 (default: 0 with one rank per training group, else 2)" in out.stdout
    assert "  zero_stage: 0\n" in out.stdout
    assert "note:" not in out.stderr
    # asked for: processes of their own (Ray, and a note says how to avoid it), and bf16 with what it costs
    out = separate
    assert out.returncode == 0, out.stderr
    assert "single process" not in out.stdout and "by default" not in out.stdout
    assert (
        "this run starts Ray and 3 worker processes; with --train.colocate_all it would fit one" in out.stderr
    )
    assert "# precision: bf16 (--ds.param_dtype)" in out.stdout
    assert (
        out.stderr.count("--ds.param_dtype bf16: the rollout engine and the trainer both compute in bf16")
        == 1
    )
    assert "expect their log-probs of the same token to differ by ~1e-2" in out.stderr
    out = two_ranks  # two ranks: Ray whatever the placement, no note
    assert out.returncode == 0 and "would fit one process" not in out.stderr
    assert "# ZeRO stage: 2 (default" in out.stdout  # two ranks have state to partition
    out = zero3
    assert out.returncode == 0 and "# ZeRO stage: 3 (--ds.zero_stage)" in out.stdout
    out = refused
    assert out.returncode != 0
    assert "--ray.single_process true cannot be honoured: the run needs 2 worker processes" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()
    out = generate  # generate always runs on Ray workers
    assert out.returncode != 0
    assert "--ray.single_process is an option of 'rlhf train ppo|sft|rm|dpo|kto|prm|kd' only" in out.stderr


def run_wrapped(tmp_path, name, args) -> dict:
    report = tmp_path / f"{name}.json"
    env = {**os.environ, "RLHF_NO_PROGRESS": "1", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "2"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-c", WRAPPER, str(report), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0 and report.is_file(), done.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["code"] == 0, done.stderr[-3000:]
    result["stderr"] = done.stderr
    return result


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


def metric_rows(out: Path, keys) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: r.get(k) for k in keys} for r in rows if "policy/loss" in r or "loss" in r]


REWARD = """
def reward_func(queries, prompts, labels, **kwargs):
    return [sum(w.startswith("w") and int(w[1:]) < 50 for w in q[len(p):].split()) / 4 for q, p in zip(queries, prompts)]
"""


@pytest.fixture(scope="module")
def ppo_args(tmp_path_factory) -> list[str]:
    """A GRPO run whose one rank hosts the reference model and the HF engine (colocate_all on CPU), with a
    KL loss: it fits one process."""
    from rlhf_core.testing.tiny import make_tiny_llama

    root = tmp_path_factory.mktemp("single_ppo")
    model = make_tiny_llama(root / "model", num_words=100, hidden_size=32, intermediate_size=64)
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"input": f"w{i} w{(i * 7) % 100}", "label": "0"}) + "\n" for i in range(32))
    )
    (root / "reward.py").write_text(REWARD)
    return [
        "train",
        "ppo",
        "--actor.model_name_or_path",
        model,
        "--reward.remote_url",
        str(root / "reward.py"),
        "--data.prompt_dataset",
        str(root / "prompts.jsonl"),
        "--data.label_key",
        "label",
        "--algo.advantage.estimator",
        "group_norm",
        "--rollout.n_samples_per_prompt",
        "4",
        "--rollout.batch_size",
        "4",
        "--rollout.max_new_tokens",
        "4",
        "--data.max_len",
        "16",
        "--train.batch_size",
        "16",
        "--train.micro_batch_size",
        "8",
        "--rollout.micro_batch_size",
        "8",
        "--ds.param_dtype",
        "fp32",
        "--actor.adam.lr",
        "1e-3",
        "--actor.lr_warmup_ratio",
        "0",
        "--algo.kl.init_coef",
        "0.05",
        "--algo.kl.use_loss",
        "--algo.kl.estimator",
        "k3",
        "--train.colocate_all",
    ]


@pytest.mark.slow
@pytest.mark.xdist_group("single_process")
def test_ppo_in_the_driver_computes_what_the_same_run_computes_on_ray(ppo_args, tmp_path):
    """The same seed gives the same steps and the same final weights, bit for bit, with and without Ray
    (both run the rank with 2 torch threads). The Ray run goes through the Python API with the reward as a
    function of the driver's script, which reaches the rollout worker by value."""
    args = [*ppo_args, "--train.max_steps", "3"]
    single = run_wrapped(tmp_path, "single", [*args, "--ckpt.output_dir", str(tmp_path / "single")])
    reward_file = args[args.index("--reward.remote_url") + 1]
    api_args = [a for a in args[2:] if a not in ("--reward.remote_url", reward_file)]
    on_ray = run_wrapped(
        tmp_path,
        "ray",
        [
            "--api",
            reward_file,
            *api_args,
            "--ray.single_process",
            "false",
            "--ckpt.output_dir",
            str(tmp_path / "ray"),
        ],
    )
    assert single["ray_init_calls"] == 0 and on_ray["ray_init_calls"] == 1
    assert "the worker in this process (no Ray) up in" in single["stderr"]
    assert "1 worker processes up in" in on_ray["stderr"]
    keys = [
        "step",
        "policy/loss",
        "policy/kl_loss",
        "policy/grad_norm",
        "reward/mean",
        "response_length/mean",
    ]
    rows = metric_rows(tmp_path / "single", keys)
    assert len(rows) == 3 and all(r["policy/grad_norm"] > 0 for r in rows)
    assert rows[-1]["policy/kl_loss"] != 0  # the reference model hosted in the rank took part
    assert rows == metric_rows(tmp_path / "ray", keys)
    a, b = weights(tmp_path / "single" / "model"), weights(tmp_path / "ray" / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model = Path(ppo_args[ppo_args.index("--actor.model_name_or_path") + 1])
    assert not all(torch.equal(a[k], v) for k, v in weights(model).items())  # it trained


@pytest.mark.slow
@pytest.mark.xdist_group("single_process")
def test_a_killed_single_process_run_resumes_exactly(ppo_args, tmp_path):
    """SIGKILL the whole run (driver and rank are one process) after its second checkpoint; resuming ends on
    the weights of the run that was never stopped."""
    env = {**os.environ, "RLHF_NO_PROGRESS": "1", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "2"}

    def cmd(out):
        return [
            sys.executable,
            "-m",
            "rlhf_cli.main",
            *ppo_args,
            "--train.max_steps",
            "6",
            "--ckpt.save_steps",
            "2",
            "--ckpt.output_dir",
            str(out),
        ]

    a, b = tmp_path / "a", tmp_path / "b"
    done = subprocess.run(cmd(a), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    proc = subprocess.Popen(cmd(b), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while (
        time.time() < deadline and proc.poll() is None and not (b / "checkpoints" / "step_00000004").is_dir()
    ):
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    done = subprocess.run(
        cmd(b) + ["--ckpt.load_enable"], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr
    wa, wb = weights(a / "model"), weights(b / "model")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
@pytest.mark.xdist_group("single_process")
def test_sft_in_the_driver_computes_what_the_same_run_computes_on_ray(tmp_path):
    from rlhf_core.testing.tiny import make_tiny_llama

    model = make_tiny_llama(tmp_path / "model", num_words=50, hidden_size=32, intermediate_size=64)
    (tmp_path / "sft.jsonl").write_text(
        "".join(
            json.dumps({"input": f"w{i} w{i + 1}", "output": f"w{(i * 3) % 50}"}) + "\n" for i in range(40)
        )
    )
    args = [
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
        "--train.max_epochs",
        "1",
        "--model.adam.lr",
        "1e-3",
        "--ds.param_dtype",
        "fp32",
        "--ds.zero_stage",
        "2",
    ]
    single = run_wrapped(tmp_path, "single", [*args, "--ckpt.output_dir", str(tmp_path / "single")])
    on_ray = run_wrapped(
        tmp_path, "ray", [*args, "--ray.single_process", "false", "--ckpt.output_dir", str(tmp_path / "ray")]
    )
    assert single["ray_init_calls"] == 0 and on_ray["ray_init_calls"] == 1
    keys = ["step", "train/loss", "train/grad_norm"]
    rows = metric_rows(tmp_path / "single", keys)
    assert len(rows) == 5 and rows == metric_rows(tmp_path / "ray", keys)
    a, b = weights(tmp_path / "single"), weights(tmp_path / "ray")
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
