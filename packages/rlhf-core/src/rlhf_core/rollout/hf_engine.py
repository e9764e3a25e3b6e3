"""The built-in rollout engine: batched sampling with a transformers model and a KV cache; it runs in a Ray
actor unchanged (``rlhf_core.handles.ray_actor(HFEngine, path)``). Instead of ``model.generate``: one
prefill of the left-padded prompts, then one forward per token (sampling on the device:
:mod:`rlhf_core.rollout.sampling`).
Which models decode from the weights directly (:func:`decode_token`), and images: rlhf-core's README.
Other architectures (sliding windows, hybrid or linear attention) and vision-language models take a generic
path with transformers' ``DynamicCache``: the same results, slower.
"""

from __future__ import annotations

import gc
import itertools
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import Cache, DynamicLayer, get_layer_types_and_kwargs
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rlhf_core.rollout.sampling import check_requests, row_keys, sample_next, sample_seeds
from rlhf_core.types import GenerationOutput, GenerationRequest, RolloutEngine
from rlhf_core.vision import count_image_tokens, image_forward_inputs, is_vision_language, load_model
from rlhf_core.weight_sync import SyncGroup, init_sync_group, is_adapter, lora_pairs, merge_lora_pair

logger = logging.getLogger(__name__)

ATTENTION_NAME = "rlhf_rollout"
# Model types whose attention modules only project, rotate and call the attention function: our own
# masks and attention are exact for them. Anything else takes the generic path.
FAST_PATH_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}

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


def rollout_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention as the HF engine runs it; registered with transformers as ``rlhf_rollout``.

    query ``[B, H, q, d]``; key/value ``[B, Hkv, L, d]`` (views of the KV cache); attention_mask
    ``[B, 1, q, L]``, additive or bool (True = attend), or None for plain causal attention. Returns
    ``([B, q, H, d], None)`` like every HF attention function. One query token: ``softmax(q k^T * scale +
    mask) v`` as two batched matmuls over the query heads that share a KV head, so K/V are never copied.
    Longer queries (prefill) use torch SDPA.
    """
    b, h, q, d = query.shape
    kv_heads = key.shape[1]
    scaling = scaling if scaling is not None else 1.0 / math.sqrt(d)
    if q == 1:
        scores = torch.matmul(query.reshape(b, kv_heads, h // kv_heads, d), key.transpose(-1, -2)) * scaling
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, -math.inf)
        elif attention_mask is not None:
            scores = scores + attention_mask  # [B, 1, 1, L] broadcasts over heads
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
        return torch.matmul(probs, value).reshape(b, 1, h, value.shape[-1]), None
    if kv_heads != h:
        key = key.repeat_interleave(h // kv_heads, dim=1)
        value = value.repeat_interleave(h // kv_heads, dim=1)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, is_causal=attention_mask is None
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, rollout_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # plain forwards of the model still get masks


class GrowingKVLayer(DynamicLayer):
    """A KV-cache layer preallocated to ``capacity`` positions and filled in place.

    ``keys``/``values`` are views of the filled prefix, so transformers sees an ordinary dynamic layer,
    but appending a token writes one column instead of concatenating the whole cache (``DynamicLayer``
    copies all of it every step).
    """

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.key_buffer, self.value_buffer = (
            x.new_empty(*x.shape[:2], self.capacity, x.shape[-1]) for x in (key_states, value_states)
        )
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        return self._views()

    def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys, self.values = self.key_buffer[:, :, : self.length], self.value_buffer[:, :, : self.length]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
            self._views()


# Below this hidden size oneDNN's per-call cost outweighs the packing it saves.
PACK_MIN_HIDDEN = 256

# RoPE variants whose cos/sin depend only on the position, so one table serves every decode step
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}


def decode_plan(model) -> dict | None:
    """The modules :func:`decode_token` reads, or None when the model has parts it does not cover:
    projections that are not plain ``nn.Linear`` (adapters, quantized layers), forward hooks (ZeRO-3
    gathering), or RoPE scaling that changes with the sequence length."""
    inner = getattr(model, "model", None)
    if (
        not hasattr(inner, "layers")
        or not hasattr(inner, "rotary_emb")
        or getattr(inner.rotary_emb, "rope_type", None) not in STATIC_ROPE_TYPES
        or any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    ):
        return None
    linears = [model.lm_head]
    for layer in inner.layers:
        at, mlp = layer.self_attn, layer.mlp
        linears += [at.q_proj, at.k_proj, at.v_proj, at.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    if any(type(m) is not torch.nn.Linear for m in linears):
        return None
    act = model.config.hidden_act
    return {
        "inner": inner,
        "lm_head": model.lm_head,
        "act": F.silu if act == "silu" else inner.layers[0].mlp.act_fn,
    }


def _stack(linears: list[torch.nn.Linear], in_place: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = (
        None
        if all(m.bias is None for m in linears)
        else torch.cat(
            [m.weight.new_zeros(m.out_features) if m.bias is None else m.bias.detach() for m in linears]
        )
    )
    if in_place:
        sizes = [m.out_features for m in linears]
        biases = [None] * len(linears) if bias is None else bias.split(sizes)
        for m, w, b in zip(linears, weight.split(sizes), biases, strict=True):
            m.weight.data = w
            if m.bias is not None:
                m.bias.data = b
    return weight, bias


def fuse_projections(plan: dict, in_place: bool = True) -> list[tuple]:
    """Lay out each layer's q/k/v weights in one tensor and its gate/up weights in another, so that a decode
    step runs one matmul per group. ``in_place``: the modules' parameters become views of them (no memory
    added; valid while the weights change only in place, as :class:`HFEngine` does); else copies.
    Returns per layer ``(qkv weight, qkv bias, gate_up weight, gate_up bias)``; a bias is None when no
    projection of the group has one."""
    return [
        (
            *_stack([at.q_proj, at.k_proj, at.v_proj], in_place),
            *_stack([mlp.gate_proj, mlp.up_proj], in_place),
        )
        for at, mlp in ((layer.self_attn, layer.mlp) for layer in plan["inner"].layers)
    ]


def decode_weights(plan: dict, fused: list[tuple] | None, pack_rows: int = 0) -> dict:
    """What :func:`decode_token` multiplies by: ``layers``, per layer ``(qkv, o, gate_up, down)``, and
    ``lm_head``, each a list of ``(weight, bias)`` whose outputs are concatenated: one entry per group
    with ``fused`` (:func:`fuse_projections`), else the modules' own.

    With ``pack_rows``, the weights are oneDNN's blocked copies for that many rows (``packed``), which
    oneDNN does not re-pack on every call. The copies are snapshots: whoever changes the weights must drop
    them (:class:`HFEngine` does).
    """

    def group(*pairs) -> list:
        pack = torch.ops.mkldnn._reorder_linear_weight
        return [(pack(w, pack_rows) if pack_rows else w, b) for w, b in pairs]

    def own(*linears: torch.nn.Linear) -> list:
        return group(*((m.weight, m.bias) for m in linears))

    layers = []
    for i, layer in enumerate(plan["inner"].layers):
        at, mlp = layer.self_attn, layer.mlp
        qkv = own(at.q_proj, at.k_proj, at.v_proj) if fused is None else group(fused[i][:2])
        gate_up = own(mlp.gate_proj, mlp.up_proj) if fused is None else group(fused[i][2:])
        layers.append((qkv, own(at.o_proj), gate_up, own(mlp.down_proj)))
    return {"layers": layers, "lm_head": own(plan["lm_head"]), "packed": bool(pack_rows)}


def _project(x: torch.Tensor, group: list, packed: bool) -> torch.Tensor:
    outs = [
        torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "") if packed else F.linear(x, w, b)
        for w, b in group
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs, -1)


def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm of Llama, Mistral and Qwen: ``w * (x / sqrt(mean(x^2) + eps))``, in float32."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers applies it: ``x cos + rotate_half(x) sin``; x ``[B, H, d]``, cos/sin ``[B, 1, d]``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def decode_token(
    plan: dict,
    tokens: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor,
    cache: Cache,
    weights: dict,
) -> torch.Tensor:
    """One new token per row through a Llama-family decoder; the same math as the model's forward.

    tokens ``[B]``; cos/sin ``[B, d]`` of each row's position; mask ``[B, 1, 1, L]`` additive over the L
    cached positions including this one; ``cache`` holds :class:`GrowingKVLayer` s and gets this token's
    K/V; ``weights`` from :func:`decode_weights`. Per layer: ``h += o(attn(rope(q(n1 h)), rope(k(n1 h)),
    v(n1 h)))`` then ``h += down(act(gate(n2 h)) * up(n2 h))``; Qwen3 normalises q and k per head before
    RoPE. Returns float32 logits ``[B, V]``.
    """
    inner, packed = plan["inner"], weights["packed"]
    b = tokens.shape[0]
    cos, sin = cos[:, None], sin[:, None]
    h = F.embedding(tokens, inner.embed_tokens.weight)
    for layer, kv, (qkv_w, o_w, gate_up_w, down_w) in zip(
        inner.layers, cache.layers, weights["layers"], strict=True
    ):
        at = layer.self_attn
        d = at.head_dim
        heads, kv_heads = at.q_proj.out_features // d, at.k_proj.out_features // d
        x = _rms_norm(layer.input_layernorm, h)
        qkv = _project(x, qkv_w, packed).view(b, heads + 2 * kv_heads, d)
        qk, v = qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads :]
        if hasattr(at, "q_norm"):
            qk = torch.cat([_rms_norm(at.q_norm, qk[:, :heads]), _rms_norm(at.k_norm, qk[:, heads:])], 1)
        qk = _rotate(qk, cos, sin)  # q and k rotated together
        keys, values = kv.update(qk[:, heads:, None], v[:, :, None])
        q = qk[:, :heads].reshape(b, kv_heads, heads // kv_heads, d)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * at.scaling + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
        out = torch.matmul(probs, values).reshape(b, heads * d)
        h = h + _project(out, o_w, packed)
        x = _rms_norm(layer.post_attention_layernorm, h)
        gate, up = _project(x, gate_up_w, packed).chunk(2, dim=-1)
        h = h + _project(plan["act"](gate) * up, down_w, packed)
    return _project(_rms_norm(inner.norm, h), weights["lm_head"], packed).float()


class HFEngine(RolloutEngine):
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
    ):
        if num_threads:
            torch.set_num_threads(num_threads)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = load_model(
            model_name_or_path, dtype=parse_dtype(dtype), attn_implementation=attn_implementation
        )
        model.requires_grad_(False)
        self._setup(model.to(device).eval(), eos_token_id, max_batch_size, True, pack_weights)

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
        self.num_layers = config.num_hidden_layers
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
        self._weights: dict | None = None  # decode_weights of an owned model; dropped whenever they change
        self.borrowed = False  # the parameters are a trainer's tensors (share_weights), changing behind us
        # Every name a trainer may send (tied weights appear under both names) -> the tensor to fill.
        self._targets: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        self._targets.update(dict(model.named_buffers(remove_duplicate=False)))
        self._params = {name: p for name, p in model.named_parameters()}  # unique parameters
        self._shapes = {name: p.shape for name, p in self._params.items()}
        self._canonical = {id(p): name for name, p in self._params.items()}  # a tied alias -> its unique name
        self._missing: set[str] = set()  # parameters not received since a level-2 sleep
        self._lora_base: dict[
            str, torch.Tensor
        ] = {}  # weight name -> the base W0 its LoRA adapter is merged into
        self._asleep = 0
        self._sync: SyncGroup | None = None

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
        for i, req in enumerate(requests):
            if self.max_positions is not None and len(req.prompt_ids) >= self.max_positions:
                raise ValueError(
                    f"generation request {i}: the prompt has {len(req.prompt_ids)} tokens, "
                    "leaving no room to generate in the model's max_position_embeddings="
                    f"{self.max_positions}"
                )
            if req.images and self.image_token_id is None:
                raise ValueError(
                    f"generation request {i} has images but the model is not a vision-language model"
                )
            if self.image_token_id is not None and (
                mismatch := count_image_tokens(req.prompt_ids, req.images, self.image_token_id)
            ):
                raise ValueError(f"generation request {i}: the prompt has {mismatch}")
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
        saved_attention = self.model.config._attn_implementation
        if self.fast_path:
            self.model.config._attn_implementation = ATTENTION_NAME
        try:
            n_chunks = math.ceil(len(rows) / self.max_batch_size)
            for k, start in enumerate(range(0, len(rows), self.max_batch_size)):
                chunk = rows[start : start + self.max_batch_size]
                began = time.perf_counter()
                outs = self._generate_rows([row[2:] for row in chunk], weights)
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

    def _generate_rows(self, rows: list[tuple], weights: dict | None) -> list[GenerationOutput]:
        """Decode one batch of samples; ``rows`` are (prompt ids, SamplingParams, seed, images); ``weights``
        from :func:`decode_weights` (None on the module path)."""
        dev, vocab = self.device, self.vocab_size
        n_rows = len(rows)
        prompt_lens = [len(row[0]) for row in rows]
        width = max(prompt_lens)  # prompts are left-padded to this many columns
        # a sample stops at the model's last position (finish reason "length")
        limit = self.max_positions or math.inf
        max_new = [int(min(p.max_new_tokens, limit - len(ids))) for ids, p, *_ in rows]
        steps = max(max_new)

        ids = torch.tensor([[0] * (width - len(prompt)) + list(prompt) for prompt, *_ in rows])
        params = [row[1] for row in rows]
        # [R, S] each row's stop ids (EOS and stop_token_ids); a shorter row repeats its first id
        stops = [[] if p.ignore_eos else sorted(self.eos_token_ids | set(p.stop_token_ids)) for p in params]
        n_stops = max(1, *map(len, stops))
        stop_ids = torch.tensor([(row + row[:1] * n_stops or [0] * n_stops)[:n_stops] for row in stops])
        filtering = any(p.top_k > 0 or p.top_p < 1 for p in params)
        max_min_new = max(p.min_new_tokens for p in params)
        # Everything indexed by batch slot; slots of finished samples are dropped together from time to time.
        slots = {
            "row": torch.arange(n_rows),
            "prompt_len": torch.tensor(prompt_lens),
            "temperature": torch.tensor([p.temperature for p in params], dtype=torch.float32),
            "top_k": torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params]),
            "top_p": torch.tensor([p.top_p for p in params], dtype=torch.float32),
            "min_new": torch.tensor([p.min_new_tokens for p in params]),
            "max_new": torch.tensor(max_new),
            "keys": row_keys(torch.tensor([row[2] for row in rows], dtype=torch.long)),
            "stop_ids": stop_ids,
            "has_stops": torch.tensor([bool(x) for x in stops]),
            "live": torch.ones(n_rows, dtype=torch.bool),
        }
        pad = width - slots["prompt_len"]
        columns = torch.arange(width)
        key_valid = columns[None, :] >= pad[:, None]  # [R, width]: False on left padding
        positions = (columns[None, :] - pad[:, None]).clamp(min=0)
        dtype = next(self.model.parameters()).dtype
        if self.fast_path:
            cache: Cache = Cache(layers=[GrowingKVLayer(width + steps) for _ in range(self.num_layers)])
            # Prefill: a query sees valid keys at or before it (padding queries see themselves, which keeps
            # their rows finite); without padding, plain causal attention. Decode: an additive row mask.
            prefill_mask = None
            if not bool(key_valid.all()):
                prefill_mask = (
                    torch.tril(torch.ones(width, width, dtype=torch.bool))[None] & key_valid[:, None, :]
                )
                prefill_mask = (prefill_mask | torch.eye(width, dtype=torch.bool)[None])[:, None]
            slots["mask"] = torch.zeros(n_rows, 1, 1, width + steps, dtype=dtype)
            slots["mask"][:, 0, 0, :width].masked_fill_(~key_valid, -math.inf)
        else:
            cache = DynamicCache(config=self.model.config)
            slots["mask"] = torch.ones(n_rows, width + steps, dtype=torch.long)
            slots["mask"][:, :width] = key_valid.long()
            prefill_mask = slots["mask"][:, :width]
        plan = self.plan if self.fast_path else None
        if plan is not None:  # cos/sin of every position a row can reach, computed once
            rope = plan["inner"].rotary_emb
            table = torch.arange(width + steps, device=dev)[None]
            cos, sin = (x[0] for x in rope(torch.zeros((), dtype=dtype, device=dev), table))
        s = {k: v.to(dev) for k, v in slots.items()}  # the slots, on the device

        tokens = torch.zeros(n_rows, steps, dtype=torch.long, device=dev)
        logprobs = torch.zeros(n_rows, steps, dtype=torch.float32, device=dev)
        lengths = torch.zeros(n_rows, dtype=torch.long, device=dev)
        stopped = torch.zeros(n_rows, dtype=torch.bool, device=dev)

        # The samples of a prompt share its prefill: each distinct prompt (ids and images) runs once (row
        # `first[k]`), then its cache rows and last logits are copied to every sample (row r takes `source[r]`).
        distinct: dict[tuple, int] = {}
        source = [distinct.setdefault((tuple(row[0]), *map(id, row[3])), len(distinct)) for row in rows]
        first = torch.tensor([source.index(k) for k in range(len(distinct))])
        source = torch.tensor(source, device=dev)
        prefill_mask = None if prefill_mask is None else prefill_mask[first].to(dev)
        prefill_positions = positions[first].to(dev)
        images = {}
        if self.image_token_id is not None:
            # M-RoPE positions over the images' grids; a row's text continues at prompt_len + offset
            images, offsets = image_forward_inputs(
                self.model,
                ids[first].to(dev),
                key_valid[first].long().to(dev),
                [rows[k][3] for k in first.tolist()],
            )
            prefill_positions = images.pop("position_ids")
            s["rope_offset"] = offsets[:, 0][source]
        logits = self._forward(ids[first].to(dev), prefill_positions, prefill_mask, cache, **images)
        if len(distinct) < n_rows:
            cache.batch_select_indices(source)
            logits = logits[source]
        for t in range(steps):
            tok, lp = sample_next(
                logits,
                s["temperature"],
                s["keys"],
                t,
                top_k=s["top_k"] if filtering else None,
                top_p=s["top_p"] if filtering else None,
                stop_ids=s["stop_ids"],
                suppress=(t < s["min_new"]) & s["has_stops"] if t < max_min_new else None,
                never=self.image_token_id,
            )
            live = s["live"]
            tokens[s["row"], t] = tok
            logprobs[s["row"], t] = lp
            lengths[s["row"]] += live.long()
            hit_stop = (s["stop_ids"] == tok[:, None]).any(1) & s["has_stops"] & live
            stopped[s["row"]] |= hit_stop
            s["live"] = live = live & ~hit_stop & (t + 1 < s["max_new"])
            if (n_live := int(live.sum())) == 0:
                break
            if n_live <= len(live) // 2 and len(live) >= 8:
                keep = live.nonzero().squeeze(1)
                s = {k: v[keep] for k, v in s.items()}
                cache.batch_select_indices(keep)
                tok = tok[keep]
            mask = s["mask"][..., : width + t + 1]
            position = s["prompt_len"] + t
            if "rope_offset" in s:  # the same next position on M-RoPE's three axes
                position = (position + s["rope_offset"])[None].expand(3, -1)
            if plan is not None:
                logits = decode_token(plan, tok, cos[position], sin[position], mask, cache, weights)
            else:
                logits = self._forward(tok[:, None], position[..., None], mask, cache)

        return [
            GenerationOutput(toks[:n], lps[:n], "stop" if is_stop else "length")
            for toks, lps, n, is_stop in zip(
                tokens.tolist(), logprobs.tolist(), lengths.tolist(), stopped.tolist(), strict=True
            )
        ]

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

    # --- weights --------------------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> None:
        """Copy tensors into the parameters or buffers of the same HF names (cast to the engine's dtype). A LoRA
        policy's adapters (``<layer>.lora_A``/``.lora_B`` pairs, :mod:`rlhf_core.weight_sync`) are merged instead:
        the layer's weight becomes ``W0 + B @ A``, ``W0`` the base weight the engine held before its first
        adapter (kept as a copy of each adapted weight)."""
        self._weights = None  # packed copies are snapshots
        named_tensors = iter(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        if (first := next(named_tensors, None)) is None:
            return
        named_tensors = itertools.chain([first], named_tensors)
        some = ", ".join(itertools.islice(self._params, 3))  # what names look like, for the errors
        if is_adapter(first[0]):  # merged rather than run as extra matmuls: decode keeps its fast path
            for layer, lora_a, lora_b in lora_pairs(named_tensors):
                name = layer + ".weight"
                if (target := self._params.get(name)) is None:
                    raise KeyError(
                        f"update_weights: the LoRA layer {layer!r} has no weight {name!r} in this "
                        f"model (names look like {some}, ...)"
                    )
                if name in self._missing:
                    raise RuntimeError(
                        f"update_weights: {name!r} was discarded by sleep(level=2), and a LoRA "
                        "adapter needs the base weight under it; send the full weights first"
                    )
                if name not in self._lora_base:  # the first adapter on this weight: it holds the base now
                    self._lora_base[name] = target.detach().clone()
                merge_lora_pair(self._lora_base[name], lora_a, lora_b, out=target)
            return
        for name, tensor in named_tensors:
            self._lora_base.pop(name, None)  # a full weight replaces the base an adapter was merged into
            if (target := self._targets.get(name)) is None:
                raise KeyError(
                    f"update_weights: {name!r} is not a weight of this model (names look like {some}, ...)"
                )
            canonical = self._canonical.get(id(target))
            expected = self._shapes[canonical] if canonical is not None else target.shape
            if tuple(tensor.shape) != tuple(expected):
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model "
                    f"expects {tuple(expected)}"
                )
            target.copy_(tensor)
            self._missing.discard(canonical)

    @torch.no_grad()
    def share_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> bool:
        """Decode from ``named_tensors`` themselves (a trainer's parameters in this process, by HF name) instead
        of a copy: the engine's own weights are freed, and the trainer's in-place updates reach the engine
        without :meth:`update_weights`. Returns False, sharing nothing, unless the engine owns its weights
        (loaded from a path) or already shares, and every parameter has a tensor of the same name, shape,
        dtype and device. :meth:`sleep` ends the sharing: after :meth:`wake_up` the engine owns its weights
        again and needs :meth:`update_weights`."""
        if (
            self._asleep
            or not (self.own_weights or self.borrowed)
            or not all(
                (t := named_tensors.get(name)) is not None
                and t.shape == p.shape
                and t.dtype == p.dtype
                and t.device == p.device
                for name, p in self._params.items()
            )
        ):
            return False
        for name, p in self._params.items():
            p.data = named_tensors[name].detach()
        self._weights = self._fused = None
        self.own_weights, self.borrowed = False, True
        return True

    def init_weight_sync(
        self,
        master_addr: str,
        master_port: int,
        first_rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 600.0,
    ) -> None:
        """Join the weight-sync group as rank ``first_rank`` (the sender is rank 0); see
        :func:`rlhf_core.weight_sync.init_sync_group`. Call it on every engine while the sender joins; a group
        joined before is left first (a new group replaces one that held a dead engine)."""
        self.close_weight_sync()
        device = self.device if backend == "nccl" else torch.device("cpu")
        self._sync = init_sync_group(
            master_addr, master_port, first_rank, world_size, backend, timeout_s, device=device
        )

    def receive_weights(self) -> None:
        """Receive one full set of weights from the sync group's rank 0 and load it."""
        if self._sync is None:
            raise RuntimeError("HFEngine.receive_weights: call init_weight_sync first")
        self.update_weights(self._sync.receive())

    def close_weight_sync(self) -> None:
        if self._sync is not None:
            self._sync.close()
            self._sync = None

    # --- memory ---------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Level 1 has nothing to do on a CPU engine: KV caches live only inside ``generate``."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self._asleep:
            return
        self._weights = self._fused = None  # level 2 frees the fused tensors; wake_up lays them out again
        if self.borrowed:  # moved or discarded: after wake_up the weights are this engine's own again
            self.borrowed, self.own_weights = False, True
        for p in self._params.values():
            if level == 2:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            elif self.device.type != "cpu":
                p.data = p.data.to("cpu")
        # the bases of LoRA-merged weights go with the weights (discarded: the next sync must send full weights)
        self._lora_base = {} if level == 2 else {k: v.to("cpu") for k, v in self._lora_base.items()}
        self._asleep = level
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        for name, p in self._params.items():
            if self._asleep == 2:
                p.data = torch.empty(self._shapes[name], dtype=p.dtype, device=self.device)
            elif self._asleep == 1 and self.device.type != "cpu":
                p.data = p.data.to(self.device)
        if self._asleep == 2:
            self._missing = set(self._params)
        self._lora_base = {k: v.to(self.device) for k, v in self._lora_base.items()}
        if self.own_weights and self._asleep:  # the parameters are separate tensors again
            self._fused = fuse_projections(self.plan)
        self._asleep = 0

    def reset_prefix_cache(self) -> None:
        """Nothing to do: this engine keeps no KV cache between ``generate`` calls."""
