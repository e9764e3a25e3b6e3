"""Issue 51: SmolLM2-135M-Instruct GRPO as responses grow, rlhf with its default flags.

The workload of bench/grpo_vs_trl.py's row R (8 chat prompts x 8 samples, micro-batches of 16, GRPO, one
AdamW step per RL step) with only ``--rollout.max_new_tokens`` changed and no minimum length: replies end
where the model ends them, so most are short and a few run to the limit. One fresh ``rlhf train ppo``
process per length, one at a time; the process tree's RSS is polled every 50 ms and its CPU seconds are
read at every step's metrics row (the machine may be shared: CPU seconds, not wall seconds, say what a step
costs). ``--report`` writes the section of bench/grpo_vs_trl.md from bench/results/long-*.json.

    DS_ACCELERATOR=cpu .venv/bin/python bench/long_responses.py --lengths 16,128,512,1024
    DS_ACCELERATOR=cpu .venv/bin/python bench/long_responses.py --report
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import grpo_vs_trl as bench  # noqa: E402

MD = HERE / "grpo_vs_trl.md"
BEGIN, END = "<!-- long responses: begin (bench/long_responses.py) -->", "<!-- long responses: end -->"


def flags(root: Path, out: Path, new_tokens: int, steps: int) -> list[str]:
    """Row R's rlhf-default flags with ``new_tokens`` as the limit and no minimum."""
    bench.GRID["R"] = (*bench.GRID["R"][:3], new_tokens)
    args = SimpleNamespace(size="R", prompts=8, n=8, warmup=0, steps=steps, beta=0.0, dtype="fp32")
    out_flags = bench.rlhf_flags(args, root, out, "rlhf-default")
    at = out_flags.index("--rollout.min_new_tokens")
    return out_flags[:at] + out_flags[at + 2 :]


def run(new_tokens: int, steps: int, threads: int, workdir: Path) -> dict:
    root, out = workdir / "R", workdir / f"out-{new_tokens}"
    root.mkdir(parents=True, exist_ok=True)
    bench.make_workload(root, 576, 30, 45, 8 * steps * 2, real=True)
    subprocess.run(["rm", "-rf", str(out)], check=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "RLHF_NO_PROGRESS": "1",
    }
    cmd = [sys.executable, __file__, "--child", *flags(root, out, new_tokens, steps)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    mem = bench.TreeMemory(proc.pid)
    mem.start()
    cpu_at_row: list[float] = []  # the tree's CPU seconds when each step's metrics row appeared
    metrics = out / "metrics.jsonl"
    while proc.poll() is None:
        rows = metrics.read_text().count("\n") if metrics.exists() else 0
        if rows > len(cpu_at_row):
            cpu = sum(t.user + t.system for p in mem.tree() for t in [p.cpu_times()])
            cpu_at_row += [cpu] * (rows - len(cpu_at_row))
        time.sleep(0.2)
    stderr = proc.stderr.read()
    mem.done.set()
    mem.join()
    if proc.returncode:
        sys.exit(f"rlhf exited with {proc.returncode}:\n{stderr[-4000:]}")
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    rows = [r for r in rows if "timing/step_total" in r]
    return {
        "new_tokens": new_tokens,
        "steps": rows,
        "phase_cpu_s": json.loads((out / "phase_cpu.json").read_text()),
        "cpu_s_per_step": [b - a for a, b in zip(cpu_at_row, cpu_at_row[1:])],
        "peak_rss_mib": mem.peak_rss / 2**20,
        "command": " ".join(cmd),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "threads": threads,
    }


def child(argv: list[str]) -> None:
    """``rlhf train ppo argv`` in this process, with the CPU seconds of each step's generation and policy
    update (``time.process_time``: every thread of the process; a single-process run's phases do not
    overlap) written to ``<output_dir>/phase_cpu.json``."""
    from rlhf_cli.main import main as rlhf_main
    from rlhf_cli.rl.rollout import Rollout
    from rlhf_cli.rl.step import PolicyStep

    cpu: dict[str, list[float]] = {"generation": [], "update": []}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                cpu[name].append(time.process_time() - t)

        return wrapper

    Rollout.collect = timed("generation", Rollout.collect)
    PolicyStep.train = timed("update", PolicyStep.train)
    rc = rlhf_main(["train", "ppo", *argv])
    out = Path(argv[argv.index("--ckpt.output_dir") + 1])
    (out / "phase_cpu.json").write_text(json.dumps(cpu))
    sys.exit(rc)


def report() -> None:
    lines = [
        BEGIN,
        "## Long responses (issue 51)",
        "",
        "SmolLM2-135M-Instruct GRPO, row R's workload with only `--rollout.max_new_tokens` changed and no",
        "minimum length (replies end where the model ends them), rlhf with its default flags (one process,",
        "fp32); the first step dropped (warm-up). CPU seconds of each phase (`time.process_time` of the one",
        "process), medians over the measured steps; per response token = over 64 x the step's mean reply.",
        "Rerun (on a quiet machine, `--threads 2`):",
        "",
        "    DS_ACCELERATOR=cpu .venv/bin/python bench/long_responses.py --lengths 16,128,512,1024",
        "",
        "| max new tokens | threads | mean / max response | generation CPU s | update CPU s | step CPU s |"
        " update CPU ms / token | generation CPU ms / token | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    results = [json.loads(p.read_text()) for p in HERE.glob("results/long-*.json")]
    for r in sorted(results, key=lambda r: (r["new_tokens"], r["date"])):
        steps, cpu = r["steps"][1:], {k: v[1:] for k, v in r["phase_cpu_s"].items()}
        tokens = [64 * s["response_length/mean"] for s in steps]
        means = [s["response_length/mean"] for s in steps]
        update = [1000 * c / t for c, t in zip(cpu["update"], tokens)]
        generation = [1000 * c / t for c, t in zip(cpu["generation"], tokens)]
        lines.append(
            f"| {r['new_tokens']} | {r['threads']} | {min(means):.0f}-{max(means):.0f} / "
            f"{max(s['response_length/max'] for s in steps):.0f} | {statistics.median(cpu['generation']):.1f} | "
            f"{statistics.median(cpu['update']):.1f} | {statistics.median(r['cpu_s_per_step']):.1f} | "
            f"{statistics.median(update):.1f} | {statistics.median(generation):.1f} | {r['peak_rss_mib']:.0f} |"
        )
    lines.append(END)
    text = MD.read_text()
    if BEGIN in text:
        text = text[: text.index(BEGIN)] + "\n".join(lines) + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(lines) + "\n"
    MD.write_text(text)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="16,128,512,1024", help="values of --rollout.max_new_tokens")
    p.add_argument("--steps", type=int, default=3, help="RL steps per run, the first dropped")
    p.add_argument("--threads", type=int, default=2, help="torch threads (1 on a machine other jobs share)")
    p.add_argument("--workdir", default="/tmp/rlhf-bench-long")
    p.add_argument("--report", action="store_true", help="only rewrite the section from bench/results")
    args = p.parse_args()
    for n in [] if args.report else [int(x) for x in args.lengths.split(",")]:
        r = run(n, args.steps, args.threads, Path(args.workdir))
        (HERE / "results").mkdir(exist_ok=True)
        (HERE / "results" / f"long-{n}-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(
            json.dumps(r, indent=1)
        )
        print(f"{n}: peak RSS {r['peak_rss_mib']:.0f} MiB, CPU s per step {r['cpu_s_per_step']}", flush=True)
    report()


if __name__ == "__main__":
    main()
