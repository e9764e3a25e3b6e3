"""The built-in placement strategies: which roles share devices (a pool). A strategy only plans;
``rlhf_cli.ray_launch`` makes the Ray placement groups (packages/rlhf-cli/README.md, "Placement").
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_core.types import BundlePool, PlacementPlan, RoleDemand, WorkerGroupSpec

ROLE_ORDER = ("actor", "ref", "critic", "reward", "rollout")


def plan_pools(roles: dict[str, RoleDemand], shared: list[set[str]], gpus_available: bool) -> PlacementPlan:
    """Give each set in ``shared`` one pool and every other role a pool of its own.

    A pool has as many bundles as its widest member needs (workers x GPUs per worker on GPU machines,
    workers on CPU-only ones); each bundle holds one GPU (or one logical CPU).
    """
    pools, groups, placed = [], [], set()
    for members in [*shared, *({r} for r in ROLE_ORDER)]:
        names = [r for r in ROLE_ORDER if r in members and r in roles and r not in placed]
        if not names:
            continue
        placed.update(names)
        pool = "+".join(names)
        share = 1.0 / len(names)
        gpus = {r: roles[r].gpus_per_worker if gpus_available else 0 for r in names}
        width = max(roles[r].num_workers * (gpus[r] if gpus_available else 1) for r in names)
        bundle = {"GPU": 1.0, "CPU": 1.0} if gpus_available else {"CPU": 1.0}
        pools.append(BundlePool(pool, [dict(bundle) for _ in range(width)]))
        groups += [
            WorkerGroupSpec(
                r, roles[r].num_workers, pool, num_gpus_per_worker=gpus[r] * share, num_cpus_per_worker=share
            )
            for r in names
        ]
    return PlacementPlan(pools, groups)


@dataclass(frozen=True)
class Colocation:
    """A placement strategy defined by which roles it puts together."""

    name: str

    def shared(self, cfg) -> list[set[str]]:
        t, actor_ref, critic_reward = cfg.train, {"actor", "ref"}, {"critic", "reward"}
        return {
            "colocate_all": [set(ROLE_ORDER)],
            "colocate_actor_ref": [actor_ref] + ([critic_reward] if t.colocate_critic_reward else []),
            "colocate_critic_reward": [critic_reward] + ([actor_ref] if t.colocate_actor_ref else []),
        }.get(self.name, [])

    def plan(self, roles: dict[str, RoleDemand], cfg, gpus_available: bool) -> PlacementPlan:
        if self.name == "colocate_all" and gpus_available and "rollout" in roles:
            actor, rollout = roles["actor"], roles["rollout"]
            engines_gpus = rollout.num_workers * rollout.gpus_per_worker
            if engines_gpus > actor.num_workers:
                raise ValueError(
                    f"--train.colocate_all puts the rollout engines on the actor's GPUs, so "
                    f"--vllm.num_engines x --vllm.tensor_parallel_size ({engines_gpus}) cannot exceed the actor's "
                    f"GPUs, --actor.num_nodes x --actor.num_gpus_per_node ({actor.num_workers})"
                )
        return plan_pools(roles, self.shared(cfg), gpus_available)


BUILTIN = [
    Colocation(n) for n in ("colocate_all", "colocate_actor_ref", "colocate_critic_reward", "separate")
]


def roles_in_actor(plan: PlacementPlan, engine: str, cfg) -> set[str]:
    """The roles (``ref``, ``rollout``) placed in the actor's pool, whose workers then run inside the actor
    ranks' processes (when and why: packages/rlhf-cli/README.md, "Placement"). An HF engine needs the sync
    pipeline since the rank's one thread runs its calls in turn; vLLM engines keep processes of their own."""
    groups = {g.role: g for g in plan.groups}
    shared = {r for r, g in groups.items() if r in ("ref", "rollout") and g.pool == groups["actor"].pool}
    if "rollout" in shared and (
        engine != "hf"
        or cfg.train.async_enable
        or cfg.vllm.sync_with_ray
        or groups["rollout"].num_workers > groups["actor"].num_workers
    ):
        shared.remove("rollout")
    return shared


def strategy_name(cfg) -> str:
    """The strategy the config asks for: ``--train.placement``, else the colocate flags."""
    flags = ("colocate_all", "colocate_actor_ref", "colocate_critic_reward")  # each is named as its strategy
    return cfg.train.placement or next((flag for flag in flags if getattr(cfg.train, flag)), "separate")
