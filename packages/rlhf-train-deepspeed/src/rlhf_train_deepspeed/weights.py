"""Weights out of a rank's module: full HF-named tensors (ZeRO-3 gathered), LoRA adapters, and the HF export.
Every function here is collective under ZeRO-3: all ranks must call it (and exhaust the iterators)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from rlhf_core import weight_sync
from rlhf_train_deepspeed.models import sequence_classification_architecture

WEIGHT_BUCKET_BYTES = 256 << 20


def is_peft(module: torch.nn.Module) -> bool:
    return hasattr(module, "peft_config")


def named_weights(
    module: torch.nn.Module, bucket_bytes: int = WEIGHT_BUCKET_BYTES, trainable_only: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, full tensor)`` pairs, ZeRO-3 parameters gathered bucket by bucket
    (``deepspeed.zero.GatheredParameters``). With LoRA the adapters are merged into the base weights (names
    without peft's prefixes). ``trainable_only`` leaves out frozen parameters (a frozen vision tower: the
    engines loaded the same weights)."""
    import deepspeed

    if is_peft(module):
        # Merging needs every LoRA pair and its base weight at once: gather the whole model.
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            module.merge_adapter()
            try:
                for name, p in module.named_parameters():
                    if "lora_" in name:
                        continue
                    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
                    yield name, p.data.detach().clone()
            finally:
                module.unmerge_adapter()
        return
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad or not trainable_only]
    bucket, size = [], 0
    for i, (name, p) in enumerate(params):
        bucket.append((name, p))
        size += getattr(p, "ds_numel", p.numel()) * p.element_size()
        if size >= bucket_bytes or i == len(params) - 1:
            with deepspeed.zero.GatheredParameters([p for _, p in bucket]):
                yield from ((n, p.data.detach().clone()) for n, p in bucket)
            bucket, size = [], 0


def gathered_adapters(module: torch.nn.Module):
    import deepspeed

    return deepspeed.zero.GatheredParameters([p for n, p in module.named_parameters() if "lora_" in n])


def adapter_weights(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA policy's adapters in the sync's wire format (:func:`rlhf_core.weight_sync.lora_adapter_tensors`):
    per adapted layer ``<HF layer name>.lora_A`` and ``.lora_B`` (scaling folded in); the frozen base never
    moves. Only the adapters are gathered."""
    with gathered_adapters(module):
        yield from weight_sync.lora_adapter_tensors(module)


def engine_weights(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What a weight sync sends: a LoRA policy's adapters (:func:`adapter_weights`), else every trained
    weight (:func:`named_weights`)."""
    return adapter_weights(module) if is_peft(module) else named_weights(module, trainable_only=True)


def write_hf(
    module: torch.nn.Module,
    rank: int,
    value_model: bool,
    out_dir: str,
    config_updates: dict | None,
    tokenizer_path: str | None,
) -> None:
    """Rank 0 writes ``module`` to ``out_dir`` (safetensors), a LoRA module its PEFT adapter; a value model
    gets the config of a sequence classifier (``AutoModelForSequenceClassification``)."""
    if is_peft(module):
        with gathered_adapters(module):
            if rank == 0:
                module.save_pretrained(out_dir, safe_serialization=True)
    else:
        state = None  # whole CPU tensors: saved from the module as they are (no copy of the model)
        if any(hasattr(p, "ds_id") or p.device.type != "cpu" for p in module.parameters()):
            state = {name: t.cpu() for name, t in named_weights(module) if rank == 0}  # all ranks gather
        if rank == 0:
            config = module.config
            for k, v in (config_updates or {}).items():
                setattr(config, k, v)
            if value_model:
                config.architectures = [sequence_classification_architecture(config)]
                config.num_labels = 1
                config.value_head_prefix = getattr(module, "value_head_prefix", "score")
            module.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
    if rank == 0 and tokenizer_path:
        from transformers import AutoTokenizer

        with contextlib.suppress(OSError, ValueError):  # a model directory without a tokenizer
            AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(out_dir)
    if torch.distributed.is_initialized():
        # NCCL wants the rank's device named, or warns that it guesses it
        nccl = torch.distributed.get_backend() == "nccl"
        torch.distributed.barrier(device_ids=[torch.cuda.current_device()] if nccl else None)
