"""`rlhf train prm` and `rlhf train kd` end to end: 2 ZeRO ranks on Ray, tiny Llamas, synthetic data.

PRM: each step of a text is a counting step ``a b`` (words for the digits) followed by the step marker, right
when ``b = a + 1``; the trained PRM must rank held-out right steps above wrong ones. KD: a sharper, wider teacher
writes the responses; the distilled student's KL to the teacher must fall well below the untrained one's.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from rlhf_core.config import KDConfig, PRMConfig
from rlhf_train_deepspeed.testing import words, write_jsonl
from rlhf_train_deepspeed.trainers import run_supervised

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

MARK, GOOD, BAD = "w50", "w51", "w52"  # the step marker and the reward tokens (positive first)


@pytest.fixture(scope="module")
def factory(reused_groups):
    return reused_groups[2]


def arithmetic_rows(n: int, seed: int, soft: bool = False) -> list[dict]:
    """Texts of 3 steps ``a b MARK`` with a digit a in 0..8; about half the steps are wrong (b != a + 1)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        parts, labels = [], []
        for _ in range(3):
            a = rng.randrange(9)
            right = rng.random() < 0.5
            b = a + 1 if right else rng.choice([x for x in range(10) if x != a + 1])
            parts.append(f"{words([a, b])} {MARK}")
            labels.append((0.9 if right else 0.1) if soft else (GOOD if right else BAD))
        rows.append({"input": " ".join(parts), "label": labels})
    return rows


def make_cfg(cls, model, tmp_path, dataset, *, lr=3e-3, epochs=2):
    cfg = cls()
    cfg.model.model_name_or_path = model
    cfg.model.num_gpus_per_node = 2
    cfg.model.adam.lr = lr
    cfg.model.lr_warmup_ratio = 0.0
    cfg.model.lr_scheduler = "constant"
    cfg.data.dataset = [dataset]
    cfg.data.max_len = 32
    cfg.train.batch_size = 16
    cfg.train.micro_batch_size = 4
    cfg.train.max_epochs = epochs
    cfg.ds.zero_stage = 3
    cfg.ds.param_dtype = "fp32"
    cfg.ckpt.output_dir = str(tmp_path / "run")
    return cfg


def test_prm_ranks_held_out_right_steps_above_wrong_ones(factory, tmp_path):
    from rlhf_agents.prm_reward import ProcessRewardModel
    from rlhf_core.testing.tiny import make_tiny_llama

    model = make_tiny_llama(tmp_path / "model", num_words=60, hidden_size=64, intermediate_size=128)
    rows = arithmetic_rows(320, seed=0) + arithmetic_rows(320, seed=1, soft=True)  # hard and soft labels
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    held_out_rows = arithmetic_rows(48, seed=2)
    held_out = write_jsonl(tmp_path / "eval.jsonl", held_out_rows)
    # 6 epochs (120 steps): over data and train seeds 0-2, eval/acc 0.91-0.99, AUC 0.98-1.0, mean scores right
    # 0.88-0.92 / wrong 0.08-0.17 (with 8 epochs: acc 0.92-0.98, AUC 0.98-1.0, right 0.80-0.95, wrong 0.06-0.11)
    cfg = make_cfg(PRMConfig, model, tmp_path, train, epochs=6)
    cfg.train.batch_size, cfg.train.micro_batch_size = 32, 8
    cfg.prm.placeholder_token, cfg.prm.reward_tokens = MARK, [GOOD, BAD]
    cfg.eval.dataset = [held_out]
    cfg.ds.packing_samples = True
    result = run_supervised("prm", cfg, factory)
    assert result["eval"]["eval/acc"] > 0.85, result["eval"]

    # The exported PRM, scored by the reward source's model (a second, independent forward pass).
    prm = ProcessRewardModel(result["output_dir"])
    scores = prm.step_scores([""] * len(held_out_rows), [r["input"] for r in held_out_rows])
    right = [s for r, ss in zip(held_out_rows, scores) for s, lab in zip(ss, r["label"]) if lab == GOOD]
    wrong = [s for r, ss in zip(held_out_rows, scores) for s, lab in zip(ss, r["label"]) if lab == BAD]
    assert len(right) + len(wrong) == 3 * len(held_out_rows)
    pairs = sum(r > w for r in right for w in wrong) / (len(right) * len(wrong))  # ROC AUC
    print(
        f"PRM held-out: eval/acc {result['eval']['eval/acc']:.3f}, AUC {pairs:.3f}, mean score right "
        f"{sum(right) / len(right):.3f} / wrong {sum(wrong) / len(wrong):.3f}"
    )
    assert pairs > 0.9, pairs
    assert sum(right) / len(right) > 0.7 > 0.3 > sum(wrong) / len(wrong)


def kd_models(root) -> tuple[str, str]:
    """A student (hidden 32) and a wider teacher (hidden 64) with the same tokenizer. The teacher is a sharp
    bigram model (its layers write nothing, its LM head is scaled up), something the student can learn in
    a few dozen steps."""
    from transformers import AutoModelForCausalLM

    from rlhf_core.testing.tiny import make_tiny_llama

    student = make_tiny_llama(root / "student", seed=0, num_words=60)
    teacher = make_tiny_llama(root / "teacher", seed=1, num_words=60, hidden_size=64, intermediate_size=128)
    model = AutoModelForCausalLM.from_pretrained(teacher)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(teacher)
    return student, teacher


def teacher_rows(teacher: str, n: int, seed: int) -> list[dict]:
    """Prompts of 3 random words, responses of 4 words sampled from the teacher."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(teacher), AutoModelForCausalLM.from_pretrained(teacher).eval()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    allowed = torch.full((len(tok),), float("-inf"))
    allowed[tok.convert_tokens_to_ids([f"w{i}" for i in range(60)])] = 0.0  # words only: no eos mid-response
    rows = []
    for _ in range(n):
        prompt = [tok.convert_tokens_to_ids(f"w{rng.randrange(60)}") for _ in range(3)]
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(4):
                logits = model(torch.tensor([ids])).logits[0, -1] + allowed
                ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1)))
        rows.append({"input": tok.decode(prompt), "output": tok.decode(ids[3:])})
    return rows


def kl_to_teacher(student: str, teacher: str, rows: list[dict]) -> float:
    """Token mean of KL(teacher || student) over the response tokens (and eos), computed here with plain
    transformers, independently of the trainer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(student)
    s_model = AutoModelForCausalLM.from_pretrained(student).eval()
    t_model = AutoModelForCausalLM.from_pretrained(teacher).eval()
    total, count = 0.0, 0
    for row in rows:
        prompt = tok(row["input"], add_special_tokens=False)["input_ids"]
        response = tok(row["output"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            s = torch.log_softmax(s_model(ids).logits[0].double(), -1)
            t = torch.log_softmax(t_model(ids).logits[0].double(), -1)
        at = slice(len(prompt) - 1, len(prompt) + len(response) - 1)  # the positions predicting the response
        total += float((t[at].exp() * (t[at] - s[at])).sum())
        count += len(response)
    return total / count


def test_kd_student_moves_close_to_its_teacher(factory, tmp_path):
    student, teacher = kd_models(tmp_path)
    train = write_jsonl(tmp_path / "train.jsonl", teacher_rows(teacher, 128, seed=0))
    held_out_rows = teacher_rows(teacher, 32, seed=1)
    held_out = write_jsonl(tmp_path / "eval.jsonl", held_out_rows)
    cfg = make_cfg(KDConfig, student, tmp_path, train, lr=1e-2, epochs=4)
    cfg.data.input_key, cfg.data.output_key = "input", "output"
    cfg.teacher.model_name_or_path = teacher
    cfg.teacher.kd_coef = 0.9  # with 128 rows, the NLL of single samples adds more noise than signal
    cfg.eval.dataset = [held_out]
    cfg.ds.packing_samples = True
    before = kl_to_teacher(student, teacher, held_out_rows)
    result = run_supervised("kd", cfg, factory)
    after = kl_to_teacher(result["output_dir"], teacher, held_out_rows)
    print(f"KD held-out KL(teacher || student): untrained {before:.4f}, distilled {after:.4f}")
    assert after < 0.3 * before, (before, after)
    # The trainer's held-out KL (teacher forward on the workers, packed) is the same number.
    assert result["eval"]["eval/kl"] == pytest.approx(after, rel=1e-4, abs=1e-5)
    steps = [json.loads(line) for line in open(f"{cfg.ckpt.output_dir}/metrics.jsonl")]
    for m in steps:  # the step loss is the kd_coef mix of its two token means
        assert m["loss"] == pytest.approx(0.1 * m["gpt_loss"] + 0.9 * m["distil_loss"], rel=1e-4)
