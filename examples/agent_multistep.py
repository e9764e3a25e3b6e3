"""A multi-step environment for ``--train.agent_func_path examples/agent_multistep.py``.

The model answers an arithmetic question (the label holds the answer). The environment checks the last
number of each reply; when it is wrong it says so and lets the model try again, up to three attempts.
The reward is 1.0 for a correct first answer, 0.1 less for each retry, and 0.0 when all attempts fail.

Token in, token out: the model's tokens and the feedback's tokens are appended to the episode as they
are; the feedback text below is tokenized once, on its own, and trained on with action_mask 0.
"""

import re

from rlhf_agents import AgentInstanceBase, MultiTurnAgentExecutor

MAX_ATTEMPTS = 3
RETRY_FEEDBACK = "\nuser : that is not correct , please try again .\nassistant : "
DONE_FEEDBACK = "\nuser : correct !"


def last_number(text):
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    return float(numbers[-1]) if numbers else None


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.attempt = 0

    async def reset(self, states, **kwargs):
        self.attempt = 0
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.attempt += 1
        answer = last_number(states["action_text"])
        correct = answer is not None and answer == float(states["label"])
        done = correct or self.attempt >= MAX_ATTEMPTS
        reward = 1.0 - 0.1 * (self.attempt - 1) if correct else 0.0
        return {
            "rewards": reward,
            "scores": 1.0 if correct else 0.0,
            "environment_feedback": DONE_FEEDBACK if correct else ("" if done else RETRY_FEEDBACK),
            "done": done,
            "sampling_params": states.get("sampling_params"),
            "extra_logs": {"attempts": self.attempt},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
