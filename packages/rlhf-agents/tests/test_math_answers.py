"""The math verifier reward files import (rlhf_agents.math_answers): hand-made answers, right and wrong, and
a reward file written the way OpenRLHF's math_reward_func.py is, run through the reward-file loader."""

from __future__ import annotations

import asyncio

import pytest

from rlhf_agents import PythonFileRewardSource, extract_boxed_answer, grade_answer
from rlhf_core.types import RewardRequest


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        ("so \\boxed{\\frac{1}{2}} and finally \\boxed{3}", "3"),  # the last one
        ("\\boxed{\\frac{a}{b}}", "\\frac{a}{b}"),  # nested braces
        ("the result is $\\boxed 7$", "7"),  # brace-less form
        ("\\fbox{4}", "4"),
        ("\\boxed{unclosed", None),
        ("no box at all", None),
    ],
)
def test_extract_boxed_answer(text, boxed):
    assert extract_boxed_answer(text) == boxed


EQUAL = [
    ("\\dfrac{1}{2}", "1/2"),
    ("\\frac12", "0.5"),
    ("$\\frac{1}{2}$", "\\frac{1}{2}"),
    ("0.75", "\\frac{3}{4}"),
    ("-\\frac{3}{4}", "-0.75"),
    ("\\frac{1}{\\frac{1}{2}}", "2"),
    ("3.0", "3"),
    ("x = 5", "5"),
    ("5 cm", "5"),
    ("90^\\circ", "90"),
    ("50\\%", "50"),
    ("\\$12", "12"),
    ("1,000", "1000"),
    ("1,000,000", "10^6"),
    ("\\frac{\\sqrt{2}}{2}", "1/\\sqrt2"),
    ("\\sqrt{8}", "2\\sqrt{2}"),
    ("\\sqrt[3]{8}", "2"),
    ("2x+2", "2(x+1)"),
    ("2\\pi", "\\pi+\\pi"),
    ("10^{2}", "100"),
    ("(1, 2)", "(1,2)"),
    ("2, -3", "-3, 2"),
    ("\\text{(A)}", "(A)"),
    ("\\infty", "\\infty"),
]
DIFFERENT = [
    ("41", "42"),
    ("0.333", "1/3"),
    ("2x", "2"),
    ("5 pi", "5"),
    ("x^2+1", "x^2"),
    ("(1,2)", "[1,2]"),
    ("(2,1)", "(1,2)"),
    ("1,2", "12"),
    ("\\pi", "3.14159"),
    ("", "1"),
    (None, "1"),
    ("1", None),
    # never evaluated as Python, and no huge powers
    ("__import__('os').system('false')", "0"),
    ("2^{1000000}", "0"),
]


@pytest.mark.parametrize(("given", "truth"), EQUAL)
def test_equivalent_forms_are_equal(given, truth):
    assert grade_answer(given, truth) and grade_answer(truth, given)


@pytest.mark.parametrize(("given", "truth"), DIFFERENT)
def test_wrong_answers_are_not(given, truth):
    assert not grade_answer(given, truth)


OPENRLHF_STYLE = '''
"""A math reward file as OpenRLHF writes them, with its one import changed to rlhf_agents."""
import re

import torch

from rlhf_agents import extract_boxed_answer, grade_answer


def tagged_answer(response):
    found = re.findall(r"Answer:\\s*(.+?)(?:\\n|$)", response, re.IGNORECASE)
    return found[-1].strip() if found else None


def reward_func(queries, prompts, labels, **kwargs):
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):] if prompt in query else query
        answer = tagged_answer(response)
        if answer is None:
            answer = extract_boxed_answer(response)
        rewards.append(1.0 if grade_answer(answer, label) else 0.0)
    rewards = torch.tensor(rewards)
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"math_accuracy": rewards.mean()}}
'''


def test_an_openrlhf_style_math_reward_file_runs_with_the_import_changed(tmp_path):
    path = tmp_path / "math_reward_func.py"
    path.write_text(OPENRLHF_STYLE)
    prompts = ["Q1 ", "Q2 ", "Q3 ", "Q4 "]
    responses = ["so \\boxed{\\dfrac{3}{4}}", "Answer: 12 cm\n", "\\boxed{5}", "I give up"]
    source = PythonFileRewardSource(str(path))
    result = asyncio.run(
        source.score(
            RewardRequest(
                queries=[p + r for p, r in zip(prompts, responses)],
                prompts=prompts,
                labels=["0.75", "12", "6", "1"],
            )
        )
    )
    assert result.rewards == [1.0, 1.0, 0.0, 0.0] and result.errors == [None] * 4


def test_code_in_an_answer_is_never_run(tmp_path):
    marker = tmp_path / "ran"
    payload = f"__import__('os').mkdir('{marker}')"  # lower case: it survives normalisation
    assert not grade_answer(payload, "0") and not grade_answer("0", payload)
    assert not marker.exists()
