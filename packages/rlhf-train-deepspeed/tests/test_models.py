"""Model-side numerics without DeepSpeed: log-probs, packing, value heads, schedules, config refusals."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_algos.sft import sft_loss
from rlhf_core.batches import make_sequence_batch
from rlhf_core.config import DSConfig, OptimizerFields
from rlhf_core.types import LossAggregation
from rlhf_train_deepspeed.models import (
    load_causal_lm,
    load_value_model,
    response_logprobs,
    response_values,
    sequence_rewards,
)
from rlhf_train_deepspeed.strategy import (
    ConfigError,
    check_features,
    lr_multiplier,
    make_optimizer,
    make_scheduler,
    param_dtype,
)

PROMPTS = [[1, 7, 8], [1, 9], [1, 10, 11, 12, 13]]
RESPONSES = [[14, 15, 16, 2], [17], [18, 19]]


@pytest.fixture(scope="module")
def batch():
    return make_sequence_batch(PROMPTS, RESPONSES, pad_token_id=0, action_masks=[[1, 1, 0, 1], [1], [1, 1]])


@pytest.fixture(scope="module")
def policy(tiny_llama):
    return load_causal_lm(tiny_llama, torch.float32).eval()


def test_logprobs_are_the_tempered_log_softmax_of_each_response_token(policy, batch):
    temperature = 0.7
    lp, ent, mask = response_logprobs(policy, batch, temperature, with_entropy=True)
    assert lp.shape == (3, 4) and mask.tolist()[0] == [True, True, False, True]
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        with torch.no_grad():  # one sequence alone, no padding, by hand
            logits = policy(torch.tensor([p + r])).logits[0].double() / temperature
        logp = torch.log_softmax(logits, -1)
        for t, token in enumerate(r):
            pos = len(p) + t - 1
            if mask[i, t]:
                assert lp[i, t].item() == pytest.approx(logp[pos, token].item(), abs=1e-5)
                h = -(logp[pos].exp() * logp[pos]).sum().item()
                assert ent[i, t].item() == pytest.approx(h, abs=1e-5)
            else:
                assert lp[i, t].item() == 0.0
    assert (lp[1, 1:] == 0).all()  # past the end of a short response


def test_packed_and_padded_logprobs_and_losses_agree(policy, batch):
    padded, ent_pad, mask = response_logprobs(policy, batch, 1.0, packing=False, with_entropy=True)
    packed, ent_pack, mask2 = response_logprobs(policy, batch, 1.0, packing=True, with_entropy=True)
    assert torch.equal(mask, mask2)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_pack, ent_pad, atol=1e-5, rtol=0)
    # the losses and their gradients agree too
    grads = []
    for packing in (False, True):
        policy.zero_grad()
        lp, _, m = response_logprobs(policy, batch, 1.0, packing=packing)
        loss = sft_loss(lp, m, LossAggregation(num_tokens=float(m.sum())))
        loss.backward()
        grads.append((loss.item(), policy.model.layers[0].self_attn.q_proj.weight.grad.clone()))
    assert grads[0][0] == pytest.approx(grads[1][0], abs=1e-5)
    torch.testing.assert_close(grads[0][1], grads[1][1], atol=1e-5, rtol=0)


def test_value_model_packing_and_hf_sequence_classification(tiny_llama, batch, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from rlhf_train_deepspeed.models import sequence_classification_architecture

    vm = load_value_model(tiny_llama, torch.float32).eval()
    assert "score.weight" in dict(vm.named_parameters())
    with torch.no_grad():
        v_pad, mask = response_values(vm, batch)
        v_pack, _ = response_values(vm, batch, packing=True)
        torch.testing.assert_close(v_pack, v_pad, atol=1e-5, rtol=0)
        rewards = sequence_rewards(vm, batch)
        torch.testing.assert_close(sequence_rewards(vm, batch, packing=True), rewards, atol=1e-5, rtol=0)
        # the reward is the value at the last real token, i.e. the last value of each full sequence
        full = vm(batch.input_ids, attention_mask=batch.attention_mask)
        last = batch.attention_mask.sum(-1) - 1
        torch.testing.assert_close(rewards, full[torch.arange(3), last])
    vm.config.architectures = [sequence_classification_architecture(vm.config)]
    vm.config.num_labels = 1
    vm.save_pretrained(tmp_path / "rm")
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    with torch.no_grad():
        hf_rewards = hf(batch.input_ids, attention_mask=batch.attention_mask).logits.squeeze(-1)
    torch.testing.assert_close(hf_rewards, rewards, atol=1e-5, rtol=0)


def test_lr_schedules_match_their_formulas():
    total, warmup, ratio = 100, 10, 0.1
    assert lr_multiplier(0, "cosine_with_min_lr", total, warmup, ratio) == 0.0
    assert lr_multiplier(5, "linear", total, warmup, ratio) == 0.5
    assert lr_multiplier(10, "cosine_with_min_lr", total, warmup, ratio) == pytest.approx(1.0)
    mid = ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * 45 / 90))
    assert lr_multiplier(55, "cosine_with_min_lr", total, warmup, ratio) == pytest.approx(mid)
    assert lr_multiplier(100, "cosine_with_min_lr", total, warmup, ratio) == pytest.approx(ratio)
    assert lr_multiplier(55, "linear", total, warmup, ratio) == pytest.approx(0.5)
    assert lr_multiplier(99, "constant", total, warmup, ratio) == 1.0
    opt = OptimizerFields(lr_scheduler="linear", lr_warmup_ratio=0.0)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = make_scheduler(sgd, opt, total_steps=4)
    lrs = []
    for _ in range(4):
        lrs.append(sched.get_last_lr()[0])
        sgd.step()
        sched.step()
    assert lrs == [2.0, 1.5, 1.0, 0.5]
    with pytest.raises(ConfigError, match="--lr_scheduler must be one of"):
        make_scheduler(sgd, OptimizerFields(lr_scheduler="cosine"), 4)


def test_fp16_and_missing_kernels_are_refused_with_the_flag_named():
    with pytest.raises(ConfigError, match="--ds.param_dtype fp16 is not supported"):
        param_dtype("fp16")
    assert param_dtype("bf16") == torch.bfloat16
    assert param_dtype("auto") == (torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(ConfigError, match="flash_attention_2 needs the flash-attn package"):
            check_features(DSConfig(attn_implementation="flash_attention_2"))
    if importlib.util.find_spec("ring_flash_attn") is None and torch.cuda.is_available():
        # without CUDA ring attention runs an exact CPU path instead (tests/test_ring_attn.py)
        with pytest.raises(ConfigError, match="--ds.ring_attn_size 2 needs the ring-flash-attn"):
            check_features(DSConfig(ring_attn_size=2, packing_samples=True))
    check_features(DSConfig())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (flash-attn varlen path)")
def test_flash_attention_packed_matches_padded_on_gpu(tiny_llama, batch):
    pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    model = load_causal_lm(tiny_llama, torch.bfloat16, "flash_attention_2").cuda().eval()
    ref = load_causal_lm(tiny_llama, torch.bfloat16, "sdpa").cuda().eval()
    b = make_sequence_batch(PROMPTS, RESPONSES, 0)
    b = type(b)(
        *(
            x.cuda() if x is not None else None
            for x in (b.input_ids, b.attention_mask, b.prompt_lens, b.action_mask)
        )
    )
    with torch.no_grad():
        packed = response_logprobs(model, b, packing=True)[0]
        padded = response_logprobs(ref, b, packing=False)[0]
    torch.testing.assert_close(packed, padded, atol=2e-2, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_log_probs_of_a_batch_on_the_gpu_match_the_cpu(tiny_llama, packing):
    """A batch moved to the GPU (as the workers move each micro-batch) gives the CPU's log-probs: the first
    GPU run failed here, building the response mask's positions on the CPU."""
    b = make_sequence_batch(PROMPTS, RESPONSES, 0)
    on_gpu = type(b)(b.input_ids.cuda(), b.attention_mask.cuda(), b.prompt_lens.cuda())
    model = load_causal_lm(tiny_llama, torch.float32).eval()
    with torch.no_grad():
        want, _, want_mask = response_logprobs(model, b, packing=packing)
        got, _, mask = response_logprobs(model.cuda(), on_gpu, packing=packing)
    assert got.is_cuda and torch.equal(mask.cpu(), want_mask)
    # fp32 on both; only the kernels' summation order differs (log-probs ~ -5: a few ulps of 5 is ~1e-6)
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=0)


WIDE_VOCAB = 3000


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def wide_vocab_llama(request):
    """A tiny Llama whose vocabulary dwarfs its hidden size, with and without tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    config = LlamaConfig(
        vocab_size=WIDE_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        tie_word_embeddings=request.param,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_chunked_head_equals_full_logits_in_values_and_gradients(wide_vocab_llama, packing, monkeypatch):
    """response_logprobs runs the LM head 3 rows at a time (so 3 chunks here); against each sequence run
    alone through the model's own full logits and a plain log_softmax (at temperature 0.7): log-probs,
    entropies and the gradients of every parameter (the tied embedding gets both of its uses) of a mix of
    the two, with a masked-out response token in the middle.

    Tolerance: the two sides are the same fp32 function evaluated in different orders (a padded or packed
    batch against one sequence; attention over padding), which moves results by a few ulps of values up to
    ~10, ~1e-6; 1e-5 (and 1e-5 relative on gradients, whose entries reach ~10) leaves room for the
    accumulation over the 13 tokens in each gradient entry."""
    import rlhf_algos.logits

    model = wide_vocab_llama
    monkeypatch.setattr(rlhf_algos.logits, "CHUNK_BYTES", 3 * 4 * WIDE_VOCAB)
    prompts = [[1, 70, 800], [1, 2900], [1, 10, 1100, 12, 2999]]
    responses = [[1400, 15, 1600, 2], [17], [1800, 19]]
    seq = make_sequence_batch(prompts, responses, pad_token_id=0, action_masks=[[1, 1, 0, 1], [1], [1, 1]])
    temperature, gen = 0.7, torch.Generator().manual_seed(6)
    w_lp, w_h = torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)

    model.zero_grad()
    want_lp, want_h, loss = torch.zeros(3, 4), torch.zeros(3, 4), 0.0
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        logp = torch.log_softmax(model(torch.tensor([p + r])).logits[0, len(p) - 1 : -1] / temperature, -1)
        lp = logp.gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        h = -(logp.exp() * logp).sum(-1)
        m = seq.response_mask()[i, : len(r)]
        loss = loss + (lp * w_lp[i, : len(r)] * m).sum() + (h * w_h[i, : len(r)] * m).sum()
        want_lp[i, : len(r)], want_h[i, : len(r)] = (lp * m).detach(), (h * m).detach()
    loss.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    lp, ent, mask = response_logprobs(model, seq, temperature, packing=packing, with_entropy=True)
    ((lp * w_lp).sum() + (ent * w_h).sum()).backward()
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, want_h, atol=1e-5, rtol=0)
    assert lp[0, 2] == ent[0, 2] == 0.0 and mask.sum() == 6
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            param.grad, want_grads[name], atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_chunked_head_keeps_no_logits_for_backward(wide_vocab_llama, monkeypatch):
    """The tensors autograd saves for backward (saved_tensors_hooks) with a vocabulary-sized last dimension,
    parameters aside: with the chunked head only the last chunk's logits (the others are recomputed in
    backward, and the softmax of each in its backward), where materialising the response logits, as the code
    before did, keeps them for every row."""
    import rlhf_algos.logits
    from rlhf_algos.logits import logprobs_and_entropy

    monkeypatch.setattr(rlhf_algos.logits, "CHUNK_BYTES", 3 * 4 * WIDE_VOCAB)
    model = wide_vocab_llama
    seq = make_sequence_batch([[1, 5, 6]] * 4, [[7, 8, 9, 10, 11]] * 4, pad_token_id=0)
    params = {p.data_ptr() for p in model.parameters()}

    def vocab_bytes_saved(fn) -> int:
        total = 0

        def pack(t):
            nonlocal total
            if t.dim() and t.shape[-1] == WIDE_VOCAB and t.data_ptr() not in params:
                total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return total

    chunked = vocab_bytes_saved(lambda: response_logprobs(model, seq, 0.7, with_entropy=True))
    labels = seq.input_ids[:, 3:]
    whole = vocab_bytes_saved(
        lambda: logprobs_and_entropy(model(seq.input_ids).logits[:, 2:-1] / 0.7, labels)
    )
    assert whole == 20 * WIDE_VOCAB * 4
    last = 20 % 3 or 3  # response rows in the last chunk of 3
    assert chunked == last * WIDE_VOCAB * 4


def test_a_tied_heads_gradient_takes_the_embeddings_in_place(monkeypatch):
    """With tied embeddings the head's and the input embedding's gradients meet in one ``[V, H]`` buffer.
    nn.Linear hands the head's over as a transposed view, which autograd does not add to in place, so their sum
    was a third ``[V, H]`` allocation; through ``_TiedHead`` a backward (the second, with ``.grad`` already
    there) allocates two, the head's gradient and the embedding's zero-filled one, and the gradients are
    bitwise those of the nn.Linear head (the same matmul, the same sum in the same order)."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig, LlamaForCausalLM

    import rlhf_train_deepspeed.models as models

    def grads_and_vh_allocations(model) -> tuple[dict, list[str]]:
        seq = make_sequence_batch([[1, 5, 6]] * 4, [[7, 8, 9, 10, 11]] * 4, pad_token_id=0)
        model.zero_grad(set_to_none=True)
        response_logprobs(model, seq, 0.7)[0].sum().backward()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            response_logprobs(model, seq, 0.7)[0].sum().backward()
        vh = WIDE_VOCAB * 32 * 4
        return (
            {n: p.grad.clone() for n, p in model.named_parameters()},
            [e.name for e in prof.events() if e.self_cpu_memory_usage == vh],
        )

    torch.manual_seed(5)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=WIDE_VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            pad_token_id=0,
            tie_word_embeddings=True,
            attn_implementation="sdpa",
        )
    )
    grads, allocations = grads_and_vh_allocations(model)
    assert len(allocations) == 2 and "aten::add" not in allocations, allocations
    monkeypatch.setattr(
        models._TiedHead, "apply", lambda h, weight, into_grad: torch.nn.functional.linear(h, weight)
    )
    linear_grads, linear_allocations = grads_and_vh_allocations(model)
    assert len(linear_allocations) == 3 and "aten::add" in linear_allocations, linear_allocations
    for name, grad in grads.items():
        assert torch.equal(grad, linear_grads[name]), name


def test_a_tied_weight_can_take_both_gradients_straight_into_its_grad():
    """``accumulate_tied_gradient_in_place``: the head and the input embedding add their parts of the tied
    weight's gradient into ``.grad`` themselves. Over two backwards (the first finds no ``.grad``) the gradients
    equal autograd's: every parameter but the tied weight bitwise (the same kernels), the tied weight to fp32
    rounding of the same sums in another order (8 units in the last place of its largest entry), pad-id rows included (nn.Embedding's ``padding_idx`` takes no gradient from the lookup). The second
    backward allocates no ``[V, H]`` (autograd: the head's gradient and the embedding's zero-filled one). A
    model without a tied trained head is left alone."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_train_deepspeed.models import accumulate_tied_gradient_in_place

    def tied_llama(tie: bool = True):
        torch.manual_seed(5)
        return LlamaForCausalLM(
            LlamaConfig(
                vocab_size=WIDE_VOCAB,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                pad_token_id=0,
                tie_word_embeddings=tie,
                attn_implementation="sdpa",
            )
        )

    seq = make_sequence_batch([[1, 0, 5, 6]] * 4, [[7, 8, 0, 10, 11]] * 4, pad_token_id=0)  # pad ids inside

    def two_backwards(model) -> tuple[dict, list[str]]:
        model.zero_grad(set_to_none=True)
        response_logprobs(model, seq, 0.7)[0].sum().backward()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            response_logprobs(model, seq, 0.7, with_entropy=True)[1].sum().backward()
        vh = WIDE_VOCAB * 32 * 4
        return (
            {n: p.grad.clone() for n, p in model.named_parameters()},
            [e.name for e in prof.events() if e.self_cpu_memory_usage == vh],
        )

    want, autograd_allocations = two_backwards(tied_llama())
    assert len(autograd_allocations) == 2, autograd_allocations
    model = tied_llama()
    assert accumulate_tied_gradient_in_place(model)
    got, allocations = two_backwards(model)
    assert allocations == []
    tied = "model.embed_tokens.weight"
    assert float(got[tied][0].abs().sum()) != 0.0  # the pad row: the head's part only
    ulp = torch.finfo(torch.float32).eps * float(want[tied].abs().max())
    torch.testing.assert_close(got[tied], want[tied], atol=8 * ulp, rtol=0)
    for name, grad in want.items():
        if name != tied:
            assert torch.equal(got[name], grad), name
    with torch.no_grad():  # a forward without autograd is the plain lookup
        assert torch.equal(
            model.model.embed_tokens(seq.input_ids), model.model.embed_tokens.weight[seq.input_ids]
        )

    assert not accumulate_tied_gradient_in_place(tied_llama(tie=False))
    frozen = tied_llama()
    frozen.requires_grad_(False)
    assert not accumulate_tied_gradient_in_place(frozen)


def test_the_fused_adamw_steps_like_the_per_tensor_one_and_a_float64_adamw():
    """``make_optimizer``'s AdamW is the fused kernel (no full-size temporaries); after 5 steps its fp32
    parameters are the default per-tensor AdamW's (the optimizer before) and a float64 AdamW written out here
    (decay on matrices only), to fp32 rounding: each step rounds the parameter and its update a few times,
    so 5 steps stay within 5 x 4 units in the last place of the largest |parameter| (0.5: 1.5e-7 each)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 3), torch.nn.LayerNorm(3))
    for p in model.parameters():
        p.data = torch.empty_like(p).uniform_(-0.5, 0.5)
    grads = [[torch.randn_like(p) * 10.0**-k for k, p in enumerate(model.parameters())] for _ in range(5)]
    opt = OptimizerFields()
    opt.adam.lr, opt.adam.weight_decay = 1e-2, 0.1
    (beta1, beta2), eps = opt.adam.betas, opt.adam.eps

    def run(make) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
        optimizer = make(torch.nn.ParameterList(params))
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.clone()
            optimizer.step()
        return [p.detach() for p in params]

    fused = run(lambda m: make_optimizer(m, opt, offload=False))
    per_tensor = run(
        lambda m: torch.optim.AdamW(
            [
                {"params": [p for p in m if p.dim() >= 2], "weight_decay": 0.1},
                {"params": [p for p in m if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=1e-2,
            betas=(beta1, beta2),
            eps=eps,
            foreach=False,
        )
    )
    assert make_optimizer(torch.nn.Linear(2, 2), opt, offload=False).defaults["fused"]
    exact = []
    for k, p in enumerate(model.parameters()):
        x, m, v = (
            p.detach().double(),
            torch.zeros_like(p, dtype=torch.float64),
            torch.zeros_like(p, dtype=torch.float64),
        )
        decay = 0.1 if p.dim() >= 2 else 0.0
        for t, step_grads in enumerate(grads, start=1):
            g = step_grads[k].double()
            x = x * (1 - 1e-2 * decay)
            m, v = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
            x = x - 1e-2 * (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps)
        exact.append(x)
    tol = 5 * 4 * 2.0**-24 * 0.5 * 2  # 5 steps x 4 ulps of |p| <= 1 (0.5 plus 5 updates of at most 1e-2 each)
    for f, d, e, p in zip(fused, per_tensor, exact, model.parameters(), strict=True):
        assert float((f - d).abs().max()) <= tol
        assert float((f.double() - e).abs().max()) <= tol
        assert float((f - p.detach()).abs().max()) > 1e-3  # the steps moved it
