"""Decode speed of the HF rollout engine against transformers' ``model.generate`` and TRL's generation call.

Same random tiny Llama (saved once, loaded by every contender), same batch (64 sequences, 16-token
prompts, a fixed number of new tokens forced with min_new_tokens), same sampling (T=1, top-p 1, no
top-k), fp32, sdpa attention. Each contender runs in a fresh process, in A B C A B C order, with 2 torch
threads; inside a process, one warm-up call then ``--reps`` timed calls (median kept).

Contenders:
- ``hf_engine``: ``rlhf_core.rollout.hf_engine.HFEngine.generate`` (also returns every token's log-prob).
- ``hf_engine_static``: the same with ``static_cache`` (a fixed-shape cache: a GPU's default, where its step is
  a CUDA graph; on CPU it attends over every cache column and keeps finished rows).
- ``generate``: ``model.generate(do_sample=True, top_k=0, min_new_tokens=L, max_new_tokens=L)``.
- ``trl``: the call TRL's GRPOTrainer makes with ``use_vllm=False`` (trl 1.16 ``grpo_trainer.py``: a
  ``GenerationConfig`` built from its generation kwargs with ``disable_compile=True``, ``model.generate``
  under ``torch.no_grad`` on left-padded prompts, then its EOS masking), reproduced here because trl is
  not a dependency of this repository.

    .venv/bin/python bench/engine_decode.py                      # both sizes, 3 rounds
    .venv/bin/python bench/engine_decode.py --sizes S --rounds 1 # quick look
    .venv/bin/python bench/engine_decode.py --contenders hf_engine,hf_engine_static
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

SIZES = {  # name -> LlamaConfig overrides
    "S": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2),
    "M": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4),
}
CONTENDERS = ["hf_engine", "hf_engine_static", "generate", "trl"]


def build_model(path: str, size: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

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
    """One contender in this (fresh) process: load, warm up, time ``reps`` calls."""
    import torch

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(4, 1024, (args.batch, args.prompt_len), generator=gen)
    attention_mask = torch.ones_like(prompts)

    if args.worker in ("hf_engine", "hf_engine_static"):
        from rlhf_core.rollout.hf_engine import HFEngine
        from rlhf_core.types import GenerationRequest, SamplingParams

        engine = HFEngine.from_model(
            model, own_weights=True
        )  # fused, and packed by the size rule, as when loaded from a path
        engine.static_cache = args.worker == "hf_engine_static"

        def run(new_tokens):
            requests = [
                GenerationRequest(
                    p.tolist(), SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens, seed=i)
                )
                for i, p in enumerate(prompts)
            ]
            return [o[0].token_ids for o in engine.generate(requests)]

    elif args.worker == "generate":

        def run(new_tokens):
            with torch.no_grad():
                out = model.generate(
                    input_ids=prompts,
                    attention_mask=attention_mask,
                    do_sample=True,
                    top_k=0,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    pad_token_id=0,
                )
            return out[:, args.prompt_len :].tolist()

    else:  # trl: GRPOTrainer.__init__ builds this GenerationConfig; _generate_single_turn calls generate

        def run(new_tokens):
            eos_token_ids = [2]
            generation_kwargs = {
                "max_new_tokens": new_tokens,
                "do_sample": True,
                "pad_token_id": 0,
                "bos_token_id": 1,
                "eos_token_id": eos_token_ids,
                "temperature": 1.0,
                "top_p": 1.0,
                "top_k": 0,
                "min_p": None,
                "repetition_penalty": 1.0,
                "cache_implementation": None,
                "min_new_tokens": new_tokens,
            }
            generation_config = GenerationConfig(**generation_kwargs, disable_compile=True)
            with torch.no_grad():
                prompt_completion_ids = model.generate(
                    input_ids=prompts, attention_mask=attention_mask, generation_config=generation_config
                )
            completion_ids = prompt_completion_ids[:, prompts.size(1) :]
            is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids))
            eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long)
            eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
            sequence_indices = torch.arange(is_eos.size(1)).expand(is_eos.size(0), -1)
            completion_mask = (sequence_indices <= eos_idx.unsqueeze(1)).int()
            return [c[m].tolist() for c, m in zip(completion_ids, completion_mask.bool(), strict=True)]

    run(8)  # warm-up
    times, cpu_times = [], []
    for _ in range(args.reps):
        start, cpu_start = time.perf_counter(), time.process_time()
        out = run(args.new_tokens)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        assert all(len(x) == args.new_tokens for x in out), "every sequence must have the fixed length"
    seconds = statistics.median(times)
    return {
        "contender": args.worker,
        "seconds": seconds,
        "times": times,
        "cpu_seconds": statistics.median(cpu_times),
        "tokens_per_s": args.batch * args.new_tokens / seconds,
        "ms_per_decode_step": 1000 * seconds / args.new_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="S,M")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contenders", default="hf_engine,generate,trl", help=f"of {','.join(CONTENDERS)}")
    parser.add_argument("--json", help="also write every measurement here")
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return

    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "MKL_NUM_THREADS": str(args.threads),
        "TOKENIZERS_PARALLELISM": "false",
        "DS_ACCELERATOR": "cpu",
    }
    common = [
        "--batch",
        str(args.batch),
        "--prompt-len",
        str(args.prompt_len),
        "--new-tokens",
        str(args.new_tokens),
        "--threads",
        str(args.threads),
        "--reps",
        str(args.reps),
    ]
    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            model_dir = os.path.join(tmp, size)
            build_model(model_dir, size)
            contenders = args.contenders.split(",")
            results[size] = {c: [] for c in contenders}
            for r in range(args.rounds):
                for contender in contenders:
                    cmd = [sys.executable, __file__, "--worker", contender, "--model-dir", model_dir, *common]
                    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                    if proc.returncode != 0:
                        sys.exit(f"{contender} failed:\n{proc.stderr[-3000:]}")
                    res = json.loads(proc.stdout.strip().splitlines()[-1])
                    results[size][contender].append(res)
                    print(
                        f"[{size} round {r + 1}/{args.rounds}] {contender:<10} {res['ms_per_decode_step']:7.2f} ms/step "
                        f"{res['tokens_per_s']:9.0f} tok/s",
                        file=sys.stderr,
                        flush=True,
                    )

    print(
        f"\nbatch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, {args.threads} threads, "
        f"{args.rounds} rounds x {args.reps} reps (median of per-process medians; best run in brackets; "
        f"CPU time = process time, insensitive to other load only with 1 thread)\n"
    )
    print("| model | contender | ms / decode step | tokens/s | hf_engine speed-up (wall) | (CPU time) |")
    print("|---|---|---|---|---|---|")
    for size, per in results.items():
        med = {c: statistics.median(x["seconds"] for x in runs) for c, runs in per.items()}
        best = {c: min(min(x["times"]) for x in runs) for c, runs in per.items()}
        cpu = {c: statistics.median(x["cpu_seconds"] for x in runs) for c, runs in per.items()}
        for c in per:
            step = 1000 * med[c] / args.new_tokens
            tps = args.batch * args.new_tokens / med[c]
            name = f"{size} ({SIZES[size]['hidden_size']}h x {SIZES[size]['num_hidden_layers']}L)"
            print(
                f"| {name} | {c} | {step:.2f} [{1000 * best[c] / args.new_tokens:.2f}] | {tps:.0f} | "
                f"{med[c] / med['hf_engine']:.2f}x [{best[c] / best['hf_engine']:.2f}x] | "
                f"{cpu[c] / cpu['hf_engine']:.2f}x |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
