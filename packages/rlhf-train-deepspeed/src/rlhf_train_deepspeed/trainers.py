"""The SFT, RM, DPO, KTO, PRM and KD trainers: a loop in the driver process over a group of DeepSpeed ranks
(data, losses and the run directory: this package's README). The data order of epoch ``e`` is a permutation
seeded by ``(train.seed, e)``, so the data position of a resumed run is just its step number."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rlhf_core.checkpoint import fault_point
from rlhf_core.data import DataError, DataStats, load_rows, load_tokenizer
from rlhf_core.errors import UserError
from rlhf_core.handles import single_process, wait
from rlhf_core.runloop import MetricsLogger, NonFiniteSteps, open_checkpoints, save_checkpoint
from rlhf_core.supervised import PLACEHOLDER_KEY, REWARD_TOKENS_KEY, SetupError, preflight
from rlhf_core.types import derive_seed
from rlhf_train_deepspeed.strategy import ConfigError, add_metrics
from rlhf_train_deepspeed.supervised_data import batch_tokens, build_examples, collate
from rlhf_train_deepspeed.worker import ModelSpec, SupervisedConfigLite

MODES = ("sft", "rm", "dpo", "kto", "prm", "kd")


class NonFiniteLossError(UserError, FloatingPointError):
    """Too many optimizer steps in a row had a non-finite loss (``--train.max_nonfinite_steps``)."""


@dataclass
class BatchPlan:
    world_size: int
    micro_batch_size: int
    grad_accum: int
    global_batch: int

    @classmethod
    def from_config(cls, cfg) -> BatchPlan:
        world = cfg.model.num_nodes * cfg.model.num_gpus_per_node
        mb, gb = cfg.train.micro_batch_size, cfg.train.batch_size
        if gb % (mb * world):
            raise ConfigError(
                f"--train.batch_size {gb} must be a multiple of --train.micro_batch_size {mb} x {world} ranks"
            )
        return cls(world, mb, gb // (mb * world), gb)


def run_supervised(mode: str, cfg, group_factory=None) -> dict:
    """Train ``cfg.model`` with the ``mode`` loss; returns the last step's metrics and the output paths.
    ``group_factory(role, spec, ds, num_workers, seed)`` builds the worker group (default:
    :func:`rlhf_train_deepspeed.group.create_worker_group`); tests pass one that reuses actors. A run on Ray
    finds Ray started by its caller (``rlhf train`` starts it as for an RL run: ``rlhf_cli.ray_launch``),
    else starts it with ``ray.init()``'s defaults (``$RAY_ADDRESS`` when set). Stops after ``--train.max_nonfinite_steps`` optimizer steps in a
    row whose loss was not finite, as an RL run does (docs/fault-handling.md)."""
    if mode not in MODES:
        raise ConfigError(f"unknown trainer mode {mode!r}; modes are {', '.join(MODES)}")
    if not cfg.model.model_name_or_path:
        raise ConfigError("--model.model_name_or_path is required")
    try:
        prm = preflight(mode, cfg)
    except SetupError as exc:
        raise ConfigError(str(exc)) from None
    plan = BatchPlan.from_config(cfg)
    output_dir = Path(cfg.ckpt.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    try:
        tokenizer = load_tokenizer(cfg.model.model_name_or_path, cfg.data)
    except OSError as exc:  # a model directory without tokenizer files, or a hub id the hub does not have
        raise ConfigError(f"--model.model_name_or_path {cfg.model.model_name_or_path}: {exc}") from exc
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def micro_batches(items: list) -> list:
        size = plan.micro_batch_size
        return [collate(mode, items[i : i + size], pad_id) for i in range(0, len(items), size)]

    stats = DataStats()
    rows = load_rows(
        cfg.data.dataset, cfg.data.dataset_probs, cfg.data.dataset_split, cfg.train.seed, cfg.data.max_samples
    )
    examples = build_examples(mode, rows, tokenizer, cfg, stats, prm)
    eval_examples = []
    if cfg.eval.dataset:
        eval_rows = load_rows(cfg.eval.dataset, None, cfg.eval.split, cfg.train.seed, cfg.eval.max_samples)
        eval_examples = build_examples(mode, eval_rows, tokenizer, cfg, DataStats(), prm)
    print(
        f"{mode}: {len(rows)} rows -> {len(examples)} examples ({', '.join(f'{k}={int(v)}' for k, v in stats.counts.items()) or 'none skipped'}); "
        f"{len(eval_examples)} eval examples",
        flush=True,
    )
    steps_per_epoch = len(examples) // plan.global_batch
    if steps_per_epoch == 0:
        raise DataError(
            f"{len(examples)} usable examples are fewer than one batch (--train.batch_size "
            f"{plan.global_batch})"
        )
    total_steps = steps_per_epoch * cfg.train.max_epochs
    total_steps = min(total_steps, cfg.train.max_steps) if cfg.train.max_steps > 0 else total_steps

    spec = ModelSpec(
        path=cfg.model.model_name_or_path,
        kind="value" if mode == "rm" else "causal",
        trainable=True,
        optim=cfg.model,
        micro_batch_size=plan.micro_batch_size,
        grad_accum=plan.grad_accum,
        total_steps=total_steps,
        grad_ckpt=cfg.model.gradient_checkpointing_enable,
        grad_ckpt_reentrant=cfg.model.gradient_checkpointing_reentrant,
        ref_path=(cfg.ref.model_name_or_path or cfg.model.model_name_or_path)
        if mode in ("dpo", "kto")
        else cfg.teacher.model_name_or_path
        if mode == "kd"
        else None,
        ref_offload=cfg.ref.offload
        if mode in ("dpo", "kto")
        else cfg.teacher.offload
        if mode == "kd"
        else False,
    )
    # checkpoint checks (damage, --ckpt.disable_ds, a run of other settings) before any worker starts
    ckpt, latest, state = open_checkpoints(cfg, output_dir)
    start_step, nonfinite = 0, NonFiniteSteps(cfg.train.max_nonfinite_steps, NonFiniteLossError)
    # What must not change between a run and its resume (the data position is a step number).
    fingerprint = {
        "mode": mode,
        "datasets": list(cfg.data.dataset),
        "num_examples": len(examples),
        "global_batch": plan.global_batch,
        "world_size": plan.world_size,
    }
    for key, value in fingerprint.items() if latest is not None else ():
        if state["fingerprint"].get(key) != value:
            raise ConfigError(
                f"cannot resume from {latest}: it was saved with "
                f"{key}={state['fingerprint'].get(key)}, this run has {key}={value}"
            )

    own_group = group_factory is None
    if own_group:
        from rlhf_train_deepspeed.group import create_worker_group

        try:
            in_driver = single_process(cfg, plan.world_size)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not in_driver:
            import ray

            if not ray.is_initialized():  # a caller other than rlhf train (which starts Ray): Ray's default
                ray.init()
        group = create_worker_group(
            "model",
            spec,
            cfg.ds,
            plan.world_size,
            seed=cfg.train.seed,
            full_determinism=cfg.train.full_determinism_enable,
            inline_rank=in_driver,
        )
    else:
        group = group_factory("model", spec, cfg.ds, plan.world_size, cfg.train.seed)
    model = cfg.model
    losses = SupervisedConfigLite(
        mode=mode,
        beta=model.beta,
        ipo=model.ipo_enable,
        label_smoothing=model.label_smoothing,
        nll_loss_coef=model.nll_loss_coef,
        loss_type=model.loss_type,
        margin_loss=model.margin_loss_enable,
        desirable_weight=model.desirable_weight,
        undesirable_weight=model.undesirable_weight,
        reward_token_ids=prm.reward_ids if prm else None,
        kd_coef=cfg.teacher.kd_coef if mode == "kd" else 0.0,
    )

    if latest is not None:
        wait(group.load_state(str(latest)))
        start_step, nonfinite.count = state["step"], state.get("consecutive_nonfinite", 0)
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])
        print(f"resumed from {latest} at step {start_step}", flush=True)

    log = MetricsLogger(cfg, total_steps, start_step, mode, {"loss": "loss"}, digits=4, bare_prefix="train/")

    def save(step: int) -> None:
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        state = {
            "step": step,
            "fingerprint": fingerprint,
            "rng": rng,
            "consecutive_nonfinite": nonfinite.count,
        }
        save_checkpoint(ckpt, step, cfg.ckpt, {"": group}, state)

    def evaluate(items: list) -> tuple[dict[str, float], list[float]]:
        """Weighted means of the loss's metrics over ``items`` (``eval/`` names), and (RM) the rewards seen."""
        totals, rewards = {}, []
        for metrics, weight in wait(group.forward(micro_batches(items), head=mode, loss_cfg=losses)):
            rewards += metrics.pop("_rewards", [])
            add_metrics(totals, metrics, weight)
        return {f"eval/{k}": s / w for k, (s, w) in totals.items() if w > 0}, rewards

    order_epoch, order = -1, None
    final_eval, rewards, last = {}, [], {}  # the last evaluation, its RM rewards, the last step's metrics
    for step in range(start_step, total_steps):
        epoch, within = divmod(step, steps_per_epoch)
        if epoch != order_epoch:
            order = np.random.default_rng(derive_seed(cfg.train.seed, "epoch", epoch)).permutation(
                len(examples)
            )
            order_epoch = epoch
        idx = order[within * plan.global_batch : (within + 1) * plan.global_batch]
        mbs = micro_batches([examples[i] for i in idx])
        t0 = time.perf_counter()
        wait(group.forward_backward(mbs, mode, losses))
        metrics = wait(group.optim_step())
        elapsed = time.perf_counter() - t0
        metrics.update(
            {"epoch": epoch, "timing/step": elapsed, "tokens_per_s": batch_tokens(mode, mbs) / elapsed}
        )
        metrics.update(stats.as_metrics())
        nonfinite.count_step(bool(metrics["skipped"]), mode)
        done = step + 1
        if eval_examples and (done == total_steps or (cfg.eval.steps > 0 and done % cfg.eval.steps == 0)):
            final_eval, rewards = evaluate(eval_examples)
            metrics.update(final_eval)
        log.log(done, metrics)
        last = metrics
        if cfg.ckpt.save_steps > 0 and done % cfg.ckpt.save_steps == 0:
            save(done)
        fault_point("after_step", done)

    if eval_examples and not final_eval:  # resumed after the last step: evaluate once more
        final_eval, rewards = evaluate(eval_examples)
    config_updates = None
    if mode == "rm":
        if not rewards:  # no eval set: take the statistics over (up to) 512 training examples
            rewards = evaluate(examples[:512])[1]
        r = torch.tensor(rewards, dtype=torch.float64)
        config_updates = {"mean": float(r.mean()), "std": max(float(r.std()) if len(r) > 1 else 1.0, 1e-8)}
    if mode == "prm":  # what the PRM reward source needs to score steps with this model
        config_updates = {PLACEHOLDER_KEY: prm.placeholder, REWARD_TOKENS_KEY: prm.reward_tokens}
    wait(group.export(str(output_dir), config_updates))
    log.close()
    if own_group:
        group.shutdown()
    return {
        "last": last,
        "eval": final_eval,
        "output_dir": str(output_dir),
        "steps": total_steps,
        "data": stats.as_metrics(),
    }
