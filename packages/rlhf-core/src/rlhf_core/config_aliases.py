"""OpenRLHF's flat flag spellings (``--advantage_estimator``), rewritten to the dotted flags of
:mod:`rlhf_core.config`, following OpenRLHF's own rename (``reference/openrlhf-features.md`` §2).
"""

from __future__ import annotations


def _same(section: str, names: str, prefix: str = "") -> dict[str, str]:
    """Flags named as their field, less ``prefix``: ``_same("vllm", "num_engines", "vllm_")`` maps
    ``vllm_num_engines`` to ``vllm.num_engines``."""
    return {prefix + n: f"{section}.{n}" for n in names.split()}


# flat name -> dotted name(s) it sets, in every mode
COMMON: dict[str, str | tuple[str, ...]] = {
    **_same(
        "data",
        "prompt_split input_key label_key input_template apply_chat_template max_len prompt_max_len "
        "max_samples image_key max_images_per_prompt disable_fast_tokenizer dataloader_num_workers "
        "dataset dataset_probs dataset_split output_key tokenizer_chat_template chosen_key "
        "rejected_key prompt_key multiturn",
    ),
    "prompt_data": "data.prompt_dataset",
    "prompt_data_probs": "data.prompt_probs",
    **_same(
        "ds",
        "zero_stage param_dtype zpg adam_offload overlap_comm grad_accum_dtype deepcompile "
        "attn_implementation use_liger_kernel load_in_4bit packing_samples ring_attn_size value_head_prefix",
    ),
    "ds_tensor_parallel_size": "ds.tensor_parallel_size",
    "ring_head_stride": "ds.ring_attn_head_stride",
    **_same("ds.lora", "rank alpha dropout", "lora_"),
    "target_modules": "ds.lora.target_modules",
    "use_ds_universal_ckpt": "ds.use_universal_ckpt",
    "value_prefix_head": "ds.value_head_prefix",  # a typo in the seed documents
    # training loop
    **_same("train", "max_epochs seed max_steps"),
    "train_batch_size": "train.batch_size",
    "micro_train_batch_size": "train.micro_batch_size",
    "full_determinism": "train.full_determinism_enable",
    # eval, checkpoints, logging
    **_same("eval", "dataset split steps", "eval_"),
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
    **_same("logger.wandb", "org group project run_name", "wandb_"),
    "use_tensorboard": "logger.tensorboard_dir",
}

_TRAINED = ("actor", "critic")
# flat optimizer flags -> their field in a trained model's section (RL: actor and critic, else model)
_OPTIMIZER = {
    "adam_betas": "adam.betas",
    "l2": "adam.weight_decay",
    "max_norm": "max_norm",
    "lr_scheduler": "lr_scheduler",
    "lr_warmup_ratio": "lr_warmup_ratio",
}
_MODELS = ("actor", "critic", "ref", "reward")

RL: dict[str, str | tuple[str, ...]] = {
    **COMMON,
    # models
    "pretrain": "actor.model_name_or_path",
    **{f"{m}_pretrain": f"{m}.model_name_or_path" for m in ("reward", "critic", "ref")},
    "remote_rm_url": "reward.remote_url",
    "agent_func_path": "train.agent_func_path",
    "gradient_checkpointing": "actor.gradient_checkpointing_enable",
    "gradient_checkpointing_use_reentrant": "actor.gradient_checkpointing_reentrant",
    "freeze_visual_encoder": "actor.freeze_visual_encoder",
    # resources
    **{f"{m}_num_nodes": f"{m}.num_nodes" for m in _MODELS},
    **{f"{m}_num_gpus_per_node": f"{m}.num_gpus_per_node" for m in _MODELS},
    "colocate_all_models": "train.colocate_all",
    **_same("train", "colocate_actor_ref colocate_critic_reward"),
    # vllm
    **_same(
        "vllm",
        "num_engines tensor_parallel_size sync_backend sync_with_ray gpu_memory_utilization enable_sleep",
        "vllm_",
    ),
    **_same("vllm", "enable_prefix_caching enforce_eager"),
    "deepspeed_enable_sleep": "ds.enable_sleep",
    # algorithm
    "advantage_estimator": "algo.advantage.estimator",
    **_same("algo.advantage", "gamma lambd"),
    "no_advantage_std_norm": "algo.advantage.no_std_norm",
    "enable_vllm_is_correction": "algo.advantage.is_correction_enable",
    "vllm_is_truncated_threshold": "algo.advantage.is_correction_threshold",
    "vllm_is_correction_type": "algo.advantage.is_correction_type",
    "init_kl_coef": "algo.kl.init_coef",
    **_same("algo.kl", "target horizon estimator", "kl_"),
    "use_kl_loss": "algo.kl.use_loss",
    "dynamic_filtering": "algo.dynamic_filtering_enable",
    "dynamic_filtering_reward_range": "algo.dynamic_filtering_range",
    # losses
    **_same("actor", "eps_clip eps_clip_low_high dual_clip policy_loss_type aux_loss_coef"),
    "entropy_loss_coef": "actor.entropy_coef",
    **_same("critic", "value_clip save_value_network"),
    "freezing_actor_steps": "critic.freezing_steps",
    # optimizers: flat flags set both trained models
    **{f"{m}_learning_rate": f"{m}.adam.lr" for m in _TRAINED},
    **{flag: tuple(f"{m}.{path}" for m in _TRAINED) for flag, path in _OPTIMIZER.items()},
    # rewards
    "normalize_reward": "reward.normalize_enable",
    "reward_clip_range": "reward.clip_range",
    **_same("reward", "overlong_buffer_len overlong_penalty_factor stop_properly_penalty_coef"),
    # batches and rollout
    "rollout_batch_size": "rollout.batch_size",
    "micro_rollout_batch_size": "rollout.micro_batch_size",
    **_same("rollout", "vllm_generate_batch_size n_samples_per_prompt max_new_tokens temperature top_p"),
    "generate_max_len": "rollout.max_new_tokens",
    "rollout_max_tokens_per_gpu": "rollout.max_tokens_per_gpu",
    **_same("train", "num_episodes enable_ema ema_beta async_queue_size"),
    "use_dynamic_batch": "train.dynamic_batch_enable",
    "train_max_tokens_per_gpu": "train.max_tokens_per_gpu",
    "async_train": "train.async_enable",
    "partial_rollout": "train.partial_rollout_enable",
    **_same("eval", "temperature n_samples_per_prompt", "eval_"),
    "best_metric_key": "ckpt.best_metric_key",
}

SUPERVISED: dict[str, str | tuple[str, ...]] = {
    **COMMON,
    "pretrain": "model.model_name_or_path",
    "gradient_checkpointing": "model.gradient_checkpointing_enable",
    "gradient_checkpointing_use_reentrant": "model.gradient_checkpointing_reentrant",
    "pretrain_mode": "model.pretrain_mode_enable",
    "learning_rate": "model.adam.lr",
    **{flag: f"model.{path}" for flag, path in _OPTIMIZER.items()},
    **_same("model", "aux_loss_coef min_lr_ratio optim beta label_smoothing nll_loss_coef"),
    # OpenRLHF's sft/rm/dpo CLIs give the optimizer flags no prefix
    **{f"adam.{k}": f"model.adam.{k}" for k in ("lr", "betas", "eps", "weight_decay")},
    **{f"muon.{k}": f"model.muon.{k}" for k in ("lr", "momentum", "ns_steps", "nesterov")},
    # rm / dpo / kto
    "loss": "model.loss_type",
    **{f: f"model.{f}_enable" for f in ("margin_loss", "compute_fp32_loss", "ipo")},
    "ref_pretrain": "ref.model_name_or_path",
    "ref_offload": "ref.offload",
    **_same("prm", "placeholder_token reward_tokens"),  # prm
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
    **_same(
        "data",
        "dataset dataset_probs dataset_split input_key output_key label_key input_template "
        "apply_chat_template tokenizer_chat_template max_len prompt_max_len max_samples "
        "disable_fast_tokenizer",
    ),
    "pretrain": "model.model_name_or_path",
    "reward_pretrain": "reward.model_name_or_path",
    "remote_rm_url": "reward.remote_url",
    "eval_task": "generate.task",
    **_same(
        "generate",
        "output_path post_processor reward_template normalize_reward enable_csft csft_prompt iter seed",
    ),
    "best_of_n": "rollout.n_samples_per_prompt",
    **_same("rollout", "max_new_tokens temperature top_p repetition_penalty"),
    "rollout_batch_size": "rollout.batch_size",
    "micro_batch_size": "rollout.micro_batch_size",
    "tp_size": "vllm.tensor_parallel_size",
    "enable_prefix_caching": "vllm.enable_prefix_caching",
    **_same("ds", "param_dtype attn_implementation value_head_prefix"),
}

# ``rlhf chat``: OpenRLHF's interactive_chat flags.
CHAT: dict[str, str | tuple[str, ...]] = {
    "pretrain": "model.model_name_or_path",
    **_same(
        "chat",
        "max_len max_new_tokens temperature top_p repetition_penalty ta_prompt enable_csft csft_prompt",
    ),
    **_same("data", "input_template apply_chat_template tokenizer_chat_template"),
    **_same("ds", "param_dtype attn_implementation"),
}

# ``rlhf serve-rm``: OpenRLHF's serve_rm flags, and the server's own flat ones.
SERVE_RM: dict[str, str | tuple[str, ...]] = {
    "reward_pretrain": "reward.model_name_or_path",
    "normalize_reward": "reward.normalize_enable",
    **_same("ds", "value_head_prefix param_dtype attn_implementation packing_samples load_in_4bit"),
    **_same("data", "max_len disable_fast_tokenizer"),
    **_same("serve", "host port batch_size api_key insecure max_body_bytes max_batch log_level use_ms"),
    "api-key": "serve.api_key",
}

# Flag-only spellings of the inference commands: flag -> (dotted, value) pairs it sets.
_DS_CONSTANTS = {flag: CONSTANTS[flag] for flag in ("bf16", "flash_attn")}
INFERENCE_CONSTANTS: dict[str, dict[str, tuple[tuple[str, str], ...]]] = {
    "generate": {"greedy_sampling": (("rollout.temperature", "0"),), **_DS_CONSTANTS},
    "chat": {"greedy_sampling": (("chat.temperature", "0"),), **_DS_CONSTANTS},
    "serve-rm": _DS_CONSTANTS,
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
    return {"ppo": RL, "generate": GENERATE, "chat": CHAT, "serve-rm": SERVE_RM}.get(mode, SUPERVISED)


def constants(mode: str) -> dict[str, tuple[tuple[str, str], ...]]:
    return INFERENCE_CONSTANTS.get(mode, CONSTANTS)


def ignored(mode: str) -> dict[str, str]:
    return INFERENCE_IGNORED.get(mode, {})
