"""The example plugin's own tests: the rlhf conformance suite plus its formula on a hand-worked case."""

import torch

from rlhf_core.testing import AdvantageEstimatorConformance, EnvironmentConformance, PostProcessorConformance
from rlhf_core.types import AdvantageInput, PostProcessInput, ScoredSample
from rlhf_example_plugin import AboveMean, GroupMedianEstimator, GuessNumber


class TestGroupMedianConformance(AdvantageEstimatorConformance):
    name = "group_median"


def test_median_baseline_by_hand():
    # group 1: rewards 1, 5, 2 -> median 2 -> 1-2=-1, 5-2=3, 2-2=0
    # group 2: rewards 0, 0, 9, sample 2 invalid -> median of (0, 0) = 0 -> 0, 0, invalid -> 0
    batch = AdvantageInput(
        rewards=torch.tensor([1.0, 5.0, 2.0, 0.0, 0.0, 9.0]),
        action_mask=torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 1], [1, 1]], dtype=torch.bool),
        n_samples_per_prompt=3,
        valid=torch.tensor([True, True, True, True, True, False]),
    )
    out = GroupMedianEstimator()(batch)
    expected = torch.tensor([[-1.0, -1.0], [3.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(out.advantages, expected)


def test_kl_penalty_and_reward_clip_by_hand():
    # rewards 1, 5, 2 -> median 2 -> shaped -1, 3, 0; clip to [-2, 2] -> -1, 2, 0 on the last token;
    # -0.5 * kl on every token; advantages are rewards-to-go
    batch = AdvantageInput(
        rewards=torch.tensor([1.0, 5.0, 2.0]),
        action_mask=torch.ones(3, 2, dtype=torch.bool),
        n_samples_per_prompt=3,
        kl=torch.tensor([[0.1, 0.2], [0.0, 0.0], [0.3, 0.0]]),
        kl_coef=0.5,
        reward_clip=(-2.0, 2.0),
    )
    out = GroupMedianEstimator()(batch)
    # row 0: token rewards -0.05, -1 - 0.1 -> to go: -1.15, -1.1; row 2: -0.15, 0 -> -0.15, 0
    expected = torch.tensor([[-1.15, -1.1], [2.0, 2.0], [-0.15, 0.0]])
    torch.testing.assert_close(out.advantages, expected)
    torch.testing.assert_close(out.returns, expected)


class TestGuessNumberConformance(EnvironmentConformance):
    name = "guess_number"
    label = "7"


def test_guess_number_feedback_and_reward():
    import asyncio

    env = GuessNumber()

    async def play(guesses):
        await env.reset({"observation": "guess", "label": "7"})
        return [await env.step({"action_text": g, "label": "7"}) for g in guesses]

    first, second, third = asyncio.run(play(["3", "9", "the answer is 7"]))
    assert (first["environment_feedback"], first["done"]) == (" higher", False)
    assert (second["environment_feedback"], second["done"]) == (" lower", False)
    assert third["done"] and third["rewards"] == 0.5 and third["scores"] == 1.0


class TestAboveMeanConformance(PostProcessorConformance):
    name = "above_mean"


def test_above_mean_by_hand():
    # prompt 0: rewards 1, 4, 1 -> mean 2 -> keeps the 4; prompt 1: 3, 3 -> nothing beats the mean
    groups = [
        [ScoredSample("p0", f"a{j}", r, 0, j) for j, r in enumerate([1.0, 4.0, 1.0])],
        [ScoredSample("p1", f"b{j}", 3.0, 1, j) for j in range(2)],
    ]
    assert AboveMean()(PostProcessInput(groups)) == [{"input": "p0", "output": "a1", "reward": 4.0}]
