"""The training step of one rank in two halves: :meth:`Learner.forward_backward` runs a registered loss
(:data:`rlhf_train_deepspeed.losses.LOSSES`) with backward over the rank's micro-batches, and
:meth:`Learner.optim_step` applies the accumulated gradients. Both are collective: every rank calls them, with
the same number of micro-batches."""

from __future__ import annotations

from typing import Any

import torch

from rlhf_train_deepspeed.losses import LOSSES
from rlhf_train_deepspeed.rank_model import RankModel
from rlhf_train_deepspeed.strategy import StepResult, add_metrics


class Learner:
    """``forward_backward`` and ``optim_step`` over ``model``'s trained engine.

    A non-finite loss on any rank (an all-reduced flag per micro-batch) skips the step: the backward of that
    micro-batch is made non-finite on purpose so that DeepSpeed's own overflow path (at ``optim_step``)
    discards every gradient accumulated so far, keeps parameters and optimizer state bitwise unchanged and does
    not advance the LR schedule. ZeRO-0 in fp32 has no overflow path; there the gradients are dropped at once.
    Further ``forward_backward`` calls of a skipped step run nothing."""

    def __init__(self, model: RankModel):
        self.model = model
        self.step: StepResult | None = None
        """The step so far: losses and metrics of the ``forward_backward`` calls since the last ``optim_step``."""

    @property
    def no_overflow_path(self) -> bool:
        return self.model.strategy.ds.zero_stage == 0 and self.model.strategy.dtype == torch.float32

    def forward_backward(
        self, micro_batches: list, loss: str, loss_cfg: Any, counts: dict[str, float]
    ) -> StepResult:
        """Run the loss registered as ``loss`` over ``micro_batches`` with backward; the gradient-accumulation
        boundary is the last micro-batch. ``loss_cfg`` and ``counts`` (the step's global counts) go to the loss.
        Returns this call's part of the step: ``loss`` (summed over micro-batches, divided by the data-parallel
        size; NaN when skipped), ``skipped``, ``lr`` and the metrics; ``grad_norm`` comes with ``optim_step``."""
        if loss not in LOSSES:
            raise ValueError(f"unknown loss {loss!r}; registered: {', '.join(sorted(LOSSES))}")
        model, engine = self.model, self.model.engine
        engine.train()
        if self.step is None:
            lr = engine.get_lr()[0] if engine.lr_scheduler is not None else 0.0
            self.step = StepResult(0.0, False, None, lr, {})
        step = self.step
        part = StepResult(0.0, step.skipped, None, step.lr, {})
        for i, mb in enumerate(micro_batches):
            if step.skipped:
                break
            value, metrics, weight = LOSSES[loss](model, model.dev(mb), loss_cfg, counts)
            if model.strategy.any_rank(not bool(torch.isfinite(value.detach()).all())):
                if self.no_overflow_path:
                    engine.zero_grad()
                else:
                    engine.set_gradient_accumulation_boundary(True)
                    engine.backward(value * float("nan"), scale_wrt_gas=False)
                step.skipped = part.skipped = True
                break
            engine.set_gradient_accumulation_boundary(i == len(micro_batches) - 1)
            engine.backward(value, scale_wrt_gas=False)
            loss_part = float(value.detach()) / model.dp_size
            for result in (step, part):
                result.loss += loss_part
                add_metrics(result.metrics, metrics, weight)
        if part.skipped:
            part.loss = float("nan")
        return part

    def optim_step(self) -> StepResult:
        """Apply the step (DeepSpeed's ``engine.step()``: clipping, optimizer, LR schedule) and update the EMA;
        a skipped step only lets DeepSpeed discard its gradients. Returns the whole step: the loss and metrics
        of its ``forward_backward`` calls, ``skipped``, the global gradient norm before clipping and the lr."""
        step, self.step = self.step, None
        if step is None:
            raise RuntimeError("optim_step: no forward_backward since the last optimizer step")
        engine = self.model.engine
        if step.skipped:
            step.loss = float("nan")
            if not self.no_overflow_path:
                engine.step()
                if engine.was_step_applied():
                    raise RuntimeError("DeepSpeed applied an optimizer step with non-finite gradients")
            return step
        if self.no_overflow_path:  # DeepSpeed keeps no norm for a plain torch optimizer: the all-reduced one
            grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
            step.grad_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        engine.step()
        if step.grad_norm is None and hasattr(engine, "get_global_grad_norm"):
            norm = engine.get_global_grad_norm()
            step.grad_norm = None if norm is None else float(norm)
        if self.model.ema is not None and engine.was_step_applied():
            self.model.ema.update()
        return step

    @torch.no_grad()
    def evaluate(
        self, micro_batches: list, loss: str, loss_cfg: Any
    ) -> list[tuple[torch.Tensor, dict, float]]:
        """``(loss, metrics, weight)`` of each micro-batch in eval mode, without gradients (the loss's
        ``counts=None``: each loss is the mean over its micro-batch)."""
        model = self.model
        model.engine.eval()
        return [LOSSES[loss](model, model.dev(mb), loss_cfg, None) for mb in micro_batches]
