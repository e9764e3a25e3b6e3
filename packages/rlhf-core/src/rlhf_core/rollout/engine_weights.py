"""The weights an :class:`~rlhf_core.rollout.hf_engine.HFEngine` decodes from, as a base class of it: loading
what a trainer sends (full tensors, or LoRA adapters merged over the base), decoding from a trainer's own
tensors, sleeping and waking up, and the weight-sync group that brings them from another process.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Iterable, Mapping

import torch

from rlhf_core.rollout.decode import fuse_projections
from rlhf_core.weight_sync import SyncGroup, init_sync_group, is_adapter, lora_pairs, merge_lora_pair


class EngineWeights:
    """What the engine keeps to take weights in, and the calls that do (see the module docstring). The engine
    sets ``model``, ``device``, ``plan``, ``own_weights`` and ``_fused`` (:func:`fuse_projections` of an owned
    model) before :meth:`_track_weights`; ``_weights`` (its decode layout) and ``_decoders`` (static decoders)
    are dropped here whenever the weights move."""

    def _track_weights(self, model: torch.nn.Module) -> None:
        self._weights: dict | None = None  # decode_weights of an owned model; dropped whenever they change
        self.borrowed = False  # the parameters are a trainer's tensors (share_weights), changing behind us
        # Every name a trainer may send (tied weights appear under both names) -> the tensor to fill.
        self._targets: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        self._targets.update(dict(model.named_buffers(remove_duplicate=False)))
        self._params = {name: p for name, p in model.named_parameters()}  # unique parameters
        self._shapes = {name: p.shape for name, p in self._params.items()}
        self._canonical = {id(p): name for name, p in self._params.items()}  # a tied alias -> its unique name
        self._missing: set[str] = set()  # parameters not received since a level-2 sleep
        # weight name -> the base W0 its LoRA adapter is merged into
        self._lora_base: dict[str, torch.Tensor] = {}
        self._asleep = 0
        self._sync: SyncGroup | None = None
        self._decoders: dict = {}  # the engine's StaticDecoders by (rows, columns, weight addresses), oldest first

    # --- weights --------------------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> None:
        """Copy tensors into the parameters or buffers of the same HF names (cast to the engine's dtype). A LoRA
        policy's adapters (``<layer>.lora_A``/``.lora_B`` pairs, :func:`rlhf_core.weight_sync.lora_adapter_tensors`)
        are merged instead: the layer's weight (or the parameter ``<layer>`` itself, fused experts) becomes
        ``W0 + B @ A``, ``W0`` the base weight the engine held before its first adapter (kept as a copy of each
        adapted weight)."""
        self._weights = None  # packed copies are snapshots
        named_tensors = iter(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        if (first := next(named_tensors, None)) is None:
            return
        named_tensors = itertools.chain([first], named_tensors)
        some = ", ".join(itertools.islice(self._params, 3))  # what names look like, for the errors
        if is_adapter(first[0]):  # merged rather than run as extra matmuls: decode keeps its fast path
            for layer, lora_a, lora_b in lora_pairs(named_tensors):
                name = layer if layer in self._params else layer + ".weight"  # a fused expert stack, a layer
                if (target := self._params.get(name)) is None:
                    raise KeyError(
                        f"update_weights: the LoRA layer {layer!r} has no weight {name!r} in this "
                        f"model (names look like {some}, ...)"
                    )
                if name in self._missing:
                    raise RuntimeError(
                        f"update_weights: {name!r} was discarded by sleep(level=2), and a LoRA "
                        "adapter needs the base weight under it; send the full weights first"
                    )
                if name not in self._lora_base:  # the first adapter on this weight: it holds the base now
                    self._lora_base[name] = target.detach().clone()
                merge_lora_pair(self._lora_base[name], lora_a, lora_b, out=target)
            return
        for name, tensor in named_tensors:
            self._lora_base.pop(name, None)  # a full weight replaces the base an adapter was merged into
            if (target := self._targets.get(name)) is None:
                raise KeyError(
                    f"update_weights: {name!r} is not a weight of this model (names look like {some}, ...)"
                )
            canonical = self._canonical.get(id(target))
            expected = self._shapes[canonical] if canonical is not None else target.shape
            if tuple(tensor.shape) != tuple(expected):
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model "
                    f"expects {tuple(expected)}"
                )
            target.copy_(tensor)
            self._missing.discard(canonical)

    @torch.no_grad()
    def share_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> bool:
        """Decode from ``named_tensors`` themselves (a trainer's parameters in this process, by HF name) instead
        of a copy: the engine's own weights are freed, and the trainer's in-place updates reach the engine
        without :meth:`update_weights`. Returns False, sharing nothing, unless the engine owns its weights
        (loaded from a path) or already shares, and every parameter has a tensor of the same name, shape,
        dtype and device. :meth:`sleep` ends the sharing: after :meth:`wake_up` the engine owns its weights
        again and needs :meth:`update_weights`."""
        if (
            self._asleep
            or not (self.own_weights or self.borrowed)
            or not all(
                (t := named_tensors.get(name)) is not None
                and t.shape == p.shape
                and t.dtype == p.dtype
                and t.device == p.device
                for name, p in self._params.items()
            )
        ):
            return False
        for name, p in self._params.items():
            p.data = named_tensors[name].detach()
        self._weights = self._fused = None
        self._decoders.clear()
        self.own_weights, self.borrowed = False, True
        return True

    def init_weight_sync(
        self,
        master_addr: str,
        master_port: int,
        first_rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 600.0,
    ) -> None:
        """Join the weight-sync group as rank ``first_rank`` (the sender is rank 0); see
        :func:`rlhf_core.weight_sync.init_sync_group`. Call it on every engine while the sender joins; a group
        joined before is left first (a new group replaces one that held a dead engine)."""
        self.close_weight_sync()
        device = self.device if backend == "nccl" else torch.device("cpu")
        self._sync = init_sync_group(
            master_addr, master_port, first_rank, world_size, backend, timeout_s, device=device
        )

    def receive_weights(self) -> None:
        """Receive one full set of weights from the sync group's rank 0 and load it."""
        if self._sync is None:
            raise RuntimeError("HFEngine.receive_weights: call init_weight_sync first")
        self.update_weights(self._sync.receive())

    def close_weight_sync(self) -> None:
        if self._sync is not None:
            self._sync.close()
            self._sync = None

    # --- memory ---------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Level 1 has nothing to do on a CPU engine: KV caches live only inside ``generate``."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self._asleep:
            return
        self._weights = self._fused = None  # level 2 frees the fused tensors; wake_up lays them out again
        self._decoders.clear()  # their caches, graphs and hold on the weights
        if self.borrowed:  # moved or discarded: after wake_up the weights are this engine's own again
            self.borrowed, self.own_weights = False, True
        for p in self._params.values():
            if level == 2:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            elif self.device.type != "cpu":
                p.data = p.data.to("cpu")
        # the bases of LoRA-merged weights go with the weights (discarded: the next sync must send full weights)
        self._lora_base = {} if level == 2 else {k: v.to("cpu") for k, v in self._lora_base.items()}
        self._asleep = level
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        for name, p in self._params.items():
            if self._asleep == 2:
                p.data = torch.empty(self._shapes[name], dtype=p.dtype, device=self.device)
            elif self._asleep == 1 and self.device.type != "cpu":
                p.data = p.data.to(self.device)
        if self._asleep == 2:
            self._missing = set(self._params)
        self._lora_base = {k: v.to(self.device) for k, v in self._lora_base.items()}
        if self.own_weights and self._asleep:  # the parameters are separate tensors again
            self._fused = fuse_projections(self.plan)
        self._asleep = 0
