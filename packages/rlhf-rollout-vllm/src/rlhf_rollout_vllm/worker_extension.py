"""Methods vLLM mixes into each of its GPU workers (``LLM(worker_extension_cls=...)``).

:class:`rlhf_rollout_vllm.engine.VLLMEngine` calls them on every worker with ``llm.collective_rpc``.
They rely only on what vLLM's worker provides: ``self.rank`` (the worker's rank within the engine),
``self.device`` and ``self.model_runner.model.load_weights(iterable of (HF name, tensor))``, which also
shards tensors for tensor parallelism. This module does not import vLLM.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_core.weight_sync import init_sync_group, open_ipc_tensors


class WeightSyncWorkerExtension:
    def rlhf_init_weight_sync(
        self, master_addr: str, master_port: int, first_rank: int, world_size: int, backend: str, timeout_s: float
    ) -> None:
        """Join the weight-sync group as rank ``first_rank + self.rank`` (gloo groups go through CPU)."""
        device = self.device if backend == "nccl" else torch.device("cpu")
        self.rlhf_sync_group = init_sync_group(
            master_addr, master_port, first_rank + self.rank, world_size, backend, timeout_s, device=device
        )

    def rlhf_receive_weights(self) -> None:
        """Receive one broadcast from rank 0, loading tensors as they arrive (one bucket in memory)."""
        group = getattr(self, "rlhf_sync_group", None)
        if group is None:
            raise RuntimeError("receive_weights before init_weight_sync")
        self.model_runner.model.load_weights(weights=group.receive())

    def rlhf_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.model_runner.model.load_weights(weights=named_tensors)

    def rlhf_load_ipc(self, handles: Any) -> None:
        self.model_runner.model.load_weights(weights=open_ipc_tensors(handles, self.device))

    def rlhf_close_weight_sync(self) -> None:
        group = getattr(self, "rlhf_sync_group", None)
        if group is not None:
            group.close()
            self.rlhf_sync_group = None
