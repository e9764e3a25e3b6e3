"""Shared prompts: the sequences of a micro-batch that start with the same prompt (the ``n`` samples of one
prompt in RL, chosen and rejected in DPO) run that prompt through the model once.

Layout, one row per group of sequences with the same prompt (``G`` rows)::

    [ P prompt slots, left-padded | slot 0: W response tokens | slot 1: W | ... | slot S-1: W ]

``P`` is the longest prompt, ``S`` the largest group, ``R`` the longest response and ``W = R - 1``: a
response's last token predicts nothing and no other token attends to it, so no slot needs it. Positions
are the prompt's ``0..p-1`` and ``p..p+W-1`` in every slot. The attention function registered here as
``rlhf_shared_prefix`` gives

- prompt queries: the causal prompt keys of their row (pad keys masked);
- response token ``t`` of slot ``s``: the row's prompt keys, then keys ``0..t`` of slot ``s`` only,

which is the attention each sequence has on its own, so log-probs and gradients equal the unshared ones up
to float summation order. The linear layers see ``G*P + G*S*W`` tokens instead of ``B*(P+R)``: with 8
samples of a 32-token prompt and 64-token responses, 30% fewer. The prompt's keys and values are expanded
to every slot, so autograd sums the group's gradients into the one prompt.

Without a layout (``shared_prefix`` keyword absent) the function is transformers' SDPA, and its masks are
SDPA's: a model loaded with it computes everything else exactly as with ``sdpa``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTN = "rlhf_shared_prefix"
MAX_MASK_ENTRIES = 1 << 26
"""Largest response mask (``G*S*W*(P+W)`` booleans, also materialised as floats by SDPA) a layout may use."""

# Attention in these architectures is plain softmax attention over RoPE'd q/k; sliding windows are checked
# separately. Others (soft-capping, attention sinks, cross-layer KV sharing) keep SDPA.
SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral"}


def supported(config) -> bool:
    """Whether a model with this transformers config can use the shared-prompt attention."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False
    return all(t == "full_attention" for t in getattr(config, "layer_types", None) or ["full_attention"])


def attn_implementation(config, ds) -> str:
    """The attention implementation to load a causal LM with: ``rlhf_shared_prefix`` where
    ``--ds.shared_prefix`` is on and it applies (SDPA, no packing, no ring attention, a supported model),
    else ``--ds.attn_implementation``."""
    if not (
        ds.shared_prefix
        and ds.attn_implementation == "sdpa"
        and not ds.packing_samples
        and ds.ring_attn_size == 1
        and supported(config)
    ):
        return ds.attn_implementation
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN, sdpa_mask)
    return ATTN


def enabled(model) -> bool:
    """True when ``model`` (possibly wrapped by DeepSpeed or PEFT) was loaded with the shared-prompt attention."""
    model = getattr(
        model, "module", model
    )  # a DeepSpeed engine's model (the engine's own `config` is DeepSpeed's)
    if hasattr(model, "get_base_model"):  # PEFT
        model = model.get_base_model()
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == ATTN


@dataclass
class Layout:
    """Where each sequence of a micro-batch sits in the shared-prompt rows (see the module docstring)."""

    input_ids: torch.Tensor
    """``[G, P + S*W]``"""
    position_ids: torch.Tensor
    """``[G, P + S*W]``"""
    prompt_len: int
    slots: int
    slot_len: int
    """``W``: positions per slot, the longest response less its last token (at least 1)"""
    prompt_mask: torch.Tensor
    """``[G, 1, P, P]`` bool: causal over real prompt keys (a pad query sees itself, so no row is empty)."""
    response_mask: torch.Tensor
    """``[G*S, 1, W, P+W]`` bool: the group's real prompt keys, then causal over the slot's own keys."""
    columns: torch.Tensor
    """``[K]`` columns of a row whose outputs predict a response token: the last prompt slot, then every
    slot's first ``R - 1`` positions (``K = 1 + S*(R-1)``; all ``W`` of them unless ``R`` is 1)."""
    logit_rows: torch.Tensor
    """``[B, T]`` index into the ``[G*K]`` flattened outputs at :attr:`columns` for response token ``t`` of
    sequence ``i``."""


def plan(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lens: torch.Tensor) -> Layout | None:
    """The shared-prompt layout of a right-padded batch (``[B, L]`` ids and mask, ``[B]`` prompt lengths),
    or None when it would not run fewer tokens than the padded batch (no prompt shared, or groups so
    uneven that the empty slots cost more than the prompts saved), or when its attention mask would pass
    :data:`MAX_MASK_ENTRIES` (long sequences, where the padded path's causal kernels need no mask at all)."""
    lengths, plens, rows = attention_mask.sum(-1).tolist(), prompt_lens.tolist(), input_ids.tolist()
    groups: dict[tuple, list[int]] = {}
    for i, (row, p) in enumerate(zip(rows, plens, strict=True)):
        groups.setdefault(tuple(row[:p]), []).append(i)
    members = list(groups.values())
    b, g = len(rows), len(members)
    P, S = max(plens), max(len(m) for m in members)
    R = max(n - p for n, p in zip(lengths, plens, strict=True))
    W = max(R - 1, 1)
    if g == b or g * (P + S * W) >= b * input_ids.shape[1] or g * S * W * (P + W) > MAX_MASK_ENTRIES:
        return None

    width = P + S * W
    ids = torch.zeros((g, width), dtype=torch.long)  # empty slots are masked out, so their ids do not matter
    pos = torch.zeros((g, width), dtype=torch.long)
    key_ok = torch.zeros((g, P), dtype=torch.bool)
    K = 1 + S * (R - 1)
    logit_rows = torch.zeros((b, R), dtype=torch.long)
    for gi, group in enumerate(members):
        p = plens[group[0]]
        ids[gi, P - p : P] = torch.tensor(rows[group[0]][:p])
        pos[gi, P - p : P] = torch.arange(p)
        key_ok[gi, P - p :] = True
        for s, i in enumerate(group):
            start = P + s * W
            r = min(lengths[i] - p, W)
            ids[gi, start : start + r] = torch.tensor(rows[i][p : p + r])
            pos[gi, start : start + W] = torch.arange(p, p + W)
            # token 0 is predicted by the last prompt slot, token t >= 1 by slot position t - 1
            logit_rows[i, 0] = gi * K
            logit_rows[i, 1:] = gi * K + 1 + s * (R - 1) + torch.arange(R - 1)
    q, k = torch.arange(P)[:, None], torch.arange(P)[None, :]
    prompt_mask = ((k <= q) & key_ok[:, None, :]) | (k == q)
    causal = torch.ones(W, W, dtype=torch.bool).tril()
    response_mask = torch.cat([key_ok[:, None, None, :].expand(g, S, W, P), causal.expand(g, S, W, W)], -1)
    slot_starts = P + torch.arange(S) * W
    columns = torch.cat([torch.tensor([P - 1]), (slot_starts[:, None] + torch.arange(R - 1)).reshape(-1)])
    return Layout(
        ids,
        pos,
        P,
        S,
        W,
        prompt_mask[:, None],
        response_mask.reshape(g * S, 1, W, P + W),
        columns,
        logit_rows,
    )


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: ``[G, H, N, D]`` queries, ``[G, Hkv, N, D]`` keys/values ->
    ``[G, N, H, D]``. Plain SDPA unless the forward was given ``shared_prefix=Layout``."""
    layout: Layout | None = kwargs.pop("shared_prefix", None)
    if layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"shared-prompt attention does not support {name}; use --ds.shared_prefix false"
            )
    (g, heads, _, d), kv = query.shape, key.shape[1]
    P, S, W = layout.prompt_len, layout.slots, layout.slot_len

    def slots(x: torch.Tensor) -> torch.Tensor:  # [G, h, S*W, D] -> [G*S, h, W, D]
        return x.reshape(g, x.shape[1], S, W, d).transpose(1, 2).reshape(g * S, x.shape[1], W, d)

    def with_prompt(x: torch.Tensor) -> torch.Tensor:  # [G, Hkv, N, D] -> [G*S, Hkv, P+W, D]
        prompt = x[:, :, :P].unsqueeze(1).expand(g, S, kv, P, d).reshape(g * S, kv, P, d)
        return torch.cat([prompt, slots(x[:, :, P:])], 2)

    gqa = heads != kv
    out_prompt = F.scaled_dot_product_attention(
        query[:, :, :P],
        key[:, :, :P],
        value[:, :, :P],
        attn_mask=layout.prompt_mask,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=gqa,
    )
    out_slots = F.scaled_dot_product_attention(  # [G*S, H, W, D]
        slots(query[:, :, P:]),
        with_prompt(key),
        with_prompt(value),
        attn_mask=layout.response_mask,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=gqa,
    )
    out_slots = out_slots.reshape(g, S, heads, W, d).permute(0, 1, 3, 2, 4).reshape(g, S * W, heads, d)
    return torch.cat([out_prompt.transpose(1, 2), out_slots], 1).contiguous(), None


def forward_inputs(layout: Layout) -> dict:
    """The causal LM's keyword arguments that run a layout; keep the columns :attr:`Layout.columns`."""
    # a 4-D mask is passed through untouched; the attention ignores it (the layout holds the real masks)
    placeholder = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=layout.input_ids.device)
    return {
        "input_ids": layout.input_ids,
        "position_ids": layout.position_ids,
        "attention_mask": placeholder,
        "shared_prefix": layout,
    }
