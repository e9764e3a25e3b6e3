"""GPU decode speed of the HF rollout engine against ``model.generate``, and against the memory floor.

Model: a random Qwen2-shaped 0.5B (Qwen2.5-0.5B's shape: hidden 896, intermediate 4864, 24 layers, 14 heads,
2 KV heads, vocab 151,936, tied embeddings, rope theta 1e6), made here from a config, bf16 on one GPU.
Batches of 64 and 256 sequences, 256-token prompts, ``--new-tokens`` forced with min_new_tokens.

The floor is the decode memory roofline: every decode step reads every weight once and the KV cache of
every sequence, so with the device's copy bandwidth ``B`` (measured here: a device-to-device copy of
1 GiB reads and writes it, ``B = 2 * bytes / seconds``)

    t_step >= (W + b * c * kv) / B,    kv = 2 * layers * kv_heads * head_dim * bytes per element

with ``W`` the weight bytes, ``b`` the batch and ``c`` the mean context over the decode (prompt + half the
new tokens). On CUDA the engine decodes through its static cache with the step captured as a CUDA graph (its
default there); ``hf_engine_eager`` is the same engine on the growing cache, a kernel launch at a time (what the
first GPU run measured). ``scripts/gpu-check`` calls :func:`measure` (with a tiny config on CPU); run alone:

    python bench/engine_decode_gpu.py [--batches 64,256] [--new-tokens 512] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

QWEN25_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=1e6,
    tie_word_embeddings=True,
)
TINY = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
    rope_theta=1e6,
    tie_word_embeddings=True,
)


def floor_ms(weight_bytes: int, batch: int, context: int, kv_bytes_per_token: int, bandwidth: float) -> float:
    """Milliseconds per decode step at the memory roofline (formula in the module docstring)."""
    return 1000 * (weight_bytes + batch * context * kv_bytes_per_token) / bandwidth


def copy_bandwidth(device, nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Bytes/s of a device-to-device copy of ``nbytes`` (counted twice: read and written), best of ``reps``."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps + 1):  # the first copy warms up
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def measure(
    config_kwargs: dict,
    device: str,
    dtype: str,
    batches: list[int],
    prompt_len: int,
    new_tokens: int,
    reps: int,
    copy_bytes: int = 1 << 30,
) -> dict:
    """Decode ms/step and tokens/s of the HF engine and ``model.generate`` per batch, with the memory floor."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf_core.rollout.hf_engine import HFEngine
    from rlhf_core.types import GenerationRequest, SamplingParams

    config = Qwen2Config(**config_kwargs, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(getattr(torch, dtype)).eval()
    params = sum(p.numel() for p in model.parameters())
    elem = model.dtype.itemsize
    head_dim = config.hidden_size // config.num_attention_heads
    kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * elem
    bandwidth = copy_bandwidth(device, copy_bytes)
    engine = HFEngine.from_model(
        model, max_batch_size=max(batches), own_weights=True
    )  # fused, as loaded from a path
    static = engine.static_cache  # on CUDA: the static cache, its decode step a captured CUDA graph

    def timed(fn) -> float:
        fn(4)  # warm-up (kernels, allocator)
        times = []
        for _ in range(reps):
            sync(device)
            start = time.perf_counter()
            fn(new_tokens)
            sync(device)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    rows = []
    for batch in batches:
        prompts = torch.randint(10, config.vocab_size, (batch, prompt_len), device=device)
        mask = torch.ones_like(prompts)

        def ours(n, prompts=prompts):
            reqs = [
                GenerationRequest(p.tolist(), SamplingParams(max_new_tokens=n, min_new_tokens=n, seed=i))
                for i, p in enumerate(prompts)
            ]
            engine.generate(reqs)

        def generate(n, prompts=prompts, mask=mask):
            with torch.no_grad():
                model.generate(
                    input_ids=prompts,
                    attention_mask=mask,
                    do_sample=True,
                    top_k=0,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    pad_token_id=0,
                )

        floor = floor_ms(params * elem, batch, prompt_len + new_tokens // 2, kv_bytes, bandwidth)
        row = {"batch": batch, "floor_ms_per_step": floor}

        def eager(n, prompts=prompts):  # the growing cache, one kernel launch at a time (the first GPU run's)
            engine.static_cache = False
            try:
                ours(n, prompts)
            finally:
                engine.static_cache = static

        contenders = [("hf_engine", ours), ("generate", generate)]
        if static:
            contenders.append(("hf_engine_eager", eager))
        for name, fn in contenders:  # interleaved per batch
            seconds = timed(fn)
            row[name] = {
                "ms_per_step": 1000 * seconds / new_tokens,
                "tokens_per_s": batch * new_tokens / seconds,
            }
        row["engine_vs_generate"] = row["generate"]["ms_per_step"] / row["hf_engine"]["ms_per_step"]
        row["engine_fraction_of_floor"] = floor / row["hf_engine"]["ms_per_step"]
        if static:
            row["static_vs_eager"] = row["hf_engine_eager"]["ms_per_step"] / row["hf_engine"]["ms_per_step"]
        rows.append(row)
    return {
        "device": device,
        "dtype": dtype,
        "params": params,
        "weight_bytes": params * elem,
        "kv_bytes_per_token": kv_bytes,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "fast_path": engine.fast_path,
        "static_cache": static,
        "cuda_graph": static and engine.cuda_graph and torch.device(device).type == "cuda",
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "reps": reps,
        "rows": rows,
    }


def table(result: dict) -> str:
    lines = [
        "| batch | contender | ms / decode step | tokens/s | floor ms/step | % of floor speed |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        for name in ("hf_engine", "generate"):
            r = row[name]
            lines.append(
                f"| {row['batch']} | {name} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:.0f} | "
                f"{row['floor_ms_per_step']:.2f} | {100 * row['floor_ms_per_step'] / r['ms_per_step']:.0f}% |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    import torch

    assert torch.cuda.is_available(), (
        "this benchmark needs a CUDA GPU (scripts/gpu-check --cpu runs it tiny on CPU)"
    )
    result = measure(
        QWEN25_05B,
        "cuda",
        "bfloat16",
        [int(b) for b in args.batches.split(",")],
        args.prompt_len,
        args.new_tokens,
        args.reps,
    )
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    print(table(result))


if __name__ == "__main__":
    main()
