"""RL prompts: read once, served in a seeded order per episode, resumable from a position; bad rows named."""

import json

import pytest

from rlhf_cli.rl.prompts import Prompt, PromptStream, load_prompts
from rlhf_core.config import RLConfig
from rlhf_core.data import DataError
from rlhf_core.testing.tiny import make_tiny_tokenizer


def test_every_prompt_once_per_episode_and_exact_resume():
    prompts = [Prompt(i, [i], f"p{i}") for i in range(7)]
    stream = PromptStream(prompts, seed=3, num_episodes=2)
    first = [p.uid for p in stream.take(5)]
    state = stream.state_dict()
    rest = [p.uid for p in stream.take(100)]
    assert sorted(first + rest[:2]) == list(range(7)) and sorted(rest[2:]) == list(range(7))
    assert stream.exhausted and stream.take(1) == []
    resumed = PromptStream(prompts, seed=3, num_episodes=2)
    resumed.load_state_dict(state)
    assert [p.uid for p in resumed.take(100)] == rest
    assert PromptStream(prompts, seed=3).take(7) != PromptStream(prompts, seed=4).take(7)  # the seed matters


def test_resuming_on_different_data_is_refused():
    stream = PromptStream([Prompt(i, [i], "") for i in range(5)], seed=0)
    with pytest.raises(ValueError, match="checkpoint was taken with 6 prompts but the data now has 5"):
        stream.load_state_dict({"episode": 0, "position": 2, "num_prompts": 6})


def make_cfg(path, **data):
    cfg = RLConfig()
    cfg.data.prompt_dataset = [str(path)]
    cfg.data.label_key = "label"
    cfg.data.max_len = 12
    cfg.rollout.max_new_tokens = 8
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def test_bad_rows_name_file_row_and_key_or_are_skipped(tmp_path):
    f = tmp_path / "prompts.jsonl"
    rows = [{"input": "w1 w2", "label": "a"}, {"prompt": "w3", "label": "b"}, {"input": 5, "label": "c"}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tok = make_tiny_tokenizer()
    with pytest.raises(DataError, match=rf"{f}.*row 1.*missing key 'input'"):
        load_prompts(make_cfg(f), tok)
    from rlhf_core.data import DataStats

    stats = DataStats()
    prompts = load_prompts(make_cfg(f, skip_bad_rows=True), tok, stats=stats)
    assert [p.label for p in prompts] == ["a"] and stats.as_metrics()["data/bad_rows_skipped"] == 2


def test_overlong_prompts_follow_the_policy(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text(json.dumps({"input": " ".join(f"w{i}" for i in range(6)), "label": "x"}) + "\n"
                 + json.dumps({"input": "w1", "label": "y"}) + "\n")
    tok = make_tiny_tokenizer()
    with pytest.raises(DataError, match="prompt has 6 tokens, more than the 4 allowed"):
        load_prompts(make_cfg(f), tok)  # budget: max_len 12 - max_new_tokens 8
    kept = load_prompts(make_cfg(f, overlong_prompt_policy="truncate_left"), tok)
    assert kept[0].ids == tok("w2 w3 w4 w5", add_special_tokens=False)["input_ids"]
    assert [p.label for p in load_prompts(make_cfg(f, overlong_prompt_policy="skip"), tok)] == ["y"]


def test_tokenizer_chat_template_shapes_the_rl_prompts(tmp_path):
    """--data.tokenizer_chat_template replaces the model's template for the prompts the engines get."""
    from rlhf_core.data import load_tokenizer

    make_tiny_tokenizer(tmp_path / "tok")
    f = tmp_path / "prompts.jsonl"
    f.write_text(json.dumps({"input": "w1 w2", "label": "a"}) + "\n")
    cfg = make_cfg(f, apply_chat_template=True, max_len=20)
    (own,) = load_prompts(cfg, load_tokenizer(str(tmp_path / "tok"), cfg.data))
    assert own.text == "<|user|> w1 w2 </s> <|assistant|> "  # the saved tokenizer's template
    cfg.data.tokenizer_chat_template = "{% for m in messages %}w9 {{ m['content'] }} {% endfor %}w8"
    (replaced,) = load_prompts(cfg, load_tokenizer(str(tmp_path / "tok"), cfg.data))
    assert replaced.text == "w9 w1 w2 w8"
