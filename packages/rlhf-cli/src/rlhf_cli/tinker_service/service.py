"""The state and the operations of the Tinker-compatible service (docs/tinker.md), independent of HTTP.

Each training model is a one-rank learner (``rlhf_train_deepspeed.group.WorkerGroup``, the ``Learner``
primitive) in this process with its own LoRA adapter and AdamW state; the frozen base weights of every model
after the first are pointed at the first model's tensors, so the base is held once however many models there
are. Sampling goes through one HF rollout engine wrapped as the ``Sampler`` primitive
(``rlhf_cli.build.EngineSampler``): a sampling client's adapter snapshot is merged into it before it samples.
Operations run one at a time on one worker thread, in the order they arrived; a request is checked in full
before it is queued, and a failed ``forward_backward`` puts the gradients back as they were."""

from __future__ import annotations

import copy
import json
import re
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_cli.tinker_service import losses
from rlhf_core.batches import make_sequence_batch
from rlhf_core.handles import wait

LORA_TARGETS = {
    "train_attn": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "train_mlp": ["gate_proj", "up_proj", "down_proj"],
    "train_unembed": ["lm_head"],
}
LORA_ALPHA = 32
EPHEMERAL_SNAPSHOTS = 32
"""Unnamed sampler snapshots (``save_weights_and_get_sampling_client``) kept; older ones are dropped."""
ADAM_DEFAULTS = {  # the SDK's AdamParams
    "learning_rate": 1e-4,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-12,
    "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
}
BATCH_WINDOW_S = 0.02
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class UserError(ValueError):
    """A bad request: HTTP 4xx, or a failed future in the ``user`` category."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def check(ok: bool, message: str, status: int = 400) -> None:
    if not ok:
        raise UserError(message, status)


@dataclass
class Datum:
    tokens: list[int]
    """The model input followed by the last target token: the targets are ``tokens[1:]``."""
    inputs: dict[str, torch.Tensor]
    """``weights`` / ``logprobs`` / ``advantages`` ``[N]`` (``target_tokens`` folded into ``tokens``)."""


@dataclass
class TrainingModel:
    id: str
    session: str
    lora: dict
    worker: Any
    """The ``TrainWorker`` (in this process): its engine's optimizer takes each step's Adam parameters."""
    learner: Any
    """The same rank as the ``Learner`` primitive (``WorkerGroup``)."""


class TinkerService:
    def __init__(self, base_model: str, workdir: str, param_dtype: str = "auto", micro_batch_size: int = 16):
        from transformers import AutoConfig

        self.base = base_model
        self.config = AutoConfig.from_pretrained(base_model)
        text = self.config.get_text_config()
        self.vocab_size, self.max_len = text.vocab_size, getattr(text, "max_position_embeddings", 1 << 20)
        self.workdir = Path(workdir).resolve()
        self.param_dtype, self.micro_batch_size = param_dtype, micro_batch_size
        self.sessions: set[str] = set()
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, str | None] = {}
        """Sampling session -> the snapshot path it samples (None: the base model)."""
        self.snapshots: dict[str, dict[str, torch.Tensor]] = {}
        self.engine = self.sampler = None
        self.merged: tuple[str | None, dict | None] = (None, None)
        """The snapshot path merged into the engine, and its adapter (kept should the snapshot be dropped)."""
        self.futures: dict[str, Future] = {}
        self.pending: list[tuple] = []
        """Sample requests not yet taken: (snapshot path, GenerationRequest, prompt_logprobs, Future)."""
        self.counter = 0
        self.lock = threading.Lock()
        self.queue = ThreadPoolExecutor(1, thread_name_prefix="tinker-op")
        losses.register()

    # --- futures ---

    def submit(self, fn, *args) -> dict:
        request_id = uuid.uuid4().hex
        self.futures[request_id] = self.queue.submit(fn, *args)
        return {"request_id": request_id}

    def retrieve(self, request_id: str, wait_s: float = 20.0) -> Any:
        """The operation's result; :class:`TimeoutError` while it runs; its exception when it failed."""
        future = self.futures.get(request_id)
        check(future is not None, f"unknown request_id {request_id!r}", 404)
        try:
            return future.result(timeout=wait_s)  # TimeoutError while it runs, its error when it failed
        finally:
            if future.done():  # delivered once
                del self.futures[request_id]

    def next_number(self) -> int:
        with self.lock:
            self.counter += 1
            return self.counter

    # --- sessions and models ---

    def create_session(self) -> str:
        session = uuid.uuid4().hex  # unguessable: every model and sampler id below starts with it
        self.sessions.add(session)
        return session

    def heartbeat(self, session: str) -> None:
        check(session in self.sessions, f"unknown session {session!r}", 404)

    def model(self, model_id: str) -> TrainingModel:
        check(model_id in self.models, f"unknown model_id {model_id!r} (created by another session?)", 404)
        return self.models[model_id]

    def check_base(self, base_model: str | None) -> None:
        served = base_model in (None, self.base) or Path(base_model).resolve() == Path(self.base).resolve()
        check(served, f"base_model {base_model!r} is not served here; this service serves {self.base!r}")

    def check_lora(self, lora: dict) -> dict:
        rank = lora.get("rank")
        check(isinstance(rank, int) and 1 <= rank <= 512, f"lora_config.rank must be 1..512, got {rank!r}")
        flags = {k: bool(lora.get(k, True)) for k in LORA_TARGETS}
        check(any(flags.values()), "lora_config: at least one of train_mlp, train_attn, train_unembed")
        tied = getattr(self.config, "tie_word_embeddings", False)
        check(
            not (flags["train_unembed"] and tied),
            f"lora_config.train_unembed: {self.base} ties its unembedding to the input embedding, and an "
            "adapter merged into one would change both; pass train_unembed=False",
        )
        return {"rank": rank, "seed": lora.get("seed"), **flags}

    def new_model_id(self, session: str, seq: int) -> str:
        """The SDK derives a model's id from its session and the client's ``model_seq_id``."""
        check(session in self.sessions, f"unknown session {session!r}", 404)
        model_id = f"{session}:train:{int(seq)}"
        check(model_id not in self.models, f"model {model_id} exists", 409)
        return model_id

    def create_model(self, session: str, seq: int, lora: dict) -> dict:
        """Check at once; the model is built on the worker thread (a future)."""
        model_id = self.new_model_id(session, seq)
        return self.submit(self._build, model_id, session, self.check_lora(lora or {"rank": 32}))

    def _build(self, model_id: str, session: str, lora: dict) -> dict:
        from rlhf_core.config import AdamConfig, DSConfig, LoraConfig, OptimizerFields
        from rlhf_core.handles import local
        from rlhf_train_deepspeed.group import WorkerGroup
        from rlhf_train_deepspeed.worker import ModelSpec, TrainWorker

        targets = [m for key, mods in LORA_TARGETS.items() if lora[key] for m in mods]
        ds = DSConfig(zero_stage=0, param_dtype=self.param_dtype)
        ds.lora = LoraConfig(rank=lora["rank"], alpha=LORA_ALPHA, target_modules=targets)
        # the step's lr, betas, eps, decay and clipping come with each optim_step
        optim = OptimizerFields(
            adam=AdamConfig(lr=0.0), lr_scheduler="constant", lr_warmup_ratio=0.0, max_norm=0
        )
        spec = ModelSpec(self.base, "causal", True, optim, self.micro_batch_size, 1, 1 << 30)
        worker = TrainWorker(0, 1)  # the inline rank of create_worker_group, kept to share its base below
        worker.init_distributed(worker.master_address())
        seed = lora["seed"] if lora["seed"] is not None else int(uuid.uuid4().int % (1 << 31))
        worker.init_model(spec, ds, seed)
        if self.models:
            share_frozen(next(iter(self.models.values())).worker.model.module, worker.model.module)
        self.models[model_id] = TrainingModel(
            model_id, session, lora, worker, WorkerGroup([local(worker)], model_id, spec)
        )
        return {"model_id": model_id}

    # --- training ---

    def check_datums(self, loss_fn: str, datums: list[Datum], config: dict) -> losses.TinkerLossConfig:
        check(loss_fn not in losses.REFUSED, f"loss_fn {loss_fn!r} is refused: {losses.REFUSED.get(loss_fn)}")
        check(loss_fn in losses.INPUTS, f"unknown loss_fn {loss_fn!r}; served: {', '.join(losses.INPUTS)}")
        check(len(datums) > 0, "forward_backward: no data")
        allowed = losses.CONFIG.get(loss_fn, set())
        check(
            set(config) <= allowed, f"{loss_fn}: loss_fn_config takes {sorted(allowed)}, got {sorted(config)}"
        )
        cfg = losses.TinkerLossConfig(loss_fn, **{k: float(v) for k, v in config.items()})
        check(loss_fn != "dro" or cfg.beta is not None, "dro needs loss_fn_config {'beta': ...}")
        needed = set(losses.INPUTS[loss_fn]) - {"target_tokens"}
        for i, d in enumerate(datums):
            n = len(d.tokens) - 1
            check(n >= 1, f"datum {i}: empty model_input")
            check(n <= self.max_len, f"datum {i}: {n} tokens; the model takes at most {self.max_len}")
            bad = [t for t in d.tokens if not 0 <= t < self.vocab_size]
            check(not bad, f"datum {i}: token id {bad[:1]} outside the vocabulary [0, {self.vocab_size})")
            check(
                set(d.inputs) == needed,
                f"datum {i}: {loss_fn} takes {sorted(needed)}, got {sorted(d.inputs)}",
            )
            for key, t in d.inputs.items():
                check(t.shape == (n,), f"datum {i}: {key} has shape {list(t.shape)}, expected [{n}]")
                check(bool(torch.isfinite(t).all()), f"datum {i}: {key} has a value that is not finite")
        return cfg

    def forward_backward(self, model_id: str, loss_fn: str, config: dict, datums, forward_only: bool) -> dict:
        model = self.model(model_id)
        cfg = self.check_datums(loss_fn, datums, config)
        return self.submit(self._forward_backward, model, cfg, datums, forward_only)

    def _forward_backward(self, model: TrainingModel, cfg, datums: list[Datum], forward_only: bool) -> dict:
        pad = self.config.pad_token_id or 0
        mbs, logprobs = [], []  # the loss appends each micro-batch's [B, T] log-probs (the client gets them)
        for i in range(0, len(datums), self.micro_batch_size):
            part = datums[i : i + self.micro_batch_size]
            seq = make_sequence_batch([d.tokens[:1] for d in part], [d.tokens[1:] for d in part], pad)
            width = seq.num_response_positions
            padded = {  # [B, T]: each input right-padded with zeros
                key: torch.stack(
                    [torch.nn.functional.pad(d.inputs[key], (0, width - len(d.tokens) + 1)) for d in part]
                )
                for key in part[0].inputs
            }
            mbs.append(losses.TinkerBatch(seq, **padded, logprobs_out=logprobs))
        if not forward_only:
            loss = self._backward(model, mbs, cfg)
        if len(logprobs) < len(mbs):  # forward only, or a step skipped for a non-finite loss
            logprobs[:] = wait(model.learner.forward([mb.seq for mb in mbs]))
        if forward_only:
            with torch.no_grad():
                loss = sum(float(losses.batch_objective(cfg, lp, mb)) for lp, mb in zip(logprobs, mbs))
        rows = [row for lp in logprobs for row in lp.float()]
        return {
            "outputs": [row[: len(d.tokens) - 1] for row, d in zip(rows, datums)],
            "metrics": {"loss:sum": loss},
        }

    def _backward(self, model: TrainingModel, mbs: list, cfg) -> float:
        """``forward_backward`` of the ``tinker`` loss; on any failure the gradients and the step so far are
        put back as they were before this call."""
        params = [p for p in model.worker.model.module.parameters() if p.requires_grad]
        grads = [None if p.grad is None else p.grad.clone() for p in params]
        step = copy.deepcopy(model.worker.learner.step)
        counts = {"num_tokens": float(sum(mb.seq.response_mask().sum() for mb in mbs)), "num_sequences": 0.0}
        try:
            return wait(model.learner.forward_backward(mbs, "tinker", cfg, counts))["loss"]
        except BaseException:
            for p, g in zip(params, grads):
                p.grad = g
            model.worker.learner.step = step
            # and the accumulation boundary as a completed call leaves it (else the next step is not taken)
            model.worker.model.engine.set_gradient_accumulation_boundary(True)
            raise

    def optim_step(self, model_id: str, adam: dict) -> dict:
        model = self.model(model_id)
        check(adam is not None, "optim_step: only adam_params are served (Dimuon is not implemented)")
        check(
            set(adam) <= set(ADAM_DEFAULTS),
            f"adam_params: unknown fields {sorted(set(adam) - set(ADAM_DEFAULTS))}",
        )
        p = ADAM_DEFAULTS | {k: float(v) for k, v in adam.items()}
        check(
            p["learning_rate"] >= 0 and p["eps"] > 0 and p["weight_decay"] >= 0,
            f"adam_params out of range: {p}",
        )
        check(0 <= p["beta1"] < 1 and 0 <= p["beta2"] < 1, f"adam_params: betas must be in [0, 1): {p}")
        check(p["grad_clip_norm"] >= 0, f"adam_params.grad_clip_norm must be >= 0: {p['grad_clip_norm']}")
        check(  # DeepSpeed's bf16 optimizer fixes its clipping when it is built
            p["grad_clip_norm"] == 0 or model.worker.learner.no_overflow_path,
            "adam_params.grad_clip_norm is honoured on fp32 models only (--param_dtype fp32)",
        )
        return self.submit(self._optim_step, model, p)

    def _optim_step(self, model: TrainingModel, p: dict) -> dict:
        check(model.worker.learner.step is not None, "optim_step: no forward_backward since the last step")
        engine = model.worker.model.engine
        for group in engine.optimizer.param_groups:
            group.update(
                lr=p["learning_rate"],
                betas=(p["beta1"], p["beta2"]),
                eps=p["eps"],
                weight_decay=p["weight_decay"],
            )
        engine._config.gradient_clipping = p["grad_clip_norm"]  # DeepSpeed reads it at each step
        metrics = wait(model.learner.optim_step())
        return {"metrics": {k: float(v) for k, v in metrics.items() if v is not None}}

    # --- checkpoints ---

    def path(self, model_id: str, kind: str, name: str) -> str:
        return f"tinker://{model_id}/{kind}/{name}"

    def local_dir(self, path: str, kind: str) -> Path:
        match = re.fullmatch(r"tinker://([0-9a-f]{32}:train:\d+)/(weights|sampler_weights)/(.+)", path or "")
        check(match is not None, f"{path!r} is not a path this service wrote (tinker://MODEL_ID/{kind}/NAME)")
        check(match[2] == kind, f"{path!r} is a {match[2]} checkpoint; this needs {kind}")
        check(NAME.fullmatch(match[3]) is not None, f"{path!r}: bad checkpoint name")
        return self.workdir / match[1].replace(":", "_") / kind / match[3]

    def save_state(self, model_id: str, name: str | None, overwrite: bool) -> dict:
        model = self.model(model_id)
        name = name or f"state-{self.next_number()}"
        check(
            NAME.fullmatch(name) is not None, f"checkpoint name {name!r}: letters, digits, '_', '.', '-' only"
        )
        path = self.path(model_id, "weights", name)
        target = self.local_dir(path, "weights")
        check(overwrite or not target.exists(), f"{path} exists; pass overwrite=True to replace it", 409)
        return self.submit(self._save_state, model, path, target)

    def _save_state(self, model: TrainingModel, path: str, target: Path) -> dict:
        check(model.worker.learner.step is None, "save_state between forward_backward and optim_step")
        target.mkdir(parents=True, exist_ok=True)
        wait(model.learner.save_state(str(target)))
        (target / "tinker.json").write_text(json.dumps({"base_model": self.base, "lora": model.lora}))
        return {"path": path}

    def load_state(
        self, path: str, optimizer: bool, model_id: str | None, session: str | None, seq: int
    ) -> dict:
        source = self.local_dir(path, "weights")
        check((source / "tinker.json").exists(), f"{path}: no such checkpoint", 404)
        meta = json.loads((source / "tinker.json").read_text())
        self.check_base(meta["base_model"])
        if model_id is None:  # create_training_client_from_state: a new model with the checkpoint's LoRA
            model_id = self.new_model_id(session, seq)
            return self.submit(
                self._create_and_load, model_id, session, meta["lora"], path, source, optimizer
            )
        model = self.model(model_id)
        check(model.lora == meta["lora"], f"{path} has LoRA {meta['lora']}, this model {model.lora}")
        return self.submit(self._load_state, model, path, source, optimizer)

    def _create_and_load(self, model_id, session, lora, path, source, optimizer) -> dict:
        self._build(model_id, session, lora)
        return self._load_state(self.models[model_id], path, source, optimizer)

    def _load_state(self, model: TrainingModel, path: str, source: Path, optimizer: bool) -> dict:
        model.worker.learner.step = None  # a load replaces any step in progress
        for p in model.worker.model.module.parameters():
            p.grad = None
        wait(model.learner.load_state(str(source)))
        if not optimizer:  # the weights only: fresh Adam moments
            model.worker.model.engine.optimizer.state.clear()
        return {"path": path, "model_id": model.id}

    # --- sampling ---

    def save_for_sampler(self, model_id: str, name: str | None, seq: int | None) -> dict:
        model = self.model(model_id)
        check(name is None or NAME.fullmatch(name) is not None, f"sampler weights name {name!r} is invalid")
        check(
            name is not None or seq is not None,
            "save_weights_for_sampler: a path or a sampling_session_seq_id",
        )
        return self.submit(self._save_for_sampler, model, name, seq)

    def _save_for_sampler(self, model: TrainingModel, name: str | None, seq: int | None) -> dict:
        path = self.path(model.id, "sampler_weights", name or f"ephemeral-{self.next_number()}")
        self.snapshots[path] = wait(model.learner.weights())  # the adapters, copied
        if name is not None:
            return {"path": path}
        unnamed = [p for p in self.snapshots if "/sampler_weights/ephemeral-" in p]
        for old in unnamed[:-EPHEMERAL_SNAPSHOTS]:
            del self.snapshots[old]
        return {"sampling_session_id": self.create_sampler(model.session, seq, path)}

    def create_sampler(
        self, session: str, seq: int, model_path: str | None, base_model: str | None = None
    ) -> str:
        check(session in self.sessions, f"unknown session {session!r}", 404)
        if model_path is None:
            self.check_base(base_model)
        else:
            check(model_path in self.snapshots, f"{model_path}: no such sampler weights (or dropped)", 404)
        sampler = f"{session}:sample:{int(seq)}"
        check(sampler not in self.samplers, f"sampling session {sampler} exists", 409)
        self.samplers[sampler] = model_path
        return sampler

    def sample(self, sampler: str, prompt: list[int], n: int, params: dict, prompt_logprobs: bool) -> dict:
        from rlhf_core.types import GenerationRequest, SamplingParams

        check(sampler in self.samplers, f"unknown sampling_session_id {sampler!r}", 404)
        check(1 <= n <= 1024, f"num_samples must be 1..1024, got {n}")
        check(len(prompt) >= 1, "the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        check(not bad, f"prompt token id {bad[:1]} outside the vocabulary [0, {self.vocab_size})")
        max_tokens, stop = params.get("max_tokens"), params.get("stop")
        check(
            isinstance(max_tokens, int) and max_tokens >= 1, "sampling_params.max_tokens (>= 1) is required"
        )
        check(len(prompt) + max_tokens <= self.max_len, f"prompt + max_tokens exceed {self.max_len} tokens")
        stop = [stop] if isinstance(stop, str) else stop or []
        check(
            all(isinstance(s, int) for s in stop),
            "sampling_params.stop: only token ids are served, not strings",
        )
        top_k = params.get("top_k", -1)
        sp = SamplingParams(
            n,
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=0 if top_k in (None, -1) else int(top_k),
            max_new_tokens=max_tokens,
            stop_token_ids=tuple(stop),
            ignore_eos=params.get("stop") == [],  # Tinker: an empty list turns off EOS too
            seed=params.get("seed"),
        )
        request_id, future = uuid.uuid4().hex, Future()
        with self.lock:
            self.pending.append(
                (self.samplers[sampler], GenerationRequest(prompt, sp), prompt_logprobs, future)
            )
        self.futures[request_id] = future
        self.queue.submit(self._sample_pending)
        return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(n)]}

    def _sample_pending(self) -> None:
        """Every sample request queued so far, one engine call per snapshot (the requests an RL step sends
        at once decode together); a later call finds them taken."""
        time.sleep(BATCH_WINDOW_S)  # the requests a client sends together arrive within it
        with self.lock:
            pending, self.pending = self.pending, []
        for path in dict.fromkeys(item[0] for item in pending):
            items = [item for item in pending if item[0] == path]
            try:
                outputs = self._sample(path, [item[1] for item in items])
                for (_, request, prompt_logprobs, future), samples in zip(items, outputs):
                    extra = (
                        {"prompt_logprobs": self._prompt_logprobs(request.prompt_ids)}
                        if prompt_logprobs
                        else {}
                    )
                    future.set_result({"sequences": samples, **extra})
            except Exception as exc:  # noqa: BLE001 - each request's future carries it
                for item in items:
                    item[3].set_exception(exc)

    def _sample(self, path: str | None, requests: list) -> list:
        check(path is None or path in self.snapshots, f"{path}: sampler weights dropped", 404)
        if self.engine is None:
            from rlhf_cli.build import EngineSampler
            from rlhf_core.handles import local
            from rlhf_core.rollout.hf_engine import HFEngine

            self.engine = HFEngine(self.base)
            self.sampler = EngineSampler([local(self.engine)])
        if self.merged[0] != path:  # unmerge the last adapter (its B zeroed), then merge this one
            if self.merged[1] is not None:
                last = self.merged[1]
                wait(
                    self.sampler.load_weights(
                        {k: v if k.endswith(".lora_A") else 0 * v for k, v in last.items()}
                    )
                )
            if path is not None:
                wait(self.sampler.load_weights(self.snapshots[path]))
            self.merged = (path, self.snapshots.get(path))
        return wait(self.sampler.sample(requests))

    @torch.no_grad()
    def _prompt_logprobs(self, prompt: list[int]) -> torch.Tensor:
        """``[N]``: NaN (none) for the first token, then each token's log-prob under the merged engine."""
        ids = torch.tensor([prompt], device=self.engine.device)
        logits = self.engine.model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
        return torch.cat([torch.tensor([float("nan")]), logits.gather(-1, ids[0, 1:, None])[:, 0].cpu()])


def share_frozen(first: torch.nn.Module, module: torch.nn.Module) -> None:
    """Point ``module``'s frozen (base) parameters at ``first``'s tensors of the same name: the LoRA models of
    one base then hold it once. peft names a wrapped layer's weight ``<layer>.base_layer.weight``."""
    base = {n.replace(".base_layer", ""): p for n, p in first.named_parameters()}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            p.data = base[name.replace(".base_layer", "")].data
