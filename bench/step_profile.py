"""The work of one step of ``bench/grpo_vs_trl.py``'s ``rlhf-single`` run at two revisions, compared where wall
time is noise (a shared machine): what each step computes, not how long it took.

    DS_ACCELERATOR=cpu .venv/bin/python bench/step_profile.py --size R --revs HERE,23c3c28 [--calls]

Per revision (``HERE``: this checkout; else a git revision, whose packages are put first on the path as
grpo_vs_trl's ``--runs rlhf-single@REV`` does), each in a fresh process with ``--threads`` torch threads
(default 1: CPU time is then the work, not OpenMP's spin-waiting):

- ``ops``: CPU seconds, system seconds and minor page faults of each step, and the aten ops of the first step
  after the warm-up over every thread (torch's profiler): calls, self CPU time and FLOPs per op;
- ``layouts``: that step's ops with each tensor argument's shape, strides and dtype (a dispatch mode on the main
  thread, where a single-process run's torch work runs: the profiler's threads say so);
- ``calls`` (with ``--calls``): Python calls per function and step, in every thread (cProfile; a 1-step run
  subtracted from a 2-step run).

The first two revisions are then compared: the metrics (timing, speed and wall-clock ones left out), the ops
by name, the layouts and the calls. Files: ``--workdir``.
"""

import argparse
import collections
import json
import os
import re
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import grpo_vs_trl as bench  # noqa: E402 - from this directory


def child(args) -> dict:
    import cProfile

    profilers = {}  # thread name -> its cProfile.Profile (cProfile sees only the thread that enabled it)

    def profile_thread(*_):
        sys.setprofile(None)
        profilers[threading.current_thread().name] = prof = cProfile.Profile()
        prof.enable()

    if args.mode == "calls":
        threading.setprofile(profile_thread)
        profile_thread()

    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    import rlhf_cli.rl.controller as controller

    try:
        import rlhf_core.runloop as metrics
    except ImportError:  # revisions before the shared run loop
        import rlhf_cli.rl.metrics as metrics
    from rlhf_cli.main import main

    set_threads, threads_set = torch.set_num_threads, []

    def logged_set_threads(n):  # OpenMP's count is per thread: which thread asks for how many
        threads_set.append((threading.current_thread().name, n))
        set_threads(n)

    torch.set_num_threads = logged_set_threads
    layouts = collections.Counter()  # "op [(shape, strides, dtype) of each tensor argument]" -> calls

    class Layouts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            layouts[f"{func} {[(tuple(t.shape), t.stride(), str(t.dtype)) for t in tensors]}"] += 1
            return func(*args, **(kwargs or {}))

    recorder = {
        "ops": profile(
            activities=[ProfilerActivity.CPU],
            record_shapes=True,
            with_flops=True,
            experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True),
        ),
        "layouts": Layouts(),
    }.get(args.mode)
    marks, log, fit = [], metrics.MetricsLogger.log, controller.RLController.fit

    def mark():
        marks.append((time.process_time(), time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)))
        if recorder is not None and len(marks) == args.warmup + 1:  # the first step after the warm-up
            recorder.__enter__()
        if recorder is not None and len(marks) == args.warmup + 2:
            recorder.__exit__(None, None, None)

    def marked_log(self, step, values):
        mark()
        return log(self, step, values)

    def marked_fit(self):
        mark()
        out = fit(self)
        if args.mode == "calls":  # what follows the steps (the report plots every step's metrics) is left out
            profilers["MainThread"].disable()
        return out

    controller.RLController.fit, metrics.MetricsLogger.log = marked_fit, marked_log
    os.environ["RLHF_NO_PROGRESS"] = "1"
    out = Path(args.workdir) / f"out-{os.getpid()}"
    if main(["train", "ppo", *bench.rlhf_flags(args, Path(args.workdir) / args.size, out, "rlhf-single")]):
        raise SystemExit("rlhf train ppo failed")
    steps = list(zip(marks, marks[1:]))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    result = {
        "cpu_s": [b[0] - a[0] for a, b in steps],
        "wall_s": [b[1] - a[1] for a, b in steps],
        "sys_s": [b[2].ru_stime - a[2].ru_stime for a, b in steps],
        "minor_faults": [b[2].ru_minflt - a[2].ru_minflt for a, b in steps],
        "set_num_threads": threads_set,
        "metrics": [
            {k: v for k, v in r.items() if k.split("/")[0] not in ("timing", "perf", "time")} for r in rows
        ],
    }
    if args.mode == "ops":
        ops = collections.defaultdict(lambda: [0, 0.0, 0])  # op -> [calls, self CPU us, FLOPs]
        op_threads = collections.Counter()  # the profiler's thread numbers
        for e in recorder.events():
            if e.name.startswith("aten::"):
                ops[e.name][0] += 1
                ops[e.name][1] += e.self_cpu_time_total
                ops[e.name][2] += e.flops or 0
                op_threads[e.thread] += 1
        result["ops"], result["op_threads"] = ops, op_threads
    if args.mode == "layouts":
        result["layouts"] = layouts
    if args.mode == "calls":
        calls = collections.Counter()
        for p in profilers.values():
            p.disable()
            p.create_stats()
            for (file, _, fn), (_, n, *_) in p.stats.items():  # the same function at both revisions:
                file = re.sub(r"^.*?/(site-packages|src|python3\.\d+)/", "", file)  # no root, no line
                calls[f"{file}({re.sub(r' at 0x[0-9a-f]+', '', fn)})"] += n  # no address
        result["calls"] = calls
    return result


def run(args, rev: str, mode: str, steps: int) -> dict:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "MKL_NUM_THREADS": str(args.threads),
        "TOKENIZERS_PARALLELISM": "false",
        "DS_ACCELERATOR": "cpu",
        "HF_HUB_OFFLINE": "1",
    }
    if rev != "HERE":
        env.update(bench.code_at(rev, Path(args.workdir)))
    path = Path(args.workdir) / f"{rev}-{mode}-{steps}.json"
    cmd = [sys.executable, __file__, "--child", mode, "--size", args.size, "--threads", str(args.threads)]
    cmd += ["--workdir", args.workdir, "--warmup", str(args.warmup), "--steps", str(steps), "--json", path]
    subprocess.run(cmd, env=env, check=True)
    return json.loads(path.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="R", choices=sorted(bench.GRID), help="a row of bench/grpo_vs_trl.py")
    p.add_argument("--revs", default="HERE,23c3c28", help="HERE: this checkout; else a git revision")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="measured steps of the ops run (CPU time per step)")
    p.add_argument("--calls", action="store_true", help="also Python call counts (two more runs per rev)")
    p.add_argument("--workdir", default="/tmp/rlhf-bench-step-profile")
    p.add_argument("--child", choices=("ops", "layouts", "calls"), dest="mode", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args()
    hidden, layers, lp, _ = bench.GRID[args.size]
    args.dtype, args.beta, args.prompts = "fp32", 0.0, 8
    args.n = bench.SAMPLES.get(args.size, 8)
    if args.mode:
        Path(args.json).write_text(json.dumps(child(args)))
        return
    root = Path(args.workdir) / args.size
    root.mkdir(parents=True, exist_ok=True)
    num_prompts = args.prompts * (args.warmup + args.steps) * 2
    bench.make_workload(root, hidden, layers, lp, num_prompts, args.size in bench.REAL_ROWS)
    revs = args.revs.split(",")[:2]
    ops, layouts, calls = {}, {}, {}
    for rev in revs:
        r = ops[rev] = run(args, rev, "ops", args.steps)
        for what in ("cpu_s", "sys_s", "minor_faults", "wall_s"):
            print(f"{rev} {what} per step: {[round(x, 2) for x in r[what]]}")
        print(f"{rev} set_num_threads: {r['set_num_threads']}; profiler's threads: {r['op_threads']}")
        layouts[rev] = run(args, rev, "layouts", 1)
        if args.calls:
            one, two = run(args, rev, "calls", 1)["calls"], run(args, rev, "calls", 2)["calls"]
            calls[rev] = {k: two[k] - one.get(k, 0) for k in two}
    a, b = revs
    print(
        "metrics equal:",
        ops[a]["metrics"] == ops[b]["metrics"],
        layouts[a]["metrics"] == layouts[b]["metrics"],
    )
    print(f"aten ops of one step, by name: {'calls':>17s} {'self CPU s':>15s} {'GFLOP':>15s}")
    oa, ob = ops[a]["ops"], ops[b]["ops"]
    for name in sorted(set(oa) | set(ob), key=lambda n: -max(oa.get(n, [0, 0])[1], ob.get(n, [0, 0])[1])):
        (na, ua, fa), (nb, ub, fb) = oa.get(name, [0, 0, 0]), ob.get(name, [0, 0, 0])
        if na != nb or fa != fb or max(ua, ub) > 5e4:
            print(
                f"{name:40s} {na:8d} {nb:8d} {ua / 1e6:7.2f} {ub / 1e6:7.2f} {fa / 1e9:7.1f} {fb / 1e9:7.1f}"
            )
    la, lb = layouts[a]["layouts"], layouts[b]["layouts"]
    print(f"ops with their tensors' shapes, strides, dtypes: {sum(la.values())} vs {sum(lb.values())} calls")
    for key in sorted(set(la) | set(lb), key=lambda k: -abs(la.get(k, 0) - lb.get(k, 0)))[:20]:
        if la.get(key, 0) != lb.get(key, 0):
            print(f"{la.get(key, 0):8d} {lb.get(key, 0):8d}  {key[:200]}")
    if args.calls:
        ca, cb = calls[a], calls[b]
        print(f"Python calls per step: {sum(ca.values())} vs {sum(cb.values())}; most different:")
        for key in sorted(set(ca) | set(cb), key=lambda k: -abs(ca.get(k, 0) - cb.get(k, 0)))[:30]:
            print(f"{ca.get(key, 0):8d} {cb.get(key, 0):8d}  {key}")


if __name__ == "__main__":
    main()
