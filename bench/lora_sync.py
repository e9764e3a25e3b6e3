"""Bytes and seconds per weight sync of a LoRA policy: adapter-only (what rlhf sends) vs. a full merged sync
(what it sent before: the adapter merged into the base and every tensor broadcast), into the HF engine and
into vLLM's CPU build, over the real gloo sync group (``rlhf_core.weight_sync``) on this machine.

    .venv/bin/python bench/lora_sync.py                      # SmolLM2-135M and a random ~0.5B Llama, both engines
    .venv/bin/python bench/lora_sync.py --models smollm2 --engines hf --rounds 2

Per model, the trainer is the policy as a peft LoRA model (rank 16, alpha 32, all linear layers), its weights
read by ``TrainWorker.adapter_weights`` (adapter) and ``TrainWorker.named_weights`` (full merged: merge_adapter,
every tensor cloned) on a one-rank worker without DeepSpeed (ZeRO-0: the gathers are no-ops). Each round
moves the adapter by noise (an optimizer step's stand-in), then runs one adapter sync and one full sync,
alternating which goes first. A sync's seconds run from the first tensor read on the trainer to the engine
having loaded it (the HF engine merging W0 + B @ A, vLLM writing the adapter and adding it as a new LoRA
request; for the full sync, the HF engine copying every weight, vLLM reloading and repacking its weights).
vLLM gets two engines, one built with LoRA and fed adapters, one without fed full weights, since a LoRA
engine applies its adapter over whatever weights it holds. After each sync the engine's log-probs of its own
sample are compared with the trainer's (max |gap|). The ~0.5B model (hidden 1024, 28 layers, 16 heads / 4 KV
heads, intermediate 4096, SmolLM2's vocabulary, tied: 476M parameters) is built at random in a temporary
directory, never saved elsewhere. Peak memory is about 6 GB (the 0.5B trainer beside two vLLM engines). Prints one row per (model, engine, mode) with the median over rounds, and
the adapter/full ratios.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

SMOLLM2 = Path.home() / ".cache/rlhf/models/SmolLM2-135M-Instruct"
PROMPT = [1, 9707, 11, 1070, 359, 346, 47]  # a fixed prompt (token ids of SmolLM2's vocabulary)
RANK, ALPHA = 16, 32


def random_half_b(out_dir: str) -> str:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_theta=1e5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(SMOLLM2).save_pretrained(out_dir)
    del model
    gc.collect()
    return out_dir


class Trainer:
    """The policy's side of a sync: ``TrainWorker``'s own weight readers over a peft model held in this process."""

    def __init__(self, model_dir: str):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        from rlhf_train_deepspeed.worker import TrainWorker

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = get_peft_model(
            base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear")
        ).eval()
        self.worker = TrainWorker.__new__(
            TrainWorker
        )  # no process group, no DeepSpeed engine: only its readers
        self.worker._module = lambda: self.model
        self.gen = torch.Generator().manual_seed(0)

    def step(self) -> None:
        """Move every adapter weight by noise, as an optimizer step would (B too, so the adapter is not zero)."""
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if "lora_" in name:
                    p.add_(0.02 * torch.randn(p.shape, generator=self.gen))

    def weights(self, mode: str):
        return (
            self.worker.adapter_weights()
            if mode == "adapter"
            else self.worker.named_weights(trainable_only=True)
        )

    @torch.no_grad()
    def logprobs(self, response: list[int]) -> list[float]:
        from rlhf_core.testing.engines import forward_logprobs

        return forward_logprobs(self.model, PROMPT, response, 1.0)


def sync(engine, trainer: Trainer, mode: str, port: int) -> tuple[float, int]:
    """One sync through a fresh two-rank gloo group: (seconds, payload bytes)."""
    from rlhf_core.weight_sync import init_sync_group

    stats = {}

    def send():
        group = init_sync_group("127.0.0.1", port, 0, 2, "gloo", 600.0)  # returns once the engine joined too
        t0 = time.perf_counter()
        stats.update(group.send(trainer.weights(mode)), t0=t0)
        group.close()

    sender = threading.Thread(target=send)
    sender.start()
    engine.init_weight_sync("127.0.0.1", port, 1, 2, "gloo", 600.0)
    engine.receive_weights()
    t1 = time.perf_counter()
    sender.join()
    engine.close_weight_sync()
    return t1 - stats["t0"], stats["bytes"]


def gap(engine, trainer: Trainer) -> float:
    from rlhf_core.types import GenerationRequest, SamplingParams

    engine.reset_prefix_cache()
    (out,) = engine.generate([GenerationRequest(PROMPT, SamplingParams(n=1, max_new_tokens=8, seed=0))])[0]
    want = trainer.logprobs(out.token_ids)
    return max(abs(a - b) for a, b in zip(out.logprobs, want, strict=True))


def free_port() -> int:
    from rlhf_core.testing.engines import free_port as port

    return port()


def bench_model(name: str, model_dir: str, engines: list[str], rounds: int) -> list[dict]:
    trainer = Trainer(model_dir)
    # the trainer's frozen base of each adapted layer (no copy: named_weights merges, then unmerges in place)
    targets = {
        n.removeprefix("base_model.model.") + ".weight": m.get_base_layer().weight.detach()
        for n, m in trainer.model.named_modules()
        if hasattr(m, "lora_A") and hasattr(m, "get_base_layer")
    }
    rows = []
    for kind in engines:
        if kind == "hf":
            from rlhf_core.rollout.hf_engine import HFEngine

            # no packed decode copies (rebuilt at the first generate after either kind of sync): 1.9 GB less at 0.5B
            hf = HFEngine(model_dir, device="cpu", pack_weights=False)
            pick = {"adapter": hf, "full": hf}
        else:
            from rlhf_rollout_vllm.engine import VLLMEngine

            common = dict(
                dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=128 << 20
            )
            pick = {
                "adapter": VLLMEngine(model_dir, lora_rank=RANK, **common),
                "full": VLLMEngine(model_dir, **common),
            }
        results = {"adapter": [], "full": []}
        for r in range(rounds):
            trainer.step()
            for mode in ("adapter", "full") if r % 2 == 0 else ("full", "adapter"):
                engine = pick[mode]
                if kind == "hf" and mode == "adapter":
                    # the previous full sync made the merged weights this engine's base: put W0 back (untimed)
                    engine.update_weights(targets)
                seconds, nbytes = sync(engine, trainer, mode, free_port())
                results[mode].append((seconds, nbytes, gap(engine, trainer)))
                print(
                    f"  {name} {kind} round {r} {mode}: {seconds:.3f} s, {nbytes / 2**20:.2f} MiB, "
                    f"gap {results[mode][-1][2]:.1e}",
                    file=sys.stderr,
                    flush=True,
                )
        for mode, res in results.items():
            rows.append(
                {
                    "model": name,
                    "engine": kind,
                    "mode": mode,
                    "mib": res[0][1] / 2**20,
                    "s": statistics.median(s for s, _, _ in res),
                    "gap": max(g for _, _, g in res),
                }
            )
        for engine in {id(e): e for e in pick.values()}.values():
            if hasattr(engine, "shutdown"):
                engine.shutdown()
        del pick
        gc.collect()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2,random-0.5b")
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    rows = []
    with tempfile.TemporaryDirectory(prefix="lora-sync-bench-") as tmp:
        for name in args.models.split(","):
            model_dir = str(SMOLLM2) if name == "smollm2" else random_half_b(tmp)
            rows += bench_model(name, model_dir, args.engines.split(","), args.rounds)
    print(
        f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"
    )
    print("| model | engine | sync | MiB per sync | s per sync (median) | max log-prob gap |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {row['model']} | {row['engine']} | {row['mode']} | {row['mib']:.2f} | {row['s']:.3f} | {row['gap']:.1e} |"
        )
    print("\n| model | engine | bytes full / adapter | s full / adapter |")
    print("| --- | --- | --- | --- |")
    for a, f in zip(rows[::2], rows[1::2], strict=True):
        print(f"| {a['model']} | {a['engine']} | {f['mib'] / a['mib']:.0f}x | {f['s'] / a['s']:.1f}x |")


if __name__ == "__main__":
    main()
