"""Issue 51: an RL step's micro-batches follow its tokens. Row-count micro-batches stay as they were while they
fit ``--train.max_tokens_per_gpu``; a step with one that does not is cut by the budget, counted as the packed
shared-prompt layout runs it (a prompt once for its rows, no padding). No model: the cuts are plain Python."""

from types import SimpleNamespace

import torch

from rlhf_cli.rl.experience import Experience, micro_batch_cuts


def experience(response_lens: list[int], prompt_len: int = 16, n: int = 8) -> Experience:
    """Rows of prompts ``n`` samples each (prompt ``g`` is ``prompt_len`` copies of token ``g + 1``)."""
    b = len(response_lens)
    seqs = [[i // n + 1] * prompt_len + [50] * r for i, r in enumerate(response_lens)]
    zeros = torch.zeros(b, max(response_lens))
    return Experience(
        seqs,
        [prompt_len] * b,
        zeros.bool(),
        zeros,
        torch.zeros(b),
        torch.ones(b, dtype=torch.bool),
        zeros[:, 0],
    )


def cfg(shared: bool = True):
    return SimpleNamespace(ds=SimpleNamespace(shared_prefix=shared, packing_samples=False))


GROUP = SimpleNamespace(dp_size=2, ring_size=1)


def test_short_steps_keep_their_row_count_micro_batches():
    exp = experience([20, 30, 5, 8] * 8)  # 4 prompts x 8; 16 rows hold 2 x 16 + 252 = 284 tokens shared
    assert micro_batch_cuts(exp, GROUP, 16, 284, cfg()) == [slice(0, 16), slice(16, 32)]
    assert micro_batch_cuts(exp, GROUP, 16, None, cfg()) == [slice(0, 16), slice(16, 32)]
    # padded, the same 16 rows count 16 x 46 = 736 tokens
    assert micro_batch_cuts(exp, GROUP, 16, 736, cfg(shared=False)) == [slice(0, 16), slice(16, 32)]
    assert micro_batch_cuts(exp, GROUP, 16, 735, cfg(shared=False)) != [slice(0, 16), slice(16, 32)]


def test_a_long_tail_step_is_cut_by_tokens_with_each_prompt_once():
    lens = [20, 300, 5, 8, 12, 30, 6, 9] * 4  # one reply per prompt runs to 300 tokens
    exp = experience(lens)
    cuts = micro_batch_cuts(exp, GROUP, 16, 406, cfg())
    assert all(isinstance(c, list) for c in cuts) and len(cuts) % 2 == 0  # the same count on both ranks
    assert sorted(i for c in cuts for i in c) == list(range(32))
    for c in cuts:
        prompts = {i // 8 for i in c}
        assert 16 * len(prompts) + sum(lens[i] for i in c) <= 406  # what the packed layout runs
        assert len(prompts) == 1 or all(sum(1 for i in c if i // 8 == g) == 8 for g in prompts)
    # each prompt's 8 rows (406 tokens with its prompt) fit the budget whole: one micro-batch each
    assert sorted(sorted(c) for c in cuts) == [list(range(g * 8, g * 8 + 8)) for g in range(4)]


def test_the_engine_drops_finished_rows_and_decodes_the_rest_as_alone(tiny_model):
    """A long tail in the HF engine: 9 of 12 rows stop after 2 tokens, so the batch is compacted to the 3
    long ones (their filled cache positions copied, GrowingKVLayer); those decode the same tokens and
    log-probs as when they run alone."""
    from rlhf_core.rollout.hf_engine import HFEngine
    from rlhf_core.types import GenerationRequest, SamplingParams

    engine = HFEngine(tiny_model, device="cpu")
    requests = [
        GenerationRequest([20 + i] * (2 + i), SamplingParams(n=3, max_new_tokens=24 if i == 3 else 2, seed=i))
        for i in range(4)
    ]
    together = engine.generate(requests)
    alone = engine.generate([requests[3]])[0]
    assert [len(o.token_ids) for o in together[3]] == [24] * 3
    assert [o.token_ids for o in together[3]] == [o.token_ids for o in alone]
    torch.testing.assert_close(
        torch.tensor([o.logprobs for o in together[3]]),
        torch.tensor([o.logprobs for o in alone]),
        atol=1e-5,
        rtol=0,
    )
