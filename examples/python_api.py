"""The Python API in one run: GRPO with a reward function and a list of prompts, from Python.

    python examples/python_api.py [OUTPUT_DIR]        # default runs/python_api

It builds a tiny random Llama with a word vocabulary (``w0 .. w99``) in OUTPUT_DIR/model and trains it for
3 steps to answer with small words: a response's reward is the fraction of its words below ``w50``. The
run fits one process, so no Ray starts; it takes seconds on a laptop CPU. With a real model, give its path
or hub id as ``actor.model_name_or_path`` instead of the tiny one.
"""

import sys
from pathlib import Path

from rlhf_cli import train
from rlhf_core.testing.tiny import make_tiny_llama


def small_words(queries, prompts, labels, **kwargs):
    """Called as a reward file's ``reward_func`` is: ``queries`` are prompt + response texts, ``prompts`` the
    prompt texts, ``labels`` the ``--data.label_key`` column (none here). It may be ``async def``."""
    rewards = []
    for query, prompt in zip(queries, prompts):
        words = query[len(prompt) :].split()
        rewards.append(sum(w.startswith("w") and int(w[1:]) < 50 for w in words) / max(1, len(words)))
    return rewards


def main(out: Path):
    model = make_tiny_llama(out / "model", num_words=100)
    prompts = [{"input": f"w{i} w{(7 * i) % 100}"} for i in range(16)]
    result = train(
        "ppo",
        reward_func=small_words,
        dataset=prompts,  # a list of dicts or a datasets.Dataset: written to the run directory as data/dataset.jsonl
        actor={"model_name_or_path": model, "adam": {"lr": 1e-3}},
        algo={"advantage": {"estimator": "group_norm"}},  # GRPO
        rollout={"batch_size": 4, "n_samples_per_prompt": 4, "max_new_tokens": 8},
        train={"batch_size": 16, "micro_batch_size": 8, "max_steps": 3},
        data={"max_len": 16},
        ckpt={"output_dir": str(out / "run")},
    )
    for row in result.metrics:
        print(f"step {row['step']}: reward {row['reward/mean']:.3f}, policy loss {row['policy/loss']:+.4f}")
    print(f"run directory: {result.output_dir}")
    return result


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/python_api"))
