"""Dataset readers, mixing, and prompt / chat-template formatting, shared by every trainer.

Every row keeps where it came from (:class:`Row`), so that a bad row fails naming the file, the row and the
key, or is skipped and counted (``--data.skip_bad_rows``). Formats: rlhf-core's README; a directory is a
dataset saved with ``datasets``' ``save_to_disk`` (a ``DatasetDict`` is indexed by split), or a folder of
data files whose names start with the split (``train.jsonl``, ``data/train-00000.parquet``; when no file
names a split, all of them are the ``train`` split). Anything else is a hub dataset name (from the local
cache when offline); ``name@dir`` reads only its subdirectory ``dir`` (``data_dir``), as in OpenRLHF.
"""

from __future__ import annotations

import csv
import itertools
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rlhf_core.errors import UserError

FILE_FORMATS = (".jsonl", ".json", ".parquet", ".csv", ".arrow")
SPLIT_NAMES = ("train", "test", "validation", "valid", "dev", "eval")
OVERLONG_POLICIES = ("error", "skip", "truncate_left")


class DataError(UserError, ValueError):
    """A dataset problem; the message names the file, row, key or flag at fault."""


@dataclass(frozen=True)
class Row:
    """One dataset row and where it came from."""

    data: dict[str, Any]
    file: str
    index: int
    """0-based row index inside ``file`` (for JSON lines: the line number, counting from 0)."""

    def where(self) -> str:
        return f"{self.file} row {self.index}"


@dataclass
class DataStats:
    """Counts of rows that were not used as they are; trainers log them as ``data/<name>``."""

    counts: Counter = field(default_factory=Counter)

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def as_metrics(self) -> dict[str, float]:
        return {f"data/{k}": float(v) for k, v in sorted(self.counts.items())}


# --- reading ---------------------------------------------------------------------------------------------


def _rows(records: Any, where: str) -> list[Row]:
    return [Row(r, where, i) for i, r in enumerate(records)]


def _read_jsonl(path: Path) -> list[Row]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path} row {i}: not valid JSON ({exc.msg})") from None
            rows.append(Row(_as_dict(obj, path, i), str(path), i))
    return rows


def _as_dict(obj: Any, path: Path, i: int) -> dict:
    if not isinstance(obj, dict):
        raise DataError(f"{path} row {i}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _read_json(path: Path, split: str) -> list[Row]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return _read_jsonl(path)  # HF's "json" loader also accepts JSON lines in a .json file
    if isinstance(obj, dict) and isinstance(obj.get(split), list):
        obj = obj[split]
    if not isinstance(obj, list):
        raise DataError(f"{path}: expected a list of objects (or a {{{split!r}: [...]}} mapping)")
    return [Row(_as_dict(o, path, i), str(path), i) for i, o in enumerate(obj)]


def _read_file(path: Path, split: str) -> list[Row]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".json":
        return _read_json(path, split)
    if suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            return _rows(csv.DictReader(f), str(path))
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return _rows(pq.read_table(path).to_pylist(), str(path))
    if suffix == ".arrow":
        import datasets

        return _rows(datasets.Dataset.from_file(str(path)), str(path))
    raise DataError(f"{path}: unsupported file type {suffix!r}; supported: {', '.join(FILE_FORMATS)}")


def _read_dir(path: Path, split: str) -> list[Row]:
    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        import datasets

        ds, where = datasets.load_from_disk(str(path)), str(path)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"{path}: no split {split!r}; it has {', '.join(ds)}")
            ds, where = ds[split], f"{path}[{split}]"
        return _rows(ds, where)
    data_files = sorted(p for p in path.rglob("*") if p.suffix.lower() in FILE_FORMATS)
    files = [p for p in data_files if p.name.startswith(split)]
    if split == "train" and not any(p.name.startswith(SPLIT_NAMES) for p in data_files):
        files = data_files  # the rule of datasets.load_dataset: no split in the names means all is train
    if not files:
        raise DataError(
            f"{path}: no data files for split {split!r} (looked for "
            f"{split}*{{{','.join(FILE_FORMATS)}}}, or a dataset saved with save_to_disk)"
        )
    return [row for f in files for row in _read_file(f, split)]


def _read_hub(name: str, data_dir: str | None, split: str) -> list[Row]:
    import datasets

    shown = f"{name}@{data_dir}" if data_dir else name
    try:
        ds = datasets.load_dataset(name, data_dir=data_dir)
    except Exception as exc:  # the hub, the network or the cache: the reason is in the message
        offline = (
            " (offline mode: only datasets already in the cache load)"
            if (datasets.config.HF_HUB_OFFLINE or datasets.config.HF_DATASETS_OFFLINE)
            else ""
        )
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        raise DataError(
            f"dataset {shown!r} is not a local file or directory, and datasets.load_dataset "
            f"could not load it from the Hugging Face hub{offline}: {type(exc).__name__}: "
            f"{first_line} (cache: {datasets.config.HF_DATASETS_CACHE})"
        ) from None
    if split not in ds:
        raise DataError(f"dataset {shown!r}: no split {split!r}; it has {', '.join(ds)}")
    return _rows(ds[split], f"{shown}[{split}]")


def read_rows(path_or_dir: str | Path, split: str = "train") -> list[Row]:
    """Every row of a data file, a local dataset directory or a hub dataset (``name`` or ``name@dir``, see the
    module docstring), each with where it came from and its row index."""
    path = Path(path_or_dir).expanduser()
    if path.exists():
        return _read_dir(path, split) if path.is_dir() else _read_file(path, split)
    name, _, data_dir = str(path_or_dir).partition("@")
    if data_dir and (base := Path(name).expanduser()).is_dir():
        if not (base / data_dir).is_dir():
            raise DataError(f"dataset not found: {path_or_dir} (no directory {data_dir!r} in {name})")
        return _read_dir(base / data_dir, split)
    if Path(name).suffix.lower() in FILE_FORMATS or name.startswith((".", "/", "~")) or not name:
        raise DataError(f"dataset not found: {path_or_dir} (no such file or directory)")
    return _read_hub(name, data_dir or None, split)


def mix_rows(
    sources: Sequence[Sequence[Row]],
    probs: Sequence[float] | None = None,
    seed: int = 0,
    max_samples: int | None = None,
) -> list[Row]:
    """Mix several datasets into ``min(sum of sizes, max_samples)`` rows: each picks its source with
    probability ``probs[k]`` (normalised); a source is read in a seeded random order and starts over when
    exhausted (so a small, highly weighted set is repeated). One source, or no ``probs``: concatenation.
    """
    total = sum(len(s) for s in sources)
    limit = total if max_samples is None else min(total, max_samples)
    if probs is None or len(sources) == 1:
        return [row for s in sources for row in s][:limit]
    if len(probs) != len(sources):
        raise DataError(f"--data.dataset_probs has {len(probs)} values for {len(sources)} datasets")
    p = np.asarray(probs, dtype=np.float64)
    if (p < 0).any() or p.sum() <= 0:
        raise DataError(f"--data.dataset_probs must be non-negative and not all zero, got {list(probs)}")
    for k, s in enumerate(sources):
        if p[k] > 0 and not s:
            raise DataError(f"dataset {k} is empty but has mixing probability {probs[k]}")
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(sources), size=limit, p=p / p.sum())
    orders = [itertools.cycle(rng.permutation(len(s))) for s in sources]
    return [sources[k][next(orders[k])] for k in picks]


def load_rows(
    paths: Sequence[str],
    probs: Sequence[float] | None = None,
    split: str = "train",
    seed: int = 0,
    max_samples: int | None = None,
) -> list[Row]:
    """Read and mix ``paths`` (see :func:`read_rows` and :func:`mix_rows`)."""
    if not paths:
        raise DataError("no dataset given (--data.dataset)")
    return mix_rows([read_rows(p, split) for p in paths], probs, seed, max_samples)


# --- fields and prompts ------------------------------------------------------------------------------------


def get_field(row: Row, key: str, types: type | tuple[type, ...] = str, flag: str | None = None) -> Any:
    """``row.data[key]``, checked to be an instance of ``types``; a :class:`DataError` naming file, row and
    key (and the flag that named the key) otherwise."""
    named = f" (set by {flag})" if flag else ""
    if (value := row.data.get(key)) is None:
        have = ", ".join(map(str, row.data)) or "none"
        raise DataError(f"{row.where()}: missing key {key!r}{named}; the row has keys: {have}")
    if not isinstance(value, types):
        want = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise DataError(f"{row.where()}: key {key!r}{named} should be {want}, got {type(value).__name__}")
    return value


def check_messages(messages: Any, row: Row, key: str, parts: bool = False) -> list[dict]:
    """A conversation: a list of ``{"role": str, "content": str}``; DataError naming the row otherwise.

    With ``parts`` (prompts with images) a content may also be a list of ``{"type": "text", "text": str}``
    and ``{"type": "image"}`` items, as vision-language chat templates take them."""

    def content_ok(c: Any) -> bool:
        return (
            isinstance(c, str)
            or parts
            and isinstance(c, list)
            and all(
                isinstance(x, dict)
                and (x.get("type") == "image" or (x.get("type") == "text" and isinstance(x.get("text"), str)))
                for x in c
            )
        )

    ok = isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and content_ok(m.get("content"))
        for m in messages
    )
    if not ok or not messages:
        kind = "a str or a list of {'type': 'text'|'image'} items" if parts else "a str"
        raise DataError(
            f"{row.where()}: key {key!r} should be a list of {{'role', 'content'}} messages, each "
            f"content {kind}"
        )
    return messages


def render_prompt(
    tokenizer: Any,
    prompt: str | list[dict],
    input_template: str | None = None,
    apply_chat_template: bool = False,
) -> str:
    """The prompt text a model sees: with ``apply_chat_template`` the tokenizer's chat template with the
    generation prompt (a string becomes one user message), else ``input_template`` (``{}`` marks the prompt)
    around the string, else the string.
    """
    if apply_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(prompt, str):
        raise DataError("a conversation (list of messages) needs --data.apply_chat_template")
    if input_template:
        if "{}" not in input_template:
            raise DataError(
                f"--data.input_template must contain '{{}}' for the prompt, got {input_template!r}"
            )
        return input_template.format(prompt)
    return prompt


def load_tokenizer(path: str, data: Any) -> Any:
    """The tokenizer of the model at ``path``, its chat template replaced by ``--data.tokenizer_chat_template``
    when ``data`` sets one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if data.tokenizer_chat_template:
        tokenizer.chat_template = data.tokenizer_chat_template
    return tokenizer


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens added (templates carry their own)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def conversation_ids(tokenizer: Any, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation and a loss mask that is 1 on assistant turns only: turn ``k`` covers
    the tokens between the renderings of ``messages[:k]`` (with the generation prompt) and ``messages[:k+1]``.
    A chat template whose renderings of prefixes are not prefixes (common ones are) fails with a DataError
    rather than masking the wrong tokens.
    """

    def ids_of(msgs: list[dict], gen: bool) -> list[int]:
        return encode(
            tokenizer, tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        )

    full = ids_of(messages, False)
    mask = [0] * len(full)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(ids_of(messages[:k], True))
        end_ids = ids_of(messages[: k + 1], False)
        if full[: len(end_ids)] != end_ids:
            raise DataError("the chat template does not render conversation prefixes as prefixes")
        mask[start : len(end_ids)] = [1] * (len(end_ids) - start)
    return full, mask


def fit_prompt(
    ids: list[int], budget: int, policy: str, where: str, stats: DataStats | None = None
) -> list[int] | None:
    """The prompt ``ids`` as ``--data.overlong_prompt_policy`` leaves it with ``budget`` tokens allowed:
    ``error`` raises a DataError naming ``where`` (file and row), ``skip`` returns None, ``truncate_left``
    keeps the last ``budget`` tokens (both counted in ``stats``). A prompt within budget comes back unchanged.
    """
    if policy not in OVERLONG_POLICIES:
        raise DataError(f"--data.overlong_prompt_policy must be one of {OVERLONG_POLICIES}, got {policy!r}")
    if len(ids) <= budget:
        return ids
    if policy == "error":
        raise DataError(
            f"{where}: prompt has {len(ids)} tokens, more than the {budget} allowed "
            "(--data.max_len / --data.prompt_max_len); set --data.overlong_prompt_policy skip or "
            "truncate_left to go on"
        )
    if stats is not None:
        stats.add("overlong_prompts_skipped" if policy == "skip" else "overlong_prompts_truncated")
    return None if policy == "skip" else ids[len(ids) - budget :]
