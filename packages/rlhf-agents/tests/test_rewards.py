"""Reward files that raise, return NaN/None/Inf, the wrong length or type; weighted sources; the reward model."""

from __future__ import annotations

import asyncio
import logging
import math
import textwrap

import pytest

from rlhf_agents import (
    PythonFileRewardSource,
    RewardModelSource,
    RolloutFailureError,
    RolloutWorker,
    UserCodeError,
    WeightedRewardSource,
    build_reward_source,
)
from rlhf_agents.loading import load_module
from rlhf_core.types import RewardRequest, SamplingParams


def reward_file(tmp_path, body: str, name: str = "reward.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def request(n: int, labels=None) -> RewardRequest:
    labels = labels if labels is not None else [str(i) for i in range(n)]
    return RewardRequest(
        queries=[f"q{i}" for i in range(n)],
        prompts=[f"p{i}" for i in range(n)],
        labels=labels,
        prompt_ids=[[1, i] for i in range(n)],
        response_ids=[[i, 2] for i in range(n)],
        finish_reasons=["stop"] * n,
        responses=[f"r{i}" for i in range(n)],
    )


def score(source, req):
    return asyncio.run(source.score(req))


RAISES_ON_BOOM = """
CALLS = []

def reward_func(queries, prompts, labels):
    CALLS.append(len(queries))
    for label in labels:
        if label == "boom":
            raise ValueError("cannot score " + label)
    return {"rewards": [float(label) for label in labels]}
"""


@pytest.mark.parametrize("kind", ["def", "async def"])
def test_one_raising_sample_in_64_is_unscorable_and_the_rest_are_scored(tmp_path, caplog, kind):
    path = reward_file(tmp_path, RAISES_ON_BOOM.replace("def reward_func", f"{kind} reward_func"))
    labels = [str(i) for i in range(64)]
    labels[37] = "boom"
    with caplog.at_level(logging.ERROR):
        result = score(PythonFileRewardSource(path), request(64, labels))
    assert result.rewards[37] is None
    assert "ValueError: cannot score boom" in result.errors[37] and path in result.errors[37]
    assert [r for i, r in enumerate(result.rewards) if i != 37] == [float(i) for i in range(64) if i != 37]
    assert result.scores[0] == 0.0 and result.scores[5] == 5.0  # scores default to the rewards
    calls = load_module(path, "test").CALLS
    assert calls[0] == 64 and len(calls) <= 1 + 2 * 6  # batched first, then halved down to the culprit
    (logged,) = [r.getMessage() for r in caplog.records if "Traceback" in r.getMessage()]
    # one traceback, the sample's own: not chained to those of the batch and of each half that held it
    assert logged.count("Traceback (most recent call last)") == 1, logged
    assert "During handling of the above exception" not in logged
    assert logged.rstrip().endswith("ValueError: cannot score boom")


def test_raising_sample_through_the_worker_is_counted_and_the_run_continues(
    tmp_path, async_engine, tokenizer, cfg_factory
):
    path = reward_file(tmp_path, RAISES_ON_BOOM, "boom_reward.py")
    cfg = cfg_factory(reward={"remote_url": path})
    worker = RolloutWorker.from_config(cfg, async_engine, tokenizer)
    prompts = [
        {"prompt_text": f"w{i}", "label": "boom" if i == 9 else "1", "prompt_uid": i} for i in range(16)
    ]
    trajs = worker.rollout(prompts, SamplingParams(n=4, max_new_tokens=2), step=0)  # 64 samples
    worker.close()
    bad = [t for t in trajs if t.reward is None]
    assert [t.prompt_uid for t in bad] == [9] * 4
    assert all("cannot score boom" in t.error for t in bad)
    assert worker.last_metrics["reward/unscorable"] == 4.0 and worker.last_metrics["error/reward"] == 4.0
    assert worker.last_metrics["reward/mean"] == 1.0  # unscorable samples are left out, not counted as 0


def test_nan_inf_none_and_wrongly_typed_values_mark_only_their_sample(tmp_path):
    path = reward_file(
        tmp_path,
        """
        import torch
        def reward_func(queries, prompts, labels):
            return {"rewards": [1.0, float("nan"), None, float("inf"), "high", 0.5],
                    "scores": torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, float("-inf")])}
        """,
    )
    result = score(PythonFileRewardSource(path), request(6))
    assert result.rewards[0] == 1.0 and result.scores[0] == 1.0
    assert result.rewards[1:] == [None] * 5
    assert "reward is nan" in result.errors[1]
    assert "reward is None" in result.errors[2]
    assert "reward is inf" in result.errors[3]
    assert "wrong type" in result.errors[4] and "str" in result.errors[4]
    assert "score is -inf" in result.errors[5]


def test_wrong_length_names_file_function_expected_and_actual(tmp_path):
    path = reward_file(
        tmp_path,
        "def reward_func(queries, prompts, labels):\n    return {'rewards': [1.0] * (len(queries) - 1)}\n",
    )
    result = score(PythonFileRewardSource(path), request(64))
    assert result.rewards == [None] * 64
    assert (
        result.errors[0]
        == f"reward_func in {path} returned 63 rewards for a batch of 64 samples (expected 64)"
    )


def test_wrong_type_names_file_function_expected_and_actual(tmp_path):
    path = reward_file(tmp_path, "def reward_func(queries, prompts, labels):\n    return 'great'\n")
    result = score(PythonFileRewardSource(path), request(3))
    assert result.rewards == [None] * 3
    message = result.errors[0]
    assert (
        f"reward_func in {path}" in message
        and "str" in message
        and "expected a dict with 'rewards'" in message
    )


def test_wrong_length_stops_the_run_naming_the_file(tmp_path, async_engine, tokenizer, cfg_factory):
    path = reward_file(
        tmp_path, "def reward_func(queries, prompts, labels):\n    return [0.0]\n", "short_reward.py"
    )
    worker = RolloutWorker.from_config(cfg_factory(reward={"remote_url": path}), async_engine, tokenizer)
    with pytest.raises(RolloutFailureError) as info:
        worker.rollout(
            [{"prompt_text": "w1", "prompt_uid": 0}], SamplingParams(n=4, max_new_tokens=2), step=2
        )
    worker.close()
    message = str(info.value)
    assert "step 2: 4 of 4 samples could not be scored" in message
    assert f"reward source: reward_func in {path}" in message
    assert "returned 1 rewards for a batch of 4 samples (expected 4)" in message


def test_async_reward_func_and_keyword_arguments(tmp_path):
    path = reward_file(
        tmp_path,
        """
        import asyncio
        SEEN = {}
        async def reward_func(queries, prompts, labels, *, finish_reasons, responses):
            await asyncio.sleep(0)
            SEEN["kwargs"] = (finish_reasons, responses)
            return {"rewards": [len(r) for r in responses], "extra_logs": {"n": [1] * len(queries)}}
        """,
    )
    result = score(PythonFileRewardSource(path), request(2))
    assert result.rewards == [2.0, 2.0] and result.extra_logs["n"] == [1.0, 1.0]
    assert load_module(path, "test").SEEN["kwargs"] == (["stop", "stop"], ["r0", "r1"])

    everything = reward_file(
        tmp_path,
        """
        SEEN = {}
        def reward_func(queries, prompts, labels, **kwargs):
            SEEN.update(kwargs)
            return [0.0] * len(queries)
        """,
        "all_kwargs.py",
    )
    score(PythonFileRewardSource(everything), request(2))
    seen = load_module(everything, "test").SEEN
    assert sorted(seen) == ["finish_reasons", "prompt_ids", "response_ids", "responses"]
    assert seen["response_ids"] == [[0, 2], [1, 2]]


def test_reward_file_loading_errors(tmp_path):
    with pytest.raises(UserCodeError, match=r"missing.py: no such file"):
        PythonFileRewardSource(str(tmp_path / "missing.py"))
    with pytest.raises(UserCodeError, match=r"defines no 'reward_func'; it defines: score"):
        PythonFileRewardSource(reward_file(tmp_path, "def score(q, p, l):\n    return []\n", "r1.py"))
    with pytest.raises(UserCodeError, match=r"cannot be called as reward_func\(queries, prompts, labels"):
        PythonFileRewardSource(reward_file(tmp_path, "def reward_func(queries):\n    return []\n", "r2.py"))


def test_slow_reward_function_times_out(tmp_path):
    path = reward_file(
        tmp_path, "import time\ndef reward_func(q, p, l):\n    time.sleep(1)\n    return [0.0] * len(q)\n"
    )
    result = score(PythonFileRewardSource(path, timeout=0.2), request(4))
    assert result.rewards == [None] * 4 and "longer than --reward.timeout 0.2 s" in result.errors[0]


def test_weighted_sources_are_combined_and_logged_each(tmp_path, cfg_factory):
    a = reward_file(
        tmp_path, "def reward_func(q, p, labels):\n    return [float(x) for x in labels]\n", "accuracy.py"
    )
    b = reward_file(
        tmp_path,
        "def reward_func(q, p, labels):\n    return [None if x == '3' else 10.0 for x in labels]\n",
        "style.py",
    )
    cfg = cfg_factory(reward={"remote_url": f"{a},{b}", "weights": [0.7, 0.3]})
    source = build_reward_source(cfg)
    assert isinstance(source, WeightedRewardSource)
    result = score(source, request(4))
    for i in (0, 1, 2):
        assert result.rewards[i] == pytest.approx(0.7 * i + 0.3 * 10.0)
    assert result.rewards[3] is None and "reward source 'style'" in result.errors[3]
    assert result.extra_logs["reward/accuracy"] == [0.0, 1.0, 2.0, 3.0]
    assert result.extra_logs["reward/style"] == [10.0, 10.0, 10.0, None]

    with pytest.raises(ValueError, match="give --reward.weights"):
        build_reward_source(cfg_factory(reward={"remote_url": f"{a},{b}"}))
    with pytest.raises(ValueError, match="1 weights for 2 reward sources"):
        build_reward_source(cfg_factory(reward={"remote_url": f"{a},{b}", "weights": [1.0]}))


def test_reward_model_source_scores_token_ids_without_retokenizing():
    class Handle:
        def __init__(self):
            self.seen = None

        def compute_rewards(self, sequences):
            self.seen = sequences
            return [float(sum(s)) for s in sequences[:-1]] + [float("nan")]

    handle = Handle()
    result = score(RewardModelSource(handle), request(3))
    assert handle.seen == [[1, 0, 0, 2], [1, 1, 1, 2], [1, 2, 2, 2]]
    assert result.rewards == [3.0, 5.0, None] and "reward is nan" in result.errors[2]


def test_local_reward_model_matches_an_unpadded_forward(tiny_dir, cfg_factory):
    import torch
    from transformers import AutoModelForSequenceClassification

    cfg = cfg_factory(
        reward={"model_name_or_path": str(tiny_dir)},
        ds={"param_dtype": "fp32"},
        rollout={"micro_batch_size": 2},
    )
    source = build_reward_source(cfg)
    assert isinstance(source, RewardModelSource)
    req = request(3)
    req.prompt_ids = [[5, 6, 7], [8], [9, 10]]
    req.response_ids = [[11, 2], [12, 13, 14, 15], [2]]
    result = score(source, req)
    model = AutoModelForSequenceClassification.from_pretrained(
        str(tiny_dir), num_labels=1, dtype=torch.float32
    )
    model.score.load_state_dict(source.handle.head.state_dict())  # the same (randomly initialised) head
    for i in range(3):
        with torch.no_grad():
            want = model(torch.tensor([req.prompt_ids[i] + req.response_ids[i]])).logits[0, 0].item()
        assert math.isclose(result.rewards[i], want, rel_tol=1e-4, abs_tol=1e-5)
