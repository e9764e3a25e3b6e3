"""OpenRLHF's flat flag spellings, rewritten to the dotted flags of :mod:`rlhf_core.config`.

OpenRLHF's current release accepts only dotted flags; its earlier releases and the seed documents use flat
ones (``--advantage_estimator``). Users' scripts carry both, so both parse here. The table follows the
flat-to-dotted mapping of OpenRLHF's own rename (``reference/openrlhf-features.md`` §2).
"""

from __future__ import annotations

# flat name -> dotted name(s) it sets, in every mode
COMMON: dict[str, str | tuple[str, ...]] = {
    # data
    "prompt_data": "data.prompt_dataset",
    "prompt_data_probs": "data.prompt_probs",
    "prompt_split": "data.prompt_split",
    "input_key": "data.input_key",
    "label_key": "data.label_key",
    "input_template": "data.input_template",
    "apply_chat_template": "data.apply_chat_template",
    "max_len": "data.max_len",
    "prompt_max_len": "data.prompt_max_len",
    "max_samples": "data.max_samples",
    "image_key": "data.image_key",
    "max_images_per_prompt": "data.max_images_per_prompt",
    "disable_fast_tokenizer": "data.disable_fast_tokenizer",
    "dataloader_num_workers": "data.dataloader_num_workers",
    "dataset": "data.dataset",
    "dataset_probs": "data.dataset_probs",
    "dataset_split": "data.dataset_split",
    "output_key": "data.output_key",
    "tokenizer_chat_template": "data.tokenizer_chat_template",
    "chosen_key": "data.chosen_key",
    "rejected_key": "data.rejected_key",
    "prompt_key": "data.prompt_key",
    "multiturn": "data.multiturn",
    # deepspeed
    "zero_stage": "ds.zero_stage",
    "param_dtype": "ds.param_dtype",
    "zpg": "ds.zpg",
    "adam_offload": "ds.adam_offload",
    "overlap_comm": "ds.overlap_comm",
    "grad_accum_dtype": "ds.grad_accum_dtype",
    "deepcompile": "ds.deepcompile",
    "attn_implementation": "ds.attn_implementation",
    "use_liger_kernel": "ds.use_liger_kernel",
    "load_in_4bit": "ds.load_in_4bit",
    "packing_samples": "ds.packing_samples",
    "ds_tensor_parallel_size": "ds.tensor_parallel_size",
    "ring_attn_size": "ds.ring_attn_size",
    "ring_head_stride": "ds.ring_attn_head_stride",
    "lora_rank": "ds.lora.rank",
    "lora_alpha": "ds.lora.alpha",
    "target_modules": "ds.lora.target_modules",
    "lora_dropout": "ds.lora.dropout",
    "use_ds_universal_ckpt": "ds.use_universal_ckpt",
    "value_head_prefix": "ds.value_head_prefix",
    "value_prefix_head": "ds.value_head_prefix",  # a typo in the seed documents
    # training loop
    "train_batch_size": "train.batch_size",
    "micro_train_batch_size": "train.micro_batch_size",
    "max_epochs": "train.max_epochs",
    "seed": "train.seed",
    "full_determinism": "train.full_determinism_enable",
    "max_steps": "train.max_steps",
    # eval, checkpoints, logging
    "eval_dataset": "eval.dataset",
    "eval_split": "eval.split",
    "eval_steps": "eval.steps",
    "save_path": "ckpt.output_dir",
    "ckpt_path": "ckpt.path",
    "save_steps": "ckpt.save_steps",
    "save_hf_ckpt": "ckpt.save_hf",
    "disable_ds_ckpt": "ckpt.disable_ds",
    "max_ckpt_num": "ckpt.max_num",
    "max_ckpt_mem": "ckpt.max_mem",
    "load_checkpoint": "ckpt.load_enable",
    "logging_steps": "logger.logging_steps",
    "use_wandb": "logger.wandb.key",
    "wandb_org": "logger.wandb.org",
    "wandb_group": "logger.wandb.group",
    "wandb_project": "logger.wandb.project",
    "wandb_run_name": "logger.wandb.run_name",
    "use_tensorboard": "logger.tensorboard_dir",
}

_TRAINED = ("actor", "critic")
# flat optimizer flags -> their field in a trained model's section (RL: actor and critic, else model)
_OPTIMIZER = {"adam_betas": "adam.betas", "l2": "adam.weight_decay", "max_norm": "max_norm",
              "lr_scheduler": "lr_scheduler", "lr_warmup_ratio": "lr_warmup_ratio"}

RL: dict[str, str | tuple[str, ...]] = {
    **COMMON,
    # models
    "pretrain": "actor.model_name_or_path",
    "reward_pretrain": "reward.model_name_or_path",
    "critic_pretrain": "critic.model_name_or_path",
    "ref_pretrain": "ref.model_name_or_path",
    "remote_rm_url": "reward.remote_url",
    "agent_func_path": "train.agent_func_path",
    "gradient_checkpointing": "actor.gradient_checkpointing_enable",
    "gradient_checkpointing_use_reentrant": "actor.gradient_checkpointing_reentrant",
    "freeze_visual_encoder": "actor.freeze_visual_encoder",
    # resources
    **{f"{m}_num_nodes": f"{m}.num_nodes" for m in ("actor", "critic", "ref", "reward")},
    **{f"{m}_num_gpus_per_node": f"{m}.num_gpus_per_node" for m in ("actor", "critic", "ref", "reward")},
    "colocate_all_models": "train.colocate_all",
    "colocate_actor_ref": "train.colocate_actor_ref",
    "colocate_critic_reward": "train.colocate_critic_reward",
    # vllm
    "vllm_num_engines": "vllm.num_engines",
    "vllm_tensor_parallel_size": "vllm.tensor_parallel_size",
    "vllm_sync_backend": "vllm.sync_backend",
    "vllm_sync_with_ray": "vllm.sync_with_ray",
    "vllm_gpu_memory_utilization": "vllm.gpu_memory_utilization",
    "vllm_enable_sleep": "vllm.enable_sleep",
    "enable_prefix_caching": "vllm.enable_prefix_caching",
    "enforce_eager": "vllm.enforce_eager",
    "deepspeed_enable_sleep": "ds.enable_sleep",
    # algorithm
    "advantage_estimator": "algo.advantage.estimator",
    "gamma": "algo.advantage.gamma",
    "lambd": "algo.advantage.lambd",
    "no_advantage_std_norm": "algo.advantage.no_std_norm",
    "enable_vllm_is_correction": "algo.advantage.is_correction_enable",
    "vllm_is_truncated_threshold": "algo.advantage.is_correction_threshold",
    "vllm_is_correction_type": "algo.advantage.is_correction_type",
    "init_kl_coef": "algo.kl.init_coef",
    "kl_target": "algo.kl.target",
    "kl_horizon": "algo.kl.horizon",
    "use_kl_loss": "algo.kl.use_loss",
    "kl_estimator": "algo.kl.estimator",
    "dynamic_filtering": "algo.dynamic_filtering_enable",
    "dynamic_filtering_reward_range": "algo.dynamic_filtering_range",
    # losses
    "eps_clip": "actor.eps_clip",
    "eps_clip_low_high": "actor.eps_clip_low_high",
    "dual_clip": "actor.dual_clip",
    "policy_loss_type": "actor.policy_loss_type",
    "aux_loss_coef": "actor.aux_loss_coef",
    "entropy_loss_coef": "actor.entropy_coef",
    "value_clip": "critic.value_clip",
    "freezing_actor_steps": "critic.freezing_steps",
    "save_value_network": "critic.save_value_network",
    # optimizers: flat flags set both trained models
    "actor_learning_rate": "actor.adam.lr",
    "critic_learning_rate": "critic.adam.lr",
    **{flag: tuple(f"{m}.{path}" for m in _TRAINED) for flag, path in _OPTIMIZER.items()},
    # rewards
    "normalize_reward": "reward.normalize_enable",
    "reward_clip_range": "reward.clip_range",
    "overlong_buffer_len": "reward.overlong_buffer_len",
    "overlong_penalty_factor": "reward.overlong_penalty_factor",
    "stop_properly_penalty_coef": "reward.stop_properly_penalty_coef",
    # batches and rollout
    "rollout_batch_size": "rollout.batch_size",
    "micro_rollout_batch_size": "rollout.micro_batch_size",
    "vllm_generate_batch_size": "rollout.vllm_generate_batch_size",
    "n_samples_per_prompt": "rollout.n_samples_per_prompt",
    "max_new_tokens": "rollout.max_new_tokens",
    "generate_max_len": "rollout.max_new_tokens",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "rollout_max_tokens_per_gpu": "rollout.max_tokens_per_gpu",
    "num_episodes": "train.num_episodes",
    "enable_ema": "train.enable_ema",
    "ema_beta": "train.ema_beta",
    "use_dynamic_batch": "train.dynamic_batch_enable",
    "train_max_tokens_per_gpu": "train.max_tokens_per_gpu",
    "async_train": "train.async_enable",
    "async_queue_size": "train.async_queue_size",
    "partial_rollout": "train.partial_rollout_enable",
    "eval_temperature": "eval.temperature",
    "eval_n_samples_per_prompt": "eval.n_samples_per_prompt",
    "best_metric_key": "ckpt.best_metric_key",
}

SUPERVISED: dict[str, str | tuple[str, ...]] = {
    **COMMON,
    "pretrain": "model.model_name_or_path",
    "gradient_checkpointing": "model.gradient_checkpointing_enable",
    "gradient_checkpointing_use_reentrant": "model.gradient_checkpointing_reentrant",
    "aux_loss_coef": "model.aux_loss_coef",
    "pretrain_mode": "model.pretrain_mode_enable",
    "learning_rate": "model.adam.lr",
    **{flag: f"model.{path}" for flag, path in _OPTIMIZER.items()},
    "min_lr_ratio": "model.min_lr_ratio",
    "optim": "model.optim",
    # OpenRLHF's sft/rm/dpo CLIs give the optimizer flags no prefix
    **{f"adam.{k}": f"model.adam.{k}" for k in ("lr", "betas", "eps", "weight_decay")},
    **{f"muon.{k}": f"model.muon.{k}" for k in ("lr", "momentum", "ns_steps", "nesterov")},
    # rm / dpo / kto
    "loss": "model.loss_type",
    "margin_loss": "model.margin_loss_enable",
    "compute_fp32_loss": "model.compute_fp32_loss_enable",
    "beta": "model.beta",
    "ipo": "model.ipo_enable",
    "label_smoothing": "model.label_smoothing",
    "nll_loss_coef": "model.nll_loss_coef",
    "ref_pretrain": "ref.model_name_or_path",
    "ref_offload": "ref.offload",
    # prm
    "placeholder_token": "prm.placeholder_token",
    "reward_tokens": "prm.reward_tokens",
    # kd
    "teacher_model": "teacher.model_name_or_path",
    "teacher_offload": "teacher.offload",
    "kd_coef": "teacher.kd_coef",
}

# flag -> (dotted, value) pairs it sets; the flag takes no value
CONSTANTS: dict[str, tuple[tuple[str, str], ...]] = {
    "bf16": (("ds.param_dtype", "bf16"),),
    "flash_attn": (("ds.attn_implementation", "flash_attention_2"),),
    "use_icepop": (("algo.advantage.is_correction_type", "icepop"),),
    "ref_reward_offload": (("ref.offload", "true"), ("reward.offload", "true")),
}

# Flags OpenRLHF dropped without a successor: name -> how many values follow it. They are accepted with a
# note, so that old scripts still run.
DROPPED: dict[str, int] = {"actor_init_on_gpu": 0, "ptx_coef": 1, "perf": 0, "local_rank": 1, "use_ms": 0}

# Seed-document spellings of the asymmetric clip, combined into actor.eps_clip_low_high.
CLIP_PARTS = {"clip_eps_low": 0, "clip_eps_high": 1}


# ``rlhf generate``: OpenRLHF's batch_inference flags (its ``--pretrain`` is the policy; the reward model
# comes with ``--reward_pretrain`` or ``--remote_rm_url``, as in train_ppo).
GENERATE: dict[str, str | tuple[str, ...]] = {
    **{k: v for k, v in COMMON.items() if v.startswith("data.") and v.removeprefix("data.") in (
        "dataset", "dataset_probs", "dataset_split", "input_key", "output_key", "label_key", "input_template",
        "apply_chat_template", "tokenizer_chat_template", "max_len", "prompt_max_len", "max_samples",
        "disable_fast_tokenizer")},
    "pretrain": "model.model_name_or_path",
    "reward_pretrain": "reward.model_name_or_path",
    "remote_rm_url": "reward.remote_url",
    "eval_task": "generate.task",
    "output_path": "generate.output_path",
    "post_processor": "generate.post_processor",
    "reward_template": "generate.reward_template",
    "normalize_reward": "generate.normalize_reward",
    "enable_csft": "generate.enable_csft",
    "csft_prompt": "generate.csft_prompt",
    "iter": "generate.iter",
    "seed": "generate.seed",
    "best_of_n": "rollout.n_samples_per_prompt",
    "max_new_tokens": "rollout.max_new_tokens",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "repetition_penalty": "rollout.repetition_penalty",
    "rollout_batch_size": "rollout.batch_size",
    "micro_batch_size": "rollout.micro_batch_size",
    "tp_size": "vllm.tensor_parallel_size",
    "enable_prefix_caching": "vllm.enable_prefix_caching",
    "param_dtype": "ds.param_dtype",
    "attn_implementation": "ds.attn_implementation",
    "value_head_prefix": "ds.value_head_prefix",
}

# ``rlhf chat``: OpenRLHF's interactive_chat flags.
CHAT: dict[str, str | tuple[str, ...]] = {
    "pretrain": "model.model_name_or_path",
    "max_len": "chat.max_len",
    "max_new_tokens": "chat.max_new_tokens",
    "temperature": "chat.temperature",
    "top_p": "chat.top_p",
    "repetition_penalty": "chat.repetition_penalty",
    "ta_prompt": "chat.ta_prompt",
    "enable_csft": "chat.enable_csft",
    "csft_prompt": "chat.csft_prompt",
    "input_template": "data.input_template",
    "apply_chat_template": "data.apply_chat_template",
    "tokenizer_chat_template": "data.tokenizer_chat_template",
    "param_dtype": "ds.param_dtype",
    "attn_implementation": "ds.attn_implementation",
}

# Flag-only spellings of the inference commands: flag -> (dotted, value) pairs it sets.
INFERENCE_CONSTANTS: dict[str, dict[str, tuple[tuple[str, str], ...]]] = {
    "generate": {"greedy_sampling": (("rollout.temperature", "0"),), "bf16": (("ds.param_dtype", "bf16"),),
                 "flash_attn": (("ds.attn_implementation", "flash_attention_2"),)},
    "chat": {"greedy_sampling": (("chat.temperature", "0"),), "bf16": (("ds.param_dtype", "bf16"),),
             "flash_attn": (("ds.attn_implementation", "flash_attention_2"),)},
}

# OpenRLHF flags of the inference commands that have nothing to act on here: flag -> why (printed as a note).
INFERENCE_IGNORED: dict[str, dict[str, str]] = {
    "generate": {
        "zero_stage": "generation runs the policy in rollout engines, not under DeepSpeed",
        "max_num_seqs": "the engines size their own batches (--rollout.micro_batch_size prompts per call)",
    },
    "chat": {"load_in_4bit": "rlhf chat loads the model in --ds.param_dtype"},
}


def table(mode: str) -> dict[str, str | tuple[str, ...]]:
    return {"ppo": RL, "generate": GENERATE, "chat": CHAT}.get(mode, SUPERVISED)


def constants(mode: str) -> dict[str, tuple[tuple[str, str], ...]]:
    return INFERENCE_CONSTANTS.get(mode, CONSTANTS)


def ignored(mode: str) -> dict[str, str]:
    return INFERENCE_IGNORED.get(mode, {})
