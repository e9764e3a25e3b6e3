"""Methods vLLM mixes into each of its workers (``LLM(worker_extension_cls=...)``), called on every worker by
:class:`rlhf_rollout_vllm.engine.VLLMEngine` with ``llm.collective_rpc``. They rely only on what vLLM's worker
provides (``self.rank``, ``self.device``, ``self.model_runner``); this module does not import vLLM. How weights
load on CPU and on GPU, tied embeddings and LoRA adapters: the package README ("CPU and GPU: what differs")."""

from __future__ import annotations

import collections
import io
import itertools
import json
from collections.abc import Iterable
from pathlib import Path

import torch

from rlhf_core.weight_sync import init_sync_group, is_adapter, lora_pairs


def save_peft_adapter(pairs: Iterable[tuple[str, torch.Tensor]], out_dir: str) -> int:
    """Write adapter pairs (``<layer>.lora_A``/``.lora_B``, scaling folded into B) to ``out_dir`` as a PEFT LoRA
    adapter that vLLM loads: ``adapter_model.safetensors`` under peft's names and ``adapter_config.json`` with
    ``lora_alpha = r`` (scaling 1, since B already carries it). Returns the number of tensors written."""
    from safetensors.torch import save_file

    tensors, targets, rank = {}, set(), 0
    for layer, lora_a, lora_b in lora_pairs(pairs):
        if lora_a.dim() != 2 or layer.endswith(".weight"):  # a fused expert stack, a router's weight
            raise ValueError(
                f"{layer}: the vllm engine serves LoRA adapters of linear layers only, this adapts a parameter "
                "(experts or a router: use the hf engine, which merges them)"
            )
        tensors[f"base_model.model.{layer}.lora_A.weight"] = lora_a.contiguous()
        tensors[f"base_model.model.{layer}.lora_B.weight"] = lora_b.contiguous()
        targets.add(layer.rsplit(".", 1)[-1])
        rank = lora_a.shape[0]
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(Path(out_dir) / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": rank,
        "target_modules": sorted(targets),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
    }
    (Path(out_dir) / "adapter_config.json").write_text(json.dumps(config))
    return len(tensors)


def reprocess_tied_layers(model: torch.nn.Module) -> int:
    """Run ``quant_method.process_weights_after_loading`` again on every layer whose ``weight`` parameter is
    shared with another layer; returns how many were processed. With tied embeddings the trainer sends only
    ``embed_tokens.weight`` and vLLM skips ``lm_head.*``, so the LM head receives nothing. Where it reads the
    shared parameter (CUDA) that is enough; where it reads a copy made at load time (the CPU build packs the
    head's weight for oneDNN), the head would keep the first weights for good. Processing again repacks from
    the shared, updated parameter."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            owners.setdefault(id(weight), []).append(module)
    shared = [
        m
        for modules in owners.values()
        if len(modules) > 1
        for m in modules
        if hasattr(getattr(m, "quant_method", None), "process_weights_after_loading")
    ]
    for module in shared:
        module.quant_method.process_weights_after_loading(module)
    return len(shared)


class WeightSyncWorkerExtension:
    def rlhf_load(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], adapter_dir: str | None = None
    ) -> bool:
        """Load ``(HF name, tensor)`` pairs, consumed as they come (one sync bucket in memory). LoRA adapter
        pairs are written to ``adapter_dir`` instead (by the worker of rank 0; all workers load it when the
        engine adds the adapter). Returns whether they were adapters."""
        named_tensors = iter(named_tensors)
        first = next(named_tensors, None)
        if first is None:
            return False
        named_tensors = itertools.chain([first], named_tensors)
        if is_adapter(first[0]):
            if adapter_dir is None:
                raise RuntimeError("a LoRA adapter arrived at a vLLM engine built without LoRA (lora_rank=0)")
            if self.rank == 0:
                save_peft_adapter(named_tensors, adapter_dir)
            collections.deque(named_tensors, maxlen=0)  # the stream must be consumed to its end
            return True
        runner = self.model_runner
        if getattr(self.device, "type", "cpu") == "cpu":
            runner.reload_weights(weights_iterator=iter(named_tensors))
        else:
            runner.model.load_weights(weights=named_tensors)  # also shards them for tensor parallelism
        reprocess_tied_layers(runner.model)
        return False

    def rlhf_init_weight_sync(
        self,
        master_addr: str,
        master_port: int,
        first_rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
    ) -> None:
        """Join the weight-sync group as rank ``first_rank + self.rank`` (gloo groups go through CPU), leaving the
        one joined before (a new group replaces one that held a dead engine)."""
        self.rlhf_close_weight_sync()
        device = self.device if backend == "nccl" else torch.device("cpu")
        self.rlhf_sync_group = init_sync_group(
            master_addr, master_port, first_rank + self.rank, world_size, backend, timeout_s, device=device
        )

    def rlhf_receive_weights(self, adapter_dir: str | None = None) -> bool:
        """Receive one broadcast from rank 0, loading tensors as they arrive (see :meth:`rlhf_load`)."""
        group = getattr(self, "rlhf_sync_group", None)
        if group is None:
            raise RuntimeError("receive_weights before init_weight_sync")
        return self.rlhf_load(group.receive(), adapter_dir)

    def rlhf_load_weights(
        self, named_tensors: list[tuple[str, torch.Tensor]] | bytes, adapter_dir: str | None = None
    ) -> bool:
        """``(name, tensor)`` pairs, or their ``torch.save`` bytes when they crossed a process boundary."""
        if isinstance(named_tensors, bytes):
            named_tensors = torch.load(io.BytesIO(named_tensors), weights_only=True)
        return self.rlhf_load(named_tensors, adapter_dir)

    def rlhf_close_weight_sync(self) -> None:
        group = getattr(self, "rlhf_sync_group", None)
        if group is not None:
            group.close()
            self.rlhf_sync_group = None
