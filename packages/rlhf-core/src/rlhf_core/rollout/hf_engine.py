"""The built-in rollout engine: batched sampling with a transformers model and a KV cache; it runs in a Ray
actor unchanged (``rlhf_core.handles.ray_actor(HFEngine, path)``). Instead of ``model.generate``: one
prefill of the left-padded prompts, then one forward per token (sampling on the device:
:mod:`rlhf_core.rollout.sampling`).
Which models decode from the weights directly (:func:`~rlhf_core.rollout.decode.decode_token`), and images:
rlhf-core's README. Other architectures (sliding windows, hybrid or linear attention) and vision-language models
take a generic path with transformers' ``DynamicCache``: the same results, slower. The decode loop is
:mod:`rlhf_core.rollout.decode_loop`; on a GPU its steps are a captured CUDA graph over a static cache
(:class:`~rlhf_core.rollout.decode.StaticDecoder`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from rlhf_core.moe import ExpertRecorder
from rlhf_core.rollout.decode import (
    ATTENTION_NAME,
    FAST_PATH_MODEL_TYPES,
    PACK_MIN_HIDDEN,
    StaticDecoder,
    decode_plan,
    decode_weights,
    fuse_projections,
)
from rlhf_core.rollout.decode_loop import decode_rows
from rlhf_core.rollout.engine_weights import EngineWeights
from rlhf_core.rollout.sampling import check_requests, sample_seeds
from rlhf_core.types import GenerationOutput, GenerationRequest, RolloutEngine
from rlhf_core.vision import count_image_tokens, is_vision_language, load_model

logger = logging.getLogger(__name__)


DTYPES = {
    **dict.fromkeys(("float32", "fp32", "float"), torch.float32),
    **dict.fromkeys(("bfloat16", "bf16"), torch.bfloat16),
    **dict.fromkeys(("float16", "fp16", "half"), torch.float16),
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def check_prompts(
    requests: Sequence[GenerationRequest], max_positions: int | None, image_token_id: int | None
):
    """Raise ValueError naming the request whose prompt leaves no room to generate, or whose images do not
    fit the model (none expected, or not as many as its image tokens)."""
    for i, req in enumerate(requests):
        if max_positions is not None and len(req.prompt_ids) >= max_positions:
            raise ValueError(
                f"generation request {i}: the prompt has {len(req.prompt_ids)} tokens, "
                "leaving no room to generate in the model's max_position_embeddings="
                f"{max_positions}"
            )
        if req.images and image_token_id is None:
            raise ValueError(
                f"generation request {i} has images but the model is not a vision-language model"
            )
        if image_token_id is not None and (
            mismatch := count_image_tokens(req.prompt_ids, req.images, image_token_id)
        ):
            raise ValueError(f"generation request {i}: the prompt has {mismatch}")


# Static caches are made for the batch's context rounded up to this many columns, so that batches of
# slightly different prompt lengths replay the same captured graph.
STATIC_COLUMNS = 128
# Static decoders (each with its cache and graph) kept for reuse: a run's full batch and its last one.
STATIC_KEPT = 2


class HFEngine(EngineWeights, RolloutEngine):
    """Generates with a transformers causal LM; see the module docstring.

    Args:
        model_name_or_path: a local model directory (or a hub id where the hub is reachable).
        dtype: ``float32``, ``bfloat16`` or ``float16`` (``fp32``/``bf16``/``fp16`` also accepted).
        device: ``cpu``, ``cuda``, ``cuda:1``...; default CUDA when available, else CPU.
        attn_implementation: what the model is loaded with; used by the generic path.
        max_batch_size: most sequences (prompts x samples) decoded together; larger requests are split.
        eos_token_id: stop id(s); default the model's generation config, else its config.
        num_threads: torch CPU threads for this process (a Ray actor sets it to its CPU share).
        pack_weights: decode from packed copies of the weights (:func:`decode_weights`); default: on CPU
            in float32 for models of hidden size :data:`PACK_MIN_HIDDEN` or more.
        static_cache: decode through a :class:`StaticDecoder` (a fixed-shape cache; no finished row dropped);
            default on CUDA, where its step is captured as a CUDA graph (``cuda_graph``), and not on CPU, where
            attending over the whole fixed cache is slower than the growing one.
        cuda_graph: on CUDA with ``static_cache``, replay the decode step as a captured graph (False: the
            same static step run eagerly, to tell a graph problem from a cache one).
        record_routing: an MoE model records each token's experts into every output (:meth:`record_routing`).
    """

    def __init__(
        self,
        model_name_or_path: str,
        dtype: str = "float32",
        device: str | None = None,
        attn_implementation: str = "sdpa",
        max_batch_size: int = 256,
        eos_token_id: int | Sequence[int] | None = None,
        num_threads: int | None = None,
        pack_weights: bool | None = None,
        static_cache: bool | None = None,
        cuda_graph: bool = True,
        record_routing: bool = False,
    ):
        if num_threads:
            torch.set_num_threads(num_threads)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = load_model(
            model_name_or_path, dtype=parse_dtype(dtype), attn_implementation=attn_implementation
        )
        model.requires_grad_(False)
        self._setup(model.to(device).eval(), eos_token_id, max_batch_size, True, pack_weights)
        self.static_cache = (
            self.static_cache if static_cache is None else static_cache and self.plan is not None
        )
        self.cuda_graph = cuda_graph
        if record_routing:
            self.record_routing()

    @classmethod
    def from_model(
        cls,
        model: torch.nn.Module,
        eos_token_id: int | Sequence[int] | None = None,
        max_batch_size: int = 256,
        own_weights: bool = False,
        pack_weights: bool | None = None,
    ) -> HFEngine:
        """Wrap a model that is already loaded (tests, or a trainer sharing its module); no copy is made.
        ``own_weights``: the module's weights change only through this engine (``update_weights``), never
        behind its back, so the engine may lay them out fused (its parameters become views) and keep
        packed copies (``pack_weights``: None for the size rule of an engine loaded from a path)."""
        engine = cls.__new__(cls)
        engine._setup(model.eval(), eos_token_id, max_batch_size, own_weights, pack_weights)
        return engine

    def _setup(
        self, model, eos_token_id, max_batch_size: int, own_weights: bool, pack_weights: bool | None
    ) -> None:
        self.model = model
        self.max_batch_size = max_batch_size
        self.image_token_id = model.config.image_token_id if is_vision_language(model.config) else None
        config = model.config.get_text_config()
        self.device = next(model.parameters()).device
        if eos_token_id is None:
            eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
            eos_token_id = config.eos_token_id if eos_token_id is None else eos_token_id
        self.eos_token_ids = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.fast_path = config.model_type in FAST_PATH_MODEL_TYPES and all(
            t == "full_attention" for t in get_layer_types_and_kwargs(config)[0]
        )
        self.plan = decode_plan(model) if self.fast_path else None
        pack_weights = config.hidden_size >= PACK_MIN_HIDDEN if pack_weights is None else pack_weights
        self.own_weights = own_weights and self.plan is not None
        self._fused = fuse_projections(self.plan) if self.own_weights else None
        self.pack_weights = (
            pack_weights
            and self.own_weights
            and self.device.type == "cpu"
            and model.lm_head.weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available()
        )
        self._track_weights(model)
        self.static_cache = self.device.type == "cuda" and self.plan is not None
        self.cuda_graph = True
        self.experts: ExpertRecorder | None = None
        """Set by :meth:`record_routing`: an MoE model's routing, recorded into every output."""

    def record_routing(self) -> None:
        """Router replay: record the experts each token is routed to (``GenerationOutput.routed_experts``), for
        the trainer to use instead of its own top-k (:mod:`rlhf_core.moe`)."""
        self.experts = self.experts or ExpertRecorder.attach(self.model)
        if self.experts is None:
            raise ValueError(
                f"router replay: {self.model.config.model_type} is not a mixture-of-experts model"
            )

    # --- generation -----------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[GenerationOutput]]:
        requests = list(requests)
        if self._asleep:
            raise RuntimeError(
                f"HFEngine.generate: the engine is asleep (level {self._asleep}); call wake_up()"
            )
        if self._missing:
            raise RuntimeError(
                f"HFEngine.generate: {len(self._missing)} weights (e.g. {min(self._missing)})"
                " were discarded by sleep(level=2) and not sent again; call update_weights"
                " first"
            )
        check_requests(requests, self.vocab_size)
        check_prompts(requests, self.max_positions, self.image_token_id)
        # one row per sample: (request index, sample index, prompt ids, params, seed, images)
        rows = [
            (i, j, req.prompt_ids, req.params, seed, tuple(req.images))
            for i, req in enumerate(requests)
            for j, seed in enumerate(sample_seeds(req.params))
        ]
        # Similar prompt lengths decode together (less padding); sampling is per row, so order is free.
        rows.sort(key=lambda row: -len(row[2]))
        results: list[list[Any]] = [[None] * req.params.n for req in requests]
        weights = self._weights
        if rows and self.plan is not None and weights is None:
            pack_rows = min(len(rows), self.max_batch_size) if self.pack_weights else 0
            # borrowed weights: the fused groups (and packed copies) of this call only, freed when it returns;
            # the same values and layout as an owned engine's, so the same numbers
            weights = decode_weights(
                self.plan,
                fuse_projections(self.plan, in_place=False) if self.borrowed else self._fused,
                pack_rows,
            )
            if self.own_weights:  # else rebuilt per call: a module we do not own may change between calls
                self._weights = weights
            elif self.borrowed:  # static decoders made over earlier calls' copies can never serve again
                self._decoders.clear()
        saved_attention = self.model.config._attn_implementation
        if self.fast_path:
            self.model.config._attn_implementation = ATTENTION_NAME
        try:
            n_chunks = math.ceil(len(rows) / self.max_batch_size)
            for k, start in enumerate(range(0, len(rows), self.max_batch_size)):
                chunk = rows[start : start + self.max_batch_size]
                began = time.perf_counter()
                outs = decode_rows(
                    self.model,
                    [row[2:] for row in chunk],
                    forward=self._forward,
                    fast_path=self.fast_path,
                    plan=self.plan,
                    weights=weights,
                    eos_token_ids=self.eos_token_ids,
                    max_positions=self.max_positions,
                    image_token_id=self.image_token_id,
                    static=(lambda r, c, w=weights: self._static_decoder(w, r, c))
                    if self.static_cache
                    else None,
                    experts=self.experts,
                )
                for (i, j, *_), out in zip(chunk, outs, strict=True):
                    results[i][j] = out
                if n_chunks > 1:
                    logger.info(
                        "HFEngine: batch %d/%d, %d samples, %d tokens in %.1fs",
                        k + 1,
                        n_chunks,
                        len(chunk),
                        sum(len(o.token_ids) for o in outs),
                        time.perf_counter() - began,
                    )
        finally:
            self.model.config._attn_implementation = saved_attention
        return results

    def _static_decoder(self, weights: dict, rows: int, columns: int) -> StaticDecoder:
        """The :class:`StaticDecoder` for ``rows`` x ``columns`` (rounded up to :data:`STATIC_COLUMNS`) over
        ``weights``: the one made before while the weights are the same tensors at the same addresses (a
        captured graph reads them there), else a new one that replaces the oldest kept."""
        columns = math.ceil(columns / STATIC_COLUMNS) * STATIC_COLUMNS
        # the parameters by address (sleep and share_weights move them), the tensors decode multiplies by by
        # identity (packed copies have no address; the decoder holds them, so no other tensor takes their id)
        groups = [t for layer in weights["layers"] for group in layer for pair in group for t in pair]
        key = (
            rows,
            columns,
            *(p.data_ptr() for p in self._params.values()),
            *map(id, groups + [weights["lm_head"][0][0]]),
        )
        if key not in self._decoders:
            if len(self._decoders) >= STATIC_KEPT:
                self._decoders.pop(next(iter(self._decoders)))
            graph = self.cuda_graph and self.device.type == "cuda"
            self._decoders[key] = StaticDecoder(self.plan, weights, rows, columns, graph)
        return self._decoders[key]

    def _forward(self, input_ids, position_ids, attention_mask, cache, **images) -> torch.Tensor:
        """Logits ``[R, V]`` (float32) of the last position; ``images``: :func:`image_forward_inputs` of a VLM
        prefill, without its positions (which come as ``position_ids``)."""
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **images,
        )
        return out.logits[:, -1].float()

    def reset_prefix_cache(self) -> None:
        """Nothing to do: this engine keeps no KV cache between ``generate`` calls."""
