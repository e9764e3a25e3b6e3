"""The losses a rank trains with, registered by name in :data:`LOSSES` (``TrainWorker.forward_backward(..., loss=
name)``). Each is ``loss(model, micro_batch, cfg, counts) -> (loss, metrics, weight)``: ``model`` is the rank's
:class:`~rlhf_train_deepspeed.rank_model.RankModel`, ``micro_batch`` is on its device, ``cfg`` the loss's own
settings and ``counts`` the step's global counts (``num_tokens``, ``num_sequences``). ``loss`` is normalised by
those counts and multiplied by the data-parallel size (DeepSpeed averages gradients over ranks), so that
gradients are summed over micro-batches and ranks; ``metrics`` are averaged with ``weight`` (tokens, pairs).
The supervised losses also evaluate: with ``counts=None`` the loss is the mean over the micro-batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhf_algos.distill import kd_loss
from rlhf_algos.kl import kl_loss
from rlhf_algos.policy_loss import entropy_loss
from rlhf_algos.preference import dpo_loss, kto_loss, nll_loss, rm_loss
from rlhf_algos.prm import prm_loss
from rlhf_algos.sft import sft_loss
from rlhf_algos.value_loss import value_loss
from rlhf_core.batches import CriticMicroBatch, PolicyMicroBatch, PolicyStepConfig, concat_batches
from rlhf_core.types import LossAggregation, PolicyLossInput
from rlhf_train_deepspeed.models import (
    response_logits,
    response_logprobs,
    response_values,
    sequence_rewards,
    step_logits,
)
from rlhf_train_deepspeed.moe import replaying


@dataclass
class SupervisedConfigLite:
    """The loss settings of the SFT/RM/DPO/KTO/PRM/KD modes (``--model.*``, ``--prm.*``, ``--teacher.*``)."""

    mode: str
    beta: float = 0.1
    ipo: bool = False
    label_smoothing: float = 0.0
    nll_loss_coef: float = 0.0
    loss_type: str = "sigmoid"
    margin_loss: bool = False
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    reward_token_ids: list[int] | None = None
    """PRM: the ids the step logits are restricted to; None: the whole vocabulary."""
    kd_coef: float = 0.4


def plus_router_loss(model, loss: torch.Tensor, metrics: dict, sequences: int, counts) -> torch.Tensor:
    """``loss`` plus an MoE model's router load-balancing term of the forward just run (its metrics go to
    ``metrics``): ``coef * aux * sequences / num_sequences * dp_size``, so that over a step the gradient is
    ``coef`` times that of the sequence-weighted mean of the micro-batches' aux losses (OpenRLHF adds
    ``coef * aux`` to each micro-batch's mean loss). Dense models and evaluation: ``loss`` unchanged."""
    if model.routing is None:
        return loss
    aux, routing_metrics = model.routing.take()
    metrics.update(routing_metrics)
    if aux is None or not model.routing.aux_loss_coef:
        return loss
    share = 1.0 if counts is None else sequences / counts["num_sequences"] * model.dp_size
    return loss + model.routing.aux_loss_coef * share * aux.to(loss.device)


def policy(model, mb: PolicyMicroBatch, cfg: PolicyStepConfig, counts: dict[str, float]):
    """The policy loss ``cfg.loss`` (a ``policy_losses`` plugin) + entropy bonus + KL loss."""
    loss_fn = model.registered("policy_losses", cfg.loss, "--actor.policy_loss_type")
    kl_fn = (
        model.registered("kl_estimators", cfg.kl_estimator, "--algo.kl.estimator") if cfg.kl_coef else None
    )
    agg = LossAggregation(
        mode=cfg.agg_mode,
        num_tokens=counts["num_tokens"],
        num_sequences=counts["num_sequences"],
        max_len=cfg.max_len,
        dp_size=model.dp_size,
    )
    with replaying(model.routing, mb.seq, model.packing):
        lp, ent, mask = response_logprobs(
            model.engine,
            mb.seq,
            cfg.temperature,
            model.packing,
            with_entropy=True,
            entropy_grad=bool(cfg.entropy_coef),
            ring=model.ring,
        )
    on_policy = mb.old_logprobs is None
    out = loss_fn(
        PolicyLossInput(
            logprobs=lp,
            old_logprobs=lp.detach() if on_policy else mb.old_logprobs,
            advantages=mb.advantages,
            action_mask=mask,
            rollout_logprobs=mb.rollout_logprobs,
            eps_clip_low=cfg.eps_clip_low,
            eps_clip_high=cfg.eps_clip_high,
            dual_clip=cfg.dual_clip,
            is_correction=cfg.is_correction,
            is_threshold=tuple(cfg.is_threshold),
            aggregation=agg,
        )
    )
    loss, metrics = out.loss, dict(out.metrics)
    loss = plus_router_loss(model, loss, metrics, len(mask), counts)
    with torch.no_grad():
        metrics["entropy"] = float((ent * mask).sum() / mask.sum().clamp(min=1))
        if on_policy and mb.rollout_logprobs is not None:  # else the controller reports it
            gap = (lp - mb.rollout_logprobs).abs() * mask
            metrics["rollout_train_logprob_gap"] = float(gap.sum() / mask.sum().clamp(min=1))
    if cfg.entropy_coef:
        loss = loss + entropy_loss(ent, mask, cfg.entropy_coef, agg)
    if kl_fn is not None:
        if mb.ref_logprobs is None:
            raise ValueError("the KL loss term (--algo.kl.use_loss) needs ref_logprobs in each micro-batch")
        kl = kl_loss(lp, mb.ref_logprobs, mask, kl_fn, agg)
        loss = loss + cfg.kl_coef * kl
        metrics["kl_loss"] = float(kl.detach()) / model.dp_size
    return loss, metrics, float(mask.sum())


def value(model, mb: CriticMicroBatch, value_clip: float | None, counts: dict[str, float]):
    """The clipped value loss (``rlhf_algos.value_loss``); ``cfg`` is the clip range."""
    agg = LossAggregation(num_tokens=counts["num_tokens"], dp_size=model.dp_size)
    values, mask = response_values(model.engine, mb.seq, model.packing, model.ring)
    out = value_loss(values, mb.old_values, mb.returns, mask, value_clip, agg)
    metrics = {**out.metrics, "values": float((values.detach() * mask).sum() / mask.sum().clamp(min=1))}
    return plus_router_loss(model, out.loss, metrics, len(mask), counts), metrics, float(mask.sum())


def _token_aggregation(model, counts: dict[str, float] | None) -> LossAggregation:
    """The token modes' aggregation: over the step's global token count in training, else this micro-batch."""
    if counts is None:
        return LossAggregation(num_tokens=None, dp_size=1)
    return LossAggregation(num_tokens=counts.get("num_tokens"), dp_size=model.dp_size)


def _per_pair(model, loss: torch.Tensor, b: int, counts: dict[str, float] | None) -> torch.Tensor:
    """A pair loss (mean over the ``b`` pairs of the micro-batch) normalised by the step's global pair count."""
    train = counts is not None
    return loss * b / (counts["num_sequences"] if train else b) * (model.dp_size if train else 1)


def sft(model, mb, cfg: SupervisedConfigLite, counts: dict[str, float] | None):
    lp, _, mask = response_logprobs(model.engine, mb, 1.0, model.packing, ring=model.ring)
    n = float(mask.sum())
    metrics = {"nll": float(-(lp.detach() * mask).sum()) / max(n, 1.0)}
    loss = plus_router_loss(
        model, sft_loss(lp, mask, _token_aggregation(model, counts)), metrics, len(mb), counts
    )
    return loss, metrics, n


def prm(model, mb, cfg: SupervisedConfigLite, counts: dict[str, float] | None):
    logits = step_logits(model.engine, mb, model.packing)  # [N, V]
    if cfg.reward_token_ids is not None:
        logits = logits[:, cfg.reward_token_ids]  # [N, K]
    out = prm_loss(logits, mb.classes, mb.soft_labels, _token_aggregation(model, counts))
    metrics = dict(out.metrics)
    return plus_router_loss(model, out.loss, metrics, len(mb.seq), counts), metrics, float(len(mb.rows))


def kd(model, mb, cfg: SupervisedConfigLite, counts: dict[str, float] | None):
    """Distillation from the teacher the rank hosts as its reference model."""
    student, labels, mask = response_logits(model.engine, mb, model.packing)
    with torch.no_grad():
        teacher, _, _ = response_logits(model.ref_engine, mb, model.packing)
    out = kd_loss(student, teacher, labels, mask, cfg.kd_coef, _token_aggregation(model, counts))
    metrics = dict(out.metrics)
    return plus_router_loss(model, out.loss, metrics, len(mask), counts), metrics, float(mask.sum())


def rm(model, mb, cfg: SupervisedConfigLite, counts: dict[str, float] | None):
    """Evaluation also returns the rewards (``_rewards``: chosen, then rejected) for the normalisation."""
    both = concat_batches([mb.chosen, mb.rejected], model.pad_token_id)
    rewards = sequence_rewards(model.engine, both, model.packing, model.ring)
    b = len(mb.chosen)
    out = rm_loss(rewards[:b], rewards[b:], mb.margin if cfg.margin_loss else None, cfg.loss_type)
    metrics = dict(out.metrics)
    if counts is None:
        metrics["_rewards"] = rewards.detach().cpu().tolist()
    loss = plus_router_loss(model, _per_pair(model, out.loss, b, counts), metrics, b, counts)
    return loss, metrics, float(b)


def _policy_and_reference_logps(model, first, second):
    """Summed response log-probs ``[2B]`` of ``first`` then ``second`` under the model and its reference, and
    the response mask ``[2B, T]``."""
    both = concat_batches([first, second], model.pad_token_id)
    lp, _, mask = response_logprobs(model.engine, both, 1.0, model.packing, ring=model.ring)
    with torch.no_grad():
        ref_lp, _, _ = response_logprobs(model.ref_engine, both, 1.0, model.packing, ring=model.ring)
    return (lp * mask).sum(-1), (ref_lp * mask).sum(-1), mask


def dpo(model, mb, cfg: SupervisedConfigLite, counts: dict[str, float] | None):
    b = len(mb.chosen)
    logps, ref_logps, mask = _policy_and_reference_logps(model, mb.chosen, mb.rejected)
    out = dpo_loss(logps[:b], logps[b:], ref_logps[:b], ref_logps[b:], cfg.beta, cfg.label_smoothing, cfg.ipo)
    loss, metrics = out.loss, dict(out.metrics)
    if cfg.nll_loss_coef:
        nll = nll_loss(logps[:b], mask[:b].sum(-1))
        loss = loss + cfg.nll_loss_coef * nll
        metrics["nll"] = float(nll.detach())
    return plus_router_loss(model, _per_pair(model, loss, b, counts), metrics, b, counts), metrics, float(b)


def kto(model, mb, cfg: SupervisedConfigLite, counts: dict[str, float] | None):
    """KTO's reference point is the mean log-ratio on the mismatched pairs ``kl_seq``, averaged over ranks."""
    b = len(mb.seq)
    logps, ref_logps, _ = _policy_and_reference_logps(model, mb.seq, mb.kl_seq)
    kl = (logps[b:] - ref_logps[b:]).detach().mean()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(kl)
        kl = kl / torch.distributed.get_world_size()
    out = kto_loss(
        logps[:b], ref_logps[:b], mb.desirable, kl, cfg.beta, cfg.desirable_weight, cfg.undesirable_weight
    )
    metrics = dict(out.metrics)
    return (
        plus_router_loss(model, _per_pair(model, out.loss, b, counts), metrics, b, counts),
        metrics,
        float(b),
    )


LOSSES: dict[str, Callable] = {
    "policy": policy,
    "value": value,
    "sft": sft,
    "rm": rm,
    "dpo": dpo,
    "kto": kto,
    "prm": prm,
    "kd": kd,
}
"""Loss name -> loss function (the module docstring); add to it, in a module the ranks import, to train with a
loss of your own."""
