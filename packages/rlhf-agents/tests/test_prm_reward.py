"""The PRM reward source: steps marked as in training, scored at each marker, aggregated, and chosen for a
``--reward.model_name_or_path`` that holds a PRM (never by the reward-model source)."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from rlhf_agents.prm_reward import PRMRewardSource, ProcessRewardModel, aggregate_steps, mark_steps
from rlhf_agents.rewards import build_reward_source
from rlhf_core.config import RLConfig
from rlhf_core.supervised import PLACEHOLDER_KEY, REWARD_TOKENS_KEY, SetupError
from rlhf_core.testing import RewardSourceConformance
from rlhf_core.testing.tiny import make_tiny_llama
from rlhf_core.types import RewardRequest


def make_prm(path, reward_tokens=("w51", "w52")) -> str:
    """A (random) tiny Llama saved as ``rlhf train prm`` saves a PRM: its config names marker and tokens."""
    from transformers import AutoConfig

    make_tiny_llama(path, num_words=60)
    config = AutoConfig.from_pretrained(path)
    setattr(config, PLACEHOLDER_KEY, "w50")
    setattr(config, REWARD_TOKENS_KEY, list(reward_tokens) if reward_tokens else None)
    config.save_pretrained(path)
    return str(path)


def prm_config(path) -> RLConfig:
    cfg = RLConfig()
    cfg.reward.model_name_or_path = path
    cfg.ds.param_dtype = "fp32"
    return cfg


class TestPRMRewardConformance(RewardSourceConformance):
    name = "prm"

    def make_config(self, tmp_path):
        return prm_config(make_prm(tmp_path / "prm"))


def test_mark_steps_puts_the_marker_after_every_step():
    assert mark_steps("w1 w2\nw3\n\nw4 ", "\n", "w50") == "w1 w2 w50\nw3 w50\n\nw4 w50"
    assert mark_steps("w1 w50 w2 w50", "\n", "w50") == "w1 w50 w2 w50"  # already marked: as it is
    assert mark_steps("w1 w2", " ", "w50") == "w1 w50 w2 w50"


def test_aggregations():
    s = [0.9, 0.2, 0.6]
    assert aggregate_steps(s, "min") == 0.2 and aggregate_steps(s, "last") == 0.6
    assert aggregate_steps(s, "mean") == pytest.approx(1.7 / 3) and aggregate_steps(
        s, "prod"
    ) == pytest.approx(0.108)
    with pytest.raises(ValueError, match="--reward.prm_aggregation 'max'"):
        aggregate_steps(s, "max")


def test_step_scores_are_the_positive_token_probability_at_each_marker(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_prm(tmp_path / "prm")
    prm = ProcessRewardModel(path, step_separator="\n", batch_size=2)
    prompts = ["w1 w50 w2", "w3", "w4 w5"]  # a marker in the prompt is not scored
    responses = ["w6 w7\nw8", "w9", ""]
    scores = prm.step_scores(prompts, responses)
    assert [len(s) for s in scores] == [2, 1, 0]

    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    good, bad = tok.convert_tokens_to_ids(["w51", "w52"])
    for prompt, response, got in zip(prompts[:2], responses[:2], scores):
        head = tok(prompt, add_special_tokens=False)["input_ids"]
        ids = head + tok(mark_steps(response, "\n", "w50"), add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        marks = [i for i in range(len(head), len(ids)) if ids[i] == tok.convert_tokens_to_ids("w50")]
        want = [
            math.exp(logits[i, good]) / (math.exp(logits[i, good]) + math.exp(logits[i, bad])) for i in marks
        ]
        assert got == pytest.approx(want, abs=1e-5)

    source = PRMRewardSource(prm, "min")
    request = RewardRequest(
        queries=[p + " " + r for p, r in zip(prompts, responses)],
        prompts=prompts,
        labels=[None] * 3,
        responses=responses,
    )
    result = asyncio.run(source.score(request))
    assert result.rewards[:2] == pytest.approx([min(scores[0]), scores[1][0]])
    assert result.rewards[2] is None and "no step to score" in result.errors[2]
    assert result.step_scores == scores
    assert result.extra_logs["prm/steps"] == [2.0, 1.0, 0.0]


def test_a_prm_directory_picks_the_prm_source_and_not_the_reward_model_one(tmp_path):
    source = build_reward_source(prm_config(make_prm(tmp_path / "prm")))
    assert isinstance(source, PRMRewardSource)


def test_a_prm_without_reward_tokens_cannot_score(tmp_path):
    with pytest.raises(SetupError, match="trained without --prm.reward_tokens"):
        ProcessRewardModel(make_prm(tmp_path / "prm", reward_tokens=None))
