"""The module import graph of ``packages/*/src``, read with ``ast``: no cycle in any package, no import of a
higher package from a lower one, and rlhf-core and rlhf-algos import no ray, vllm or deepspeed at module level.
Imports inside functions count as edges too: moving an import into a function hides a cycle from Python, not
from a reader."""

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYER = {
    "rlhf_core": 0,
    "rlhf_algos": 1,
    "rlhf_agents": 2,
    "rlhf_train_deepspeed": 2,
    "rlhf_rollout_vllm": 2,
    "rlhf_cli": 3,
}
LIGHT = ("rlhf_core", "rlhf_algos")
HEAVY = ("ray", "vllm", "deepspeed")


def source_files() -> dict[str, Path]:
    """Every module of every package, by dotted name (a package is its ``__init__.py``)."""
    files = {}
    for src in ROOT.glob("packages/*/src"):
        for path in src.rglob("*.py"):
            files[".".join(path.relative_to(src).with_suffix("").parts).removesuffix(".__init__")] = path
    return files


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """``(imported module, line, at module level)`` for each import in the file; ``from m import x`` imports
    ``m.x`` when that is a module of ours, else ``m``. Module level: outside any function body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parent = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    found.append((sub if sub in known else base, child.lineno, top))
            visit(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(), str(path)), True)
    return found


def graph() -> tuple[dict[str, Path], dict[str, list[tuple[str, int, bool]]]]:
    files = source_files()
    return files, {name: imports(name, path, set(files)) for name, path in files.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or with a self-import (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges[node]:
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1 or node in edges[node]:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return found


def test_no_import_cycle_in_any_package():
    files, found = graph()
    edges = defaultdict(set)
    for name, targets in found.items():
        edges[name] |= {t for t, _, _ in targets if t in files and t.split(".")[0] == name.split(".")[0]}
    problems = []
    for component in cycles({name: edges[name] for name in files}):
        lines = {
            f"    {a} -> {b} ({files[a].relative_to(ROOT)}:{line})"
            for a in component
            for b, line, _ in found[a]
            if b in component
        }
        problems.append(f"cycle of {len(component)} modules:\n" + "\n".join(sorted(lines)))
    assert not problems, "\n".join(problems)


def test_no_upward_import_and_light_packages_stay_light():
    files, found = graph()
    problems = []
    for name, targets in found.items():
        top = name.split(".")[0]
        where = files[name].relative_to(ROOT)
        for target, line, module_level in targets:
            other = target.split(".")[0]
            if LAYER.get(other, -1) > LAYER[top]:
                problems.append(f"{where}:{line}: {top} imports the higher package {target}")
            if top in LIGHT and other in HEAVY and module_level:
                problems.append(f"{where}:{line}: {top} imports {target} at module level")
    assert not problems, "\n".join(problems)


def test_the_graph_reads_every_kind_of_import_and_finds_cycles(tmp_path):
    """The checks above could pass by reading nothing: ``imports`` on a planted file (relative imports, and
    imports in a function marked as such), ``cycles`` on a planted graph."""
    path = tmp_path / "mod.py"
    path.write_text("import ray\nfrom . import sib\n\n\ndef f():\n    from .sub import x\n    import vllm\n")
    assert imports("pkg.mod", path, {"pkg.sib"}) == [
        ("ray", 1, True),
        ("pkg.sib", 2, True),
        ("pkg.sub", 6, False),
        ("vllm", 7, False),
    ]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "d"}}) == [["a", "b", "c"], ["d"]]
    assert {"rlhf_core", "rlhf_agents.executors", "rlhf_cli"} <= set(source_files())
