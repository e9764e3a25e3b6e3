"""A math reward function with a verifier, for ``--reward.remote_url examples/reward_math.py``.

The reward is 1.0 when the response's final answer equals the label as a number (``3/4``, ``0.75`` and
``$0.75`` are equal), else 0.0. The final answer is, in order of preference: the content of the last
``\\boxed{...}``, the number after the last "answer is" / "answer :", or the last number in the response.

rlhf calls ``reward_func`` once per batch of samples, and passes the keyword arguments it names from
``prompt_ids``, ``response_ids``, ``finish_reasons`` and ``responses`` (all of them to ``**kwargs``).
The same file works with OpenRLHF, which passes neither (the response is then cut out of the query).
"""

import re
from fractions import Fraction

import torch

NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?"


def parse_number(text):
    """``Fraction`` for "12", "-3.5", "1,000", "$4", "3/4" (spaces allowed around "/"); None otherwise."""
    text = str(text).strip().replace("$", "").replace(",", "").replace(" ", "")
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(response):
    """The final answer of a response as a string, or None when it states none."""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", response)
    if boxed:
        return boxed[-1]
    stated = re.findall(r"answer\s*(?:is|:|=)\s*(" + NUMBER + ")", response, flags=re.IGNORECASE)
    if stated:
        return stated[-1]
    numbers = re.findall(NUMBER, response)
    return numbers[-1] if numbers else None


def verify(response, label):
    """Whether the response's final answer equals ``label`` numerically (or as text, for non-numbers)."""
    answer = extract_answer(response)
    if answer is None:
        return False
    want, got = parse_number(label), parse_number(answer)
    if want is not None and got is not None:
        return want == got
    return answer.strip().lower() == str(label).strip().lower()


def reward_func(queries, prompts, labels, responses=None, **kwargs):
    if responses is None:  # OpenRLHF: the query is prompt + response
        responses = [q[len(p):] if q.startswith(p) else q for q, p in zip(queries, prompts)]
    correct = [1.0 if verify(r, label) else 0.0 for r, label in zip(responses, labels)]
    has_answer = [0.0 if extract_answer(r) is None else 1.0 for r in responses]
    return {
        "rewards": torch.tensor(correct),
        "scores": torch.tensor(correct),
        "extra_logs": {"has_answer": torch.tensor(has_answer)},
    }
