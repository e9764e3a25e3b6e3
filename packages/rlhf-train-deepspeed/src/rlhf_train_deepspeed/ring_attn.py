"""Sequence parallelism with ring attention (``--ds.ring_attn_size R``, ``--ds.ring_attn_head_stride``).

This package's README describes the layout (the ``W`` ranks form ``D = W / R`` ring groups of ``R``
consecutive ranks; ring rank ``j`` runs the ``j``-th slice of each packed row, :func:`shard_packed`) and the
two attention functions (:func:`llama3_attention` on CUDA, the exact :func:`gather_attention` on CPU).

Gradient scaling. Let ``L = sum_d L_d`` be the loss of a step, ``L_d`` the part of ring group ``d``
(losses are normalised by global counts). Every rank of group ``d`` computes the same value ``l_d = c *
L_d`` from the same gathered outputs. The backward of the output all-gather sums, for each rank's piece,
the gradients all ``R`` ranks send for it (a reduce-scatter); they are identical, so each slice's outputs
receive ``R * dl_d/d(piece)``. Inside attention, the backward of the K/V all-gathers sums what every
rank's queries contribute to a slice's keys and values, which is the exact chain rule since each query
lives on one rank. So every operation of the forward is back-propagated exactly once in the ring, scaled
by ``R``: summed over the ring the parameter gradient is ``R * c * dL_d/dtheta``. DeepSpeed then averages
over all ``W`` ranks: ``grad = (1/W) * sum_d R * c * dL_d/dtheta = (R * c / W) * dL/dtheta``, which is
``dL/dtheta`` for ``c = W / R = D``. So the loss multiplier is the data-parallel size ``D`` (not ``W``),
and summing the reported losses over ranks must use one rank per ring group."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

ATTN_GATHER = "rlhf_ring_gather"
"""Exact all-gather-K/V SDPA (CPU). The names avoid "sdpa" and "flash": transformers keys checks on them."""
ATTN_LLAMA3 = "rlhf_ring_llama3"
"""ring-flash-attn's ``llama3_flash_attn_varlen_func`` (CUDA)."""


@dataclass(frozen=True)
class RingGroup:
    """This rank's ring group."""

    group: Any
    """The ``torch.distributed`` process group of the ``size`` ranks."""
    rank: int
    """Rank inside the ring, ``0 .. size-1``: which slice of each packed row this rank runs."""
    size: int
    head_stride: int = 1
    """KV heads per all-gather step of the CUDA path (``--ds.ring_attn_head_stride``)."""
    backend: str = "gather"
    """``gather`` (exact, CPU) or ``llama3`` (ring-flash-attn, CUDA)."""


_GROUPS: dict[tuple[int, int], Any] = {}


def setup_ring(size: int, head_stride: int = 1, backend: str | None = None) -> RingGroup:
    """Create the ring groups of the current process group (once per process) and return this rank's.
    Collective: ``dist.new_group`` must be called by every rank for every group, in the same order, so every
    rank creates all ``W / size`` groups and keeps its own. ``size`` divides ``W`` (the strategy checks)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if (world, size) not in _GROUPS:
        groups = [dist.new_group(list(range(d * size, (d + 1) * size))) for d in range(world // size)]
        _GROUPS[(world, size)] = groups[rank // size]
    backend = backend or ("llama3" if torch.cuda.is_available() else "gather")
    return RingGroup(_GROUPS[(world, size)], rank % size, size, head_stride, backend)


def attn_implementation(ring: RingGroup) -> str:
    """Register both ring attention functions with transformers and return the name to load models with."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_GATHER, gather_attention)
    AttentionInterface.register(ATTN_LLAMA3, llama3_attention)
    return ATTN_LLAMA3 if ring.backend == "llama3" else ATTN_GATHER


# --- slicing a packed row ------------------------------------------------------------------------------------


def padded_length(n: int, size: int) -> int:
    """``N' = ceil(n / size) * size``: the packed length once padded to equal slices."""
    return -(-n // size) * size


@dataclass
class RingSlice:
    """One packed micro-batch as seen by one ring rank: its inputs and the metadata attention needs."""

    ring: RingGroup
    start: int
    end: int
    total: int
    """Padded length ``N'`` of the whole row."""
    inputs: dict
    """``input_ids`` and ``position_ids`` ``[1, end - start]`` of this rank's slice."""
    labels: torch.Tensor
    """``[end - start]`` next token of the full padded row for each local token (0 after the last)."""
    cu_seqlens: torch.Tensor
    allowed: torch.Tensor | None = None
    """Gather path: ``[end - start, N']`` bool, local query ``i`` may attend global key ``k``."""
    llama3: tuple | None = None
    """CUDA path: ``llama3_flash_attn_prepare_cu_seqlens`` output for this rank."""


# The attention functions are called deep inside the HF model, through the DeepSpeed engine, PEFT wrappers
# and value-model forwards that drop extra keyword arguments, and again during gradient-checkpoint
# recomputation in backward. A module-level context reaches all of those; it is set before each forward and
# left in place until the next micro-batch replaces it, so that recomputation sees the same metadata.
_ACTIVE: RingSlice | None = None


def shard_packed(inputs: dict, lengths: torch.Tensor, ring: RingGroup, pad_token_id: int = 0) -> RingSlice:
    """Pad a packed row (``input_ids`` / ``position_ids`` ``[1, N]``, sequences of ``lengths``) to a multiple
    of the ring size, cut out this rank's slice and make it the active ring-attention context. The pad tokens
    form a dummy sequence with positions ``0 .. pad-1``; labels are taken before slicing, so the last token of
    a slice is labelled with the first token of the next one."""
    global _ACTIVE
    if "position_ids" not in inputs:
        raise ValueError("ring attention needs packed micro-batches (--ds.packing_samples)")
    ids, positions = inputs["input_ids"], inputs["position_ids"]
    n = ids.shape[1]
    total = padded_length(n, ring.size)
    if total > n:
        ids = F.pad(ids, (0, total - n), value=pad_token_id)
        positions = torch.cat([positions, torch.arange(total - n, device=positions.device)[None, :]], 1)
    labels = F.pad(ids[0, 1:], (0, 1), value=0)
    per = total // ring.size
    start, end = ring.rank * per, (ring.rank + 1) * per
    cu = F.pad(torch.cumsum(lengths.to(ids.device).long(), 0), (1, 0))  # [S + 1]: [0, l0, l0 + l1, ...]
    if total > int(cu[-1]):  # the padding is one more (dummy) sequence
        cu = torch.cat([cu, cu.new_tensor([total])])
    cu = cu.to(torch.int32)
    inputs = {"input_ids": ids[:, start:end], "position_ids": positions[:, start:end]}
    sl = RingSlice(ring, start, end, total, inputs, labels[start:end], cu)
    if ring.backend == "llama3":
        # ring-flash-attn (API read in the source of zhuzilin/ring-flash-attention 0.1.7):
        # llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal, rank, world_size) ->
        # (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice); needs total % size == 0.
        from ring_flash_attn import llama3_flash_attn_prepare_cu_seqlens

        sl.llama3 = llama3_flash_attn_prepare_cu_seqlens(cu, True, ring.rank, ring.size)
    else:
        lengths = (cu[1:] - cu[:-1]).long()
        seq = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths)  # [N'] sequence
        q, k = torch.arange(start, end, device=ids.device), torch.arange(total, device=ids.device)
        sl.allowed = (seq[q][:, None] == seq[None, :]) & (k[None, :] <= q[:, None])
    _ACTIVE = sl
    return sl


def all_gather_cat(local: torch.Tensor, group, dim: int) -> torch.Tensor:
    """The ring ranks' ``local`` tensors concatenated along ``dim`` in ring order. Autograd-aware: the
    backward sums the gradients every ring rank sends for this rank's piece (see the module docstring for
    why the loss multiplier is then the data-parallel size)."""
    from torch.distributed.nn.functional import all_gather

    # torch 2.13 marks this public autograd all-gather deprecated in favour of the private
    # torch.distributed._functional_collectives; it works (on gloo too), so keep it and silence the note.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        pieces = all_gather(local.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)


def _active(kwargs: dict) -> RingSlice:
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("ring attention does not support sliding-window attention")
    if _ACTIVE is None:
        raise RuntimeError(
            "ring attention was called outside a sliced forward (shard_packed sets its context)"
        )
    return _ACTIVE


# --- the two attention implementations -----------------------------------------------------------------------


def gather_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Exact ring attention: all-gather K/V (``[1, Hkv, n, D]`` -> ``[1, Hkv, N', D]``, autograd-aware) over the
    ring group and run SDPA for the local queries ``[1, H, n, D]`` with the causal, same-sequence mask of
    the global positions. GQA: KV heads are repeated to the query heads. Returns ``[1, n, H, D]``."""
    sl = _active(kwargs)
    k, v = (all_gather_cat(x, sl.ring.group, 2) for x in (key, value))
    rep = query.shape[1] // key.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(
        query, k, v, attn_mask=sl.allowed[None, None], dropout_p=dropout, scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


def llama3_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """ring-flash-attn's ``llama3_flash_attn_varlen_func`` (zhuzilin/ring-flash-attention; API read in the
    source of 0.1.7) on ``[tokens, heads, head_dim]`` tensors. It all-gathers K/V ``heads_k_stride`` KV heads
    at a time and reduce-scatters their gradients; GQA is native to flash-attn. Called directly rather than
    through ``substitute_hf_flash_attn``, which patches a private transformers function whose signature
    changes between versions."""
    from ring_flash_attn import llama3_flash_attn_varlen_func

    sl = _active(kwargs)
    if key.shape[1] % sl.ring.head_stride:
        raise ValueError(
            f"--ds.ring_attn_head_stride {sl.ring.head_stride} must divide the {key.shape[1]} key/value heads"
        )
    cu_q, cu_k, max_q, max_k, k_slice = sl.llama3
    out = llama3_flash_attn_varlen_func(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        cu_q,
        cu_k,
        max_q,
        max_k,
        heads_k_stride=sl.ring.head_stride,
        local_k_slice=k_slice,
        dropout_p=dropout,
        softmax_scale=scaling,
        causal=True,
        group=sl.ring.group,
    )
    return out[None], None
