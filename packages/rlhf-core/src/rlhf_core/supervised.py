"""Checks of ``rlhf train prm`` and ``rlhf train kd`` that need only tokenizers and model configs (when they
run: docs/prm-and-distillation.md). The PRM conventions live here because two packages share them: the
trainer (rlhf-train-deepspeed) and the PRM reward source (rlhf-agents), which reads the tokens a trained PRM
stores in its ``config.json``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from rlhf_core.data import encode
from rlhf_core.errors import UserError

PLACEHOLDER_KEY = "prm_placeholder_token"
REWARD_TOKENS_KEY = "prm_reward_tokens"
"""Keys of a PRM's ``config.json`` (written by ``rlhf train prm``): its step marker and reward tokens."""
PRM_AGGREGATIONS = ("min", "last", "mean", "prod")
"""How the PRM reward source turns step scores into a reward (``--reward.prm_aggregation``)."""


class SetupError(UserError, ValueError):
    """A flag, model or tokenizer that cannot work for the mode; the message names the flag."""


def is_prm_model(path: str | None) -> bool:
    """Whether ``path`` holds a PRM trained by ``rlhf train prm`` (its config stores a step marker). A hub id is
    looked up in the local cache only, so that an offline driver does not wait on retries (a PRM not
    downloaded yet needs ``--reward.source prm``)."""
    if not path:
        return False
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=not os.path.isdir(path))
        return bool(getattr(config, PLACEHOLDER_KEY, None))
    except (OSError, ValueError):
        return False


def single_token_id(tokenizer: Any, token: str, flag: str) -> int:
    """The id of ``token`` when the tokenizer encodes it as exactly one known token; SetupError otherwise."""
    ids = encode(tokenizer, token)
    if len(ids) != 1:
        raise SetupError(
            f"{flag} {token!r} is {len(ids)} tokens {ids} for this tokenizer; it must be exactly one"
        )
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and ids[0] == unk and token != getattr(tokenizer, "unk_token", None):
        raise SetupError(
            f"{flag} {token!r} is not in this tokenizer's vocabulary (it encodes as the unknown token)"
        )
    return ids[0]


@dataclass
class PRMTokens:
    placeholder: str
    placeholder_id: int
    reward_tokens: list[str] | None
    reward_ids: list[int] | None
    """None: hard labels over the whole vocabulary."""


def prm_tokens(tokenizer: Any, placeholder: str | None, reward_tokens: list[str] | None) -> PRMTokens:
    """Resolve ``--prm.placeholder_token`` and ``--prm.reward_tokens`` to single token ids."""
    if not placeholder:
        raise SetupError(
            "rlhf train prm needs --prm.placeholder_token (OpenRLHF: --placeholder_token), the "
            "marker the dataset puts after every step"
        )
    pid = single_token_id(tokenizer, placeholder, "--prm.placeholder_token")
    ids = None
    if reward_tokens is not None:
        if len(reward_tokens) < 2:
            raise SetupError(f"--prm.reward_tokens {reward_tokens}: give at least two tokens, positive first")
        if len(set(reward_tokens)) != len(reward_tokens) or placeholder in reward_tokens:
            raise SetupError(
                f"--prm.reward_tokens {reward_tokens}: the tokens must differ from each other "
                f"and from --prm.placeholder_token {placeholder!r}"
            )
        ids = [single_token_id(tokenizer, t, "--prm.reward_tokens") for t in reward_tokens]
    return PRMTokens(placeholder, pid, list(reward_tokens) if reward_tokens else None, ids)


def check_teacher(cfg: Any) -> None:
    """``rlhf train kd``: a teacher is given and shares the student's vocabulary, word for word."""
    teacher, student = cfg.teacher.model_name_or_path, cfg.model.model_name_or_path
    if not teacher:
        raise SetupError(
            "rlhf train kd needs a teacher: --teacher.model_name_or_path (OpenRLHF: --teacher_model)"
        )
    if not student:
        raise SetupError("rlhf train kd needs the student: --model.model_name_or_path (OpenRLHF: --pretrain)")
    check_same_tokenizer(
        "--teacher.model_name_or_path",
        teacher,
        student,
        "distillation compares the logits entry by entry",
        same_logits_width=True,
    )


def check_same_tokenizer(flag: str, teacher: str, student: str, why: str, same_logits_width: bool) -> None:
    """Refuse a teacher (given by ``flag``) whose tokens or special-token ids (eos, pad, bos) differ from the
    student's, and, with ``same_logits_width`` (logits compared entry by entry), whose vocabulary size (the
    embedding rows, padding included) differs; ``why`` says what needs them equal. Without a tokenizer to
    compare, equal vocabulary sizes are all that can be checked. Raises SetupError naming both models."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        t_cfg, s_cfg = AutoConfig.from_pretrained(teacher), AutoConfig.from_pretrained(student)
    except (OSError, ValueError) as exc:
        raise SetupError(f"{flag} {teacher}: cannot read the model config: {exc}") from None
    sizes = SetupError(
        f"{flag} {teacher} has {t_cfg.vocab_size} vocabulary entries, the student {student} "
        f"{s_cfg.vocab_size}: {why}"
    )
    if same_logits_width and t_cfg.vocab_size != s_cfg.vocab_size:
        raise sizes
    try:
        t_tok, s_tok = AutoTokenizer.from_pretrained(teacher), AutoTokenizer.from_pretrained(student)
    except (OSError, ValueError):
        if t_cfg.vocab_size != s_cfg.vocab_size:
            raise sizes from None
        return  # a teacher directory without a tokenizer: the matching vocabulary size is all we can check
    if t_tok.get_vocab() != s_tok.get_vocab():
        raise SetupError(
            f"{flag} {teacher}: its tokenizer differs from the student's ({student}); {why}, "
            "so it needs the same tokens at the same ids"
        )
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(t_tok, name) != getattr(s_tok, name):
            raise SetupError(
                f"{flag} {teacher}: its {name} is {getattr(t_tok, name)}, the student's ({student}) "
                f"{getattr(s_tok, name)}; {why}, so it needs the same special tokens"
            )


def preflight(mode: str, cfg: Any) -> PRMTokens | None:
    """The mode's checks (``prm``, ``kd``; nothing for the others). Returns the PRM's tokens for ``prm``."""
    if mode not in ("prm", "kd"):
        return None
    if cfg.ds.ring_attn_size > 1:
        raise SetupError(
            f"--ds.ring_attn_size {cfg.ds.ring_attn_size}: rlhf train {mode} does not support ring "
            "attention yet"
        )
    if mode == "kd":
        if not 0.0 <= cfg.teacher.kd_coef <= 1.0:
            raise SetupError(
                f"--teacher.kd_coef {cfg.teacher.kd_coef}: the distillation weight must be in [0, 1]"
            )
        check_teacher(cfg)
        return None
    from transformers import AutoTokenizer

    if not cfg.model.model_name_or_path:
        raise SetupError("rlhf train prm needs --model.model_name_or_path (OpenRLHF: --pretrain)")
    d = cfg.data
    unused = [
        flag
        for flag, on in (
            ("--data.apply_chat_template", d.apply_chat_template),
            ("--data.input_template", d.input_template),
            ("--data.multiturn", d.multiturn),
            ("--data.output_key", d.output_key),
        )
        if on
    ]
    if unused:
        raise SetupError(
            f"rlhf train prm reads each --data.input_key text as it is, so {', '.join(unused)} "
            "cannot apply: put the template into the texts"
        )
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.model_name_or_path)
    return prm_tokens(tokenizer, cfg.prm.placeholder_token, cfg.prm.reward_tokens)
