"""The Ray actor that hosts one rollout engine with its agent executor and reward source."""

from __future__ import annotations

import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from rlhf_core import handles
from rlhf_core.errors import UserError
from rlhf_core.memory import keep_freed_memory
from rlhf_core.types import GenerationOutput, GenerationRequest, SamplingParams, Trajectory


class RolloutActor:
    """One rollout engine (resolved by name in this process) plus an ``rlhf_agents.RolloutWorker``. The
    controller makes it a Ray actor; everything it is given is plain data (config, names), never a plugin
    manager or a model."""

    def __init__(
        self,
        cfg,
        engine_name: str,
        index: int,
        reward_model: Any = None,
        num_threads: int | None = None,
        hosted: bool = False,
    ):
        """``hosted``: built inside a training rank's process (``TrainWorker.host``), whose thread runs every
        call in turn; the engine then decodes on that thread with the rank's torch threads."""
        from rlhf_agents.worker import RolloutWorker
        from rlhf_core.data import load_tokenizer
        from rlhf_core.plugins import get_plugin_manager, resolve
        from rlhf_core.vision import ImageProcessing

        pm = get_plugin_manager()
        factory = resolve(pm, "rollout_engines", engine_name, "--rollout.engine")
        # The HF engine's torch work stays on one thread: every thread that runs OpenMP ops gets its own worker
        # team, and two teams on the same cores throttle each other. Partial rollout keeps the Ray threads: its
        # weights must be able to land while a generation runs. Hosted, that one thread is the rank's own.
        one_thread = engine_name == "hf" and not cfg.train.partial_rollout_enable and not hosted
        self.engine_thread = ThreadPoolExecutor(1, thread_name_prefix="rlhf-engine") if one_thread else None
        if num_threads:  # per thread with OpenMP: Ray's and the engine's
            torch.set_num_threads(num_threads)
            self._on_engine_thread(torch.set_num_threads, num_threads)
        if not torch.cuda.is_available():  # a CPU engine frees and reallocates its KV cache every batch
            keep_freed_memory()
        self.engine = self._on_engine_thread(factory.create, cfg, index=index)
        # batched generate calls: on the engine's thread, which built it and loads its weights; hosted, on the
        # rank's own thread (blocking the event loop while it decodes); else the worker runs them on threads
        engine = self.engine
        if self.engine_thread is not None:
            engine = handles.threaded(self.engine, self.engine_thread)
        elif hosted:
            engine = handles.local(self.engine)
        self.tokenizer = load_tokenizer(cfg.actor.model_name_or_path, cfg.data)
        # The driver checked the agent and reward files, but here they are imported again and the executor is
        # built (on another machine, perhaps). Ray turns an error in __init__ into text holding the worker's
        # traceback; raised by ping() instead, it reaches the driver as itself, with its clear message.
        self.init_error: UserError | None = None
        images = ImageProcessing.for_model(cfg.actor.model_name_or_path)  # an environment's images, if a VLM
        try:
            self.worker = RolloutWorker.from_config(
                cfg, engine, self.tokenizer, pm, reward_model_handle=reward_model, image_processing=images
            )
        except UserError as exc:
            self.init_error = exc
        # With partial rollout the actor runs calls concurrently, so the first receive_weights can start
        # while init_weight_sync is still joining the group.
        self.sync_ready = threading.Event()
        self.sync_timeout = cfg.vllm.sync_timeout

    def _on_engine_thread(self, fn, *args, **kwargs):
        if self.engine_thread is None:
            return fn(*args, **kwargs)
        return self.engine_thread.submit(fn, *args, **kwargs).result()

    def rollout(
        self, prompts: list[dict], sampling: SamplingParams, step: int
    ) -> tuple[list[Trajectory], dict]:
        return self.worker.rollout(prompts, sampling, step), dict(
            self.worker.last_metrics
        )  # this rollout's metrics

    def generate(self, requests: list[GenerationRequest]) -> list[list[GenerationOutput]]:
        """The engine's samples of ``requests``, on its thread (``rlhf_core.primitives.Sampler.sample``)."""
        return self._on_engine_thread(self.engine.generate, requests)

    def update_weights(self, state_dict: dict) -> int:
        """Load HF-named weights (from the object store, or from the rank hosting this actor)."""
        self._on_engine_thread(self.engine.update_weights, state_dict.items())
        self.engine.reset_prefix_cache()
        return len(state_dict)

    def share_weights(self, named_tensors: dict) -> bool:
        """Let the engine decode from the hosting rank's own parameters instead of a copy (an HF engine in a
        training rank's process); False where the engine cannot (then weights come by :meth:`update_weights`)."""
        share = getattr(self.engine, "share_weights", None)
        return bool(share is not None and self._on_engine_thread(share, named_tensors))

    @property
    def borrowed(self) -> bool:
        """The engine decodes from the hosting rank's parameters: a weight sync has nothing to copy."""
        return bool(getattr(self.engine, "borrowed", False))

    def weight_sync_ranks(self) -> int:
        """Ranks the engine takes in the weight-broadcast group (one per tensor-parallel worker), or 0 for an
        engine without ``init_weight_sync``, whose weights then come through the object store."""
        return (
            getattr(self.engine, "tensor_parallel_size", 1) if hasattr(self.engine, "init_weight_sync") else 0
        )

    def init_weight_sync(self, **kwargs) -> None:
        """The engine joins the broadcast group (``master_addr``, ``master_port``, ``first_rank``,
        ``world_size``, ``backend``, ``timeout_s``)."""
        self._on_engine_thread(self.engine.init_weight_sync, **kwargs)
        self.sync_ready.set()

    def receive_weights(self) -> None:
        """Load the weights the policy's rank 0 is broadcasting through the sync group."""
        if not self.sync_ready.wait(self.sync_timeout):
            raise TimeoutError(
                f"no weight-sync group joined within --vllm.sync_timeout {self.sync_timeout:g} s"
            )
        self._on_engine_thread(self.engine.receive_weights)
        self.engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        self.engine.sleep(level)

    def wake_up(self) -> None:
        self.engine.wake_up()

    def where(self) -> str:
        """The host and Python this actor runs on: an inference node runs its own environment."""
        return f"{socket.gethostname()} ({sys.executable})"

    def ping(self) -> bool:
        """True once the actor is up; raises the user error that its set-up met, if any."""
        if self.init_error is not None:
            raise self.init_error
        return True


class RewardModelWorkers:
    """The reward-model worker group as rlhf-agents' reward-model source sees it: ids in, floats out. The
    driver runs it as a Ray actor on its own node, because the group handle it holds belongs to the train
    backend's package, which an inference node does not install; rollout actors reach it through its handle
    (``rlhf_core.handles``), whose futures the reward source awaits. One actor also keeps the engines' calls
    from interleaving on the ranks."""

    def __init__(self, group, pad_token_id: int, micro_batch_size: int):
        self.group, self.pad, self.micro = group, pad_token_id, micro_batch_size

    def compute_rewards(self, sequences: list[list[int]]) -> list[float]:
        from rlhf_core.batches import make_sequence_batch

        # the reward is read at the last token, so where the prompt ends does not matter
        chunks = [sequences[i : i + self.micro] for i in range(0, len(sequences), self.micro)]
        batches = [make_sequence_batch([s[:1] for s in c], [s[1:] for s in c], self.pad) for c in chunks]
        return [
            float(r) for rewards in handles.wait(self.group.forward(batches, head="rewards")) for r in rewards
        ]
