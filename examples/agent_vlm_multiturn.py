"""A multi-turn agent for a vision-language model: the environment answers with new images.

The task: the prompt shows a picture; after each reply the environment either shows a *new* picture (a
"screenshot" of a changed scene) with a question about it, or asks again in words; the last reply is
scored against the label. Images come back from ``step`` as ``environment_images`` (PIL images), and the
feedback text holds one image placeholder per image, written the way the model's chat template writes
one (Qwen-VL: ``<|vision_start|><|image_pad|><|vision_end|>``); rlhf repeats it once per image token.

    rlhf train ppo --train.agent_func_path examples/agent_vlm_multiturn.py \\
        --actor.model_name_or_path Qwen/Qwen2.5-VL-3B-Instruct --data.image_key images \\
        --data.max_images_per_prompt 4 --actor.freeze_visual_encoder --data.apply_chat_template ...

This is the API of OpenRLHF's ``vlm_multiturn_agent.py``: an agent written for it runs as it is (its
``from openrlhf.utils.agent import ...`` is served by rlhf); new files import from ``rlhf_agents`` as below.
"""

import random

import numpy as np
import torch
from PIL import Image

from rlhf_agents import AgentInstanceBase, MultiTurnAgentExecutor

# Qwen-VL chat markup; adjust to the model's chat template
TURN_END = "<|im_end|>\n"
USER_TURN = "<|im_start|>user\n"
ASSISTANT_TURN = "<|im_start|>assistant\n"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def render_scene(rng: random.Random) -> Image.Image:
    """A stand-in for a real observation (a browser screenshot, a rendered game frame): random blocks."""
    pixels = np.zeros((56, 56, 3), dtype=np.uint8)
    for _ in range(3):
        x, y = rng.randrange(0, 40), rng.randrange(0, 40)
        pixels[y : y + 16, x : x + 16] = [rng.randrange(256) for _ in range(3)]
    return Image.fromarray(pixels)


class AgentInstance(AgentInstanceBase):
    """One episode of 2 to 3 turns; odd turns get a new picture, even ones a text nudge."""

    def __init__(self, *args, **kwargs):
        self.turn = 0
        self.turns = 2
        self.rng = random.Random()

    async def reset(self, states: dict, **kwargs):
        self.turn = 0
        self.turns = self.rng.choice([2, 3])
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        self.turn += 1
        if self.turn >= self.turns:
            correct = float(str(states["label"]).lower() in states["action_text"].lower())
            return {
                "rewards": torch.tensor(correct),
                "scores": torch.tensor(correct),
                "environment_feedback": TURN_END,
                "done": True,
                "extra_logs": {"turns": self.turn},
            }
        if self.turn % 2 == 1:
            return {
                "rewards": torch.tensor(0.0),
                "environment_feedback": f"{TURN_END}{USER_TURN}{IMAGE}\nThe scene changed. What now?{TURN_END}"
                f"{ASSISTANT_TURN}",
                "environment_images": [render_scene(self.rng)],
                "done": False,
            }
        return {
            "rewards": torch.tensor(0.0),
            "environment_feedback": f"{TURN_END}{USER_TURN}Look again.{TURN_END}{ASSISTANT_TURN}",
            "done": False,
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
