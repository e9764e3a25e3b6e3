"""The built-in post-processors of rlhf generate, against hand-computed rows, and their conformance."""

import math

import pytest

from rlhf_core.postprocess import BUILTIN, z_scores
from rlhf_core.testing import PostProcessorConformance
from rlhf_core.types import PostProcessInput, PostProcessOptions, ScoredSample


class TestRejectionSampling(PostProcessorConformance):
    name = "rs"


class TestIterativeDPO(PostProcessorConformance):
    name = "iter_dpo"


class TestConditionalSFT(PostProcessorConformance):
    name = "csft"


def groups(*rewards_per_prompt):
    return [
        [ScoredSample(f"p{p}", f"a{p}.{j}", r, p, j) for j, r in enumerate(rs)]
        for p, rs in enumerate(rewards_per_prompt)
    ]


def test_rs_keeps_the_best_sample_and_the_first_of_equals():
    rows = BUILTIN["rs"](PostProcessInput(groups([0.5, 2.0, -1.0, 2.0], [0.0], [-3.0, -2.0])))
    assert rows == [
        {"input": "p0", "output": "a0.1", "reward": 2.0},
        {"input": "p1", "output": "a1.0", "reward": 0.0},
        {"input": "p2", "output": "a2.1", "reward": -2.0},
    ]


def test_iter_dpo_pairs_best_with_worst_and_drops_prompts_without_a_preference():
    rows = BUILTIN["iter_dpo"](
        PostProcessInput(groups([0.5, 2.0, -1.0, 2.0, -1.0], [1.0, 1.0, 1.0], [0.0], [3.0, 4.0]))
    )
    # prompt 1 (all equal) and prompt 2 (one sample) have no preference: OpenRLHF wrote chosen == rejected
    assert rows == [
        {"prompt": "p0", "chosen": "a0.1", "chosen_reward": 2.0, "rejected": "a0.2", "rejected_reward": -1.0},
        {"prompt": "p3", "chosen": "a3.1", "chosen_reward": 4.0, "rejected": "a3.0", "rejected_reward": 3.0},
    ]


def test_csft_writes_the_reward_into_the_prompt():
    rows = BUILTIN["csft"](PostProcessInput(groups([1.0, -0.125], [2.5])))
    assert [r["input"] for r in rows] == [
        "p0 <rm_score>: 1.00 ",
        "p0 <rm_score>: -0.12 ",
        "p1 <rm_score>: 2.50 ",
    ]
    assert [r["output"] for r in rows] == ["a0.0", "a0.1", "a1.0"]


def test_csft_normalises_over_the_whole_output_with_the_sample_std():
    # rewards 1, 2, 6: mean 3, sample variance ((-2)^2 + (-1)^2 + 3^2) / 2 = 7
    options = PostProcessOptions(reward_template="[{reward}] {input}", normalize_reward=True)
    rows = BUILTIN["csft"](PostProcessInput(groups([1.0, 2.0], [6.0]), options))
    expected = [-2 / math.sqrt(7), -1 / math.sqrt(7), 3 / math.sqrt(7)]  # -0.756, -0.378, 1.134
    assert [r["input"] for r in rows] == ["[-0.76] p0", "[-0.38] p0", "[1.13] p1"]
    assert [r["reward"] for r in rows] == [round(e, 2) for e in expected]
    assert z_scores([4.0, 4.0]) == [0.0, 0.0] and z_scores([4.0]) == [0.0]


@pytest.mark.parametrize(
    "template, message",
    [
        ("{input} only", "must contain {reward}"),
        ("score {reward}", "must contain {input}"),
        ("{input} {reward} {other}", "only {input} and {reward}"),
    ],
)
def test_csft_refuses_a_template_it_cannot_fill(template, message):
    with pytest.raises(ValueError, match="--generate.reward_template") as info:
        BUILTIN["csft"].check(PostProcessOptions(reward_template=template))
    assert message in str(info.value)
