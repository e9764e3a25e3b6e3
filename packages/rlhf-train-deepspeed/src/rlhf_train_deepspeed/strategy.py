"""DeepSpeed set-up: distributed init, ZeRO config, optimizer and LR schedule, LoRA, for the one
:class:`Strategy` of each worker process (the training step is :mod:`rlhf_train_deepspeed.learner`'s)."""

from __future__ import annotations

import atexit
import datetime
import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rlhf_core.config import resolve_param_dtype, resolve_zero_stage
from rlhf_core.errors import UserError
from rlhf_train_deepspeed import ring_attn

PRECISIONS = {"bf16": torch.bfloat16, "fp32": torch.float32}
LR_SCHEDULERS = ("cosine_with_min_lr", "linear", "constant")


class ConfigError(UserError, ValueError):
    """A flag value this backend cannot run with; the message names the flag."""


def param_dtype(name: str) -> torch.dtype:
    """The training dtype of ``--ds.param_dtype`` (``auto``: bf16 on a GPU, fp32 on CPU); fp16 is refused (no
    loss scaling here)."""
    if name == "fp16":
        raise ConfigError(
            "--ds.param_dtype fp16 is not supported: fp16 needs loss scaling, which this "
            "backend does not do. Use bf16 (also works on CPU), fp32 or auto (the default: "
            "bf16 on a GPU, fp32 on CPU)."
        )
    name = resolve_param_dtype(name)
    if name not in PRECISIONS:
        raise ConfigError(f"--ds.param_dtype must be one of {sorted(PRECISIONS)}, got {name!r}")
    return PRECISIONS[name]


def check_features(ds) -> None:
    """Fail early, naming the flag (and the package to install), when a requested feature cannot run."""
    if ds.attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ConfigError(
            "--ds.attn_implementation flash_attention_2 needs the flash-attn package, which "
            "is not installed (pip install 'rlhf-train-deepspeed[flash]' on a CUDA machine), "
            "or use sdpa"
        )
    if ds.ring_attn_size > 1:
        # On CUDA ring attention runs ring-flash-attn; without CUDA an exact all-gather-K/V attention
        # (rlhf_train_deepspeed.ring_attn) serves, so only a CUDA machine needs the packages.
        if torch.cuda.is_available():
            missing = [
                p
                for p, m in (("ring-flash-attn", "ring_flash_attn"), ("flash-attn", "flash_attn"))
                if importlib.util.find_spec(m) is None
            ]
            if missing:
                raise ConfigError(
                    f"--ds.ring_attn_size {ds.ring_attn_size} needs the {' and '.join(missing)} "
                    "package(s) on a CUDA machine, which are not installed (pip install "
                    "'rlhf-train-deepspeed[flash]')"
                )
        if not ds.packing_samples:
            raise ConfigError("--ds.ring_attn_size > 1 needs --ds.packing_samples")
        if ds.ring_attn_head_stride < 1:
            raise ConfigError(
                f"--ds.ring_attn_head_stride must be at least 1, got {ds.ring_attn_head_stride}"
            )
    if ds.load_in_4bit:
        if not torch.cuda.is_available() or importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError("--ds.load_in_4bit (QLoRA) needs a CUDA device and the bitsandbytes package")
        if ds.lora.rank <= 0:
            raise ConfigError("--ds.load_in_4bit (QLoRA) trains LoRA adapters: set --ds.lora.rank > 0")


def lr_multiplier(step: int, name: str, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Learning-rate factor at optimizer step ``step`` (0-based), as in HF transformers' schedules.

    Warm-up: ``step / warmup_steps`` for ``step < warmup_steps``. Then with ``p = (step - warmup) /
    (total - warmup)``: constant ``1``; linear ``max(0, 1 - p)``; cosine_with_min_lr
    ``min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * p)) / 2``."""
    if name not in LR_SCHEDULERS:
        raise ConfigError(f"--lr_scheduler must be one of {LR_SCHEDULERS}, got {name!r}")
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    if name == "constant":
        return 1.0
    p = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if name == "linear":
        return max(0.0, 1.0 - p)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


def make_scheduler(optimizer, optim, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` following :func:`lr_multiplier` for ``optim.lr_scheduler``."""
    warmup = math.ceil(total_steps * optim.lr_warmup_ratio)
    name, ratio = optim.lr_scheduler, optim.min_lr_ratio
    lr_multiplier(0, name, total_steps, warmup, ratio)  # validates the name before training starts
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, name, total_steps, warmup, ratio)
    )


def make_optimizer(model: torch.nn.Module, optim, offload: bool):
    """AdamW over the trainable parameters (no weight decay on biases and norms, i.e. 1-D tensors);
    DeepSpeed's CPU Adam when the optimizer state is offloaded (``--ds.adam_offload``). Other ``--*.optim``
    values are refused by the parser."""
    params = [p for p in model.parameters() if p.requires_grad]
    # ZeRO-3 parameters are empty placeholders; ds_shape is the real shape
    matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for p in params]
    groups = [
        {"params": [p for p, m in zip(params, matrix) if m == decay], "weight_decay": wd}
        for decay, wd in ((True, optim.adam.weight_decay), (False, 0.0))
    ]
    groups = [g for g in groups if g["params"]]
    kwargs = dict(lr=optim.adam.lr, betas=tuple(optim.adam.betas), eps=optim.adam.eps)
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    # fused: one kernel per parameter with no temporaries; the default on CPU is a loop of tensor ops whose
    # temporaries reach the size of the largest parameter (a 49k-row embedding: 2 x 0.11 GB at the peak)
    return torch.optim.AdamW(groups, fused=True, **kwargs)


def quantization_kwargs(ds, dtype: torch.dtype) -> dict:
    """``from_pretrained`` arguments that load the base model in 4 bits for QLoRA (``--ds.load_in_4bit``)."""
    if not ds.load_in_4bit:
        return {}
    from transformers import BitsAndBytesConfig

    return {
        "quantization_config": BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
    }


def apply_lora(
    model: torch.nn.Module, lora, task_type: str, trained_heads: list[str] | None = None
) -> torch.nn.Module:
    """Wrap ``model`` with LoRA adapters (peft) when ``--ds.lora.rank`` > 0; otherwise return it.
    ``trained_heads`` stay fully trainable (a value head)."""
    if lora.rank <= 0:
        return model
    from peft import LoraConfig, TaskType, get_peft_model, prepare_model_for_kbit_training

    if getattr(model, "is_loaded_in_4bit", False):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    targets = lora.target_modules
    return get_peft_model(
        model,
        LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            task_type=getattr(TaskType, task_type),
            target_modules=targets[0] if targets == ["all-linear"] else targets,
            modules_to_save=trained_heads,
        ),
    )


def ds_config(
    ds,
    *,
    train: bool,
    micro_batch_size: int = 1,
    grad_accum: int = 1,
    world_size: int = 1,
    max_norm: float = 0.0,
    offload_params: bool = False,
) -> dict[str, Any]:
    """The DeepSpeed config dict for a trained (``train=True``) or frozen model. Frozen models (reference,
    reward) use ZeRO-3 when training does, so that their weights are partitioned too, else stage 0;
    ``offload_params`` keeps a ZeRO-3 frozen model's weights in CPU memory."""
    dtype = param_dtype(ds.param_dtype)
    pin = torch.cuda.is_available()
    if train:
        zero: dict[str, Any] = {
            "stage": ds.zero_stage,
            "overlap_comm": ds.overlap_comm,
            "contiguous_gradients": True,
            "stage3_gather_16bit_weights_on_model_save": True,
        }
        if ds.adam_offload:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
        if ds.zpg > 1:
            zero["zero_hpz_partition_size"] = ds.zpg
    else:
        zero = {"stage": 3 if ds.zero_stage == 3 else 0, "stage3_param_persistence_threshold": "auto"}
        if offload_params and ds.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch_size * grad_accum * world_size,
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": max_norm if train else 0.0,
        "bf16": {"enabled": dtype == torch.bfloat16, "check_grad_overflow": True},
    }
    if train and ds.grad_accum_dtype:
        cfg["data_types"] = {"grad_accum_dtype": ds.grad_accum_dtype}
    return cfg


@dataclass
class StepResult:
    loss: float
    """Sum over this rank's micro-batches of the loss divided by the data-parallel size: summed over
    ranks (one per ring group with ring attention) this is the loss of the whole step."""
    skipped: bool
    grad_norm: float | None
    lr: float
    metrics: dict[str, list[float]]
    """name -> [weighted sum, weight] over this rank's micro-batches."""


def add_metrics(acc: dict[str, list[float]], metrics: dict[str, float], weight: float) -> None:
    for k, v in metrics.items():
        s, w = acc.get(k, (0.0, 0.0))
        acc[k] = [s + float(v) * weight, w + weight]


class Strategy:
    """Distributed context and DeepSpeed engines of one worker process (one rank)."""

    def __init__(self, ds, full_determinism: bool = False):
        self.ds = ds
        # the driver resolves the default; a strategy built without it (tests, the Python API) does the same
        ds.zero_stage = resolve_zero_stage(ds.zero_stage, int(os.environ.get("WORLD_SIZE", "1")))
        self.dtype = param_dtype(ds.param_dtype)
        check_features(ds)
        if full_determinism:
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.ring = None
        """This rank's :class:`~rlhf_train_deepspeed.ring_attn.RingGroup` with ``--ds.ring_attn_size`` > 1."""
        if ds.ring_attn_size > 1:
            if self.world_size() % ds.ring_attn_size:
                raise ConfigError(
                    f"--ds.ring_attn_size {ds.ring_attn_size} must divide the number of ranks "
                    f"({self.world_size()})"
                )
            self.ring = ring_attn.setup_ring(ds.ring_attn_size, ds.ring_attn_head_stride)

    # --- distributed ---

    @staticmethod
    def init_distributed(
        address: tuple[str, int], store: dist.TCPStore | None, timeout_s: float = 1800.0
    ) -> None:
        """Join the process group of RANK and WORLD_SIZE (set by the Ray worker group, not a launcher) whose
        rank 0 listens at ``address``; rank 0 passes the store it listens with (``weight_sync.listening_store``).
        NCCL with a GPU, gloo on CPU. A process already in a group (a single-process run's later ranks) keeps it."""
        import deepspeed

        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            backend = "nccl"
        else:
            backend = "gloo"
            # DeepSpeed JIT-compiles a shared-memory all-reduce kernel on CPU (~50 s, and rebuilt whenever
            # another environment shares the cache). Only AutoTP inference uses it; gloo serves training.
            import deepspeed.comm.torch  # noqa: F401 - the attribute `torch` of deepspeed.comm is torch itself

            sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        if not dist.is_initialized():
            timeout = datetime.timedelta(seconds=timeout_s)
            if store is None:
                store = dist.TCPStore(address[0], address[1], is_master=False, timeout=timeout)
            store.set_timeout(timeout)
            dist.init_process_group(
                backend,
                store=store,
                rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
                timeout=timeout,
                # the rank's GPU bound to the group: every barrier (DeepSpeed's too) knows it, none guesses
                device_id=torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None,
            )
            deepspeed.init_distributed(
                dist_backend=backend, timeout=timeout, verbose=False
            )  # adopts torch's group
            # NCCL warns of a leak at exit when the group was never destroyed (by close_distributed: a rank
            # that ends with its process is never closed)
            atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())

    @staticmethod
    def close_distributed(*sync_groups) -> None:
        """The end of a rank: close its weight-sync groups (``weight_sync.SyncGroup``; None skipped) and destroy
        the process group, so that NCCL has nothing to warn about at exit. A later rank in this process (a
        single-process run's next model) joins a new group."""
        for group in sync_groups:
            if group is not None:
                group.close()
        if dist.is_initialized():  # joined through init_distributed, so DeepSpeed's too
            import deepspeed.comm

            deepspeed.comm.destroy_process_group()  # torch's, and DeepSpeed's cached references to its groups

    @property
    def device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @staticmethod
    def world_size() -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def dp_size(self) -> int:
        """Data-parallel size: the number of ring groups (all ranks without ring attention). Losses are
        multiplied by it; see ``ring_attn`` for why it is not the world size under ring attention."""
        return self.world_size() // max(1, self.ds.ring_attn_size)

    def any_rank(self, flag: bool) -> bool:
        """True when ``flag`` is true on any rank (an all-reduce of one number)."""
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    # --- engines ---

    def zero3_init_context(self, train: bool):
        """Keep the returned object alive while loading a model so that transformers builds it already
        partitioned under ZeRO-3 (``deepspeed.zero.Init``); None for other stages."""
        if self.ds.zero_stage != 3:
            return None
        from transformers.integrations import HfDeepSpeedConfig

        return HfDeepSpeedConfig(ds_config(self.ds, train=train, world_size=self.world_size()))

    def prepare_train(self, model: torch.nn.Module, spec):
        """A DeepSpeed training engine for ``model`` with AdamW, the LR schedule, batch sizes and gradient
        checkpointing of ``spec`` (a ``worker.ModelSpec``)."""
        import deepspeed

        if spec.grad_ckpt:
            reentrant = spec.grad_ckpt_reentrant
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            if hasattr(model, "enable_input_require_grads"):
                model.enable_input_require_grads()  # needed with reentrant checkpointing and LoRA
        optimizer = make_optimizer(model, spec.optim, self.ds.adam_offload)
        scheduler = make_scheduler(optimizer, spec.optim, spec.total_steps)
        cfg = ds_config(
            self.ds,
            train=True,
            micro_batch_size=spec.micro_batch_size,
            grad_accum=spec.grad_accum,
            world_size=self.world_size(),
            max_norm=spec.optim.max_norm,
        )
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=cfg
        )
        if self.world_size() == 1 and self.ds.zero_stage == 0:
            # A lone rank's all-reduce is the identity, but DeepSpeed's ZeRO-0 path first copies every gradient
            # into one flat buffer (a second copy of the model, SmolLM2-135M fp32: 0.54 GB) and back.
            engine.enable_backward_allreduce = False
        return engine

    def prepare_eval(self, model: torch.nn.Module, offload: bool = False):
        """A DeepSpeed inference engine for a frozen model (reference or reward model)."""
        import deepspeed

        model.requires_grad_(False)
        cfg = ds_config(self.ds, train=False, world_size=self.world_size(), offload_params=offload)
        engine, *_ = deepspeed.initialize(model=model, config=cfg)
        engine.eval()
        return engine
