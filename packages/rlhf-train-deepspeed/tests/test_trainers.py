"""The SFT, RM, DPO and KTO trainers end to end: 2 ZeRO ranks on Ray, a tiny Llama, synthetic data."""

from __future__ import annotations

import json
import random

import pytest
import torch

from rlhf_core.config import PreferenceConfig, SupervisedConfig
from rlhf_train_deepspeed.testing import sft_rows, words, write_jsonl
from rlhf_train_deepspeed.trainers import run_supervised

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

GOOD, BAD = range(30, 40), range(40, 50)


@pytest.fixture(scope="module")
def factory(reused_groups):
    return reused_groups[2]


def preference_rows(n: int, seed: int) -> list[dict]:
    """A learnable preference: the chosen response is made of 'good' words, the rejected of 'bad' ones."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        rows.append(
            {
                "prompt": words(rng.randrange(20) for _ in range(3)),
                "chosen": words(rng.choice(GOOD) for _ in range(3)),
                "rejected": words(rng.choice(BAD) for _ in range(3)),
            }
        )
    return rows


def make_cfg(cls, tiny_llama, tmp_path, dataset, *, lr=3e-3, epochs=2, stage=3, **data):
    cfg = cls()
    cfg.model.model_name_or_path = tiny_llama
    cfg.model.num_gpus_per_node = 2
    cfg.model.adam.lr = lr
    cfg.model.lr_warmup_ratio = 0.0
    cfg.model.lr_scheduler = "constant"
    cfg.data.dataset = [dataset]
    cfg.data.max_len = 32
    for k, v in data.items():
        setattr(cfg.data, k, v)
    cfg.train.batch_size = 16
    cfg.train.micro_batch_size = 4
    cfg.train.max_epochs = epochs
    cfg.ds.zero_stage = stage
    cfg.ds.param_dtype = "fp32"
    cfg.ckpt.output_dir = str(tmp_path / "run")
    return cfg


def read_metrics(cfg) -> list[dict]:
    with open(f"{cfg.ckpt.output_dir}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_sft_loss_falls(factory, tiny_llama, tmp_path):
    data = write_jsonl(tmp_path / "sft.jsonl", sft_rows(64))
    cfg = make_cfg(SupervisedConfig, tiny_llama, tmp_path, data, output_key="output", epochs=3)
    cfg.ds.packing_samples = True
    result = run_supervised("sft", cfg, factory)
    losses = [m["loss"] for m in read_metrics(cfg) if "loss" in m]
    assert len(losses) == 12
    assert losses[-1] < 0.8 * losses[0], losses
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(result["output_dir"]) is not None


def test_reward_model_ranks_held_out_pairs(factory, tiny_llama, tmp_path):
    from transformers import AutoModelForSequenceClassification

    train = write_jsonl(tmp_path / "train.jsonl", preference_rows(96, seed=0))
    held_out = write_jsonl(tmp_path / "eval.jsonl", preference_rows(32, seed=1))
    cfg = make_cfg(SupervisedConfig, tiny_llama, tmp_path, train, prompt_key="prompt")
    cfg.eval.dataset = [held_out]
    cfg.logger.logging_steps = 5
    result = run_supervised("rm", cfg, factory)
    assert result["eval"]["eval/accuracy"] > 0.9, result["eval"]
    logged = read_metrics(cfg)  # 12 steps: the first, every 5th and the last
    assert [m["step"] for m in logged] == [1, 5, 10, 12] and "eval/accuracy" in logged[-1]
    rm = AutoModelForSequenceClassification.from_pretrained(result["output_dir"])
    assert rm.config.std > 0 and isinstance(rm.config.mean, float)  # for --reward.normalize_enable


def test_dpo_widens_the_chosen_rejected_margin(factory, tiny_llama, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", preference_rows(64, seed=0))
    cfg = make_cfg(PreferenceConfig, tiny_llama, tmp_path, train, prompt_key="prompt", lr=2e-3)
    run_supervised("dpo", cfg, factory)
    steps = read_metrics(cfg)
    margins = [m["reward_margin"] for m in steps]
    assert margins[0] == pytest.approx(0.0, abs=1e-4)  # policy == reference at first
    assert margins[-1] > 0.15 and margins[-1] > margins[len(margins) // 2] > margins[1], margins
    assert steps[-1]["loss"] < steps[0]["loss"]


def test_kto_improves_its_objective(factory, tiny_llama, tmp_path):
    rng = random.Random(0)
    rows = []
    for _ in range(64):
        good = rng.random() < 0.5
        rows.append(
            {
                "input": words(rng.randrange(20) for _ in range(3)),
                "output": words(rng.choice(GOOD if good else BAD) for _ in range(3)),
                "label": good,
            }
        )
    data = write_jsonl(tmp_path / "kto.jsonl", rows)
    cfg = make_cfg(PreferenceConfig, tiny_llama, tmp_path, data, output_key="output", lr=3e-3)
    run_supervised("kto", cfg, factory)
    losses = [m["loss"] for m in read_metrics(cfg)]
    assert losses[0] == pytest.approx(0.5, abs=1e-3)  # 1 - sigmoid(0) with policy == reference
    assert losses[-1] < 0.47 and losses[-1] < min(losses[:3]), losses


def test_lora_sft_exports_an_adapter_that_merges_into_a_plain_model(factory, tiny_llama, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlhf_cli.lora_merge import main as lora_merge

    data = write_jsonl(tmp_path / "sft.jsonl", sft_rows(32))
    cfg = make_cfg(SupervisedConfig, tiny_llama, tmp_path, data, output_key="output", stage=2, lr=1e-2)
    cfg.ds.lora.rank = 4
    cfg.ds.lora.alpha = 8
    result = run_supervised("sft", cfg, factory)
    losses = [m["loss"] for m in read_metrics(cfg)]
    assert losses[-1] < losses[0]
    merged_dir = str(tmp_path / "merged")
    assert lora_merge(["--base", tiny_llama, "--adapter", result["output_dir"], "--out", merged_dir]) == 0
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_llama), result["output_dir"]
    ).eval()
    ids = torch.tensor([[1, 8, 9, 10, 11]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapter(ids).logits, atol=1e-5, rtol=0)
        base = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
        assert not torch.allclose(
            base(ids).logits, merged(ids).logits, atol=1e-4
        )  # the adapter did something
