"""One training rank: :class:`TrainWorker`, the object :mod:`rlhf_train_deepspeed.group` runs N of as Ray actors
(or one in the driver's process) and fans calls out to. It composes the parts that do the work: the model
(:class:`~rlhf_train_deepspeed.rank_model.RankModel`: loading, forward, checkpoints, EMA, export, sleep/wake), the
training step over a registered loss (:class:`~rlhf_train_deepspeed.learner.Learner`: ``forward_backward`` and
``optim_step``), and the objects hosted in the rank's process (:class:`~rlhf_train_deepspeed.host.InRankHost`).
Every method that touches a ZeRO-3 model is collective: all ranks must call it, with the same number of
micro-batches."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

from rlhf_core import weight_sync
from rlhf_core.memory import keep_freed_memory
from rlhf_train_deepspeed import weights
from rlhf_train_deepspeed.ema import ema_update_  # noqa: F401 - re-exported: its home before the split
from rlhf_train_deepspeed.host import InRankHost
from rlhf_train_deepspeed.learner import Learner
from rlhf_train_deepspeed.losses import LOSSES, SupervisedConfigLite  # noqa: F401 - re-exported
from rlhf_train_deepspeed.rank_model import ModelSpec, RankModel, causal_attn  # noqa: F401 - re-exported
from rlhf_train_deepspeed.strategy import StepResult, Strategy, add_metrics

DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class TrainWorker:
    """One rank. ``rank``/``world_size`` come from the group; the process group is joined through
    environment variables (no ``deepspeed`` launcher)."""

    def __init__(self, rank: int, world_size: int, num_threads: int | None = None):
        self.rank, self.world_size = rank, world_size
        # what close() gives back to a process that outlives the rank (a single-process run's driver)
        self._saved = ({k: os.environ.get(k) for k in DIST_ENV}, torch.get_num_threads())
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
        # Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES, so the local device is 0 unless one
        # actor sees several GPUs.
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        os.environ["LOCAL_RANK"] = str(rank % visible if visible > 1 else 0)
        if num_threads:
            torch.set_num_threads(num_threads)
        if not visible:  # a CPU rank frees and reallocates its activations every step
            keep_freed_memory()
        self.model: RankModel | None = None
        self.learner: Learner | None = None
        self._hosted = InRankHost()
        self._sync_group = None
        self._stores: dict[int, Any] = {}
        """Stores :meth:`master_address` opened, by port, until the group they are for is joined."""

    # --- set-up ---

    def master_address(self) -> tuple[str, int]:
        """Rank 0's address and the port of a store it already listens on (``weight_sync.listening_store``),
        for the ranks of its group or the engines of a weight-sync group; the call that joins takes the store."""
        store = weight_sync.listening_store()
        self._stores[store.port] = store
        ray = sys.modules.get("ray")  # a single-process run has no Ray (nor imports it)
        host = ray.util.get_node_ip_address() if ray is not None and ray.is_initialized() else "127.0.0.1"
        return host, store.port

    def init_distributed(self, address: tuple[str, int]) -> None:
        """Join the group whose rank 0 is at ``address`` (:meth:`master_address` of rank 0)."""
        os.environ.update(MASTER_ADDR=address[0], MASTER_PORT=str(address[1]))
        Strategy.init_distributed(address, self._stores.pop(address[1], None))

    def init_model(self, spec: ModelSpec, ds, seed: int = 42, full_determinism: bool = False) -> dict:
        """Load the model described by ``spec`` into a DeepSpeed engine (replacing any previous one)."""
        self.model = RankModel(self.rank, spec, ds, seed, full_determinism)
        self.learner = Learner(self.model)
        return {"rank": self.rank, "num_parameters": self.model.num_parameters}

    @property
    def engine(self):
        return self.model.engine if self.model else None

    @property
    def ref_engine(self):
        return self.model.ref_engine if self.model else None

    @property
    def hf_config(self):
        return self.model.hf_config

    def _module(self) -> torch.nn.Module:
        return self.model.module

    # --- the learner primitives, this rank's part (rlhf_train_deepspeed.group.WorkerGroup fans them out) ---

    def forward(
        self,
        batches: list,
        temperature: float = 1.0,
        head: str = "logprobs",
        teacher: int = 0,
        loss_cfg: Any = None,
    ) -> list:
        """Per micro-batch, without gradients: ``logprobs`` ``[B, T]`` response log-probs at ``temperature``
        (:meth:`RankModel.compute_logprobs`; ``teacher`` i > 0: multi-teacher OPD's teacher i), ``entropy``
        ``(logprobs, entropy)`` pairs, ``ref`` the log-probs of the frozen model hosted beside this one,
        ``values`` ``[B, T]`` critic values of the state before each response token, ``rewards`` ``[B]`` the
        value head at the last token (normalised when configured); or a registered loss (``LOSSES``) evaluated
        with ``loss_cfg``: ``(metrics, weight)``, the metrics with the micro-batch's mean ``loss`` (RM: and
        ``_rewards``, its sequences' rewards, for the normalisation statistics)."""
        model = self.model
        if head in LOSSES:
            return [
                ({"loss": float(v), **m}, w) for v, m, w in self.learner.evaluate(batches, head, loss_cfg)
            ]
        if head == "values":
            return model.compute_values(batches)
        if head == "rewards":
            return model.compute_rewards(batches)
        if head not in ("logprobs", "entropy", "ref"):
            raise ValueError(
                f"unknown forward head {head!r}; heads: logprobs, entropy, ref, values, rewards, a loss"
            )
        return model.compute_logprobs(batches, temperature, head == "entropy", head == "ref", teacher)

    def forward_backward(
        self, micro_batches: list, loss: str, loss_cfg: Any, counts: dict[str, float]
    ) -> StepResult:
        """Run the loss registered as ``loss`` (``rlhf_train_deepspeed.losses.LOSSES``) over this rank's
        micro-batches with backward; see :meth:`Learner.forward_backward`."""
        return self.learner.forward_backward(micro_batches, loss, loss_cfg, counts)

    def optim_step(self) -> StepResult:
        """Apply the optimizer step of the gradients accumulated since the last (:meth:`Learner.optim_step`);
        on a GPU with the step's peak memory in its metrics."""
        result = self.learner.optim_step()
        if torch.cuda.is_available():  # the process's (a hosted engine's memory included)
            peak = torch.cuda.max_memory_allocated() / 2**30
            add_metrics(result.metrics, {"gpu_peak_gib": peak, **self.model.gpu_memory}, 1.0)
        return result

    def save_state(self, path: str) -> None:
        self.model.save_checkpoint(path)

    def load_state(self, path: str) -> None:
        self.model.load_checkpoint(path)

    def export(
        self,
        out_dir: str,
        config_updates: dict | None = None,
        tokenizer_path: str | None = None,
        ema: bool | None = None,
    ) -> None:
        """Write an HF model (safetensors) to ``out_dir`` on rank 0 (:meth:`RankModel.export_hf`)."""
        self.model.export_hf(out_dir, config_updates, tokenizer_path, ema)

    # --- weights out ---

    def named_weights(
        self, bucket_bytes: int = weights.WEIGHT_BUCKET_BYTES, trainable_only: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, full tensor)`` pairs (:func:`rlhf_train_deepspeed.weights.named_weights`)."""
        return weights.named_weights(self._module(), bucket_bytes, trainable_only)

    def weights(self) -> dict[str, torch.Tensor] | None:
        """What the engines get (``weights.engine_weights``) as CPU tensors on rank 0 (None on the others), for
        the object-store sync path."""
        sent = weights.engine_weights(self._module())
        out = {name: t.cpu() for name, t in sent if self.rank == 0}  # every rank gathers
        return out if self.rank == 0 else None

    def broadcast_weights_to_engines(
        self,
        master_addr: str,
        master_port: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 600.0,
    ) -> int:
        """One rank's part of ``TrainGroup.broadcast_weights_to_engines_async`` (whose docstring describes the
        sync group's life): rank 0 sends ``weights.engine_weights`` as sync rank 0, hosting its store at
        ``master_addr:master_port``. Returns the number of tensors sent (0 on ranks other than 0)."""
        sent = weights.engine_weights(self._module())
        if self.rank != 0:
            for _ in sent:  # the ZeRO-3 gathers only
                pass
            return 0
        if self._sync_group is not None and self._sync_group.address != f"{master_addr}:{master_port}":
            self._sync_group.close()
            self._sync_group = None
        if self._sync_group is None:
            self._sync_group = weight_sync.init_sync_group(
                master_addr,
                master_port,
                0,
                world_size,
                backend,
                timeout_s,
                store=self._stores.pop(master_port, None),
            )
        return self._sync_group.send(sent)["tensors"]

    # --- hybrid engine, end ---

    def sleep(self) -> None:
        """Hybrid engine (``--ds.enable_sleep``): training state to CPU memory (:meth:`RankModel.sleep`)."""
        self.model.sleep()

    def wake_up(self) -> None:
        """Undo :meth:`sleep` before the next training or forward call."""
        self.model.wake_up()

    def close(self) -> None:
        """Drop the models, optimizer and hosted objects and give back the environment and thread count: the end
        of a rank that lives in the driver's process (a single-process run, ``rlhf_core.handles.local``), where no
        process exit does it, including the process group (a later rank in this process joins a new one)."""
        self.model = self.learner = None
        self._hosted.clear()
        Strategy.close_distributed(self._sync_group)
        gc.collect()
        env, threads = self._saved
        for k, v in env.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
        torch.set_num_threads(threads)

    # --- other roles in this process ---

    def host(self, name: str, cls: type, *args, **kwargs) -> None:
        """Build ``cls(*args, **kwargs)`` in this rank's process under ``name`` (a rollout engine colocated with
        this rank on CPU), instead of in a process of its own; :meth:`call_hosted` reaches it. See
        :meth:`InRankHost.host` for the objects that decode from the rank's own parameters."""
        self._hosted.host(self.model, name, cls, *args, **kwargs)

    def call_hosted(self, name: str, method: str, *args, **kwargs) -> Any:
        return self._hosted.call(name, method, *args, **kwargs)

    def push_weights_to_hosted(self, name: str) -> int:
        """Load this rank's weights into the object hosted under ``name`` (its ``update_weights``), in process.
        Collective under ZeRO-3 (:meth:`InRankHost.push_weights`). Returns the number of tensors loaded."""
        return self._hosted.push_weights(self.model, name)
