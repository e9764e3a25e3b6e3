"""One training rank: a model (plus, for DPO/KTO, its frozen reference) in DeepSpeed engines.

:class:`TrainWorker` is a plain class; :mod:`rlhf_train_deepspeed.group` runs N of them as Ray actors and
fans calls out. Every method that touches a ZeRO-3 model is collective: all ranks must call it, with the
same number of micro-batches.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhf_train_deepspeed.batches import (
    CriticMicroBatch,
    PolicyMicroBatch,
    SequenceBatch,
    concat_batches,
    to_device,
)
from rlhf_train_deepspeed.models import (
    load_causal_lm,
    load_value_model,
    normalize_rewards,
    response_logprobs,
    response_values,
    sequence_classification_architecture,
    sequence_rewards,
)
from rlhf_train_deepspeed.strategy import StepResult, Strategy, apply_lora, quantization_kwargs

ENGINE_TAG = "engine"
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
    """DPO/KTO: a frozen reference model hosted in the same worker."""
    ref_offload: bool = False
    init_value_head: bool = True


@dataclass
class PolicyStepConfig:
    """How a policy step computes its loss; see ``--actor.*`` and ``--algo.*``."""

    loss: str = "ppo"
    """Registered policy loss (``--actor.policy_loss_type``), resolved in the worker."""
    temperature: float = 1.0
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    dual_clip: float | None = None
    is_correction: str | None = None
    is_threshold: tuple[float, float] = (0.5, 5.0)
    agg_mode: str = "token_mean"
    max_len: int | None = None
    """Dr. GRPO's constant normaliser (``seq_mean_token_sum_norm``); default: the generation budget."""
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    """Weight of the KL loss term; 0 disables it (needs ``ref_logprobs`` in the micro-batches)."""
    kl_estimator: str = "k3"


@dataclass
class SupervisedConfigLite:
    """The loss settings of the SFT/RM/DPO/KTO modes (``--model.*``)."""

    mode: str
    beta: float = 0.1
    ipo: bool = False
    label_smoothing: float = 0.0
    nll_loss_coef: float = 0.0
    loss_type: str = "sigmoid"
    margin_loss: bool = False
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


class TrainWorker:
    """One rank. ``rank``/``world_size`` come from the group; the process group is joined through
    environment variables (no ``deepspeed`` launcher)."""

    def __init__(self, rank: int, world_size: int, num_threads: int | None = None):
        self.rank, self.world_size = rank, world_size
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world_size)
        # Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES, so the local device is 0 unless one
        # actor sees several GPUs.
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        os.environ["LOCAL_RANK"] = str(rank % visible if visible > 1 else 0)
        if num_threads:
            torch.set_num_threads(num_threads)
        self.engine = None
        self.ref_engine = None
        self.spec: ModelSpec | None = None
        self._sync_group = None

    # --- set-up ---

    def master_address(self) -> tuple[str, int]:
        """Rank 0's address and a free port on it, shared with every rank by the group."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        os.environ["MASTER_ADDR"] = master_addr
        os.environ["MASTER_PORT"] = str(master_port)
        Strategy.init_distributed()

    def init_model(self, spec: ModelSpec, ds, seed: int = 42, full_determinism: bool = False) -> dict:
        """Load the model described by ``spec`` into a DeepSpeed engine (replacing any previous one)."""
        self.spec = spec
        self.strategy = Strategy(ds, seed, full_determinism)
        seed_everything(seed)
        dtype = self.strategy.dtype
        attn = ds.attn_implementation
        zero3 = self.strategy.zero3_init_context(spec.trainable)  # noqa: F841 - must stay alive while loading
        quant = quantization_kwargs(ds, dtype) if spec.trainable else {}
        if spec.kind == "value":
            model = load_value_model(spec.path, dtype, attn, ds.value_head_prefix, **quant)
        elif spec.kind == "causal":
            model = load_causal_lm(spec.path, dtype, attn, **quant)
        else:
            raise ValueError(f"unknown model kind {spec.kind!r}")
        self.hf_config = model.config
        if spec.trainable:
            if spec.kind == "causal":
                model = apply_lora(model, ds.lora, "CAUSAL_LM")
            else:
                model = apply_lora(model, ds.lora, "FEATURE_EXTRACTION", [ds.value_head_prefix])
            self.engine = self.strategy.prepare_train(
                model,
                spec.optim,
                micro_batch_size=spec.micro_batch_size,
                grad_accum=spec.grad_accum,
                total_steps=spec.total_steps,
                grad_ckpt=spec.grad_ckpt,
                grad_ckpt_reentrant=spec.grad_ckpt_reentrant,
            )
        else:
            self.engine = self.strategy.prepare_eval(model, spec.offload)
        self.ref_engine = None
        if spec.ref_path:
            zero3 = self.strategy.zero3_init_context(False)  # noqa: F841
            ref = load_causal_lm(spec.ref_path, dtype, attn)
            self.ref_engine = self.strategy.prepare_eval(ref, spec.ref_offload)
        del zero3
        return {"rank": self.rank, "num_parameters": sum(p.numel() for p in model.parameters())}

    @property
    def packing(self) -> bool:
        return bool(self.strategy.ds.packing_samples)

    def _dev(self, obj):
        return to_device(obj, self.strategy.device)

    # --- forward-only calls ---

    @torch.no_grad()
    def compute_logprobs(
        self, batches: list[SequenceBatch], temperature: float = 1.0, with_entropy: bool = False
    ) -> list[torch.Tensor] | list[tuple[torch.Tensor, torch.Tensor]]:
        """Per micro-batch ``[B, T]`` response log-probs (and entropies) at ``temperature``, on CPU."""
        self.engine.eval()
        out = []
        for b in batches:
            lp, ent, _ = response_logprobs(self.engine, self._dev(b), temperature, self.packing, with_entropy)
            out.append((lp.cpu(), ent.cpu()) if with_entropy else lp.cpu())
        return out

    @torch.no_grad()
    def compute_values(self, batches: list[SequenceBatch]) -> list[torch.Tensor]:
        """Per micro-batch ``[B, T]`` critic values of the state before each response token."""
        self.engine.eval()
        return [response_values(self.engine, self._dev(b), self.packing)[0].cpu() for b in batches]

    @torch.no_grad()
    def compute_rewards(self, batches: list[SequenceBatch]) -> list[torch.Tensor]:
        """Per micro-batch ``[B]`` rewards: value head at the last token, normalised when configured."""
        self.engine.eval()
        out = []
        for b in batches:
            r = sequence_rewards(self.engine, self._dev(b), self.packing)
            if self.spec.normalize_reward:
                r = normalize_rewards(r, self.hf_config)
            out.append(r.cpu())
        return out

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

        pm = get_plugin_manager()
        policy_loss = resolve(pm, "policy_losses", cfg.loss, "--actor.policy_loss_type")
        kl_fn = resolve(pm, "kl_estimators", cfg.kl_estimator, "--algo.kl.estimator") if cfg.kl_coef else None
        agg = LossAggregation(
            mode=cfg.agg_mode,
            num_tokens=counts["num_tokens"],
            num_sequences=counts["num_sequences"],
            max_len=cfg.max_len,
            dp_size=self.world_size,
        )

        def loss_fn(mb: PolicyMicroBatch):
            mb = self._dev(mb)
            lp, ent, mask = response_logprobs(
                self.engine, mb.seq, cfg.temperature, self.packing, with_entropy=True, entropy_grad=bool(cfg.entropy_coef)
            )
            out = policy_loss(
                PolicyLossInput(
                    logprobs=lp,
                    old_logprobs=mb.old_logprobs,
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
            loss = out.loss
            metrics = dict(out.metrics)
            with torch.no_grad():
                metrics["entropy"] = float((ent * mask).sum() / mask.sum().clamp(min=1))
            if cfg.entropy_coef:
                loss = loss + entropy_loss(ent, mask, cfg.entropy_coef, agg)
            if kl_fn is not None:
                if mb.ref_logprobs is None:
                    raise ValueError("the KL loss term (--algo.kl.use_loss) needs ref_logprobs in each micro-batch")
                kl = kl_loss(lp, mb.ref_logprobs, mask, kl_fn, agg)
                loss = loss + cfg.kl_coef * kl
                metrics["kl_loss"] = float(kl.detach()) / self.world_size
            return loss, metrics, float(mask.sum())

        return self.strategy.optimizer_step(self.engine, micro_batches, loss_fn)

    def train_critic(
        self, micro_batches: list[CriticMicroBatch], value_clip: float | None, counts: dict[str, float]
    ) -> StepResult:
        """One optimizer step of the clipped value loss (``rlhf_algos.value_loss``)."""
        from rlhf_algos.value_loss import value_loss
        from rlhf_core.types import LossAggregation

        agg = LossAggregation(num_tokens=counts["num_tokens"], dp_size=self.world_size)

        def loss_fn(mb: CriticMicroBatch):
            mb = self._dev(mb)
            values, mask = response_values(self.engine, mb.seq, self.packing)
            out = value_loss(values, mb.old_values, mb.returns, mask, value_clip, agg)
            metrics = dict(out.metrics)
            metrics["values"] = float((values.detach() * mask).sum() / mask.sum().clamp(min=1))
            return out.loss, metrics, float(mask.sum())

        return self.strategy.optimizer_step(self.engine, micro_batches, loss_fn)

    # --- supervised modes ---

    def _supervised_loss(self, mb, cfg: SupervisedConfigLite, counts: dict[str, float] | None):
        """``(loss, metrics, weight)`` of one SFT/RM/DPO/KTO micro-batch. With ``counts`` (training) the loss
        is normalised by the step's global token / pair count and multiplied by the data-parallel size;
        without (evaluation) it is the mean over this micro-batch."""
        from rlhf_algos.preference import dpo_loss, kto_loss, nll_loss, rm_loss
        from rlhf_algos.sft import sft_loss
        from rlhf_core.types import LossAggregation

        dp = self.world_size if counts else 1
        train = counts is not None
        mb = self._dev(mb)
        pad = self.hf_config.pad_token_id or 0
        if cfg.mode == "sft":
            lp, _, mask = response_logprobs(self.engine, mb, 1.0, self.packing)
            loss = sft_loss(lp, mask, LossAggregation(num_tokens=counts["num_tokens"] if train else None, dp_size=dp))
            n = float(mask.sum())
            return loss, {"nll": float(-(lp.detach() * mask).sum()) / max(n, 1.0)}, n
        if cfg.mode == "rm":
            both = concat_batches([mb.chosen, mb.rejected], pad)
            rewards = sequence_rewards(self.engine, both, self.packing)
            b = len(mb.chosen)
            margin = mb.margin if cfg.margin_loss else None
            out = rm_loss(rewards[:b], rewards[b:], margin, cfg.loss_type)
            metrics = dict(out.metrics)
            if not train:
                metrics["_rewards"] = rewards[:b].detach().cpu().tolist() + rewards[b:].detach().cpu().tolist()
            return out.loss * b / (counts["num_sequences"] if train else b) * dp, metrics, float(b)
        if cfg.mode == "dpo":
            both = concat_batches([mb.chosen, mb.rejected], pad)
            b = len(mb.chosen)
            lp, _, mask = response_logprobs(self.engine, both, 1.0, self.packing)
            with torch.no_grad():
                ref_lp, _, _ = response_logprobs(self.ref_engine, both, 1.0, self.packing)
            logps, ref_logps = (lp * mask).sum(-1), (ref_lp * mask).sum(-1)
            out = dpo_loss(logps[:b], logps[b:], ref_logps[:b], ref_logps[b:], cfg.beta, cfg.label_smoothing, cfg.ipo)
            loss = out.loss
            metrics = dict(out.metrics)
            if cfg.nll_loss_coef:
                nll = nll_loss(logps[:b], mask[:b].sum(-1))
                loss = loss + cfg.nll_loss_coef * nll
                metrics["nll"] = float(nll.detach())
            return loss * b / (counts["num_sequences"] if train else b) * dp, metrics, float(b)
        if cfg.mode == "kto":
            both = concat_batches([mb.seq, mb.kl_seq], pad)
            b = len(mb.seq)
            lp, _, mask = response_logprobs(self.engine, both, 1.0, self.packing)
            with torch.no_grad():
                ref_lp, _, _ = response_logprobs(self.ref_engine, both, 1.0, self.packing)
            logps, ref_logps = (lp * mask).sum(-1), (ref_lp * mask).sum(-1)
            # The reference point: mean log-ratio on mismatched pairs, averaged over ranks.
            kl = (logps[b:] - ref_logps[b:]).detach().mean()
            if torch.distributed.is_initialized():
                torch.distributed.all_reduce(kl)
                kl = kl / self.world_size
            out = kto_loss(
                logps[:b], ref_logps[:b], mb.desirable, kl, cfg.beta, cfg.desirable_weight, cfg.undesirable_weight
            )
            return out.loss * b / (counts["num_sequences"] if train else b) * dp, dict(out.metrics), float(b)
        raise ValueError(f"unknown supervised mode {cfg.mode!r}")

    def train_supervised(self, micro_batches: list, cfg: SupervisedConfigLite, counts: dict[str, float]) -> StepResult:
        """One optimizer step of an SFT/RM/DPO/KTO loss over the micro-batches."""
        return self.strategy.optimizer_step(
            self.engine, micro_batches, lambda mb: self._supervised_loss(mb, cfg, counts)
        )

    @torch.no_grad()
    def eval_supervised(self, micro_batches: list, cfg: SupervisedConfigLite) -> list[tuple[dict, float, list]]:
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
        """DeepSpeed engine state (model, optimizer, LR schedule) and this rank's RNG states."""
        self.engine.save_checkpoint(path, tag=ENGINE_TAG)
        torch.save(rng_state(), Path(path) / f"rng_rank{self.rank}.pt")

    def load_checkpoint(self, path: str) -> None:
        load_path, _ = self.engine.load_checkpoint(
            path, tag=ENGINE_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed state under {path}/{ENGINE_TAG}")
        rng_file = Path(path) / f"rng_rank{self.rank}.pt"
        if rng_file.exists():
            set_rng_state(torch.load(rng_file, weights_only=False))

    def _module(self):
        return self.engine.module

    def _is_peft(self) -> bool:
        return hasattr(self._module(), "peft_config")

    def named_weights(self, bucket_bytes: int = WEIGHT_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, full tensor)`` pairs, ZeRO-3 parameters gathered bucket by bucket
        (``deepspeed.zero.GatheredParameters``). Collective: every rank must exhaust the iterator. With LoRA
        the adapters are merged into the base weights (names without peft's prefixes)."""
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
        params = list(module.named_parameters())
        bucket: list[tuple[str, torch.nn.Parameter]] = []
        size = 0

        def flush():
            with deepspeed.zero.GatheredParameters([p for _, p in bucket]):
                for n, p in bucket:
                    yield n, p.data.detach().clone()

        for name, p in params:
            numel = getattr(p, "ds_numel", p.numel())
            bucket.append((name, p))
            size += numel * p.element_size()
            if size >= bucket_bytes:
                yield from flush()
                bucket, size = [], 0
        if bucket:
            yield from flush()

    def get_state_dict_for_engines(self) -> dict[str, torch.Tensor] | None:
        """Every weight as a CPU tensor on rank 0 (None on the others), for the object-store sync path."""
        out = {}
        for name, t in self.named_weights():
            if self.rank == 0:
                out[name] = t.cpu()
        return out if self.rank == 0 else None

    def broadcast_weights_to_engines(
        self, master_addr: str, master_port: int, world_size: int, backend: str = "gloo", timeout_s: float = 600.0
    ) -> int:
        """Send the weights to the rollout engines through ``rlhf_core.weight_sync``: rank 0 is rank 0 of the
        sync group (hosting its store at ``master_addr:master_port``; the engines take ranks 1..world_size-1
        and call ``receive``). The group is joined on the first call and kept. Other trainer ranks only take
        part in the ZeRO-3 gathers. Returns the number of tensors sent (0 on ranks other than 0)."""
        from rlhf_core import weight_sync

        if self.rank == 0 and self._sync_group is None:
            self._sync_group = weight_sync.init_sync_group(
                master_addr, master_port, 0, world_size, backend, timeout_s
            )
        weights = self.named_weights()
        if self.rank == 0:
            return self._sync_group.send(weights)["tensors"]
        for _ in weights:
            pass
        return 0

    def export_hf(self, out_dir: str, config_updates: dict | None = None, tokenizer_path: str | None = None) -> None:
        """Write an HF model (safetensors) to ``out_dir`` on rank 0: a causal LM loadable with
        ``AutoModelForCausalLM``, or a value model loadable with ``AutoModelForSequenceClassification``.
        With LoRA the PEFT adapter is written instead (merge it with ``rlhf lora-merge``)."""
        module = self._module()
        if self._is_peft():
            import deepspeed

            lora = [p for n, p in module.named_parameters() if "lora_" in n]
            with deepspeed.zero.GatheredParameters(lora):
                if self.rank == 0:
                    module.save_pretrained(out_dir, safe_serialization=True)
        else:
            state = {}
            for name, t in self.named_weights():
                if self.rank == 0:
                    state[name] = t.cpu()
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

            try:
                AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(out_dir)
            except (OSError, ValueError):
                pass  # a model directory without a tokenizer: nothing to copy
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def sleep(self) -> None:
        """Hybrid engine (``--ds.enable_sleep``): move ZeRO-3 training state (parameters, gradients,
        optimizer) to CPU memory while the rollout engines use the GPU. Nothing to free on CPU ranks."""
        if torch.cuda.is_available() and self.strategy.ds.zero_stage == 3 and self.spec.trainable:
            self.engine.offload_states()

    def wake_up(self) -> None:
        """Undo :meth:`sleep` before the next training or forward call."""
        if torch.cuda.is_available() and self.strategy.ds.zero_stage == 3 and self.spec.trainable:
            self.engine.reload_states()

    def ping(self) -> int:
        return self.rank
