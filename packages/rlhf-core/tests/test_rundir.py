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


def test_metrics_every_logging_steps_and_wandb_gets_the_config_without_its_key(tmp_path, monkeypatch):
    """``--logger.logging_steps 3`` over 7 steps logs steps 1, 3, 6 and the last; W&B (not installed here and it
    needs an account: a stand-in module records the calls) gets the same rows and the shown config."""
    import sys
    import types

    from rlhf_core.config_parser import parse_config, shown_config
    from rlhf_core.rundir import MetricsWriter

    calls = []
    wandb = types.ModuleType("wandb")
    wandb.login = lambda key: calls.append(("login", key))
    wandb.init = lambda **kw: calls.append(("init", kw)) or wandb
    wandb.log = lambda row, step: calls.append(("log", step))
    wandb.finish = lambda: calls.append(("finish",))
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    cfg, _ = parse_config(
        "sft", ["--logging_steps", "3", "--use_wandb", "sk-secret-1", "--wandb_project", "p"]
    )
    writer = MetricsWriter(tmp_path, cfg.logger, total_steps=7, config=shown_config(cfg, "sft"))
    assert [writer.log(s, {"loss": s / 10}) for s in range(1, 8)] == [
        True,
        False,
        True,
        False,
        False,
        True,
        True,
    ]
    writer.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 0.1), (3, 0.3), (6, 0.6), (7, 0.7)]
    assert calls[0] == ("login", "sk-secret-1")  # the code gets the real key...
    init = calls[1][1]
    assert (
        init["project"] == "p" and init["config"]["logger"]["wandb"]["key"] == "***"
    )  # ...the record does not
    assert "sk-secret-1" not in json.dumps(init)
    assert [c for c in calls if c[0] == "log"] == [("log", s) for s in (1, 3, 6, 7)] and calls[-1] == (
        "finish",
    )
