"""Objects of other roles living in a training rank's process (a rollout engine colocated with the rank on CPU),
by name: built there instead of in a process of their own, they get the rank's weights in process."""

from __future__ import annotations

from typing import Any

import torch

from rlhf_train_deepspeed import weights
from rlhf_train_deepspeed.rank_model import RankModel


class InRankHost(dict):
    """Name -> hosted object."""

    def host(self, model: RankModel | None, name: str, cls: type, *args, **kwargs) -> None:
        """Build ``cls(*args, **kwargs)`` under ``name``. An object that can decode from the rank's parameters
        themselves (``share_weights``: the HF engine) is given them where they are whole fp32 tensors in HF
        layout that the optimizer updates in place (ZeRO-0 with torch's AdamW, no LoRA to merge): one copy of
        the policy in the process instead of two, and no packed decode copies kept through training
        (SmolLM2-135M: 1.1 GB less at the peak)."""
        obj = self[name] = cls(*args, **kwargs)
        if (
            hasattr(obj, "share_weights")
            and model is not None
            and model.spec.trainable
            and model.strategy.ds.zero_stage == 0
            and model.strategy.dtype == torch.float32
            and not model.strategy.ds.adam_offload
            and not weights.is_peft(model.module)
        ):
            obj.share_weights(dict(model.module.named_parameters()))

    def call(self, name: str, method: str, *args, **kwargs) -> Any:
        return getattr(self[name], method)(*args, **kwargs)

    def push_weights(self, model: RankModel, name: str) -> int:
        """Load ``model``'s weights into the object hosted under ``name`` (its ``update_weights``): no broadcast,
        no object store. Collective under ZeRO-3: every rank calls it, and ranks that host nothing only take
        part in the gathers. A LoRA policy's engine gets only the adapters. Returns the number of tensors."""
        target = self.get(name)
        module = model.module
        # it decodes from our parameters: nothing to copy (pointed at them again, should they have been replaced)
        if getattr(target, "borrowed", False) and target.share_weights(dict(module.named_parameters())):
            return 0
        loaded = dict(
            weights.adapter_weights(module) if weights.is_peft(module) else weights.named_weights(module)
        )
        if target is None:
            return 0
        target.update_weights(loaded)
        return len(loaded)
