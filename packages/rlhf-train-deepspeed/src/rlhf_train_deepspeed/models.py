"""Models the backend trains and queries: causal LMs (policy, reference), whose response log-probs
:func:`response_logprobs` gives, and value models (critic, reward model: :func:`value_model_class`). What
they compute, the value head's name and export, and packing are described in this package's README; a
packed micro-batch (:func:`model_inputs`) has no attention mask, so transformers builds a block-diagonal
causal one."""

from __future__ import annotations

import torch
from torch import nn

from rlhf_algos.logits import head_logprobs
from rlhf_core.batches import PRMBatch, SequenceBatch, to_device
from rlhf_core.memory import release_free_heap
from rlhf_core.vision import image_forward_inputs
from rlhf_train_deepspeed import ring_attn, shared_prefix

# --- forward passes ------------------------------------------------------------------------------------


def model_inputs(batch: SequenceBatch, packing: bool) -> tuple[dict, torch.Tensor]:
    """The keyword arguments of the forward pass, and ``[B]`` offsets of each row in the flattened output.
    Padded: ``input_ids [B, L]`` with the attention mask; row ``i`` starts at ``i * L``. Packed: one row of
    ``sum(lengths)`` tokens with ``position_ids`` restarting per sequence and no attention mask."""
    lengths = batch.attention_mask.sum(-1)
    if not packing:
        offsets = torch.arange(len(batch), device=lengths.device) * batch.input_ids.shape[1]
        return {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}, offsets
    ids = batch.input_ids[batch.attention_mask.bool()][None, :]
    positions = torch.cat([torch.arange(int(n), device=ids.device) for n in lengths])[None, :]
    offsets = torch.cumsum(lengths, 0) - lengths
    return {"input_ids": ids, "position_ids": positions}, offsets


def response_positions(batch: SequenceBatch, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices ``[B, T]`` of the outputs that predict each response token, and the ``[B, T]`` mask.
    Response token ``t`` of row ``i`` (token ``p_i + t``) is predicted at position ``p_i + t - 1``. Masked
    entries point at index 0 so they can be gathered safely."""
    t = torch.arange(batch.num_response_positions, device=offsets.device)
    mask = batch.response_mask().to(offsets.device)
    pos = offsets[:, None] + batch.prompt_lens[:, None].to(offsets.device) - 1 + t[None, :]
    return torch.where(mask, pos, torch.zeros_like(pos)), mask


def response_logprobs(
    model: nn.Module,
    batch: SequenceBatch,
    temperature: float = 1.0,
    packing: bool = False,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    ring: ring_attn.RingGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Log-probs (and entropies) of the response tokens under ``softmax(logits / temperature)``, ``[B, T]``
    each and zero where masked, and the ``[B, T]`` mask. A temperature of 0 (greedy) is treated as 1.

    The model runs up to its LM head's input (:func:`head_inputs`); the head then runs on the real response
    positions only, a chunk at a time (:func:`rlhf_algos.logits.head_logprobs`), so no more than one
    chunk's logits exist at once, in forward or backward. With ``entropy_grad=False`` the entropy is a
    detached diagnostic. With ``ring`` (packing only) see :func:`_ring_logprobs`."""
    kwargs, offsets = model_inputs(batch, packing)
    pos, mask = response_positions(batch, offsets)
    if batch.images is not None:
        if packing or ring is not None:
            raise ValueError(
                "a batch with images is not packed (images are per row): drop --ds.packing_samples"
            )
        kwargs.update(image_forward_inputs(model, batch.input_ids, batch.attention_mask, batch.images)[0])
    if ring is not None:
        lp, ent = _ring_logprobs(model, kwargs, batch, pos, mask, temperature, with_entropy, ring)
    else:
        targets = kwargs["input_ids"].reshape(-1)[pos + 1][mask]
        layout = None
        if not packing and shared_prefix.enabled(model):
            layout = shared_prefix.plan(
                batch.input_ids.cpu(), batch.attention_mask.cpu(), batch.prompt_lens.cpu()
            )
        if (
            layout is not None
        ):  # one packed row: a prompt once for its samples, no padding (see shared_prefix)
            layout = to_device(layout, targets.device)
            hidden = head_inputs(model, shared_prefix.forward_inputs(layout), layout.columns)  # [1, K, H]
            rows = layout.logit_rows[mask]
        else:
            # Only the columns from the first one that predicts a response token (the shortest prompt's)
            # reach the head's input, as TRL keeps logits: the prompt columns need no head.
            width = kwargs["input_ids"].shape[1]
            cols = pos % width
            first = int(cols[mask].min()) if bool(mask.any()) else 0
            keep = width - first
            hidden = head_inputs(model, kwargs, keep)  # [rows, keep, H]
            rows = ((pos // width) * keep + cols - first)[mask]
        hidden = hidden.reshape(-1, hidden.shape[-1])[rows]  # [M, H]: the M real response positions
        lp, ent = _head_logprobs(model, hidden, targets, temperature, with_entropy)
    lp = lp.new_zeros(mask.shape).index_put((mask,), lp)
    if ent is not None:
        ent = ent.new_zeros(mask.shape).index_put((mask,), ent if entropy_grad else ent.detach())
    return lp, ent, mask


def head_inputs(model: nn.Module, kwargs: dict, logits_to_keep) -> torch.Tensor:
    """The LM head's input at the kept columns, ``[rows, K, H]``: the causal LM's forward with
    ``logits_to_keep`` (a count of last columns, or a ``[K]`` index tensor), whose head is handed an empty
    slice of it instead (a forward pre-hook), so the forward builds no logits. Going through the model's
    own forward keeps what wraps it working: DeepSpeed (ZeRO-3 gathers the head's weight in its hooks), PEFT,
    vision-language inputs, the shared-prompt attention."""
    head = getattr(
        model, "module", model
    ).get_output_embeddings()  # a DeepSpeed engine's model; PEFT forwards
    captured = []

    def take(module, args):
        captured.append(args[0])
        return (args[0][..., :0, :],)

    handle = head.register_forward_pre_hook(take)
    try:
        model(**kwargs, use_cache=False, logits_to_keep=logits_to_keep)
    finally:
        handle.remove()
    return captured[0]


def _head_logprobs(model, hidden, labels, temperature, with_entropy):
    """:func:`rlhf_algos.logits.head_logprobs` with ``model``'s LM head and the scaling some architectures
    apply to its output in their forward (``logit_scale``: Cohere; ``logits_scaling``: Granite;
    ``final_logit_softcapping``: Gemma 2/3), as their ``*ForCausalLM`` forward does."""
    inner = getattr(model, "module", model)  # a DeepSpeed engine's model
    config = inner.config.get_text_config()
    head, embedding = inner.get_output_embeddings(), inner.get_input_embeddings()
    multiplier = getattr(config, "logit_scale", None) or 1.0
    if getattr(config, "logits_scaling", None):
        multiplier = 1.0 / config.logits_scaling
    cap = getattr(config, "final_logit_softcapping", None)
    # a trained head tied to the input embedding, whole (not a ZeRO-3 partition, gathered only in its forward)
    tied = (
        isinstance(head, nn.Linear)
        and head.bias is None
        and head.weight is getattr(embedding, "weight", None)
        and head.weight.requires_grad
        and not hasattr(head.weight, "ds_id")
    )

    into_grad = tied and getattr(embedding, "accumulates_into_grad", False)

    def logits(h: torch.Tensor) -> torch.Tensor:
        z = _TiedHead.apply(h, head.weight, into_grad) if tied and torch.is_grad_enabled() else head(h)
        if multiplier != 1.0:
            z = z * multiplier
        if cap:
            z = torch.tanh(z.float() / cap) * cap
        return z

    if torch.is_grad_enabled() and hidden.device.type == "cpu":
        # a CPU training step peaks here, activations all saved: the heap's holes (the forward's freed
        # temporaries, kept resident by keep_freed_memory) need not stay on top of them and the logits
        release_free_heap()
    # a frozen ZeRO-3 head (LoRA) is gathered only while its module runs: see head_logprobs(reentrant=)
    frozen_zero3 = any(hasattr(p, "ds_id") and not p.requires_grad for p in head.parameters())
    return head_logprobs(logits, hidden, labels, config.vocab_size, temperature, with_entropy, frozen_zero3)


class _TiedHead(torch.autograd.Function):
    """``h @ W^T`` (``[n, H]`` and ``[V, H]`` -> ``[n, V]``), nn.Linear without bias, whose backward returns W's
    gradient as a new ``[V, H]`` tensor. Linear's is a transposed view, and autograd cannot add a tied input
    embedding's gradient to a view in place: it allocates their sum, one more ``[V, H]`` at the end of each
    backward (108 MiB for SmolLM2). Same kernels, so the same numbers.

    ``into_grad`` (the embedding accumulates into ``W.grad`` too: :func:`accumulate_tied_gradient_in_place`):
    the gradient is added into ``W.grad`` here and none goes through autograd, so no ``[V, H]`` is held from
    the start of backward, when the head's gradient arrives, to its end, when the embedding's does."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, into_grad: bool = False) -> torch.Tensor:
        ctx.save_for_backward(h, weight)
        ctx.into_grad = into_grad
        return nn.functional.linear(h, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, weight = ctx.saved_tensors
        grad_h = grad @ weight if ctx.needs_input_grad[0] else None
        if not ctx.into_grad:
            return grad_h, grad.t() @ h, None
        if weight.grad is None:
            weight.grad = grad.t() @ h
        else:
            weight.grad.addmm_(grad.t(), h)
        return grad_h, None, None


class _EmbeddingIntoGrad(torch.autograd.Function):
    """``W[ids]`` (``[...]`` ids and ``[V, H]`` -> ``[..., H]``) whose backward adds the rows' gradients into
    ``W.grad`` (``index_add_``; ids equal to ``padding_idx`` add nothing, as nn.Embedding) instead of returning
    a zero-filled ``[V, H]`` for autograd to add there."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        weight, ids, rows = ctx.weight, ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:
            keep = ids != ctx.padding_idx
            ids, rows = ids[keep], rows[keep]
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, ids, rows.to(weight.dtype))
        return None, None, None


def accumulate_tied_gradient_in_place(model: nn.Module) -> bool:
    """Have a causal LM whose trained LM head is tied to its input embedding add that weight's gradient
    straight into ``.grad`` from both places (:class:`_TiedHead`, :class:`_EmbeddingIntoGrad`). Through
    autograd the two ``[V, H]`` gradients, the head's and the embedding's zero-filled one, meet in a buffer
    before ``.grad``: on SmolLM2-135M two 108 MiB tensors at the end of every backward, the step's peak.

    Only for a plain ``.grad`` (the caller's to know: ZeRO-0 in fp32, where DeepSpeed reads ``.grad`` at the
    step and registers no gradient hooks); a weight with hooks, or an embedding with ``max_norm``,
    ``scale_grad_by_freq`` or ``sparse``, is left as it is. Returns whether the model was changed."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    weight = getattr(embedding, "weight", None)
    if not (
        isinstance(head, nn.Linear)
        and head.bias is None
        and type(embedding) is nn.Embedding
        and head.weight is weight
        and weight.requires_grad
        and not hasattr(weight, "ds_id")
        and embedding.max_norm is None
        and not embedding.scale_grad_by_freq
        and not embedding.sparse
        and not weight._backward_hooks
        and weight._post_accumulate_grad_hooks is None
    ):
        return False

    def forward(ids: torch.Tensor) -> torch.Tensor:
        fn = _EmbeddingIntoGrad.apply if torch.is_grad_enabled() else nn.functional.embedding
        return fn(ids, embedding.weight, embedding.padding_idx)

    embedding.forward = forward
    embedding.accumulates_into_grad = True
    return True


def response_logits(model: nn.Module, batch: SequenceBatch, packing: bool = False):
    """The full logits that predict each response token, ``[B, T, V]`` (garbage where masked), the ``[B, T]``
    response tokens and the ``[B, T]`` mask: what distillation compares with a teacher's."""
    kwargs, offsets = model_inputs(batch, packing)
    pos, mask = response_positions(batch, offsets)
    logits = model(**kwargs, use_cache=False).logits
    targets = kwargs["input_ids"].reshape(-1)[pos + 1]
    return logits.reshape(-1, logits.shape[-1])[pos], targets, mask


def step_logits(model: nn.Module, batch: PRMBatch, packing: bool = False) -> torch.Tensor:
    """``[N, V]`` logits *at* the ``N`` step markers of a PRM micro-batch (each predicts the token after its
    marker), padded or packed."""
    kwargs, offsets = model_inputs(batch.seq, packing)
    logits = model(**kwargs, use_cache=False).logits
    return logits.reshape(-1, logits.shape[-1])[offsets[batch.rows] + batch.cols]


def _ring_logprobs(model, kwargs, batch, pos, mask, temperature, with_entropy, ring):
    """``[M]`` log-probs (and entropies, else None) of the ``M`` real response positions, this rank running its
    ring slice only: the head's results for its tokens that predict a response token (labels from the full
    packed row) are all-gathered over the ring into ``[N']`` and read at ``pos[mask]``."""
    sl = ring_attn.shard_packed(kwargs, batch.attention_mask.sum(-1), ring)
    wanted = torch.zeros(sl.total, dtype=torch.bool, device=pos.device)
    wanted[pos[mask]] = True
    rows = wanted[sl.start : sl.end].nonzero().squeeze(-1)
    hidden = head_inputs(model, sl.inputs, rows)[0]  # [r, H]
    lp, ent = _head_logprobs(model, hidden, sl.labels[rows], temperature, with_entropy)

    def whole_row(x: torch.Tensor) -> torch.Tensor:
        local = x.new_zeros(sl.end - sl.start).index_put((rows,), x)
        return ring_attn.all_gather_cat(local, ring.group, 0)[pos[mask]]

    return whole_row(lp), None if ent is None else whole_row(ent)


def token_values(
    model: nn.Module, batch: SequenceBatch, packing: bool, ring=None
) -> tuple[torch.Tensor, ...]:
    """Value-head output for every token of the flattened model input (``[B * L]`` padded, ``[N]`` packed),
    and the ``[B]`` row offsets in it (:func:`model_inputs`); with ``ring`` this rank runs its slice and the
    values are all-gathered (``[N']``, padding at the end)."""
    kwargs, offsets = model_inputs(batch, packing)
    if ring is None:
        return model(**kwargs).reshape(-1).float(), offsets
    sl = ring_attn.shard_packed(kwargs, batch.attention_mask.sum(-1), ring)
    return ring_attn.all_gather_cat(model(**sl.inputs).reshape(-1).float(), ring.group, 0), offsets


def response_values(
    model: nn.Module, batch: SequenceBatch, packing: bool = False, ring: ring_attn.RingGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Critic values of the state before each response token, ``[B, T]`` (zero where masked), and the mask."""
    layout = None
    if ring is None and not packing and shared_prefix.enabled(model):  # as response_logprobs
        layout = shared_prefix.plan(
            batch.input_ids.cpu(), batch.attention_mask.cpu(), batch.prompt_lens.cpu()
        )
    if layout is not None:
        layout = to_device(layout, batch.input_ids.device)
        values = model(**shared_prefix.forward_inputs(layout)).reshape(-1).float()[layout.columns]
        mask = batch.response_mask()
        return values[layout.logit_rows] * mask, mask
    values, offsets = token_values(model, batch, packing, ring)
    pos, mask = response_positions(batch, offsets)
    return values[pos] * mask, mask


def sequence_rewards(
    model: nn.Module, batch: SequenceBatch, packing: bool = False, ring: ring_attn.RingGroup | None = None
) -> torch.Tensor:
    """``[B]`` value-head output at the last non-pad token of each sequence."""
    values, offsets = token_values(model, batch, packing, ring)
    return values[offsets + batch.attention_mask.sum(-1).to(offsets.device) - 1]


# --- value models ----------------------------------------------------------------------------------------


def value_model_class(config, head_prefix: str = "score") -> type:
    """A ``PreTrainedModel`` class: the base transformer of ``config``'s architecture plus a linear value
    head named ``head_prefix``. Its ``forward`` returns per-token values ``[B, L]`` (fp32 head input).

    Parameter names are ``<base_model_prefix>.*`` and ``<head_prefix>.weight``, the layout of
    ``*ForSequenceClassification`` with ``num_labels=1`` when the prefix is ``score``."""
    from transformers import AutoModel

    base_cls = AutoModel._model_mapping[type(config)]
    pretrained_cls = next(c for c in base_cls.__mro__[1:] if c.__name__.endswith("PreTrainedModel"))

    class ValueModel(pretrained_cls):
        value_head_prefix = head_prefix

        def __init__(self, config):
            super().__init__(config)
            setattr(self, self.base_model_prefix, base_cls(config))
            setattr(self, head_prefix, nn.Linear(config.hidden_size, 1, bias=False))
            self.post_init()

        def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
            base = getattr(self, self.base_model_prefix)
            hidden = base(  # kwargs: the attention's (a shared-prompt layout)
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
                **kwargs,
            )
            return getattr(self, head_prefix)(hidden.last_hidden_state).squeeze(-1)

    ValueModel.__name__ = ValueModel.__qualname__ = f"{base_cls.__name__}WithValueHead"
    return ValueModel


def sequence_classification_architecture(config) -> str:
    """The ``*ForSequenceClassification`` class name of ``config``'s model type (for ``architectures``)."""
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification._model_mapping[type(config)].__name__


def normalize_rewards(rewards: torch.Tensor, config) -> torch.Tensor:
    """``(r - mean) / std`` with the statistics stored in an RM's config; unchanged when it has none."""
    mean, std = getattr(config, "mean", None), getattr(config, "std", None)
    if mean is None or std is None:
        return rewards
    return (rewards - mean) / max(float(std), 1e-8)


# --- loading ---------------------------------------------------------------------------------------------


def load_causal_lm(path: str, dtype: torch.dtype, attn_implementation: str = "sdpa", **kwargs):
    """The generating model at ``path`` with the training dtype and attention implementation:
    ``AutoModelForCausalLM``, or ``AutoModelForImageTextToText`` for a vision-language model (see
    ``rlhf_core.vision.load_model``)."""
    from rlhf_core.vision import load_model

    return load_model(path, dtype=dtype, attn_implementation=attn_implementation, **kwargs)


def load_value_model(
    path: str, dtype: torch.dtype, attn_implementation: str = "sdpa", head_prefix: str = "score", **kwargs
):
    """A value model (:func:`value_model_class`) from a causal LM, a base model or a saved RM / critic. A
    checkpoint without the head (a causal LM) gets a freshly initialised head; one with it (an RM trained
    here, or any ``*ForSequenceClassification`` with one label and the same head name) keeps it."""
    from transformers import AutoConfig

    cls = value_model_class(AutoConfig.from_pretrained(path), head_prefix)
    return cls.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation, **kwargs)
