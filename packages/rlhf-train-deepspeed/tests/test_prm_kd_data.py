"""PRM and KD without Ray: examples and micro-batches, the errors bad input gets before any worker starts,
and the logits the worker takes (packed equals padded equals one row at a time)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.config import KDConfig, PRMConfig
from rlhf_core.data import DataError, DataStats, Row
from rlhf_core.supervised import SetupError, check_teacher, prm_tokens
from rlhf_core.testing.tiny import make_tiny_llama, make_tiny_tokenizer
from rlhf_train_deepspeed.models import response_logits, step_logits
from rlhf_train_deepspeed.strategy import ConfigError
from rlhf_train_deepspeed.supervised_data import build_examples, collate, step_counts
from rlhf_train_deepspeed.testing import write_jsonl
from rlhf_train_deepspeed.trainers import run_supervised


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer(num_words=60)


def prm_cfg(**data):
    cfg = PRMConfig()
    cfg.data.max_len = 32
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def rows(*dicts):
    return [Row(d, "steps.jsonl", i) for i, d in enumerate(dicts)]


def test_prm_examples_hold_marker_positions_and_labels(tok):
    prm = prm_tokens(tok, "w50", ["w51", "w52"])
    data = rows(
        {"input": "w1 w2 w50 w3 w5 w50", "label": ["w51", "w52"]}, {"input": "w7 w50", "label": [0.25]}
    )
    examples = build_examples("prm", data, tok, prm_cfg(), DataStats(), prm)
    assert [e.positions for e in examples] == [[2, 5], [1]]
    assert [e.classes for e in examples] == [[0, 1], [1]]  # p = 0.25 < 0.5: the negative token's class
    assert math.isnan(examples[0].soft_labels[0]) and examples[1].soft_labels == [0.25]
    batch = collate("prm", examples, tok.pad_token_id)
    assert batch.rows.tolist() == [0, 0, 1] and batch.cols.tolist() == [2, 5, 1]
    assert (
        batch.seq.input_ids[0, 2]
        == batch.seq.input_ids[0, 5]
        == batch.seq.input_ids[1, 1]
        == prm.placeholder_id
    )
    assert step_counts("prm", [batch]) == {"num_tokens": 3.0, "num_sequences": 2.0}


def test_prm_full_vocabulary_labels_and_truncation(tok):
    prm = prm_tokens(tok, "w50", None)
    stats = DataStats()
    data = rows({"input": "w1 w50 w2 w50 w3 w50", "label": ["w9", "w8", "w7"]})
    (example,) = build_examples("prm", data, tok, prm_cfg(max_len=4), stats, prm)
    assert example.ids == tok("w1 w50 w2 w50")["input_ids"] and example.positions == [1, 3]
    assert example.classes == tok.convert_tokens_to_ids(["w9", "w8"])  # vocabulary ids
    assert stats.counts["prm_steps_truncated"] == 1


@pytest.mark.parametrize(
    "row, message",
    [
        (
            {"input": "w1 w2 w3", "label": ["w51"]},
            "steps.jsonl row 0: key 'input' has no placeholder token 'w50'",
        ),
        ({"input": "w1 w50 w2", "label": ["w51", "w52"]}, "1 steps marked with 'w50' but 2 labels"),
        (
            {"input": "w1 w50", "label": ["w9"]},
            r"step 0 label 'w9' \(key 'label'\) is not one of --prm.reward_tokens",
        ),
        ({"input": "w1 w50", "label": [1.5]}, "in \\[0, 1\\]"),
        ({"input": "w1 w50", "label": "w51"}, "key 'label' .* should be list"),
    ],
)
def test_prm_bad_rows_name_the_file_row_and_step(tok, row, message):
    prm = prm_tokens(tok, "w50", ["w51", "w52"])
    with pytest.raises(DataError, match=message):
        build_examples("prm", rows(row), tok, prm_cfg(), DataStats(), prm)


def test_prm_soft_labels_need_two_reward_tokens(tok):
    prm = prm_tokens(tok, "w50", ["w51", "w52", "w53"])
    with pytest.raises(DataError, match="exactly two --prm.reward_tokens"):
        build_examples("prm", rows({"input": "w1 w50", "label": [0.5]}), tok, prm_cfg(), DataStats(), prm)


def test_prm_tokens_must_be_single_known_tokens(tok):
    with pytest.raises(SetupError, match="needs --prm.placeholder_token"):
        prm_tokens(tok, None, None)
    with pytest.raises(SetupError, match=r"--prm.reward_tokens 'w51 w52' is 2 tokens"):
        prm_tokens(tok, "w50", ["w51 w52", "w53"])
    with pytest.raises(
        SetupError, match="--prm.placeholder_token 'ки' is not in this tokenizer's vocabulary"
    ):
        prm_tokens(tok, "ки", ["w51", "w52"])
    with pytest.raises(SetupError, match="must differ"):
        prm_tokens(tok, "w50", ["w50", "w52"])


class NoWorkers:
    """A group factory that fails the test if a run gets as far as starting workers."""

    def __call__(self, *args):
        raise AssertionError("a worker group was started")


def test_bad_input_stops_the_run_before_any_worker(tmp_path):
    model = make_tiny_llama(tmp_path / "m", num_words=60)
    data = write_jsonl(
        tmp_path / "d.jsonl",
        [{"input": "w1 w50 w2 w50", "label": ["w51", "w52"]}, {"input": "w1 w2", "label": ["w51"]}],
    )
    cfg = PRMConfig()
    cfg.model.model_name_or_path, cfg.data.dataset = model, [data]
    cfg.ckpt.output_dir = str(tmp_path / "run")
    with pytest.raises(ConfigError, match="needs --prm.placeholder_token"):
        run_supervised("prm", cfg, NoWorkers())
    cfg.prm.placeholder_token, cfg.prm.reward_tokens = "w50", ["w51", "w52"]
    with pytest.raises(DataError, match=r"d.jsonl row 1: key 'input' has no placeholder token 'w50'"):
        run_supervised("prm", cfg, NoWorkers())
    kd = KDConfig()
    kd.model.model_name_or_path, kd.data.dataset, kd.data.output_key = model, [data], "label"
    kd.ckpt.output_dir = str(tmp_path / "run")
    with pytest.raises(ConfigError, match="needs a teacher: --teacher.model_name_or_path"):
        run_supervised("kd", kd, NoWorkers())


def test_flags_that_cannot_apply_are_refused(tmp_path):
    from rlhf_core.supervised import preflight

    model = make_tiny_llama(tmp_path / "m", num_words=60)
    cfg = PRMConfig()
    cfg.model.model_name_or_path, cfg.prm.placeholder_token = model, "w50"
    cfg.data.apply_chat_template = True
    with pytest.raises(SetupError, match="--data.apply_chat_template cannot apply"):
        preflight("prm", cfg)
    cfg.data.apply_chat_template, cfg.ds.ring_attn_size = False, 2
    with pytest.raises(SetupError, match="--ds.ring_attn_size 2: rlhf train prm does not support"):
        preflight("prm", cfg)
    kd = KDConfig()
    kd.model.model_name_or_path = kd.teacher.model_name_or_path = model
    kd.teacher.kd_coef = 1.5
    with pytest.raises(SetupError, match="--teacher.kd_coef 1.5"):
        preflight("kd", kd)


def test_teacher_must_share_the_vocabulary(tmp_path):
    cfg = KDConfig()
    cfg.model.model_name_or_path = make_tiny_llama(tmp_path / "s", num_words=60)
    cfg.teacher.model_name_or_path = make_tiny_llama(tmp_path / "t", num_words=61)
    with pytest.raises(SetupError, match="has 68 vocabulary entries, the student .* 67"):
        check_teacher(cfg)
    cfg.teacher.model_name_or_path = make_tiny_llama(tmp_path / "t2", num_words=60, hidden_size=64)
    check_teacher(cfg)  # another size, the same tokens: fine


def test_step_and_response_logits_packed_equal_padded_equal_single_rows(tmp_path, tok):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_tiny_llama(tmp_path / "m", num_words=60)).eval()
    prm = prm_tokens(tok, "w50", ["w51", "w52"])
    texts = ["w1 w2 w50 w3 w4 w5 w50", "w9 w50", "w3 w4 w50 w6 w50"]
    examples = build_examples(
        "prm",
        rows(*({"input": t, "label": ["w51"] * t.count("w50")} for t in texts)),
        tok,
        prm_cfg(),
        DataStats(),
        prm,
    )
    batch = collate("prm", examples, tok.pad_token_id)
    with torch.no_grad():
        single = torch.cat([model(torch.tensor([e.ids])).logits[0, e.positions] for e in examples])
        torch.testing.assert_close(step_logits(model, batch, packing=False), single, atol=1e-5, rtol=0)
        torch.testing.assert_close(step_logits(model, batch, packing=True), single, atol=1e-5, rtol=0)

    sft = [{"input": "w1 w2", "output": "w3 w4 w5"}, {"input": "w7", "output": "w8"}]
    cfg = KDConfig()
    cfg.data.output_key = "output"
    kd_examples = build_examples("kd", rows(*sft), tok, cfg, DataStats())
    seq = collate("kd", kd_examples, tok.pad_token_id)
    with torch.no_grad():
        padded, labels, mask = response_logits(model, seq, packing=False)
        packed, labels_p, _ = response_logits(model, seq, packing=True)
        for i, e in enumerate(kd_examples):
            full = model(torch.tensor([e.prompt + e.response])).logits[0]
            n = len(e.response)
            torch.testing.assert_close(padded[i, :n], full[len(e.prompt) - 1 : -1], atol=1e-5, rtol=0)
            torch.testing.assert_close(packed[i, :n], full[len(e.prompt) - 1 : -1], atol=1e-5, rtol=0)
            assert labels[i, :n].tolist() == labels_p[i, :n].tolist() == e.response
            assert mask[i].sum() == n


def test_is_prm_model_reads_local_configs_and_never_asks_the_hub(tmp_path, monkeypatch):
    """The driver asks whether the reward model is a PRM before any worker starts; for a hub id it must look in
    the local cache only (online lookups of an unreachable hub retried for about a minute per model)."""
    import socket
    import traceback

    from rlhf_core.supervised import PLACEHOLDER_KEY, is_prm_model

    plain = make_tiny_llama(tmp_path / "plain")
    prm = make_tiny_llama(tmp_path / "prm")
    config = tmp_path / "prm" / "config.json"
    config.write_text(config.read_text().replace("{", f'{{"{PLACEHOLDER_KEY}": "<step>",', 1))

    lookups = []

    def no_network(*args, **kwargs):  # the hub client turns errors into retries, so record the attempts
        # (huggingface_hub also fetches its user-agent registry once per process: not a model lookup)
        if any(frame.name == "get_hf_file_metadata" for frame in traceback.extract_stack()):
            lookups.append(args)
        raise OSError("no network in this test")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    assert is_prm_model(prm) and not is_prm_model(plain)
    assert not is_prm_model("some-org/a-reward-model-never-downloaded")
    assert lookups == []
