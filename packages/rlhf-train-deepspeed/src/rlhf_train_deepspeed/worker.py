"""One training rank: a model (plus, for DPO/KTO, its frozen reference; for KD, its teacher) in DeepSpeed
engines.

:class:`TrainWorker` is a plain class; :mod:`rlhf_train_deepspeed.group` runs N of them as Ray actors and
fans calls out. Every method that touches a ZeRO-3 model is collective: all ranks must call it, with the
same number of micro-batches."""

from __future__ import annotations

import contextlib
import gc
import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhf_core import weight_sync
from rlhf_core.batches import (
    CriticMicroBatch,
    PolicyMicroBatch,
    PolicyStepConfig,
    SequenceBatch,
    concat_batches,
    to_device,
)
from rlhf_core.checkpoint import CheckpointError
from rlhf_core.memory import keep_freed_memory, release_file_pages, release_free_heap
from rlhf_train_deepspeed import ring_attn, shared_prefix
from rlhf_train_deepspeed.models import (
    accumulate_tied_gradient_in_place,
    load_causal_lm,
    load_value_model,
    normalize_rewards,
    response_logits,
    response_logprobs,
    response_values,
    sequence_classification_architecture,
    sequence_rewards,
    step_logits,
)
from rlhf_train_deepspeed.strategy import StepResult, Strategy, add_metrics, apply_lora, quantization_kwargs

ENGINE_TAG = "engine"
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
WEIGHT_BUCKET_BYTES = 256 << 20


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


@dataclass
class SupervisedConfigLite:
    """The loss settings of the SFT/RM/DPO/KTO/PRM/KD modes (``--model.*``, ``--prm.*``, ``--teacher.*``)."""

    mode: str
    beta: float = 0.1
    ipo: bool = False
    label_smoothing: float = 0.0
    nll_loss_coef: float = 0.0
    loss_type: str = "sigmoid"
    margin_loss: bool = False
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    reward_token_ids: list[int] | None = None
    """PRM: the ids the step logits are restricted to; None: the whole vocabulary."""
    kd_coef: float = 0.4


def causal_attn(path: str, ds, attn: str) -> str:
    """``attn``, or the shared-prompt attention where ``--ds.shared_prefix`` applies to the model at ``path``."""
    if attn != ds.attn_implementation or not ds.shared_prefix:  # ring attention chose its own
        return attn
    from transformers import AutoConfig

    return shared_prefix.attn_implementation(AutoConfig.from_pretrained(path), ds)


@torch.no_grad()
def ema_update_(ema: list[torch.Tensor], params: list[torch.Tensor], beta: float) -> None:
    """In place, for every pair: ``ema_i = beta * ema_i + (1 - beta) * params_i``.

    ``ema_i`` is float32 with the shape of ``params_i`` (any shape: here one rank's local shard of a trainable
    parameter, the flat ``p.ds_tensor`` slice under ZeRO-3 or ``p.data`` under ZeRO 0-2). ``params_i`` may be
    bf16 or live on another device; it is upcast to float32 on ``ema_i``'s device. Under bf16 the average is
    over the bf16 module weights (what an export writes), not the optimizer's fp32 master weights."""
    if len(ema) != len(params):
        raise ValueError(f"ema_update_: {len(ema)} EMA tensors for {len(params)} parameters")
    for e, p in zip(ema, params, strict=True):
        e.mul_(beta).add_(p.to(device=e.device, dtype=torch.float32), alpha=1.0 - beta)


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
        self.engine = self.ref_engine = None
        self.teacher_engines: list = []
        self.spec: ModelSpec | None = None
        self._sync_group = None
        self._stores: dict[int, Any] = {}
        """Stores :meth:`master_address` opened, by port, until the group they are for is joined."""
        self._plugins = None
        self._hosted: dict[str, Any] = {}
        """Objects of other roles living in this rank's process (:meth:`host`), by name."""
        self.ema: list[torch.Tensor] | None = None
        """fp32 EMA of this rank's local shards of the trainable parameters (``ModelSpec.ema_beta``)."""
        self.gpu_memory: dict[str, float] = {}
        """GiB this process had allocated on its GPU around the last :meth:`sleep` / :meth:`wake_up`."""

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
        self.spec, self.ema = spec, None
        self.strategy = Strategy(ds, full_determinism)
        self.packing = bool(ds.packing_samples)
        self.ring = (
            self.strategy.ring
        )  # this rank's ring-attention group (--ds.ring_attn_size > 1), else None
        self.dp_size = self.strategy.dp_size  # the loss multiplier: ranks / ring size (see ring_attn)
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
        if spec.kind == "value":
            model = load_value_model(spec.path, dtype, attn, ds.value_head_prefix, **quant, **experts)
        elif spec.kind == "causal":
            model = load_causal_lm(spec.path, dtype, causal_attn(spec.path, ds, attn), **quant, **experts)
        else:
            raise ValueError(f"unknown model kind {spec.kind!r}")
        self.hf_config = model.config
        if spec.freeze_vision:
            from rlhf_core.vision import is_vision_language, vision_tower

            if not is_vision_language(model.config):
                raise ValueError(f"--actor.freeze_visual_encoder: {spec.path} is not a vision-language model")
            vision_tower(model).requires_grad_(False)
        if spec.trainable:
            if spec.kind == "causal":
                model = apply_lora(model, ds.lora, "CAUSAL_LM")
            else:
                model = apply_lora(model, ds.lora, "FEATURE_EXTRACTION", [ds.value_head_prefix])
            self.engine = self.strategy.prepare_train(model, spec)
            if (
                spec.kind == "causal"
                and self.strategy.ds.zero_stage == 0
                and dtype == torch.float32
                and not self._is_peft()
            ):  # DeepSpeed reads a plain .grad: no [V, H] transients at the peak
                accumulate_tied_gradient_in_place(self._module())
            if spec.ema_beta is not None:
                self.ema = [s.detach().to(torch.float32, copy=True) for s in self._local_shards()]
        else:
            self.engine = self.strategy.prepare_eval(model, spec.offload)
        del zero3
        self.ref_engine = load_frozen(spec.ref_path, spec.ref_offload) if spec.ref_path else None
        self.teacher_engines = [load_frozen(p, spec.ref_offload or spec.offload) for p in spec.teacher_paths]
        return {"rank": self.rank, "num_parameters": sum(p.numel() for p in model.parameters())}

    def _dev(self, obj):
        return to_device(obj, self.strategy.device)

    # --- forward-only calls ---

    @torch.no_grad()
    def compute_logprobs(
        self,
        batches: list[SequenceBatch],
        temperature: float = 1.0,
        with_entropy: bool = False,
        ref: bool = False,
        teacher: int = 0,
    ) -> list[torch.Tensor] | list[tuple[torch.Tensor, torch.Tensor]]:
        """Per micro-batch ``[B, T]`` response log-probs (and entropies) at ``temperature``, on CPU; with ``ref``,
        those of the frozen model this rank hosts beside its own (``ModelSpec.ref_path``); ``teacher`` i > 0:
        those of multi-teacher OPD's teacher i (``ModelSpec.teacher_paths[i - 1]``)."""
        engine = self.teacher_engines[teacher - 1] if teacher else self.ref_engine if ref else self.engine
        frozen = engine is not self.engine
        if frozen:  # its weights come in next: first hand back the heap pages the last step freed
            release_free_heap()
        engine.eval()
        out = []
        for b in batches:
            lp, ent, _ = response_logprobs(
                engine, self._dev(b), temperature, self.packing, with_entropy, ring=self.ring
            )
            out.append((lp.cpu(), ent.cpu()) if with_entropy else lp.cpu())
        if frozen:  # idle until the next step: its weights to the page cache
            release_file_pages(engine.parameters())
        return out

    @torch.no_grad()
    def compute_values(self, batches: list[SequenceBatch]) -> list[torch.Tensor]:
        """Per micro-batch ``[B, T]`` critic values of the state before each response token."""
        self.engine.eval()
        return [response_values(self.engine, self._dev(b), self.packing, self.ring)[0].cpu() for b in batches]

    @torch.no_grad()
    def compute_rewards(self, batches: list[SequenceBatch]) -> list[torch.Tensor]:
        """Per micro-batch ``[B]`` rewards: value head at the last token, normalised when configured."""
        self.engine.eval()
        rewards = [sequence_rewards(self.engine, self._dev(b), self.packing, self.ring) for b in batches]
        if self.spec.normalize_reward:
            rewards = [normalize_rewards(r, self.hf_config) for r in rewards]
        return [r.cpu() for r in rewards]

    # --- RL steps ---

    def train_policy(
        self, micro_batches: list[PolicyMicroBatch], cfg: PolicyStepConfig, counts: dict[str, float]
    ) -> StepResult:
        """One optimizer step of the policy loss ``cfg.loss`` (+ entropy bonus, + KL loss) over the
        micro-batches; ``counts`` holds the step's global ``num_tokens`` / ``num_sequences``."""
        from rlhf_algos.kl import kl_loss
        from rlhf_algos.policy_loss import entropy_loss
        from rlhf_core.plugins import get_plugin_manager, resolve
        from rlhf_core.types import LossAggregation, PolicyLossInput

        if self._plugins is None:  # reading the entry points costs ~10 ms: once per worker, not per step
            self._plugins = get_plugin_manager()
        policy_loss = resolve(self._plugins, "policy_losses", cfg.loss, "--actor.policy_loss_type")
        kl_fn = (
            resolve(self._plugins, "kl_estimators", cfg.kl_estimator, "--algo.kl.estimator")
            if cfg.kl_coef
            else None
        )
        agg = LossAggregation(
            mode=cfg.agg_mode,
            num_tokens=counts["num_tokens"],
            num_sequences=counts["num_sequences"],
            max_len=cfg.max_len,
            dp_size=self.dp_size,
        )

        def loss_fn(mb: PolicyMicroBatch):
            mb = self._dev(mb)
            lp, ent, mask = response_logprobs(
                self.engine,
                mb.seq,
                cfg.temperature,
                self.packing,
                with_entropy=True,
                entropy_grad=bool(cfg.entropy_coef),
                ring=self.ring,
            )
            on_policy = mb.old_logprobs is None
            out = policy_loss(
                PolicyLossInput(
                    logprobs=lp,
                    old_logprobs=lp.detach() if on_policy else mb.old_logprobs,
                    advantages=mb.advantages,
                    action_mask=mask,
                    rollout_logprobs=mb.rollout_logprobs,
                    eps_clip_low=cfg.eps_clip_low,
                    eps_clip_high=cfg.eps_clip_high,
                    dual_clip=cfg.dual_clip,
                    is_correction=cfg.is_correction,
                    is_threshold=tuple(cfg.is_threshold),
                    aggregation=agg,
                )
            )
            loss, metrics = out.loss, dict(out.metrics)
            with torch.no_grad():
                metrics["entropy"] = float((ent * mask).sum() / mask.sum().clamp(min=1))
                if on_policy and mb.rollout_logprobs is not None:  # else the controller reports it
                    gap = (lp - mb.rollout_logprobs).abs() * mask
                    metrics["rollout_train_logprob_gap"] = float(gap.sum() / mask.sum().clamp(min=1))
            if cfg.entropy_coef:
                loss = loss + entropy_loss(ent, mask, cfg.entropy_coef, agg)
            if kl_fn is not None:
                if mb.ref_logprobs is None:
                    raise ValueError(
                        "the KL loss term (--algo.kl.use_loss) needs ref_logprobs in each micro-batch"
                    )
                kl = kl_loss(lp, mb.ref_logprobs, mask, kl_fn, agg)
                loss = loss + cfg.kl_coef * kl
                metrics["kl_loss"] = float(kl.detach()) / self.dp_size
            return loss, metrics, float(mask.sum())

        result = self.strategy.optimizer_step(self.engine, micro_batches, loss_fn)
        if self.ema is not None and not result.skipped and self.engine.was_step_applied():
            ema_update_(self.ema, self._local_shards(), self.spec.ema_beta)
        if torch.cuda.is_available():  # the process's (a hosted engine's memory included)
            add_metrics(
                result.metrics,
                {"gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30, **self.gpu_memory},
                1.0,
            )
        return result

    def train_critic(
        self, micro_batches: list[CriticMicroBatch], value_clip: float | None, counts: dict[str, float]
    ) -> StepResult:
        """One optimizer step of the clipped value loss (``rlhf_algos.value_loss``)."""
        from rlhf_algos.value_loss import value_loss
        from rlhf_core.types import LossAggregation

        agg = LossAggregation(num_tokens=counts["num_tokens"], dp_size=self.dp_size)

        def loss_fn(mb: CriticMicroBatch):
            mb = self._dev(mb)
            values, mask = response_values(self.engine, mb.seq, self.packing, self.ring)
            out = value_loss(values, mb.old_values, mb.returns, mask, value_clip, agg)
            mean = float((values.detach() * mask).sum() / mask.sum().clamp(min=1))
            return out.loss, {**out.metrics, "values": mean}, float(mask.sum())

        return self.strategy.optimizer_step(self.engine, micro_batches, loss_fn)

    # --- supervised modes ---

    def _supervised_loss(self, mb, cfg: SupervisedConfigLite, counts: dict[str, float] | None):
        """``(loss, metrics, weight)`` of one SFT/RM/DPO/KTO/PRM/KD micro-batch. With ``counts`` (training) the loss
        is normalised by the step's global token / pair count and multiplied by the data-parallel size;
        without (evaluation) it is the mean over this micro-batch."""
        from rlhf_algos.preference import dpo_loss, kto_loss, nll_loss, rm_loss
        from rlhf_algos.sft import sft_loss
        from rlhf_core.types import LossAggregation

        train = counts is not None
        dp = self.dp_size if train else 1
        # the token modes' aggregation (the pair modes count pairs: their counts have no num_tokens)
        agg = LossAggregation(num_tokens=counts.get("num_tokens") if train else None, dp_size=dp)
        mb = self._dev(mb)
        pad = self.hf_config.pad_token_id or 0

        def per_pair(loss, b: int):  # a pair loss normalised by the step's global pair count (training)
            return loss * b / (counts["num_sequences"] if train else b) * dp

        if cfg.mode == "sft":
            lp, _, mask = response_logprobs(self.engine, mb, 1.0, self.packing, ring=self.ring)
            n = float(mask.sum())
            return sft_loss(lp, mask, agg), {"nll": float(-(lp.detach() * mask).sum()) / max(n, 1.0)}, n
        if cfg.mode == "prm":
            from rlhf_algos.prm import prm_loss

            logits = step_logits(self.engine, mb, self.packing)  # [N, V]
            if cfg.reward_token_ids is not None:
                logits = logits[:, cfg.reward_token_ids]  # [N, K]
            out = prm_loss(logits, mb.classes, mb.soft_labels, agg)
            return out.loss, dict(out.metrics), float(len(mb.rows))
        if cfg.mode == "kd":
            from rlhf_algos.distill import kd_loss

            student, labels, mask = response_logits(self.engine, mb, self.packing)
            with torch.no_grad():
                teacher, _, _ = response_logits(self.ref_engine, mb, self.packing)
            out = kd_loss(student, teacher, labels, mask, cfg.kd_coef, agg)
            return out.loss, dict(out.metrics), float(mask.sum())
        if cfg.mode == "rm":
            both = concat_batches([mb.chosen, mb.rejected], pad)
            rewards = sequence_rewards(self.engine, both, self.packing, self.ring)
            b = len(mb.chosen)
            out = rm_loss(rewards[:b], rewards[b:], mb.margin if cfg.margin_loss else None, cfg.loss_type)
            metrics = dict(out.metrics)
            if not train:
                metrics["_rewards"] = rewards.detach().cpu().tolist()  # chosen, then rejected
            return per_pair(out.loss, b), metrics, float(b)
        if cfg.mode not in ("dpo", "kto"):
            raise ValueError(f"unknown supervised mode {cfg.mode!r}")
        # DPO: chosen and rejected; KTO: the completions and the mismatched pairs of its reference point
        first, second = (mb.chosen, mb.rejected) if cfg.mode == "dpo" else (mb.seq, mb.kl_seq)
        both = concat_batches([first, second], pad)
        b = len(first)
        lp, _, mask = response_logprobs(self.engine, both, 1.0, self.packing, ring=self.ring)
        with torch.no_grad():
            ref_lp, _, _ = response_logprobs(self.ref_engine, both, 1.0, self.packing, ring=self.ring)
        logps, ref_logps = (lp * mask).sum(-1), (ref_lp * mask).sum(-1)
        if cfg.mode == "dpo":
            out = dpo_loss(
                logps[:b], logps[b:], ref_logps[:b], ref_logps[b:], cfg.beta, cfg.label_smoothing, cfg.ipo
            )
            loss, metrics = out.loss, dict(out.metrics)
            if cfg.nll_loss_coef:
                nll = nll_loss(logps[:b], mask[:b].sum(-1))
                loss = loss + cfg.nll_loss_coef * nll
                metrics["nll"] = float(nll.detach())
            return per_pair(loss, b), metrics, float(b)
        # The reference point: mean log-ratio on mismatched pairs, averaged over ranks.
        kl = (logps[b:] - ref_logps[b:]).detach().mean()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(kl)
            kl = kl / self.world_size
        out = kto_loss(
            logps[:b], ref_logps[:b], mb.desirable, kl, cfg.beta, cfg.desirable_weight, cfg.undesirable_weight
        )
        return per_pair(out.loss, b), dict(out.metrics), float(b)

    def train_supervised(
        self, micro_batches: list, cfg: SupervisedConfigLite, counts: dict[str, float]
    ) -> StepResult:
        """One optimizer step of an SFT/RM/DPO/KTO/PRM/KD loss over the micro-batches."""
        return self.strategy.optimizer_step(
            self.engine, micro_batches, lambda mb: self._supervised_loss(mb, cfg, counts)
        )

    @torch.no_grad()
    def eval_supervised(
        self, micro_batches: list, cfg: SupervisedConfigLite
    ) -> list[tuple[dict, float, list]]:
        """Per evaluation micro-batch: its metrics (mean ``loss`` included), its weight (tokens or pairs),
        and for RM the rewards of its sequences (for the normalisation statistics)."""
        self.engine.eval()
        out = []
        for mb in micro_batches:
            loss, m, w = self._supervised_loss(mb, cfg, None)
            rewards = m.pop("_rewards", [])
            out.append(({"loss": float(loss), **m}, w, rewards))
        return out

    # --- checkpoints and export ---

    def save_checkpoint(self, path: str) -> None:
        """DeepSpeed engine state (model, optimizer, LR schedule), this rank's RNG states and EMA shards."""
        self.engine.save_checkpoint(path, tag=ENGINE_TAG)
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, Path(path) / f"rng_rank{self.rank}.pt")
        if self.ema is not None:
            torch.save([e.cpu() for e in self.ema], Path(path) / f"ema_rank{self.rank}.pt")

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
            self._load_ema(Path(path) / f"ema_rank{self.rank}.pt")

    def _load_ema(self, ema_file: Path) -> None:
        shards = self._local_shards()
        if not ema_file.exists():
            self.ema = [s.detach().to(torch.float32, copy=True) for s in shards]
            if self.rank == 0:
                print(
                    f"warning: {ema_file.parent} has no EMA (a run without --train.enable_ema?): "
                    "the EMA starts again from the loaded weights",
                    flush=True,
                )
            return
        saved = torch.load(ema_file, weights_only=True)
        if [tuple(e.shape) for e in saved] != [tuple(s.shape) for s in shards]:
            raise ValueError(
                f"{ema_file}: the saved EMA shards do not fit this model's local shards (a "
                "checkpoint of another model, LoRA setting, number of ranks or ZeRO stage?)"
            )
        self.ema = [e.to(device=s.device, dtype=torch.float32) for e, s in zip(saved, shards, strict=True)]

    def _module(self):
        return self.engine.module

    def _local_shards(self) -> list[torch.Tensor]:
        """This rank's part of every trainable parameter: the flat ZeRO-3 partition ``p.ds_tensor`` (a view
        into the optimizer's flat buffer, updated in place by each step), else the whole ``p.data``."""
        return [getattr(p, "ds_tensor", p.data) for p in self._module().parameters() if p.requires_grad]

    @contextlib.contextmanager
    def _ema_swapped_in(self):
        """Within the block the model holds the EMA weights; the trained weights are restored bitwise after
        it, also when it raises. Entering is collective under ZeRO-3, leaving is local."""
        shards = self._local_shards()
        trained = [s.clone() for s in shards]
        optimizer = self.engine.optimizer
        zero3 = hasattr(optimizer, "checkpoint_event_prologue")
        # ZeRO-3 keeps small "persistent" parameters gathered between steps: partition everything so that
        # the shards are the only copy, and re-gather the persistent ones (now EMA) afterwards. Their full
        # trained values are kept so that restoring needs no collective.
        persistent = [
            p for p in self._module().parameters() if p.requires_grad and getattr(p, "ds_persist", False)
        ]
        trained_full = [p.data.clone() if p.data.numel() else None for p in persistent]
        if zero3:
            optimizer.checkpoint_event_prologue()
        try:
            for s, e in zip(shards, self.ema, strict=True):
                s.copy_(e)
            if zero3:
                optimizer.checkpoint_event_epilogue()
            yield
        finally:
            for s, t in zip(shards, trained, strict=True):
                s.copy_(t)
            if zero3:
                optimizer.invalidate_secondary_tensor()  # hpZ copies of the EMA shards
                for p, full in zip(persistent, trained_full, strict=True):
                    if p.data.numel() and full is not None:  # still gathered: holds the EMA in full
                        p.data.copy_(full)

    def _is_peft(self) -> bool:
        return hasattr(self._module(), "peft_config")

    def named_weights(
        self, bucket_bytes: int = WEIGHT_BUCKET_BYTES, trainable_only: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, full tensor)`` pairs, ZeRO-3 parameters gathered bucket by bucket
        (``deepspeed.zero.GatheredParameters``). Collective: every rank must exhaust the iterator. With LoRA
        the adapters are merged into the base weights (names without peft's prefixes). ``trainable_only``
        leaves out frozen parameters (a frozen vision tower: the engines loaded the same weights)."""
        import deepspeed

        module = self._module()
        if self._is_peft():
            # Merging needs every LoRA pair and its base weight at once: gather the whole model.
            with deepspeed.zero.GatheredParameters(list(module.parameters())):
                module.merge_adapter()
                try:
                    for name, p in module.named_parameters():
                        if "lora_" in name:
                            continue
                        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
                        yield name, p.data.detach().clone()
                finally:
                    module.unmerge_adapter()
            return
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad or not trainable_only]
        bucket, size = [], 0
        for i, (name, p) in enumerate(params):
            bucket.append((name, p))
            size += getattr(p, "ds_numel", p.numel()) * p.element_size()
            if size >= bucket_bytes or i == len(params) - 1:
                with deepspeed.zero.GatheredParameters([p for _, p in bucket]):
                    yield from ((n, p.data.detach().clone()) for n, p in bucket)
                bucket, size = [], 0

    def adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """A LoRA policy's adapters in the sync's wire format (:func:`rlhf_core.weight_sync.lora_adapter_tensors`):
        per adapted layer ``<HF layer name>.lora_A`` and ``.lora_B`` (scaling folded in); the frozen base never
        moves. Collective under ZeRO-3 (only the adapters are gathered)."""
        with self._gathered_adapters():
            yield from weight_sync.lora_adapter_tensors(self._module())

    def _gathered_adapters(self):
        import deepspeed

        return deepspeed.zero.GatheredParameters(
            [p for n, p in self._module().named_parameters() if "lora_" in n]
        )

    def engine_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What a weight sync sends: a LoRA policy's adapters (:meth:`adapter_weights`), else every trained
        weight (:meth:`named_weights`). Collective under ZeRO-3."""
        return self.adapter_weights() if self._is_peft() else self.named_weights(trainable_only=True)

    def get_state_dict_for_engines(self) -> dict[str, torch.Tensor] | None:
        """What the engines get (:meth:`engine_weights`) as CPU tensors on rank 0 (None on the others), for the
        object-store sync path."""
        out = {name: t.cpu() for name, t in self.engine_weights() if self.rank == 0}  # every rank gathers
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
        sync group's life): rank 0 sends :meth:`engine_weights` as sync rank 0, hosting its store at
        ``master_addr:master_port``. Returns the number of tensors sent (0 on ranks other than 0)."""
        if self.rank != 0:
            for _ in self.engine_weights():  # the ZeRO-3 gathers only
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
        return self._sync_group.send(self.engine_weights())["tensors"]

    def export_hf(
        self,
        out_dir: str,
        config_updates: dict | None = None,
        tokenizer_path: str | None = None,
        ema: bool | None = None,
    ) -> None:
        """Write an HF model (safetensors) to ``out_dir`` on rank 0: a causal LM loadable with
        ``AutoModelForCausalLM``, or a value model loadable with ``AutoModelForSequenceClassification``.
        With LoRA the PEFT adapter is written instead (merge it with ``rlhf lora-merge``). ``ema`` (default:
        whether this model keeps an EMA) writes the EMA weights instead of the trained ones."""
        if ema is None:
            ema = self.ema is not None
        if ema and self.ema is None:
            raise ValueError("export_hf(ema=True): this model keeps no EMA (--train.enable_ema is off)")
        release_free_heap()  # the tokenizer and the files' buffers need not come on top of training's heap
        with self._ema_swapped_in() if ema else contextlib.nullcontext():
            self._write_hf(out_dir, config_updates, tokenizer_path)

    def _write_hf(self, out_dir: str, config_updates: dict | None, tokenizer_path: str | None) -> None:
        module = self._module()
        if self._is_peft():
            with self._gathered_adapters():
                if self.rank == 0:
                    module.save_pretrained(out_dir, safe_serialization=True)
        else:
            state = None  # whole CPU tensors: saved from the module as they are (no copy of the model)
            if any(hasattr(p, "ds_id") or p.device.type != "cpu" for p in module.parameters()):
                state = {
                    name: t.cpu() for name, t in self.named_weights() if self.rank == 0
                }  # all ranks gather
            if self.rank == 0:
                config = module.config
                for k, v in (config_updates or {}).items():
                    setattr(config, k, v)
                if self.spec.kind == "value":
                    config.architectures = [sequence_classification_architecture(config)]
                    config.num_labels = 1
                    config.value_head_prefix = getattr(module, "value_head_prefix", "score")
                module.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
        if self.rank == 0 and tokenizer_path:
            from transformers import AutoTokenizer

            with contextlib.suppress(OSError, ValueError):  # a model directory without a tokenizer
                AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(out_dir)
        if torch.distributed.is_initialized():
            # NCCL wants the rank's device named, or warns that it guesses it
            nccl = torch.distributed.get_backend() == "nccl"
            torch.distributed.barrier(device_ids=[torch.cuda.current_device()] if nccl else None)

    def sleep(self) -> None:
        """Hybrid engine (``--ds.enable_sleep``): move ZeRO-3 training state (parameters, gradients,
        optimizer) and the fp32 EMA to CPU memory while the rollout engines use the GPU (on CPU ranks the
        same calls, with nothing to free)."""
        if self.ema is not None:
            self.ema = [e.to("cpu") for e in self.ema]
        if self.strategy.ds.zero_stage == 3 and self.spec.trainable:
            self._note_gpu_memory("gpu_before_sleep_gib")
            move_zero3_state(self.engine, asleep=True)
            self._note_gpu_memory("gpu_asleep_gib")

    def wake_up(self) -> None:
        """Undo :meth:`sleep` before the next training or forward call."""
        if self.strategy.ds.zero_stage == 3 and self.spec.trainable:
            move_zero3_state(self.engine, asleep=False)
            self._note_gpu_memory("gpu_woken_gib")
        if self.ema is not None:
            self.ema = [e.to(s.device) for e, s in zip(self.ema, self._local_shards(), strict=True)]

    def _note_gpu_memory(self, key: str) -> None:
        if torch.cuda.is_available():
            self.gpu_memory[key] = torch.cuda.memory_allocated() / 2**30

    def close(self) -> None:
        """Drop the models, optimizer and hosted objects and give back the environment and thread count: the end
        of a rank that lives in the driver's process (a single-process run, ``rlhf_core.inline``), where no
        process exit does it, including the process group (a later rank in this process joins a new one)."""
        self.engine = self.ref_engine = self.ema = None
        self.teacher_engines = []
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
        this rank on CPU), instead of in a process of its own; :meth:`call_hosted` reaches it. An object that
        can decode from this rank's parameters themselves (``share_weights``: the HF engine) is given them
        where they are whole fp32 tensors in HF layout that the optimizer updates in place (ZeRO-0 with torch's
        AdamW, no LoRA to merge): one copy of the policy in the process instead of two, and no packed decode
        copies kept through training (SmolLM2-135M: 1.1 GB less at the peak)."""
        obj = self._hosted[name] = cls(*args, **kwargs)
        if (
            hasattr(obj, "share_weights")
            and self.engine is not None
            and self.spec.trainable
            and self.strategy.ds.zero_stage == 0
            and self.strategy.dtype == torch.float32
            and not self.strategy.ds.adam_offload
            and not self._is_peft()
        ):
            obj.share_weights(dict(self._module().named_parameters()))

    def call_hosted(self, name: str, method: str, *args, **kwargs) -> Any:
        return getattr(self._hosted[name], method)(*args, **kwargs)

    def push_weights_to_hosted(self, name: str) -> int:
        """Load this rank's weights into the object hosted under ``name`` (its ``update_weights``), in process:
        no broadcast, no object store. Collective under ZeRO-3 like :meth:`named_weights`: every rank calls
        it, and ranks that host nothing only take part in the gathers. A LoRA policy's engine gets only the
        adapters (:meth:`adapter_weights`). Returns the number of tensors loaded."""
        target = self._hosted.get(name)
        # it decodes from our parameters: nothing to copy (pointed at them again, should they have been replaced)
        if getattr(target, "borrowed", False) and target.share_weights(
            dict(self._module().named_parameters())
        ):
            return 0
        weights = dict(self.adapter_weights() if self._is_peft() else self.named_weights())
        if target is None:
            return 0
        target.update_weights(weights)
        return len(weights)
