"""Ray plumbing: joining or starting a cluster, and turning a PlacementPlan into placement groups and actors."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from rlhf_cli import reaper
from rlhf_core import console
from rlhf_core.types import PlacementPlan, WorkerGroupSpec

# Environment every actor gets: CPU DeepSpeed when there is no GPU, no tokenizer thread pools.
WORKER_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    # torch.distributed deprecation notices from DeepSpeed internals, once per call: noise to users
    "PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning",
}


def init_ray(cfg, plan: PlacementPlan | None = None, min_cpus: int = 0) -> None:
    """Join ``--ray.address`` / ``$RAY_ADDRESS`` when given, else start a local cluster for the plan's bundles
    (settings: the README's "Placement"); a :mod:`rlhf_cli.reaper` ends it, or on a joined cluster this run's
    workers, if the driver dies."""
    if ray.is_initialized():
        return
    import torch

    accelerator = os.environ.get("DS_ACCELERATOR", "cpu") if torch.cuda.is_available() else "cpu"
    env = {**WORKER_ENV, "DS_ACCELERATOR": accelerator}
    runtime_env: dict[str, Any] = {"env_vars": env}
    if os.environ.get(console.RUN_LOG_ENV):  # a run's workers write third-party output to its log file
        names = (console.RUN_LOG_ENV, console.DEBUG_ENV, "VLLM_CONFIGURE_LOGGING")
        env.update({v: os.environ[v] for v in names if v in os.environ})
        runtime_env["worker_process_setup_hook"] = "rlhf_core.console.setup_ray_worker"
    env[reaper.TOKEN_ENV] = reaper.TOKEN  # marks the workers as this driver's, for its reaper
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        reaper.start()  # the cluster is not this driver's: only its workers go when it goes
        return
    needed = 0.0 if plan is None else sum(b.get("CPU", 0.0) for pool in plan.pools for b in pool.bundles)
    # "local": without it ray.init joins whatever cluster another program started on this machine
    ray.init(
        address="local",
        num_cpus=max(math.ceil(needed) + 1, os.cpu_count() or 1, min_cpus),
        include_dashboard=cfg.ray.dashboard,
        dashboard_host="127.0.0.1",
        runtime_env=runtime_env,
        log_to_driver=True,
        _system_config={"prestart_worker_first_driver": False},
        # "Started a local Ray instance." and the like: on the terminal with --debug only
        logging_level=logging.INFO if os.environ.get(console.DEBUG_ENV, "1") == "1" else logging.WARNING,
    )
    reaper.start()  # the cluster is this driver's: it goes when the driver goes, even by SIGKILL


@dataclass
class Pool:
    """A created placement group and the plan entry it came from."""

    name: str
    group: PlacementGroup
    num_bundles: int


def create_pools(plan: PlacementPlan, timeout_s: float = 120.0) -> dict[str, Pool]:
    """One Ray placement group per pool of the plan; raises if the cluster cannot hold one in time."""
    pools: dict[str, Pool] = {}
    for spec in plan.pools:
        pg = placement_group(spec.bundles, strategy=spec.strategy, name=f"rlhf-{spec.name}-{os.getpid()}")
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise RuntimeError(
                f"Ray could not place pool {spec.name!r} ({len(spec.bundles)} bundles of {spec.bundles[0]}) within "
                f"{timeout_s:.0f} s; cluster resources: {ray.cluster_resources()}"
            )
        pools[spec.name] = Pool(spec.name, pg, len(spec.bundles))
    return pools


def remove_pools(pools: dict[str, Pool]) -> None:
    for pool in pools.values():
        remove_placement_group(pool.group)


def worker_options(
    spec: WorkerGroupSpec, pool: Pool, rank: int, gpus_per_worker_bundles: int = 1
) -> dict[str, Any]:
    """Ray actor options that pin worker ``rank`` of ``spec`` to its bundle of ``pool``: in rank order, so
    roles sharing a pool land on the same bundles (colocation)."""
    bundle = (rank * gpus_per_worker_bundles) % pool.num_bundles
    return {
        "num_cpus": spec.num_cpus_per_worker,
        "num_gpus": spec.num_gpus_per_worker,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pool.group, placement_group_bundle_index=bundle
        ),
    }


def this_node() -> NodeAffinitySchedulingStrategy:
    """Ray actor option ``scheduling_strategy``: on the node of this process (the driver)."""
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
