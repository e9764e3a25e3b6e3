"""Every hook is documented in docs/plugin-hooks.md with its exact signature, and has a test."""

import inspect
import re
from pathlib import Path

import pytest

from rlhf_core import hookspecs

ROOT = Path(__file__).resolve().parents[1]
HOOKS = sorted(n for n, f in vars(hookspecs).items() if n.startswith("rlhf_") and callable(f))


def test_there_are_hooks_to_check():
    assert len(HOOKS) >= 9


@pytest.mark.parametrize("name", HOOKS)
def test_hook_is_documented_with_its_signature(name):
    params = ", ".join(inspect.signature(getattr(hookspecs, name)).parameters)
    doc = (ROOT / "docs" / "plugin-hooks.md").read_text()
    assert f"### `{name}({params})`" in doc, f"docs/plugin-hooks.md lacks a heading `{name}({params})`"


@pytest.mark.parametrize("name", HOOKS)
def test_hook_has_a_test(name):
    pattern = re.compile(rf"def test_hook_{name}\(")
    sources = [p.read_text() for p in ROOT.glob("**/tests/**/test_*.py") if ".venv" not in p.parts]
    assert any(pattern.search(s) for s in sources), f"no test named test_hook_{name}"
