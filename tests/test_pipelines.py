"""Rejection sampling, iterative DPO and conditional SFT, end to end through ``examples/iterate.py``.

A random tiny Llama learns a task it starts out failing: reply with the digit that follows the last digit
of the prompt ("3 8 4" -> "5"), rewarded 1 by a rule. The policy's reward is measured exactly, as the
mean probability of a right first token over 200 other prompts (the expected reward of sampling), so no
sampling noise enters the comparisons. Each pipeline runs the real commands (rlhf generate on Ray with
the HF engine, then rlhf train sft/dpo with DeepSpeed on CPU).

Conditional SFT is rewarded for replying with an even digit instead: its model must learn to act on the
condition written after the prompt, and on the successor task (the answer read from a token three places
back) it had not learned that after 512 SFT steps (expected reward 0.095 asked for 1.00, 0.073 for 0.00),
while the even-digit condition is learned in a few dozen.
"""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("pipelines")]
REPO = Path(__file__).resolve().parents[1]

VOCAB = ["<pad>", "<s>", "</s>", "<unk>", *[str(d) for d in range(10)], "<rm_score>:", "0.00", "1.00"]
REWARD = '''
def reward_func(queries, prompts, labels, responses):
    """1.0 when the reply's first word is the digit after the prompt's last digit."""
    return [float(r.split()[:1] == [label]) for r, label in zip(responses, labels)]
'''
EVEN = ["0", "2", "4", "6", "8"]
REWARD_EVEN = f'''
def reward_func(queries, prompts, labels, responses):
    """1.0 when the reply's first word is an even digit."""
    return [float(r.split()[:1] in [[d] for d in {EVEN}]) for r in responses]
'''
GENERATE = "--label_key label --max_new_tokens 2 --param_dtype fp32 --micro_batch_size 64"
TRAIN = (
    "--max_len 10 --train_batch_size {batch} --micro_train_batch_size {batch} --max_epochs {epochs} "
    "--learning_rate {lr} --adam_betas 0.9 0.999 --zero_stage 0 --param_dtype fp32"
)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("pipelines")
    backend = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(root / "policy")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(root / "policy")
    rng = random.Random(0)

    def rows(n):
        digits = [[rng.randrange(10) for _ in range(3)] for _ in range(n)]
        return [{"input": " ".join(map(str, d)), "label": str((d[-1] + 1) % 10)} for d in digits]

    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(512)))
    (root / "reward.py").write_text(REWARD)
    (root / "reward_even.py").write_text(REWARD_EVEN)
    return {
        "root": root,
        "policy": str(root / "policy"),
        "prompts": str(root / "prompts.jsonl"),
        "reward": str(root / "reward.py"),
        "reward_even": str(root / "reward_even.py"),
        "eval": rows(200),
    }


def expected_reward(model_dir, rows, suffix="", right=None):
    """Mean over ``rows`` of P(first reply token is right | prompt + suffix), right = the row's label, or any
    of ``right`` when given: the policy's expected reward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tok(r["input"] + suffix, add_special_tokens=False)["input_ids"] for r in rows])
    with torch.no_grad():
        probs = model(ids).logits[:, -1].float().softmax(-1)
    if right is not None:
        return probs[:, tok.convert_tokens_to_ids(right)].sum(-1).mean().item()
    target = torch.tensor([tok.convert_tokens_to_ids(r["label"]) for r in rows])
    return probs.gather(1, target[:, None]).mean().item()


def iterate(task, mode, workdir, iterations, prompts_per_iter, train, env=None, reward="reward"):
    cmd = [
        sys.executable,
        str(REPO / "examples" / "iterate.py"),
        mode,
        "--policy",
        task["policy"],
        "--prompts",
        task["prompts"],
        "--reward",
        task[reward],
        "--workdir",
        str(workdir),
        "--iterations",
        str(iterations),
        "--prompts-per-iter",
        str(prompts_per_iter),
        "--best-of-n",
        "8",
        "--generate-flags",
        GENERATE,
        "--train-flags",
        train,
    ]
    return subprocess.run(
        cmd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=1200,
    )


def rewards(path):
    return [json.loads(line)["reward"] for line in Path(path).read_text().splitlines()]


def test_rejection_sampling_keeps_better_samples_and_sft_on_them_raises_the_reward(task, tmp_path):
    done = iterate(task, "rs", tmp_path, 1, 256, TRAIN.format(batch=32, epochs=8, lr=3e-3))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    every = rewards(tmp_path / "iter0" / "data.jsonl.samples.jsonl")
    kept = rewards(tmp_path / "iter0" / "data.jsonl")
    assert (len(every), len(kept)) == (256 * 8, 256)
    # one in 16 samples is right; best of 8 keeps a right one for about 1 - (15/16)^8 = 40% of prompts
    assert sum(kept) / len(kept) > sum(every) / len(every) + 0.2
    before = expected_reward(task["policy"], task["eval"])
    after = expected_reward(tmp_path / "iter0" / "model", task["eval"])
    assert after > before + 0.05, (before, after)  # one run: 0.050 -> 0.153


def test_iterative_dpo_raises_the_reward_each_iteration_and_resumes(task, tmp_path):
    train = TRAIN.format(batch=16, epochs=4, lr=1e-3) + " --beta 0.1"
    first = iterate(task, "iter_dpo", tmp_path, 1, 256, train)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    # a second iteration, killed in the middle of writing generated samples, then resumed
    crashed = iterate(task, "iter_dpo", tmp_path, 2, 256, train, env={"RLHF_FAULT": "generate_mid_write:2"})
    assert crashed.returncode == 137, crashed.stdout[-3000:] + crashed.stderr[-3000:]
    assert "iteration 0 generate: done before, skipped" in crashed.stdout
    assert "iteration 0 train: done before, skipped" in crashed.stdout
    written = (tmp_path / "iter1" / "data.jsonl.samples.jsonl").read_text()
    assert not written.endswith("\n")  # the kill left half a micro-batch
    lines = written.splitlines()[:-1]
    per_prompt = {}
    for line in lines:
        per_prompt[json.loads(line)["prompt_index"]] = per_prompt.get(json.loads(line)["prompt_index"], 0) + 1
    done_before = [line for line in lines if per_prompt[json.loads(line)["prompt_index"]] == 8]
    assert done_before, "no prompt was complete when the run was killed"
    resumed = iterate(task, "iter_dpo", tmp_path, 2, 256, train)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "dropped a partial last line" in resumed.stdout
    text = (tmp_path / "iter1" / "data.jsonl.samples.jsonl").read_text()
    assert text.startswith("".join(line + "\n" for line in done_before))  # finished prompts kept, not redone
    samples = [json.loads(line) for line in text.splitlines()]
    assert sorted((s["prompt_index"], s["sample_index"]) for s in samples) == [
        (p, j) for p in range(256) for j in range(8)
    ]
    pairs = [json.loads(line) for line in (tmp_path / "iter1" / "data.jsonl").read_text().splitlines()]
    assert pairs and all(p["chosen_reward"] > p["rejected_reward"] for p in pairs)

    r0 = expected_reward(task["policy"], task["eval"])
    r1 = expected_reward(tmp_path / "iter0" / "model", task["eval"])
    r2 = expected_reward(tmp_path / "iter1" / "model", task["eval"])
    assert r1 > r0 + 0.03 and r2 > r1 + 0.03, (r0, r1, r2)  # one run: 0.050, 0.116, 0.228
    # the samples of iteration 1 (policy after one DPO iteration) score higher than those of iteration 0
    assert sum(s["reward"] for s in samples) > sum(rewards(tmp_path / "iter0" / "data.jsonl.samples.jsonl"))


def test_conditional_sft_output_follows_the_condition(task, tmp_path):
    done = iterate(
        task, "csft", tmp_path, 1, 128, TRAIN.format(batch=32, epochs=2, lr=3e-3), reward="reward_even"
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "iter0" / "data.jsonl").read_text().splitlines()]
    assert len(rows) == 128 * 8 and {r["input"].split("<rm_score>: ")[1] for r in rows} == {"0.00 ", "1.00 "}
    model = tmp_path / "iter0" / "model"
    before = expected_reward(task["policy"], task["eval"], right=EVEN)
    good = expected_reward(model, task["eval"], " <rm_score>: 1.00", right=EVEN)
    bad = expected_reward(model, task["eval"], " <rm_score>: 0.00", right=EVEN)
    assert good > before + 0.2 and bad < before - 0.1, (before, good, bad)
