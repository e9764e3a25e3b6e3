"""Rollout engines built into rlhf-core, and what every engine shares.

- :mod:`rlhf_core.rollout.hf_engine`: ``HFEngine``, the transformers engine (imports transformers).
- :mod:`rlhf_core.rollout.async_engine`: ``AsyncEngine``, batching concurrent asyncio requests.
- :mod:`rlhf_core.rollout.sampling`: counter-based sampling math and request checks.
"""

from __future__ import annotations

from typing import Any

from rlhf_core.types import SamplingParams


def sampling_params_from_config(cfg: Any, seed: int | None = None, **overrides: Any) -> SamplingParams:
    """The sampling parameters of an RL run (``cfg.rollout``: n, temperature, top_p, top_k,
    max_new_tokens); ``seed`` is usually ``derive_seed(cfg.train.seed, step, prompt_uid)``."""
    r = cfg.rollout
    fields = dict(
        n=r.n_samples_per_prompt,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        seed=seed,
    )
    return SamplingParams(**{**fields, **overrides})
