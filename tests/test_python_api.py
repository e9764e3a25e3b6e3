"""The Python API (``rlhf_cli.train``): its example runs, mistakes are refused naming the field or argument before
anything is written, and a run stopped by its (async) reward function resumes through the API exactly.

The runs live in this process, as in a notebook (single-process runs: no Ray). A reward function on a Ray run
is covered by tests/test_single_process.py (the same run on Ray, bit for bit).
"""

import asyncio
import contextlib
import io
import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_cli import train
from rlhf_core.config import RLConfig
from rlhf_core.errors import UserError

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "python_api.py"
small_words = runpy.run_path(str(EXAMPLE))["small_words"]


@pytest.fixture(scope="module")
def example_run(tmp_path_factory) -> tuple[Path, str]:
    """``python examples/python_api.py OUT``, run in this process; its run directory and what it printed."""
    out = tmp_path_factory.mktemp("python_api")
    argv, sys.argv = sys.argv, [str(EXAMPLE), str(out)]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(str(EXAMPLE), run_name="__main__")
    finally:
        sys.argv = argv
    return out / "run", printed.getvalue()


def metric_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in r.items() if k != "time" and not k.startswith(("perf/", "timing/"))} for r in rows
    ]


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.slow
def test_the_example_trains_from_python_objects_and_prints_its_metrics(example_run):
    run, printed = example_run
    rows = metric_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert printed.splitlines()[-4:] == [  # after what DeepSpeed prints when DS_ACCELERATOR is unset
        *(
            f"step {r['step']}: reward {r['reward/mean']:.3f}, policy loss {r['policy/loss']:+.4f}"
            for r in rows
        ),
        f"run directory: {run}",
    ]
    # every reward is a fraction of 8 or fewer words (0, 1/8, ..., 1), so a step's mean over 16 samples is in [0, 1]
    assert all(0 <= r["reward/mean"] <= 1 for r in rows) and any(r["reward/mean"] > 0 for r in rows)
    # the list of prompts became a file of the run directory, which the saved config names
    data = run / "data" / "dataset.jsonl"
    assert [json.loads(line)["input"] for line in data.read_text().splitlines()][:2] == ["w0 w0", "w1 w7"]
    assert f"prompt_dataset: [{data}]" in (run / "config.yaml").read_text()
    assert json.loads((run / "run.json").read_text())["reward_func"] == "__main__.small_words"
    assert (run / "train.log").is_file() and (run / "model" / "config.json").is_file()


@pytest.mark.slow
def test_a_run_stopped_by_its_reward_function_resumes_through_the_api_exactly(example_run, tmp_path):
    """The example's run again, from the config it saved, with an async reward function that fails from the third
    step on: the run stops naming it, after its step-2 checkpoint. Calling ``train`` again with
    ``ckpt.load_enable`` resumes there and ends on the example's metrics and weights, bit for bit."""
    calls = []

    async def flaky(queries, prompts, labels):
        calls.append(len(queries))
        await asyncio.sleep(0)
        if len(calls) > 2:
            raise ConnectionError("the judge went away")
        return small_words(queries, prompts, labels)

    async def steady(queries, prompts, labels):
        await asyncio.sleep(0)
        return small_words(queries, prompts, labels)

    config = example_run[0] / "config.yaml"
    ckpt = {"output_dir": str(tmp_path / "run"), "save_steps": 1}
    with pytest.raises(
        UserError, match=r"step 3: 16 of 16 samples could not be scored.*reward_func= .*flaky"
    ) as err:
        train("ppo", config, reward_func=flaky, ckpt=ckpt)
    assert "ConnectionError: the judge went away" in str(err.value)
    assert "rlhf train ppo stopped: step 3" in (tmp_path / "run" / "train.log").read_text()
    result = train("ppo", config, reward_func=steady, ckpt={**ckpt, "load_enable": True})
    assert result.output_dir == tmp_path / "run"
    assert [r["step"] for r in result.metrics] == [1, 2, 3]
    assert metric_rows(result.output_dir) == metric_rows(example_run[0])
    a, b = weights(result.output_dir / "model"), weights(example_run[0] / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"rollout": {"batch_szie": 4}},
            "unknown option --rollout.batch_szie for 'rlhf train ppo'; did you mean --rollout.batch_size",
        ),
        ({"rollout": {"batch_size": "four"}}, "--rollout.batch_size: invalid int value: 'four'"),
        ({"ds": {"tensor_parallel_size": 2}}, "--ds.tensor_parallel_size: DeepSpeed AutoTP is not wired"),
        (
            {"rollout": {"vllm_generate_batch_size": None}},
            "--rollout.vllm_generate_batch_size None: an override cannot",
        ),
        ({"reward_func": 42}, "reward_func= is a int (42), not a function"),
        (
            {"reward_func": lambda texts: texts},
            "reward_func= <lambda>(texts) cannot be called as reward_func(queries, "
            "prompts, labels, **kwargs)",
        ),
        (
            {"reward_func": small_words, "reward": {"remote_url": "reward.py"}},
            "reward_func= and --reward.remote_url both give the reward",
        ),
        ({"dataset": [{"input": "w1"}, "w2"]}, "dataset= row 1 is a str; expected a dict"),
        ({"dataset": [{"input": {1, 2}}]}, "dataset= row 0 cannot be written as JSON"),
        (
            {"dataset": [{"input": "w1"}], "data": {"prompt_dataset": ["p.jsonl"]}},
            "dataset= and --data.prompt_dataset both give the data",
        ),
        (
            {"config": RLConfig(), "mode": "sft"},
            "config= is a RLConfig: rlhf train sft takes a SupervisedConfig",
        ),
        ({"mode": "sft", "reward_func": small_words}, "reward_func= is the reward of 'rlhf train ppo'"),
    ],
    ids=[
        "misspelled",
        "mistyped",
        "refused",
        "none",
        "not-callable",
        "signature",
        "two-rewards",
        "row-not-dict",
        "row-not-json",
        "two-datasets",
        "config-of-another-mode",
        "reward-for-sft",
    ],
)
def test_mistakes_are_refused_naming_the_field_before_anything_is_written(
    kwargs, message, tiny_model, tmp_path
):
    kwargs = {
        "mode": "ppo",
        "reward_func": small_words,
        "actor": {"model_name_or_path": tiny_model},
        "ckpt": {"output_dir": str(tmp_path / "run")},
        **kwargs,
    }
    if kwargs["mode"] != "ppo":
        kwargs.pop("actor")
    with pytest.raises(UserError) as err:
        train(**kwargs)
    assert message in str(err.value)
    assert not (tmp_path / "run").exists()


def test_a_dry_run_checks_and_plans_from_a_config_object_without_changing_it(tiny_model, tmp_path):
    cfg = RLConfig()
    cfg.actor.model_name_or_path = tiny_model
    cfg.ckpt.output_dir = str(tmp_path / "run")
    result = train(
        "ppo",
        cfg,
        reward_func=small_words,
        dataset=[{"input": "w1"}],
        dry_run=True,
        algo={"advantage": {"estimator": "group_norm"}},
        rollout={"n_samples_per_prompt": 2},
    )
    assert result.metrics == [] and not (tmp_path / "run").exists()  # a dry run writes nothing
    assert "advantage_estimators   group_norm" in result.plan and "single process" in result.plan
    assert result.config.rollout.n_samples_per_prompt == 2 and result.config.ds.param_dtype == "fp32"
    assert result.config.reward.func is small_words
    assert result.config.data.prompt_dataset == [str(tmp_path / "run" / "data" / "dataset.jsonl")]
    assert cfg.ds.param_dtype == "auto" and cfg.reward.func is None and cfg.rollout.n_samples_per_prompt == 1
    cfg.data.dataset = ["sft.jsonl"]  # a field of the supervised modes, which a flag of ppo cannot set
    with pytest.raises(
        UserError, match=r"--data.dataset is an option of 'rlhf train sft\|rm\|dpo\|kto\|prm\|kd' only"
    ):
        train("ppo", cfg, reward_func=small_words, dry_run=True)


def test_a_datasets_dataset_is_written_as_a_list_is_and_a_resume_on_other_rows_is_refused(tmp_path):
    import datasets

    from rlhf_cli.api import _data_files
    from rlhf_core.config_parser import ConfigError

    rows = [{"input": "w1 w2", "label": 3}, {"input": "w4", "label": None}]
    cfg = RLConfig()
    cfg.ckpt.output_dir = str(tmp_path)
    files = _data_files("ppo", cfg, datasets.Dataset.from_list(rows), rows[:1])
    assert files == {
        tmp_path
        / "data"
        / "dataset.jsonl": '{"input": "w1 w2", "label": 3}\n{"input": "w4", "label": null}\n',
        tmp_path / "data" / "eval_dataset.jsonl": '{"input": "w1 w2", "label": 3}\n',
    }
    assert cfg.data.prompt_dataset == [str(tmp_path / "data" / "dataset.jsonl")]
    assert cfg.eval.dataset == [str(tmp_path / "data" / "eval_dataset.jsonl")]
    for path, text in files.items():
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    cfg = RLConfig()
    cfg.ckpt.output_dir, cfg.ckpt.load_enable = str(tmp_path), True
    assert _data_files("ppo", cfg, rows, None)  # the same rows: the resume reads what the run read
    cfg.data.prompt_dataset = None
    with pytest.raises(
        ConfigError, match="dataset=: the rows differ from .*dataset.jsonl, which the run being resumed"
    ):
        _data_files("ppo", cfg, rows[::-1], None)
