"""Executors with a vision-language model: prompt images shared by a group's samples, environment images in
multi-turn feedback, and an agent written against OpenRLHF's VLM agent API (a tiny Qwen2-VL built here)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from rlhf_agents import RolloutWorker
from rlhf_agents.executors import fit_feedback
from rlhf_core.rollout.async_engine import AsyncEngine
from rlhf_core.rollout.hf_engine import HFEngine
from rlhf_core.testing.tiny import make_tiny_vlm
from rlhf_core.types import ImageInput, SamplingParams
from rlhf_core.vision import ImageProcessing, image_forward_inputs


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from transformers import AutoTokenizer

    path = make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model")
    engine = HFEngine(path)
    return {
        "path": path,
        "tok": AutoTokenizer.from_pretrained(path),
        "images": ImageProcessing.from_pretrained(path),
        "engine": engine,
        "model": engine.model,
    }


def prompt_row(vlm, uid: int, color=(200, 0, 0), label="w1") -> dict:
    images = vlm["images"].process([Image.new("RGB", (56, 56), color)])
    text = vlm["tok"].apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w5 w6"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = vlm["images"].expand(vlm["tok"](text, add_special_tokens=False)["input_ids"], images)
    return {"prompt_text": text, "prompt_ids": ids, "label": label, "prompt_uid": uid, "images": images}


def worker_for(vlm, cfg) -> RolloutWorker:
    return RolloutWorker.from_config(
        cfg, AsyncEngine(vlm["engine"]), vlm["tok"], image_processing=vlm["images"]
    )


def check_tokens(vlm, traj) -> None:
    """Image tokens are the trajectory's images'; action log-probs equal a teacher-forced forward with the
    images; feedback tokens have log-prob 0."""
    full = traj.prompt_ids + traj.response_ids
    pad = vlm["images"].image_token_id
    assert full.count(pad) == sum(im.num_tokens for im in traj.images)
    seq = torch.tensor([full])
    with torch.no_grad():
        kwargs, _ = image_forward_inputs(vlm["model"], seq, torch.ones_like(seq), [traj.images])
        logp = (
            vlm["model"](input_ids=seq, attention_mask=torch.ones_like(seq), **kwargs)
            .logits[0]
            .log_softmax(-1)
        )
    ref = logp[:-1].gather(1, seq[0, 1:, None])[:, 0][len(traj.prompt_ids) - 1 :]
    for mask, got, want in zip(traj.action_mask, traj.rollout_logprobs, ref.tolist(), strict=True):
        assert abs(got - want) < 1e-5 if mask else got == 0.0


def test_single_turn_samples_share_their_prompts_images(vlm, cfg_factory, tmp_path):
    # a reward file sees a query's images as the prompt text has them: one placeholder each
    (tmp_path / "reward.py").write_text(
        "def reward_func(queries, prompts, labels, **kw):\n"
        "    return [float(q.count('<|image_pad|>') == p.count('<|image_pad|>') == 1)\n"
        "            for q, p in zip(queries, prompts)]\n"
    )
    worker = worker_for(
        vlm, cfg_factory(reward={"remote_url": str(tmp_path / "reward.py")}, data={"max_len": 32})
    )
    rows = [prompt_row(vlm, 0), prompt_row(vlm, 1, (0, 0, 200))]
    trajs = worker.rollout(rows, SamplingParams(n=3, max_new_tokens=4), step=0)
    worker.close()
    assert len(trajs) == 6 and [t.reward for t in trajs] == [1.0] * 6
    for k, t in enumerate(trajs):
        assert (
            t.images == rows[k // 3]["images"] and t.images[0] is rows[k // 3]["images"][0]
        )  # the same object
        check_tokens(vlm, t)


# The shape of OpenRLHF's VLM multi-turn agent (examples/python/vlm_multiturn_agent.py): torch rewards,
# Qwen chat markup in the feedback, numpy "screenshots" of 28 x 28, 3 or 4 turns, an image every 2nd turn.
OPENRLHF_VLM_AGENT = """
import random
from typing import Any, Dict

import numpy as np
import torch
from PIL import Image

from rlhf_agents import AgentInstanceBase, MultiTurnAgentExecutor  # was: from openrlhf.utils.agent import ...

OPEN_USER = "\\n<|im_start|>user\\n"
CLOSE_USER = "<|im_end|>\\n<|im_start|>assistant\\n"
PICTURE = "<|vision_start|><|image_pad|><|vision_end|>"


def screenshot():
    rng = np.random.RandomState(random.randint(0, 10000))
    return Image.fromarray(rng.randint(0, 256, (28, 28, 3), dtype=np.uint8))


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.step_idx = 0
        self.max_steps = random.choice([3, 4])

    async def reset(self, states: dict, **kwargs):
        self.step_idx = 0
        self.max_steps = random.choice([3, 4])
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> Dict[str, Any]:
        self.step_idx += 1
        if self.step_idx >= self.max_steps:
            value = 1.0 if states["label"].lower() in states["action_text"].lower() else 0.0
            return {"rewards": torch.tensor(value), "scores": torch.tensor(value),
                    "environment_feedback": "\\n<|im_end|>\\n", "done": True,
                    "extra_logs": {"step_count": self.step_idx, "max_steps": self.max_steps}}
        if self.step_idx % 2 == 0:
            return {"rewards": torch.tensor(0.0),
                    "environment_feedback": f"{OPEN_USER}{PICTURE}\\nw3 w4?\\n{CLOSE_USER}",
                    "environment_images": [screenshot()], "done": False}
        return {"rewards": torch.tensor(0.0), "environment_feedback": f"{OPEN_USER}w7 w8\\n{CLOSE_USER}",
                "done": False}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


@pytest.mark.parametrize("source", ["openrlhf_shape", "example"])
def test_a_vlm_agent_gets_environment_images_into_its_episode(
    vlm, cfg_factory, tmp_path, examples_dir, source
):
    if source == "example":
        path = examples_dir / "agent_vlm_multiturn.py"
    else:
        path = tmp_path / "vlm_agent.py"
        path.write_text(OPENRLHF_VLM_AGENT)
    worker = worker_for(vlm, cfg_factory(train={"agent_func_path": str(path)}, data={"max_len": 160}))
    rows = [prompt_row(vlm, 0), prompt_row(vlm, 1, (0, 0, 200), label="w2")]
    trajs = worker.rollout(rows, SamplingParams(n=3, max_new_tokens=3), step=0)
    worker.close()
    pad = vlm["images"].image_token_id
    screens = 0
    for k, t in enumerate(trajs):
        assert t.error is None and t.reward in (0.0, 1.0)
        assert t.images[0] is rows[k // 3]["images"][0]  # the prompt's image, shared
        turns = int(t.extra_logs["num_turns"])
        # an image on every 2nd turn before the last (OpenRLHF's shape), on every odd one (the example)
        expected = (turns - 1) // 2 if source == "openrlhf_shape" else turns // 2
        assert len(t.images) == 1 + expected and turns in ((3, 4) if source == "openrlhf_shape" else (2, 3))
        screens += len(t.images) - 1
        env_tokens = [tok for tok, m in zip(t.response_ids, t.action_mask, strict=True) if tok == pad]
        assert len(env_tokens) == sum(im.num_tokens for im in t.images[1:])  # feedback (mask 0) holds them
        assert all(m == 0 for tok, m in zip(t.response_ids, t.action_mask, strict=True) if tok == pad)
        check_tokens(vlm, t)
    assert screens > 0


MISMATCHED = """
from PIL import Image
from rlhf_agents import AgentInstanceBase, MultiTurnAgentExecutor

class AgentInstance(AgentInstanceBase):
    async def step(self, states, **kwargs):
        return {"rewards": 0.0, "environment_feedback": "w1 w2", "environment_images": [Image.new("RGB", (56, 56))],
                "done": False}

class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


def test_environment_images_without_placeholders_end_the_episode_with_the_reason(vlm, cfg_factory, tmp_path):
    path = tmp_path / "agent.py"
    path.write_text(MISMATCHED)
    cfg = cfg_factory(
        train={"agent_func_path": str(path)}, data={"max_len": 64}, reward={"max_failure_fraction": 1.0}
    )
    worker = worker_for(vlm, cfg)
    (t,) = worker.rollout([prompt_row(vlm, 0)], SamplingParams(max_new_tokens=2), step=0)
    worker.close()
    assert t.reward is None and t.extra_logs["error/env_invalid"] == 1.0
    assert "returned 1 environment_images but its environment_feedback has 0 image placeholders" in t.error


def test_images_past_the_limit_or_the_room_are_dropped_with_their_tokens(vlm, cfg_factory, tmp_path):
    def img(n):
        return ImageInput(torch.zeros(4 * n, 1), torch.tensor([1, 2, 2 * n]), n)

    pad = vlm["images"].image_token_id
    a, b = img(3), img(2)
    ids = [1, pad, pad, pad, 7, pad, pad, 8]
    assert fit_feedback(ids, [a, b], 8, pad) == (ids, [a, b])
    assert fit_feedback(ids, [a, b], 6, pad) == (
        [1, pad, pad, pad, 7],
        [a],
    )  # b would be cut: the prefix ends before it
    assert fit_feedback(ids, [a, b], 3, pad) == ([1], [])
    assert fit_feedback([1, 2, 3], [], 2, None) == ([1, 2], [])

    agent = OPENRLHF_VLM_AGENT.replace("random.choice([3, 4])", "5").replace("self.step_idx % 2 == 0", "True")
    path = tmp_path / "agent.py"
    path.write_text(agent)
    cfg = cfg_factory(train={"agent_func_path": str(path)}, data={"max_len": 200, "max_images_per_prompt": 3})
    worker = worker_for(vlm, cfg)
    (t,) = worker.rollout([prompt_row(vlm, 0)], SamplingParams(max_new_tokens=2), step=0)
    worker.close()
    assert t.error is None and t.extra_logs["num_turns"] == 5.0
    # 4 screenshots offered, room for 2 next to the prompt's: the other 2 and their placeholders are gone
    assert len(t.images) == 3 and t.extra_logs["images_dropped"] == 2.0
    check_tokens(vlm, t)


RESETTING = """
from rlhf_agents import AgentInstanceBase, MultiTurnAgentExecutor

class AgentInstance(AgentInstanceBase):
    async def reset(self, states, **kwargs):
        text = states["observation"]
        return {"observation": text.replace("<|image_pad|>", "") if "w1" == states["label"] else text + "w9 "}

    async def step(self, states, **kwargs):
        return {"rewards": 1.0, "environment_feedback": "", "done": True}

class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


def test_a_reset_observation_keeps_the_prompts_images_or_ends_the_episode(vlm, cfg_factory, tmp_path):
    path = tmp_path / "agent.py"
    path.write_text(RESETTING)
    cfg = cfg_factory(
        train={"agent_func_path": str(path)}, data={"max_len": 64}, reward={"max_failure_fraction": 1.0}
    )
    worker = worker_for(vlm, cfg)
    kept, dropped = worker.rollout(
        [prompt_row(vlm, 0, label="w2"), prompt_row(vlm, 1, label="w1")],
        SamplingParams(max_new_tokens=2),
        step=0,
    )
    worker.close()
    assert kept.error is None and kept.reward == 1.0
    assert kept.prompt_ids[-1] == vlm["tok"].convert_tokens_to_ids(
        "w9"
    )  # the new observation, images expanded
    check_tokens(vlm, kept)
    assert (
        dropped.reward is None
        and "returned an observation that does not fit the prompt's images: the text has "
        "0 image placeholders for 1 images"
        in dropped.error
    )
