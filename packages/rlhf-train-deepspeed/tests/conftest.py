"""Shared fixtures: a tiny Llama saved once per session, and one local Ray cluster per test module."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    from rlhf_core.testing.tiny import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), num_words=60)


@pytest.fixture(scope="module")
def ray_cluster():
    """Local Ray with more logical CPUs than cores, so that a driver subprocess can start its own group."""
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
