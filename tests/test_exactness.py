"""bench/exactness.py's comparison of two runs' output directories: equal ones pass, and one changed metric,
one changed tensor, a changed dtype, a missing key or row is named as the first difference. No training run:
the directories are written here as the runs write them (``metrics.jsonl``, ``model/*.safetensors``)."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

spec = importlib.util.spec_from_file_location(
    "exactness", Path(__file__).resolve().parents[1] / "bench" / "exactness.py"
)
exactness = importlib.util.module_from_spec(spec)
spec.loader.exec_module(exactness)

ROWS = [
    {"step": 1, "time": 1.5, "policy/loss": 0.25, "reward/mean": 0.5, "timing/step_total": 0.1,
     "perf/tokens_per_s": 9.0},
    {"step": 2, "time": 2.5, "policy/loss": -0.125, "reward/mean": float("nan"), "timing/step_total": 0.2,
     "perf/tokens_per_s": 8.0, "mem/peak_gib": 1.0},
]  # fmt: skip


def write_run(path: Path, rows=ROWS, tensors=None, exported_to="model") -> Path:
    """An output directory as a run leaves it: metrics rows, and the weights under ``exported_to``."""
    (path / exported_to).mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if tensors is None:
        gen = torch.Generator().manual_seed(0)
        tensors = {"lm_head.weight": torch.randn(8, 4, generator=gen), "norm.weight": torch.ones(4)}
    save_file(tensors, str(path / exported_to / "model.safetensors"))
    (path / exported_to / "config.json").write_text("{}")
    return path


@pytest.fixture
def base(tmp_path):
    return write_run(tmp_path / "base")


def test_identical_runs_are_equal_and_timing_memory_and_wall_clock_keys_are_left_out(base, tmp_path):
    # the new side's timings and wall clock differ, as they do between any two runs
    rows = [{**r, "time": r["time"] + 100, "timing/step_total": 9.0, "perf/tokens_per_s": 1.0} for r in ROWS]
    result = exactness.compare_runs(base, write_run(tmp_path / "new", rows))
    assert result == {
        "metrics_equal": True,
        "metric_keys": 3,  # step, policy/loss, reward/mean (NaN in both: the same value logged)
        "left_out": {"time", "timing/step_total", "perf/tokens_per_s", "mem/peak_gib"},
        "weights_equal": True,
        "tensors": 2,
        "first_difference": None,
    }


def test_one_changed_metric_is_the_first_difference(base, tmp_path):
    rows = [ROWS[0], {**ROWS[1], "policy/loss": -0.125 + 1e-12}]
    result = exactness.compare_runs(base, write_run(tmp_path / "new", rows))
    assert not result["metrics_equal"] and result["weights_equal"]
    assert result["first_difference"] == "row 2 policy/loss: -0.125 vs -0.124999999999"


@pytest.mark.parametrize(
    "rows, difference",
    [
        ([ROWS[0]], "2 metric rows vs 1"),
        ([{**ROWS[0], "extra": 1.0}, ROWS[1]], "row 1: keys only in base [], only in new ['extra']"),
        ([{**ROWS[0], "step": 1.0}, ROWS[1]], "row 1 step: 1 vs 1.0"),  # an int logged as a float
    ],
)
def test_missing_rows_keys_and_changed_types_are_differences(base, tmp_path, rows, difference):
    assert exactness.compare_runs(base, write_run(tmp_path / "new", rows))["first_difference"] == difference


def test_one_changed_tensor_element_is_the_first_difference(base, tmp_path):
    gen = torch.Generator().manual_seed(0)
    head = torch.randn(8, 4, generator=gen)
    head[3, 1] = torch.nextafter(head[3, 1], torch.tensor(10.0))  # one bit of one element
    result = exactness.compare_runs(
        base, write_run(tmp_path / "new", tensors={"lm_head.weight": head, "norm.weight": torch.ones(4)})
    )
    assert result["metrics_equal"] and not result["weights_equal"]
    assert result["tensors"] == 0 and result["first_difference"].startswith("lm_head.weight: max abs diff ")


def test_dtype_and_missing_tensors_are_differences(base, tmp_path):
    gen = torch.Generator().manual_seed(0)
    head = torch.randn(8, 4, generator=gen)
    bf16 = exactness.compare_runs(
        base,
        write_run(
            tmp_path / "bf16", tensors={"lm_head.weight": head, "norm.weight": torch.ones(4).bfloat16()}
        ),
    )
    assert bf16["tensors"] == 1
    assert bf16["first_difference"] == "norm.weight: torch.float32 (4,) vs torch.bfloat16 (4,)"
    fewer = exactness.compare_runs(base, write_run(tmp_path / "fewer", tensors={"lm_head.weight": head}))
    assert (
        fewer["first_difference"] == "model.safetensors: tensors only in base ['norm.weight'], only in new []"
    )


def test_supervised_runs_export_into_the_output_directory_itself(tmp_path):
    a, b = write_run(tmp_path / "a", exported_to="."), write_run(tmp_path / "b", exported_to=".")
    assert exactness.compare_runs(a, b)["tensors"] == 2
    shutil.rmtree(tmp_path / "b")
    write_run(tmp_path / "b", exported_to=".", tensors={"norm.weight": torch.zeros(4)})
    assert exactness.compare_runs(a, b)["first_difference"].startswith(
        "model.safetensors: tensors only in base"
    )


def test_a_run_without_weights_is_not_equal(base, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text((base / "metrics.jsonl").read_text())
    result = exactness.compare_runs(base, tmp_path / "empty")
    assert (
        not result["weights_equal"]
        and result["first_difference"] == "weight files ['model.safetensors'] vs []"
    )
