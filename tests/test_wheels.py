"""The built wheels (not the editable installs) installed into clean venvs, one per way of installing rlhf:
(a) `pip install rlhf-cli rlhf-algos`, then `rlhf doctor` and a one-step SFT run on Ray with DeepSpeed;
(b) a rollout node (rlhf-core, rlhf-agents, rlhf-rollout-vllm) whose venv has no deepspeed;
(c) the example plugin package against the wheels, found by rlhf's plugin manager.

Installing torch, Ray and transformers into each venv would take minutes, so each venv's site-packages links
every third-party entry of this venv's (deepspeed left out for the rollout node) and pip installs the wheels
with dependency resolution from the built wheels only (--no-index): a declared dependency that is missing
from the venv fails the install, as it would leave a user's install incomplete. pip's configuration on the
machine (constraints, find-links, indexes) is switched off, so nothing else is consulted."""

import importlib.metadata as md
import json
import math
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("wheels")]

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(sysconfig.get_paths()["purelib"])
RLHF = ["rlhf-core", "rlhf-algos", "rlhf-agents", "rlhf-train-deepspeed", "rlhf-rollout-vllm", "rlhf-cli"]
# pip without the machine's configuration, and nothing of the test's own environment that could point
# Python at the repository's sources
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))}
ENV.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", RLHF_NO_PROGRESS="1")


def run(cmd: list, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    """A wheel and an sdist of each package and of the example plugin, as `make dist` builds them."""
    out = tmp_path_factory.mktemp("dist")
    for pkg in [*sorted(ROOT.glob("packages/*/")), ROOT / "examples" / "rlhf-example-plugin"]:
        done = run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, pkg], cwd=out)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out


def clean_venv(path: Path, leave_out: tuple[str, ...] = ()) -> Path:
    """A venv whose site-packages links each top-level entry of this venv's except the rlhf packages (and
    their editable-install hooks) and the distributions in leave_out; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True)
    site = path / SITE.relative_to(sys.prefix)
    for entry in SITE.iterdir():
        top = entry.name.split("-")[0].split(".")[0].lower()
        if "rlhf" in entry.name.lower() or top in leave_out or entry.name == "__pycache__":
            continue
        (site / entry.name).symlink_to(entry)
    return path / "bin" / "python"


def pip_install(python: Path, wheels: Path, *names: str) -> subprocess.CompletedProcess:
    return run(
        [python, "-m", "pip", "install", "--no-index", "--find-links", wheels, "--no-cache-dir", *names],
        cwd=wheels,
    )


def test_make_dist_builds_a_wheel_and_an_sdist_of_every_package(wheels):
    built = sorted(p.name for p in wheels.iterdir())
    for dist in [*RLHF, "rlhf-example-plugin"]:
        stem = dist.replace("-", "_")
        assert any(n.startswith(stem) and n.endswith("-py3-none-any.whl") for n in built), (dist, built)
        assert any(n.startswith(stem) and n.endswith(".tar.gz") for n in built), (dist, built)


def test_cli_and_algos_install_runs_doctor_and_a_one_step_sft(wheels, tmp_path):
    python = clean_venv(tmp_path / "venv")
    done = pip_install(python, wheels, "rlhf-cli", "rlhf-algos")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    rlhf = tmp_path / "venv" / "bin" / "rlhf"
    doctor = run([rlhf, "doctor"], cwd=tmp_path)
    assert doctor.returncode == 0, doctor.stderr[-3000:]
    for dist in ("rlhf-core", "rlhf-algos", "rlhf-agents", "rlhf-train-deepspeed", "rlhf-cli"):
        line = next(x for x in doctor.stdout.splitlines() if x.startswith(dist + " "))
        assert line.split()[1:] == [md.version(dist), "(wheel)"], line  # the version of this tree
    assert "rlhf-rollout-vllm      -- not installed" in doctor.stdout
    assert "install     trainer (generates on the HF engine; no rlhf-rollout-vllm)" in doctor.stdout

    make_data = (
        "import sys\nfrom rlhf_core.testing.tiny import make_tiny_llama\n"
        "from rlhf_train_deepspeed.testing import sft_rows, write_jsonl\n"
        "import rlhf_cli\nprint(rlhf_cli.__file__)\n"
        "make_tiny_llama('model')\nwrite_jsonl('sft.jsonl', sft_rows(8))\n"
    )
    made = run([python, "-c", make_data], cwd=tmp_path)
    assert made.returncode == 0, made.stderr[-3000:]
    assert made.stdout.startswith(str(tmp_path / "venv")), (
        made.stdout
    )  # the wheel's code, not the repository's
    sft = run(
        [
            rlhf,
            "train",
            "sft",
            "--model.model_name_or_path",
            "model",
            "--data.dataset",
            "sft.jsonl",
            "--data.input_key",
            "input",
            "--data.output_key",
            "output",
            "--train.batch_size",
            "8",
            "--train.micro_batch_size",
            "8",
            "--train.max_epochs",
            "1",
            "--ds.zero_stage",
            "0",
            "--ds.param_dtype",
            "fp32",
            "--ckpt.output_dir",
            "out",
        ],
        cwd=tmp_path,
        timeout=600,
    )
    assert sft.returncode == 0, sft.stdout[-3000:] + sft.stderr[-3000:]
    (row,) = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    # the step's loss is the initial model's: its logits are near zero (weights drawn with std 0.02), so
    # the cross-entropy is close to that of the uniform distribution over the vocabulary, ln V
    vocab = json.loads((tmp_path / "model" / "config.json").read_text())["vocab_size"]
    assert row["step"] == 1 and abs(row["loss"] - math.log(vocab)) < 0.1, (row, vocab)


def test_rollout_node_installs_without_deepspeed(wheels, tmp_path):
    python = clean_venv(tmp_path / "venv", leave_out=("deepspeed",))
    done = pip_install(python, wheels, "rlhf-core", "rlhf-agents", "rlhf-rollout-vllm")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # every module of the three packages imports (rlhf_core.testing aside: it is the [testing] extra)
    probe = (
        "import importlib, importlib.util, pkgutil, sys\n"
        "import rlhf_core, rlhf_agents, rlhf_rollout_vllm\n"
        "for pkg in (rlhf_core, rlhf_agents, rlhf_rollout_vllm):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        if not m.name.startswith('rlhf_core.testing'):\n"
        "            importlib.import_module(m.name)\n"
        "from rlhf_core import plugins\n"
        "pm = plugins.get_plugin_manager()\n"
        "print(sorted(d['distribution'] for d in plugins.describe(pm)))\n"
        "print(sorted(plugins.collect(pm, 'rollout_engines')))\n"
        "print(importlib.util.find_spec('deepspeed'), [m for m in sys.modules if m.split('.')[0] == 'deepspeed'])\n"
    )
    out = run([python, "-c", probe], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    # rlhf-algos comes with rlhf-agents (the PRM reward source's step scores); no training stack does
    assert out.stdout.splitlines() == [
        "['rlhf-agents', 'rlhf-algos', 'rlhf-core', 'rlhf-rollout-vllm']",
        "['hf', 'vllm']",
        "None []",
    ]
    # the same venv refuses the training backend: its dependency on deepspeed cannot be met here
    refused = pip_install(python, wheels, "rlhf-train-deepspeed")
    assert refused.returncode != 0 and "deepspeed" in refused.stdout + refused.stderr


def test_example_plugin_installs_against_the_wheels_and_is_found(wheels, tmp_path):
    python = clean_venv(tmp_path / "venv")
    done = pip_install(python, wheels, "rlhf-example-plugin")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    probe = (
        "from rlhf_core import plugins\n"
        "pm = plugins.get_plugin_manager()\n"
        "print(sorted(d['distribution'] for d in plugins.describe(pm)))\n"
        "print(plugins.collect(pm, 'advantage_estimators')['group_median'].distribution)\n"
    )
    out = run([python, "-c", probe], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == [
        "['rlhf-agents', 'rlhf-algos', 'rlhf-core', 'rlhf-example-plugin']",
        "rlhf-example-plugin",
    ]
