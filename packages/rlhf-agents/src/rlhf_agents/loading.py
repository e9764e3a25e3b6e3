"""Loading user Python files (reward functions, agents) by path, with errors that name the path and symbol.
A user file runs with the trainer's privileges: it can do anything the training process can."""

from __future__ import annotations

import hashlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from rlhf_agents import openrlhf_compat
from rlhf_core.errors import UserError


class UserCodeError(UserError, RuntimeError):
    """A user file is missing, fails to import, lacks a symbol, or returned something unusable."""


def load_module(path: str | Path, flag: str) -> ModuleType:
    """Import the Python file at ``path`` once per process; ``flag`` names the option that gave the path."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserCodeError(f"{flag} {path}: no such file")
    if file.suffix != ".py":
        raise UserCodeError(f"{flag} {path}: expected a Python file ending in .py")
    resolved = file.resolve()
    digest = hashlib.blake2b(str(resolved).encode(), digest_size=4).hexdigest()
    stem = re.sub(r"\W", "_", file.stem)
    name = f"rlhf_user_{stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise UserCodeError(f"{flag} {path}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    openrlhf_compat.install()  # OpenRLHF's files import its base classes and math helpers from openrlhf
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise UserCodeError(f"{flag} {path}: importing the file raised {type(exc).__name__}: {exc}") from exc
    return module


def load_symbol(path: str | Path, symbol: str, flag: str) -> Any:
    """``symbol`` from the Python file at ``path``; the error lists what the file does define."""
    module = load_module(path, flag)
    if not hasattr(module, symbol):
        defined = sorted(
            n for n, v in vars(module).items() if not n.startswith("_") and not isinstance(v, ModuleType)
        )
        raise UserCodeError(
            f"{flag} {path}: the file defines no {symbol!r}; it defines: {', '.join(defined) or 'nothing'}"
        )
    return getattr(module, symbol)
