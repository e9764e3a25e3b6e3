"""Mixture-of-experts models on a training rank: the router's load-balancing loss (``--*.aux_loss_coef``), a
frozen router (``--*.freeze_moe_router``) and the routing metrics of every step, all read from the router
logits of the training forward. The routers are the modules transformers records as ``router_logits`` when a
forward asks for ``output_router_logits=True``, and the loss is the model family's own
``load_balancing_loss_func``: the ``aux_loss`` its ``*ForCausalLM`` returns. See docs/moe.md."""

from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn

from rlhf_core.batches import SequenceBatch
from rlhf_core.moe import replay_rows, replayed_output, router_recorder, routers


def routing_stats(logits: list[torch.Tensor], mask: torch.Tensor | None, top_k: int) -> dict[str, float]:
    """Per-layer router logits ``[N, E]`` (``mask`` ``[N]``: the real tokens; None: all) -> metrics, averaged
    over layers: ``moe_load_max_over_mean`` = max_e c_e / mean_e c_e, with c_e the real tokens that pick
    expert e among their top ``top_k`` (1 when perfectly balanced, E / top_k when all tokens pick the same
    experts), and ``moe_router_entropy`` = mean over real tokens of -sum_e p_e log p_e, p = softmax(logits)."""
    load, entropy = 0.0, 0.0
    for layer in logits:
        p = torch.softmax(layer.detach().float(), dim=-1)  # [N, E]
        m = torch.ones(len(p), device=p.device) if mask is None else mask.to(p.device, torch.float32)
        picks = torch.zeros_like(p).scatter_(1, p.topk(top_k, dim=-1).indices, 1.0)  # [N, E]
        counts = (picks * m[:, None]).sum(0)  # [E]
        load += float(counts.max() / counts.mean().clamp(min=1e-9))
        entropy += float((-(p * p.clamp(min=1e-30).log()).sum(-1) * m).sum() / m.sum().clamp(min=1))
    return {"moe_load_max_over_mean": load / len(logits), "moe_router_entropy": entropy / len(logits)}


class Routing:
    """Forward hooks on the routers of a trained MoE model that keep each layer's router logits of the last
    forward run with gradients (the training forward; a gradient-checkpointing recompute writes the same
    values again) and the attention mask it ran with; :meth:`take` turns them into the aux loss and metrics.
    Inside :meth:`replaying` the routers use the given experts instead of their own top-k (router replay).
    ``attach`` returns None for a dense model, refusing the MoE flags there."""

    def __init__(self, model: nn.Module, recorder, aux_loss_coef: float):
        from transformers import AutoModel

        self.aux_loss_coef = aux_loss_coef
        self.family_loss = sys.modules[recorder.target_class.__module__].load_balancing_loss_func
        self.routers = routers(model, recorder)
        self.replay: torch.Tensor | None = None
        """The experts the routers of the current forward use (``[layers, N, k]``), None: their own. Set at
        each forward's start from ``pending`` and kept for its backward: a gradient-checkpointing recompute
        runs the routers again then, and replays the same experts."""
        self.pending: torch.Tensor | None = None
        """What the next forward replays (set inside :meth:`replaying`)."""
        self.disagreement = [torch.zeros(()), torch.zeros(())]
        """Replayed (token, layer) pairs whose own experts differ from the replayed ones, and all of them,
        since the last :meth:`take` (tensors on the model's device: no sync per layer)."""
        config, first = model.config, self.routers[0]
        self.num_experts = getattr(first, "num_experts", None) or getattr(config, "num_local_experts", None)
        self.num_experts = self.num_experts or config.num_experts
        self.top_k = getattr(first, "top_k", None) or config.num_experts_per_tok
        self.logits: list[torch.Tensor | None] = [None] * len(self.routers)
        self.mask: torch.Tensor | None = None
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._keep(i, recorder.index))
        # the transformer under the head, which its forward calls with the mask (PEFT calls the head's
        # forward directly, past its hooks); an architecture transformers does not map: the model itself
        base_cls = AutoModel._model_mapping[type(config)] if type(config) in AutoModel._model_mapping else ()
        for base in [m for m in model.modules() if isinstance(m, base_cls)] or [model]:
            base.register_forward_pre_hook(self._keep_mask, with_kwargs=True)

    @classmethod
    def attach(
        cls, model: nn.Module, aux_loss_coef: float, freeze_router: bool, replay: bool
    ) -> Routing | None:
        recorder = router_recorder(model)
        family = sys.modules[recorder.target_class.__module__] if recorder is not None else None
        if not hasattr(family, "load_balancing_loss_func"):
            flags = (
                ("aux_loss_coef", aux_loss_coef),
                ("freeze_moe_router", freeze_router),
                ("router_replay", replay),
            )
            for flag, value in flags:
                if value:
                    raise ValueError(
                        f"--*.{flag} {value}: the model ({model.config.model_type}) is not a mixture-of-experts "
                        "model with a router transformers knows"
                    )
            return None
        routing = cls(model, recorder, aux_loss_coef)
        if freeze_router:
            for router in routing.routers:
                router.requires_grad_(False)
        return routing

    def _keep(self, i: int, index: int):
        def hook(module, args, output):
            if torch.is_grad_enabled():
                self.logits[i] = output[index] if isinstance(output, tuple) else output
            if self.replay is None:
                return None
            own, replay = output[-1], self.replay[i].to(output[-1].device)
            if len(replay) != len(own):
                raise ValueError(
                    f"router replay: the forward routed {len(own)} tokens but the batch recorded {len(replay)}: "
                    "its layout is not the padded or packed batch the engine's routing was laid out for"
                )
            valid = replay[:, 0] >= 0
            differ = (own.sort(-1).values != replay.sort(-1).values).any(-1) & valid
            self.disagreement = [self.disagreement[0] + differ.sum(), self.disagreement[1] + valid.sum()]
            return replayed_output(module, output, replay)

        return hook

    @contextlib.contextmanager
    def replaying(self, experts: torch.Tensor):
        """Forwards inside (and their backward's recompute) use ``experts`` ``[layers, N, k]``
        (:func:`rlhf_core.moe.replay_rows`; rows of -1 keep the router's own choice) and count in
        ``disagreement`` where the router would have chosen otherwise."""
        self.pending = experts
        try:
            yield
        finally:
            self.pending = None

    def _keep_mask(self, module, args, kwargs):
        # a new forward: forget what a gradient-checkpointing recompute left from the last backward
        self.replay = self.pending
        self.logits = [None] * len(self.routers)
        self.mask = kwargs.get("attention_mask") if torch.is_grad_enabled() else None

    def take(self) -> tuple[torch.Tensor | None, dict[str, float]]:
        """The family's load-balancing loss of the last training forward (a scalar with gradient) and the routing
        metrics, then forgets them; no loss and only ``moe_experts_differ`` (router replay) when no forward with
        gradients ran since the last call."""
        logits, mask = self.logits, self.mask
        self.logits, self.mask = [None] * len(self.routers), None
        (differ, total), self.disagreement = self.disagreement, [torch.zeros(()), torch.zeros(())]
        replayed = {"moe_experts_differ": float(differ / total)} if total else {}
        if any(x is None for x in logits):
            return None, replayed
        rows = logits[0].shape[0]
        if mask is not None and (mask.dim() != 2 or mask.numel() != rows):
            mask = None  # a packed row or a custom mask: every routed token is real
        aux = self.family_loss(tuple(logits), self.num_experts, self.top_k, mask)
        metrics = routing_stats(logits, None if mask is None else mask.reshape(-1), self.top_k)
        return aux, {"aux_loss": float(aux.detach()), **metrics, **replayed}


def replaying(routing: Routing | None, seq: SequenceBatch, packed: bool):
    """The context of a policy forward of ``seq``: the rollout's routing replayed where the batch carries it
    (``--actor.router_replay``), else nothing (dense models cost a ``None`` check)."""
    if routing is None or seq.routed_experts is None:
        return contextlib.nullcontext()
    return routing.replaying(replay_rows(seq.routed_experts, seq.attention_mask, packed))
