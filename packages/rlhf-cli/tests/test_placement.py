"""Placement: the built-in strategies' plans, and real Ray placement across two nodes on this machine."""

import pytest

from rlhf_cli.placement import BUILTIN, plan_pools
from rlhf_core.config import RLConfig
from rlhf_core.testing import PlacementStrategyConformance
from rlhf_core.types import RoleDemand

STRATEGIES = {s.name: s for s in BUILTIN}
ROLES = {
    "actor": RoleDemand(2),
    "ref": RoleDemand(2),
    "critic": RoleDemand(2),
    "reward": RoleDemand(1),
    "rollout": RoleDemand(2),
}


def pools_of(plan):
    return {g.role: g.pool for g in plan.groups}


def test_separate_gives_every_role_its_own_pool():
    plan = STRATEGIES["separate"].plan(ROLES, RLConfig(), gpus_available=True)
    assert pools_of(plan) == {r: r for r in ROLES}
    assert all(g.num_gpus_per_worker == 1.0 for g in plan.groups)


def test_colocate_all_shares_one_pool_and_splits_each_gpu():
    plan = STRATEGIES["colocate_all"].plan(ROLES, RLConfig(), gpus_available=True)
    assert set(pools_of(plan).values()) == {"actor+ref+critic+reward+rollout"}
    (pool,) = plan.pools
    assert len(pool.bundles) == 2  # as wide as the widest role
    assert all(g.num_gpus_per_worker == pytest.approx(1 / 5) for g in plan.groups)


def test_partial_colocation_honours_both_flags():
    cfg = RLConfig()
    assert pools_of(STRATEGIES["colocate_actor_ref"].plan(ROLES, cfg, True))["critic"] == "critic"
    cfg.train.colocate_critic_reward = True
    pools = pools_of(STRATEGIES["colocate_actor_ref"].plan(ROLES, cfg, True))
    assert (
        pools["actor"] == pools["ref"] == "actor+ref"
        and pools["critic"] == pools["reward"] == "critic+reward"
    )


def test_colocate_all_refuses_more_engine_gpus_than_actor_gpus():
    roles = {"actor": RoleDemand(2), "rollout": RoleDemand(2, gpus_per_worker=2)}
    with pytest.raises(ValueError, match=r"\(4\) cannot exceed the actor's GPUs.*\(2\)"):
        STRATEGIES["colocate_all"].plan(roles, RLConfig(), gpus_available=True)


def test_cpu_plans_use_cpu_bundles():
    plan = plan_pools({"actor": RoleDemand(2), "rollout": RoleDemand(1)}, [{"actor", "rollout"}], False)
    (pool,) = plan.pools
    assert pool.bundles == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert {g.role: g.num_cpus_per_worker for g in plan.groups} == {"actor": 0.5, "rollout": 0.5}


def test_roles_in_the_actors_pool_run_inside_the_actor_ranks():
    from rlhf_cli.placement import roles_in_actor

    def hosted(strategy="colocate_all", engines=2, engine="hf", gpus=False, **flags):
        cfg = RLConfig()
        for k, v in flags.items():
            setattr(cfg.vllm if k == "sync_with_ray" else cfg.train, k, v)
        roles = {
            "actor": RoleDemand(2),
            "ref": RoleDemand(1),
            "critic": RoleDemand(1),
            "rollout": RoleDemand(engines),
        }
        return roles_in_actor(STRATEGIES[strategy].plan(roles, cfg, gpus), engine, cfg)

    assert hosted() == {"ref", "rollout"}  # the critic trains beside the policy: it keeps its ranks
    assert hosted(engines=1) == {"ref", "rollout"}
    assert hosted("separate") == set()  # pools of their own: processes of their own
    assert hosted("colocate_actor_ref") == {"ref"}
    assert hosted(engines=3) == {"ref"}  # more engines than ranks
    assert hosted(engine="vllm") == {"ref"}
    assert hosted(gpus=True) == {"ref", "rollout"}  # the same GPUs: one process per rank, as on CPU
    assert hosted(async_enable=True) == {"ref"}  # generation and training at once: not on one thread
    assert hosted(sync_with_ray=True) == {"ref"}  # the object-store path was asked for


@pytest.mark.slow
@pytest.mark.xdist_group("placement")
def test_groups_land_on_the_nodes_the_strategy_says():
    """Two Ray nodes of 2 CPUs each: `separate` packs actor and rollout pools onto different nodes;
    `colocate_all` puts both roles on the same bundles, hence the same node."""
    import ray
    from ray.cluster_utils import Cluster

    from rlhf_cli.ray_launch import create_pools, remove_pools, worker_options

    @ray.remote
    class Where:
        def node(self):
            return ray.get_runtime_context().get_node_id()

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        roles = {"actor": RoleDemand(2), "rollout": RoleDemand(2)}

        def nodes(strategy):
            plan = STRATEGIES[strategy].plan(roles, RLConfig(), gpus_available=False)
            pools = create_pools(plan, timeout_s=60)
            try:
                found = {}
                for spec in plan.groups:
                    actors = [
                        Where.options(**worker_options(spec, pools[spec.pool], r)).remote()
                        for r in range(spec.num_workers)
                    ]
                    found[spec.role] = ray.get([a.node.remote() for a in actors])
                    for a in actors:
                        ray.kill(a)
                return found
            finally:
                remove_pools(pools)

        sep = nodes("separate")
        assert len(set(sep["actor"])) == 1 and len(set(sep["rollout"])) == 1
        assert sep["actor"][0] != sep["rollout"][0]
        together = nodes("colocate_all")
        assert together["actor"] == together["rollout"]
    finally:
        ray.shutdown()
        cluster.shutdown()


class TestColocateAllConformance(PlacementStrategyConformance):
    name = "colocate_all"


class TestColocateActorRefConformance(PlacementStrategyConformance):
    name = "colocate_actor_ref"


class TestColocateCriticRewardConformance(PlacementStrategyConformance):
    name = "colocate_critic_reward"


class TestSeparateConformance(PlacementStrategyConformance):
    name = "separate"
