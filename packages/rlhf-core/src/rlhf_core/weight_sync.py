"""Moving weights from the policy's rank 0 to the rollout engines.

Every transport ends in the engine's ``update_weights(named tensors)`` with HF parameter names: a broadcast
group (:func:`init_sync_group`, :meth:`SyncGroup.send`: rank 0 is the policy's rank 0, ranks 1.. the engine
processes, one per vLLM tensor-parallel worker; gloo on CPU, NCCL on GPU), or Ray's object store, or, for an
HF engine hosted in a rank's process, an in-process copy (``TrainWorker.push_weights_to_hosted``). Which
engine takes which, and LoRA policies' adapter pairs (:func:`lora_pairs`): docs/plugin-hooks.md.

Wire format of one :meth:`SyncGroup.send`: per bucket, an int64 header ``(metadata bytes, payload bytes)``,
then one uint8 buffer holding the metadata (JSON list of ``[name, dtype, shape, offset, nbytes]``, padded
to 16 bytes) followed by the payload (each tensor's bytes at a 16-byte aligned offset). A ``(0, 0)``
header ends the transfer. Every wait is bounded: a peer that stalls makes the other side raise
:class:`WeightSyncTimeout` naming who waited for what.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_ALIGN = 16
_STORE_PREFIX = "rlhf_weight_sync"


LORA_A, LORA_B = ".lora_A", ".lora_B"


def is_adapter(name: str) -> bool:
    """Whether ``name`` is half of a LoRA pair on the wire (HF weights end in ``.weight``/``.bias``)."""
    return name.endswith((LORA_A, LORA_B))


def lora_pairs(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(layer name, A, B)`` from a stream of adapter tensors sent as consecutive ``.lora_A``/``.lora_B``
    pairs; raises :class:`WeightSyncError` on a tensor out of that order (a full weight mixed in)."""
    pending: tuple[str, torch.Tensor] | None = None
    for name, tensor in named_tensors:
        if pending is None and name.endswith(LORA_A):
            pending = (name.removesuffix(LORA_A), tensor)
        elif pending is not None and name == pending[0] + LORA_B:
            yield pending[0], pending[1], tensor
            pending = None
        else:
            raise WeightSyncError(
                f"weight sync: {name!r} is not the next half of a LoRA pair (expected "
                f"{(pending[0] + LORA_B) if pending else '<layer>' + LORA_A!r})"
            )
    if pending is not None:
        raise WeightSyncError(f"weight sync: {pending[0] + LORA_A!r} arrived without its {LORA_B}")


def lora_adapter_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A peft LoRA model's active adapters in the wire format: per adapted weight ``<name>.lora_A`` then
    ``<name>.lora_B`` times the adapter's scaling (names without peft's prefixes), the weight becoming
    ``W0 + B @ A``. ``<name>`` is a linear layer, whose weight is ``<name>.weight`` (``A [r, in]``,
    ``B [out, r]``), or a parameter peft adapts directly (``target_parameters``): a router's
    ``mlp.gate.weight`` (2-D, as a linear layer's) or a fused expert stack ``mlp.experts.gate_up_proj``
    (``W [E, p, q]``: ``A [E, r, q]``, ``B [E, p, r]``, peft's own factors of each expert's update).
    Raises ValueError for an adapter on anything else (an embedding), which no engine merges."""
    for name, layer in model.named_modules():
        if not (hasattr(layer, "lora_A") and hasattr(layer, "scaling") and hasattr(layer, "get_base_layer")):
            continue
        (adapter,) = layer.active_adapters
        param = getattr(layer, "parameter_name", None)  # set by peft's ParamWrapper
        if param is None and not isinstance(layer.get_base_layer(), torch.nn.Linear):
            raise ValueError(
                f"{name}: the weight sync sends LoRA adapters of linear layers, routers and fused experts "
                f"only, this is a {type(layer.get_base_layer()).__name__} (--ds.lora.target_modules)"
            )
        if getattr(layer, "num_experts", 1) > 1:
            lora_b, lora_a, scaling = layer.get_delta_factors(adapter)
        else:
            lora_a, lora_b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
            scaling = layer.scaling[adapter]
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")  # nested ParamWrappers
        name = name if param is None else f"{name}.{param}"
        yield name + LORA_A, lora_a.detach().clone()
        yield name + LORA_B, lora_b.detach() * scaling


def merge_lora_pair(
    base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Write the adapted weight ``W = W0 + B @ A`` into ``out`` and return it: ``base`` ``[out, in]``,
    ``lora_a`` ``[r, in]``, ``lora_b`` ``[out, r]`` (scaling folded in), or a stack of them with a leading
    experts dimension ``E`` (``[E, out, in]``, ``[E, r, in]``, ``[E, out, r]``). Computed in float32: in place
    by one ``addmm``/``baddbmm`` (no temporaries) where ``out`` is float32, else cast into it."""
    if (
        lora_a.shape[:-2] != lora_b.shape[:-2]
        or lora_a.shape[-2] != lora_b.shape[-1]
        or (*lora_b.shape[:-1], lora_a.shape[-1]) != tuple(base.shape)
    ):
        raise WeightSyncError(
            f"weight sync: LoRA pair A {tuple(lora_a.shape)}, B {tuple(lora_b.shape)} does not fit "
            f"a weight of shape {tuple(base.shape)}"
        )
    a, b = lora_a.to(out.device, torch.float32), lora_b.to(out.device, torch.float32)
    add_product = torch.addmm if base.dim() == 2 else torch.baddbmm
    if out.dtype == torch.float32:
        return add_product(base, b, a, out=out)
    return out.copy_(add_product(base.float(), b, a))


class WeightSyncError(RuntimeError):
    """A weight sync failed: a peer closed the connection, or the group could not be formed."""


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A weight sync waited longer than its timeout for a peer."""


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass
class SyncGroup:
    """One member of a weight-sync group. Rank 0 calls :meth:`send`; every other rank :meth:`receive`."""

    rank: int
    world_size: int
    backend: str
    timeout_s: float
    address: str
    device: torch.device
    _pg: Any = field(repr=False)
    _store: Any = field(repr=False)

    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = opts.rootTensor = 0
        opts.timeout = timedelta(seconds=self.timeout_s)
        started = time.monotonic()
        try:
            self._pg.broadcast([tensor], opts).wait()
        except RuntimeError as exc:
            waited = time.monotonic() - started
            if self.rank == 0:
                who = f"rank 0 (the sender) waited {waited:.1f}s for the {self.world_size - 1} receiving rank(s)"
            else:
                who = f"rank {self.rank} (a receiver) waited {waited:.1f}s for rank 0 (the sender)"
            msg = f"weight sync over {self.backend} at {self.address}: {who} to exchange {what}"
            text = str(exc).lower()
            if "timed out" in text or "timeout" in text:
                raise WeightSyncTimeout(
                    f"{msg}; no answer within timeout_s={self.timeout_s:g} (is the peer "
                    f"alive and in the same sync?). Underlying error: {exc}"
                ) from exc
            raise WeightSyncError(
                f"{msg}; the exchange failed (did the peer exit?). Underlying error: {exc}"
            ) from exc

    def send(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 256 << 20
    ) -> dict[str, int]:
        """Rank 0: broadcast every (name, tensor), packed into buckets of about ``bucket_bytes``.

        Tensors are consumed one at a time, so an iterator that gathers ZeRO-3 shards lazily keeps at
        most one bucket of full tensors alive. Returns ``{"tensors": n, "bytes": total, "buckets": k}``.
        """
        if self.rank != 0:
            raise WeightSyncError(f"SyncGroup.send: only rank 0 sends; this is rank {self.rank}")
        stats = {"tensors": 0, "bytes": 0, "buckets": 0}
        entries, parts, size = [], [], 0
        for name, tensor in named_tensors:
            flat = tensor.detach().to(self.device).contiguous().reshape(-1).view(torch.uint8)
            offset, nbytes = _align(size), flat.numel()
            entries.append(
                [name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, nbytes]
            )
            parts.append(flat)
            size = offset + nbytes
            stats["tensors"] += 1
            stats["bytes"] += nbytes
            if size >= bucket_bytes:
                self._send_bucket(entries, parts, size, stats)
                entries, parts, size = [], [], 0
        if entries:
            self._send_bucket(entries, parts, size, stats)
        self._broadcast(torch.zeros(2, dtype=torch.int64, device=self.device), "the end-of-transfer header")
        return stats

    def _send_bucket(self, entries: list[list[Any]], parts: list[torch.Tensor], size: int, stats: dict):
        index = stats["buckets"]
        stats["buckets"] += 1
        meta = json.dumps(entries).encode()
        meta += b" " * (_align(len(meta)) - len(meta))  # keeps the payload 16-byte aligned
        buffer = torch.empty(len(meta) + size, dtype=torch.uint8, device=self.device)
        buffer[: len(meta)].copy_(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
        payload = buffer[len(meta) :]
        for (_, _, _, offset, nbytes), flat in zip(entries, parts, strict=True):
            payload[offset : offset + nbytes].copy_(flat)
        header = torch.tensor([len(meta), size], dtype=torch.int64, device=self.device)
        self._broadcast(header, f"the header of bucket {index}")
        self._broadcast(buffer, f"bucket {index} ({len(entries)} tensors, {size} bytes)")

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Receivers: yield (name, tensor) in the order rank 0 sent them, until its end-of-transfer.

        Each tensor is a view into its bucket's buffer, valid until the caller drops it; consume the
        iterator to the end, or the next sync reads a half-finished stream.
        """
        if self.rank == 0:
            raise WeightSyncError("SyncGroup.receive: rank 0 is the sender")
        for index in itertools.count():
            header = torch.zeros(2, dtype=torch.int64, device=self.device)
            self._broadcast(header, f"the header of bucket {index}")
            meta_len, size = header.tolist()
            if meta_len == 0:
                return
            buffer = torch.empty(meta_len + size, dtype=torch.uint8, device=self.device)
            self._broadcast(buffer, f"bucket {index} ({size} bytes)")
            entries = json.loads(buffer[:meta_len].cpu().numpy().tobytes())
            payload = buffer[meta_len:]
            for name, dtype_name, shape, offset, nbytes in entries:
                yield name, payload[offset : offset + nbytes].view(getattr(torch, dtype_name)).view(shape)

    def close(self) -> None:
        if self.backend == "nccl" and hasattr(self._pg, "shutdown"):
            self._pg.shutdown()
        self._pg = self._store = None


def listening_store() -> dist.TCPStore:
    """A store server for rank 0 of a group yet to form, already listening on a port the OS chose (its
    ``port``, to hand the other ranks; it listens on every interface). A port picked by binding and closing
    a socket stays free only until another process binds it: Ray's own connections took one in CI, and the
    group failed with EADDRINUSE. A store that listens from the start leaves no such gap."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def init_sync_group(
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    device: str | torch.device | None = None,
    store: dist.TCPStore | None = None,
) -> SyncGroup:
    """Join a weight-sync group of ``world_size`` ranks; rank 0 (the sender) hosts its store on
    ``master_addr:master_port``. Blocks until every rank has joined, at most ``timeout_s`` seconds.
    Rank 0 passes the :func:`listening_store` whose port it handed out, or opens one on ``master_port`` here.

    ``backend`` is ``gloo`` (tensors travel through CPU memory) or ``nccl`` (``device`` must be the
    rank's GPU). The default process group, if any, is neither used nor changed. With NCCL, a stalled
    collective is ended by torch's NCCL watchdog after ``timeout_s`` rather than by an exception here.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight sync backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"weight sync rank {rank} is outside [0, world_size={world_size})")
    address = f"{master_addr}:{master_port}"
    timeout = timedelta(seconds=timeout_s)
    if device is None:
        device = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
    device = torch.device(device)
    if store is not None:
        if rank != 0 or store.port != master_port:
            raise ValueError(
                f"weight sync: a listening store is rank 0's, on port {master_port}; got rank {rank} "
                f"and port {store.port}"
            )
        store.set_timeout(timeout)
    else:
        try:
            store = dist.TCPStore(
                master_addr,
                master_port,
                world_size,
                is_master=rank == 0,
                timeout=timeout,
                wait_for_workers=False,
            )
        except (RuntimeError, TimeoutError) as exc:
            role = "host the store" if rank == 0 else "reach rank 0's store"
            raise WeightSyncTimeout(
                f"weight sync: rank {rank} could not {role} at {address} within "
                f"{timeout_s:g}s (is the sender up, and the address and port "
                f"right?): {exc}"
            ) from exc
    store = dist.PrefixStore(_STORE_PREFIX, store)
    try:
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        else:
            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
    except (RuntimeError, TimeoutError) as exc:
        raise WeightSyncTimeout(
            f"weight sync: rank {rank} waited {timeout_s:g}s at {address} for all "
            f"{world_size} ranks to join the {backend} group; some never came: "
            f"{exc}"
        ) from exc
    return SyncGroup(rank, world_size, backend, timeout_s, address, device, pg, store)
