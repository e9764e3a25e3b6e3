"""Router replay's effect on a tiny MoE policy (issue 48): after a few policy updates, the engine/trainer
log-prob gap and the fraction of (token, layer) pairs whose experts differ, with and without replay.

For each model (tiny random Mixtral and Qwen3-MoE: 2 layers, 4 experts, top-2, hidden 64; "near-tie": the same
with its router weights scaled by 0.01, so that router logits are close and rounding can flip a choice) and
each arm (the policy trained with ``--actor.router_replay`` or without), one process runs a trainer rank
(ZeRO-0, ``--dtype``) and an HF engine that records routing, from the same initial weights. Each update:
sync the trainer's weights into the engine, sample ``--prompts`` x 2 x ``--new-tokens`` tokens, then measure
on that batch (the trainer's log-prob forward, once with its own routing, once replaying the engine's):

- gap = mean over sampled tokens of |engine log-prob - trainer log-prob|;
- differ = fraction of (token, layer) pairs where the trainer's own top-k set is not the engine's;

- flipped tokens: the sampled tokens predicted at a position where some layer's experts differ (own routing),
  and the gap on those alone, own routing / replayed;

then one on-policy PPO step (advantages: the group-normalised count of even token ids, lr ``--lr``) with or
without replay. The table gives each measure at the first measurement (the initial weights: both arms equal)
and after the last update; flipped tokens are counted over all measurements.

    DS_ACCELERATOR=cpu .venv/bin/python bench/moe_replay.py                    # bf16, 4 updates
    DS_ACCELERATOR=cpu .venv/bin/python bench/moe_replay.py --dtype fp32 --updates 2
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import torch

from rlhf_core.batches import PolicyMicroBatch, PolicyStepConfig, make_sequence_batch
from rlhf_core.config import ActorConfig, DSConfig
from rlhf_core.rollout.hf_engine import HFEngine
from rlhf_core.testing.moe import make_tiny_moe
from rlhf_core.types import GenerationRequest, SamplingParams
from rlhf_train_deepspeed import weights
from rlhf_train_deepspeed.worker import ModelSpec, TrainWorker


def tiny_model(root: Path, family: str, near_tie: bool) -> str:
    path = make_tiny_moe(root / f"{family}{'-tie' * near_tie}", family)
    if near_tie:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("gate.weight"):
                    p.mul_(0.01)
        model.save_pretrained(path)
    return path


def gap(lp: torch.Tensor, engine_lp: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean |trainer - engine| log-prob over the ``[B, T]`` ``mask``."""
    return float(((lp.float() - engine_lp).abs() * mask).sum() / mask.sum().clamp(min=1))


def flipped_tokens(own: torch.Tensor, batch) -> torch.Tensor:
    """``[B, T]``: the response tokens predicted at a position (``prompt_len - 1 + t``) where some layer's own
    experts (``own`` ``[layers, B * L, k]``, the trainer's padded forward) are not the engine's."""
    recorded = batch.routed_experts.flatten(0, 1).transpose(0, 1).sort(-1).values
    flips = ((own.sort(-1).values != recorded) & (recorded >= 0)).any(-1).any(0)  # [B * L]
    t = torch.arange(batch.num_response_positions)
    at = torch.arange(len(batch))[:, None] * batch.input_ids.shape[1] + batch.prompt_lens[:, None] - 1 + t
    return flips[at.clamp(max=len(flips) - 1)].float()


def run(path: str, dtype: str, replay: bool, updates: int, prompts: int, new_tokens: int, lr: float) -> list:
    """Per measurement (before each update and after the last): the gap with the trainer's own routing (all
    tokens, flipped tokens), replayed (the same two), the experts-differ fraction and the number of flipped
    tokens; the policy trained with ``replay``."""
    optim = ActorConfig(router_replay=True)  # the hooks; whether the step replays is the batch's field
    optim.adam.lr = lr
    worker = TrainWorker(0, 1)
    worker.init_distributed(worker.master_address())
    worker.init_model(
        ModelSpec(path, "causal", True, optim, total_steps=updates), DSConfig(zero_stage=0, param_dtype=dtype)
    )
    engine = HFEngine(path, dtype=dtype, record_routing=True)
    chosen = []  # each router's own experts, before replay replaces them: [layers, B * L, k] per forward
    for router in worker.model.routing.routers:
        router.register_forward_hook(lambda m, a, output: chosen.append(output[-1]), prepend=True)
    g = torch.Generator().manual_seed(5)
    out = []
    try:
        for u in range(updates + 1):
            engine.update_weights(weights.engine_weights(worker._module()))
            ids = [torch.randint(7, 60, (4 + i % 5,), generator=g).tolist() for i in range(prompts)]
            params = SamplingParams(n=2, max_new_tokens=new_tokens, seed=u, ignore_eos=True)
            outs = [o for r in engine.generate([GenerationRequest(p, params) for p in ids]) for o in r]
            rows = [p for p in ids for _ in range(2)]
            routed = [o.routed_experts for o in outs]
            batch = make_sequence_batch(rows, [o.token_ids for o in outs], 0, routed_experts=routed)
            plain = dataclasses.replace(batch, routed_experts=None)
            engine_lp = torch.tensor([o.logprobs for o in outs])
            mask = batch.response_mask().float()
            chosen.clear()
            (own,) = worker.forward([plain])
            (replayed,) = worker.forward([batch])
            differ = worker.model.routing.take()[1]["moe_experts_differ"]
            flipped = flipped_tokens(torch.stack(chosen[: len(worker.model.routing.routers)]), batch) * mask
            gaps = [gap(lp, engine_lp, m) for lp in (own, replayed) for m in (mask, flipped)]
            out.append((*gaps, differ, int(flipped.sum())))
            if u == updates:
                break
            reward = torch.tensor([sum(t % 2 == 0 for t in o.token_ids) for o in outs], dtype=torch.float)
            reward = reward.view(-1, 2)
            adv = ((reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-6)).view(-1)
            mb = PolicyMicroBatch(batch if replay else plain, None, adv[:, None] * mask, engine_lp * mask)
            counts = {"num_tokens": float(mask.sum()), "num_sequences": float(len(outs))}
            worker.forward_backward([mb], "policy", PolicyStepConfig(loss="ppo"), counts)
            worker.optim_step()
    finally:
        worker.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--updates", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(
        f"dtype {args.dtype}, {args.updates} updates, lr {args.lr}, {args.prompts} prompts x 2 x {args.new_tokens}"
    )
    print(
        "| model | policy trained | gap own routing, first / last | gap replayed, first / last "
        "| experts differ, first / last | flipped tokens, all | their gap, own / replayed |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for family in ("mixtral", "qwen3_moe"):
            for near_tie in (False, True):
                path = tiny_model(Path(tmp), family, near_tie)
                for replay in (False, True):
                    r = run(path, args.dtype, replay, args.updates, args.prompts, args.new_tokens, args.lr)
                    flips = sum(x[5] for x in r)
                    on_flips = [sum(x[i] * x[5] for x in r) / max(flips, 1) for i in (1, 3)]
                    cells = [
                        f"{family}{', near-tie' * near_tie}",
                        "with replay" if replay else "without",
                        *(f"{r[0][i]:.2e} / {r[-1][i]:.2e}" for i in (0, 2)),
                        f"{r[0][4]:.2%} / {r[-1][4]:.2%}",
                        str(flips),
                        f"{on_flips[0]:.2e} / {on_flips[1]:.2e}" if flips else "-",
                    ]
                    print(f"| {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
