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


def test_every_conformance_suite_is_listed():
    import rlhf_core.testing

    suites = sorted(n for n in rlhf_core.testing.__all__ if n.endswith("Conformance"))
    doc = (ROOT / "docs" / "plugin-hooks.md").read_text()
    assert len(suites) >= 7
    missing = [s for s in suites if f"| `{s}` |" not in doc]
    assert not missing, f"docs/plugin-hooks.md does not list the conformance suites {missing}"
