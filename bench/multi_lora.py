"""Does serving two LoRA policies from one vLLM engine pay (issue 30, item 3)? Measured on vLLM's CPU build
with SmolLM2-135M-Instruct and two random rank-16 adapters on all linear layers (fp32):

    .venv/bin/python bench/multi_lora.py [--prompts 32] [--tokens 32] [--rounds 3]

One engine is built with ``max_loras=2``; the process's RSS before and after is what one engine costs (the
model, its KV cache, vLLM's buffers), which a second engine for a second policy would cost again. Then, per
round, the same prompts are generated three ways, in turns: ``mixed`` (one ``generate`` call, half the prompts
under each adapter: what a shared engine does), ``one adapter per call`` (two calls, one adapter each: the
time-sliced engine of one policy at a time) and ``no adapter`` (the base model: LoRA's own cost). Prints the
medians and the ratios. The engine runs in this process, as rlhf runs a one-rank engine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import torch

SMOLLM2 = Path.home() / ".cache/rlhf/models/SmolLM2-135M-Instruct"
RANK, ALPHA = 16, 32


def make_adapter(out_dir: str, seed: int) -> str:
    """A peft LoRA adapter over SmolLM2 with random A and B (peft leaves B at zero: no effect to serve)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32),
        LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear"),
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    model.save_pretrained(out_dir)
    return out_dir


def rss_gb() -> float:
    return psutil.Process().memory_info().rss / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, as rlhf's
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    work = tempfile.mkdtemp(prefix="multi-lora-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    adapters = [make_adapter(f"{work}/a{i}", seed=i) for i in (1, 2)]

    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    before = rss_gb()
    llm = LLM(
        model=str(SMOLLM2),
        dtype="float32",
        enforce_eager=True,
        enable_chunked_prefill=False,
        seed=0,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=RANK,
        max_model_len=256,
        kv_cache_memory_bytes=128 << 20,
        gpu_memory_utilization=0.5,
    )
    engine_gb = rss_gb() - before
    requests = [LoRARequest(f"policy{i}", i + 1, path) for i, path in enumerate(adapters)]
    prompts = [f"Question {i}: what is {i} plus {2 * i}?" for i in range(args.prompts)]
    params = SamplingParams(temperature=1.0, max_tokens=args.tokens, min_tokens=args.tokens, seed=0)
    half = len(prompts) // 2

    def mixed():
        return llm.generate(
            prompts, params, use_tqdm=False, lora_request=[requests[i % 2] for i in range(len(prompts))]
        )

    def per_call():
        return llm.generate(prompts[:half], params, use_tqdm=False, lora_request=requests[0]) + llm.generate(
            prompts[half:], params, use_tqdm=False, lora_request=requests[1]
        )

    def base():
        return llm.generate(prompts, params, use_tqdm=False)

    ways = {"mixed": mixed, "one adapter per call": per_call, "no adapter": base}
    mixed()  # warm-up: both adapters loaded
    seconds: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(args.rounds):
        for name in list(ways)[r % 3 :] + list(ways)[: r % 3]:
            t = time.perf_counter()
            outs = ways[name]()
            seconds[name].append(time.perf_counter() - t)
            assert sum(len(o.outputs[0].token_ids) for o in outs) == args.prompts * args.tokens
    tokens = args.prompts * args.tokens
    print(
        f"one vLLM engine (SmolLM2-135M fp32, max_loras=2): {engine_gb:.2f} GB of RSS; "
        f"peak RSS of this process {psutil.Process().memory_info().rss / 1e9:.2f} GB; threads {torch.get_num_threads()}"
    )
    print(f"{args.prompts} prompts x {args.tokens} tokens, median of {args.rounds} rounds:")
    med = {k: statistics.median(v) for k, v in seconds.items()}
    for name, s in med.items():
        print(f"  {name:<22} {s:7.2f} s  {tokens / s:8.1f} tokens/s")
    print(
        f"  mixed / one adapter per call: {med['mixed'] / med['one adapter per call']:.2f}x the time; "
        f"LoRA's cost over the base: {med['one adapter per call'] / med['no adapter']:.2f}x"
    )


if __name__ == "__main__":
    main()
