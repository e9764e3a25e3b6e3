"""Images in prompts: reading them from rows, the image processor and image tokens, forward inputs, and the
HF engine generating from text + images (a tiny Qwen2-VL / Qwen2.5-VL built here, random weights)."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image

from rlhf_core.data import DataError, Row
from rlhf_core.rollout.hf_engine import HFEngine
from rlhf_core.testing.tiny import IMAGE_PLACEHOLDER, make_tiny_vlm
from rlhf_core.types import GenerationRequest, SamplingParams
from rlhf_core.vision import ImageProcessing, image_forward_inputs, load_model, read_image, row_images


def png(color=(255, 0, 0), size=(56, 56)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vlm(request, tmp_path_factory):
    path = make_tiny_vlm(tmp_path_factory.mktemp(request.param) / "model", kind=request.param)
    from transformers import AutoTokenizer

    return {
        "path": path,
        "tok": AutoTokenizer.from_pretrained(path),
        "images": ImageProcessing.from_pretrained(path),
        "model": load_model(path).eval(),
    }


def prompt_ids(vlm, images, words="w3 w4") -> list[int]:
    msgs = [
        {"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": words}]}
    ]
    text = vlm["tok"].apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return vlm["images"].expand(vlm["tok"](text, add_special_tokens=False)["input_ids"], images)


# --- reading ----------------------------------------------------------------------------------------------


def test_every_image_form_of_a_row_reads_as_the_same_pixels(tmp_path, monkeypatch):
    data = png((10, 200, 30))
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(data)
    monkeypatch.chdir(tmp_path.parent)  # relative paths then resolve against the data file's folder
    forms = [
        str(tmp_path / "imgs" / "a.png"),
        "imgs/a.png",
        f"file://{tmp_path / 'imgs' / 'a.png'}",
        "data:image/png;base64," + base64.b64encode(data).decode(),
        data,
        {"bytes": data, "path": None},
        {"bytes": None, "path": str(tmp_path / "imgs" / "a.png")},
    ]
    row = Row({"images": forms}, str(tmp_path / "data.jsonl"), 3)
    pictures = [ref.read() for ref in row_images(row, "images", max_images=0)]
    assert len(pictures) == len(forms)
    for p in pictures:
        assert p.mode == "RGB" and p.size == (56, 56) and p.getpixel((5, 5)) == (10, 200, 30)
    one = Row({"images": data}, "d.jsonl", 0)  # a single value is a list of one
    assert len(row_images(one, "images", 1)) == 1
    assert row_images(Row({"images": None}, "d.jsonl", 0), "images", 1) == []  # a text-only row


def test_bad_images_fail_naming_file_row_key_and_image(tmp_path):
    (tmp_path / "text.png").write_text("not an image")
    where = f"{tmp_path / 'data.jsonl'} row 7: image 0 of key 'images'"

    def read(value):
        row = Row({"images": [value]}, str(tmp_path / "data.jsonl"), 7)
        return [ref.read() for ref in row_images(row, "images", 0)]

    with pytest.raises(DataError, match=rf"{where}: image file missing.png does not exist"):
        read("missing.png")
    with pytest.raises(
        DataError, match=rf"{where}: .*text.png cannot be read as an image \(UnidentifiedImageError"
    ):
        read(str(tmp_path / "text.png"))
    with pytest.raises(
        DataError, match=rf"{where}: http://x/a.png is a web URL; rlhf reads local files only"
    ):
        read("http://x/a.png")
    with pytest.raises(DataError, match=rf"{where}: the data URI is not base64"):
        read("data:image/png;base64,@@@")
    with pytest.raises(
        DataError, match=rf"{where}: expected a path, file:// URL, data URI or bytes, got int"
    ):
        read(5)
    with pytest.raises(
        DataError,
        match=r"d.jsonl row 2: missing key 'images' \(set by --data.image_key\); the row "
        r"has keys: prompt",
    ):
        row_images(Row({"prompt": "x"}, "d.jsonl", 2), "images", 1)
    with pytest.raises(
        DataError,
        match=r"d.jsonl row 2: 2 images in key 'images', more than "
        r"--data.max_images_per_prompt 1",
    ):
        row_images(Row({"images": [png(), png()]}, "d.jsonl", 2), "images", 1)
    assert read_image(png(), tmp_path, "w").size == (56, 56)


# --- processing and tokens -----------------------------------------------------------------------------


def test_an_image_costs_24_bytes_per_pixel_and_one_token_per_merged_patch(vlm):
    a, b = vlm["images"].process([Image.new("RGB", (56, 84)), Image.new("RGB", (60, 60))])
    # 56 x 84 stays (multiples of patch 14 x merge 2 = 28): a 4 x 6 grid of 14-pixel patches, 2 x 3 merged
    assert a.grid_thw.tolist() == [1, 6, 4] and a.num_tokens == 6
    assert a.pixel_values.shape == (24, 3 * 2 * 14 * 14) and a.pixel_values.dtype == torch.float32
    assert a.pixel_values.nbytes == 56 * 84 * 24
    assert b.grid_thw.tolist() == [1, 4, 4] and b.num_tokens == 4  # 60 x 60 rounds to 56 x 56
    ids = vlm["tok"](f"w1 {IMAGE_PLACEHOLDER} w2 {IMAGE_PLACEHOLDER}", add_special_tokens=False)["input_ids"]
    pad = vlm["images"].image_token_id
    assert vlm["images"].expand(ids, [a, b]).count(pad) == 10
    with pytest.raises(ValueError, match="the text has 2 image placeholders for 1 images"):
        vlm["images"].expand(ids, [a])


def test_forward_inputs_match_the_models_own_image_path_and_encode_each_image_once(vlm):
    """Rows that share images (a group's samples) encode them once, and the logits are those of the model
    fed the repeated pixel values itself (its own M-RoPE and placeholder scatter)."""
    m = vlm["model"]
    imgs = vlm["images"].process(
        [Image.new("RGB", (56, 84), (200, 30, 30)), Image.new("RGB", (56, 56), (0, 0, 250))]
    )
    ids = prompt_ids(vlm, imgs)
    rows = torch.tensor([ids + [10, 11, 12], ids + [13, 0, 0], [5, 20, 21, 22, 0, 0] + [0] * (len(ids) - 3)])
    mask = torch.ones_like(rows)
    mask[1, -2:] = 0
    mask[2, 4:] = 0
    images = [imgs, imgs, []]  # the third row is text only
    calls = []
    hook = m.model.visual.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[0]))
    try:
        with torch.no_grad():
            kwargs, offsets = image_forward_inputs(m, rows, mask, images)
            mine = m(input_ids=rows, attention_mask=mask, **kwargs).logits
            pixels = torch.cat([im.pixel_values for im in imgs] * 2)
            grid = torch.stack([im.grid_thw for im in imgs] * 2)
            theirs = m(
                input_ids=rows,
                attention_mask=mask,
                pixel_values=pixels,
                image_grid_thw=grid,
                mm_token_type_ids=(rows == m.config.image_token_id).int(),
            ).logits
    finally:
        hook.remove()
    assert calls[0] == 24 + 16  # the first call: each distinct image's patches once, not once per row
    real = mask.bool()
    # fp32 throughout, the same ops in the same order: differences are rounding of the scatter, ~1e-7
    assert (mine - theirs)[real].abs().max() < 1e-5
    # M-RoPE: the text after a 2 x 3 and a 2 x 2 merged grid sits 3 + 2 positions before its token index
    assert offsets[:, 0].tolist() == [-(6 - 3) - (4 - 2)] * 2 + [0]
    with pytest.raises(
        ValueError, match="sequence 0 of the batch has 10 image tokens for 1 images of 6 tokens"
    ):
        image_forward_inputs(m, rows, mask, [imgs[:1], imgs, []])


# --- the HF engine -------------------------------------------------------------------------------------


def teacher_forced(model, prompt, tokens, images) -> torch.Tensor:
    seq = torch.tensor([prompt + tokens])
    with torch.no_grad():
        kwargs, _ = image_forward_inputs(model, seq, torch.ones_like(seq), [images])
        logp = (
            model(input_ids=seq, attention_mask=torch.ones_like(seq), **kwargs).logits.float().log_softmax(-1)
        )
    return logp[0, len(prompt) - 1 : -1].gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_the_engine_samples_from_text_and_images_with_the_trainers_logprobs(vlm):
    engine = HFEngine.from_model(vlm["model"])
    red, blue = vlm["images"].process(
        [Image.new("RGB", (56, 56), (250, 0, 0)), Image.new("RGB", (56, 84), (0, 0, 250))]
    )
    same_ids = prompt_ids(vlm, [red])
    params = SamplingParams(n=3, max_new_tokens=6, seed=11)
    requests = [
        GenerationRequest(same_ids, params, [red]),
        GenerationRequest(
            prompt_ids(vlm, [blue], "w7"), SamplingParams(n=2, max_new_tokens=6, seed=12), [blue]
        ),
        GenerationRequest([5, 12, 13], SamplingParams(n=2, max_new_tokens=6, seed=13)),  # text only
    ]
    outs = engine.generate(requests)
    for req, samples in zip(requests, outs, strict=True):
        assert len(samples) == req.params.n
        for out in samples:
            gap = (
                (
                    teacher_forced(vlm["model"], req.prompt_ids, out.token_ids, list(req.images))
                    - torch.tensor(out.logprobs)
                )
                .abs()
                .max()
            )
            assert gap < 1e-5, gap  # fp32: KV-cached decode vs one full forward, rounding only
    # equal ids, different image: the two prompts must not share a prefill
    recolored = vlm["images"].process([Image.new("RGB", (56, 56), (0, 250, 0))])[0]
    pair = engine.generate(
        [
            GenerationRequest(same_ids, SamplingParams(max_new_tokens=4, seed=5), [red]),
            GenerationRequest(same_ids, SamplingParams(max_new_tokens=4, seed=5), [recolored]),
        ]
    )
    for (out,), image in zip(pair, [red, recolored], strict=True):
        ref = teacher_forced(vlm["model"], same_ids, out.token_ids, [image])
        assert (ref - torch.tensor(out.logprobs)).abs().max() < 1e-5
    assert pair[0][0].logprobs[0] != pair[1][0].logprobs[0]
    with pytest.raises(ValueError, match="generation request 0: the prompt has 4 image tokens for 0 images"):
        engine.generate([GenerationRequest(same_ids, params)])


def test_the_engine_never_samples_the_image_token_and_reports_the_full_distributions_logprob(vlm):
    """Only images fill image tokens: even a model that puts most of its mass there samples something else,
    and the log-prob it reports is still the trainer's (the image token's mass stays in the softmax)."""
    model = load_model(vlm["path"]).eval()
    pad = model.config.image_token_id
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[pad] = 20.0  # the image token takes nearly all the mass
    model.lm_head = head
    engine = HFEngine.from_model(model)
    ids = prompt_ids(vlm, [])
    for temperature in (0.0, 1.0):
        (outs,) = engine.generate(
            [GenerationRequest(ids, SamplingParams(n=4, max_new_tokens=8, seed=3, temperature=temperature))]
        )
        for out in outs:
            assert pad not in out.token_ids
            ref = teacher_forced(model, ids, out.token_ids, [])
            assert (ref - torch.tensor(out.logprobs)).abs().max() < 1e-5
    seq = torch.tensor([ids])
    with torch.no_grad():
        first = model(input_ids=seq, attention_mask=torch.ones_like(seq)).logits[0, -1].softmax(-1)
    assert first[pad] > 0.5  # the pad really was the most likely token
