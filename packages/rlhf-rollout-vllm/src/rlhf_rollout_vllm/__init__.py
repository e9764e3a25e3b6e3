"""rlhf-rollout-vllm: vLLM behind rlhf's rollout-engine contract (vLLM itself is imported only when used)."""

from rlhf_rollout_vllm.engine import VLLMEngine

__version__ = "0.1.0"
__all__ = ["VLLMEngine"]
