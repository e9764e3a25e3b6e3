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
    f.write_text(
        json.dumps({"input": " ".join(f"w{i}" for i in range(6)), "label": "x"})
        + "\n"
        + json.dumps({"input": "w1", "label": "y"})
        + "\n"
    )
    tok = make_tiny_tokenizer()
    with pytest.raises(DataError, match="prompt has 6 tokens, more than the 4 allowed"):
        load_prompts(make_cfg(f), tok)  # budget: max_len 12 - max_new_tokens 8
    kept = load_prompts(make_cfg(f, overlong_prompt_policy="truncate_left"), tok)
    assert kept[0].ids == tok("w2 w3 w4 w5", add_special_tokens=False)["input_ids"]
    assert [p.label for p in load_prompts(make_cfg(f, overlong_prompt_policy="skip"), tok)] == ["y"]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from transformers import AutoTokenizer

    from rlhf_core.testing.tiny import make_tiny_vlm
    from rlhf_core.vision import ImageProcessing

    path = make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model")
    return AutoTokenizer.from_pretrained(path), ImageProcessing.from_pretrained(path)


def test_prompts_with_images_hold_their_image_tokens_and_where_the_images_are(tmp_path, vlm):
    from PIL import Image

    from rlhf_core.testing.tiny import IMAGE_PLACEHOLDER

    tok, images = vlm
    (tmp_path / "img").mkdir()
    Image.new("RGB", (56, 84), (255, 0, 0)).save(tmp_path / "img" / "a.png")  # 6 image tokens
    Image.new("RGB", (56, 56), (0, 0, 255)).save(tmp_path / "img" / "b.png")  # 4
    chat = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w1"}, {"type": "image"}]}
    ]
    rows = [
        {"input": chat, "images": ["img/a.png", "img/b.png"], "label": "two"},  # a conversation, 2 images
        {"input": "w2 w3", "images": "img/b.png", "label": "one"},  # a question: image first
        {"input": "w4", "images": None, "label": "none"},
    ]  # text only
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = make_cfg(f, image_key="images", max_images_per_prompt=2, apply_chat_template=True, max_len=64)
    two, one, none = load_prompts(cfg, tok, images=images)
    pad = images.image_token_id
    assert [p.ids.count(pad) for p in (two, one, none)] == [10, 4, 0]
    assert one.text.index(IMAGE_PLACEHOLDER) < one.text.index("w2")
    served = two.image_inputs(images)
    assert [im.num_tokens for im in served] == [6, 4] and served[0].image.getpixel((0, 0)) == (255, 0, 0)
    assert none.images == () and none.image_inputs(images) == []
    # a prompt used as it is must carry its placeholders itself
    f.write_text(json.dumps({"input": "w2 w3", "images": ["img/b.png"], "label": "x"}) + "\n")
    with pytest.raises(DataError, match=rf"{f} row 0: the text has 0 image placeholders for 1 images"):
        load_prompts(make_cfg(f, image_key="images", max_len=64), tok, images=images)
    f.write_text(
        json.dumps({"input": f"{IMAGE_PLACEHOLDER} w2 w3", "images": ["img/b.png"], "label": "x"}) + "\n"
    )
    (raw,) = load_prompts(make_cfg(f, image_key="images", max_len=64), tok, images=images)
    assert raw.ids.count(pad) == 4


def test_a_missing_image_names_file_and_row_or_is_skipped_and_images_are_never_cut(tmp_path, vlm):
    from PIL import Image

    from rlhf_core.data import DataStats

    tok, images = vlm
    Image.new("RGB", (56, 56)).save(tmp_path / "ok.png")
    f = tmp_path / "prompts.jsonl"
    rows = [
        {"input": "w1", "images": ["ok.png"], "label": "a"},
        {"input": "w2", "images": ["gone.png"], "label": "b"},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = make_cfg(f, image_key="images", apply_chat_template=True, max_len=64)
    with pytest.raises(
        DataError, match=rf"{f} row 1: image 0 of key 'images': image file gone.png does not exist"
    ):
        load_prompts(cfg, tok, images=images)
    stats = DataStats()
    kept = load_prompts(
        make_cfg(f, image_key="images", apply_chat_template=True, max_len=64, skip_bad_rows=True),
        tok,
        images=images,
        stats=stats,
    )
    assert [p.label for p in kept] == ["a"] and stats.as_metrics()["data/bad_rows_skipped"] == 1
    # 4 image tokens + the chat markup do not fit in 16 - 8: cutting from the left would cut the image
    f.write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(
        DataError,
        match=rf"{f} row 0: the prompt has \d+ tokens with its images, more than the 8 "
        "allowed, and a prompt with images cannot be cut",
    ):
        load_prompts(
            make_cfg(
                f,
                image_key="images",
                apply_chat_template=True,
                max_len=16,
                overlong_prompt_policy="truncate_left",
            ),
            tok,
            images=images,
        )


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
