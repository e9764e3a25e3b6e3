"""Mixture-of-experts routers as transformers defines them, for the rollout engine (which records the experts
each token was routed to) and the trainer (which replays them: router replay). A router is a module that
transformers records as ``router_logits`` for ``output_router_logits=True``; the top-k routers of Mixtral,
Qwen2-MoE, Qwen3-MoE and their kin return ``(logits [N, E], scores [N, k], indices [N, k])``. See docs/moe.md."""

from __future__ import annotations

import torch
from torch import nn


def router_recorder(model: nn.Module):
    """The ``OutputRecorder`` transformers uses for ``model``'s router logits, or None for a dense model."""
    for module in model.modules():
        recorder = (getattr(module, "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None:
            return recorder
    return None


def routers(model: nn.Module, recorder) -> list[nn.Module]:
    """The router of each MoE layer, in layer order."""
    suffix = recorder.layer_name or ""
    return [
        m
        for name, m in model.named_modules()
        if isinstance(m, recorder.target_class) and name.endswith(suffix)
    ]


class ExpertRecorder:
    """Forward hooks that keep the experts each router picked in the last forward; :meth:`take` returns them
    as ``[layers, N, k]`` (``N`` the forward's flattened tokens). ``attach`` returns None for a dense model."""

    def __init__(self, layers: list[nn.Module]):
        self.picked: list[torch.Tensor | None] = [None] * len(layers)
        for i, router in enumerate(layers):
            router.register_forward_hook(self._keep(i))

    @classmethod
    def attach(cls, model: nn.Module) -> ExpertRecorder | None:
        recorder = router_recorder(model)
        return None if recorder is None else cls(routers(model, recorder))

    def _keep(self, i: int):
        def hook(module, args, output):
            self.picked[i] = output[-1]

        return hook

    def take(self) -> torch.Tensor:
        picked, self.picked = self.picked, [None] * len(self.picked)
        return torch.stack(picked)


def replay_rows(experts: list[torch.Tensor], lengths: list[int], width: int | None) -> torch.Tensor:
    """Per-sequence routed experts ``[T_i, layers, k]`` (-1: none recorded) laid out as a forward's router rows,
    ``[layers, N, k]``: padded rows of ``width`` columns (``N = B * width``, -1 on padding), or packed
    (``width`` None: ``N = sum(lengths)``)."""
    layers, k = experts[0].shape[1:]
    if width is None:
        return torch.cat([e[:n].long() for e, n in zip(experts, lengths, strict=True)]).transpose(0, 1)
    out = torch.full((len(experts), width, layers, k), -1, dtype=torch.long)
    for i, (e, n) in enumerate(zip(experts, lengths, strict=True)):
        out[i, :n] = e[:n].long()
    return out.reshape(-1, layers, k).transpose(0, 1)


def replayed_output(router: nn.Module, output: tuple, replay: torch.Tensor) -> tuple:
    """A top-k router's ``(logits, scores, indices)`` with the experts of ``replay`` ``[N, k]`` (rows of -1
    keep the router's own): the scores are the replayed experts' softmax probabilities, renormalised over
    them as the router does (``norm_topk_prob``; Mixtral always), so the gradient still reaches the router."""
    logits, scores, own = output
    indices = torch.where(replay[:, :1] >= 0, replay.to(own.device), own)
    top = torch.softmax(logits.float(), dim=-1).gather(1, indices)
    if getattr(router, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(scores.dtype), indices
