"""A group of N training ranks (Ray actors, or one rank in the driver's process: ``rlhf_core.handles``), and
the handle that fans calls out to them. This package's README describes the set-up (no ``deepspeed``
launcher), the sharding of micro-batches and every method."""

from __future__ import annotations

import math
import os
from functools import partial
from typing import Any

import torch

from rlhf_core import handles
from rlhf_core.batches import CriticMicroBatch, PolicyMicroBatch
from rlhf_core.handles import Future, Handle, Joined, wait
from rlhf_train_deepspeed.strategy import StepResult
from rlhf_train_deepspeed.supervised_data import step_counts
from rlhf_train_deepspeed.worker import ModelSpec, TrainWorker


def merge_steps(results: list[StepResult]) -> dict[str, float]:
    """One metrics dict for a step: the global loss (sum over ranks), weighted means of the other
    metrics over all micro-batches of all ranks, and the skip flag."""
    out = {"loss": sum(r.loss for r in results), "skipped": float(results[0].skipped), "lr": results[0].lr}
    if results[0].grad_norm is not None:
        out["grad_norm"] = results[0].grad_norm
    totals: dict[str, list[float]] = {}
    for r in results:
        for k, sw in r.metrics.items():
            totals[k] = [t + x for t, x in zip(totals.get(k, (0.0, 0.0)), sw, strict=True)]
    out.update({k: s / w for k, (s, w) in totals.items() if w > 0})
    return out


def policy_counts(micro_batches: list[PolicyMicroBatch]) -> dict[str, float]:
    """A policy step's global counts; sequences without any action token take no part in the normalisation."""
    masks = [mb.seq.response_mask() for mb in micro_batches]
    return {
        "num_tokens": float(sum(m.sum() for m in masks)),
        "num_sequences": float(sum(m.any(-1).sum() for m in masks)),
    }


def value_counts(micro_batches: list[CriticMicroBatch]) -> dict[str, float]:
    return {"num_tokens": float(sum(mb.seq.response_mask().sum() for mb in micro_batches))}


class WorkerGroup:
    """Handle of one model's ranks. Build it with :func:`create_worker_group` (or the backend's
    ``create_group``)."""

    def __init__(self, actors: list[Handle], role: str, spec: ModelSpec):
        self.actors, self.role, self.spec, self.world_size = actors, role, spec, len(actors)
        self.ring_size = 1
        """Consecutive ranks ``[d*R, (d+1)*R)`` form ring group ``d`` and return the same results."""
        self.nonfinite_steps = 0
        """Steps skipped because a loss was not finite (on any rank)."""
        self._starting: list[Future] = []
        """Set-up calls still running (``create_worker_group(..., wait=False)``); see :meth:`wait_ready`."""

    # --- fan-out primitives ---

    def call_async(self, method: str, *args, **kwargs) -> list[Future]:
        """Call ``method`` with the same arguments on every rank; returns a future per rank."""
        return [getattr(a, method)(*args, **kwargs) for a in self.actors]

    def call(self, method: str, *args, **kwargs) -> list:
        """Call ``method`` on every rank and wait; returns the per-rank results."""
        return wait(self.call_async(method, *args, **kwargs))

    @property
    def dp_size(self) -> int:
        return self.world_size // self.ring_size

    def call_sharded_async(self, method: str, items: list, *args, **kwargs) -> tuple[list[Future], list[int]]:
        """Give ring group ``d`` (rank ``r`` without ring attention) the ``d``-th contiguous share of ``items``
        (as its first argument). Ranks with a shorter share get copies of their last item so that every rank
        runs the same number of forward passes (ZeRO-3 gathers are collective); those extra results, and
        those of all but the first rank of each ring group, are dropped by :meth:`forward`; ``real`` says
        how many results of each rank to keep."""
        if not items:
            raise ValueError(f"{method}: no micro-batches given")
        per = math.ceil(len(items) / self.dp_size)
        futures, real = [], []
        for r, actor in enumerate(self.actors):
            d = r // self.ring_size
            share = items[d * per : (d + 1) * per]
            real.append(len(share) if r % self.ring_size == 0 else 0)
            share = share + [share[-1] if share else items[-1]] * (per - len(share))
            futures.append(getattr(actor, method)(share, *args, **kwargs))
        return futures, real

    # --- the learner primitives (rlhf_core.primitives.Learner): one Future each ---

    def forward(
        self,
        batches: list,
        temperature: float = 1.0,
        head: str | None = None,
        teacher: int = 0,
        loss_cfg: Any = None,
    ) -> Future:
        """Per micro-batch, ``head`` (default: ``values`` for a value model, else ``logprobs``) of the ranks'
        model, without gradients (:meth:`TrainWorker.forward`, which lists the heads)."""
        head = head or ("values" if self.spec.kind == "value" else "logprobs")
        futures, real = self.call_sharded_async("forward", batches, temperature, head, teacher, loss_cfg)
        return Joined(futures, lambda res: [x for r, n in zip(res, real, strict=True) for x in r[:n]])

    def forward_backward(
        self, micro_batches: list, loss: str, loss_cfg: Any, counts: dict[str, float] | None = None
    ) -> Future:
        """The ranks' parts of the step merged (:func:`merge_steps`; no gradient norm before the step)."""
        if len(micro_batches) % self.dp_size:
            raise ValueError(
                f"{loss}: {len(micro_batches)} micro-batches cannot be split evenly over "
                f"{self.dp_size} data-parallel ranks"
            )
        if counts is None:
            counts = {"policy": policy_counts, "value": value_counts}.get(loss, partial(step_counts, loss))(
                micro_batches
            )
        futures = self.call_sharded_async("forward_backward", micro_batches, loss, loss_cfg, counts)[0]
        return Joined(futures, lambda res: merge_steps(res[:: self.ring_size]))

    def optim_step(self) -> Future:
        """The whole step's metrics (:func:`merge_steps`), with ``nonfinite_steps``: the skipped steps so far."""
        return Joined(self.call_async("optim_step"), self._merged)

    def _merged(self, results: list[StepResult]) -> dict[str, float]:
        metrics = merge_steps(results[:: self.ring_size])  # one rank per ring group
        if metrics["skipped"]:
            self.nonfinite_steps += 1
        metrics["nonfinite_steps"] = float(self.nonfinite_steps)
        return metrics

    def save_state(self, path: str) -> Future:
        """Every rank writes its DeepSpeed shard and RNG state under ``path`` (a shared directory)."""
        return Joined(self.call_async("save_state", path), lambda _: None)

    def load_state(self, path: str) -> Future:
        return Joined(self.call_async("load_state", path), lambda _: None)

    def weights(self) -> Future:
        return Joined(self.call_async("weights"), lambda res: res[0])

    def export(self, path: str, config_updates: dict | None = None, ema: bool | None = None) -> Future:
        """HF safetensors export to ``path`` (written by rank 0), ``config_updates`` merged into its config: the
        EMA weights when the model keeps one (``ModelSpec.ema_beta``) unless ``ema=False``, else the trained
        weights."""
        return Joined(self.call_async("export", path, config_updates, self.spec.path, ema), lambda _: None)

    # --- weight sync to engines, set-up, hosting ---

    def weight_sync_address(self) -> tuple[str, int]:
        return wait(self.actors[0].master_address())

    def broadcast_weights_to_engines_async(
        self,
        master_addr: str,
        master_port: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 600.0,
    ) -> list[Future]:
        """``wait`` on the futures gives the tensor count on rank 0's entry."""
        return self.call_async(
            "broadcast_weights_to_engines", master_addr, master_port, world_size, backend, timeout_s
        )

    def init_model(self, spec: ModelSpec, ds, seed: int = 42, full_determinism: bool = False) -> None:
        """(Re)load a model on every rank, replacing the current one (the process group is kept)."""
        wait(self._init_model_async(spec, ds, seed, full_determinism))

    def _init_model_async(self, spec: ModelSpec, ds, seed: int, full_determinism: bool) -> list[Future]:
        self.spec = spec
        self.nonfinite_steps = 0
        self.ring_size = max(1, ds.ring_attn_size)
        return self.call_async("init_model", spec, ds, seed, full_determinism)

    def wait_ready(self) -> None:
        """A group whose set-up failed is shut down: ranks outside a placement group would keep their CPUs or
        GPUs until the driver ends."""
        starting, self._starting = self._starting, []
        try:
            wait(starting)
        except BaseException:
            self.shutdown()
            raise

    def host(self, name: str, cls: type, args: list[tuple]) -> list[Handle]:
        if len(args) > self.world_size:
            raise ValueError(
                f"{self.role}: cannot host {len(args)} {name!r} objects on {self.world_size} ranks"
            )
        wait([a.host(name, cls, *rank_args) for a, rank_args in zip(self.actors, args)])
        return [handles.hosted(a, name) for a in self.actors[: len(args)]]

    def hosted_ref(self) -> HostedRef:
        if not self.spec.ref_path:
            raise ValueError(f"{self.role}: these ranks host no reference model (ModelSpec.ref_path)")
        return HostedRef(self)

    def push_weights_to_hosted(self, name: str) -> None:
        self.call("push_weights_to_hosted", name)

    def sleep(self) -> None:
        self.call("sleep")

    def wake_up(self) -> None:
        self.call("wake_up")

    def shutdown(self) -> None:
        for a in self.actors:
            handles.kill(a)
        self.actors = []


class HostedRef:
    """A reference model living in the policy's ranks (:meth:`WorkerGroup.hosted_ref`), with the calls the RL
    controller makes on a reference group: its log-probs are the frozen model's, sharded over the policy's
    ranks; sleeping and shutting down are the policy group's."""

    def __init__(self, policy: WorkerGroup):
        self.policy, self.role = policy, "ref"

    @property
    def actors(self) -> list:
        return self.policy.actors

    @property
    def dp_size(self) -> int:  # the policy's ranks shard its micro-batches
        return self.policy.dp_size

    @property
    def ring_size(self) -> int:
        return self.policy.ring_size

    def forward(
        self, batches: list, temperature: float = 1.0, head: str | None = None, teacher: int = 0
    ) -> Future:
        if head not in (None, "logprobs"):
            raise ValueError(f"a hosted reference model only computes log-probs, not {head!r}")
        return self.policy.forward(batches, temperature, "ref", teacher)

    def sleep(self) -> None:
        """Sleeping, waking up and shutting down are the policy group's."""

    wake_up = shutdown = sleep


def create_worker_group(
    role: str,
    spec: ModelSpec,
    ds,
    num_workers: int,
    *,
    seed: int = 42,
    full_determinism: bool = False,
    pool: Any = None,
    bundle_indices: list[int] | None = None,
    num_gpus_per_worker: float | None = None,
    num_cpus_per_worker: float = 1,
    num_threads: int | None = None,
    wait: bool = True,
    inline_rank: bool = False,
) -> WorkerGroup:
    """Start ``num_workers`` ranks for ``role``, join them into one process group, and load the model. The
    options are ``create_group``'s (this package's README); with ``wait=False``, calls made before
    :meth:`WorkerGroup.wait_ready` queue behind the set-up, and ``num_threads`` defaults to
    ``num_cpus_per_worker`` on GPU ranks."""
    if num_workers < 1:
        raise ValueError(f"{role}: num_workers must be at least 1, got {num_workers}")
    if inline_rank:
        if num_workers != 1 or pool is not None:
            raise ValueError(
                f"{role}: an inline group has one rank and no placement group, got {num_workers} ranks"
            )
        if (
            not torch.cuda.is_available()
        ):  # as a Ray rank's environment says (DeepSpeed reads it once, on import)
            os.environ["DS_ACCELERATOR"] = "cpu"
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        actors = [handles.local(TrainWorker(0, 1, num_threads or os.cpu_count() or 1))]
    else:
        actors = _ray_ranks(
            num_workers, pool, bundle_indices, num_gpus_per_worker, num_cpus_per_worker, num_threads
        )
    address = actors[0].master_address()  # each rank gets the value once rank 0 gave it
    group = WorkerGroup(actors, role, spec)
    group._starting = [a.init_distributed(address) for a in actors]
    group._starting += group._init_model_async(spec, ds, seed, full_determinism)
    if wait:
        group.wait_ready()
    return group


def _ray_ranks(
    num_workers: int,
    pool: Any,
    bundle_indices: list[int] | None,
    num_gpus_per_worker: float | None,
    num_cpus_per_worker: float,
    num_threads: int | None,
) -> list[Handle]:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    gpus = num_gpus_per_worker
    if gpus is None:  # one per rank when the cluster has GPUs
        gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
    if pool is None and not gpus:
        # More CPU ranks than logical CPUs would wait for resources forever: share the CPUs instead.
        num_cpus_per_worker = min(num_cpus_per_worker, ray.cluster_resources().get("CPU", 1) / num_workers)
    env = {"TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"}
    if not gpus:
        env["DS_ACCELERATOR"] = "cpu"
    passed = ("RLHF_LOAD_PLUGINS", "RLHF_DISABLE_PLUGINS", "DS_ACCELERATOR", "HF_HUB_OFFLINE")
    env = {var: os.environ[var] for var in passed if var in os.environ} | env  # env's own values win
    # CPU ranks split the cores between them (Ray would give each actor one thread); GPU ranks need few.
    threads = num_threads or (
        max(1, int(num_cpus_per_worker)) if gpus else max(1, (os.cpu_count() or 1) // num_workers)
    )
    env["OMP_NUM_THREADS"] = str(threads)
    actors = []
    for r in range(num_workers):
        options: dict[str, Any] = {
            "num_cpus": num_cpus_per_worker,
            "num_gpus": gpus,
            "runtime_env": {"env_vars": env},
        }
        if pool is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pool, placement_group_bundle_index=bundle_indices[r] if bundle_indices else r
            )
        actors.append(handles.ray_actor(TrainWorker, r, num_workers, threads, options=options))
    return actors
