"""On-policy distillation (`rlhf train ppo --algo.advantage.estimator opd`) beside `rlhf train kd` on the same
budget: tests/test_opd.py's task (a tiny teacher answers every prompt with `w7`; the student is a random
initialisation), 4 optimizer steps of 32 sequences at lr 3e-2 each, from the same student and teacher. OPD
trains on 32 prompts x 4 samples of its own; KD on the same 32 prompts x 4 rows with the teacher's answer,
teacher-forced. Held out (40 prompts neither saw): greedy accuracy and the reverse KL of the first answer
position, as the test measures them. A quality measurement, not a speed one.

    .venv/bin/python bench/opd_vs_kd.py [--async]     # --async: the OPD run also with --train.async_enable
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_opd as task_lib  # noqa: E402 - the task's helpers live with the test

from rlhf_core.testing.tiny import make_tiny_llama  # noqa: E402


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="opd_vs_kd_"))
    student = make_tiny_llama(
        root / "student", seed=0, num_words=task_lib.NUM_WORDS, hidden_size=128, intermediate_size=128
    )
    teacher = task_lib.make_teacher(root / "teacher")
    train = task_lib.prompts(1, 64)
    (root / "prompts.jsonl").write_text("".join(json.dumps({"input": p}) + "\n" for p in train))
    # OPD's 4 steps of 8 prompts draw the first 32 (one pass, in order); KD gets them 4 times each
    (root / "kd.jsonl").write_text(
        "".join(json.dumps({"input": p, "output": task_lib.ANSWER}) + "\n" for p in train[:32] * 4)
    )
    task = {"student": student, "teacher": teacher, "data": str(root / "prompts.jsonl")}
    held = task_lib.prompts(2, 40)
    rows = [
        ("teacher", *task_lib.held_out(teacher, teacher, held), 0.0),
        ("student at start", *task_lib.held_out(student, teacher, held), 0.0),
    ]
    runs = [("opd (sync)", task_lib.opd_args(task, root / "opd", 4), root / "opd" / "model")]
    if "--async" in sys.argv:
        runs.append(
            (
                "opd (async)",
                [*task_lib.opd_args(task, root / "opd_async", 4), "--train.async_enable"],
                root / "opd_async" / "model",
            )
        )
    for coef in ("0.4", "1.0"):
        out = root / f"kd_{coef}"
        runs.append(
            (
                f"kd, kd_coef {coef}",
                [
                    "train",
                    "kd",
                    "--model.model_name_or_path",
                    student,
                    "--teacher.model_name_or_path",
                    teacher,
                    "--teacher.kd_coef",
                    coef,
                    "--data.dataset",
                    str(root / "kd.jsonl"),
                    "--data.output_key",
                    "output",
                    "--data.max_len",
                    "12",
                    "--train.batch_size",
                    "32",
                    "--train.micro_batch_size",
                    "32",
                    "--ds.param_dtype",
                    "fp32",
                    "--model.adam.lr",
                    "3e-2",
                    "--model.lr_warmup_ratio",
                    "0",
                    "--train.max_epochs",
                    "1",
                    "--ckpt.output_dir",
                    str(out),
                ],
                out,
            )
        )
    for name, args, model in runs:
        start = time.perf_counter()
        done = task_lib.run_cli(args)
        if done.returncode:
            raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
        rows.append((name, *task_lib.held_out(model, teacher, held), time.perf_counter() - start))
    print("| model | held-out greedy accuracy | held-out reverse KL (first answer position) | run wall s |")
    print("| --- | --- | --- | --- |")
    for name, acc, kl, wall in rows:
        print(f"| {name} | {acc:.3f} | {kl:.3f} | {wall:.0f} |")


if __name__ == "__main__":
    main()
