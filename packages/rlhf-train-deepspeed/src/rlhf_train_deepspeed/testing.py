"""Helpers for tests of this backend and of code that drives it (e.g. the RL controller's tests)."""

from __future__ import annotations

import json
import random


def words(ids) -> str:
    """Text of the tiny tokenizer's words ``w<i>`` (see ``rlhf_core.testing.tiny``)."""
    return " ".join(f"w{i}" for i in ids)


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def sft_rows(n: int, seed: int = 0) -> list[dict]:
    """A learnable SFT set: the response repeats the 4 prompt words shifted by 20 (``w3`` -> ``w23``)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(20) for _ in range(4)] for _ in range(n)]
    return [{"input": words(p), "output": words(x + 20 for x in p)} for p in prompts]


class ReusedGroup:
    """A ``group_factory`` for ``run_supervised`` that reloads the model into one long-lived group instead of
    starting new actors for every run (actor start-up dominates short runs on small machines)."""

    def __init__(self, num_workers: int):
        self.num_workers, self.group = num_workers, None

    def __call__(self, role, spec, ds, n, seed):
        from rlhf_train_deepspeed.group import create_worker_group

        if n != self.num_workers:
            raise ValueError(f"this ReusedGroup has {self.num_workers} ranks, the run asks for {n}")
        if self.group is None:
            self.group = create_worker_group(role, spec, ds, n, seed=seed)
        else:
            self.group.init_model(spec, ds, seed)
        return self.group

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None


def train_step(learner, micro_batches: list, loss: str, loss_cfg, counts: dict | None = None):
    """One optimizer step of ``loss``: ``forward_backward`` then ``optim_step``, on a group (its merged metrics)
    or on a rank in this process (a ``TrainWorker``, whose ``counts`` are required: its ``StepResult``)."""
    from rlhf_core.handles import wait

    wait(learner.forward_backward(micro_batches, loss, loss_cfg, counts))
    return wait(learner.optim_step())
