"""What the async pipeline's fixed schedule costs in overlap (issue 29, item 4): the controller's async loop
with a fake engine and trainer that sleep (no model, no Ray), against the free-running bounded queue it
replaced (``RLController`` at commit 8687ef3, read with ``git show``):

    .venv/bin/python bench/async_schedule.py [--steps 12] [--rounds 3] [--baseline 8687ef3]

Per case (seconds of generation per batch, of training per step) both controllers run in turns, ``--rounds``
times each, ``--train.async_queue_size 1``; prints the best wall time of each, their ratio and what the
sync pipeline would take (steps x (generation + training)). The sleeps leave the CPU idle, so the ratio is the
pipelines' own: how well generation overlaps training, and the hand-off between the threads.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlhf_cli.rl import controller as scheduled
from rlhf_cli.rl.prompts import Prompt, PromptStream
from rlhf_core.config import RLConfig
from rlhf_core.types import Trajectory

ROOT = Path(__file__).resolve().parents[1]


def baseline_module(commit: str):
    source = subprocess.run(
        ["git", "show", f"{commit}:packages/rlhf-cli/src/rlhf_cli/rl/controller.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "queue_controller.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("queue_controller", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class FakeExperience(list):
    def __init__(self, trajectories):
        super().__init__(trajectories)
        self.info = {"kl/mean": 0.0}
        self.sequences = [[1]]


class FakeActor:
    def push_weights_to_hosted(self, name):
        pass


def wall_time(module, steps: int, generate_s: float, train_s: float) -> float:
    cfg = RLConfig()
    cfg.algo.advantage.estimator = "group_norm"
    cfg.rollout.n_samples_per_prompt, cfg.rollout.batch_size = 2, 2
    cfg.train.async_enable, cfg.train.max_steps = True, steps
    prompts = [Prompt(i, [1], "p") for i in range(2 * steps)]
    ctl = module.RLController(
        cfg, module.Groups(actor=FakeActor(), rollout=[], rollout_in_actor=True), PromptStream(prompts, 0), 0
    )

    def generate(prompts, step, eval_mode=False):
        time.sleep(generate_s)
        return [
            Trajectory([1], [3], [1], [0.0], prompt_uid=p.uid, sample_index=i, reward=0.0)
            for p in prompts
            for i in range(2)
        ], {}

    def train(exp, step):
        time.sleep(train_s)
        return {}

    if hasattr(ctl, "rollout"):  # the controller split into its parts (issue 28)
        ctl.rollout.generate, ctl.policy.train = generate, lambda exp, step, kl_coef: train(exp, step)
        ctl.experience.make = lambda trajs, kl_coef: FakeExperience(trajs)
    else:
        ctl.generate, ctl.train, ctl.make_experience = (
            generate,
            train,
            lambda batch: FakeExperience(batch.trajectories),
        )
    t0 = time.perf_counter()
    ctl.fit()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", default="8687ef3")
    args = parser.parse_args()
    queue = baseline_module(args.baseline)
    print(
        "| generation s | training s | queue (before) s | schedule s | schedule / queue | sync would take s |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for generate_s, train_s in ((0.1, 0.1), (0.2, 0.1), (0.1, 0.2), (0.5, 0.5)):
        times: dict[str, list[float]] = {"queue": [], "schedule": []}
        for _ in range(args.rounds):
            times["queue"].append(wall_time(queue, args.steps, generate_s, train_s))
            times["schedule"].append(wall_time(scheduled, args.steps, generate_s, train_s))
        q, s = min(times["queue"]), min(times["schedule"])
        print(
            f"| {generate_s} | {train_s} | {q:.2f} | {s:.2f} | {s / q:.3f} | {args.steps * (generate_s + train_s):.1f} |"
        )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
