"""metrics.jsonl between runs: a fresh run keeps an earlier run's file aside, a resumed run drops the steps it
redoes."""

from __future__ import annotations

import json

from rlhf_core.rundir import prepare_metrics_file


def rows(*steps: int) -> str:
    return "".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in steps)


def test_a_fresh_run_keeps_earlier_runs_aside(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert prepare_metrics_file(path, 0) is None  # nothing there yet
    path.write_text(rows(1, 2, 3))
    assert prepare_metrics_file(path, 0) == tmp_path / "metrics.1.jsonl"
    assert not path.exists() and (tmp_path / "metrics.1.jsonl").read_text() == rows(1, 2, 3)
    path.write_text(rows(1))
    assert prepare_metrics_file(path, 0) == tmp_path / "metrics.2.jsonl"
    assert (tmp_path / "metrics.1.jsonl").read_text() == rows(1, 2, 3)  # the older one untouched
    assert (tmp_path / "metrics.2.jsonl").read_text() == rows(1)


def test_a_resumed_run_drops_the_steps_it_redoes_and_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(rows(1, 2, 3, 4) + '{"step": 5, "lo')  # killed while writing step 5
    assert prepare_metrics_file(path, 2) is None
    assert path.read_text() == rows(1, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
