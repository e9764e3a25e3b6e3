"""Policy weights to the rollout engines."""

from __future__ import annotations

import torch

from rlhf_cli.rl.groups import Groups, dead_worker_reported, wait_for
from rlhf_core.handles import share, wait


class WeightSync:
    """Broadcasts the policy's weights from its rank 0 through a torch.distributed group that the engines join
    themselves (gloo on CPU, NCCL on GPU; one rank per tensor-parallel worker; ZeRO-3 parameters gathered
    bucket by bucket), or through the object store (``rlhf_core.handles.share``) with ``--vllm.sync_with_ray``
    or an engine that cannot join a group. A stalled sync raises after ``--vllm.sync_timeout``. Engines that
    live in the actor ranks' processes get an in-process copy."""

    def __init__(self, cfg, groups: Groups):
        self.cfg = cfg
        self.groups = groups
        self.policy_version = 0
        """Weight syncs so far: the engines generate with the policy of this version."""
        self.address: tuple[str, int] | None = None
        """The broadcast group's (address, port); None until it is built, or after an engine was replaced."""
        self._ranks: list[int] | None = None  # broadcast-group ranks of each engine; a 0: object store
        # async with engine restarts: the weights the engines hold (kept at each sync), for a replacement
        # engine, since the trainers have moved on by then; None: the model's own (version 0)
        self.keep_held = cfg.train.async_enable and bool(cfg.rollout.max_engine_restarts)
        self.held = None

    def to_engines(self) -> None:
        engines = self.groups.rollout
        if self.groups.rollout_in_actor:  # each rank copies its weights into the engine in its process
            with dead_worker_reported("a policy worker died during the weight sync"):
                self.groups.actor.push_weights_to_hosted("rollout")
            self.policy_version += 1
            return
        if self._ranks is None:
            # NCCL cannot join two processes on one GPU: an engine colocated with the ranks on GPUs (vLLM) takes
            # the object store (CUDA IPC would avoid the copy through host memory; untested, see docs/gpu.md)
            same_gpu = self.cfg.train.colocate_all and torch.cuda.is_available()
            self._ranks = (
                [0] * len(engines)
                if self.cfg.vllm.sync_with_ray or same_gpu
                else wait_for([a.weight_sync_ranks() for a in engines], "rollout")
            )
        weights = None
        if not all(self._ranks):
            weights = share(wait(self.groups.actor.weights()))
            wait_for([a.update_weights(weights) for a in engines], "rollout")
        else:
            backend = self.cfg.vllm.sync_backend if torch.cuda.is_available() else "gloo"
            world, timeout = 1 + sum(self._ranks), self.cfg.vllm.sync_timeout
            joins = []
            if self.address is None:  # engine i's ranks follow those of engines 0..i-1
                addr, port = self.address = self.groups.actor.weight_sync_address()
                joins = [
                    a.init_weight_sync(
                        master_addr=addr,
                        master_port=port,
                        world_size=world,
                        first_rank=1 + sum(self._ranks[:i]),
                        backend=backend,
                        timeout_s=timeout,
                    )
                    for i, a in enumerate(engines)
                ]
            addr, port = self.address
            receives = [a.receive_weights() for a in engines]
            sends = self.groups.actor.broadcast_weights_to_engines_async(addr, port, world, backend, timeout)
            wait_for(joins + receives, "rollout")
            with dead_worker_reported("a policy worker died during the weight sync"):
                wait(sends)
        if self.keep_held:
            self.held = weights if weights is not None else share(wait(self.groups.actor.weights()))
        self.policy_version += 1

    def to_new_engine(self, engine, trainers_asleep: bool) -> None:
        """The weights the other engines hold to a new engine that replaces a dead one, through the object
        store: the current policy's, or with the async pipeline those kept at the last sync (none yet: the new
        engine loaded version 0 itself). The next sync builds a new broadcast group, since the old one has a
        dead rank."""
        self.address = None
        if self.cfg.train.async_enable:
            if self.held is not None:
                wait_for(engine.update_weights(self.held), "new rollout")
            return
        if trainers_asleep:  # their ZeRO-3 state is off the GPU: gather the weights from it awake
            self.groups.actor.wake_up()
        weights = share(wait(self.groups.actor.weights()))
        if trainers_asleep:
            self.groups.actor.sleep()
        wait_for(engine.update_weights(weights), "new rollout")
