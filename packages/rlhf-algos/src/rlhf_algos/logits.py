"""Per-token quantities from model logits: the log-prob of the taken token, and the entropy."""

from __future__ import annotations

import torch
import torch.utils.checkpoint


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[label]``: ``[B, T, V]`` logits and ``[B, T]`` labels -> ``[B, T]`` float32.

    Computed as ``logits[label] - logsumexp(logits)`` in float32, without materialising the full
    log-softmax. Divide ``logits`` by the sampling temperature first, so the result is comparable with the
    engine's log-probs.
    """
    logits = logits.float()
    picked = logits.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per position: ``[B, T, V] -> [B, T]`` float32, differentiable.

    ``H = logsumexp(z) - sum_v softmax(z)_v z_v``, which equals ``-sum p log p`` and stays finite when some
    probabilities underflow to 0 (where ``p log p`` would give ``0 * -inf``). Logits must be finite.
    """
    z = logits.float()
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)


def logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`logprobs_from_logits` and :func:`entropy_from_logits` in one pass: ``[B, T, V]`` logits and
    ``[B, T]`` labels -> two ``[B, T]`` float32 tensors, both differentiable.

    With ``p = softmax(z)`` and ``lse = logsumexp(z)``: ``logp = z[label] - lse`` and
    ``H = lse - sum_v p_v z_v``. One exponential over the vocabulary instead of three in forward, one more in
    backward: ``dlogp/dz = onehot(label) - p`` and ``dH/dz = -p (z - lse + H)``, with ``p = exp(z - lse)``
    recomputed rather than kept, so that only the float32 logits stay saved between forward and backward.
    """
    return _LogprobsAndEntropy.apply(logits, labels.long())


class _LogprobsAndEntropy(torch.autograd.Function):
    """:func:`logprobs_and_entropy` in at most two float32 ``[..., V]`` buffers besides the float32 logits, the
    only ``[..., V]`` tensor saved for backward (the last chunk of :func:`head_logprobs` is the peak of a CPU
    training step's memory)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor):
        z = logits.float()
        m = z.amax(-1, keepdim=True)
        e = z - m
        e.exp_()
        total = e.sum(-1, keepdim=True)
        lse = m + total.log()
        logp = z.gather(-1, labels.unsqueeze(-1)) - lse
        # sum_v p_v z_v = sum_v e_v z_v / total, multiplied into e, which nothing needs after it: (p * z).sum(-1)
        # would be a third [..., V] (and on [256, 49152] fp32, 2 threads, is 2-3x slower)
        entropy = lse - e.mul_(z).sum(-1, keepdim=True) / total
        ctx.set_materialize_grads(False)  # an unused (e.g. detached) entropy costs nothing in backward
        ctx.save_for_backward(z, labels, lse, entropy)
        ctx.logits_dtype = logits.dtype
        return logp.squeeze(-1), entropy.squeeze(-1)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        z, labels, lse, entropy = ctx.saved_tensors
        p = (z - lse).exp_()
        grad = None
        if grad_entropy is not None:  # -ge p (z - lse + H), built in place in a second buffer
            grad = (z - lse).add_(entropy).mul_(p).mul_(-grad_entropy.unsqueeze(-1))
        if grad_logp is not None:  # -g p, then g at the label
            g = grad_logp.unsqueeze(-1)
            grad = p.mul_(-g) if grad is None else grad.addcmul_(p, g, value=-1)
            grad.scatter_add_(-1, labels.unsqueeze(-1), g)
        del p  # before a bf16 copy of the gradient is made
        return None if grad is None else grad.to(ctx.logits_dtype), None


CHUNK_BYTES = 64 << 20
"""Float32 logits one chunk of :func:`head_logprobs` may hold: a few buffers of this size (logits, probabilities,
their gradient) are small beside the weights of any model whose vocabulary needs chunks, while ``64 MiB / (4 V)``
rows keep each ``[rows, H] @ [H, V]`` product at full matmul speed. Above glibc's 32 MiB mmap threshold
(``rlhf_core.memory.keep_freed_memory``), so that a freed chunk goes back to the OS instead of staying resident."""


def head_logprobs(
    head,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    reentrant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels`` (and entropies) under ``softmax(head(hidden) / temperature)``, never holding
    the logits of more than :data:`CHUNK_BYTES` at once: ``[N, H]`` hidden states and ``[N]`` labels ->
    ``[N]`` float32 (and ``[N]`` or None), differentiable in ``hidden`` and ``head``'s parameters.

    ``head`` maps ``[n, H]`` to ``[n, V]`` logits (the LM head, with any scaling the model applies after it).
    Each chunk of ``CHUNK_BYTES // (4 V)`` rows runs the head, :func:`logprobs_from_logits` or
    :func:`logprobs_and_entropy` and drops its logits; under autograd every chunk but the last is
    checkpointed, so backward recomputes its logits rather than keeping all of them (its head matmul runs
    twice, as with activation checkpointing). The last chunk keeps its logits: backward reaches it first, before
    any recomputation, so they add nothing to the peak and a micro-batch that fits one chunk runs its head
    once. A temperature of 0 (greedy) is treated as 1.

    ``reentrant``: recompute through the reentrant checkpoint, for a ``head`` whose weight is present only while
    its module runs (a frozen LM head partitioned by ZeRO-3, as under LoRA): DeepSpeed gathers it again when
    backward reaches the module, while the non-reentrant checkpoint checks the recomputed tensors before that
    and raises ``CheckpointError``. Same numbers either way.
    """
    scale = temperature if temperature > 0 else 1.0

    def chunk(h: torch.Tensor, y: torch.Tensor):
        z = head(h).float()
        if scale != 1.0:
            z = z / scale
        if with_entropy:
            return logprobs_and_entropy(z, y)
        return logprobs_from_logits(z, y), None

    rows = max(1, CHUNK_BYTES // (4 * vocab_size))
    chunks = list(zip(hidden.split(rows), labels.split(rows), strict=True))
    recompute = torch.is_grad_enabled()
    out = [
        torch.utils.checkpoint.checkpoint(chunk, h, y, use_reentrant=reentrant)
        if recompute and i < len(chunks) - 1
        else chunk(h, y)
        for i, (h, y) in enumerate(chunks)
    ]
    lp = torch.cat([o[0] for o in out])  # split gives at least one (maybe empty) chunk
    return lp, torch.cat([o[1] for o in out]) if with_entropy else None
