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
