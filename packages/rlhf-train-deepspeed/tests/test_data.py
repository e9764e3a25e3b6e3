"""Dataset readers, mixing, formatting and bad-input handling (rlhf_core.data + supervised_data)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from rlhf_core.config import SupervisedConfig
from rlhf_core.data import (
    DataError,
    DataStats,
    conversation_ids,
    encode,
    fit_prompt,
    load_rows,
    mix_rows,
    read_rows,
)
from rlhf_core.testing.tiny import make_tiny_tokenizer
from rlhf_train_deepspeed.supervised_data import build_examples, collate
from rlhf_train_deepspeed.testing import write_jsonl

ROWS = [{"input": f"w{i}", "output": f"w{i + 1}"} for i in range(5)]


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer(num_words=40)


def test_every_format_reads_the_same_rows_with_their_origin(tmp_path):
    import datasets
    import pandas as pd

    paths = {
        "jsonl": write_jsonl(tmp_path / "d.jsonl", ROWS),
        "json": str(tmp_path / "d.json"),
        "csv": str(tmp_path / "d.csv"),
        "parquet": str(tmp_path / "d.parquet"),
    }
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    pd.DataFrame(ROWS).to_csv(paths["csv"], index=False)
    pd.DataFrame(ROWS).to_parquet(paths["parquet"])
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "hf"))
    (tmp_path / "files").mkdir()
    write_jsonl(tmp_path / "files" / "train.jsonl", ROWS)
    write_jsonl(tmp_path / "files" / "test.jsonl", ROWS[:1])
    paths["hf_dir"] = str(tmp_path / "hf")
    paths["file_dir"] = str(tmp_path / "files")
    for kind, path in paths.items():
        rows = read_rows(path, "train")
        assert [r.data for r in rows] == ROWS, kind
        assert [r.index for r in rows] == list(range(5)), kind
    assert read_rows(paths["jsonl"])[3].where() == f"{paths['jsonl']} row 3"


def test_reader_errors_name_the_file_and_row(tmp_path):
    with pytest.raises(DataError, match="dataset not found"):
        read_rows(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "w1"}\n{"input": \n')
    with pytest.raises(DataError, match=r"bad.jsonl row 1: not valid JSON"):
        read_rows(bad)
    with pytest.raises(DataError, match="no split 'test'"):
        import datasets

        datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "hf"))
        read_rows(tmp_path / "hf", "test")


def test_mixing_follows_the_probabilities_and_is_seeded(tmp_path):
    a = read_rows(write_jsonl(tmp_path / "a.jsonl", [{"src": "a", "i": i} for i in range(100)]))
    b = read_rows(write_jsonl(tmp_path / "b.jsonl", [{"src": "b", "i": i} for i in range(100)]))
    mixed = mix_rows([a, b], [0.8, 0.2], seed=1)
    assert len(mixed) == 200
    share = Counter(r.data["src"] for r in mixed)["a"] / 200
    assert 0.72 < share < 0.88
    assert [r.data for r in mixed] == [r.data for r in mix_rows([a, b], [0.8, 0.2], seed=1)]
    assert len(mix_rows([a, b], [0.5, 0.5], max_samples=10)) == 10
    assert [r.data for r in load_rows([str(tmp_path / "a.jsonl")])] == [r.data for r in a]
    with pytest.raises(DataError, match="dataset_probs has 1 values for 2 datasets"):
        mix_rows([a, b], [1.0])


def _cfg(**data):
    cfg = SupervisedConfig()
    cfg.data.output_key = "output"
    cfg.data.max_len = 16
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def test_bad_rows_fail_naming_file_row_and_key_or_are_skipped_and_counted(tmp_path, tok):
    rows = [{"input": "w1 w2", "output": "w3"}, {"input": "w1"}, {"input": 7, "output": "w3"}]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(
        DataError, match=r"rows.jsonl row 1: missing key 'output' \(set by --data.output_key\)"
    ):
        build_examples("sft", read_rows(path), tok, _cfg(), DataStats())
    with pytest.raises(
        DataError, match=r"rows.jsonl row 2: key 'input' \(set by --data.input_key\) should be str, got int"
    ):
        build_examples("sft", read_rows(path)[2:], tok, _cfg(), DataStats())
    stats = DataStats()
    examples = build_examples("sft", read_rows(path), tok, _cfg(skip_bad_rows=True), stats)
    assert len(examples) == 1
    assert stats.as_metrics() == {"data/bad_rows_skipped": 2.0}
    # preference data: a missing rejected response
    pref = write_jsonl(tmp_path / "pref.jsonl", [{"prompt": "w1", "chosen": "w2"}])
    with pytest.raises(DataError, match=r"pref.jsonl row 0: missing key 'rejected'"):
        build_examples("dpo", read_rows(pref), tok, _cfg(prompt_key="prompt"), DataStats())


def test_overlong_prompts_follow_the_policy_and_are_never_cut_silently(tmp_path, tok):
    long_prompt = " ".join(f"w{i}" for i in range(20))  # 20 tokens; the budget is max_len - 1 = 15
    path = write_jsonl(
        tmp_path / "long.jsonl", [{"input": long_prompt, "output": "w1"}, {"input": "w2", "output": "w3"}]
    )
    with pytest.raises(DataError, match=r"long.jsonl row 0: prompt has 20 tokens, more than the 15 allowed"):
        build_examples("sft", read_rows(path), tok, _cfg(), DataStats())
    stats = DataStats()
    kept = build_examples("sft", read_rows(path), tok, _cfg(overlong_prompt_policy="skip"), stats)
    assert len(kept) == 1 and stats.counts["overlong_prompts_skipped"] == 1
    stats = DataStats()
    cut = build_examples("sft", read_rows(path), tok, _cfg(overlong_prompt_policy="truncate_left"), stats)
    assert stats.counts["overlong_prompts_truncated"] == 1
    assert cut[0].prompt == encode(tok, long_prompt)[-15:]
    assert fit_prompt([1, 2, 3], 3, "error", "x") == [1, 2, 3]
    # over-long responses are cut to the room the prompt leaves, each one counted
    pair = write_jsonl(
        tmp_path / "pair.jsonl",
        [
            {"prompt": "w1", "chosen": long_prompt, "rejected": "w2"},
            {"prompt": "w1", "chosen": long_prompt, "rejected": long_prompt},
        ],
    )
    stats = DataStats()
    pairs = build_examples("dpo", read_rows(pair), tok, _cfg(prompt_key="prompt"), stats)
    room = 16 - len(pairs[0].prompt)
    assert stats.counts["responses_truncated"] == 3
    assert [len(p.chosen) for p in pairs] == [room, room] and len(pairs[1].rejected) == room
    assert pairs[0].chosen == encode(tok, long_prompt)[:room] and pairs[0].rejected == encode(tok, "w2") + [
        tok.eos_token_id
    ]


def test_sft_examples_train_on_the_response_only(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": "w1 w2", "output": "w3 w4"}])
    (ex,) = build_examples("sft", read_rows(path), tok, _cfg(input_template="w9 {}"), DataStats())
    assert ex.prompt == encode(tok, "w9 w1 w2")
    assert ex.response == encode(tok, "w3 w4") + [tok.eos_token_id]
    batch = collate("sft", [ex, ex], tok.pad_token_id)
    assert batch.response_mask().sum().item() == 2 * 3


def test_multiturn_loss_covers_assistant_turns_only(tok):
    messages = [
        {"role": "user", "content": "w1 w2"},
        {"role": "assistant", "content": "w3"},
        {"role": "user", "content": "w4"},
        {"role": "assistant", "content": "w5 w6"},
    ]
    ids, mask = conversation_ids(tok, messages)
    text = tok.convert_ids_to_tokens(ids)
    trained = [t for t, m in zip(text, mask, strict=True) if m]
    # The template renders "<|role|> content </s>"; assistant turns train on content and their </s>.
    assert trained == ["w3", "</s>", "w5", "w6", "</s>"]
    assert text[: text.index("w3")][-1] == "<|assistant|>"


def test_multiturn_sft_examples_from_rows(tmp_path, tok):
    conv = [
        {"role": "user", "content": "w1"},
        {"role": "assistant", "content": "w2"},
        {"role": "user", "content": "w3"},
        {"role": "assistant", "content": "w4"},
    ]
    path = write_jsonl(tmp_path / "c.jsonl", [{"input": conv}, {"input": "not a conversation"}])
    cfg = _cfg(multiturn=True, max_len=64)
    with pytest.raises(
        DataError, match=r"c.jsonl row 1: key 'input' \(set by --data.input_key\) should be list"
    ):
        build_examples("sft", read_rows(path), tok, cfg, DataStats())
    (ex,) = build_examples("sft", read_rows(path)[:1], tok, cfg, DataStats())
    trained = [t for t, m in zip(tok.convert_ids_to_tokens(ex.response), ex.response_mask, strict=True) if m]
    assert trained == ["w2", "</s>", "w4", "</s>"]
