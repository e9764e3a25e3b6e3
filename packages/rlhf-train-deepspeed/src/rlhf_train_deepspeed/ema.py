"""The policy EMA (``--train.enable_ema``): an fp32 average of one rank's local shards of the trained weights."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch


@torch.no_grad()
def ema_update_(ema: list[torch.Tensor], params: list[torch.Tensor], beta: float) -> None:
    """In place, for every pair: ``ema_i = beta * ema_i + (1 - beta) * params_i``.

    ``ema_i`` is float32 with the shape of ``params_i`` (any shape: here one rank's local shard of a trainable
    parameter, the flat ``p.ds_tensor`` slice under ZeRO-3 or ``p.data`` under ZeRO 0-2). ``params_i`` may be
    bf16 or live on another device; it is upcast to float32 on ``ema_i``'s device. Under bf16 the average is
    over the bf16 module weights (what an export writes), not the optimizer's fp32 master weights."""
    if len(ema) != len(params):
        raise ValueError(f"ema_update_: {len(ema)} EMA tensors for {len(params)} parameters")
    for e, p in zip(ema, params, strict=True):
        e.mul_(beta).add_(p.to(device=e.device, dtype=torch.float32), alpha=1.0 - beta)


def local_shards(module: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's part of every trainable parameter: the flat ZeRO-3 partition ``p.ds_tensor`` (a view
    into the optimizer's flat buffer, updated in place by each step), else the whole ``p.data``."""
    return [getattr(p, "ds_tensor", p.data) for p in module.parameters() if p.requires_grad]


class EMA:
    """The EMA of ``engine``'s trainable weights with decay ``beta``, starting at the current weights."""

    def __init__(self, engine, beta: float):
        self.engine, self.beta = engine, beta
        self.shards = [s.detach().to(torch.float32, copy=True) for s in local_shards(engine.module)]

    def update(self) -> None:
        """After an applied optimizer step."""
        ema_update_(self.shards, local_shards(self.engine.module), self.beta)

    def to(self, device: str | None) -> None:
        """To ``device`` (``cpu`` while a hybrid engine sleeps); None: back beside the weights."""
        targets = [device or s.device for s in local_shards(self.engine.module)]
        self.shards = [e.to(d) for e, d in zip(self.shards, targets, strict=True)]

    def save(self, ema_file: Path) -> None:
        torch.save([e.cpu() for e in self.shards], ema_file)

    def load(self, ema_file: Path, warn: bool) -> None:
        """The shards saved in ``ema_file``; a checkpoint without them restarts from the loaded weights."""
        shards = local_shards(self.engine.module)
        if not ema_file.exists():
            self.shards = [s.detach().to(torch.float32, copy=True) for s in shards]
            if warn:
                print(
                    f"warning: {ema_file.parent} has no EMA (a run without --train.enable_ema?): "
                    "the EMA starts again from the loaded weights",
                    flush=True,
                )
            return
        saved = torch.load(ema_file, weights_only=True)
        if [tuple(e.shape) for e in saved] != [tuple(s.shape) for s in shards]:
            raise ValueError(
                f"{ema_file}: the saved EMA shards do not fit this model's local shards (a "
                "checkpoint of another model, LoRA setting, number of ranks or ZeRO stage?)"
            )
        self.shards = [e.to(device=s.device, dtype=torch.float32) for e, s in zip(saved, shards, strict=True)]

    @contextlib.contextmanager
    def swapped_in(self):
        """Within the block the model holds the EMA weights; the trained weights are restored bitwise after
        it, also when it raises. Entering is collective under ZeRO-3, leaving is local."""
        module = self.engine.module
        shards = local_shards(module)
        trained = [s.clone() for s in shards]
        optimizer = self.engine.optimizer
        zero3 = hasattr(optimizer, "checkpoint_event_prologue")
        # ZeRO-3 keeps small "persistent" parameters gathered between steps: partition everything so that
        # the shards are the only copy, and re-gather the persistent ones (now EMA) afterwards. Their full
        # trained values are kept so that restoring needs no collective.
        persistent = [p for p in module.parameters() if p.requires_grad and getattr(p, "ds_persist", False)]
        trained_full = [p.data.clone() if p.data.numel() else None for p in persistent]
        if zero3:
            optimizer.checkpoint_event_prologue()
        try:
            for s, e in zip(shards, self.shards, strict=True):
                s.copy_(e)
            if zero3:
                optimizer.checkpoint_event_epilogue()
            yield
        finally:
            for s, t in zip(shards, trained, strict=True):
                s.copy_(t)
            if zero3:
                optimizer.invalidate_secondary_tensor()  # hpZ copies of the EMA shards
                for p, full in zip(persistent, trained_full, strict=True):
                    if p.data.numel() and full is not None:  # still gathered: holds the EMA in full
                        p.data.copy_(full)
