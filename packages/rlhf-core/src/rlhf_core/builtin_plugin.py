"""rlhf-core's own registrations, loaded through its ``rlhf`` entry point like any third-party plugin."""

from __future__ import annotations

from typing import Any

from rlhf_core import hookimpl


class HFEngineFactory:
    """The ``hf`` rollout engine (:class:`rlhf_core.rollout.hf_engine.HFEngine`); a caller that wants it in a
    Ray actor does ``rlhf_core.handles.ray_actor(factory.engine_class(), **factory.engine_kwargs(cfg))``."""

    def available(self) -> str | None:
        return None  # transformers and torch are rlhf-core dependencies

    def engine_class(self) -> type:
        from rlhf_core.rollout.hf_engine import HFEngine

        return HFEngine

    def engine_kwargs(self, cfg: Any) -> dict[str, Any]:
        """Constructor arguments from an :class:`rlhf_core.config.RLConfig`."""
        if not cfg.actor.model_name_or_path:
            raise ValueError("the hf rollout engine needs --actor.model_name_or_path")
        from rlhf_core.config import resolve_param_dtype

        return {
            "model_name_or_path": cfg.actor.model_name_or_path,
            "dtype": resolve_param_dtype(cfg.ds.param_dtype),
            "attn_implementation": cfg.ds.attn_implementation,
            "record_routing": cfg.actor.router_replay,
        }

    def create(self, cfg: Any, index: int = 0, **overrides: Any) -> Any:
        """``index`` numbers the engines of a run; the HF engine needs no per-engine setting."""
        return self.engine_class()(**{**self.engine_kwargs(cfg), **overrides})


@hookimpl
def rlhf_register_rollout_engines(register):
    register("hf", HFEngineFactory())


@hookimpl
def rlhf_register_post_processors(register):
    from rlhf_core.postprocess import BUILTIN

    for name, processor in BUILTIN.items():
        register(name, processor)
