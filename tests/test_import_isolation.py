"""rlhf-core and rlhf-algos stay light: importing them, or loading every plugin, pulls in no ray, vllm or
deepspeed (heavy packages import those only when a run uses them)."""

import subprocess
import sys

import pytest

HEAVY = ("ray", "vllm", "deepspeed")


@pytest.mark.parametrize(
    "code",
    [
        "import rlhf_core, rlhf_core.config_parser, rlhf_core.types, rlhf_core.testing",
        "import rlhf_algos, rlhf_algos.plugin",
        "import rlhf_core; rlhf_core.describe(rlhf_core.get_plugin_manager())",
    ],
)
def test_no_heavy_imports(code):
    probe = f"{code}\nimport sys\nprint(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"{code!r} imported {out.stdout.strip()}"
