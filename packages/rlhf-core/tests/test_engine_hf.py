"""The HF engine passes the rollout-engine conformance suite: in process (fast path and generic path)
and as a Ray actor; its log-probs equal a trainer-style batched recomputation."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlhf_core.config import RLConfig
from rlhf_core.plugins import get_plugin_manager, resolve
from rlhf_core.rollout.async_engine import AsyncEngine
from rlhf_core.rollout.decode import decode_plan
from rlhf_core.rollout.hf_engine import HFEngine
from rlhf_core.testing import RolloutEngineConformance
from rlhf_core.testing.tiny import make_tiny_llama, tiny_decoder
from rlhf_core.types import GenerationRequest, SamplingParams


class TestHFEngine(RolloutEngineConformance):
    def make_engine(self, model_dir):
        # packed although the model is below PACK_MIN_HIDDEN: the suite's weight updates check the copies
        engine = HFEngine(model_dir, dtype="float32", device="cpu", pack_weights=True)
        assert engine.fast_path and engine.pack_weights
        return engine


class TestHFEngineGenericPath(RolloutEngineConformance):
    """The path other architectures take: transformers' DynamicCache and its own masks."""

    def make_engine(self, model_dir):
        engine = HFEngine(model_dir, dtype="float32", device="cpu")
        engine.fast_path = False
        return engine


class RayEngine:
    """Calls an engine actor like a local engine (what a controller does with ray.get)."""

    def __init__(self, handle):
        self.handle = handle

    def __getattr__(self, name):
        import ray

        method = getattr(self.handle, name)
        return lambda *args, **kwargs: ray.get(method.remote(*args, **kwargs))


@pytest.fixture(scope="module")
def ray_session():
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.xdist_group("hf_engine_ray")
class TestHFEngineRayActor(RolloutEngineConformance):
    @pytest.fixture(scope="class", autouse=True)
    def _ray(self, ray_session):
        return ray_session

    def make_engine(self, model_dir):
        import ray

        handle = ray.remote(num_cpus=1)(HFEngine).remote(
            model_dir, dtype="float32", device="cpu", num_threads=1
        )
        return RayEngine(handle)

    def close_engine(self, engine):
        import ray

        ray.kill(engine.handle)

    def test_engines_side_by_side(self, model_dir, engine):
        """A second actor on the same weights samples the same tokens for the same seeds."""
        other = self.make_engine(model_dir)
        try:
            req = GenerationRequest([3, 4, 5], SamplingParams(n=2, max_new_tokens=6, seed=9, ignore_eos=True))
            assert [o.token_ids for o in other.generate([req])[0]] == [
                o.token_ids for o in engine.generate([req])[0]
            ]
        finally:
            self.close_engine(other)

    def test_async_front_over_the_actor(self, engine):
        """AsyncEngine awaits the actor handle's generate.remote, batching concurrent requests."""
        llm = AsyncEngine(engine.handle)
        requests = [GenerationRequest([3 + i], SamplingParams(max_new_tokens=4, seed=i)) for i in range(5)]

        async def main():
            return await asyncio.gather(*(llm.generate(r) for r in requests))

        outs = asyncio.run(main())
        assert llm.calls == 1
        assert [o[0].token_ids for o in outs] == [o[0].token_ids for o in engine.generate(requests)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("hf_engine"), seed=1)


def test_logprobs_equal_trainer_recomputation(tiny_dir, monkeypatch):
    """A trainer batches prompt+response right-padded, with an attention mask, and gathers
    log_softmax(logits / T) at the response tokens; the engine's log-probs must be the same numbers.
    The two samples of each prompt share one prefill row (its KV cache copied to both)."""
    from transformers import AutoModelForCausalLM

    engine = HFEngine(tiny_dir, device="cpu")
    forward_rows = []
    forward = engine._forward
    monkeypatch.setattr(
        engine, "_forward", lambda ids, *a: forward_rows.append(ids.shape) or forward(ids, *a)
    )
    prompts = [[10, 11, 12], [40, 41, 42, 43, 44, 45], [70], [10, 11, 12]]
    temperature = 0.6
    requests = [
        GenerationRequest(p, SamplingParams(n=2, temperature=temperature, max_new_tokens=12, seed=i))
        for i, p in enumerate(prompts)
    ]
    samples = [
        (req.prompt_ids, out)
        for req, outs in zip(requests, engine.generate(requests), strict=True)
        for out in outs
    ]
    assert forward_rows[0] == (3, 6)  # prefill: 3 distinct prompts for 8 samples

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    seqs = [p + o.token_ids for p, o in samples]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits.float()
    logp = torch.log_softmax(logits[:, :-1] / temperature, -1).gather(2, ids[:, 1:, None]).squeeze(2)
    for i, (prompt, out) in enumerate(samples):
        start = len(prompt) - 1
        want = logp[i, start : start + len(out.token_ids)]
        torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=1e-4, rtol=0)


def test_long_batches_are_split_and_finished_rows_dropped(tiny_dir):
    """More samples than max_batch_size, with very different lengths: the same tokens as one by one."""
    engine = HFEngine(tiny_dir, device="cpu", max_batch_size=5)
    requests = [
        GenerationRequest([20 + i] * (1 + i % 4), SamplingParams(n=3, max_new_tokens=2 + 5 * (i % 3), seed=i))
        for i in range(6)
    ]
    together = engine.generate(requests)
    for req, outs in zip(requests, together, strict=True):
        alone = engine.generate([req])[0]
        assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
        assert all(len(o.token_ids) <= req.params.max_new_tokens for o in outs)


def test_prompt_too_long_for_the_model(tmp_path):
    engine = HFEngine(make_tiny_llama(tmp_path, max_position_embeddings=16), device="cpu")
    with pytest.raises(ValueError, match="request 0: the prompt has 16 tokens.*max_position_embeddings=16"):
        engine.generate([GenerationRequest([5] * 16, SamplingParams(max_new_tokens=4))])
    ((out,),) = engine.generate(
        [GenerationRequest([5] * 12, SamplingParams(max_new_tokens=50, ignore_eos=True))]
    )
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_update_weights_refuses_unknown_names_and_shapes(tiny_dir):
    engine = HFEngine(tiny_dir, device="cpu")
    with pytest.raises(KeyError, match="model.layers.9.mlp"):
        engine.update_weights({"model.layers.9.mlp.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="lm_head.weight.*shape"):
        engine.update_weights([("lm_head.weight", torch.zeros(3, 3))])
    engine.sleep(2)
    engine.wake_up()
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.generate([GenerationRequest([5], SamplingParams(max_new_tokens=2))])


def test_registered_as_hf_and_built_from_the_config(tiny_dir):
    factory = resolve(get_plugin_manager(), "rollout_engines", "hf")
    assert factory.available() is None
    cfg = RLConfig()
    with pytest.raises(ValueError, match="model_name_or_path"):
        factory.create(cfg)
    cfg.actor.model_name_or_path = tiny_dir
    cfg.ds.param_dtype = "fp32"
    cfg.rollout.n_samples_per_prompt = 2
    cfg.rollout.max_new_tokens = 3
    engine = factory.create(cfg, index=1, device="cpu")
    assert isinstance(engine, HFEngine) and factory.engine_class() is HFEngine
    params = SamplingParams(
        n=cfg.rollout.n_samples_per_prompt, max_new_tokens=cfg.rollout.max_new_tokens, seed=5
    )
    (outs,) = engine.generate([GenerationRequest([4, 5], params)])
    assert len(outs) == 2 and all(len(o.token_ids) <= 3 for o in outs)


@pytest.mark.parametrize("weights", ["module", "fused", "packed"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_direct_decode_equals_the_module_forward(kind, weights, monkeypatch):
    """decode_token reads the weights itself (the modules' own, the fused q/k/v and gate/up layout of an
    engine that owns its model, or packed copies of those); it must give the model's own forward: the
    same tokens and log-probs (1e-5) through prompts of different lengths (left padding) and rows
    finishing early. Without the direct step the model still decodes into the preallocated cache (the
    fast path's other half)."""
    from rlhf_core.rollout import decode_loop
    from rlhf_core.rollout.decode import GrowingKVLayer

    model = tiny_decoder(kind)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine = HFEngine.from_model(model, own_weights=weights != "module", pack_weights=weights == "packed")
    assert engine.fast_path and engine.plan is not None and engine.pack_weights == (weights == "packed")
    attn = model.model.layers[0].self_attn
    # fused: the projections are views of one tensor, holding the same values as before
    shared = (
        attn.q_proj.weight.untyped_storage().data_ptr() == attn.k_proj.weight.untyped_storage().data_ptr()
    )
    assert shared == (weights != "module")
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    requests = [
        GenerationRequest(list(range(5, 5 + n)), SamplingParams(n=3, max_new_tokens=9 + n, seed=n))
        for n in (1, 4, 7)
    ]
    seen = []
    decode = decode_loop.decode_token
    monkeypatch.setattr(decode_loop, "decode_token", lambda plan, *a: seen.append(a[-1]) or decode(plan, *a))
    direct = engine.generate(requests)
    qkv, _, gate_up, _ = seen[0]["layers"][0]  # one matmul per group once fused
    assert (len(qkv), len(gate_up)) == ((3, 2) if weights == "module" else (1, 1))
    assert seen[0]["packed"] == (weights == "packed")
    monkeypatch.undo()
    engine.plan = None
    writes = []
    update = GrowingKVLayer.update
    monkeypatch.setattr(
        GrowingKVLayer, "update", lambda self, k, v, *a, **kw: writes.append(1) or update(self, k, v)
    )
    module = engine.generate(requests)
    assert len(writes) > 2 * 9  # every layer, every step
    for a_outs, b_outs in zip(direct, module, strict=True):
        for a, b in zip(a_outs, b_outs, strict=True):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_fused_layout_returns_after_sleep(tmp_path):
    """Sleeping gives the parameters separate tensors again; waking lays them out fused again (level 2
    once the weights are sent back), and the engine generates exactly what it did before sleeping."""
    engine = HFEngine(make_tiny_llama(tmp_path / "m"), device="cpu")
    attn = engine.model.model.layers[1].self_attn
    mlp = engine.model.model.layers[1].mlp

    def fused() -> bool:
        def storage(m):
            return m.weight.untyped_storage().data_ptr()

        return storage(attn.q_proj) == storage(attn.v_proj) and storage(mlp.gate_proj) == storage(mlp.up_proj)

    requests = [GenerationRequest([5, 6, 7], SamplingParams(n=2, max_new_tokens=6, seed=3))]
    before = engine.generate(requests)
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    assert fused()
    for level in (1, 2):
        engine.sleep(level)
        engine.wake_up()
        if level == 2:
            engine.update_weights(state)
        assert fused(), level
        again = engine.generate(requests)
        assert [o.token_ids for o in again[0]] == [o.token_ids for o in before[0]]
        assert [o.logprobs for o in again[0]] == [o.logprobs for o in before[0]]


def test_packed_weights_by_default_from_hidden_size_256(tmp_path):
    """Below PACK_MIN_HIDDEN packing costs more than it saves; a module the engine does not own is never
    packed (nor fused) unless handed over with ``own_weights``."""
    from rlhf_core.rollout.decode import PACK_MIN_HIDDEN

    small = make_tiny_llama(tmp_path / "small", hidden_size=PACK_MIN_HIDDEN // 2, intermediate_size=64)
    wide = make_tiny_llama(
        tmp_path / "wide", hidden_size=PACK_MIN_HIDDEN, intermediate_size=64, num_hidden_layers=1
    )
    assert not HFEngine(small, device="cpu").pack_weights
    assert HFEngine(wide, device="cpu").pack_weights
    assert not HFEngine(wide, device="cpu", dtype="bf16").pack_weights
    assert not HFEngine.from_model(tiny_decoder("llama")).pack_weights


def test_direct_decode_steps_aside_for_what_it_does_not_cover():
    """Adapters, forward hooks and RoPE that depends on the sequence length keep the module path."""
    from peft import LoraConfig, get_peft_model

    assert decode_plan(tiny_decoder("llama")) is not None
    lora = get_peft_model(tiny_decoder("llama"), LoraConfig(r=2, target_modules=["q_proj"]))
    assert decode_plan(lora.base_model.model) is None
    hooked = tiny_decoder("qwen2")
    hooked.model.layers[1].mlp.register_forward_pre_hook(lambda *_: None)
    assert decode_plan(hooked) is None
    dynamic = tiny_decoder("llama")
    dynamic.model.rotary_emb.rope_type = "dynamic"
    assert decode_plan(dynamic) is None


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_static_cache_decodes_like_the_growing_cache(kind):
    """The static path (what a GPU runs, there as a CUDA graph) against the default CPU path on the same
    engine: greedy and sampled tokens equal, log-probs within 1e-5. The two differ only in attention: the
    static step sums softmax weights and weighted values over all C cache columns, the masked ones adding
    exact zeros, so only the order of float32 sums changes: at most C * 2^-24 relative per sum (C = 128 here:
    7.6e-6; about 1e-7 seen). Rows that finish early are kept (no compaction), and a second batch of another
    shape and then one of the first shape reuse the decoders made for them."""
    from rlhf_core.rollout.decode import StaticDecoder

    engine = HFEngine.from_model(tiny_decoder(kind), own_weights=True)
    assert not engine.static_cache  # CPU default: the growing cache, unchanged
    batches = [
        [
            GenerationRequest(list(range(5, 5 + n)), SamplingParams(n=3, max_new_tokens=9 + n, seed=n))
            for n in (1, 4, 7)
        ],
        [GenerationRequest([7, 8], SamplingParams(n=2, temperature=0.0, max_new_tokens=20, ignore_eos=True))],
        [
            GenerationRequest(
                list(range(9, 9 + n)), SamplingParams(n=3, max_new_tokens=11, seed=n + 1, top_k=20, top_p=0.9)
            )
            for n in (2, 3, 6)
        ],
    ]
    growing = [engine.generate(b) for b in batches]
    engine.static_cache = True
    static = [engine.generate(b) for b in batches]
    decoders = list(engine._decoders.values())
    assert len(decoders) == 2 and all(isinstance(d, StaticDecoder) and not d.graph for d in decoders)
    assert [d.tokens.shape[0] for d in decoders] == [9, 2] and decoders[0].mask.shape[-1] == 128
    for a_outs, b_outs in zip(growing, static, strict=True):
        for a_samples, b_samples in zip(a_outs, b_outs, strict=True):
            for a, b in zip(a_samples, b_samples, strict=True):
                assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
                torch.testing.assert_close(
                    torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0
                )
    # a weight update lands in place: the kept decoder decodes the new weights
    with torch.no_grad():
        engine.update_weights({"lm_head.weight": engine.model.lm_head.weight * 1.5})
    after = engine.generate(batches[0])
    engine.static_cache = False
    for a, b in zip(engine.generate(batches[0]), after, strict=True):
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert list(engine._decoders.values()) == decoders  # no new one for the same batch shape


# --- on a GPU (scripts/gpu-check runs these; skipped elsewhere) ------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
class TestHFEngineOnCUDA(RolloutEngineConformance):
    """The whole suite on a GPU, in fp32 (torch's matmuls do not use TF32 unless asked, so the 1e-4
    log-prob tolerance against the CPU reference holds)."""

    def make_engine(self, model_dir):
        engine = HFEngine(model_dir, dtype="float32", device="cuda")
        assert engine.fast_path and engine.device.type == "cuda"
        return engine


@pytest.mark.gpu
@needs_cuda
def test_bf16_decode_on_cuda_matches_a_bf16_forward_and_sleep_frees_the_weights(tmp_path):
    """bf16 on a GPU, as RL runs there: the engine's sampled-token log-probs against one full forward of the
    same bf16 weights (different kernels: KV-cached decode against a full pass), within 0.05 nats on average
    (log-probs here are ~-5.3 = -ln(200); one bf16 rounding moves such a value by up to 5.3 * 2^-9 = 0.01,
    and the two sides round differently in every layer); then sleep level 1 gives the weights' GPU memory
    back and wake-up brings them back unchanged."""
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_llama(tmp_path, seed=0, hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    engine = HFEngine(model_dir, dtype="bfloat16", device="cuda")
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    prompt = list(range(5, 21))
    (outs,) = engine.generate(
        [GenerationRequest(prompt, SamplingParams(max_new_tokens=24, min_new_tokens=24, seed=3, n=4))]
    )
    gaps = []
    for out in outs:
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + out.token_ids], device="cuda")).logits[
                0, len(prompt) - 1 : -1
            ]
        want = torch.log_softmax(logits.float(), -1).gather(
            1, torch.tensor(out.token_ids, device="cuda")[:, None]
        )
        gaps.append((torch.tensor(out.logprobs) - want.squeeze(1).cpu()).abs().mean())
    assert float(torch.stack(gaps).mean()) <= 0.05, gaps

    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    before = engine.generate([GenerationRequest(prompt, greedy)])[0][0].token_ids
    awake = torch.cuda.memory_allocated()
    engine.sleep(1)
    assert awake - torch.cuda.memory_allocated() >= 0.9 * weight_bytes
    engine.wake_up()
    assert engine.generate([GenerationRequest(prompt, greedy)])[0][0].token_ids == before


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_equals_the_eager_paths(tmp_path, dtype):
    """On CUDA the static decoder is the default and its step a captured graph, replayed from the first step
    of the next call of the same shape. Against the same static step run eagerly and against the growing cache
    (eager, rows dropped as they finish): in fp32 the same tokens and log-probs within 1e-5 (only the order of
    sums differs, as on CPU; TF32 is off); in bf16, where a near-tie may flip a token, log-probs of the tokens
    both drew within 0.05 on average (a few bf16 roundings of log-probs ~-7)."""
    model_dir = make_tiny_llama(tmp_path, seed=0, hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    engine = HFEngine(model_dir, dtype=dtype, device="cuda")
    assert engine.static_cache and engine.cuda_graph
    requests = [
        GenerationRequest(
            list(range(5, 5 + n)), SamplingParams(n=4, max_new_tokens=40, seed=n, ignore_eos=True)
        )
        for n in (3, 9)
    ] + [
        GenerationRequest([7, 8, 9], SamplingParams(n=2, temperature=0.0, max_new_tokens=40, ignore_eos=True))
    ]

    def run(static: bool, graph: bool):
        engine.static_cache, engine.cuda_graph = static, graph
        engine._decoders.clear()
        return engine.generate(requests)

    def agree(ours, reference) -> None:
        pairs = [
            (a, b) for a_outs, b_outs in zip(ours, reference, strict=True) for a, b in zip(a_outs, b_outs)
        ]
        gaps = [
            (torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs()
            for a, b in pairs
            if a.token_ids == b.token_ids
        ]
        if dtype == "float32":
            assert len(gaps) == len(pairs) and float(torch.cat(gaps).max()) <= 1e-5
        else:
            assert gaps and float(torch.cat(gaps).mean()) <= 0.05

    graph = run(True, True)
    (decoder,) = engine._decoders.values()
    assert decoder.graph and decoder.captured is not None
    agree(engine.generate(requests), graph)  # the kept graph, replayed from the first step
    agree(graph, run(True, False))
    agree(graph, run(False, False))


def test_a_lora_adapter_is_merged_over_the_base_the_engine_loaded(tiny_dir):
    """A LoRA policy's sync carries only adapter pairs (scaling folded into B). The engine keeps the base it
    loaded and sets W = W0 + B @ A: after two syncs of different adapters its log-probs equal the peft model's
    forward, x W0^T + s (x A^T) B^T, to 1e-5 (the same fp32 products summed in another order: ~1e-6 here), so the
    second adapter replaced the first instead of adding to it. A full weight sent later becomes the new base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rlhf_core.testing.engines import forward_logprobs
    from rlhf_core.weight_sync import lora_adapter_tensors

    engine = HFEngine(tiny_dir, device="cpu")
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    trainer = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    ).eval()
    prompt = [10, 11, 12]
    request = GenerationRequest(prompt, SamplingParams(n=2, max_new_tokens=8, seed=0))
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        with torch.no_grad():
            for name, p in trainer.named_parameters():
                if "lora_" in name:
                    p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        sent = list(lora_adapter_tensors(trainer))
        assert len(sent) == 2 * 3 * 2 and all(
            n.endswith((".lora_A", ".lora_B")) for n, _ in sent
        )  # layers x targets x A/B
        engine.update_weights(sent)
        for out in engine.generate([request])[0]:
            torch.testing.assert_close(
                out.logprobs, forward_logprobs(trainer, prompt, out.token_ids, 1.0), atol=1e-5, rtol=0
            )
    out = engine.generate([request])[0][0]
    assert (
        max(abs(a - b) for a, b in zip(out.logprobs, forward_logprobs(base, prompt, out.token_ids, 1.0)))
        > 1e-2
    )
    engine.update_weights(
        dict(base.named_parameters())
    )  # full weights again: the adapters' bases are dropped
    engine.update_weights(sent[:2])  # one layer's pair, merged over the new base
    assert not engine._lora_base.keys() - {sent[0][0].removesuffix(".lora_A") + ".weight"}
    with pytest.raises(Exception, match="not the next half of a LoRA pair"):
        engine.update_weights(sent[1:3])
