"""One decode step of the HF engine, from the weights: attention as the engine runs it, the KV-cache layers (one
that grows in place, one of fixed shape for a captured CUDA graph), the weight layout (fused, packed) and
:func:`decode_token`, a Llama-family decoder step written out. :mod:`rlhf_core.rollout.hf_engine` drives it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "rlhf_rollout"
# Model types whose attention modules only project, rotate and call the attention function: our own
# masks and attention are exact for them. Anything else takes the generic path.
FAST_PATH_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


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
            self.key_buffer, self.value_buffer = (
                self._select(x, indices) for x in (self.key_buffer, self.value_buffer)
            )
            self._views()

    def _select(self, buffer: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The rows ``indices`` of a ``[R, H, capacity, D]`` buffer; only their filled positions are copied,
        so the rest of the capacity stays untouched (no time, and no resident memory until written)."""
        out = buffer.new_empty(len(indices), *buffer.shape[1:])
        out[:, :, : self.length] = buffer[indices, :, : self.length]
        return out


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


class StaticKVLayer(DynamicLayer):
    """A KV-cache layer of fixed shape ``[B, Hkv, capacity, d]`` for a decode step whose tensors keep their
    shapes and addresses (what a CUDA graph replays). A token's K/V go to column ``column`` (``[1]`` int64 on
    the device, shared by the layers); attention reads every column, and the step's mask hides those not
    written (the buffers start as zeros, so a hidden column adds ``0 * finite``)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, column: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.column = keys, values, column
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys.index_copy_(2, self.column, key_states)
        self.values.index_copy_(2, self.column, value_states)
        return self.keys, self.values


class StaticDecoder:
    """:func:`decode_token` for ``rows`` samples over a cache of ``capacity`` columns, with every tensor
    allocated once: on CUDA (``graph``) the step is captured as a CUDA graph on its first call and replayed
    after, one launch instead of a few hundred kernels. Reusable for the next batch of the same shape while
    the weights stay where they are (:class:`HFEngine` keys it on their addresses).

    Per generate call :meth:`start` takes the prefill; each :meth:`step` opens the mask at ``column``, runs the
    layers on ``tokens`` at positions ``column - pad``, writes their K/V at ``column`` and advances it. The
    numbers are :func:`decode_token`'s over a :class:`GrowingKVLayer` except for the order of the sums over
    the masked columns' zeros (a few ulps in float32).
    """

    def __init__(self, plan: dict, weights: dict, rows: int, capacity: int, graph: bool):
        inner = plan["inner"]
        at = inner.layers[0].self_attn
        dtype, device = inner.embed_tokens.weight.dtype, inner.embed_tokens.weight.device
        self.plan, self.weights, self.graph = plan, weights, graph
        self.captured: torch.cuda.CUDAGraph | None = None
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.pad = torch.zeros(rows, dtype=torch.long, device=device)
        self.mask = torch.full((rows, 1, 1, capacity), -math.inf, dtype=dtype, device=device)
        shape = (rows, at.k_proj.out_features // at.head_dim, capacity, at.head_dim)
        self.cache = Cache(
            layers=[
                StaticKVLayer(*(torch.zeros(shape, dtype=dtype, device=device) for _ in "kv"), self.column)
                for _ in inner.layers
            ]
        )
        table = torch.arange(capacity, device=device)[None]
        self.cos, self.sin = (
            x[0] for x in inner.rotary_emb(torch.zeros((), dtype=dtype, device=device), table)
        )

    def start(self, prefill: Cache, key_valid: torch.Tensor, pad: torch.Tensor) -> None:
        """Take a prefill's K/V (``prefill``: :class:`GrowingKVLayer` s of ``width`` columns, one row per sample),
        its ``key_valid`` ``[B, width]`` (False on left padding) and each row's padding ``pad`` ``[B]``."""
        width = key_valid.shape[1]
        for mine, theirs in zip(self.cache.layers, prefill.layers, strict=True):
            mine.keys[:, :, :width].copy_(theirs.keys)
            mine.values[:, :, :width].copy_(theirs.values)
        self.mask.fill_(-math.inf)
        self.mask[:, 0, 0, :width].masked_fill_(key_valid, 0.0)
        self.pad.copy_(pad)
        self.column.fill_(width)

    def _step(self) -> torch.Tensor:
        self.mask.index_fill_(-1, self.column, 0.0)
        position = self.column - self.pad
        cos, sin = self.cos[position], self.sin[position]
        logits = decode_token(self.plan, self.tokens, cos, sin, self.mask, self.cache, self.weights)
        self.column += 1
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` (float32) of the next position of every row after ``tokens`` ``[B]``; on CUDA the
        tensor is the graph's output, overwritten by the next step."""
        self.tokens.copy_(tokens)
        if not self.graph:
            return self._step()
        if self.captured is None:
            # the first step runs eagerly on a side stream (warming up kernels and workspaces), then the
            # same work is captured, not run, for the steps after
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                logits = self._step()
            torch.cuda.current_stream().wait_stream(stream)
            self.captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.captured):
                self.logits = self._step()
            return logits
        self.captured.replay()
        return self.logits
