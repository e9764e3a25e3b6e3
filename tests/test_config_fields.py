"""Every configuration field does something in each command that accepts it, or says why it does not.

A field that is parsed and then read by no code is a flag that silently does nothing. The check is static,
so it is fast and needs no run: it parses the source of each mode's code and collects the attribute reads
``<x>.<field>`` where ``<x>`` is the name of the field's section (``cfg.data.max_len``, ``data.max_len``,
``adam.lr``) or a name bound to that section somewhere (``d = cfg.data``, ``f(optim=cfg.model)``), and
``getattr(<x>, "field")``. A field of a class shared by several sections (the optimizer fields of actor,
critic and model) counts as read for all of them. The configuration modules themselves, the docs and the
tests are not scanned: a field named there is not a field acted on.

A mode's code is its entry modules and every module of the monorepo they import (at any depth, also inside
functions), without entering another mode's entry modules: so ``--data.tokenizer_chat_template`` read only
by the supervised trainer does not count for ``rlhf train ppo``. ``rlhf generate`` and ``rlhf chat`` are
checked as modes of their own.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import typing
from pathlib import Path

import pytest

from rlhf_core import config
from rlhf_core.config_parser import ConfigError, all_leaves, command_name, leaves, parse_config

ROOT = Path(__file__).resolve().parents[1]
NOT_CODE = {"rlhf_core.config", "rlhf_core.config_parser", "rlhf_core.config_aliases"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT / "packages").parts[2:]  # <dist>/src/<package>/...
    name = ".".join(parts).removesuffix(".py")
    return name.removesuffix(".__init__")


MODULES = {_module_name(p): p for p in ROOT.glob("packages/*/src/**/*.py")}
PLUGINS = tuple(ep.value for ep in importlib.metadata.entry_points(group="rlhf") if ep.value in MODULES)
SUPERVISED_CODE = ("rlhf_train_deepspeed.trainers", "rlhf_cli.main")
MODE_ENTRIES = {
    "ppo": ("rlhf_cli.rl.run", "rlhf_cli.assemble", "rlhf_cli.main", *PLUGINS),
    **dict.fromkeys(config.SUPERVISED_MODES, SUPERVISED_CODE),
    # the plugins get an RLConfig made of generate's own section objects: their reads count here too
    "generate": ("rlhf_cli.generate", *PLUGINS),
    "chat": ("rlhf_cli.chat",),
    "serve-rm": ("rlhf_agents.serve_rm",),
}


@functools.cache
def _tree(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text(), str(MODULES[module]))


def _imports(module: str) -> set[str]:
    out = set()
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    # importing a module runs its package's __init__ too
    return {m for name in out for m in (name, name.rpartition(".")[0]) if m in MODULES}


def mode_code(mode: str) -> set[str]:
    """The modules of ``mode``'s code (see the module docstring)."""
    entries = MODE_ENTRIES[mode]
    others = {m for e in MODE_ENTRIES.values() for m in e} - set(entries)
    seen: set[str] = set()
    todo = list(entries)
    while todo:
        m = todo.pop()
        if m in seen or m in others:
            continue
        seen.add(m)
        todo += _imports(m) | {m.rpartition(".")[0]} & MODULES.keys()
    return seen - NOT_CODE


def _sections() -> dict[str, set[type]]:
    """Section name -> the dataclasses a section of that name holds (``adam`` -> AdamConfig, ...)."""
    out: dict[str, set[type]] = {}

    def walk(cls: type) -> None:
        for name, tp in typing.get_type_hints(cls).items():
            if isinstance(tp, type) and hasattr(tp, "__dataclass_fields__"):
                out.setdefault(name, set()).add(tp)
                walk(tp)

    for root in config.COMMANDS.values():
        walk(root)
    return out


SECTIONS = _sections()


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` -> ["a", "b", "c"]; None for anything but names and attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


@functools.cache
def _aliases() -> dict[str, set[str]]:
    """Names bound to a section anywhere in the scanned code: ``d = cfg.data``, ``a, c = x.actor, x``,
    ``ModelSpec(optim=cfg.model)`` (a keyword becomes the callee's name for it)."""
    out: dict[str, set[str]] = {}
    for module in MODULES:
        if module in NOT_CODE:
            continue
        for node in ast.walk(_tree(module)):
            pairs = []
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        pairs.append((target.id, node.value))
                    elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        pairs += [
                            (t.id, v) for t, v in zip(target.elts, node.value.elts) if isinstance(t, ast.Name)
                        ]
            elif isinstance(node, ast.keyword) and node.arg:
                pairs.append((node.arg, node.value))
            for name, value in pairs:
                chain = _chain(value)
                if chain and chain[-1] in SECTIONS and chain[-1] != name:
                    out.setdefault(name, set()).add(chain[-1])
    return out


def _owner(cls: type, name: str) -> str | None:
    """The class that declares field ``name`` of ``cls`` (a field of a shared base is one field)."""
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}):
            return f"{klass.__qualname__}.{name}"
    return None


@functools.cache
def reads(module: str) -> frozenset[str]:
    """The fields ``module`` reads, as ``DeclaringClass.field``."""
    found = set()
    for node in ast.walk(_tree(module)):
        pairs = []
        if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
            chain = _chain(node)
            if chain:
                pairs = [(chain[-2], chain[-1])]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
        ):
            chain = _chain(node.args[0])
            if chain:
                pairs = [(chain[-1], node.args[1].value)]
        for holder, name in pairs:
            for section in {holder} | _aliases().get(holder, set()):
                for cls in SECTIONS.get(section, ()):
                    owner = _owner(cls, name)
                    if owner:
                        found.add(owner)
    return frozenset(found)


def _field_owner(mode: str, path: str) -> str:
    cls = config.COMMANDS[mode]
    *parents, name = path.split(".")
    for p in parents:
        cls = typing.get_type_hints(cls)[p]
    return _owner(cls, name)


def test_every_mode_has_its_code_named():
    assert set(MODE_ENTRIES) == set(config.COMMANDS), (
        "name the entry modules of every command in MODE_ENTRIES"
    )
    assert {"rlhf_algos.plugin", "rlhf_agents.plugin"} <= set(PLUGINS)


def test_the_scan_sees_reads_through_sections_aliases_and_shared_classes():
    # the scanner itself: each of these is a read the code makes in a different way
    assert "DataConfig.max_len" in reads("rlhf_cli.rl.prompts")  # cfg.data.max_len
    assert "DataConfig.input_key" in reads("rlhf_cli.rl.prompts")  # d = cfg.data; d.input_key
    assert "OptimizerFields.lr_scheduler" in reads("rlhf_train_deepspeed.strategy")  # ModelSpec(optim=...)
    assert "AdamConfig.lr" in reads("rlhf_train_deepspeed.strategy")  # optim.adam.lr
    assert "rlhf_train_deepspeed.trainers" not in mode_code("ppo")
    assert "rlhf_cli.rl.controller" not in mode_code("sft")


@pytest.mark.parametrize("mode", sorted(config.COMMANDS))
def test_every_field_is_read_by_the_code_of_each_mode_that_accepts_it(mode):
    code = mode_code(mode)
    read = set().union(*(reads(m) for m in code))
    problems = []
    for path, leaf in leaves(mode).items():
        owner = _field_owner(mode, path)
        elsewhere = sorted(m for m in MODULES if m not in code and owner in reads(m))
        if leaf.refused or leaf.noted:
            if owner in read:
                problems.append(
                    f"--{path} is read by the code of '{command_name(mode)}' but marked "
                    f"{'refused' if leaf.refused else 'noted'}: drop the mark"
                )
        elif owner not in read:
            where = f"read only by {', '.join(elsewhere)}" if elsewhere else "read by no code"
            problems.append(
                f"--{path}: {where}; make it work in '{command_name(mode)}', or restrict it with "
                "option(modes=...), or mark it option(refused=...) / option(noted=...) with the reason"
            )
    assert not problems, "\n".join(problems)


def _other_value(leaf):
    """A valid value other than ``leaf``'s default, as command-line tokens."""
    if leaf.kind == "bool":
        return [str(not leaf.default).lower()]
    if leaf.kind in ("int", "float"):
        return [str((leaf.default or 0) + 1)]
    if leaf.kind == "pair":
        return ["1", "2"]
    return ["other"]


MARKED = sorted(
    (mode, path)
    for mode in config.COMMANDS
    for path, leaf in leaves(mode).items()
    if leaf.refused or leaf.noted
)


@pytest.mark.parametrize(("mode", "path"), MARKED, ids=[f"{m}:{p}" for m, p in MARKED])
def test_refused_and_noted_fields_say_so_when_set(mode, path):
    leaf = leaves(mode)[path]
    argv = [f"--{path}", *_other_value(leaf)]
    if leaf.refused:
        with pytest.raises(ConfigError) as err:
            parse_config(mode, argv)
        assert f"--{path}: {leaf.refused}" in str(err.value)
    else:
        _, notes = parse_config(mode, argv)
        assert any(n.startswith(f"--{path} changes nothing: {leaf.noted}") for n in notes)
    _, notes = parse_config(mode, [])
    assert not [n for n in notes if path in n]  # the default passes quietly


def test_a_field_of_another_mode_is_refused_naming_the_modes_that_take_it():
    with pytest.raises(
        ConfigError, match=r"--train.dynamic_batch_enable is an option of 'rlhf train ppo' only"
    ):
        parse_config("sft", ["--train.dynamic_batch_enable"])
    with pytest.raises(ConfigError, match=r"--use_dynamic_batch is an option of 'rlhf train ppo' only"):
        parse_config("sft", ["--use_dynamic_batch"])
    with pytest.raises(ConfigError, match=r"--model.beta is an option of 'rlhf train dpo\|kto' only"):
        parse_config("sft", ["--beta", "0.5"])
    assert "data.prompt_dataset" in all_leaves(config.SupervisedConfig)  # in the class, not in the parser
    assert "data.prompt_dataset" not in leaves("sft")
