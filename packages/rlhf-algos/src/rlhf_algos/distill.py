"""Knowledge distillation: the student learns the labels and the teacher's next-token distribution."""

from __future__ import annotations

import torch

from rlhf_algos.aggregation import aggregate
from rlhf_algos.logits import entropy_from_logits, logprobs_from_logits
from rlhf_core.types import LossAggregation, LossOutput


def distill_cross_entropy(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Per position, the cross-entropy of the student under the teacher: ``[B, T, V]`` twice -> ``[B, T]``::

        d = -sum_v softmax(t)_v log softmax(s)_v  =  KL(T || S) + H(T)

    in float32. Vocabulary entries where the student logit is infinite (a masked token) add 0, as in
    OpenRLHF, instead of turning the sum into inf or NaN.
    """
    s, t = student_logits.float(), teacher_logits.float()
    terms = torch.softmax(t, dim=-1) * torch.log_softmax(s, dim=-1)
    return -torch.where(torch.isinf(s), torch.zeros_like(terms), terms).sum(-1)


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    kd_coef: float = 0.4,
    aggregation: LossAggregation | None = None,
) -> LossOutput:
    """OpenRLHF's distillation loss (MiniLLM's): ``(1 - kd_coef) * NLL + kd_coef * distil``.

    ``student_logits``, ``teacher_logits`` ``[B, T, V]`` at the positions that predict the ``[B, T]``
    ``labels``; ``mask`` ``[B, T]`` true on the trained (response) tokens. Both terms use that one mask::

        NLL    = aggregate(-log softmax(s)[label], mask)
        distil = aggregate(distill_cross_entropy(s, t), mask)

    (default aggregation: the token mean of this micro-batch). The teacher gets no gradient; masked
    positions may hold anything (inf, NaN) and get none either. Metrics:
    ``gpt_loss`` (NLL), ``distil_loss`` and ``kl`` (the token mean of KL(T || S) = distil - H(T)), each the
    plain mean over this micro-batch's masked tokens.
    """
    m = mask.bool()
    student_logits = torch.where(m[..., None], student_logits, student_logits.new_zeros(()))
    teacher_logits = torch.where(m[..., None], teacher_logits.detach(), teacher_logits.new_zeros(()))
    nll_tok = -logprobs_from_logits(student_logits, labels)
    distil_tok = distill_cross_entropy(student_logits, teacher_logits)
    loss = (1 - kd_coef) * aggregate(nll_tok, mask, aggregation) + kd_coef * aggregate(
        distil_tok, mask, aggregation
    )
    with torch.no_grad():
        teacher_entropy = entropy_from_logits(teacher_logits)
        n = max(int(m.sum()), 1)
        metrics = {
            "gpt_loss": float(nll_tok[m].sum()) / n,
            "distil_loss": float(distil_tok[m].sum()) / n,
            "kl": float((distil_tok - teacher_entropy)[m].sum()) / n,
        }
    return LossOutput(loss=loss, metrics=metrics)
