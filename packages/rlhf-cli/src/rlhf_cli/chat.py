"""``rlhf chat``: talk to a checkpoint. OpenRLHF's interactive_chat, scriptable through stdin.

A line read is a user turn, its reply a line of stdout; the commands, the streaming and how the conversation
is rendered are in docs/generation.md ("rlhf chat").
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from rlhf_core.config import ChatConfig
from rlhf_core.errors import UserError


class ChatError(UserError, ValueError):
    """A setting that cannot work; the message names the flag or file."""


@dataclass
class Conversation:
    """The turns so far, and how to render them into the text the model continues."""

    cfg: ChatConfig
    tokenizer: Any
    opening: str = ""
    turns: list[tuple[str, str]] = field(default_factory=list)
    """(user text, reply text) of every finished turn."""

    def render(self, user: str, skip: int = 0) -> str:
        """The prompt for a new user turn, leaving out the oldest ``skip`` turns."""
        c, turns = self.cfg, self.turns[skip:]
        if c.data.apply_chat_template:
            messages = [{"role": "system", "content": self.opening}] if self.opening else []
            for u, r in turns:
                messages += [{"role": "user", "content": u}, {"role": "assistant", "content": r}]
            messages.append({"role": "user", "content": user})
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            template = c.data.input_template or "{}"
            parts = [self.opening] if self.opening else []
            parts += [template.format(u) + r for u, r in turns] + [template.format(user)]
            text = "\n".join(parts)
        if c.chat.enable_csft:
            text += c.chat.csft_prompt.strip() + " "
        return text


def check(cfg: ChatConfig) -> None:
    c, path, template = cfg.chat, cfg.model.model_name_or_path, cfg.data.input_template
    problems = [
        message
        for failed, message in [
            (not path, "--model.model_name_or_path (--pretrain) is required: the checkpoint to talk to"),
            (
                path and not (Path(path) / "config.json").is_file(),
                f"--model.model_name_or_path {path}: no model there (no config.json)",
            ),
            (
                c.ta_prompt and not Path(c.ta_prompt).is_file(),
                f"--chat.ta_prompt {c.ta_prompt}: no such file",
            ),
            (c.stream not in ("auto", "true", "false"), f"--chat.stream {c.stream}: use auto, true or false"),
            (
                not cfg.data.apply_chat_template and template and "{}" not in template,
                f"--data.input_template {template!r} must contain '{{}}' for the user turn",
            ),
            (
                c.max_new_tokens < 1 or c.max_len < 2,
                "--chat.max_new_tokens must be at least 1 and --chat.max_len at least 2",
            ),
            (c.temperature < 0, f"--chat.temperature {c.temperature}: must be 0 (greedy) or more"),
        ]
        if failed
    ]
    if problems:
        raise ChatError("cannot start:\n  - " + "\n  - ".join(problems))


def load(cfg: ChatConfig) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_core.config import resolve_param_dtype
    from rlhf_core.data import load_tokenizer
    from rlhf_core.rollout.hf_engine import parse_dtype

    tokenizer = load_tokenizer(cfg.model.model_name_or_path, cfg.data)
    if cfg.data.apply_chat_template and not tokenizer.chat_template:
        raise ChatError(
            f"--data.apply_chat_template: the tokenizer of {cfg.model.model_name_or_path} has no chat "
            "template (give --data.tokenizer_chat_template)"
        )
    model = AutoModelForCausalLM.from_pretrained(
        cfg.model.model_name_or_path,
        dtype=parse_dtype(resolve_param_dtype(cfg.ds.param_dtype)),
        attn_implementation=cfg.ds.attn_implementation,
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return tokenizer, model.to(device).eval()


def reply(conv: Conversation, model: Any, user: str, out: TextIO, stream: bool, err: TextIO) -> str:
    """Generate the reply to ``user``, print it (streamed or whole), record the turn, return the reply."""
    import torch
    from transformers import TextStreamer

    c, tok = conv.cfg.chat, conv.tokenizer
    for skip in range(len(conv.turns) + 1):  # the oldest turns left out until the prompt fits
        ids = tok(conv.render(user, skip), add_special_tokens=False, return_tensors="pt")["input_ids"]
        if ids.shape[1] < c.max_len:
            break
    if skip:
        print(
            f"(the {skip} oldest turn(s) no longer fit --chat.max_len {c.max_len} and are left out)", file=err
        )
    room = min(c.max_new_tokens, c.max_len - ids.shape[1])
    if room < 1:
        print(
            f"(this message alone has {ids.shape[1]} tokens, the limit is --chat.max_len {c.max_len})",
            file=err,
        )
        return ""

    class Printer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            print(text, end="\n" if stream_end else "", file=out, flush=True)

    sampling = (
        {"do_sample": True, "temperature": c.temperature, "top_p": c.top_p}
        if c.temperature > 0
        else {"do_sample": False}
    )
    ids = ids.to(model.device)
    with torch.no_grad():
        generated = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=room,
            repetition_penalty=c.repetition_penalty,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
            streamer=Printer(tok, skip_prompt=True, skip_special_tokens=True) if stream else None,
            **sampling,
        )
    text = tok.decode(generated[0, ids.shape[1] :], skip_special_tokens=True)
    if not stream:
        print(text.replace("\n", " ").strip(), file=out, flush=True)  # a line per reply: transcripts align
    conv.turns.append((user, text))
    return text


def chat_loop(
    cfg: ChatConfig,
    tokenizer: Any,
    model: Any,
    lines: TextIO,
    out: TextIO,
    err: TextIO,
    stream: bool,
    interactive: bool,
) -> int:
    conv = Conversation(cfg, tokenizer, Path(cfg.chat.ta_prompt).read_text() if cfg.chat.ta_prompt else "")
    while True:
        if interactive:
            print("> ", end="", file=err, flush=True)
        line = lines.readline()
        user = line.rstrip("\n")
        command = user.strip()
        if not line or command in ("/exit", "exit"):  # end of input, or /exit
            return 0
        if command in ("/reset", "clear"):
            conv.turns.clear()
            print("(new conversation)", file=err)
        elif command:
            reply(conv, model, user, out, stream, err)


def main(argv: list[str]) -> int:
    from rlhf_core.config_parser import ConfigError, build_argparser, parse_config

    if "-h" in argv or "--help" in argv:
        build_argparser("chat").print_help()
        print("\ncommands in the chat: /reset (or clear) starts over, /exit (or exit, or end of input) quits")
        return 0
    try:
        cfg, notes = parse_config("chat", argv)
        check(cfg)
        tokenizer, model = load(cfg)
    except (ConfigError, ChatError) as exc:
        print(f"rlhf chat: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    import torch

    torch.manual_seed(cfg.chat.seed)
    stream = sys.stdout.isatty() if cfg.chat.stream == "auto" else cfg.chat.stream == "true"
    interactive = sys.stdin.isatty()
    if interactive:
        print("rlhf chat: /reset starts over, /exit quits", file=sys.stderr)
    try:
        return chat_loop(cfg, tokenizer, model, sys.stdin, sys.stdout, sys.stderr, stream, interactive)
    except KeyboardInterrupt:
        return 0
