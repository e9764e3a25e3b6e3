"""Same numbers before and after: short runs at a base revision and at the working tree, compared exactly.

Each run (RL and supervised, tiny models built here, fixed seeds) goes once on the packages of ``--base``
(``git archive`` of ``packages/``, put first on ``PYTHONPATH`` as ``bench/grpo_vs_trl.py``'s ``NAME@REV``
rows do) and once on the working tree, each invocation a fresh process. Then every metric of each run's
``metrics.jsonl`` must be equal (same keys, same type, same value; timing, memory and wall-clock keys are
left out: ``excluded``) and every tensor of the final weights bitwise equal (``torch.equal``, dtype and
shape). Both sides read the same model, data and reward files, made once per invocation.

    DS_ACCELERATOR=cpu .venv/bin/python bench/exactness.py --base 23c3c28    # writes bench/exactness.md
    DS_ACCELERATOR=cpu .venv/bin/python bench/exactness.py --base main --runs grpo-single,sft --no-write
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent

# metrics that measure time, speed or memory, not the computation: left out of the comparison (the keys
# seen so far: timing/*, perf/*, the supervised loop's tokens_per_s, and the wall-clock time of each row)
EXCLUDED_PREFIXES = ("timing/", "perf/")
EXCLUDED_KEYS = ("time", "tokens_per_s")

REWARD = '''
def reward_func(queries, prompts, labels, **kwargs):
    """Fraction of response words among w0..w49."""
    out = []
    for q, p in zip(queries, prompts):
        words = q[len(p):].replace("</s>", " ").split()
        out.append(sum(w.startswith("w") and int(w[1:]) < 50 for w in words) / max(len(words), 1))
    return out
'''


def excluded(key: str) -> bool:
    """Whether metric ``key`` measures time, speed or memory (``mem`` anywhere in its name counts)."""
    return key.startswith(EXCLUDED_PREFIXES) or key in EXCLUDED_KEYS or "mem" in key.lower()


def same_value(a, b) -> bool:
    """Exact equality of two JSON values, type included (NaN equals NaN: the same bits were logged)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def compare_metrics(a: Path, b: Path) -> tuple[set[str], set[str], str | None]:
    """(keys compared, keys left out, first difference or None) of two ``metrics.jsonl`` files: the same
    rows, each with the same keys (:func:`excluded` ones aside) and :func:`same_value` values."""
    rows_a = [json.loads(x) for x in a.read_text().splitlines() if x.strip()]
    rows_b = [json.loads(x) for x in b.read_text().splitlines() if x.strip()]
    compared, left_out = set(), set()
    if len(rows_a) != len(rows_b):
        return compared, left_out, f"{len(rows_a)} metric rows vs {len(rows_b)}"
    for i, (ra, rb) in enumerate(zip(rows_a, rows_b)):
        left_out |= {k for k in [*ra, *rb] if excluded(k)}
        keys_a, keys_b = ra.keys() - left_out, rb.keys() - left_out
        if keys_a != keys_b:
            only = f"only in base {sorted(keys_a - keys_b)}, only in new {sorted(keys_b - keys_a)}"
            return compared, left_out, f"row {i + 1}: keys {only}"
        for k in [k for k in ra if k in keys_a]:  # in the order logged: the earliest difference first
            if not same_value(ra[k], rb[k]):
                return compared, left_out, f"row {i + 1} {k}: {ra[k]!r} vs {rb[k]!r}"
            compared.add(k)
    return compared, left_out, None


def weight_files(run: Path) -> list[Path]:
    """The final weights of a run: its ``model/`` export (RL) or the output directory itself (supervised)."""
    where = run / "model" if (run / "model" / "config.json").is_file() else run
    return sorted(where.glob("*.safetensors"))


def compare_weights(a: Path, b: Path) -> tuple[int, str | None]:
    """(number of tensors compared, first difference or None) of two runs' final weights."""
    import torch
    from safetensors.torch import load_file

    files_a, files_b = weight_files(a), weight_files(b)
    if not files_a or [f.name for f in files_a] != [f.name for f in files_b]:
        return 0, f"weight files {[f.name for f in files_a]} vs {[f.name for f in files_b]}"
    n = 0
    for fa, fb in zip(files_a, files_b):
        ta, tb = load_file(fa), load_file(fb)
        if ta.keys() != tb.keys():
            only = (
                f"only in base {sorted(ta.keys() - tb.keys())}, only in new {sorted(tb.keys() - ta.keys())}"
            )
            return n, f"{fa.name}: tensors {only}"
        for k in sorted(ta):
            x, y = ta[k], tb[k]
            if x.dtype != y.dtype or x.shape != y.shape:
                return n, f"{k}: {x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)}"
            if not torch.equal(x, y):
                return n, f"{k}: max abs diff {(x.double() - y.double()).abs().max().item():.3g}"
            n += 1
    return n, None


def compare_runs(a: Path, b: Path) -> dict:
    """The row of the table for two output directories of the same run: ``a`` the base's, ``b`` the new."""
    compared, left_out, metrics_diff = compare_metrics(a / "metrics.jsonl", b / "metrics.jsonl")
    tensors, weights_diff = compare_weights(a, b)
    return {
        "metrics_equal": metrics_diff is None,
        "metric_keys": len(compared),
        "left_out": left_out,
        "weights_equal": weights_diff is None,
        "tensors": tensors,
        "first_difference": metrics_diff or weights_diff,
    }


# --- the runs ------------------------------------------------------------------------------------------


def make_assets(root: Path) -> dict[str, str]:
    """The tiny model (100 words), RL prompts, reward file, SFT rows and preference pairs under ``root``."""
    from rlhf_core.testing.tiny import make_tiny_llama

    root.mkdir(parents=True, exist_ok=True)
    model = make_tiny_llama(root / "model", num_words=100)
    lines = {
        "prompts.jsonl": [
            {"input": f"w{i} w{(i * 7) % 100} w{(i * 13) % 100}", "label": str(i % 10)} for i in range(48)
        ],
        "sft.jsonl": [{"input": f"w{i} w{i + 1}", "output": f"w{(i * 3) % 50}"} for i in range(40)],
        "prefs.jsonl": [
            {
                "prompt": f"w{i}",
                "chosen": f"w{i % 50} w{(i + 3) % 50}",
                "rejected": f"w{50 + i % 50} w{50 + (i + 7) % 50}",
            }
            for i in range(32)
        ],
    }
    for name, rows in lines.items():
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "reward.py").write_text(REWARD)
    return {"model": model, **{name.split(".")[0]: str(root / name) for name in [*lines, "reward.py"]}}


def rl_flags(a: dict, steps: int, *more: str, estimator: str = "group_norm", kl: str = "0") -> list[str]:
    """RL on the tiny model: 4 prompts x 4 samples of 4 tokens a step, one optimizer step of 16, fp32."""
    return [
        "train", "ppo", "--actor.model_name_or_path", a["model"], "--reward.remote_url", a["reward"],
        "--data.prompt_dataset", a["prompts"], "--data.label_key", "label", "--data.max_len", "16",
        "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "4", "--rollout.max_new_tokens", "4",
        "--rollout.micro_batch_size", "8", "--train.batch_size", "16", "--train.micro_batch_size", "4",
        "--algo.advantage.estimator", estimator, "--algo.kl.init_coef", kl, "--actor.adam.lr", "1e-3",
        "--actor.lr_warmup_ratio", "0", "--ds.param_dtype", "fp32", "--train.max_steps", str(steps), *more,
    ]  # fmt: skip


ONE_PROCESS = ("--ds.zero_stage", "0", "--train.colocate_all", "--ray.single_process", "true")


def supervised_flags(a: dict, mode: str) -> list[str]:
    """One epoch of ``mode`` (sft: 40 rows, dpo: 32 pairs) in batches of 8, in the driver's process, fp32."""
    data = {
        "sft": ["--data.dataset", a["sft"], "--data.input_key", "input", "--data.output_key", "output"],
        "dpo": ["--data.dataset", a["prefs"], "--data.prompt_key", "prompt", "--data.chosen_key", "chosen",
                "--data.rejected_key", "rejected"],
    }[mode]  # fmt: skip
    return [
        "train", mode, "--model.model_name_or_path", a["model"], *data, "--data.max_len", "8",
        "--train.batch_size", "8", "--train.micro_batch_size", "4", "--train.max_epochs", "1",
        "--model.adam.lr", "3e-3", "--ds.zero_stage", "0", "--ds.param_dtype", "fp32",
        "--ray.single_process", "true",
    ]  # fmt: skip


def runs(a: dict) -> dict[str, tuple[str, list[list[str]]]]:
    """Each run: what it covers, and its invocations in order (``rlhf`` argv, no output directory or seed)."""
    saving = (*ONE_PROCESS, "--ckpt.save_steps", "2")
    critic = ("--critic.adam.lr", "1e-3", "--ds.zero_stage", "0", "--train.colocate_all")
    return {
        "grpo-single": ("GRPO, sync, one process (no Ray), 3 steps", [rl_flags(a, 3, *ONE_PROCESS)]),
        "grpo-ray2": (
            "GRPO, sync, 2 ZeRO-3 ranks and an engine on Ray, 2 steps",
            [rl_flags(a, 2, "--actor.num_gpus_per_node", "2", "--ds.zero_stage", "3")],
        ),
        # async cannot run in one process (the engine generates beside training): a rank and the engine on Ray
        "grpo-async": (
            "GRPO, async (one rank and the engine on Ray), 3 steps",
            [rl_flags(a, 3, "--ds.zero_stage", "0", "--train.async_enable")],
        ),
        "ppo-critic-kl": (
            "PPO: GAE with a critic, reference model with KL 0.01 in the reward, on Ray, 2 steps",
            [rl_flags(a, 2, *critic, estimator="gae", kl="0.01")],
        ),
        "sft": ("SFT, one process, 1 epoch of 40 rows (5 steps)", [supervised_flags(a, "sft")]),
        "dpo": ("DPO, one process, 1 epoch of 32 pairs (4 steps)", [supervised_flags(a, "dpo")]),
        "grpo-resume": (
            "grpo-single stopped after its checkpoint at step 2, then resumed to step 4 (two invocations)",
            [rl_flags(a, 2, *saving), rl_flags(a, 4, *saving, "--ckpt.load_enable")],
        ),
        "grpo-resume-old-ckpt": (
            "grpo-resume whose new side resumes from the step-2 checkpoint the base's code wrote",
            [rl_flags(a, 2, *saving), rl_flags(a, 4, *saving, "--ckpt.load_enable")],
        ),
    }


# runs whose new side writes its first checkpoint with the base's code (old checkpoints must still load)
FIRST_ON_BASE = {"grpo-resume-old-ckpt"}


def run_side(name: str, invocations: list[list[str]], out: Path, envs: list[dict], seed: int) -> float:
    """Run one side of a run into ``out`` (fresh), invocation i in environment ``envs[i]``; returns its wall
    seconds. The commands and their output go to ``out``.log."""
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(f"{out}.log", "w") as log:
        for argv, env in zip(invocations, envs, strict=True):
            cmd = [
                sys.executable,
                "-m",
                "rlhf_cli.main",
                *argv,
                "--train.seed",
                str(seed),
                "--ckpt.output_dir",
                str(out),
            ]
            log.write(" ".join(cmd) + "\n")
            log.flush()
            try:
                rc = subprocess.run(
                    cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=600
                ).returncode
            except subprocess.TimeoutExpired:
                rc = "none after 600 s"
            if rc:
                raise RuntimeError(f"{name}: exit {rc}, see {out}.log")
    return time.time() - started


def tree_env(rev: str | None, workdir: Path, threads: int) -> dict:
    """The children's environment: rlhf's packages of ``rev`` (None: the working tree) first on the path."""
    from grpo_vs_trl import code_at  # bench/, the script's directory, is on the path

    code = (
        code_at(rev, workdir)
        if rev
        else {"PYTHONPATH": os.pathsep.join(str(d) for d in sorted(HERE.parent.glob("packages/*/src")))}
    )
    return {
        **os.environ,
        **code,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "DS_ACCELERATOR": "cpu",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "RLHF_NO_PROGRESS": "1",
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| run | metrics equal (keys compared) | weights equal (tensors) | first difference "
        "| wall s base / new |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['run']} | — | — | failed: {r['error']} | |")
            continue
        lines.append(
            f"| {r['run']} | {'yes' if r['metrics_equal'] else '**no**'} ({r['metric_keys']}) | "
            f"{'yes' if r['weights_equal'] else '**no**'} ({r['tensors']}) | "
            f"{r['first_difference'] or '—'} | "
            f"{r['wall_base']:.0f} / {r['wall_new']:.0f} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--base", required=True, help="git revision to compare the working tree with (e.g. 23c3c28)"
    )
    p.add_argument(
        "--runs",
        help="comma-separated subset of: " + ", ".join(runs(defaultdict(str))),
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (OMP_NUM_THREADS)")
    p.add_argument("--workdir", default="/tmp/rlhf-bench-exactness")
    p.add_argument("--no-write", action="store_true", help="print the table only; leave bench/exactness.md")
    p.add_argument("--perturb", action="store_true", help=argparse.SUPPRESS)  # new side: another seed
    args = p.parse_args()
    base = subprocess.run(
        ["git", "-C", str(HERE.parent), "rev-parse", "--short=12", args.base],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    workdir = Path(args.workdir)
    every = runs(make_assets(workdir / "assets"))
    chosen = args.runs.split(",") if args.runs else list(every)
    unknown = [r for r in chosen if r not in every]
    if unknown:
        p.error(f"--runs: unknown {unknown}; known: {', '.join(every)}")
    envs = {"base": tree_env(base, workdir, args.threads), "new": tree_env(None, workdir, args.threads)}
    started, rows, load = time.time(), [], os.getloadavg()[0]
    for name in chosen:
        row = {"run": name}
        try:
            for side in ("base", "new"):
                seed = 43 if args.perturb and side == "new" else 42
                invocations = every[name][1]
                env = [envs[side]] * len(invocations)
                if side == "new" and name in FIRST_ON_BASE:
                    env[0] = envs["base"]
                row[f"wall_{side}"] = run_side(name, invocations, workdir / side / name, env, seed)
            row.update(compare_runs(workdir / "base" / name, workdir / "new" / name))
        except RuntimeError as e:
            row["error"] = str(e)
        rows.append(row)
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    wall = time.time() - started
    dirty = subprocess.run(
        ["git", "-C", str(HERE.parent), "status", "--porcelain", "packages"], capture_output=True, text=True
    ).stdout
    head = subprocess.run(
        ["git", "-C", str(HERE.parent), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    command = "DS_ACCELERATOR=cpu .venv/bin/python bench/exactness.py " + " ".join(sys.argv[1:])
    left_out = sorted(set().union(*(r.get("left_out", ()) for r in rows)))
    text = (
        f"# Same numbers: base {base} vs the working tree "
        f"({head}{', packages/ modified' if dirty else ''})\n\n"
        f"    {command}\n\n{table(rows)}\n\n"
        + "".join(f"- {name}: {every[name][0]}\n" for name in chosen)
        + f"\n{len(chosen)} runs, each on both sides: {wall:.0f} s in all, {args.threads} thread(s) per "
        f"process, {os.cpu_count()} cores (load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the "
        f"end: other jobs share them), seed 42. Metrics left out (timing, speed, memory, wall clock: "
        f"keys starting {' or '.join(EXCLUDED_PREFIXES)}, named {' or '.join(EXCLUDED_KEYS)}, or containing "
        f"`mem`); in these runs: {', '.join(f'`{k}`' for k in left_out)}.\n"
    )
    print(text)
    if not args.no_write:
        (HERE / "exactness.md").write_text(text)
    return 0 if all(r.get("metrics_equal") and r.get("weights_equal") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
