"""The same GRPO workload through ``rlhf serve-tinker`` (driven by the ``tinker`` SDK) and through ``rlhf train
ppo``: seconds per step and peak memory, on SmolLM2-135M-Instruct and the real demo's task (``rlhf demo
--real``: "What is a + b?" with its reward file).

Workload, both sides: ``--prompts`` prompts x ``--group`` samples of at most 16 tokens per step, rewards
centred on their group (``dr_grpo``; the service's client does the same by hand), LoRA rank 16 on the
attention and MLP projections (alpha 32), fp32, ZeRO-0, one process, lr 1e-4 constant, one optimizer step
per RL step. The losses differ as each side's API does (the service: Tinker's ``importance_sampling``, a sum
over tokens; ``rlhf train ppo``: its clipped PPO loss, a token mean); the passes are the same: sampling, a
forward pass for log-probs, a forward-backward, a step, the adapter to the engine.

Measured per side, after ``--warmup`` dropped steps: wall seconds per step (service: the client's loop from
saving the sampler weights to the end of ``optim_step``; train: its own ``timing/step_total``) and the peak
RSS of the process that holds the models (service: its ``VmHWM``; train: ``ru_maxrss`` of the child).

    DS_ACCELERATOR=cpu .venv/bin/python bench/tinker_vs_train.py [--steps 4] [--warmup 1] [--prompts 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LORA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peak_rss_mib(pid: int) -> float:
    found = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    if found is None:  # a zombie: it has ended
        raise ProcessLookupError(pid)
    return int(found[1]) / 1024


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of the process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def per_step(marks: list[tuple[float, float]], warmup: int) -> dict:
    """Medians over the measured steps of the wall and CPU seconds between consecutive step ends."""
    deltas = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks, marks[1:])][warmup:]
    return {
        "step_s": statistics.median(d[0] for d in deltas),
        "step_cpu_s": statistics.median(d[1] for d in deltas),
    }


def run_service(files: dict, args, work: Path) -> dict:
    import tinker
    from tinker import types

    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "rlhf_cli.tinker_service", "--base_model", str(files["base"]), "--port", "0"]
    server = subprocess.Popen(
        [*cmd, "--workdir", str(work / "svc")], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        url = re.search(r"at (http://\S+)", server.stdout.readline())[1]
        sc = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        tc = sc.create_lora_training_client(
            base_model=str(files["base"]), rank=16, seed=0, train_unembed=False
        )
        tc = tc.result()
        tok = tc.get_tokenizer()
        reward_func = runpy.run_path(str(files["reward"]))["reward_func"]
        rows = [json.loads(line) for line in files["prompts"].read_text().splitlines()]
        rng = random.Random(0)
        marks = [(time.perf_counter(), cpu_s(server.pid) + time.process_time())]
        for step in range(args.warmup + args.steps):
            sampler = tc.save_weights_and_get_sampling_client().result()
            batch = rng.sample(rows, args.prompts)
            prompts = [
                tok.apply_chat_template(
                    [{"role": "user", "content": r["input"]}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
                for r in batch
            ]
            params = types.SamplingParams(max_tokens=16, seed=step)
            futures = [sampler.sample(types.ModelInput.from_ints(p), args.group, params) for p in prompts]
            data = []
            for prompt, row, future in zip(prompts, batch, futures):
                samples = future.result().sequences
                replies = [tok.decode(s.tokens, skip_special_tokens=True) for s in samples]
                rewards = reward_func(None, None, [row["label"]] * args.group, responses=replies)["rewards"]
                mean = sum(rewards) / len(rewards)
                for s, reward in zip(samples, rewards):
                    tokens, pad = prompt + s.tokens, [0.0] * (len(prompt) - 1)
                    inputs = {
                        "target_tokens": tokens[1:],
                        "logprobs": pad + list(s.logprobs),
                        "advantages": pad + [reward - mean] * len(s.tokens),
                    }
                    model_input = types.ModelInput.from_ints(tokens[:-1])
                    data.append(types.Datum(model_input=model_input, loss_fn_inputs=inputs))
            tc.forward_backward(data, "importance_sampling").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            marks.append((time.perf_counter(), cpu_s(server.pid) + time.process_time()))
            print(f"service step {step}: {marks[-1][0] - marks[-2][0]:.2f} s", flush=True)
        return {**per_step(marks, args.warmup), "peak_rss_mib": peak_rss_mib(server.pid)}
    finally:
        server.terminate()
        server.wait()


def run_train(files: dict, args, work: Path) -> dict:
    out = work / "train"
    cmd = [
        *("rlhf", "train", "ppo", "--actor.model_name_or_path", str(files["base"])),
        *("--reward.remote_url", str(files["reward"]), "--data.prompt_dataset", str(files["prompts"])),
        *("--data.input_key", "input", "--data.label_key", "label", "--data.apply_chat_template"),
        *("--algo.advantage.estimator", "dr_grpo", "--algo.kl.init_coef", "0"),
        *("--rollout.n_samples_per_prompt", str(args.group), "--rollout.batch_size", str(args.prompts)),
        *("--rollout.max_new_tokens", "16", "--train.batch_size", str(args.prompts * args.group)),
        *("--train.micro_batch_size", "16", "--rollout.micro_batch_size", "16"),
        *("--train.max_steps", str(args.warmup + args.steps), "--actor.adam.lr", "1e-4"),
        *("--actor.lr_scheduler", "constant", "--actor.lr_warmup_ratio", "0"),
        *("--ds.lora.rank", "16", "--ds.lora.alpha", "32", "--ds.lora.target_modules", *LORA),
        *("--ds.zero_stage", "0", "--ds.param_dtype", "fp32", "--train.colocate_all"),
        *("--ckpt.output_dir", str(out), "--eval.steps", "-1"),
    ]
    child = subprocess.Popen([str(Path(sys.executable).parent / cmd[0]), *cmd[1:]])
    marks, seen, peak = [], 0, 0.0
    while child.poll() is None:  # a step ends when its line reaches metrics.jsonl
        found = list(out.rglob("metrics.jsonl"))
        lines = found[0].read_text().count("timing/step_total") if found else 0
        try:
            now = (time.perf_counter(), cpu_s(child.pid))
            peak = peak_rss_mib(child.pid)
        except (FileNotFoundError, ProcessLookupError):  # it just ended
            break
        if lines > seen:  # step `lines - 1` ended: its first end is the start of the next step
            seen = lines
            marks.append(now)
            print(f"train step {lines - 1} ended at {now[0]:.1f}", flush=True)
        time.sleep(0.2)
    if child.wait() != 0:
        raise SystemExit(f"rlhf train ppo failed ({child.returncode})")
    return {**per_step(marks, args.warmup - 1), "peak_rss_mib": peak}  # marks begin at step 0's end


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1, help="dropped steps (at least 1)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    args = ap.parse_args()
    from rlhf_cli.demo import make_real_assets

    work = Path(tempfile.mkdtemp(prefix="tinker-bench-"))
    files = make_real_assets(work)
    load = os.getloadavg()[0]
    results = {"train": run_train(files, args, work), "service": run_service(files, args, work)}
    results["load_average"] = [load, os.getloadavg()[0]]
    results["service/train step"] = results["service"]["step_s"] / results["train"]["step_s"]
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
