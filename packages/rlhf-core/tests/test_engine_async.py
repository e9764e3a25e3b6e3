"""AsyncEngine: concurrent agent episodes share batched generate calls and sample what they would alone."""

from __future__ import annotations

import asyncio

import pytest

from rlhf_core.rollout.async_engine import AsyncEngine
from rlhf_core.rollout.hf_engine import HFEngine
from rlhf_core.testing.tiny import make_tiny_llama
from rlhf_core.types import GenerationRequest, SamplingParams


class CountingEngine:
    """The real HF engine, recording the size of every batch it is given."""

    def __init__(self, engine):
        self.engine = engine
        self.batches: list[int] = []

    def generate(self, requests):
        self.batches.append(len(requests))
        return self.engine.generate(requests)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return HFEngine(make_tiny_llama(tmp_path_factory.mktemp("async"), seed=2), device="cpu")


def turn_request(episode: int, turn: int, history: list[int]) -> GenerationRequest:
    return GenerationRequest(
        history, SamplingParams(n=1, max_new_tokens=4, ignore_eos=True, seed=100 * episode + turn)
    )


async def episode(llm, index: int, turns: int = 3) -> list[list[int]]:
    """A multi-turn episode: generate, append the answer and some 'environment feedback', repeat."""
    history, answers = [10 + index], []
    for turn in range(turns):
        (out,) = await llm.generate(turn_request(index, turn, history))
        answers.append(out.token_ids)
        history = history + out.token_ids + [5, 6]
        await asyncio.sleep(0.001 * (index % 3))  # environments take different times
    return answers


def test_concurrent_episodes_are_batched_and_sample_as_alone(engine):
    counting = CountingEngine(engine)
    llm = AsyncEngine(counting)

    async def main():
        return await asyncio.gather(*(episode(llm, i) for i in range(12)))

    results = asyncio.run(main())
    assert sum(counting.batches) == 12 * 3
    assert counting.batches[0] == 12  # every episode's first turn went in one call
    assert len(counting.batches) < 12 * 3 and llm.calls == len(counting.batches)
    # replay each episode alone, one call per turn: the same tokens
    for i, answers in enumerate(results):
        history = [10 + i]
        for turn, answer in enumerate(answers):
            (alone,) = engine.generate([turn_request(i, turn, history)])[0]
            assert alone.token_ids == answer
            history = history + answer + [5, 6]


def test_engine_errors_reach_every_waiter_and_the_front_keeps_working(engine):
    llm = AsyncEngine(engine)

    async def main():
        bad = GenerationRequest([], SamplingParams(max_new_tokens=2))
        good = GenerationRequest([3], SamplingParams(max_new_tokens=2, seed=1))
        first = await asyncio.gather(llm.generate(good), llm.generate(bad), return_exceptions=True)
        second = await llm.generate(good)
        return first, second

    (a, b), second = asyncio.run(main())
    assert isinstance(a, ValueError) and isinstance(b, ValueError) and "empty" in str(b)
    assert len(second) == 1 and len(second[0].token_ids) <= 2


def test_max_batch_requests_caps_each_call(engine):
    counting = CountingEngine(engine)
    llm = AsyncEngine(counting, max_batch_requests=4)

    async def main():
        reqs = [GenerationRequest([7 + i], SamplingParams(max_new_tokens=2, seed=i)) for i in range(10)]
        return await asyncio.gather(*(llm.generate(r) for r in reqs))

    assert len(asyncio.run(main())) == 10
    assert counting.batches == [4, 4, 2]
