"""The HF engine's decode loop over one batch of samples: left-padded prefill (each distinct prompt once), then
one token per step, sampled on the device (:mod:`rlhf_core.rollout.sampling`), through :func:`decode_token` with
a KV cache that grows in place (rows that finish are dropped from time to time), through a
:class:`StaticDecoder` (fixed shapes, a CUDA graph on a GPU; no row dropped), or through the model's own forward
(the generic path).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Set

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from rlhf_core.moe import ExpertRecorder
from rlhf_core.rollout.decode import GrowingKVLayer, StaticDecoder, decode_token
from rlhf_core.rollout.sampling import row_keys, sample_next
from rlhf_core.types import GenerationOutput
from rlhf_core.vision import image_forward_inputs


def decode_rows(
    model: torch.nn.Module,
    rows: list[tuple],
    *,
    forward: Callable[..., torch.Tensor],
    fast_path: bool,
    plan: dict | None,
    weights: dict | None,
    eos_token_ids: Set[int],
    max_positions: int | None,
    image_token_id: int | None,
    static: Callable[[int, int], StaticDecoder] | None = None,
    experts: ExpertRecorder | None = None,
) -> list[GenerationOutput]:
    """Decode one batch of samples; ``rows`` are (prompt ids, SamplingParams, seed, images). ``forward``: the
    engine's model call (logits ``[R, V]`` of the last position); ``fast_path``: the engine's own attention and
    preallocated cache; ``plan``/``weights``: :func:`decode_plan` and :func:`decode_weights` when decode reads
    the weights directly (else None); ``static(rows, capacity)``: the :class:`StaticDecoder` to decode with
    (needs ``plan``), or None for the growing cache; ``experts``: an MoE model's routing, recorded into each
    output (the generic path)."""
    dev = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    n_rows = len(rows)
    prompt_lens = [len(row[0]) for row in rows]
    width = max(prompt_lens)  # prompts are left-padded to this many columns
    # a sample stops at the model's last position (finish reason "length")
    limit = max_positions or math.inf
    max_new = [int(min(p.max_new_tokens, limit - len(ids))) for ids, p, *_ in rows]
    steps = max(max_new)

    ids = torch.tensor([[0] * (width - len(prompt)) + list(prompt) for prompt, *_ in rows])
    params = [row[1] for row in rows]
    # [R, S] each row's stop ids (EOS and stop_token_ids); a shorter row repeats its first id
    stops = [[] if p.ignore_eos else sorted(eos_token_ids | set(p.stop_token_ids)) for p in params]
    n_stops = max(1, *map(len, stops))
    stop_ids = torch.tensor([(row + row[:1] * n_stops or [0] * n_stops)[:n_stops] for row in stops])
    filtering = any(p.top_k > 0 or p.top_p < 1 for p in params)
    max_min_new = max(p.min_new_tokens for p in params)
    # Everything indexed by batch slot; slots of finished samples are dropped together from time to time.
    slots = {
        "row": torch.arange(n_rows),
        "prompt_len": torch.tensor(prompt_lens),
        "temperature": torch.tensor([p.temperature for p in params], dtype=torch.float32),
        "top_k": torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params]),
        "top_p": torch.tensor([p.top_p for p in params], dtype=torch.float32),
        "min_new": torch.tensor([p.min_new_tokens for p in params]),
        "max_new": torch.tensor(max_new),
        "keys": row_keys(torch.tensor([row[2] for row in rows], dtype=torch.long)),
        "stop_ids": stop_ids,
        "has_stops": torch.tensor([bool(x) for x in stops]),
        "live": torch.ones(n_rows, dtype=torch.bool),
    }
    pad = width - slots["prompt_len"]
    columns = torch.arange(width)
    key_valid = columns[None, :] >= pad[:, None]  # [R, width]: False on left padding
    positions = (columns[None, :] - pad[:, None]).clamp(min=0)
    dtype = next(model.parameters()).dtype
    plan = plan if fast_path else None
    decoder = static(n_rows, width + steps) if static is not None and plan is not None else None
    if fast_path:
        # the prefill's keys and values; a static decoder copies them into its own cache
        capacity = width if decoder is not None else width + steps
        layers = model.config.get_text_config().num_hidden_layers
        cache: Cache = Cache(layers=[GrowingKVLayer(capacity) for _ in range(layers)])
        # Prefill: a query sees valid keys at or before it (padding queries see themselves, which keeps
        # their rows finite); without padding, plain causal attention. Decode: an additive row mask.
        prefill_mask = None
        if not bool(key_valid.all()):
            prefill_mask = (
                torch.tril(torch.ones(width, width, dtype=torch.bool))[None] & key_valid[:, None, :]
            )
            prefill_mask = (prefill_mask | torch.eye(width, dtype=torch.bool)[None])[:, None]
        slots["mask"] = torch.zeros(n_rows, 1, 1, width + steps, dtype=dtype)
        slots["mask"][:, 0, 0, :width].masked_fill_(~key_valid, -math.inf)
    else:
        cache = DynamicCache(config=model.config)
        slots["mask"] = torch.ones(n_rows, width + steps, dtype=torch.long)
        slots["mask"][:, :width] = key_valid.long()
        prefill_mask = slots["mask"][:, :width]
    if plan is not None and decoder is None:  # cos/sin of every position a row can reach, computed once
        rope = plan["inner"].rotary_emb
        table = torch.arange(width + steps, device=dev)[None]
        cos, sin = (x[0] for x in rope(torch.zeros((), dtype=dtype, device=dev), table))
    s = {k: v.to(dev) for k, v in slots.items()}  # the slots, on the device

    tokens = torch.zeros(n_rows, steps, dtype=torch.long, device=dev)
    logprobs = torch.zeros(n_rows, steps, dtype=torch.float32, device=dev)
    lengths = torch.zeros(n_rows, dtype=torch.long, device=dev)
    stopped = torch.zeros(n_rows, dtype=torch.bool, device=dev)

    # The samples of a prompt share its prefill: each distinct prompt (ids and images) runs once (row
    # `first[k]`), then its cache rows and last logits are copied to every sample (row r takes `source[r]`).
    distinct: dict[tuple, int] = {}
    source = [distinct.setdefault((tuple(row[0]), *map(id, row[3])), len(distinct)) for row in rows]
    first = torch.tensor([source.index(k) for k in range(len(distinct))])
    source = torch.tensor(source, device=dev)
    prefill_mask = None if prefill_mask is None else prefill_mask[first].to(dev)
    prefill_positions = positions[first].to(dev)
    images = {}
    if image_token_id is not None:
        # M-RoPE positions over the images' grids; a row's text continues at prompt_len + offset
        images, offsets = image_forward_inputs(
            model,
            ids[first].to(dev),
            key_valid[first].long().to(dev),
            [rows[k][3] for k in first.tolist()],
        )
        prefill_positions = images.pop("position_ids")
        s["rope_offset"] = offsets[:, 0][source]
    logits = forward(ids[first].to(dev), prefill_positions, prefill_mask, cache, **images)
    if len(distinct) < n_rows:
        cache.batch_select_indices(source)
        logits = logits[source]
    if decoder is not None:
        decoder.start(cache, key_valid.to(dev), pad.to(dev))
    if experts is not None:  # the prompt's routing from the prefill; token t's from decode step t
        picked = experts.take().cpu().unflatten(1, (len(distinct), width))  # [layers, D, width, k]
        prompt_experts = [picked[:, k, p:] for k, p in zip(source.tolist(), pad.tolist(), strict=True)]
        generated = torch.full((picked.shape[0], n_rows, steps, picked.shape[-1]), -1, dtype=picked.dtype)
    for t in range(steps):
        tok, lp = sample_next(
            logits,
            s["temperature"],
            s["keys"],
            t,
            top_k=s["top_k"] if filtering else None,
            top_p=s["top_p"] if filtering else None,
            stop_ids=s["stop_ids"],
            suppress=(t < s["min_new"]) & s["has_stops"] if t < max_min_new else None,
            never=image_token_id,
        )
        live = s["live"]
        tokens[s["row"], t] = tok
        logprobs[s["row"], t] = lp
        lengths[s["row"]] += live.long()
        hit_stop = (s["stop_ids"] == tok[:, None]).any(1) & s["has_stops"] & live
        stopped[s["row"]] |= hit_stop
        s["live"] = live = live & ~hit_stop & (t + 1 < s["max_new"])
        if (n_live := int(live.sum())) == 0:
            break
        if decoder is None and n_live <= len(live) // 2 and len(live) >= 8:
            keep = live.nonzero().squeeze(1)
            s = {k: v[keep] for k, v in s.items()}
            cache.batch_select_indices(keep)
            tok = tok[keep]
        mask = s["mask"][..., : width + t + 1]
        position = s["prompt_len"] + t
        if "rope_offset" in s:  # the same next position on M-RoPE's three axes
            position = (position + s["rope_offset"])[None].expand(3, -1)
        if decoder is not None:
            logits = decoder.step(tok)
        elif plan is not None:
            logits = decode_token(plan, tok, cos[position], sin[position], mask, cache, weights)
        else:
            logits = forward(tok[:, None], position[..., None], mask, cache)
            if experts is not None:
                generated[:, s["row"].cpu(), t] = experts.take().cpu()

    outs = [
        GenerationOutput(toks[:n], lps[:n], "stop" if is_stop else "length")
        for toks, lps, n, is_stop in zip(
            tokens.tolist(), logprobs.tolist(), lengths.tolist(), stopped.tolist(), strict=True
        )
    ]
    for r, out in enumerate(outs if experts is not None else []):
        n = len(out.token_ids)
        out.routed_experts = torch.cat([prompt_experts[r], generated[:, r, :n]], 1).transpose(0, 1)
    return outs
