"""Turn command-line flags and YAML files into a config dataclass, and show a config without its secrets.

Precedence: defaults < ``--config file.yaml`` (in order) < flags on the command line. What else it does
(flat aliases, closest spellings, the rules of :func:`rlhf_core.config.option`) is in rlhf-core's README.md.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import difflib
import functools
import importlib.util
import inspect
import re
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rlhf_core import config_aliases as aliases
from rlhf_core.config import COMMANDS, MODES
from rlhf_core.errors import UserError

REDACTED = "***"


class ConfigError(UserError, ValueError):
    """A flag or YAML key is unknown, malformed, or has a value of the wrong type."""


@dataclass(frozen=True)
class Leaf:
    """One settable field: its dotted path, value type, documentation and the rules of
    :func:`rlhf_core.config.option`."""

    path: str
    kind: str  # bool | int | float | str | pair | list
    item: type  # element type for pair/list, else the scalar type
    doc: str
    default: Any
    modes: tuple[str, ...] | None = None  # None: every mode whose config has the field
    refused: str | None = None
    noted: str | None = None
    secret: bool = False
    requires: str | None = None


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The string written under each field of a dataclass (its documentation), by field name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for stmt, nxt in zip(body, body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _leaf_kind(tp: Any) -> tuple[str, type]:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
    origin = typing.get_origin(tp)
    if origin is tuple:
        return "pair", typing.get_args(tp)[0]
    if origin is list:
        return "list", typing.get_args(tp)[0]
    return tp.__name__, tp


@functools.cache
def all_leaves(root: type) -> dict[str, Leaf]:
    """Every field under ``root``, keyed by dotted path, whichever modes accept it. A
    :func:`rlhf_core.config.view` gives its fields first, in its order, with its docs and defaults; the
    section's other fields follow, accepted by no mode (``modes=()``), so that a config object setting one is
    refused."""
    out: dict[str, Leaf] = {}

    def walk(
        section: Any, prefix: str, view: list | None = None, docs: dict | None = None, taken: bool = True
    ):
        hints = typing.get_type_hints(type(section))
        docs = field_docs(type(section)) | (docs or {})
        fields = {f.name: f for f in dataclasses.fields(section)}
        names = view or list(fields)
        for name in [*names, *(n for n in fields if n not in names)]:
            f, value, accepted = fields[name], getattr(section, name), taken and name in names
            if f.metadata.get("python_only"):  # a Python object (``reward.func``): no flag, not saved
                continue
            if dataclasses.is_dataclass(hints[name]):
                walk(value, f"{prefix}{name}.", f.metadata.get("fields"), f.metadata.get("docs"), accepted)
                continue
            rules = {k: f.metadata[k] for k in Leaf.__dataclass_fields__ if k in f.metadata}
            if view or not accepted:
                rules["modes"] = None if accepted else ()
            out[prefix + name] = Leaf(
                prefix + name, *_leaf_kind(hints[name]), docs.get(name, ""), value, **rules
            )

    walk(root(), "")
    return out


@functools.cache
def leaves(mode: str) -> dict[str, Leaf]:
    """The fields ``rlhf train <mode>`` (or ``rlhf generate`` / ``rlhf chat``) accepts, keyed by dotted path."""
    return {
        p: leaf for p, leaf in all_leaves(COMMANDS[mode]).items() if leaf.modes is None or mode in leaf.modes
    }


def _parse_bool(text: str) -> bool:
    low = str(text).lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(message)


def command_name(mode: str) -> str:
    """How the user typed the command: ``rlhf train sft``, ``rlhf generate``."""
    return f"rlhf train {mode}" if mode in MODES else f"rlhf {mode}"


def build_argparser(mode: str) -> argparse.ArgumentParser:
    """An argparse parser with one dotted flag per config field, grouped by section (for ``--help``)."""
    root = COMMANDS[mode]
    parser = _Parser(
        prog=command_name(mode), allow_abbrev=False, add_help=False, description=inspect.getdoc(root)
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for leaf in leaves(mode).values():
        section = leaf.path.split(".")[0]
        group = groups.get(section) or groups.setdefault(section, parser.add_argument_group(section))
        kw: dict[str, Any] = {"dest": leaf.path, "default": argparse.SUPPRESS, "help": leaf.doc}
        if leaf.kind == "bool":
            kw.update(nargs="?", const=True, type=_parse_bool, metavar="BOOL")
        elif leaf.kind == "pair":
            kw.update(nargs=2, type=leaf.item, metavar=("LOW", "HIGH"))
        elif leaf.kind == "list":
            kw.update(nargs="+", type=str, metavar=leaf.item.__name__.upper())
        else:
            kw.update(type=leaf.item, metavar=leaf.item.__name__.upper())
        group.add_argument(f"--{leaf.path}", **kw)
    return parser


def _split_flag(token: str) -> tuple[str, str | None]:
    name, eq, value = token[2:].partition("=")
    return name, (value if eq else None)


def rewrite_aliases(mode: str, tokens: list[str], notes: list[str]) -> list[str]:
    """Rewrite flat OpenRLHF flags in ``tokens`` to dotted ones; notes collect what was dropped."""
    renames, constants, ignored = aliases.table(mode), aliases.constants(mode), aliases.ignored(mode)
    out: list[str] = []
    clip: dict[int, str] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--"):
            out.append(tok)
            i += 1
            continue
        name, inline = _split_flag(tok)
        j = i + 1
        while inline is None and j < len(tokens) and not tokens[j].startswith("--"):  # the flag's values
            j += 1
        values = [inline] if inline is not None else tokens[i + 1 : j]
        i = j
        if name in renames:
            targets = renames[name]
            for target in (targets,) if isinstance(targets, str) else targets:
                out += [f"--{target}", *values]
        elif name in constants:
            for target, value in constants[name]:
                out += [f"--{target}", value]
        elif name in ignored:
            notes.append(f"--{name} is ignored: {ignored[name]}")
        elif name in aliases.DROPPED:
            notes.append(f"--{name} is ignored: OpenRLHF dropped it and rlhf has no equivalent")
        elif name in aliases.CLIP_PARTS and mode == "ppo":
            clip[aliases.CLIP_PARTS[name]] = values[0] if values else ""
        else:
            out += [f"--{name}", *values]
    if clip:
        eps = next((out[k + 1] for k in reversed(range(len(out) - 1)) if out[k] == "--actor.eps_clip"), "0.2")
        out += ["--actor.eps_clip_low_high", clip.get(0, eps), clip.get(1, eps)]
    return out


def _unknown_error(mode: str, unknown: list[str], where: str) -> ConfigError:
    lines = []
    known = [f"--{name}" for name in [*leaves(mode), *aliases.table(mode)]]
    after_flag = False
    for tok in unknown:
        if not tok.startswith("--"):
            if not after_flag:  # the values of an unknown flag need no message of their own
                lines.append(f"unexpected value {tok!r}{where}")
            continue
        after_flag = True
        flag = "--" + _split_flag(tok)[0]
        other = [m for m in MODES if flag[2:] in leaves(m) or flag[2:] in aliases.table(m)]
        if other:
            lines.append(
                f"{flag}{where} is an option of 'rlhf train {'|'.join(other)}' only: "
                f"the code of '{command_name(mode)}' does not use it"
            )
            continue
        close = difflib.get_close_matches(flag, known, n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        lines.append(f"unknown option {flag}{where} for '{command_name(mode)}'{hint}")
    return ConfigError("\n".join(lines))


def _flatten_yaml(data: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten_yaml(value, path + "."))
        else:
            out[path] = value
    return out


def yaml_tokens(path: str | Path) -> list[str]:
    """The flags a YAML config file stands for (nested sections or dotted keys, flat aliases too)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except yaml.YAMLError as exc:
        # PyYAML's message quotes the offending line, which may hold a secret: give its position only
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(
            f"--config {path}: not valid YAML{where}: {getattr(exc, 'problem', None) or 'parse error'}"
        ) from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of sections, got {type(data).__name__}")
    return dict_tokens(data)


def dict_tokens(data: dict, none_is_default: bool = True) -> list[str]:
    """The flags a mapping stands for: nested sections or dotted keys (a YAML file's, or the Python API's
    ``config=`` and overrides). None means the default, or is refused where it would be ignored (an override
    of a value given below it: no flag says None)."""
    tokens: list[str] = []
    for key, value in _flatten_yaml(data).items():
        if value is None:
            if none_is_default:
                continue
            raise ConfigError(
                f"--{key} None: an override cannot set a field to None; leave it out for the value "
                "below it, or set it on the config object"
            )
        if isinstance(value, bool):
            value = ["true" if value else "false"]
        elif not isinstance(value, (list, tuple)):
            value = [value]
        tokens += [f"--{key}", *(str(v) for v in value)]
    return tokens


def _parse_tokens(mode: str, tokens: list[str], where: str) -> dict[str, Any]:
    parser = build_argparser(mode)
    try:
        ns, unknown = parser.parse_known_args(tokens)
    except ConfigError as exc:
        raise ConfigError(f"{exc}{where}") from None
    if unknown:
        raise _unknown_error(mode, unknown, where)
    return vars(ns)


def parse_config(mode: str, argv: list[str], base: Any = None) -> tuple[Any, list[str]]:
    """Parse ``argv`` (flags only, no subcommand) for ``mode``; returns the config and notes to print. The flags
    apply to a copy of ``base`` (a config object of ``mode``) when given, else to the defaults; either way the
    whole result is checked against the fields' rules."""
    if mode not in COMMANDS:
        raise ConfigError(f"unknown mode {mode!r}; modes are: {', '.join(COMMANDS)}")
    notes: list[str] = []
    files: list[str] = []
    cli: list[str] = []
    tokens = iter(argv)
    for tok in tokens:
        name, inline = _split_flag(tok) if tok.startswith("--") else ("", None)
        if name != "config":
            cli.append(tok)
        elif (value := next(tokens, None) if inline is None else inline) is None:
            raise ConfigError("--config needs a YAML file path")
        else:
            files.append(value)
    values: dict[str, Any] = {}
    for f in files:
        values.update(_parse_tokens(mode, rewrite_aliases(mode, yaml_tokens(f), notes), f" (in {f})"))
    values.update(_parse_tokens(mode, rewrite_aliases(mode, cli, notes), ""))
    cfg = build_config(mode, values, base)
    refused = []
    accepted = leaves(mode)
    for path, leaf in all_leaves(COMMANDS[mode]).items():
        value = _get(cfg, path)
        if path in accepted and leaf.secret and value == REDACTED:
            refused.append(
                f"--{path} is {REDACTED!r}, the placeholder of a saved config that hides it: give the "
                "real value on the command line"
            )
        elif value == leaf.default:
            continue
        elif path not in accepted:
            # only a config object (``base``) can hold it: flags of other modes are refused
            others = "|".join(m for m in MODES if path in leaves(m))
            refused.append(
                f"--{path} is an option of 'rlhf train {others}' only: the code of "
                f"'{command_name(mode)}' does not use it"
            )
        elif leaf.refused:
            refused.append(f"--{path}: {leaf.refused}")
        elif leaf.noted:
            notes.append(f"--{path} changes nothing: {leaf.noted}")
        elif leaf.requires and not _importable(leaf.requires):
            refused.append(
                f"--{path} needs the {leaf.requires} package, which is not installed: "
                f"pip install {leaf.requires}"
            )
    if refused:
        raise ConfigError("\n".join(refused))
    return cfg, notes


def _importable(module: str) -> bool:
    return module in sys.modules or importlib.util.find_spec(module) is not None


def _get(cfg: Any, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), cfg)


def build_config(mode: str, values: dict[str, Any], base: Any) -> Any:
    """A config of ``mode`` with defaults (or a copy of ``base``), updated by ``{dotted path: value}``."""
    cfg = COMMANDS[mode]() if base is None else copy.deepcopy(base)
    table = leaves(mode)
    for path, value in values.items():
        leaf = table[path]
        if leaf.kind == "pair":
            value = tuple(value)
        elif leaf.kind == "list":
            parts = [p for v in value for p in str(v).split(",") if p != ""]
            try:
                value = [leaf.item(p) for p in parts]
            except ValueError:
                raise ConfigError(f"--{path}: expected {leaf.item.__name__} values, got {value}") from None
        section, _, name = path.rpartition(".")
        setattr(_get(cfg, section), name, value)
    return cfg


_URL_SECRET = re.compile(
    r"(?i)(://[^/@:\s]*:)[^/@\s]*@|([?&](?:[a-z_]*(?:token|key|secret|password|passwd|sig|auth)"
    r"[a-z_]*)=)[^&#\s]*"
)


def redact_text(text: str) -> str:
    """``text`` with the password of any ``scheme://user:password@host`` and the values of URL query parameters
    that name a token, key, secret, password, signature or auth replaced by ``***``."""
    return _URL_SECRET.sub(
        lambda m: f"{m.group(1)}{REDACTED}@" if m.group(1) else f"{m.group(2)}{REDACTED}", text
    )


def shown_config(cfg: Any, mode: str) -> dict:
    """The fields ``mode`` accepts as nested plain data, fit to print or save: secret fields that are set become
    ``***`` and credentials inside URLs are masked (:func:`redact_text`); the code keeps using ``cfg``."""
    out: dict = {}
    for path, leaf in leaves(mode).items():
        value = _get(cfg, path)
        if leaf.secret and value is not None:
            value = REDACTED
        elif isinstance(value, str):
            value = redact_text(value)
        elif isinstance(value, (list, tuple)):
            value = [redact_text(v) if isinstance(v, str) else v for v in value]
        *parents, name = path.split(".")
        functools.reduce(lambda node, section: node.setdefault(section, {}), parents, out)[name] = value
    return out


def config_to_yaml(cfg: Any, mode: str) -> str:
    """``cfg`` as YAML for ``--dry-run`` and the run directory, secrets hidden (:func:`shown_config`)."""
    return yaml.safe_dump(shown_config(cfg, mode), sort_keys=False, default_flow_style=None)
