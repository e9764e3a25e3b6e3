"""rlhf-rollout-vllm: vLLM behind rlhf's rollout-engine contract (vLLM itself is imported only when used)."""

import importlib.metadata

from rlhf_rollout_vllm.engine import VLLMEngine

# The version lives in pyproject.toml only; an installed distribution reports it.
__version__ = importlib.metadata.version("rlhf-rollout-vllm")
__all__ = ["VLLMEngine"]
