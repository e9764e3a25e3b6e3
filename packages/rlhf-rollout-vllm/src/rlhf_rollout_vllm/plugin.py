"""rlhf-rollout-vllm registrations, loaded through its ``rlhf`` entry point like any third-party plugin."""

from __future__ import annotations

import importlib.util
from typing import Any

from rlhf_core import hookimpl
from rlhf_rollout_vllm.engine import INSTALL_HINT


def vllm_installed() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None
    except ValueError:  # a module in sys.modules without a spec (tests insert one)
        return True


class VLLMEngineFactory:
    """The ``vllm`` rollout engine (:class:`rlhf_rollout_vllm.engine.VLLMEngine`).

    ``create(cfg, index=0, **overrides)`` builds one in this process; a caller that wants a Ray actor does
    ``ray.remote(num_gpus=tp)(factory.engine_class()).remote(**factory.engine_kwargs(cfg, index))``.
    """

    def available(self) -> str | None:
        if not vllm_installed():
            return f"vllm is not installed ({INSTALL_HINT})"
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device: the vllm engine needs a GPU (--rollout.engine hf runs anywhere)"
        return None

    def engine_class(self) -> type:
        from rlhf_rollout_vllm.engine import VLLMEngine

        return VLLMEngine

    def engine_kwargs(self, cfg: Any, index: int = 0) -> dict[str, Any]:
        """Constructor arguments from an :class:`rlhf_core.config.RLConfig`; engine ``index`` offsets the seed."""
        if not cfg.actor.model_name_or_path:
            raise ValueError("the vllm rollout engine needs --actor.model_name_or_path")
        v = cfg.vllm
        kwargs = {
            "model_name_or_path": cfg.actor.model_name_or_path,
            "dtype": cfg.ds.param_dtype,
            "tensor_parallel_size": v.tensor_parallel_size,
            "gpu_memory_utilization": v.gpu_memory_utilization,
            "enable_prefix_caching": v.enable_prefix_caching,
            "enforce_eager": v.enforce_eager,
            "enable_sleep": v.enable_sleep,
            "seed": cfg.train.seed + index,
        }
        if cfg.data.max_images_per_prompt:  # vLLM sizes its multimodal budget by it
            kwargs["limit_mm_per_prompt"] = {"image": cfg.data.max_images_per_prompt}
        return kwargs

    def create(self, cfg: Any, index: int = 0, **overrides: Any) -> Any:
        reason = self.available()
        if reason is not None:
            raise RuntimeError(f"cannot start the vllm rollout engine: {reason}")
        return self.engine_class()(**{**self.engine_kwargs(cfg, index), **overrides})


@hookimpl
def rlhf_register_rollout_engines(register):
    register("vllm", VLLMEngineFactory())
