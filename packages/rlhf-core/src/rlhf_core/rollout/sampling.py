"""Sampling math and request checks shared by the rollout engines.

Randomness is counter-based: the uniform that picks token ``t`` of a sample is a hash of (the sample's
seed, ``t``), computed on the device for the whole batch at once. A sample therefore draws the same
tokens whatever else is in its batch, in whatever order, and after a restart, with no generator state
to save. Shapes: ``R`` rows (one row per sample), ``V`` vocabulary entries.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

from rlhf_core.types import GenerationRequest, SamplingParams, derive_seed

_M32 = 0xFFFFFFFF


def mix32(x):
    """A 32-bit integer hash (xorshift-multiply rounds), for Python ints or int64 tensors in ``[0, 2**32)``.

    Both multipliers are below ``2**31``, so every product stays below ``2**63``: no int64 overflow.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor) -> torch.Tensor:
    """``[R]`` non-negative 63-bit seeds -> ``[R]`` 32-bit keys (int64) for :func:`counter_uniform`."""
    return mix32((seeds & _M32) ^ mix32(seeds >> 32))


def counter_uniform(keys: torch.Tensor, step: int) -> torch.Tensor:
    """``[R]`` float32 uniforms in ``[0, 1)`` with 24 random bits; ``u[r]`` depends only on ``keys[r]`` and
    ``step``."""
    h = mix32(keys ^ mix32(step & _M32))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def top_k_top_p_mask(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which tokens survive top-k then top-p (nucleus) filtering, per row.

    probs ``[R, V]`` (need not sum to 1); top_k ``[R]`` int64 (``>= V`` keeps all); top_p ``[R]`` float in
    ``(0, 1]``. Top-k keeps the k most likely tokens; top-p then keeps the smallest prefix of those, by
    decreasing probability, whose mass reaches ``top_p`` of the remaining mass: token j is kept when the
    mass strictly above it is ``< top_p * total``. Rows with neither filter active keep every token
    exactly, so a row's result never depends on its neighbours. Returns ``[R, V]`` bool.
    """
    vocab = probs.shape[-1]
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    keep = torch.arange(vocab, device=probs.device)[None, :] < top_k[:, None]
    sorted_p = sorted_p * keep
    mass_above = sorted_p.cumsum(-1) - sorted_p
    keep &= mass_above < top_p[:, None] * sorted_p.sum(-1, keepdim=True)
    keep[:, 0] = True
    mask = torch.zeros_like(keep).scatter_(-1, order, keep)
    inactive = (top_k >= vocab) & (top_p >= 1.0)
    return mask | inactive[:, None]


def sample_next(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    keys: torch.Tensor,
    step: int,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    stop_ids: torch.Tensor | None = None,
    suppress: torch.Tensor | None = None,
    never: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the next token of every row, and its log-prob.

    logits ``[R, V]`` float32; temperature ``[R]`` (0: greedy); keys ``[R]`` from :func:`row_keys`;
    step: index of the token being drawn within its sample; top_k/top_p ``[R]`` or None when no row
    filters; stop_ids ``[R, S]`` each row's stop ids (a short row repeats one of its ids) and suppress
    ``[R]`` bool, the rows whose stop ids may not be picked now (before ``min_new_tokens``); never: an id
    no row may pick (a vision-language model's image token, which only images may fill).

    Sampling is by inverse CDF over the unnormalised probabilities: token = first j with
    ``cdf[j] > u * cdf[-1]``, ``u`` from :func:`counter_uniform`. The log-prob is
    ``log_softmax(logits / T)[token]`` (T = 1 for greedy rows), taken before suppression and filtering:
    the quantity a trainer recomputes from the same weights. Returns (tokens ``[R]`` int64, logprobs
    ``[R]`` float32).
    """
    greedy = temperature <= 0
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
    probs = logp.exp()
    if suppress is not None:
        # zero the stop ids of suppressed rows; repeated ids write the same value, so order is irrelevant
        kept = probs.gather(1, stop_ids) * (~suppress)[:, None]
        probs = probs.scatter(1, stop_ids, kept)
    if never is not None:
        probs[:, never] = 0.0
    if top_k is not None or top_p is not None:
        rows, vocab = logits.shape
        k = top_k if top_k is not None else torch.full((rows,), vocab, device=logits.device)
        p = top_p if top_p is not None else torch.ones(rows, device=logits.device)
        probs = probs * top_k_top_p_mask(probs, k, p)
    cdf = probs.cumsum(dim=-1)
    u = counter_uniform(keys, step) * cdf[:, -1]
    tokens = torch.searchsorted(cdf, u[:, None], right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)
    if bool(greedy.any()):
        tokens = torch.where(greedy, probs.argmax(dim=-1), tokens)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def sample_seeds(params: SamplingParams) -> list[int]:
    """The seed of each of the ``n`` samples: ``derive_seed(params.seed, i)``. An unseeded request draws
    its base seed at random, so its samples still differ from each other."""
    base = params.seed if params.seed is not None else random.getrandbits(63)
    return [derive_seed(base, i) for i in range(params.n)]


def check_requests(requests: Sequence[GenerationRequest], vocab_size: int | None = None) -> None:
    """Raise ValueError naming the request and field at fault; engines call this before any work."""
    for i, req in enumerate(requests):
        where = f"generation request {i}"
        if not isinstance(req, GenerationRequest):
            raise TypeError(f"{where}: expected GenerationRequest, got {type(req).__name__}")
        ids, p = req.prompt_ids, req.params
        if len(ids) == 0:
            raise ValueError(f"{where}: prompt_ids is empty (a prompt needs at least one token)")
        if vocab_size is not None:
            if bad := [t for t in ids if not 0 <= t < vocab_size]:
                raise ValueError(
                    f"{where}: prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
                )
            if bad := [t for t in p.stop_token_ids if not 0 <= t < vocab_size]:
                raise ValueError(
                    f"{where}: stop_token_ids has {bad[0]}, outside the vocabulary [0, {vocab_size})"
                )
        for ok, name, rule in (
            (p.n >= 1, "n", ">= 1"),
            (p.temperature >= 0 and math.isfinite(p.temperature), "temperature", "a finite number >= 0"),
            (0 < p.top_p <= 1, "top_p", "in (0, 1]"),
            (p.top_k >= -1, "top_k", ">= -1 (0 or -1 disable it)"),
            (p.max_new_tokens >= 1, "max_new_tokens", ">= 1"),
            (
                0 <= p.min_new_tokens <= p.max_new_tokens,
                "min_new_tokens",
                f"in [0, max_new_tokens={p.max_new_tokens}]",
            ),
        ):
            if not ok:
                raise ValueError(f"{where}: {name} must be {rule}, got {getattr(p, name)}")
