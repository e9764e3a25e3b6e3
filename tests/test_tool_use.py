"""A tool-using agent learns in an RL run: ``examples/agent_tool_grpo.py`` GRPO-trains a policy whose agent
(``examples/agent_tool_calculator.py``, the real ``openai`` client with a calculator tool) is rewarded only when
it calls the calculator, through ``rlhf_cli.train("ppo", ...)`` in this process (what ``rlhf train ppo`` runs).

The policy is the example's warm start: a tiny Llama with SmolLM2-135M-Instruct's tokenizer and chat template
that answers the question either by calling the calculator or at once with a wrong product, about evenly.
"""

from pathlib import Path

import pytest

from rlhf_agents.loading import load_module

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "agent_tool_grpo.py"


@pytest.mark.real_model
@pytest.mark.slow
def test_grpo_raises_the_reward_of_an_agent_that_calls_a_calculator(tmp_path, smollm2):
    example = load_module(str(EXAMPLE), "agent_tool_grpo")
    question = [(48, 23)]
    example.warm_start(tmp_path / "policy", question, guessed=question)
    metrics = example.learn(tmp_path / "policy", tmp_path / "run", question, steps=6)

    rewards = [m["reward/mean"] for m in metrics]
    calls = [m["tool_calls"] for m in metrics]
    assert len(rewards) == 6
    # the reward needs a calculator call, so it never exceeds the share of episodes that made one
    assert all(r <= c for r, c in zip(rewards, calls))
    # 16 episodes a step: the first step's reward is near the untrained policy's rate of tool use (about 0.5,
    # minus the episodes whose memorised call or answer sampling broke); after training it is near 1
    assert sum(rewards[-3:]) / 3 >= max(0.8, rewards[0] + 0.15), rewards
    assert sum(calls[-3:]) / 3 > calls[0], calls
