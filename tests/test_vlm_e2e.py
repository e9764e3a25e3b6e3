"""`rlhf train ppo` with a vision-language model, end to end on CPU: a tiny Qwen2-VL built here (random
weights, a 1-block vision tower), 2 DeepSpeed ZeRO-3 policy ranks with the vision encoder frozen, a
reference rank, the HF engine generating from text + images, GRPO on a visual task the test draws.

The task: an image holds a red and a blue square of different sizes; the prompt (the same words for every
image) asks which is larger; the answer is ``w0`` for red, ``w1`` for blue. Only the image tells them apart.
"""

import json
import os
import random
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vlm_e2e")]

REWARD = '''
def reward_func(queries, prompts, labels, responses, **kwargs):
    """1 when the response is the answer (w0: red is larger, w1: blue is), else 0."""
    return [float(r.split() == [label]) for r, label in zip(responses, labels)]
'''


def draw(rng: random.Random, red_larger: bool) -> Image.Image:
    """56 x 56 on black: a large and a small square, one red and one blue, in random places."""
    img = Image.new("RGB", (56, 56), (0, 0, 0))
    pen = ImageDraw.Draw(img)
    big, small = rng.randint(30, 38), rng.randint(8, 12)
    for color, size in (
        ((220, 20, 20), big if red_larger else small),
        ((20, 20, 220), small if red_larger else big),
    ):
        x, y = rng.randint(0, 56 - size), rng.randint(0, 56 - size)
        pen.rectangle([x, y, x + size, y + size], fill=color)
    return img


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from rlhf_core.testing.tiny import make_tiny_vlm

    root = tmp_path_factory.mktemp("vlm")
    # 4 words: a random model says the answer word about 1 time in 16 (the vocabulary less the image token)
    model = make_tiny_vlm(root / "model", num_words=4)
    rng = random.Random(0)
    (root / "images").mkdir()
    with (root / "prompts.jsonl").open("w") as f:
        for i in range(128):
            red = i % 2 == 0
            draw(rng, red).save(root / "images" / f"{i}.png")
            msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w2 w3"}]}]
            f.write(
                json.dumps({"prompt": msgs, "images": [f"images/{i}.png"], "label": "w0" if red else "w1"})
                + "\n"
            )
    (root / "reward.py").write_text(REWARD)
    return {
        "model": model,
        "prompts": str(root / "prompts.jsonl"),
        "reward": str(root / "reward.py"),
        "root": root,
    }


@pytest.fixture(scope="module")
def ray_session():
    import ray

    from rlhf_cli.ray_launch import init_ray
    from rlhf_core.config import RLConfig

    if ray.is_initialized():
        ray.shutdown()
    init_ray(RLConfig(), min_cpus=8)
    yield
    ray.shutdown()


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_grpo_learns_a_visual_task_with_the_vision_encoder_frozen(assets, ray_session, tmp_path):
    from rlhf_cli.main import main

    os.environ["RLHF_NO_PROGRESS"] = "1"
    out = tmp_path / "run"
    args = [
        "--actor.model_name_or_path",
        assets["model"],
        "--reward.remote_url",
        assets["reward"],
        "--data.prompt_dataset",
        assets["prompts"],
        "--data.input_key",
        "prompt",
        "--data.label_key",
        "label",
        "--data.image_key",
        "images",
        "--data.max_images_per_prompt",
        "1",
        "--data.apply_chat_template",
        "--actor.freeze_visual_encoder",
        "--algo.advantage.estimator",
        "group_norm",
        "--rollout.n_samples_per_prompt",
        "8",
        "--rollout.batch_size",
        "16",
        "--rollout.max_new_tokens",
        "1",
        "--rollout.micro_batch_size",
        "32",
        "--data.max_len",
        "24",
        "--train.batch_size",
        "128",
        "--train.micro_batch_size",
        "16",
        "--actor.num_gpus_per_node",
        "2",
        "--ds.zero_stage",
        "3",
        "--ds.param_dtype",
        "fp32",
        "--algo.kl.init_coef",
        "1e-3",
        "--algo.kl.use_loss",
        "--actor.adam.lr",
        "1e-2",
        "--actor.lr_scheduler",
        "constant",
        "--train.num_episodes",
        "3",
        "--train.max_steps",
        "20",
        "--ckpt.output_dir",
        str(out),
    ]
    assert main(["train", "ppo", *args]) == 0
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 21))
    rewards = [r["reward/mean"] for r in rows]
    print("reward per step:", [round(x, 3) for x in rewards])
    for r in rows:
        # fp32: after every weight sync the engine's log-probs of its samples are the trainer's
        assert r["policy/rollout_train_logprob_gap"] < 1e-4, r["policy/rollout_train_logprob_gap"]
        assert r["policy/skipped"] == 0 and "policy/kl_loss" in r
    # the vision encoder was frozen: bit-identical, while the language model moved
    before, after = (
        load_file(Path(assets["model"]) / "model.safetensors"),
        load_file(out / "model" / "model.safetensors"),
    )
    assert before.keys() == after.keys()
    visual = [k for k in before if k.startswith("visual.")]  # Qwen2-VL's checkpoint names
    assert len(visual) > 10 and all(torch.equal(before[k], after[k]) for k in visual)
    assert not torch.equal(before["lm_head.weight"], after["lm_head.weight"])
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    # saying w0 or w1 at random earns 0.5 at best: above it, the model reads the image
    assert first < 0.25 and last > 0.6, (
        f"the reward did not rise past what ignoring the image gives: {rewards}"
    )


def test_ray_sends_the_image_of_a_groups_samples_once(ray_session):
    """The samples of a prompt reference one ImageInput; a Ray round trip (what rollout results and
    micro-batches take) keeps one object, so the pixels travel and live once per prompt, not per sample."""
    import ray

    from rlhf_core.types import ImageInput, Trajectory

    image = ImageInput(torch.rand(64, 1176), torch.tensor([1, 8, 8]), 16, Image.new("RGB", (112, 112)))
    group = [Trajectory([1], [2], [1], [0.0], images=[image]) for _ in range(8)]
    echo = ray.remote(lambda x: x)
    back = ray.get(echo.remote(group))
    assert all(t.images[0] is back[0].images[0] for t in back)
    assert torch.equal(back[0].images[0].pixel_values, image.pixel_values)
    size = len(ray.cloudpickle.dumps(group))
    assert size < 1.2 * image.pixel_values.nbytes  # 301,056 bytes of pixels: once, not 8 times
