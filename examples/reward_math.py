"""A math reward function, for ``--reward.remote_url examples/reward_math.py``.

The reward (and score) is 1.0 when the response's final answer equals the label, else 0.0. The final answer
is the last "Answer: ..." line, else the last ``\\boxed{...}``, else the last number of the response;
``rlhf_agents.grade_answer`` decides equality (``3/4``, ``0.75`` and ``\\frac{3}{4}`` are equal; so are
``x = 5`` and ``5``, ``2(x+1)`` and ``2x+2``). ``extra_logs.has_answer`` counts responses that state one.

rlhf calls ``reward_func`` once per batch and passes the keyword arguments it names from ``prompt_ids``,
``response_ids``, ``finish_reasons`` and ``responses``. OpenRLHF's own ``math_reward_func.py`` runs here as
well once its import reads ``from rlhf_agents import extract_boxed_answer, grade_answer``.
"""

import re

import torch

from rlhf_agents import extract_boxed_answer, grade_answer


def extract_answer(response):
    """The final answer of a response as a string, or None when it states none."""
    tagged = re.findall(r"answer\s*(?:is|:)\s*(.+?)\s*(?:\n|$)", response, flags=re.IGNORECASE)
    if tagged:
        return tagged[-1].rstrip(".")
    boxed = extract_boxed_answer(response)
    if boxed is not None:
        return boxed
    numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?", response)
    return numbers[-1] if numbers else None


def reward_func(queries, prompts, labels, responses=None, **kwargs):
    if responses is None:  # called as OpenRLHF does: the query is prompt + response
        responses = [q[len(p) :] if q.startswith(p) else q for q, p in zip(queries, prompts)]
    answers = [extract_answer(r) for r in responses]
    correct = [1.0 if grade_answer(a, label) else 0.0 for a, label in zip(answers, labels)]
    return {
        "rewards": torch.tensor(correct),
        "scores": torch.tensor(correct),
        "extra_logs": {"has_answer": torch.tensor([0.0 if a is None else 1.0 for a in answers])},
    }
