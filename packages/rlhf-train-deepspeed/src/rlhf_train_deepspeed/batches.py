"""The micro-batches the workers receive: plain dataclasses of tensors, cheap to send through Ray.

Everything indexed by response position has shape ``[B, T]`` (``T`` = the longest response of the
micro-batch), right-padded, like :class:`rlhf_core.types.Trajectory` data.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace

import torch
import torch.nn.functional as F

# --- batches -------------------------------------------------------------------------------------------


@dataclass
class SequenceBatch:
    """``B`` sequences ``prompt + response``, right-padded to ``L`` tokens.

    Response position ``t`` of row ``i`` is token ``prompt_lens[i] + t``; outputs indexed by response
    position have shape ``[B, T]`` with ``T = max(response lengths)``, zero past each row's end.
    """

    input_ids: torch.Tensor
    """``[B, L]`` token ids, padded on the right."""
    attention_mask: torch.Tensor
    """``[B, L]`` 1 on real tokens."""
    prompt_lens: torch.Tensor
    """``[B]`` prompt lengths (at least 1: the first response token is predicted from the prompt)."""
    action_mask: torch.Tensor | None = None
    """``[B, T]`` 1 on tokens that count (model tokens; 0 on environment feedback and padding).
    None means every response token counts."""

    @property
    def response_lens(self) -> torch.Tensor:
        return self.attention_mask.sum(-1) - self.prompt_lens

    @property
    def num_response_positions(self) -> int:
        return int(self.response_lens.max().item()) if len(self.prompt_lens) else 0

    def response_mask(self) -> torch.Tensor:
        """``[B, T]`` bool: ``action_mask`` if given, else the real response positions."""
        t = torch.arange(self.num_response_positions)
        valid = t[None, :] < self.response_lens[:, None]
        if self.action_mask is None:
            return valid
        return self.action_mask[:, : valid.shape[1]].bool() & valid

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: slice | torch.Tensor) -> SequenceBatch:
        return SequenceBatch(
            self.input_ids[rows],
            self.attention_mask[rows],
            self.prompt_lens[rows],
            None if self.action_mask is None else self.action_mask[rows],
        )


def make_sequence_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    pad_token_id: int,
    action_masks: list[list[int]] | None = None,
) -> SequenceBatch:
    """Build a :class:`SequenceBatch` from token-id lists (e.g. ``Trajectory.prompt_ids`` / ``response_ids``
    / ``action_mask``)."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"sequence {i} has an empty prompt; at least one prompt token is needed")
    lens = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    length = max(lens)
    ids = torch.full((len(prompts), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, : lens[i]] = torch.tensor(p + r, dtype=torch.long)
        mask[i, : lens[i]] = 1
    amask = None
    if action_masks is not None:
        t = max((len(r) for r in responses), default=0)
        amask = torch.zeros((len(prompts), t), dtype=torch.long)
        for i, m in enumerate(action_masks):
            if len(m) != len(responses[i]):
                raise ValueError(f"sequence {i}: action mask has {len(m)} entries for {len(responses[i])} tokens")
            amask[i, : len(m)] = torch.tensor(m, dtype=torch.long)
    return SequenceBatch(ids, mask, torch.tensor([len(p) for p in prompts], dtype=torch.long), amask)


def concat_batches(batches: list[SequenceBatch], pad_token_id: int) -> SequenceBatch:
    """Stack batches row-wise, padding to the longest (e.g. chosen and rejected in one forward pass)."""
    length = max(b.input_ids.shape[1] for b in batches)
    t = max(b.num_response_positions for b in batches)

    def pad(x: torch.Tensor, width: int, value: int) -> torch.Tensor:
        return F.pad(x, (0, width - x.shape[1]), value=value)

    ids = torch.cat([pad(b.input_ids, length, pad_token_id) for b in batches])
    mask = torch.cat([pad(b.attention_mask, length, 0) for b in batches])
    amask = None
    if any(b.action_mask is not None for b in batches):
        amask = torch.cat(
            [pad(b.response_mask().long() if b.action_mask is None else b.action_mask[:, :t], t, 0) for b in batches]
        )
    return SequenceBatch(ids, mask, torch.cat([b.prompt_lens for b in batches]), amask)


def to_device(obj, device: torch.device):
    """Move a tensor, or every tensor inside a (nested) dataclass, to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if is_dataclass(obj):
        return replace(obj, **{f.name: to_device(getattr(obj, f.name), device) for f in fields(obj)})
    return obj




@dataclass
class PolicyMicroBatch:
    """One micro-batch of a policy step. Tensors are ``[B, T]`` over response positions."""

    seq: SequenceBatch
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    rollout_logprobs: torch.Tensor | None = None
    """The engine's log-probs, for IS correction (``--algo.advantage.is_correction_enable``)."""
    ref_logprobs: torch.Tensor | None = None
    """Reference log-probs, for the KL loss term (``--algo.kl.use_loss``)."""


@dataclass
class CriticMicroBatch:
    """One micro-batch of a critic step. Tensors are ``[B, T]`` over response positions."""

    seq: SequenceBatch
    old_values: torch.Tensor
    returns: torch.Tensor


@dataclass
class PairBatch:
    """Reward-model and DPO micro-batch: row ``i`` of ``chosen`` is preferred to row ``i`` of ``rejected``."""

    chosen: SequenceBatch
    rejected: SequenceBatch
    margin: torch.Tensor | None = None
    """``[B]`` the dataset's ``margin`` column (RM with ``--model.margin_loss_enable``)."""


@dataclass
class KTOBatch:
    """KTO micro-batch: completions labelled desirable or not, and mismatched pairs for the KL estimate."""

    seq: SequenceBatch
    desirable: torch.Tensor
    """``[B]`` bool."""
    kl_seq: SequenceBatch
    """Prompt ``i`` with the completion of row ``(i + 1) % B``: the reference point of KTO."""
