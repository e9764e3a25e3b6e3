"""One rank's model (plus, for DPO/KTO, its frozen reference; for KD and multi-teacher OPD, its teachers) in
DeepSpeed engines: loading, the forward-only calls, checkpoints, the EMA, export, and sleep/wake. Every method
that touches a ZeRO-3 model is collective: all ranks must call it, with the same number of micro-batches."""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhf_core.batches import SequenceBatch, to_device
from rlhf_core.checkpoint import CheckpointError
from rlhf_core.memory import release_file_pages, release_free_heap
from rlhf_train_deepspeed import moe, ring_attn, shared_prefix, weights
from rlhf_train_deepspeed.ema import EMA
from rlhf_train_deepspeed.models import (
    accumulate_tied_gradient_in_place,
    load_causal_lm,
    load_value_model,
    normalize_rewards,
    response_logprobs,
    response_values,
    sequence_rewards,
)
from rlhf_train_deepspeed.moe import Routing
from rlhf_train_deepspeed.strategy import Strategy, apply_lora, quantization_kwargs

ENGINE_TAG = "engine"


@dataclass
class ModelSpec:
    """What one worker group hosts; built from the run config by :mod:`rlhf_train_deepspeed.backend`."""

    path: str
    kind: str
    """``causal`` (policy, reference, SFT/DPO/KTO model) or ``value`` (critic, reward model)."""
    trainable: bool
    optim: Any = None
    """The ``OptimizerFields`` section (actor, critic or model) of a trained model."""
    micro_batch_size: int = 1
    grad_accum: int = 1
    total_steps: int = 1
    """Optimizer steps of the whole run, for the LR schedule."""
    grad_ckpt: bool = False
    grad_ckpt_reentrant: bool = False
    offload: bool = False
    """Frozen models: keep ZeRO-3 weights in CPU memory (``--ref.offload``, ``--reward.offload``)."""
    normalize_reward: bool = False
    """Reward models: return ``(r - mean) / std`` with the statistics stored in the model's config."""
    ref_path: str | None = None
    """DPO/KTO: a frozen reference model hosted in the same worker; KD: the teacher."""
    ref_offload: bool = False
    teacher_paths: list[str] = field(default_factory=list)
    """Multi-teacher OPD: the teachers after the first (the group's own model, or ``ref_path`` where the
    policy's ranks host the reference), each loaded frozen beside it; ``compute_logprobs(teacher=i)``."""
    ema_beta: float | None = None
    """Trained models: keep an EMA of the weights with this decay (``--train.enable_ema``,
    ``--train.ema_beta``) and export it instead of the trained weights; None: no EMA."""
    freeze_vision: bool = False
    """A trained vision-language model keeps its vision tower frozen (``--actor.freeze_visual_encoder``)."""


def move_zero3_state(engine, asleep: bool) -> None:
    """Hybrid engine: move a ZeRO-3 engine's training state to CPU memory (``asleep``) or back to its device.

    DeepSpeed's ``offload_states`` moves the bf16 parameters, gradients and buckets but, unless the optimizer
    is its own FusedAdam, not the fp32 master partitions and Adam moments; torch's fused AdamW keeps its
    moments under the same state keys, so those two move here. CPU ranks make the same calls (a no-op)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as State
    from deepspeed.runtime.zero.offload_states import offload_adam_states, reload_adam_states

    zero = engine.optimizer
    device = "cpu" if asleep else get_accelerator().current_device_name()
    if asleep:
        engine.offload_states(include=[State.lp_params, State.lp_grads, State.contiguous_grad_buffer])
        offload_adam_states(zero.optimizer, device)
    else:
        engine.reload_states()
        reload_adam_states(zero.optimizer, device)
    for flat in zero.fp32_partitioned_groups_flat:
        flat.data = flat.data.to(device)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def causal_attn(path: str, ds, attn: str) -> str:
    """``attn``, or the shared-prompt attention where ``--ds.shared_prefix`` applies to the model at ``path``."""
    if attn != ds.attn_implementation or not ds.shared_prefix:  # ring attention chose its own
        return attn
    from transformers import AutoConfig

    return shared_prefix.attn_implementation(AutoConfig.from_pretrained(path), ds)


class RankModel:
    """The model of ``spec`` loaded into DeepSpeed engines on rank ``rank`` (seeded with ``seed`` first)."""

    def __init__(self, rank: int, spec: ModelSpec, ds, seed: int = 42, full_determinism: bool = False):
        self.rank, self.spec, self.ema = rank, spec, None
        self.strategy = Strategy(ds, full_determinism)
        self.packing = bool(ds.packing_samples)
        self.ring = (
            self.strategy.ring
        )  # this rank's ring-attention group (--ds.ring_attn_size > 1), else None
        self.dp_size = self.strategy.dp_size  # the loss multiplier: ranks / ring size (see ring_attn)
        self.gpu_memory: dict[str, float] = {}
        """GiB this process had allocated on its GPU around the last :meth:`sleep` / :meth:`wake_up`."""
        self._registered: dict[tuple[str, str], Any] = {}
        random.seed(seed)
        np.random.seed(seed % (1 << 32))
        torch.manual_seed(seed)
        dtype = self.strategy.dtype
        attn = ds.attn_implementation if self.ring is None else ring_attn.attn_implementation(self.ring)
        # None leaves the choice to transformers (a MoE model's grouped_mm where it can run, else eager)
        experts = {"experts_implementation": ds.experts_implementation} if ds.experts_implementation else {}

        def load_frozen(path: str, offload: bool):
            zero3 = self.strategy.zero3_init_context(False)  # noqa: F841 - must stay alive while loading
            frozen = load_causal_lm(path, dtype, causal_attn(path, ds, attn), **experts)
            return self.strategy.prepare_eval(frozen, offload)

        zero3 = self.strategy.zero3_init_context(spec.trainable)  # noqa: F841 - must stay alive while loading
        quant = quantization_kwargs(ds, dtype) if spec.trainable else {}
        aux_coef = getattr(spec.optim, "aux_loss_coef", 0.0) if spec.trainable else 0.0  # critics: none
        replay = getattr(spec.optim, "router_replay", False) and spec.trainable
        if spec.kind == "value":
            model = load_value_model(
                spec.path, dtype, causal_attn(spec.path, ds, attn), ds.value_head_prefix, **quant, **experts
            )
        elif spec.kind == "causal":
            # the aux loss and router replay need each routed token's row in the padded batch: not the
            # shared-prompt layout
            trained_attn = attn if aux_coef or replay else causal_attn(spec.path, ds, attn)
            model = load_causal_lm(spec.path, dtype, trained_attn, **quant, **experts)
        else:
            raise ValueError(f"unknown model kind {spec.kind!r}")
        self.hf_config = model.config
        if spec.freeze_vision:
            from rlhf_core.vision import is_vision_language, vision_tower

            if not is_vision_language(model.config):
                raise ValueError(f"--actor.freeze_visual_encoder: {spec.path} is not a vision-language model")
            vision_tower(model).requires_grad_(False)
        self.routing = None
        """A trained MoE model's router hooks: its aux loss and routing metrics (see :mod:`.moe`)."""
        if spec.trainable:
            freeze = getattr(spec.optim, "freeze_moe_router", False)
            self.routing = Routing.attach(model, aux_coef, freeze, replay)
            if spec.kind == "causal":
                model = apply_lora(model, ds.lora, "CAUSAL_LM")
            else:
                model = apply_lora(model, ds.lora, "FEATURE_EXTRACTION", [ds.value_head_prefix])
            self.engine = self.strategy.prepare_train(model, spec)
            fp32_zero0 = self.strategy.ds.zero_stage == 0 and dtype == torch.float32
            if spec.kind == "causal" and fp32_zero0 and not weights.is_peft(self.engine.module):
                # DeepSpeed reads a plain .grad: no [V, H] transients at the peak
                accumulate_tied_gradient_in_place(self.engine.module)
            if spec.ema_beta is not None:
                self.ema = EMA(self.engine, spec.ema_beta)
        else:
            self.engine = self.strategy.prepare_eval(model, spec.offload)
        del zero3
        self.ref_engine = load_frozen(spec.ref_path, spec.ref_offload) if spec.ref_path else None
        self.teacher_engines = [load_frozen(p, spec.ref_offload or spec.offload) for p in spec.teacher_paths]
        self.num_parameters = sum(p.numel() for p in model.parameters())

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def pad_token_id(self) -> int:
        return self.hf_config.pad_token_id or 0

    def dev(self, obj):
        return to_device(obj, self.strategy.device)

    def registered(self, seam: str, name: str, flag: str) -> Any:
        """The plugin ``name`` of ``seam`` (a policy loss, a KL estimator), looked up once per model."""
        if (seam, name) not in self._registered:
            from rlhf_core.plugins import get_plugin_manager, resolve

            if not self._registered:  # reading the entry points costs ~10 ms: once, not per step
                self._plugins = get_plugin_manager()
            self._registered[seam, name] = resolve(self._plugins, seam, name, flag)
        return self._registered[seam, name]

    # --- forward-only calls ---

    @torch.no_grad()
    def compute_logprobs(self, batches: list[SequenceBatch], temperature, with_entropy, ref, teacher):
        """Per micro-batch ``[B, T]`` response log-probs (and entropies) at ``temperature``, on CPU; with ``ref``,
        those of the frozen model this rank hosts beside its own (``ModelSpec.ref_path``); ``teacher`` i > 0:
        those of multi-teacher OPD's teacher i (``ModelSpec.teacher_paths[i - 1]``)."""
        engine = self.teacher_engines[teacher - 1] if teacher else self.ref_engine if ref else self.engine
        frozen = engine is not self.engine
        if frozen:  # its weights come in next: first hand back the heap pages the last step freed
            release_free_heap()
        engine.eval()
        out = []
        for b in map(self.dev, batches):
            with moe.replaying(None if frozen else self.routing, b, self.packing):
                lp, ent, _ = response_logprobs(
                    engine, b, temperature, self.packing, with_entropy, ring=self.ring
                )
            out.append((lp.cpu(), ent.cpu()) if with_entropy else lp.cpu())
        if frozen:  # idle until the next step: its weights to the page cache
            release_file_pages(engine.parameters())
        return out

    @torch.no_grad()
    def compute_values(self, batches: list[SequenceBatch]) -> list[torch.Tensor]:
        self.engine.eval()
        return [response_values(self.engine, self.dev(b), self.packing, self.ring)[0].cpu() for b in batches]

    @torch.no_grad()
    def compute_rewards(self, batches: list[SequenceBatch]) -> list[torch.Tensor]:
        self.engine.eval()
        rewards = [sequence_rewards(self.engine, self.dev(b), self.packing, self.ring) for b in batches]
        if self.spec.normalize_reward:
            rewards = [normalize_rewards(r, self.hf_config) for r in rewards]
        return [r.cpu() for r in rewards]

    # --- state ---

    def save_checkpoint(self, path: str) -> None:
        """DeepSpeed engine state (model, optimizer, LR schedule), this rank's RNG states and EMA shards."""
        self.engine.save_checkpoint(path, tag=ENGINE_TAG)
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, Path(path) / f"rng_rank{self.rank}.pt")
        if self.ema is not None:
            self.ema.save(Path(path) / f"ema_rank{self.rank}.pt")

    def load_checkpoint(self, path: str) -> None:
        # CheckpointManager.latest() checked the files in the driver; this names the checkpoint when damage it
        # cannot see (garbage of the right size and structure) makes DeepSpeed fail
        try:
            load_path, _ = self.engine.load_checkpoint(
                path, tag=ENGINE_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
            )
        except Exception as exc:
            raise CheckpointError(
                f"{path}/{ENGINE_TAG}: DeepSpeed could not load rank {self.rank}'s state: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed state under {path}/{ENGINE_TAG}")
        rng_file = Path(path) / f"rng_rank{self.rank}.pt"
        if (
            not rng_file.exists()
        ):  # without it the resumed run would not sample what the uninterrupted one did
            raise CheckpointError(f"{rng_file} is missing: rank {self.rank}'s RNG state cannot be restored")
        rng = torch.load(rng_file, weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        if self.ema is not None:
            self.ema.load(Path(path) / f"ema_rank{self.rank}.pt", warn=self.rank == 0)

    def export_hf(self, out_dir: str, config_updates, tokenizer_path, ema: bool | None) -> None:
        """Write an HF model (safetensors) to ``out_dir`` on rank 0: a causal LM loadable with
        ``AutoModelForCausalLM``, or a value model loadable with ``AutoModelForSequenceClassification``.
        With LoRA the PEFT adapter is written instead (merge it with ``rlhf lora-merge``). ``ema`` (default:
        whether this model keeps an EMA) writes the EMA weights instead of the trained ones."""
        if ema is None:
            ema = self.ema is not None
        if ema and self.ema is None:
            raise ValueError("export_hf(ema=True): this model keeps no EMA (--train.enable_ema is off)")
        release_free_heap()  # the tokenizer and the files' buffers need not come on top of training's heap
        with self.ema.swapped_in() if ema else contextlib.nullcontext():
            value_model = self.spec.kind == "value"
            weights.write_hf(self.module, self.rank, value_model, out_dir, config_updates, tokenizer_path)

    # --- hybrid engine ---

    def sleep(self) -> None:
        """Hybrid engine (``--ds.enable_sleep``): move ZeRO-3 training state (parameters, gradients,
        optimizer) and the fp32 EMA to CPU memory while the rollout engines use the GPU (on CPU ranks the
        same calls, with nothing to free)."""
        if self.ema is not None:
            self.ema.to("cpu")
        if self.strategy.ds.zero_stage == 3 and self.spec.trainable:
            self._note_gpu_memory("gpu_before_sleep_gib")
            move_zero3_state(self.engine, asleep=True)
            self._note_gpu_memory("gpu_asleep_gib")

    def wake_up(self) -> None:
        if self.strategy.ds.zero_stage == 3 and self.spec.trainable:
            move_zero3_state(self.engine, asleep=False)
            self._note_gpu_memory("gpu_woken_gib")
        if self.ema is not None:
            self.ema.to(None)

    def _note_gpu_memory(self, key: str) -> None:
        if torch.cuda.is_available():
            self.gpu_memory[key] = torch.cuda.memory_allocated() / 2**30
