"""Token-budget micro-batches (dynamic batching): the grouping function's properties and hand-worked cases,
and one policy step on 2 Ray/DeepSpeed ranks that must not depend on how its rows are grouped."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_core.batches import (
    PolicyMicroBatch,
    PolicyStepConfig,
    make_sequence_batch,
    token_budget_micro_batches,
)
from rlhf_core.config import DSConfig, ModelConfig
from rlhf_core.handles import wait
from rlhf_train_deepspeed.testing import train_step
from rlhf_train_deepspeed.worker import ModelSpec


def cost(lengths: list[int], rows: list[int], packed: bool) -> int:
    return sum(lengths[i] for i in rows) if packed else len(rows) * max(lengths[i] for i in rows)


# --- the grouping function ------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 4).flatmap(
        lambda r: st.tuples(
            st.just(r),
            st.lists(st.integers(1, 60), min_size=r, max_size=48).map(lambda x: x[: len(x) // r * r]),
        )
    ),
    st.integers(1, 120),
    st.booleans(),
)
def test_rows_once_within_budget_same_count_per_rank(ranks_and_lengths, max_tokens, packed):
    ranks, lengths = ranks_and_lengths  # len(lengths) is a multiple of ranks, as in a training step
    mbs = token_budget_micro_batches(lengths, ranks, max_tokens, packed)
    assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))
    for mb in mbs:
        assert mb and mb == sorted(mb)
        assert (
            cost(lengths, mb, packed) <= max_tokens or len(mb) == 1
        )  # only a lone row may exceed the budget
    assert len(mbs) % ranks == 0
    per = len(mbs) // ranks
    for r in range(ranks):  # rank-major: rank r's share is contiguous and holds B / R rows
        assert sum(len(mb) for mb in mbs[r * per : (r + 1) * per]) == len(lengths) // ranks


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 60), max_size=30), st.integers(1, 5), st.integers(1, 120), st.booleans())
def test_any_row_count_keeps_every_row_within_budget(lengths, ranks, max_tokens, packed):
    # forward-only passes take whatever the rollout produced, not necessarily a multiple of the ranks
    mbs = token_budget_micro_batches(lengths, ranks, max_tokens, packed)
    assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))
    assert all(cost(lengths, mb, packed) <= max_tokens or len(mb) == 1 for mb in mbs)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 4).flatmap(
        lambda r: st.tuples(
            st.just(r),
            st.lists(st.tuples(st.integers(1, 60), st.integers(0, 5)), min_size=r, max_size=48).map(
                lambda x: x[: len(x) // r * r]
            ),
        )
    ),
    st.integers(1, 120),
    st.booleans(),
)
def test_prompt_units_keep_every_guarantee(ranks_and_rows, max_tokens, packed):
    ranks, rows = ranks_and_rows
    lengths, keys = [n for n, _ in rows], [k for _, k in rows]
    mbs = token_budget_micro_batches(lengths, ranks, max_tokens, packed, prompts=keys)
    assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))
    assert all(cost(lengths, mb, packed) <= max_tokens or len(mb) == 1 for mb in mbs)
    assert len(mbs) % ranks == 0
    per = len(mbs) // ranks
    for r in range(ranks):
        assert sum(len(mb) for mb in mbs[r * per : (r + 1) * per]) == len(lengths) // ranks


def test_rows_of_one_prompt_share_micro_batches():
    # 4 prompts x 4 samples, interleaved, all 10 tokens; 2 ranks, 40 tokens per micro-batch
    lengths, keys = [10] * 16, [i % 4 for i in range(16)]
    assert token_budget_micro_batches(lengths, 2, 40, packed=False, prompts=keys) == [
        [0, 4, 8, 12],
        [2, 6, 10, 14],
        [1, 5, 9, 13],
        [3, 7, 11, 15],
    ]
    # without keys the rows are dealt to the ranks in turn, so each micro-batch mixes two prompts
    assert token_budget_micro_batches(lengths, 2, 40, packed=False) == [
        [0, 2, 4, 6],
        [8, 10, 12, 14],
        [1, 3, 5, 7],
        [9, 11, 13, 15],
    ]
    # a prompt with more samples than a rank holds is dealt row by row, longest first, to the rank with the
    # fewest tokens: 9 -> r0, 8 -> r1, 7 -> r1, 6 -> r0, 5 -> r0 (15 vs 15), 4 -> r1
    lengths = [5, 9, 7, 8, 6, 4]
    assert token_budget_micro_batches(lengths, 2, 100, packed=False, prompts=["p"] * 6) == [
        [0, 1, 4],
        [2, 3, 5],
    ]


def test_packed_and_padded_costs_group_differently():
    # packed: 8+2 fits 10; padded: a 2-token row next to the 8-token one costs 2 x 8 = 16
    assert token_budget_micro_batches([8, 2, 2, 2], 1, 10, packed=True) == [[0, 1], [2, 3]]
    assert token_budget_micro_batches([8, 2, 2, 2], 1, 10, packed=False) == [[0], [1, 2, 3]]


def test_an_oversize_row_goes_alone_and_whole():
    assert token_budget_micro_batches([3, 50, 3], 1, 10, packed=False) == [[1], [0, 2]]
    assert token_budget_micro_batches([50], 1, 10, packed=True) == [[0]]


def test_rows_are_dealt_by_tokens_and_short_ranks_split():
    # deal (longest first, to the lighter rank with room): rank 0 gets 10 and 1, rank 1 gets 5 and 5.
    # rank 0 needs two micro-batches (10 + 1 > 10); rank 1 fits in one and splits it to match.
    assert token_budget_micro_batches([10, 5, 5, 1], 2, 10, packed=True) == [[0], [3], [1], [2]]
    # balancing tokens, not contiguous halves: each rank gets one long and one short row
    mbs = token_budget_micro_batches([100, 100, 1, 1], 2, 1000, packed=True)
    assert mbs == [[0, 2], [1, 3]]


def test_bad_budgets_are_refused():
    with pytest.raises(ValueError, match="max_tokens"):
        token_budget_micro_batches([3, 4], 1, 0, packed=True)
    with pytest.raises(ValueError, match="num_ranks"):
        token_budget_micro_batches([3, 4], 0, 10, packed=True)
    assert token_budget_micro_batches([], 2, 10, packed=False) == []


# --- one policy step on 2 ranks: grouping must not change the update -----------------------------------

# (prompt, response) lengths: totals 4 12 3 10 3 11 4 3, responses 1 to 9 tokens
SHAPES = [(2, 2), (3, 9), (2, 1), (4, 6), (1, 2), (2, 9), (3, 1), (1, 2)]


def rows(seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(7, 60, (p,), generator=g).tolist() for p, _ in SHAPES]
    responses = [torch.randint(7, 60, (r,), generator=g).tolist() for _, r in SHAPES]
    return prompts, responses


def spec(path: str) -> ModelSpec:
    opt = ModelConfig(lr_scheduler="constant", lr_warmup_ratio=0.0, max_norm=0.5)
    # Adam's first step moves a weight by lr * g / (|g| + eps): with the default eps (1e-8) a gradient entry
    # of ~1e-9, summation-order noise that depends on the grouping, could move it by up to lr
    opt.adam.lr, opt.adam.eps = 1e-2, 1e-3
    return ModelSpec(
        path=path, kind="causal", trainable=True, optim=opt, micro_batch_size=2, grad_accum=2, total_steps=10
    )


@pytest.fixture(scope="module")
def group(reused_groups, tiny_llama):
    return reused_groups[2]("actor", spec(tiny_llama), DSConfig(zero_stage=3, param_dtype="fp32"), 2, 42)


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
@pytest.mark.parametrize(
    "stage,packed,agg",
    [(3, False, "token_mean"), (2, True, "seq_mean_token_mean")],
    ids=["zero3-padded-token-mean", "zero2-packed-seq-mean"],
)
def test_token_budget_step_equals_fixed_micro_batches(group, tiny_llama, stage, packed, agg):
    prompts, responses = rows()
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    assert len({len(r) for r in responses}) > 3  # rows of different response lengths

    def batch(cut: list[int]):
        return make_sequence_batch([prompts[i] for i in cut], [responses[i] for i in cut], pad_token_id=0)

    fixed = [[0, 1], [2, 3], [4, 5], [6, 7]]  # micro_batch_size 2: two micro-batches per rank
    budget = token_budget_micro_batches(lengths, 2, 12, packed)
    assert sorted(len(c) for c in budget) != [2, 2, 2, 2] and len({len(c) for c in budget}) > 1
    assert budget != fixed

    ds = DSConfig(zero_stage=stage, param_dtype="fp32", packing_samples=packed)
    group.init_model(spec(tiny_llama), ds)
    before = wait(group.weights())
    # per-row [8, 9] old log-probs (the model's, moved so that ratios leave the clip range) and advantages
    lp = torch.cat(
        [
            torch.nn.functional.pad(x, (0, 9 - x.shape[1]))
            for x in wait(group.forward([batch(c) for c in fixed]))
        ]
    )
    g = torch.Generator().manual_seed(1)
    old = lp + 0.3 * torch.randn(lp.shape, generator=g)
    adv = torch.randn(lp.shape, generator=g)

    def micro_batches(cuts):
        out = []
        for c in cuts:
            seq = batch(c)
            t = seq.num_response_positions
            out.append(PolicyMicroBatch(seq, old[c, :t].contiguous(), adv[c, :t].contiguous()))
        return out

    pcfg = PolicyStepConfig(loss="ppo", agg_mode=agg)
    want = train_step(group, micro_batches(fixed), "policy", pcfg)
    want_weights = wait(group.weights())
    group.init_model(spec(tiny_llama), ds)
    got = train_step(group, micro_batches(budget), "policy", pcfg)
    got_weights = wait(group.weights())

    assert want["skipped"] == got["skipped"] == 0.0
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], abs=1e-5)
    assert any(not torch.allclose(want_weights[k], before[k], atol=1e-4) for k in before)  # the step moved
    for name, w in got_weights.items():
        torch.testing.assert_close(w, want_weights[name], atol=1e-5, rtol=0, msg=name)
