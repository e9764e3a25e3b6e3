"""Registration through the entry point, and the package's dependency rules."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

from rlhf_algos import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES
from rlhf_core import collect, get_plugin_manager
from rlhf_core.types import AdvantageEstimator, KLEstimator, PolicyLoss

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "rlhf_algos"


def test_names_and_provenance():
    pm = get_plugin_manager()
    expected = {
        "advantage_estimators": {
            "gae",
            "reinforce",
            "reinforce_baseline",
            "rloo",
            "group_norm",
            "dr_grpo",
            "opd",
        },
        "policy_losses": {"ppo", "gspo"},
        "kl_estimators": {"k1", "k2", "k3"},
    }
    for seam, names in expected.items():
        found = {k: v for k, v in collect(pm, seam).items() if v.distribution == "rlhf-algos"}
        assert set(found) == names, seam
    est = collect(pm, "advantage_estimators")
    assert all(isinstance(est[n].obj, AdvantageEstimator) for n in expected["advantage_estimators"])
    assert {n: (e.needs_critic, e.min_samples_per_prompt) for n, e in ADVANTAGE_ESTIMATORS.items()} == {
        "gae": (True, 1),
        "reinforce": (False, 1),
        "reinforce_baseline": (False, 2),
        "rloo": (False, 2),
        "group_norm": (False, 2),
        "dr_grpo": (False, 2),
        "opd": (False, 1),
    }
    assert all(isinstance(f, PolicyLoss) for f in POLICY_LOSSES.values())
    assert all(isinstance(f, KLEstimator) for f in KL_ESTIMATORS.values())


def test_no_heavy_imports_in_source():
    pattern = re.compile(r"^\s*(import|from)\s+(ray|vllm|deepspeed)\b", re.MULTILINE)
    offenders = [p.name for p in SRC.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_importing_the_package_loads_no_heavy_module():
    code = (
        "import sys, rlhf_algos, rlhf_algos.plugin; "
        "print(sorted(m for m in ('ray', 'vllm', 'deepspeed') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
