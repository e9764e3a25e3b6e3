"""Shared fixtures: a tiny Llama saved locally, its tokenizer, and the HF rollout engine over it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rlhf_core.config import RLConfig
from rlhf_core.rollout.async_engine import AsyncEngine
from rlhf_core.rollout.hf_engine import HFEngine
from rlhf_core.testing.tiny import make_tiny_llama

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return Path(make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), seed=0))


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir))


@pytest.fixture(scope="session")
def hf_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def engine(tiny_dir):
    """The HF rollout engine (KV cache, batched): its log-probs are checked against a plain forward."""
    return HFEngine(str(tiny_dir), dtype="float32")


@pytest.fixture
def async_engine(engine):
    return AsyncEngine(engine)


def make_cfg(**sections) -> RLConfig:
    """An RLConfig with small budgets; ``sections`` map a section name to field overrides."""
    cfg = RLConfig()
    cfg.data.max_len = 48
    cfg.rollout.max_new_tokens = 8
    for name, fields in sections.items():
        setattr(cfg, name, dataclasses.replace(getattr(cfg, name), **fields))
    return cfg


@torch.no_grad()
def teacher_forced_logprobs(model, ids: list[int], temperature: float = 1.0) -> list[float]:
    """``log p(ids[t] | ids[:t])`` for t >= 1 from one forward pass over the whole sequence."""
    logits = model(torch.tensor([ids])).logits[0].float()  # [L, V]
    logp = torch.log_softmax(logits[:-1] / temperature, -1)
    return logp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()


def check_trajectory_tokens(traj, model, temperature: float = 1.0, atol: float = 1e-4) -> None:
    """The rollout's log-probs equal a teacher-forced forward at action positions; feedback has 0.0."""
    assert len(traj.response_ids) == len(traj.action_mask) == len(traj.rollout_logprobs)
    full = traj.prompt_ids + traj.response_ids
    ref = teacher_forced_logprobs(model, full, temperature)[len(traj.prompt_ids) - 1 :]
    for k, (mask, got, want) in enumerate(zip(traj.action_mask, traj.rollout_logprobs, ref)):
        if mask:
            assert abs(got - want) < atol, (
                f"response token {k}: rollout log-prob {got} vs teacher-forced {want}"
            )
        else:
            assert got == 0.0


@pytest.fixture
def cfg_factory():
    return make_cfg


@pytest.fixture
def check_tokens(hf_model):
    """Checks a trajectory's log-probs against ``model`` (default: the tiny Llama of the engine fixtures)."""
    return lambda traj, model=None, **kw: check_trajectory_tokens(traj, model or hf_model, **kw)


@pytest.fixture
def examples_dir() -> Path:
    return EXAMPLES
