"""GRPO written by hand over rlhf's public primitives (``rlhf_cli.primitives``: learner, sampler, sync), on
the demo's task: a random tiny Llama, a short SFT on two-digit sums by a teacher that forgets carries, then
sampled groups scored by the demo's reward, group-normalised advantages, the registered ``policy`` loss.

    python examples/custom_grpo_loop.py [--steps 150] [--seed 0] [--workdir runs/custom-grpo]
"""

import argparse
import json
import random
import runpy
from pathlib import Path

import torch

import rlhf_cli
from rlhf_cli.demo import accuracy, make_assets
from rlhf_core.batches import PolicyMicroBatch, PolicyStepConfig, make_sequence_batch
from rlhf_core.handles import wait
from rlhf_core.types import GenerationRequest, SamplingParams

PROMPTS, GROUP, MICRO = 16, 8, 64  # per step: 16 prompts x 8 samples, in micro-batches of 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--sft-epochs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default="runs/custom-grpo")
    args = ap.parse_args()
    work = Path(args.workdir).resolve()
    files = make_assets(work, args.seed)
    fp32 = {"zero_stage": 0, "param_dtype": "fp32"}
    sft_data = {"dataset": [str(files["sft"])], "input_key": "input", "output_key": "output", "max_len": 16}
    sft_steps = {"batch_size": 32, "micro_batch_size": 32, "max_epochs": args.sft_epochs, "seed": args.seed}
    if not (work / "sft" / "config.json").exists():  # a workdir's SFT model is reused
        rlhf_cli.train(  # the demo's SFT stage, shorter
            "sft",
            model={"model_name_or_path": str(files["base"]), "adam": {"lr": 3e-3}},
            data=sft_data,
            train=sft_steps,
            ds=fp32,
            ckpt={"output_dir": str(work / "sft")},
        )
    before = accuracy(work / "sft", files["eval"])
    reward_func = runpy.run_path(str(files["reward"]))["reward_func"]
    rows = [json.loads(line) for line in files["prompts"].read_text().splitlines()]
    rng, adam = random.Random(args.seed), {"lr": 5e-4, "betas": [0.9, 0.999]}
    with rlhf_cli.primitives(  # what `rlhf train ppo` would build from these sections, without its loop
        actor={"model_name_or_path": str(work / "sft"), "lr_scheduler": "constant", "adam": adam},
        rollout={"n_samples_per_prompt": GROUP},
        reward={"remote_url": str(files["reward"])},  # the engines' own (unused here: the loop scores)
        algo={"advantage": {"estimator": "group_norm"}, "kl": {"init_coef": 0}},  # no critic, no reference
        train={"colocate_all": True, "micro_batch_size": MICRO, "seed": args.seed},
        ds=fp32,
        ckpt={"output_dir": str(work / "rl")},
    ) as (learner, sampler, sync, tokenizer):
        for step in range(args.steps):
            batch = rng.sample(rows, PROMPTS)
            prompts = [tokenizer(r["input"], add_special_tokens=False)["input_ids"] for r in batch]
            seeds = [args.seed * 10**6 + step * PROMPTS + i for i in range(PROMPTS)]  # repeatable samples
            params = [SamplingParams(GROUP, max_new_tokens=4, seed=s) for s in seeds]
            requests = [GenerationRequest(p, sp) for p, sp in zip(prompts, params)]
            samples = [s for group in wait(sampler.sample(requests)) for s in group]  # GROUP per prompt
            replies = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples]
            texts = [f"{batch[i // GROUP]['input']} {reply}" for i, reply in enumerate(replies)]
            labels = [batch[i // GROUP]["label"] for i in range(len(samples))]
            rewards = torch.tensor(reward_func(texts, None, labels)["rewards"]).view(PROMPTS, GROUP)
            # GRPO: a sample's reward against its group's, the same advantage for each of its tokens
            mean, std = rewards.mean(1, keepdim=True), rewards.std(1, keepdim=True)
            advantages = ((rewards - mean) / (std + 1e-6)).flatten()
            pairs = [(prompts[i // GROUP], s.token_ids) for i, s in enumerate(samples)]
            micro_batches = []
            for i in range(0, len(pairs), MICRO):  # on-policy: no old log-probs (the current ones, detached)
                seq = make_sequence_batch(*zip(*pairs[i : i + MICRO]), tokenizer.pad_token_id)
                adv = advantages[i : i + MICRO, None] * seq.response_mask()
                micro_batches.append(PolicyMicroBatch(seq, None, adv))
            wait(learner.forward_backward(micro_batches, "policy", PolicyStepConfig()))
            metrics = wait(learner.optim_step())
            wait(sync(learner, sampler))
            print(f"step {step}: reward {rewards.mean():.3f}, loss {metrics['loss']:.4f}", flush=True)
        wait(learner.export(str(work / "rl" / "model")))
    after = accuracy(work / "rl" / "model", files["eval"])
    print(f"held-out accuracy: {before:.1%} after SFT, {after:.1%} after GRPO")
    (work / "accuracy.json").write_text(json.dumps({"before": before, "after": after}))


if __name__ == "__main__":
    main()
