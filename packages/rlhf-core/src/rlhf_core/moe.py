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
        return torch.stack(picked).to(torch.int16)  # any model's expert ids, a quarter of the bytes


def replay_rows(experts: torch.Tensor, attention_mask: torch.Tensor, packed: bool) -> torch.Tensor:
    """A batch's recorded experts ``[B, L, layers, k]`` (:attr:`rlhf_core.batches.SequenceBatch.routed_experts`,
    -1: none recorded) laid out as its forward's router rows, ``[layers, N, k]``: padded (``N = B * L``) or
    packed (``N`` = the real tokens, row after row, as the packed forward runs them)."""
    rows = experts[attention_mask.bool()] if packed else experts.flatten(0, 1)
    return rows.transpose(0, 1).long()


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
