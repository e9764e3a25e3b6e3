"""Shared prompts, packed responses: the sequences of a micro-batch that start with the same prompt (the ``n``
samples of one prompt in RL, chosen and rejected in DPO) run that prompt through the model once, and every
sequence runs its own tokens only, without padding.

Layout, one packed row ``[1, N]``, group after group (sequences with the same prompt)::

    [ prompt 0 | response a less its last token | response b ... | prompt 1 | response c ... | ... ]

A response's last token predicts nothing and no other token attends to it, so it is left out: a group of
prompt ``p`` and responses ``r_i`` holds ``p + sum(r_i - 1)`` tokens, ``N`` is the sum over groups. Positions
are the prompt's ``0..p-1`` and ``p..p+r_i-2`` in each response. The attention function registered here as
``rlhf_shared_prefix`` runs, for each response, causal SDPA over its group's prompt followed by its own
tokens (one call per sequence, the prompt's keys and values concatenated in front), which is the attention
that sequence has on its own: log-probs and gradients equal the padded batch's up to float summation order.
The prompt's queries are answered by the first sequence's call (the others drop theirs). The linear layers
see ``N`` tokens instead of ``B * L`` padded; attention costs ``sum_i (p + r_i)^2 / 2`` per head, as the
sequences would alone. Autograd sums the group's gradients into the one prompt.

Without a layout (``shared_prefix`` keyword absent) the function is transformers' SDPA, and its masks are
SDPA's: a model loaded with it computes everything else exactly as with ``sdpa``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTN = "rlhf_shared_prefix"

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
    """Where each sequence of a micro-batch sits in the packed row (see the module docstring)."""

    input_ids: torch.Tensor
    """``[1, N]``"""
    position_ids: torch.Tensor
    """``[1, N]``"""
    groups: list[tuple[int, int, list[tuple[int, int]]]]
    """Per group: its prompt's start and length in the row, and each response's start and length there."""
    columns: torch.Tensor
    """``[K]`` columns whose outputs predict a response token: each group's last prompt column, then its
    responses' columns."""
    logit_rows: torch.Tensor
    """``[B, T]`` index into :attr:`columns` of the output that predicts response token ``t`` of sequence
    ``i`` (0 past its end)."""


def plan(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lens: torch.Tensor) -> Layout | None:
    """The packed shared-prompt layout of a right-padded batch (``[B, L]`` ids and mask, ``[B]`` prompt
    lengths); rows with the same prompt ids form a group, in order of their first row. None when no prompt
    is shared: such a batch runs padded, as it always has (``--ds.packing_samples`` packs it)."""
    lengths, plens, rows = attention_mask.sum(-1).tolist(), prompt_lens.tolist(), input_ids.tolist()
    groups: dict[tuple, list[int]] = {}
    for i, (row, p) in enumerate(zip(rows, plens, strict=True)):
        groups.setdefault(tuple(row[:p]), []).append(i)
    if len(groups) == len(rows):
        return None
    ids: list[int] = []
    pos: list[int] = []
    columns: list[int] = []
    spans = []
    logit_rows = torch.zeros(
        (len(rows), max(n - p for n, p in zip(lengths, plens, strict=True))), dtype=torch.long
    )
    for members in groups.values():
        p, start = plens[members[0]], len(ids)
        ids += rows[members[0]][:p]
        pos += range(p)
        prompt_column = len(columns)
        columns.append(start + p - 1)
        responses = []
        for i in members:
            r = lengths[i] - p
            w = max(r - 1, 0)  # the last token predicts nothing
            responses.append((len(ids), w))
            logit_rows[i, :r] = torch.tensor([prompt_column, *range(len(columns), len(columns) + w)])
            columns += range(len(ids), len(ids) + w)
            ids += rows[i][p : p + w]
            pos += range(p, p + w)
        spans.append((start, p, responses))
    return Layout(torch.tensor([ids]), torch.tensor([pos]), spans, torch.tensor(columns), logit_rows)


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: ``[1, H, N, D]`` queries, ``[1, Hkv, N, D]`` keys/values ->
    ``[1, N, H, D]``. Plain SDPA unless the forward was given ``shared_prefix=Layout``."""
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
    gqa = query.shape[1] != key.shape[1]
    out = []
    for start, p, responses in layout.groups:
        for n, (a, w) in enumerate(responses):
            q, k, v = (
                torch.cat([x[:, :, start : start + p], x[:, :, a : a + w]], 2) for x in (query, key, value)
            )
            o = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa
            )  # [1, H, p + w, D]
            out.append(o if n == 0 else o[:, :, p:])  # the group's first sequence answers its prompt
    return torch.cat(out, 2).transpose(1, 2).contiguous(), None


def forward_inputs(layout: Layout) -> dict:
    """The causal LM's keyword arguments that run a layout; keep the columns :attr:`Layout.columns`."""
    # a 4-D mask is passed through untouched; the attention needs none (the layout says who sees whom)
    placeholder = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=layout.input_ids.device)
    return {
        "input_ids": layout.input_ids,
        "position_ids": layout.position_ids,
        "attention_mask": placeholder,
        "shared_prefix": layout,
    }
