"""Sampling math of the rollout engines, against hand-computed distributions."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.rollout.sampling import (
    check_requests,
    counter_uniform,
    row_keys,
    sample_next,
    sample_seeds,
    top_k_top_p_mask,
)
from rlhf_core.types import GenerationRequest, SamplingParams, derive_seed


def keys_for(n: int, offset: int = 0) -> torch.Tensor:
    return row_keys(torch.tensor([derive_seed(offset, i) for i in range(n)], dtype=torch.long))


def test_counter_uniforms_are_uniform_across_rows_and_steps():
    u_rows = counter_uniform(keys_for(10000), step=3)
    key = keys_for(1)
    u_steps = torch.cat([counter_uniform(key, s) for s in range(10000)])
    for u in (u_rows, u_steps):
        assert u.dtype == torch.float32 and 0 <= float(u.min()) and float(u.max()) < 1
        counts = torch.histc(u, bins=10, min=0, max=1)
        # each bin expects 1000 draws, binomial sd 30: 5 sd bounds
        assert (counts - 1000).abs().max() < 150, counts
    # consecutive steps of one sample are uncorrelated
    corr = torch.corrcoef(torch.stack([u_steps[:-1], u_steps[1:]]))[0, 1]
    assert abs(float(corr)) < 0.05


def test_a_rows_uniform_depends_only_on_its_seed_and_step():
    keys = keys_for(8)
    full = counter_uniform(keys, 5)
    assert torch.equal(counter_uniform(keys[[6, 2]], 5), full[[6, 2]])
    assert not torch.equal(counter_uniform(keys, 6), full)


def empirical(logits: torch.Tensor, rows: int, **kwargs) -> torch.Tensor:
    """Frequencies of the tokens sampled for ``rows`` independent samples of the same distribution."""
    batch = logits.expand(rows, -1).contiguous()
    temperature = torch.full((rows,), kwargs.pop("temperature", 1.0))
    tokens, _ = sample_next(batch, temperature, keys_for(rows, offset=7), step=0, **kwargs)
    return torch.bincount(tokens, minlength=logits.shape[-1]).float() / rows


LOGITS = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -1.0]])


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_sampled_frequencies_follow_the_tempered_softmax(temperature):
    want = torch.softmax(LOGITS[0] / temperature, -1)
    got = empirical(LOGITS, 40000, temperature=temperature)
    assert (got - want).abs().max() < 0.01, (got, want)


def test_top_k_and_top_p_sample_from_the_renormalised_head():
    probs = torch.softmax(LOGITS[0], -1)  # order by probability: 3, 0, 1, 4, 2, 5
    rows = 40000
    got = empirical(LOGITS, rows, top_k=torch.full((rows,), 2), top_p=torch.ones(rows))
    want = torch.zeros(6)
    want[[3, 0]] = probs[[3, 0]] / probs[[3, 0]].sum()
    assert (got - want).abs().max() < 0.01
    # nucleus 0.8: tokens 3 and 0 hold ~0.76 of the mass, so token 1 is needed and token 4 is not
    got = empirical(LOGITS, rows, top_k=torch.full((rows,), 6), top_p=torch.full((rows,), 0.8))
    keep = [3, 0, 1]
    assert sum(float(probs[k]) for k in keep[:2]) < 0.8 <= sum(float(probs[k]) for k in keep)
    want = torch.zeros(6)
    want[keep] = probs[keep] / probs[keep].sum()
    assert (got - want).abs().max() < 0.01


def test_top_k_top_p_mask_by_hand():
    probs = torch.tensor(
        [[0.15, 0.5, 0.05, 0.2, 0.1]]
    )  # sorted: 0.5 (1), 0.2 (3), 0.15 (0), 0.1 (4), 0.05 (2)

    def kept(k, p):
        mask = top_k_top_p_mask(probs, torch.tensor([k]), torch.tensor([p]))
        return sorted(torch.nonzero(mask[0]).squeeze(1).tolist())

    assert kept(5, 1.0) == [0, 1, 2, 3, 4]
    assert kept(1, 1.0) == [1]
    assert kept(5, 0.7) == [1, 3]  # mass above token 0 is exactly 0.7: not < 0.7
    assert kept(5, 0.71) == [0, 1, 3]
    assert kept(5, 0.01) == [1]  # the most likely token always survives
    assert kept(3, 0.8) == [1, 3]  # top-3 mass 0.85; 0.8 of it is 0.68 < 0.7 above token 0
    rows = top_k_top_p_mask(probs.expand(2, -1), torch.tensor([1, 5]), torch.tensor([1.0, 1.0]))
    assert rows[0].sum() == 1 and rows[1].all()  # each row its own filter


def test_logprobs_ignore_filtering_and_suppression_and_greedy_uses_temperature_one():
    logits = torch.tensor([[0.3, 2.0, -1.0, 1.5], [0.1, 0.2, 0.3, 0.4], [5.0, 1.0, 0.0, 0.0]])
    temperature = torch.tensor([0.5, 1.0, 0.0])
    stop_ids = torch.tensor([[1, 1], [2, 3], [0, 3]])  # row 0 has one stop id, repeated
    suppress = torch.tensor([True, False, True])  # rows 0 and 2 may not stop yet
    tokens, logprobs = sample_next(
        logits,
        temperature,
        keys_for(3),
        0,
        top_k=torch.tensor([2, 4, 4]),
        top_p=torch.ones(3),
        stop_ids=stop_ids,
        suppress=suppress,
    )
    assert tokens[0] in (0, 3)  # the top 2 once token 1, the most likely, is suppressed
    assert tokens[2] == 1  # greedy: the argmax once tokens 0 and 3 are suppressed
    for r, t in enumerate((0.5, 1.0, 1.0)):
        want = torch.log_softmax(logits[r] / t, -1)[tokens[r]]
        assert math.isclose(float(logprobs[r]), float(want), abs_tol=1e-6)


def test_suppressed_stop_ids_are_never_sampled_and_others_keep_their_odds():
    rows = 40000
    probs = torch.softmax(LOGITS[0], -1)
    stop_ids = torch.tensor([[3, 0]]).expand(rows, -1)  # the two most likely tokens
    got = empirical(LOGITS, rows, stop_ids=stop_ids, suppress=torch.ones(rows, dtype=torch.bool))
    want = probs.clone()
    want[[3, 0]] = 0
    assert (got - want / want.sum()).abs().max() < 0.01
    free = empirical(LOGITS, rows, stop_ids=stop_ids, suppress=torch.zeros(rows, dtype=torch.bool))
    assert (free - probs).abs().max() < 0.01


def test_sample_seeds():
    params = SamplingParams(n=3, seed=42)
    assert sample_seeds(params) == [derive_seed(42, i) for i in range(3)]
    unseeded = SamplingParams(n=2)
    assert sample_seeds(unseeded) != sample_seeds(unseeded)


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(n=0), "n must be"),
        (SamplingParams(temperature=-1), "temperature"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_k=-2), "top_k"),
        (SamplingParams(max_new_tokens=0), "max_new_tokens"),
        (SamplingParams(max_new_tokens=4, min_new_tokens=5), "min_new_tokens"),
        (SamplingParams(stop_token_ids=(99,)), "stop_token_ids has 99"),
    ],
)
def test_check_requests_names_the_field(params, message):
    good = GenerationRequest([1, 2], SamplingParams())
    with pytest.raises(ValueError, match=f"generation request 1: .*{message}"):
        check_requests([good, GenerationRequest([1, 2], params)], vocab_size=50)


def test_check_requests_refuses_bad_prompts():
    with pytest.raises(ValueError, match="request 0: prompt token id -1"):
        check_requests([GenerationRequest([3, -1], SamplingParams())], vocab_size=50)
    with pytest.raises(TypeError, match="GenerationRequest"):
        check_requests([[1, 2, 3]])
