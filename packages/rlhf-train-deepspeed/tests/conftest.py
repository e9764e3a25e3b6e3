"""Shared fixtures: a tiny Llama saved once per session; one local Ray cluster, and one 2-rank and one 1-rank
worker group, for all the Ray modules of this directory that a test process runs (they are in xdist group "ray").
Starting Ray took ~8 s and a group's ranks 15-30 s, once per module before; pytest_runtest_teardown below stops
them all after the last test of this directory, so the modules that follow (their own Ray sessions) start clean."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

REUSED_GROUPS: dict = {}  # ranks -> ReusedGroup, while Ray runs


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    from rlhf_core.testing.tiny import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), num_words=60)


@pytest.fixture(scope="module")
def ray_cluster():
    """Local Ray with more logical CPUs than cores, so that a driver subprocess can start its own group."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    return ray


@pytest.fixture(scope="module")
def reused_groups(ray_cluster) -> dict:
    """{1: ReusedGroup(1), 2: ReusedGroup(2)}: call one as ``group_factory`` (role, spec, ds, ranks, seed) to get
    its "actor" ranks with the model of ``spec`` loaded (``init_model`` replaces the model, optimizer and RNG
    state; the processes and their process group are kept). Never shut down by a test: the hook below does."""
    from rlhf_train_deepspeed.testing import ReusedGroup

    for n in (1, 2):
        REUSED_GROUPS.setdefault(n, ReusedGroup(n))
    return REUSED_GROUPS


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    ray = sys.modules.get("ray")  # None: no test here started Ray
    if ray is not None and (
        nextitem is None or nextitem.path.parent != item.path.parent
    ):  # this directory's last
        for group in REUSED_GROUPS.values():
            group.shutdown()
        REUSED_GROUPS.clear()
        if ray.is_initialized():
            ray.shutdown()
    return result
