"""OpenRLHF's reward and agent files, run as they are: the few ``openrlhf`` names they import (package README,
"Writing a reward function" and "Writing an agent"), served by rlhf when OpenRLHF is not installed.
:func:`install` puts a finder at the end of ``sys.meta_path`` that answers for ``openrlhf``, ``openrlhf.utils``
and ``openrlhf.utils.agent`` with modules holding only those names; consulted last, after the finder of
installed packages, it lets a real OpenRLHF win. A missing name says which ones are offered."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

from rlhf_agents.executors import AgentExecutorBase, AgentInstanceBase, MultiTurnAgentExecutor
from rlhf_agents.math_answers import extract_boxed_answer, grade_answer

EXPORTS = {
    "openrlhf": {},
    "openrlhf.utils": {"extract_boxed_answer": extract_boxed_answer, "grade_answer": grade_answer},
    "openrlhf.utils.agent": {
        "AgentInstanceBase": AgentInstanceBase,
        "AgentExecutorBase": AgentExecutorBase,
        "MultiTurnAgentExecutor": MultiTurnAgentExecutor,
    },
}


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in EXPORTS:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname != "openrlhf.utils.agent")

    def exec_module(self, module: ModuleType) -> None:
        names = EXPORTS[module.__name__]
        module.__doc__ = (
            f"rlhf's stand-in for {module.__name__} (OpenRLHF is not installed): {', '.join(names)}"
        )
        module.__dict__.update(names)

        def __getattr__(attr: str):
            if attr.startswith("__"):
                raise AttributeError(attr)
            # ImportError, not AttributeError: `from m import x` would replace an AttributeError's message
            raise ImportError(
                f"{module.__name__}.{attr} is OpenRLHF's, which is not installed; rlhf provides only "
                f"{', '.join(f'{n}.{k}' for n, ks in EXPORTS.items() for k in ks)} under OpenRLHF's names"
            )

        module.__getattr__ = __getattr__


_FINDER = _Finder()


def install() -> None:
    """Serve OpenRLHF's names to user files, unless OpenRLHF itself is importable. Idempotent."""
    if not (_FINDER in sys.meta_path or "openrlhf" in sys.modules or importlib.util.find_spec("openrlhf")):
        sys.meta_path.append(_FINDER)
