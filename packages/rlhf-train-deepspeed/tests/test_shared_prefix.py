"""Shared-prompt forward (``--ds.shared_prefix``): the same log-probs, entropies and gradients as the padded
batch, on each model family it is switched on for; plain SDPA everywhere else."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from rlhf_core.batches import make_sequence_batch
from rlhf_core.testing.tiny import tiny_decoder
from rlhf_train_deepspeed import shared_prefix
from rlhf_train_deepspeed.models import load_causal_lm, response_logprobs
from rlhf_train_deepspeed.worker import causal_attn


def ds(**kw):
    base = dict(shared_prefix=True, attn_implementation="sdpa", packing_samples=False, ring_attn_size=1)
    return SimpleNamespace(**{**base, **kw})


def grouped_batch(seed: int = 0):
    """Three prompts of different lengths with 4, 3 and 1 samples of different response lengths, rows
    interleaved, and an action mask with holes (environment tokens of a multi-turn sample)."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(3, 96, (n,), generator=g).tolist()

    rows = []
    for p, lens in ((ids(12), [4, 7, 2, 5]), (ids(15), [6, 6, 3]), (ids(9), [5])):
        rows += [(p, ids(n)) for n in lens]
    rows = [rows[i] for i in (3, 0, 5, 1, 7, 4, 2, 6)]
    masks = [[1] * len(r) for _, r in rows]
    masks[1][2:4] = [0, 0]
    return make_sequence_batch([p for p, _ in rows], [r for _, r in rows], 0, masks)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_log_probs_entropies_and_gradients_equal_the_padded_batch(kind):
    plain = tiny_decoder(kind).train()
    shared = copy.deepcopy(plain)
    shared.set_attn_implementation(shared_prefix.attn_implementation(shared.config, ds()))
    assert shared_prefix.enabled(shared) and not shared_prefix.enabled(plain)
    batch = grouped_batch()
    layout = shared_prefix.plan(batch.input_ids, batch.attention_mask, batch.prompt_lens)
    # the 3 prompts once (12 + 15 + 9) and each response less its last token (30): 66 tokens, not 8 x 21
    assert layout.input_ids.shape == (1, 36 + 30)

    if kind == "llama":  # LoRA adapters: PEFT's wrapper must not hide the attention implementation
        from rlhf_core.config import LoraConfig
        from rlhf_train_deepspeed.strategy import apply_lora

        lora = LoraConfig(rank=4, alpha=8)
        torch.manual_seed(2)
        plain = apply_lora(plain, lora, "CAUSAL_LM")
        torch.manual_seed(2)
        shared = apply_lora(shared, lora, "CAUSAL_LM")
        assert shared_prefix.enabled(shared)
    outs = [response_logprobs(m, batch, 0.7, with_entropy=True) for m in (plain, shared)]
    (lp_a, ent_a, mask_a), (lp_b, ent_b, mask_b) = outs
    assert torch.equal(mask_a, mask_b) and int(mask_a.sum()) == 38 - 2
    torch.testing.assert_close(lp_b, lp_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_b, ent_a, atol=1e-5, rtol=0)
    w = torch.randn(lp_a.shape, generator=torch.Generator().manual_seed(1))
    for lp, ent in ((lp_a, ent_a), (lp_b, ent_b)):
        ((lp * w).sum() + 0.1 * ent.sum()).backward()
    trained = [
        (n, a, b)
        for (n, a), b in zip(plain.named_parameters(), shared.parameters(), strict=True)
        if a.requires_grad
    ]
    assert trained
    for name, a, b in trained:
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_without_a_layout_the_model_computes_plain_sdpa(tiny_llama):
    """A model loaded for sharing serves every other forward (padded rows, reference passes, generation
    masks) exactly as SDPA does."""
    plain = load_causal_lm(tiny_llama, torch.float32, "sdpa")
    shared = load_causal_lm(tiny_llama, torch.float32, causal_attn(tiny_llama, ds(), "sdpa"))
    assert shared.config._attn_implementation == shared_prefix.ATTN
    batch = make_sequence_batch([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14, 15]], 0)
    # nothing shared: the batch runs padded, as it always has
    assert shared_prefix.plan(batch.input_ids, batch.attention_mask, batch.prompt_lens) is None
    kwargs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    assert torch.equal(shared(**kwargs).logits, plain(**kwargs).logits)


def test_the_layout_packs_each_prompt_once_and_each_response_less_its_last_token():
    # rows 0 and 2 share a prompt; row 2's one-token response is predicted by the prompt alone
    b = make_sequence_batch([[5, 6, 7], [8, 9], [5, 6, 7]], [[10, 11], [13, 14, 15], [12]], 0)
    layout = shared_prefix.plan(b.input_ids, b.attention_mask, b.prompt_lens)
    assert layout.input_ids.tolist() == [[5, 6, 7, 10, 8, 9, 13, 14]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert layout.groups == [(0, 3, [(3, 1), (4, 0)]), (4, 2, [(6, 2)])]
    assert layout.columns.tolist() == [2, 3, 5, 6, 7]
    # token t of row i is predicted by column columns[logit_rows[i, t]]: 7 -> 10 -> 11, 9 -> 13 -> 14 -> 15
    assert layout.logit_rows.tolist() == [[0, 1, 0], [2, 3, 4], [0, 0, 0]]


def test_which_models_and_settings_get_it():
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

    llama = LlamaConfig()
    assert shared_prefix.attn_implementation(llama, ds()) == shared_prefix.ATTN
    assert shared_prefix.attn_implementation(llama, ds(shared_prefix=False)) == "sdpa"
    assert shared_prefix.attn_implementation(llama, ds(packing_samples=True)) == "sdpa"
    assert shared_prefix.attn_implementation(llama, ds(ring_attn_size=2)) == "sdpa"
    assert shared_prefix.attn_implementation(llama, ds(attn_implementation="eager")) == "eager"
    assert not shared_prefix.supported(MistralConfig(sliding_window=4096))
    assert shared_prefix.supported(Qwen2Config(sliding_window=4096, use_sliding_window=False))
    assert not shared_prefix.supported(Gemma2Config())  # soft-capping, sliding layers


@pytest.mark.parametrize("lengths", [[1, 1, 1, 1], [2, 1, 2, 1]])
def test_one_and_two_token_responses(lengths):
    """The shortest responses: a 1-token response is predicted by the prompt alone (it adds no token to the
    row), a 2-token one by the prompt and its first token."""
    plain = tiny_decoder("llama")
    shared = copy.deepcopy(plain)
    shared.set_attn_implementation(shared_prefix.attn_implementation(shared.config, ds()))
    prompt = list(range(10, 17))
    batch = make_sequence_batch([prompt] * 4, [[20 + i] * n for i, n in enumerate(lengths)], 0)
    layout = shared_prefix.plan(batch.input_ids, batch.attention_mask, batch.prompt_lens)
    assert layout.input_ids.shape[1] == 7 + sum(n - 1 for n in lengths)
    lp_a, _, mask = response_logprobs(plain, batch, 1.0)
    lp_b, _, _ = response_logprobs(shared, batch, 1.0)
    assert int(mask.sum()) == sum(lengths)
    torch.testing.assert_close(lp_b, lp_a, atol=1e-5, rtol=0)


def long_tail_batch(shared: bool):
    """A long tail: most responses short, one at the limit; 2 prompts x 4 samples, or 7 prompts of which only
    the last has two samples (the others are packed all the same)."""
    g = torch.Generator().manual_seed(3)

    def ids(n):
        return torch.randint(3, 60, (n,), generator=g).tolist()

    lengths = [3, 40, 1, 5, 2, 7, 4, 2]
    prompts = [ids(6)] * 4 + [ids(11)] * 4 if shared else [ids(6 + i % 5) for i in range(7)]
    if not shared:
        prompts.append(prompts[-1])
    return make_sequence_batch(prompts, [ids(n) for n in lengths], 0)


@pytest.mark.parametrize("shared", [True, False])
def test_a_long_tail_costs_its_tokens_and_gives_the_padded_batch_gradients(shared):
    """Ragged rows, with prompts shared or (but for one pair) not: the packed row holds the real tokens
    only (the padded batch holds 8 x the longest row), and the weighted log-prob and entropy loss and every
    gradient equal the padded batch's."""
    plain = tiny_decoder("mistral").train()
    packed = copy.deepcopy(plain)
    packed.set_attn_implementation(shared_prefix.attn_implementation(packed.config, ds()))
    batch = long_tail_batch(shared)
    layout = shared_prefix.plan(batch.input_ids, batch.attention_mask, batch.prompt_lens)
    prompts = 6 + 11 if shared else int(batch.prompt_lens[:7].sum())
    assert layout.input_ids.shape[1] == prompts + sum(n - 1 for n in [3, 40, 1, 5, 2, 7, 4, 2])
    losses = []
    w = torch.randn(8, 40, generator=torch.Generator().manual_seed(1))
    for model in (plain, packed):
        lp, ent, mask = response_logprobs(model, batch, 1.0, with_entropy=True)
        losses.append(((lp * w).sum() + 0.1 * (ent * mask).sum()) / mask.sum())
        losses[-1].backward()
    torch.testing.assert_close(losses[1], losses[0], atol=1e-6, rtol=0)
    for (name, a), b in zip(plain.named_parameters(), packed.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_the_critic_runs_the_layout_with_the_padded_batch_values_and_gradients(tiny_llama):
    from rlhf_train_deepspeed.models import load_value_model, response_values

    plain = load_value_model(tiny_llama, torch.float32, "sdpa").train()
    packed = load_value_model(tiny_llama, torch.float32, causal_attn(tiny_llama, ds(), "sdpa")).train()
    packed.load_state_dict(plain.state_dict())
    assert shared_prefix.enabled(packed)
    batch = long_tail_batch(True)
    outs = [response_values(m, batch) for m in (plain, packed)]
    (va, mask_a), (vb, mask_b) = outs
    assert torch.equal(mask_a, mask_b)
    torch.testing.assert_close(vb, va, atol=1e-5, rtol=0)
    for v in (va, vb):
        (v * v).sum().backward()
    for (name, a), b in zip(plain.named_parameters(), packed.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)
