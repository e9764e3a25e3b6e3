"""The micro-batches the workers receive: plain dataclasses of tensors, cheap to send through Ray (shapes:
:class:`SequenceBatch`)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, fields, is_dataclass, replace

import torch
import torch.nn.functional as F

from rlhf_core.types import ImageInput


@dataclass
class SequenceBatch:
    """``B`` sequences ``prompt + response``, right-padded to ``L`` tokens.

    Response position ``t`` of row ``i`` is token ``prompt_lens[i] + t``; outputs indexed by response
    position have shape ``[B, T]`` with ``T = max(response lengths)``, zero past each row's end (right-padded,
    like :class:`rlhf_core.types.Trajectory` data).
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
    images: list[list[ImageInput]] | None = None
    """Vision-language models: each row's images, in the order of their tokens; rows that sample the same
    prompt hold the same objects (the vision tower encodes each once). None: a text batch."""
    routed_experts: torch.Tensor | None = None
    """Router replay (``--actor.router_replay``): ``[B, L, layers, k]`` the experts the rollout engine routed
    each token to, -1 where it recorded none (padding, each sequence's last token). None: no replay."""

    @property
    def response_lens(self) -> torch.Tensor:
        return self.attention_mask.sum(-1) - self.prompt_lens

    @property
    def num_response_positions(self) -> int:
        return int(self.response_lens.max().item()) if len(self.prompt_lens) else 0

    def response_mask(self) -> torch.Tensor:
        """``[B, T]`` bool: ``action_mask`` if given, else the real response positions."""
        lens = self.response_lens
        t = torch.arange(self.num_response_positions, device=lens.device)
        valid = t[None, :] < lens[:, None]
        return valid if self.action_mask is None else self.action_mask[:, : valid.shape[1]].bool() & valid

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def make_sequence_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    pad_token_id: int,
    action_masks: list[list[int]] | None = None,
    images: list[list[ImageInput]] | None = None,
    routed_experts: list[torch.Tensor] | None = None,
) -> SequenceBatch:
    """Build a :class:`SequenceBatch` from token-id lists (e.g. ``Trajectory.prompt_ids`` / ``response_ids``
    / ``action_mask``) and, for a vision-language model, each row's images (``Trajectory.images``); for router
    replay each row's recorded experts ``[<= len(prompt + response), layers, k]`` (``Trajectory.routed_experts``;
    None: none recorded)."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"sequence {i} has an empty prompt; at least one prompt token is needed")
    lens = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    ids = torch.full((len(prompts), max(lens)), pad_token_id, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, : lens[i]] = torch.tensor(p + r, dtype=torch.long)
    mask = (torch.arange(ids.shape[1])[None, :] < torch.tensor(lens)[:, None]).long()
    amask = None
    if action_masks is not None:
        t = max((len(r) for r in responses), default=0)
        amask = torch.zeros((len(prompts), t), dtype=torch.long)
        for i, m in enumerate(action_masks):
            if len(m) != len(responses[i]):
                raise ValueError(
                    f"sequence {i}: action mask has {len(m)} entries for {len(responses[i])} tokens"
                )
            amask[i, : len(m)] = torch.tensor(m, dtype=torch.long)
    if images is not None and len(images) != len(prompts):
        raise ValueError(f"{len(images)} image lists for {len(prompts)} sequences")
    routed, known = None, [e for e in routed_experts or [] if e is not None]
    if known:  # int16: expert ids of any model, a quarter of the bytes through Ray
        routed = torch.full((*ids.shape, *known[0].shape[1:]), -1, dtype=torch.int16)
        for i, e in enumerate(routed_experts):
            if e is not None:
                routed[i, : len(e)] = e
    prompt_lens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    return SequenceBatch(ids, mask, prompt_lens, amask, images, routed)


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
        masks = [b.response_mask().long() if b.action_mask is None else b.action_mask[:, :t] for b in batches]
        amask = torch.cat([pad(m, t, 0) for m in masks])
    return SequenceBatch(ids, mask, torch.cat([b.prompt_lens for b in batches]), amask)


def to_device(obj, device: torch.device):
    """Move a tensor, or every tensor inside a (nested) dataclass, to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if is_dataclass(obj):
        return replace(obj, **{f.name: to_device(getattr(obj, f.name), device) for f in fields(obj)})
    return obj


def token_budget_micro_batches(
    lengths: list[int],
    num_ranks: int,
    max_tokens: int,
    packed: bool,
    prompts: Sequence[Hashable] | None = None,
) -> list[list[int]]:
    """Row indices grouped into micro-batches that each fit a token budget (dynamic batching), rank-major,
    with the same number of micro-batches on every rank.

    ``lengths[i]`` is row ``i``'s token count (prompt + response), ``B = len(lengths)``, ``R = num_ranks``
    (data-parallel ranks: the ranks of one ring-attention group share their micro-batches and count once).
    ``prompts[i]`` (optional) is a key of row ``i``'s prompt, e.g. its ids: rows with the same key form a
    unit that stays together where it can, so that ``--ds.shared_prefix`` runs the prompt once for them.
    Without keys every row is its own unit. The cost of a micro-batch ``M`` is the size of its forward pass::

        packed:  cost(M) = sum_{i in M} lengths[i]
        padded:  cost(M) = |M| * max_{i in M} lengths[i]

    (an upper bound for rows that share their prompt, which run fewer tokens).

    1. Units are dealt to the ranks longest first (by their longest row), each to the rank holding the
       fewest tokens among those with room for all of it; a unit no rank has room for is dealt row by row.
       Ranks get equal numbers of rows (the first ``B mod R`` ranks one more).
    2. Each rank places its rows in that order (a unit's rows together, longest first): a unit's rows in
       the first of its micro-batches (or a new one) where the cost of all of them stays ``<= max_tokens``;
       a unit that fits none is placed row by row, each in the first where the cost stays ``<= max_tokens``,
       else in a new one. A single row longer than ``max_tokens`` gets a micro-batch of its own, over the
       budget: rows are never dropped or truncated.
    3. A rank with fewer micro-batches than the most any rank has halves its costliest one (of two rows or
       more) until the counts are equal, because every rank must run the same number of forward/backward
       passes (ZeRO-3 gathers are collective). That needs at least as many rows on the rank as the target
       count, which holds whenever ``B`` is a multiple of ``R``; otherwise a rank short of rows may end with
       fewer micro-batches (one row each).

    Returns ``K`` lists of row indices (ascending within each), rank ``r``'s at ``[r*K/R, (r+1)*K/R)`` when
    the counts are equal. Every row appears in exactly one micro-batch.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive token budget, got {max_tokens}")
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}")
    if prompts is not None and len(prompts) != len(lengths):
        raise ValueError(f"{len(prompts)} prompt keys for {len(lengths)} rows")

    def cost(rows: list[int]) -> int:
        return sum(lengths[i] for i in rows) if packed else len(rows) * max(lengths[i] for i in rows)

    def key(i: int) -> Hashable:
        return i if prompts is None else prompts[i]

    units: dict[Hashable, list[int]] = {}
    for i in range(len(lengths)):
        units.setdefault(key(i), []).append(i)
    ordered = [sorted(u, key=lambda i: (-lengths[i], i)) for u in units.values()]
    ordered.sort(key=lambda u: (-lengths[u[0]], u[0]))
    room = [len(lengths) // num_ranks + (r < len(lengths) % num_ranks) for r in range(num_ranks)]
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    tokens = [0] * num_ranks
    for unit in ordered:
        whole = [r for r in range(num_ranks) if room[r] - len(shares[r]) >= len(unit)]
        for i in unit:
            r = min(
                whole or [r for r in range(num_ranks) if len(shares[r]) < room[r]], key=lambda r: tokens[r]
            )
            whole = [r] if whole else []  # the rest of the unit follows its first row
            shares[r].append(i)
            tokens[r] += lengths[i]

    def fits(mbs: list[list[int]], stats: list[tuple[int, int]], k: int, rows: list[int]) -> bool:
        """Whether ``rows`` keep micro-batch ``k`` (``len(mbs)``: a new one) within the budget."""
        tok, wide = stats[k] if k < len(mbs) else (0, 0)
        size = len(mbs[k]) if k < len(mbs) else 0
        wide = max(wide, *(lengths[i] for i in rows))
        return (tok + sum(lengths[i] for i in rows) if packed else (size + len(rows)) * wide) <= max_tokens

    per_rank: list[list[list[int]]] = []
    for share in shares:
        mbs: list[list[int]] = []
        stats: list[tuple[int, int]] = []  # tokens and longest row of each micro-batch: a try costs O(1)

        runs: list[list[int]] = []  # a unit's rows on this rank, placed together where they fit
        for i in share:
            if runs and key(runs[-1][0]) == key(i):
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            k = next((k for k in range(len(mbs) + 1) if fits(mbs, stats, k, run)), None)
            for i in run:
                at = (
                    k
                    if k is not None
                    else next((j for j in range(len(mbs)) if fits(mbs, stats, j, [i])), len(mbs))
                )
                if at == len(mbs):
                    mbs.append([])
                    stats.append((0, 0))
                mbs[at].append(i)
                stats[at] = (stats[at][0] + lengths[i], max(stats[at][1], lengths[i]))
        per_rank.append(mbs)
    target = max(len(mbs) for mbs in per_rank)
    for mbs in per_rank:
        while len(mbs) < target and any(len(mb) > 1 for mb in mbs):
            big = max((mb for mb in mbs if len(mb) > 1), key=cost)
            half = len(big) // 2
            mbs.append(
                big[half:]
            )  # rows in placement order: the later half is the shorter one, or another prompt
            del big[half:]
    return [sorted(mb) for mbs in per_rank for mb in mbs]


@dataclass
class PolicyMicroBatch:
    """One micro-batch of a policy step. Tensors are ``[B, T]`` over response positions."""

    seq: SequenceBatch
    old_logprobs: torch.Tensor | None
    """The behaviour policy's log-probs. None when the step is on-policy (one epoch, one optimizer step per
    rollout batch): they equal the current log-probs, so the step uses those, detached."""
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
class PolicyStepConfig:
    """How a policy step computes its loss; see ``--actor.*`` and ``--algo.*``."""

    loss: str = "ppo"
    """Registered policy loss (``--actor.policy_loss_type``), resolved in the worker."""
    temperature: float = 1.0
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    dual_clip: float | None = None
    is_correction: str | None = None
    is_threshold: tuple[float, float] = (0.5, 5.0)
    agg_mode: str = "token_mean"
    max_len: int | None = None
    """Dr. GRPO's constant normaliser (``seq_mean_token_sum_norm``); default: the generation budget."""
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    """Weight of the KL loss term; 0 disables it (needs ``ref_logprobs`` in the micro-batches)."""
    kl_estimator: str = "k3"


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


@dataclass
class PRMBatch:
    """Process-reward-model micro-batch: whole texts, and their ``N`` labelled step markers."""

    seq: SequenceBatch
    """The texts, each as one sequence (its first token the 'prompt', the rest the 'response')."""
    rows: torch.Tensor
    """``[N]`` long: the row of each step marker."""
    cols: torch.Tensor
    """``[N]`` long: its token position within the row."""
    classes: torch.Tensor
    """``[N]`` long: the labelled token, as an index into the reward tokens (or a vocabulary id)."""
    soft_labels: torch.Tensor
    """``[N]`` float: NaN for a hard label, else the probability of the positive reward token."""
