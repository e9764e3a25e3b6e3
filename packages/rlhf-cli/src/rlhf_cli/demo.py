"""``rlhf demo``: a real RLHF run on a laptop in minutes, with nothing downloaded.

The task, its flawed SFT teacher and ``--real`` (GRPO alone on SmolLM2-135M-Instruct) are described in the
README's "What the demo does" and "The demo on a real model" sections.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

VOCAB = ["<pad>", "<s>", "</s>", "<unk>", *[str(d) for d in range(10)], "+", "="]

REWARD_FILE = '''"""Reward for the rlhf demo: 1.0 when the digits after '=' spell the right sum, else 0.0.

rlhf calls reward_func once per batch: queries are prompt + response texts, labels the true sums.
"""


def answer_of(query: str) -> str:
    response = query.rsplit("=", 1)[-1]
    return "".join(tok for tok in response.split() if tok.isdigit())


def reward_func(queries, prompts, labels, **kwargs):
    rewards = [float(answer_of(q) == str(label)) for q, label in zip(queries, labels)]
    return {"rewards": rewards, "scores": rewards}
'''


def spaced(n: int) -> str:
    return " ".join(str(n))


def prompt_of(a: int, b: int) -> str:
    return f"{spaced(a)} + {spaced(b)} ="


def flawed_teacher(a: int, b: int, rng: random.Random) -> int:
    """The sum, except that 70% of carries are forgotten."""
    if (a % 10) + (b % 10) >= 10 and rng.random() < 0.7:
        return (a // 10 + b // 10) * 10 + (a % 10 + b % 10) % 10
    return a + b


def make_assets(work: Path, seed: int = 0, num_heads: int = 4) -> dict[str, Path]:
    """Tokenizer, a randomly initialised tiny Llama, the datasets and the reward file, all made here.
    ``num_heads`` 2 gives head size 32, the smallest vLLM's CPU attention kernel takes (4 gives 16)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    work.mkdir(parents=True, exist_ok=True)
    base = work / "base_model"
    backend = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="right",
    )
    tok.save_pretrained(base)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(base)

    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10, 50) for b in range(10, 50)]
    rng.shuffle(pairs)
    held_out, train = pairs[:200], pairs[200:]
    files = {
        "base": base,
        "sft": work / "sft.jsonl",
        **write_task(work, train, held_out, prompt_of, REWARD_FILE),
    }
    files["sft"].write_text(
        "".join(
            json.dumps({"input": prompt_of(a, b), "output": spaced(flawed_teacher(a, b, rng))}) + "\n"
            for a, b in train
        )
    )
    return files


def write_task(work: Path, train: list, held_out: list, question, reward_file: str) -> dict[str, Path]:
    """The RL prompts, the held-out questions (``question(a, b)`` labelled with ``a + b``) and the reward file."""
    files = {"prompts": work / "prompts.jsonl", "eval": work / "eval.jsonl", "reward": work / "reward.py"}
    for name, split in (("prompts", train), ("eval", held_out)):
        files[name].write_text(
            "".join(json.dumps({"input": question(a, b), "label": str(a + b)}) + "\n" for a, b in split)
        )
    files["reward"].write_text(reward_file)
    return files


def greedy_replies(
    model_dir: Path, eval_file: Path, max_new_tokens: int, chat: bool, limit: int | None = None
) -> tuple[list[dict], list[str]]:
    """The held-out rows and the built-in HF engine's greedy replies to them (special tokens removed), the
    prompts rendered by the tokenizer's chat template when ``chat``: an evaluation apart from training."""
    from transformers import AutoTokenizer

    from rlhf_core.rollout.hf_engine import HFEngine
    from rlhf_core.types import GenerationRequest, SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in eval_file.read_text().splitlines()][:limit]
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    requests = [
        GenerationRequest(
            tok.apply_chat_template(
                [{"role": "user", "content": r["input"]}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            if chat
            else tok(r["input"], add_special_tokens=False)["input_ids"],
            params,
        )
        for r in rows
    ]
    outs = HFEngine(str(model_dir), dtype="fp32").generate(requests)
    return rows, [tok.decode(out.token_ids, skip_special_tokens=True) for (out,) in outs]


def held_out_accuracy(
    model_dir: Path, eval_file: Path, real: bool = False, limit: int | None = None
) -> tuple[float, list[str]]:
    """Greedy accuracy on the held-out prompts, and the replies. A reply of the toy model is right when its
    digits spell the sum; one of the real model (chat template, 16 tokens) when the last number it writes is."""
    rows, replies = greedy_replies(
        model_dir, eval_file, REAL_NEW_TOKENS if real else 4, chat=real, limit=limit
    )
    answers = [
        re.findall(r"-?[0-9]+", reply)[-1:] if real else ["".join(t for t in reply.split() if t.isdigit())]
        for reply in replies
    ]
    return sum(answer == [row["label"]] for answer, row in zip(answers, rows)) / len(rows), replies


def accuracy(model_dir: Path, eval_file: Path) -> float:
    """The toy model's greedy accuracy on the held-out prompts (:func:`held_out_accuracy`)."""
    return held_out_accuracy(model_dir, eval_file)[0]


def argv(line: str, **values) -> list[str]:
    """A command's words: ``line`` split at spaces, each ``{name}`` word replaced by ``values[name]`` (paths may
    hold spaces)."""
    return [str(values[word[1:-1]]) if word[0] == "{" else word for word in line.split()]


def commands(
    files: dict[str, Path], work: Path, quick: bool, engine: str = "hf"
) -> list[tuple[str, list[str]]]:
    # calibrated over seeds 0-2: SFT reaches ~60% held-out accuracy (the teacher's carry mistakes), GRPO ~85%;
    # --quick only checks that every stage runs: one SFT epoch, 4 GRPO steps
    sft_epochs, rl_steps = (1, 4) if quick else (28, 88)  # 88 steps: one pass over the 1,400 prompts
    sft = argv(
        "rlhf train sft --model.model_name_or_path {base} --data.dataset {sft} --data.input_key input "
        "--data.output_key output --data.max_len 16 --train.batch_size 32 --train.micro_batch_size 32 "
        "--train.max_epochs {epochs} --model.adam.lr 3e-3 --model.adam.betas 0.9 0.999 "
        "--model.lr_scheduler cosine_with_min_lr --model.lr_warmup_ratio 0.03 --ds.zero_stage 0 "
        "--ds.param_dtype fp32 --ckpt.output_dir {out}",
        **files,
        epochs=sft_epochs,
        out=work / "sft",
    )
    rl = argv(
        "rlhf train ppo --actor.model_name_or_path {actor} --reward.remote_url {reward} "
        "--data.prompt_dataset {prompts} --data.input_key input --data.label_key label --eval.dataset {eval} "
        "--eval.steps 10 --eval.n_samples_per_prompt 1 --eval.temperature 0 "
        "--algo.advantage.estimator group_norm --algo.kl.init_coef 0 --rollout.n_samples_per_prompt 8 "
        "--rollout.batch_size 16 --rollout.max_new_tokens 4 --rollout.micro_batch_size 64 --data.max_len 16 "
        "--train.batch_size 128 --train.micro_batch_size 64 --train.max_steps {steps} --actor.adam.lr 5e-4 "
        "--actor.adam.betas 0.9 0.999 --actor.lr_scheduler constant --actor.lr_warmup_ratio 0 "
        "--ds.zero_stage 0 --ds.param_dtype fp32 --ckpt.output_dir {out}",
        **files,
        actor=work / "sft",
        steps=rl_steps,
        out=work / "rl",
    )
    if engine == "vllm":  # eager: vLLM's CPU build would otherwise spend minutes compiling the model
        rl += ["--rollout.engine", "vllm", "--vllm.enforce_eager"]
    else:  # one rank hosting the engine: the whole run in this process, no Ray to start (--ray.single_process)
        rl += ["--train.colocate_all"]
    return [("SFT", sft), ("RL (GRPO)", rl)]


# --- rlhf demo --real: the real SmolLM2-135M-Instruct -----------------------------------------------------

REAL_REWARD_FILE = '''"""Reward for `rlhf demo --real`: 1.0 when the last number of the reply is the sum, else 0.0.

rlhf calls reward_func once per batch; responses are the generated replies (special tokens removed) and
labels the sums. SmolLM2's answers look like "7 + 5 = 12" or "The answer is 12."; a reply that spends its
16 tokens explaining ("To solve this, we need to ...") and never states a sum scores 0.
"""

import re


def answer_of(reply):
    numbers = re.findall(r"-?[0-9]+", reply)
    return numbers[-1] if numbers else None


def reward_func(queries, prompts, labels, responses, **kwargs):
    rewards = [float(answer_of(reply) == str(label)) for reply, label in zip(responses, labels)]
    return {"rewards": rewards, "scores": rewards}
'''

REAL_NEW_TOKENS = 16
REAL_QUESTION = "What is {} + {}? Answer with only the number."


def make_real_assets(work: Path, seed: int = 0) -> dict[str, Path]:
    """The real model (built once into rlhf's cache), the prompts, the held-out questions and the reward file."""
    from rlhf_core.testing.smollm2 import smollm2_dir

    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(20) for b in range(20)]
    rng.shuffle(pairs)
    held_out, train = pairs[:100], pairs[100:]
    return {
        "base": smollm2_dir(),
        **write_task(work, train, held_out, REAL_QUESTION.format, REAL_REWARD_FILE),
    }


def real_commands(files: dict[str, Path], work: Path, quick: bool) -> list[tuple[str, list[str]]]:
    # --quick only checks that every stage runs: 2 steps of 4 prompts
    steps, prompts = (2, 4) if quick else (30, 8)
    rl = argv(
        "rlhf train ppo --actor.model_name_or_path {base} --reward.remote_url {reward} "
        "--data.prompt_dataset {prompts} --data.input_key input --data.label_key label "
        "--data.apply_chat_template --data.max_len 96 --eval.dataset {eval} --eval.steps {eval_steps} "
        "--eval.n_samples_per_prompt 1 --eval.temperature 0 --eval.max_samples {eval_max} "
        "--algo.advantage.estimator group_norm --algo.kl.init_coef 0 --rollout.n_samples_per_prompt 8 "
        "--rollout.batch_size {prompts_n} --rollout.max_new_tokens {new_tokens} --rollout.micro_batch_size 16 "
        "--train.batch_size {batch} --train.micro_batch_size 16 --train.max_steps {steps} "
        "--actor.adam.lr 2e-5 --actor.lr_scheduler cosine_with_min_lr --actor.lr_warmup_ratio 0 "
        "--ds.zero_stage 0 --ds.param_dtype fp32 --train.colocate_all --ckpt.output_dir {out}",
        **files,
        eval_steps=-1 if quick else 10,
        eval_max=16 if quick else 100,
        prompts_n=prompts,
        new_tokens=REAL_NEW_TOKENS,
        batch=8 * prompts,
        steps=steps,
        out=work / "rl",
    )
    return [("RL (GRPO)", rl)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rlhf demo", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--workdir", help="where models, data and runs go (default runs/demo, with --real runs/real-demo)"
    )
    ap.add_argument("--quick", action="store_true", help="a shortened run (seconds, not minutes)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random model and of the data split")
    ap.add_argument(
        "--real",
        action="store_true",
        help="the real SmolLM2-135M-Instruct instead of a random tiny model: GRPO alone (no SFT) on "
        "sums of numbers below 20, where its 16-token replies seldom state the right sum (about 10 minutes on 2 cores)",
    )
    ap.add_argument(
        "--rollout.engine",
        dest="engine",
        choices=["hf", "vllm"],
        default="hf",
        help="the GRPO stage's rollout engine; vllm (vLLM's CPU build here) makes the model with 2 "
        "attention heads of 32 dims instead of 4 of 16, the smallest head vLLM's CPU kernel takes",
    )
    args = ap.parse_args(argv)
    if args.real and args.engine != "hf":
        print(
            "rlhf demo: --real runs on the HF engine only (--rollout.engine vllm is for the toy demo)",
            file=sys.stderr,
        )
        return 2
    if args.engine == "vllm":
        from rlhf_core.plugins import get_plugin_manager, resolve

        reason = resolve(get_plugin_manager(), "rollout_engines", "vllm").available()
        if reason is not None:
            print(f"rlhf demo: --rollout.engine vllm cannot run here: {reason}", file=sys.stderr)
            return 2
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    if args.real:
        work = Path(args.workdir or "runs/real-demo").resolve()
        print(f"[demo] SmolLM2-135M-Instruct (built once into rlhf's cache) and the task in {work}")
        files = make_real_assets(work, args.seed)
        stages = real_commands(files, work, args.quick)
    else:
        work = Path(args.workdir or "runs/demo").resolve()
        print(
            f"[demo] making the tokenizer, a random tiny Llama and the addition task in {work}"
            f"{' (GRPO on vLLM)' if args.engine == 'vllm' else ''}"
        )
        files = make_assets(work, args.seed, num_heads=2 if args.engine == "vllm" else 4)
        stages = commands(files, work, args.quick, args.engine)
    limit = 16 if args.real and args.quick else None  # --real --quick evaluates on 16 held-out questions
    acc, replies, timings, models = {}, {}, {}, {}

    def evaluate(name: str, model: Path) -> None:
        models[name] = model
        acc[name], replies[name] = held_out_accuracy(model, files["eval"], args.real, limit)
        print(f"[demo] held-out accuracy {name}: {acc[name]:.1%}", flush=True)

    evaluate(f"before {stages[0][0].split()[0]}", files["base"])
    timings["setup and evaluation"] = time.perf_counter() - t0
    for stage, cmd in stages:
        if code := run_stage(stage, cmd, timings):
            return code
        t, after = time.perf_counter(), f"after {stage.split()[0]}"
        evaluate(after, work / "sft" if stage == "SFT" else work / "rl" / "model")
        timings[f"evaluation {after}"] = time.perf_counter() - t
    total, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    rule = "; right when the reply's last number is the sum" if args.real else ""
    print(f"\n[demo] held-out accuracy ({len(replies[after])} unseen sums, greedy{rule}):")
    print(f"  {'stage':<12} {'accuracy':>9}")
    for k, v in acc.items():
        print(f"  {k:<12} {v:>9.1%}")
    questions = [json.loads(line)["input"] for line in files["eval"].read_text().splitlines()]
    print(f"[demo] replies {' -> '.join(acc)}:")
    for q, *answers in list(zip(questions, *replies.values()))[:3]:
        print(f"  {q!r}: {' -> '.join(map(repr, answers))}")
    stages_s = ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())
    print(f"\n[demo] time per stage: {stages_s}; total {total:.0f} s, {cpu:.0f} CPU-seconds")
    print(f"[demo] report: {work / 'rl' / 'report' / 'index.html'}")
    summary = {"accuracy": acc, "seconds": timings, "total_s": total, "cpu_s": cpu, "replies": replies}
    (work / "summary.json").write_text(
        json.dumps(summary | {"models": {k: str(v) for k, v in models.items()}}, indent=2)
    )
    return 0


def run_stage(stage: str, cmd: list[str], timings: dict[str, float]) -> int:
    """Print one stage's ``rlhf`` command, run it in a child process and time it; its exit code."""
    print(f"\n[demo] {stage}:\n  " + shlex.join(cmd).replace(" --", " \\\n    --"), flush=True)
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "rlhf_cli.main", *cmd[1:]])
    timings[stage] = time.perf_counter() - t
    if done.returncode != 0:
        print(f"[demo] {stage} failed (exit {done.returncode})", file=sys.stderr)
    return done.returncode


def cpu_seconds() -> float:
    """CPU seconds of this process and of its finished children (the training runs)."""
    import resource

    return sum(
        r.ru_utime + r.ru_stime
        for r in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    )


if __name__ == "__main__":
    sys.exit(main())
