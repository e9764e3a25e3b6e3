"""Dataset rows -> token-id examples for SFT, RM, DPO, KTO, PRM and KD, and examples -> micro-batches. Each
example keeps its prompt and response ids apart, so the loss covers the response only; a PRM example is a
whole text with the positions of its step markers and their labels. The columns each mode reads, and what
becomes of bad rows and overlong prompts, are in this package's README."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_core.batches import KTOBatch, PairBatch, PRMBatch, SequenceBatch, make_sequence_batch
from rlhf_core.data import (
    DataError,
    DataStats,
    Row,
    check_messages,
    conversation_ids,
    encode,
    fit_prompt,
    get_field,
    render_prompt,
)
from rlhf_core.supervised import PRMTokens


@dataclass
class Example:
    prompt: list[int]
    response: list[int]
    response_mask: list[int] | None = None
    """1 on trained response tokens (multi-turn SFT masks user turns); None: all."""


@dataclass
class PairExample:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    margin: float = 0.0


@dataclass
class KTOExample:
    prompt: list[int]
    completion: list[int]
    desirable: bool


@dataclass
class PRMExample:
    ids: list[int]
    positions: list[int]
    """Token index of each step marker."""
    classes: list[int]
    soft_labels: list[float]
    """NaN for a hard label."""


def _with_eos(tokenizer, text: str) -> list[int]:
    ids, eos = encode(tokenizer, text), tokenizer.eos_token_id
    return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def _fit(prompt: list[int], responses: list[list[int]], data, where: str, stats: DataStats, make, *extra):
    """Apply the prompt budget (``max_len - 1``: one response token at least) and cut responses to fit;
    ``make(prompt, *responses, *extra)``, or None where ``--data.overlong_prompt_policy`` drops the row."""
    prompt = fit_prompt(prompt, data.max_len - 1, data.overlong_prompt_policy, where, stats)
    if prompt is None:
        return None
    room = data.max_len - len(prompt)
    truncated = sum(len(r) > room for r in responses)
    if truncated:
        stats.add("responses_truncated", truncated)
    return make(prompt, *[r[:room] for r in responses], *extra)


def _prompt_ids(tokenizer, text: str) -> list[int]:
    ids = encode(tokenizer, text)
    # An empty prompt still needs one token to predict the first response token from.
    return ids or [tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id]


def _chat_response(tokenizer, prompt: str | list[dict], answer: str, prompt_text: str, where: str) -> str:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    full = tokenizer.apply_chat_template(
        messages + [{"role": "assistant", "content": answer}], tokenize=False
    )
    if not full.startswith(prompt_text):
        raise DataError(
            f"{where}: the chat template does not render the prompt as a prefix of the conversation"
        )
    return full[len(prompt_text) :]


def build_examples(
    mode: str, rows: list[Row], tokenizer, cfg, stats: DataStats, prm: PRMTokens | None = None
) -> list:
    """Turn dataset rows into examples for ``mode`` (``sft``, ``rm``, ``dpo``, ``kto``, ``prm``, ``kd``);
    ``prm`` holds the PRM's resolved tokens."""
    data, model = cfg.data, cfg.model
    mode = "sft" if mode == "kd" else mode  # distillation reads SFT data
    out = []
    for row in rows:
        try:  # a PRM row is read and tokenized at once
            if mode == "prm":
                fields = _prm_example(row, tokenizer, data, prm, stats)
            else:
                fields = _read_fields(mode, row, data, model)
        except DataError:
            if not data.skip_bad_rows:
                raise
            stats.add("bad_rows_skipped")
            continue
        example = fields if mode == "prm" else _tokenize(mode, fields, row.where(), tokenizer, cfg, stats)
        if example is not None:
            out.append(example)
    return out


def _prm_example(row: Row, tokenizer, data, prm: PRMTokens, stats: DataStats) -> PRMExample | None:
    """A text with ``prm.placeholder`` after every step, and one label per step (a reward token, or with
    two reward tokens a probability of the positive one). Texts longer than ``--data.max_len`` tokens are
    cut, with the labels of the markers cut off (counted as ``data/prm_steps_truncated``)."""
    where = row.where()
    label_key = data.label_key or "label"
    text = get_field(row, data.input_key, str, "--data.input_key")
    labels = get_field(row, label_key, list, "--data.label_key")
    ids = encode(tokenizer, text)
    positions = [i for i, t in enumerate(ids) if t == prm.placeholder_id]
    # a marker glued to its neighbours tokenizes into other tokens and goes missing
    merged = (
        ""
        if text.count(prm.placeholder) <= len(positions)
        else (
            f"; {prm.placeholder!r} appears {text.count(prm.placeholder)} times in the text, so it merges with the "
            "text around it: put a space on each side"
        )
    )
    if not positions:
        raise DataError(
            f"{where}: key {data.input_key!r} has no placeholder token {prm.placeholder!r} "
            f"(--prm.placeholder_token), so none of its {len(labels)} labels has a step to go "
            f"to{merged}"
        )
    if len(positions) != len(labels):
        raise DataError(
            f"{where}: {len(positions)} steps marked with {prm.placeholder!r} but {len(labels)} "
            f"labels in key {label_key!r}: give one label per step{merged}"
        )
    classes, soft = zip(
        *[
            _prm_label(label, prm, tokenizer, f"{where}: step {k} label {label!r} (key {label_key!r})")
            for k, label in enumerate(labels)
        ],
        strict=True,
    )
    kept = sum(1 for p in positions if p < data.max_len)
    if kept < len(positions):
        stats.add("prm_steps_truncated", len(positions) - kept)
        if kept == 0:
            stats.add("prm_rows_without_steps")
            return None
    return PRMExample(ids[: data.max_len], positions[:kept], list(classes[:kept]), list(soft[:kept]))


def _prm_label(label, prm: PRMTokens, tokenizer, where: str) -> tuple[int, float]:
    """``(class, soft label)`` of one step: the class indexes the reward tokens (or is a vocabulary id)."""
    nan = float("nan")
    if isinstance(label, str):
        if prm.reward_tokens is None:
            ids = encode(tokenizer, label)
            if len(ids) != 1:
                raise DataError(f"{where} is {len(ids)} tokens; a hard label must be one token")
            return ids[0], nan
        if label not in prm.reward_tokens:
            raise DataError(f"{where} is not one of --prm.reward_tokens {prm.reward_tokens}")
        return prm.reward_tokens.index(label), nan
    if isinstance(label, (int, float)) and not isinstance(label, bool):
        if prm.reward_ids is None or len(prm.reward_ids) != 2:
            raise DataError(
                f"{where}: a soft (number) label needs exactly two --prm.reward_tokens, positive first"
            )
        if not 0.0 <= label <= 1.0:
            raise DataError(f"{where}: a soft label is the probability of the positive token, in [0, 1]")
        return (0 if label >= 0.5 else 1), float(label)
    raise DataError(f"{where}: a label is a reward token (string) or a probability (number)")


def _read_fields(mode: str, row: Row, data, model) -> dict:
    """The raw values a mode needs, type-checked (a DataError names the file, row and key)."""
    text_or_chat = (str, list) if data.apply_chat_template or data.multiturn else str
    if mode == "sft":
        if data.multiturn:
            return {
                "messages": check_messages(
                    get_field(row, data.input_key, list, "--data.input_key"), row, data.input_key
                )
            }
        prompt = get_field(row, data.input_key, text_or_chat, "--data.input_key")
        if model.pretrain_mode_enable:
            extra = get_field(row, data.output_key, str, "--data.output_key") if data.output_key else ""
            return {"text": prompt if not extra else f"{prompt} {extra}"}
        if not data.output_key:
            raise DataError(
                "SFT needs --data.output_key (or --data.multiturn, or --model.pretrain_mode_enable)"
            )
        return {"prompt": prompt, "response": get_field(row, data.output_key, str, "--data.output_key")}
    if mode in ("rm", "dpo"):
        return {
            "prompt": get_field(row, data.prompt_key, text_or_chat, "--data.prompt_key")
            if data.prompt_key
            else "",
            "chosen": get_field(row, data.chosen_key, text_or_chat, "--data.chosen_key"),
            "rejected": get_field(row, data.rejected_key, text_or_chat, "--data.rejected_key"),
            "margin": float(get_field(row, "margin", (int, float), "--model.margin_loss_enable"))
            if model.margin_loss_enable
            else 0.0,
        }
    if mode == "kto":
        if not data.output_key:
            raise DataError("KTO needs --data.output_key (the completion column)")
        return {
            "prompt": get_field(row, data.input_key, text_or_chat, "--data.input_key"),
            "completion": get_field(row, data.output_key, str, "--data.output_key"),
            "desirable": get_field(row, data.label_kto_key, bool, "--data.label_kto_key"),
        }
    raise ValueError(f"unknown supervised mode {mode!r}")


def _tokenize(mode: str, f: dict, where: str, tokenizer, cfg, stats: DataStats):
    data = cfg.data
    if mode == "sft":
        if "messages" in f:
            ids, mask = conversation_ids(tokenizer, f["messages"])
            if 1 not in mask:
                stats.add("rows_without_assistant_turn")
                return None
            p = max(1, mask.index(1))
            return _fit(
                ids[:p],
                [ids[p:]],
                data,
                where,
                stats,
                lambda prompt, resp: Example(prompt, resp, mask[p : p + len(resp)]),
            )
        if "text" in f:
            ids = _with_eos(tokenizer, f["text"])
            return _fit(ids[:1], [ids[1:]], data, where, stats, Example)
        prompt_text = render_prompt(tokenizer, f["prompt"], data.input_template, data.apply_chat_template)
        if data.apply_chat_template:
            response = encode(
                tokenizer, _chat_response(tokenizer, f["prompt"], f["response"], prompt_text, where)
            )
        else:
            response = _with_eos(tokenizer, f["response"])
        return _fit(_prompt_ids(tokenizer, prompt_text), [response], data, where, stats, Example)
    if mode in ("rm", "dpo"):
        prompt_text = (
            render_prompt(tokenizer, f["prompt"], data.input_template, data.apply_chat_template)
            if f["prompt"]
            else ""
        )
        responses = []
        for key in ("chosen", "rejected"):
            value = f[key]
            if isinstance(value, list):  # a whole conversation: the prompt is everything but the last turn
                messages = check_messages(value, Row({}, where, -1), key)
                prompt_text = (
                    render_prompt(tokenizer, messages[:-1], None, True) if len(messages) > 1 else prompt_text
                )
                text = _chat_response(tokenizer, messages[:-1], messages[-1]["content"], prompt_text, where)
            elif data.apply_chat_template:
                text = _chat_response(tokenizer, f["prompt"], value, prompt_text, where)
            else:
                text = value if not prompt_text else " " + value
            if tokenizer.eos_token and text.rstrip().endswith(tokenizer.eos_token):
                # a chat turn ends "<eos>\n": the response ends at its EOS (where a reward model is read), not
                # at a second EOS appended after the newline
                text = text.rstrip()
            responses.append(_with_eos(tokenizer, text))
        return _fit(
            _prompt_ids(tokenizer, prompt_text), responses, data, where, stats, PairExample, f["margin"]
        )
    prompt_text = render_prompt(tokenizer, f["prompt"], data.input_template, data.apply_chat_template)
    return _fit(
        _prompt_ids(tokenizer, prompt_text),
        [_with_eos(tokenizer, f["completion"])],
        data,
        where,
        stats,
        KTOExample,
        f["desirable"],
    )


def collate(mode: str, examples: list, pad_token_id: int):
    """One micro-batch for ``mode`` from its examples."""
    if mode in ("sft", "kd"):
        masks = [e.response_mask if e.response_mask is not None else [1] * len(e.response) for e in examples]
        return make_sequence_batch(
            [e.prompt for e in examples], [e.response for e in examples], pad_token_id, masks
        )
    if mode in ("rm", "dpo"):
        prompts = [e.prompt for e in examples]
        return PairBatch(
            make_sequence_batch(prompts, [e.chosen for e in examples], pad_token_id),
            make_sequence_batch(prompts, [e.rejected for e in examples], pad_token_id),
            torch.tensor([e.margin for e in examples], dtype=torch.float32),
        )
    if mode == "prm":
        rows = [i for i, e in enumerate(examples) for _ in e.positions]
        return PRMBatch(
            make_sequence_batch([e.ids[:1] for e in examples], [e.ids[1:] for e in examples], pad_token_id),
            torch.tensor(rows, dtype=torch.long),
            torch.tensor([p for e in examples for p in e.positions], dtype=torch.long),
            torch.tensor([c for e in examples for c in e.classes], dtype=torch.long),
            torch.tensor([p for e in examples for p in e.soft_labels], dtype=torch.float32),
        )
    if mode == "kto":
        prompts = [e.prompt for e in examples]
        completions = [e.completion for e in examples]
        return KTOBatch(
            make_sequence_batch(prompts, completions, pad_token_id),
            torch.tensor([e.desirable for e in examples], dtype=torch.bool),
            make_sequence_batch(prompts, completions[1:] + completions[:1], pad_token_id),
        )
    raise ValueError(f"unknown supervised mode {mode!r}")


def step_counts(mode: str, micro_batches: list) -> dict[str, float]:
    """Global counts of one optimizer step: trained tokens (SFT, KD) or labelled steps (PRM), and sequences /
    pairs."""
    if mode == "prm":
        return {
            "num_tokens": float(sum(len(b.rows) for b in micro_batches)),
            "num_sequences": float(sum(len(b.seq) for b in micro_batches)),
        }
    if mode in ("sft", "kd"):
        mb: list[SequenceBatch] = micro_batches
        return {
            "num_tokens": float(sum(b.response_mask().sum() for b in mb)),
            "num_sequences": float(sum(len(b) for b in mb)),
        }
    n = sum(len(b.chosen) if isinstance(b, PairBatch) else len(b.seq) for b in micro_batches)
    return {"num_sequences": float(n)}


def batch_tokens(mode: str, micro_batches: list) -> int:
    """Non-pad tokens that go through the trained model in one step (for tokens/s)."""
    pair = ("chosen", "rejected")
    parts = {"rm": pair, "dpo": pair, "prm": ("seq",), "kto": ("seq", "kl_seq")}  # sft, kd: SequenceBatch
    seqs = [getattr(b, p) for b in micro_batches for p in parts[mode]] if mode in parts else micro_batches
    return sum(int(s.attention_mask.sum()) for s in seqs)
