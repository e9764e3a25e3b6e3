"""The ``deepspeed`` train backend: the object registered under ``rlhf_register_train_backends``."""

from __future__ import annotations

from typing import Any

from rlhf_core.config import opd_teachers
from rlhf_train_deepspeed.worker import ModelSpec

ROLES = ("actor", "critic", "ref", "reward")


def reference_paths(cfg) -> list[str]:
    """The frozen models of the reference group: multi-teacher OPD's teachers in order (``--algo.opd.teachers``),
    else ``--ref.model_name_or_path`` (default: the policy's initial weights)."""
    return list(opd_teachers(cfg).values()) or [cfg.ref.model_name_or_path or cfg.actor.model_name_or_path]


def spec_for_role(role: str, cfg, num_workers: int, total_steps: int | None = None) -> ModelSpec:
    """The model a group of ``role`` hosts, from an ``RLConfig``."""
    actor_path = cfg.actor.model_name_or_path
    micro = cfg.train.micro_batch_size
    grad_accum = max(1, cfg.train.batch_size // (micro * num_workers))
    steps = total_steps or (cfg.train.max_steps if cfg.train.max_steps > 0 else 1_000_000)
    if role == "actor":
        if not actor_path:
            raise ValueError("--actor.model_name_or_path is required")
        ema_beta = cfg.train.ema_beta if cfg.train.enable_ema else None
        if ema_beta is not None and not 0.0 <= ema_beta < 1.0:
            raise ValueError(f"--train.ema_beta must be in [0, 1), got {ema_beta}")
        return ModelSpec(
            actor_path,
            "causal",
            True,
            cfg.actor,
            micro,
            grad_accum,
            steps,
            cfg.actor.gradient_checkpointing_enable,
            cfg.actor.gradient_checkpointing_reentrant,
            ema_beta=ema_beta,
            freeze_vision=cfg.actor.freeze_visual_encoder,
        )
    if role == "critic":
        path = cfg.critic.model_name_or_path or cfg.reward.model_name_or_path or actor_path
        return ModelSpec(
            path,
            "value",
            True,
            cfg.critic,
            micro,
            grad_accum,
            steps,
            cfg.critic.gradient_checkpointing_enable,
        )
    if role == "ref":
        first, *more = reference_paths(cfg)
        return ModelSpec(first, "causal", False, offload=cfg.ref.offload, teacher_paths=more)
    if role == "reward":
        if not cfg.reward.model_name_or_path:
            raise ValueError("a reward-model group needs --reward.model_name_or_path")
        return ModelSpec(
            cfg.reward.model_name_or_path,
            "value",
            False,
            offload=cfg.reward.offload,
            normalize_reward=cfg.reward.normalize_enable,
        )
    raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")


class DeepSpeedBackend:
    """``create_group`` starts Ray workers for a role of an RL run; ``run_trainer`` runs SFT/RM/DPO/KTO/PRM/KD."""

    name = "deepspeed"
    hosts_roles = True
    """Its groups host a reference model or HF engines in the ranks' processes (``rlhf_core.types.TrainGroup``)."""
    single_process = True
    """A group of one rank can live in the driver's process (``create_group(..., inline_rank=True)``)."""

    def create_group(self, role: str, cfg, pool: Any = None, num_workers: int = 1, **kwargs):
        """A :class:`rlhf_train_deepspeed.group.WorkerGroup`; ``with_ref`` groups reach the reference model
        through ``group.hosted_ref()``."""
        from rlhf_train_deepspeed.group import create_worker_group

        spec = spec_for_role(role, cfg, num_workers, kwargs.pop("total_steps", None))
        if kwargs.pop("with_ref", False):
            spec.ref_path, *spec.teacher_paths = reference_paths(cfg)
            spec.ref_offload = cfg.ref.offload
        return create_worker_group(
            role,
            spec,
            cfg.ds,
            num_workers,
            seed=cfg.train.seed,
            full_determinism=cfg.train.full_determinism_enable,
            pool=pool,
            **kwargs,
        )

    def run_trainer(self, mode: str, cfg) -> dict:
        from rlhf_train_deepspeed.trainers import run_supervised

        return run_supervised(mode, cfg)
