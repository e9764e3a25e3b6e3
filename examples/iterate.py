"""Rejection sampling, iterative DPO and conditional SFT as pipelines of ordinary ``rlhf`` commands.

Each iteration k runs two commands, printed before they run:

1. ``rlhf generate``: the current policy samples ``--best-of-n`` responses to the prompts of iteration
   k (``--iter k``: rows ``[k R, (k+1) R)``, fresh prompts every iteration), the reward source scores
   them and a post-processor filters them: ``rs`` keeps each prompt's best sample, ``iter_dpo`` pairs
   its best and worst, ``csft`` writes every sample's reward into its prompt.
2. ``rlhf train sft`` (rs, csft) or ``rlhf train dpo`` (iter_dpo, the reference is always the first
   policy) on that output. Its model is the next iteration's policy.

Resumable at any stage: a stage that finished leaves ``<workdir>/iter<k>/<stage>.done`` and is skipped
when the same command runs again; an interrupted generation resumes from its samples file; an
interrupted training stage runs again from the iteration's policy.

    python examples/iterate.py rs --policy sft_model --prompts prompts.jsonl --reward reward.py \\
        --workdir runs/rs --iterations 3 --prompts-per-iter 1024 --best-of-n 4 \\
        --generate-flags "--label_key label --max_new_tokens 512" \\
        --train-flags "--learning_rate 2e-6 --train_batch_size 128 --micro_train_batch_size 2"

Extra flags go to every ``rlhf generate`` / ``rlhf train`` of the pipeline unchanged.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

POST_PROCESSOR = {"rs": "rs", "iter_dpo": "iter_dpo", "csft": "csft"}


def stage_commands(args, k: int, policy: str) -> list[tuple[str, list[str]]]:
    """The two commands of iteration ``k`` starting from ``policy``."""
    it = Path(args.workdir) / f"iter{k}"
    reward_flag = "--reward_pretrain" if Path(args.reward).is_dir() else "--remote_rm_url"
    generate = [
        "rlhf",
        "generate",
        "--pretrain",
        policy,
        "--dataset",
        args.prompts,
        "--iter",
        str(k),
        "--rollout_batch_size",
        str(args.prompts_per_iter),
        "--best_of_n",
        str(args.best_of_n),
        reward_flag,
        args.reward,
        "--post_processor",
        POST_PROCESSOR[args.mode],
        "--output_path",
        str(it / "data.jsonl"),
        *shlex.split(args.generate_flags),
    ]
    if args.mode == "iter_dpo":
        train = [
            "rlhf",
            "train",
            "dpo",
            "--pretrain",
            policy,
            "--ref_pretrain",
            args.policy,
            "--dataset",
            str(it / "data.jsonl"),
            "--prompt_key",
            "prompt",
            "--chosen_key",
            "chosen",
            "--rejected_key",
            "rejected",
        ]
    else:  # the prompt is already templated by generate; the loss covers the response only
        train = [
            "rlhf",
            "train",
            "sft",
            "--pretrain",
            policy,
            "--dataset",
            str(it / "data.jsonl"),
            "--input_key",
            "input",
            "--output_key",
            "output",
        ]
    train += ["--save_path", str(it / "model"), *shlex.split(args.train_flags)]
    return [("generate", generate), ("train", train)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=sorted(POST_PROCESSOR), help="rs, iter_dpo or csft")
    ap.add_argument("--policy", required=True, help="the initial policy (and the DPO reference)")
    ap.add_argument(
        "--prompts", required=True, help="the prompt dataset (iteration k uses rows [k R, (k+1) R))"
    )
    ap.add_argument(
        "--reward",
        required=True,
        help="a reward model directory (--reward_pretrain), or a reward .py file or server URL "
        "(--remote_rm_url)",
    )
    ap.add_argument("--workdir", required=True, help="where each iteration's data and model go")
    ap.add_argument("--iterations", type=int, default=1)
    ap.add_argument("--prompts-per-iter", type=int, default=1024, help="R, prompts per iteration")
    ap.add_argument("--best-of-n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--generate-flags", default="", help="more flags for every rlhf generate")
    ap.add_argument("--train-flags", default="", help="more flags for every rlhf train")
    args = ap.parse_args(argv)
    policy = args.policy
    for k in range(args.iterations):
        for stage, cmd in stage_commands(args, k, policy):
            marker = Path(args.workdir) / f"iter{k}" / f"{stage}.done"
            if marker.exists():
                print(f"[iterate] iteration {k} {stage}: done before, skipped", flush=True)
                continue
            print(
                f"\n[iterate] iteration {k} {stage}:\n  " + shlex.join(cmd).replace(" --", " \\\n    --"),
                flush=True,
            )
            done = subprocess.run([sys.executable, "-m", "rlhf_cli.main", *cmd[1:]])
            if done.returncode != 0:
                print(
                    f"[iterate] iteration {k} {stage} failed (exit {done.returncode}); run the same command "
                    "again to resume",
                    file=sys.stderr,
                )
                return done.returncode
            marker.write_text(json.dumps({"command": cmd}) + "\n")
        policy = str(Path(args.workdir) / f"iter{k}" / "model")
    print(f"[iterate] {args.iterations} iteration(s) done; the policy is {policy}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
