"""GPU decode step time of the HF rollout engine against ``model.generate``, and against the memory floor.

Model: a random Qwen2-shaped 0.5B (hidden 896, intermediate 4864, 24 layers, 14 heads, 2 KV heads,
vocab 151,936, tied embeddings, rope theta 1e6), bf16 on one GPU. Batches of 64 and 256 sequences,
256-token prompts, 512 new tokens forced with min_new_tokens (mean decode context ~512).

The floor is the decode roofline of performance-anchors.md §4, with the device's measured bandwidth
B = 3.0e12 B/s and bf16 throughput F = 790e12 FLOP/s:

    t_step >= max((2P + b*c*kv) / B, 2P*b / F),  kv = 2 * layers * kv_heads * head_dim * 2 bytes

Not run yet (no GPU was available when it was written). Run:

    python bench/engine_decode_gpu.py [--batches 64,256] [--new-tokens 512] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time


def floor_ms(params: int, batch: int, context: int, kv_bytes_per_token: int, bandwidth=3.0e12, flops=790e12) -> float:
    memory = (2 * params + batch * context * kv_bytes_per_token) / bandwidth
    compute = 2 * params * batch / flops
    return 1000 * max(memory, compute)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf_core.rollout.hf_engine import HFEngine
    from rlhf_core.types import GenerationRequest, SamplingParams

    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    config = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    params = sum(p.numel() for p in model.parameters())
    head_dim = config.hidden_size // config.num_attention_heads
    kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2
    engine = HFEngine.from_model(model, max_batch_size=max(int(b) for b in args.batches.split(",")))
    print(f"model: {params / 1e9:.3f}B parameters, KV {kv_bytes} bytes/token, fast path {engine.fast_path}")

    def timed(fn) -> float:
        fn(8)  # warm-up (kernels, allocator)
        times = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn(args.new_tokens)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    print("| batch | contender | ms / decode step | tokens/s | floor ms/step | % of floor speed |")
    print("|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = torch.randint(10, config.vocab_size, (batch, args.prompt_len), device="cuda")
        mask = torch.ones_like(prompts)

        def ours(n, prompts=prompts):
            reqs = [GenerationRequest(p.tolist(), SamplingParams(max_new_tokens=n, min_new_tokens=n, seed=i))
                    for i, p in enumerate(prompts)]
            engine.generate(reqs)

        def generate(n, prompts=prompts, mask=mask):
            with torch.no_grad():
                model.generate(input_ids=prompts, attention_mask=mask, do_sample=True, top_k=0,
                               max_new_tokens=n, min_new_tokens=n, pad_token_id=0)

        floor = floor_ms(params, batch, args.prompt_len + args.new_tokens // 2, kv_bytes)
        for name, fn in (("hf_engine", ours), ("generate", generate)):
            seconds = timed(fn)
            step = 1000 * seconds / args.new_tokens
            print(f"| {batch} | {name} | {step:.2f} | {batch * args.new_tokens / seconds:.0f} | {floor:.2f} | "
                  f"{100 * floor / step:.0f}% |", flush=True)


if __name__ == "__main__":
    main()
