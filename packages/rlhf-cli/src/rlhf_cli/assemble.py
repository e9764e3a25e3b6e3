"""From a parsed config to a checked run: plugins resolved by name, options validated, roles placed.

Planning only (``--dry-run`` stops after it; what is checked: packages/rlhf-cli/README.md, "Assembly"), so
that a mistake costs seconds, not a cluster start-up. Importing the reward and agent files runs them, as the
workers will.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_cli.placement import ROLE_ORDER, plan_pools, roles_in_actor, strategy_name
from rlhf_core import handles, plugins
from rlhf_core.config import (
    RewardConfig,
    distills_only,
    opd_teachers,
    resolve_param_dtype,
    resolve_zero_stage,
)
from rlhf_core.config_parser import config_to_yaml
from rlhf_core.errors import UserError
from rlhf_core.supervised import PRM_AGGREGATIONS, SetupError, check_same_tokenizer, is_prm_model, preflight
from rlhf_core.types import PlacementPlan, RoleDemand


class RunConfigError(UserError, ValueError):
    """Options that cannot work together, or a plugin that is missing; the message says why."""


@dataclass
class Assembly:
    """What a run will use: the plugin objects by seam, where they came from, and the placement plan."""

    mode: str
    cfg: Any
    chosen: dict[str, str] = field(default_factory=dict)  # seam -> name
    provenance: dict[str, str] = field(default_factory=dict)  # seam -> "dist version"
    roles: dict[str, RoleDemand] = field(default_factory=dict)
    plan: PlacementPlan | None = None
    notes: list[str] = field(default_factory=list)
    vision: list[str] = field(default_factory=list)
    """How a vision-language run uses images (empty for a text run)."""
    in_actor: set[str] = field(default_factory=set)
    """Roles whose workers run inside the actor ranks' processes (``rlhf_cli.placement.roles_in_actor``)."""
    single_process: bool = False
    """The run's one worker lives in the driver's process and no Ray starts (``--ray.single_process``)."""
    precision: str = ""
    """The precision every model of the run computes in, and why (``--ds.param_dtype``)."""
    zero: str = ""
    """The ZeRO stage of the training groups, and why (``--ds.zero_stage``)."""
    default_placement: bool = False
    """No placement flag was given and the run was colocated, because that fits it in one process."""

    def describe(self) -> str:
        lines = [f"plugins used by 'rlhf train {self.mode}':"]
        lines += [f"  {seam:<22} {name:<20} ({self.provenance[seam]})" for seam, name in self.chosen.items()]
        lines += [f"{k}: {v}" for k, v in (("precision", self.precision), ("ZeRO stage", self.zero)) if v]
        if self.default_placement:
            lines.append(
                "placement: colocate_all by default (no placement flag; on CPU, colocating every role fits "
                "this run in one process; --train.placement separate keeps them apart)"
            )
        if self.plan is not None:
            lines.append("placement plan:")
            lines += ["  " + line for line in self.plan.describe().splitlines()]
            if "ref" in self.in_actor:
                lines.append("  the reference model runs inside the actor ranks' processes (none of its own)")
            if "rollout" in self.in_actor:
                lines.append("  rollout engine i runs inside the process of actor rank i (none of its own)")
        if self.single_process:
            lines.append(
                "single process: the one training rank runs in this process; no Ray cluster starts "
                "(--ray.single_process)"
            )
        if self.vision:
            lines.append("vision-language model:")
            lines += ["  " + line for line in self.vision]
        return "\n".join(lines)


def gpus_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # a broken CUDA install means no usable GPU
        return False


def _use(asm: Assembly, pm, seam: str, name: str, flag: str) -> Any:
    try:
        obj = plugins.resolve(pm, seam, name, flag)
    except plugins.PluginError as exc:
        raise RunConfigError(str(exc)) from None
    reg = plugins.collect(pm, seam)[name]
    asm.chosen[seam] = name
    asm.provenance[seam] = f"{reg.distribution} {reg.version}".strip()
    return obj


def choose_engine(cfg, pm) -> str:
    """``--rollout.engine auto``: vLLM where it is installed, a GPU exists and it can run this configuration
    (a vision-language model needs a torchvision that imports), else the HF engine (also where vLLM's CPU
    build is installed: on CPU the HF engine decodes faster, bench/engine_vllm_cpu.md)."""
    if cfg.rollout.engine != "auto":
        return cfg.rollout.engine
    import torch

    vllm = plugins.collect(pm, "rollout_engines").get("vllm")
    if vllm is None or not torch.cuda.is_available() or vllm.obj.available() is not None:
        return "hf"
    return "hf" if getattr(vllm.obj, "config_problem", lambda cfg: None)(cfg) else "vllm"


HUB_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def is_hub_id(value: str) -> bool:
    """Whether a model value that is not on disk is a Hugging Face Hub id rather than a path (the rule:
    packages/rlhf-cli/README.md, "Model paths")."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if value.startswith(("/", ".", "~")) or Path(value.split("/")[0]).is_dir():
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def model_path_problem(flag: str, value: str) -> str | None:
    """Why ``value`` given to ``flag`` cannot be loaded as a model, or None (what is accepted:
    packages/rlhf-cli/README.md, "Model paths")."""
    path = Path(value)
    if path.exists():
        if path.is_dir() and (path / "config.json").is_file():
            return None
        inside = sorted(str(c.parent) for c in path.glob("*/config.json")) if path.is_dir() else []
        hint = f"; did you mean {' or '.join(inside)}?" if inside else ""
        return f"{flag} {value}: not a model directory (it has no config.json){hint}"
    if not is_hub_id(value):
        return f"{flag} {value}: no such directory"
    offline = [v for v in HUB_OFFLINE_VARS if os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")]
    if offline:
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(value, "config.json"), str):
            return (
                f"{flag} {value}: no such directory, and as a Hugging Face Hub id it is not in the local cache "
                f"({offline[0]} is set, so the hub is not asked)"
            )
    return None


def check_models(models: list[tuple[str, str | None]], required: str, asm: Assembly) -> list[str]:
    """Problems with the model flags ``models`` (flag, value; None when not given), of which ``required`` must be
    given; hub ids become notes, so that a mistyped path read as one is visible."""
    problems = []
    for flag, value in models:
        if not value:
            if flag == required:
                problems.append(f"{flag} is required: the model to train (a local model directory or hub id)")
            continue
        problem = model_path_problem(flag, value)
        if problem:
            problems.append(problem)
        elif not Path(value).exists():
            asm.notes.append(f"{flag} {value} is not a local directory: it is read as a Hugging Face Hub id")
    return problems


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:  # imported already, as a module without a spec (a shim, or a test's stand-in)
        return True


def _refuse(problems: list[str], head: str = "this run cannot start") -> None:
    if problems:
        raise RunConfigError(f"{head}:\n  - " + "\n  - ".join(problems))


def _check_rl_options(cfg, estimator, problems: list[str]) -> None:
    """Refuse up front the combinations that cannot work, with ``problems`` found before, saying why."""
    c, t, n = cfg, cfg.train, cfg.rollout.n_samples_per_prompt
    embedding_targets = [
        m for m in c.ds.lora.target_modules if m.rsplit(".", 1)[-1] in ("embed_tokens", "lm_head")
    ]
    generate, restarts = c.rollout.vllm_generate_batch_size, c.rollout.max_engine_restarts
    staleness = t.max_staleness
    ranks, samples = c.actor.num_nodes * c.actor.num_gpus_per_node, c.rollout.batch_size * n
    checks = [
        (
            n < estimator.min_samples_per_prompt,
            f"--algo.advantage.estimator {c.algo.advantage.estimator} compares samples of the same prompt, so "
            f"it needs --rollout.n_samples_per_prompt >= {estimator.min_samples_per_prompt} (got {n})",
        ),
        (
            not (
                c.reward.remote_url
                or c.reward.model_name_or_path
                or t.agent_func_path
                or t.agent_command
                or t.env
                or c.reward.source
                or c.reward.func is not None
                or distills_only(c)
            ),
            "no reward: give --reward.remote_url (a reward .py file or HTTP URL), --reward.model_name_or_path, "
            "--train.agent_func_path, --train.agent_command or --train.env (Python API: reward_func=)",
        ),
        (
            c.ds.lora.rank > 0 and embedding_targets,
            f"--ds.lora.target_modules {','.join(embedding_targets)}: a LoRA policy's weight sync sends "
            "adapters of linear decoder layers only (the HF engine merges them, vLLM serves them); LoRA on the "
            "embeddings or the LM head (tied to them in many models) is refused",
        ),
        (
            c.algo.dynamic_filtering_enable and n < 2,
            "--algo.dynamic_filtering_enable filters prompt groups, so it needs "
            "--rollout.n_samples_per_prompt >= 2",
        ),
        (
            t.async_enable and c.vllm.enable_sleep,
            "--train.async_enable keeps the engines generating while the trainers work, so they cannot sleep: "
            "drop --vllm.enable_sleep (--ds.enable_sleep may stay)",
        ),
        (
            generate is not None and generate < c.rollout.batch_size,
            f"--rollout.vllm_generate_batch_size {generate} is below --rollout.batch_size "
            f"({c.rollout.batch_size}): every step would train on fewer prompts than a batch",
        ),
        (
            generate is not None and generate > c.rollout.batch_size and not t.async_enable,
            "--rollout.vllm_generate_batch_size above --rollout.batch_size generates ahead for later steps, "
            "which only the async pipeline does: add --train.async_enable",
        ),
        (
            (c.vllm.enable_sleep or c.ds.enable_sleep) and not t.colocate_all,
            "--vllm.enable_sleep / --ds.enable_sleep free memory for a colocated partner; they need "
            "--train.colocate_all",
        ),
        (
            t.async_enable and t.async_queue_size < 1,
            f"--train.async_queue_size {t.async_queue_size}: the async pipeline generates at least one batch "
            "ahead of training; use 1 or more (or drop --train.async_enable)",
        ),
        (
            staleness is not None and not t.async_enable,
            "--train.max_staleness limits how old the async pipeline's samples may be; a sync run trains each "
            "batch on the policy that generated it: add --train.async_enable",
        ),
        (
            staleness is not None and t.async_enable and staleness < t.async_queue_size,
            f"--train.max_staleness {staleness} is below --train.async_queue_size ({t.async_queue_size}): "
            "every batch is generated that many policy versions before it is trained, so every group would be "
            "dropped as stale",
        ),
        (
            t.partial_rollout_enable and not t.async_enable,
            "--train.partial_rollout_enable only applies to the async pipeline (--train.async_enable)",
        ),
        (
            restarts is not None and restarts < 0,
            f"--rollout.max_engine_restarts {restarts}: a number of engine restarts must be 0 or more",
        ),
        (
            restarts and t.partial_rollout_enable,
            f"--rollout.max_engine_restarts {restarts} with --train.partial_rollout_enable: weights land in "
            "the engines while they generate, so there is no one version of them to give a replacement "
            "engine; engine restarts are for the sync pipeline and the async one without partial rollout",
        ),
        (
            t.episode_timeout < 0,
            f"--train.episode_timeout {t.episode_timeout:g}: seconds must be 0 (no limit) or more",
        ),
        (
            c.ds.ring_attn_size > 1 and not c.ds.packing_samples,
            "--ds.ring_attn_size > 1 splits packed sequences across ranks: add --ds.packing_samples",
        ),
        *[
            (
                budget is not None and budget < 1,
                f"{flag} {budget}: a token budget per micro-batch must be positive",
            )
            for flag, budget in (
                ("--train.max_tokens_per_gpu", t.max_tokens_per_gpu),
                ("--rollout.max_tokens_per_gpu", c.rollout.max_tokens_per_gpu),
            )
        ],
        (
            t.enable_ema and not 0.0 <= t.ema_beta < 1.0,
            f"--train.ema_beta {t.ema_beta}: the EMA decay must be in [0, 1)",
        ),
        (
            c.ds.param_dtype not in ("bf16", "fp32"),
            f"--ds.param_dtype {c.ds.param_dtype}: use bf16 or fp32 (fp16 loss scaling is not supported)",
        ),
        (
            samples % t.batch_size,
            f"--rollout.batch_size x --rollout.n_samples_per_prompt ({samples}) must be a multiple of "
            f"--train.batch_size ({t.batch_size}) so every sample is trained on",
        ),
        (
            t.batch_size % (t.micro_batch_size * ranks),
            f"--train.batch_size ({t.batch_size}) must be a multiple of --train.micro_batch_size x the actor's "
            f"ranks ({t.micro_batch_size} x {ranks})",
        ),
        (
            c.logger.wandb.key and not _importable("wandb"),
            "--logger.wandb.key: wandb is not installed (pip install 'rlhf-cli[wandb]')",
        ),
    ]
    _refuse(problems + [message for failed, message in checks if failed])


def _check_opd(c, problems: list[str], asm: Assembly) -> None:
    """``--algo.advantage.estimator opd``: the reference group is the teacher, scoring every sampled token; the
    per-token k1 KL folded into the reward is the signal (``rlhf_algos.advantages.opd_advantages``)."""
    if c.algo.advantage.estimator != "opd":
        for flag, value in (
            ("task_reward_coef", c.algo.opd.task_reward_coef),
            ("teachers", c.algo.opd.teachers),
            ("teacher_key", c.algo.opd.teacher_key),
        ):
            if value:
                problems.append(f"--algo.opd.{flag} applies to --algo.advantage.estimator opd only")
        return
    try:
        teachers = {f"--algo.opd.teachers {name}": path for name, path in opd_teachers(c).items()}
    except ValueError as exc:
        problems.append(str(exc))
        return
    if teachers:
        if c.ref.model_name_or_path:
            problems.append(
                "--ref.model_name_or_path: with --algo.opd.teachers every teacher is given there (the "
                "reference group loads them all); drop one of the two"
            )
        if len(teachers) < 2:
            problems.append("--algo.opd.teachers: one teacher is --ref.model_name_or_path; give two or more")
        if not c.algo.opd.teacher_key:
            problems.append(
                "--algo.opd.teachers needs --algo.opd.teacher_key: the prompt column naming each "
                "prompt's teacher"
            )
        problems += check_models(list(teachers.items()), "--actor.model_name_or_path", asm)
    elif c.algo.opd.teacher_key:
        problems.append(
            "--algo.opd.teacher_key names a teacher of --algo.opd.teachers per prompt: give the teachers"
        )
    elif c.ref.model_name_or_path:
        teachers = {"--ref.model_name_or_path": c.ref.model_name_or_path}
    else:
        problems.append(
            "--algo.advantage.estimator opd distils from a teacher: give it as --ref.model_name_or_path "
            "(the reference group loads it and scores every sampled token), or several as "
            "--algo.opd.teachers"
        )
    for flag, teacher in teachers.items():
        if problems:  # the model paths must be sound (check_models found nothing) to read their tokenizers
            break
        try:
            check_same_tokenizer(
                flag,
                teacher,
                c.actor.model_name_or_path,
                "on-policy distillation scores the student's sampled token ids with the teacher",
                same_logits_width=False,
            )
        except SetupError as exc:
            problems.append(str(exc))
    opd, kl = c.algo.opd, c.algo.kl
    problems += [
        message
        for failed, message in [
            (
                kl.init_coef <= 0,
                f"--algo.kl.init_coef {kl.init_coef}: with opd it weights the teacher's "
                "per-token signal and must be > 0 (0 loads no teacher)",
            ),
            (
                kl.use_loss,
                "--algo.kl.use_loss: opd's signal is the KL to the teacher as a per-token reward; "
                "drop the flag",
            ),
            (
                kl.estimator != "k1",
                f"--algo.kl.estimator {kl.estimator}: opd's per-token signal is the reverse "
                "KL's k1 estimate log pi_student - log pi_teacher of the sampled token; use k1",
            ),
            (
                c.algo.advantage.gamma != 1.0,
                f"--algo.advantage.gamma {c.algo.advantage.gamma}: opd gives each "
                "token its own KL, with no return over later tokens, so there is nothing to discount",
            ),
            (opd.task_reward_coef < 0, f"--algo.opd.task_reward_coef {opd.task_reward_coef}: must be >= 0"),
            (
                opd.task_reward_coef and c.rollout.n_samples_per_prompt < 2,
                "--algo.opd.task_reward_coef > 0 "
                "group-normalises the task reward over the samples of a prompt, so it needs "
                "--rollout.n_samples_per_prompt >= 2",
            ),
            (
                distills_only(c) and c.algo.dynamic_filtering_enable,
                "--algo.dynamic_filtering_enable filters on "
                "the task score, which opd with --algo.opd.task_reward_coef 0 does not compute",
            ),
        ]
        if failed
    ]


def _check_moe(section, name: str, vllm_lora=None) -> list[str]:
    """The mixture-of-experts checks of a local model (a hub id is left to the ranks, which refuse the flags
    too): the MoE flags of ``--<name>.*`` on a dense model (no ``num_experts_per_tok`` in its config), and
    (``vllm_lora``: the ``--ds.lora`` of a policy the vllm engine serves) an MoE policy whose weight sync vLLM
    cannot take: full weights (experts under transformers' fused names), or LoRA on parameters that are not
    linear layers (fused experts, routers), which PEFT adapts as it does on a model built from the config."""
    path = section.model_name_or_path
    flags = [
        (f"--{name}.aux_loss_coef", section.aux_loss_coef),
        (f"--{name}.freeze_moe_router", section.freeze_moe_router),
        (f"--{name}.router_replay", getattr(section, "router_replay", False)),
    ]
    if not (vllm_lora or any(on for _, on in flags)) or not (path and (Path(path) / "config.json").is_file()):
        return []
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if not getattr(config, "num_experts_per_tok", None):
        return [
            f"{flag} {value}: {path} is a {config.model_type} model, not a mixture-of-experts one (it has no "
            "router)"
            for flag, value in flags
            if value
        ]
    if vllm_lora is None:
        return []
    if not vllm_lora.rank:
        return [VLLM_MOE_SYNC.format(model_type=config.model_type)]
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # module names and shapes only: no memory, nothing read from disk
        model = AutoModelForCausalLM.from_config(config)
    targets = vllm_lora.target_modules
    lora = LoraConfig(r=vllm_lora.rank, target_modules=targets[0] if targets == ["all-linear"] else targets)
    try:
        modules = get_peft_model(model, lora).named_modules()
    except ValueError as exc:  # a target the model does not have
        return [f"--ds.lora.target_modules {' '.join(targets)}: {exc}"]
    adapted = sorted(  # peft's ParamWrapper, nested where it adapts two parameters of one module
        {
            f"{n.replace('.base_layer', '').rsplit('.', 1)[-1]}.{m.parameter_name}"
            for n, m in modules
            if hasattr(m, "parameter_name")
        }
    )
    return [VLLM_MOE_LORA.format(targets=" ".join(targets), adapted=", ".join(adapted))] if adapted else []


def router_replay_problems(cfg, engine: str) -> list[str]:
    """What ``--actor.router_replay`` cannot run with: an engine that does not record routing, and the options
    whose rows are not the rollout's tokens (docs/moe.md, "Router replay")."""
    cannot = [
        (
            engine != "hf",
            f"--rollout.engine {engine}: only the hf engine records the experts. vLLM 0.32 returns them "
            "(enable_return_routed_experts) only from its Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1, prefix "
            "caching on), which needs Triton, so a CUDA or ROCm GPU build: its CPU build (vllm-cpu, installed "
            "here) refuses it ('Model Runner V2 requires Triton'), and rlhf's vllm engine, tested on that build "
            "only, does not ask for them",
        ),
        (cfg.ds.ring_attn_size > 1, "--ds.ring_attn_size > 1: each rank routes a slice of a packed row"),
        (
            bool(cfg.train.agent_command) or cfg.train.per_call_samples == "always",
            "OpenAI-endpoint agents (--train.agent_command, --train.per_call_samples always): their samples "
            "do not carry the engine's routing",
        ),
    ]
    return [f"--actor.router_replay with {why}" for bad, why in cannot if bad]


VLLM_MOE_SYNC = (
    "--rollout.engine vllm with a mixture-of-experts policy ({model_type}): the weight sync sends the experts "
    "as transformers holds them (fused, mlp.experts.gate_up_proj) and vLLM loads only the checkpoint's "
    "per-expert names, so the first sync would fail; use --rollout.engine hf, or LoRA on linear layers "
    "(--ds.lora.rank, on a GPU build of vLLM), whose sync sends the adapters only"
)
VLLM_MOE_LORA = (
    "--ds.lora.target_modules {targets} with --rollout.engine vllm: on this mixture-of-experts policy PEFT puts "
    "the adapter on parameters that are not linear layers ({adapted}), and rlhf's vllm engine serves adapters "
    "of linear layers only (vLLM reads fused-expert adapters in PEFT's own layout, which the weight sync does "
    "not write); use --rollout.engine hf, which merges them, or name linear layers (q_proj v_proj)"
)


def _check_vision(c, estimator, engine: str) -> list[str]:
    """The checks of a run with images (``--data.image_key``, or an actor that is a vision-language model);
    returns how it uses them, for ``--dry-run``. A model given by hub id (not a local directory) is judged
    by the flags alone."""
    from rlhf_core import vision

    path = c.actor.model_name_or_path
    config = None
    if path and (Path(path) / "config.json").is_file():
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
    is_vlm = config is not None and vision.is_vision_language(config)
    model_type = config.model_type if config is not None else None
    vlm_flags = [
        f
        for f, on in (
            ("--data.image_key", c.data.image_key),
            ("--actor.freeze_visual_encoder", c.actor.freeze_visual_encoder),
            ("--data.max_images_per_prompt", c.data.max_images_per_prompt),
        )
        if on
    ]
    if not (is_vlm or vlm_flags):
        return []
    _refuse(
        [
            message
            for failed, message in [
                (
                    config is not None and not is_vlm,
                    f"{', '.join(vlm_flags)}: {path} is not a vision-language model "
                    "(its config.json has no vision_config)",
                ),
                (
                    is_vlm and model_type not in vision.SUPPORTED_MODEL_TYPES,
                    f"{path} is a vision-language model of "
                    f"type {model_type!r}; rlhf trains images with {', '.join(vision.SUPPORTED_MODEL_TYPES)} models "
                    "only",
                ),
                (
                    estimator.needs_critic,
                    f"--algo.advantage.estimator {c.algo.advantage.estimator} needs a critic, "
                    "and a critic for a vision-language model is not supported (as in OpenRLHF): use group_norm, rloo, "
                    "reinforce_baseline, reinforce or dr_grpo",
                ),
                (
                    c.ds.packing_samples,
                    "--ds.packing_samples: images go with each sequence, so a vision-language "
                    "run is not packed",
                ),
                (c.ds.lora.rank > 0, "--ds.lora.rank: LoRA on a vision-language model is not supported yet"),
                (
                    c.reward.model_name_or_path,
                    "--reward.model_name_or_path: a reward model would score the text "
                    "without the images; use a reward function (--reward.remote_url file.py) or an agent",
                ),
                (
                    c.train.agent_executor == "openai_server",
                    "--train.agent_executor openai_server sends text messages and cannot carry images",
                ),
            ]
            if failed
        ],
        "this vision-language run cannot start",
    )
    limit = c.data.max_images_per_prompt or "any number of"
    trained = (
        "the language model (the vision encoder is frozen)"
        if c.actor.freeze_visual_encoder
        else "the vision encoder and the language model"
    )
    return [
        f"model: {path}"
        + (f" ({model_type})" if config is not None else " (not a local directory: not read)"),
        (
            f"images: from --data.image_key {c.data.image_key}, {limit} per prompt"
            if c.data.image_key
            else "images: none in the prompts (an agent's environment may return some)"
        ),
        f"trained: {trained}; synced to the {engine} engines: "
        + ("the language model" if c.actor.freeze_visual_encoder else "every weight"),
        "no critic, no packing; log-probs over the text response only",
    ]


def _check_prm_reward(cfg) -> bool:
    """Whether the reward is a process reward model (it then scores in the rollout actors, so no reward-model
    workers start); its settings are checked here, before anything starts."""
    r = cfg.reward
    prm = bool(r.model_name_or_path) and r.source in (None, "prm") and is_prm_model(r.model_name_or_path)
    defaults = RewardConfig()
    if not prm:
        if r.source == "prm":
            raise RunConfigError(
                f"--reward.source prm: --reward.model_name_or_path {r.model_name_or_path} is not a "
                "PRM trained by rlhf train prm (its config.json has no prm_placeholder_token)"
            )
        if (r.prm_aggregation, r.prm_step_separator) != (
            defaults.prm_aggregation,
            defaults.prm_step_separator,
        ):
            raise RunConfigError(
                "--reward.prm_aggregation and --reward.prm_step_separator apply to a process reward "
                "model (--reward.model_name_or_path trained by rlhf train prm) only"
            )
        return False
    _refuse(
        [
            message
            for failed, message in [
                (
                    r.prm_aggregation not in PRM_AGGREGATIONS,
                    f"--reward.prm_aggregation {r.prm_aggregation!r}: "
                    f"choose one of {', '.join(PRM_AGGREGATIONS)}",
                ),
                (
                    r.normalize_enable,
                    "--reward.normalize_enable: a PRM's step scores are probabilities, with no "
                    "stored mean/std to normalise by",
                ),
                (
                    r.offload,
                    "--reward.offload: a PRM scores in the rollout actors, which hold no ZeRO-3 weights to "
                    "offload",
                ),
            ]
            if failed
        ],
        f"--reward.model_name_or_path {r.model_name_or_path} is a PRM",
    )
    return True


def assemble(mode: str, cfg, pm=None, gpus: bool | None = None) -> Assembly:
    """Resolve the plugins a run needs, check its options and plan its placement."""
    pm = pm or plugins.get_plugin_manager()
    gpus = gpus_available() if gpus is None else gpus
    asm = Assembly(mode, cfg)
    _resolve_precision(asm, gpus)
    if cfg.train.max_tokens_per_gpu is None:  # activations follow tokens: a GPU's budget fills a CPU's memory
        cfg.train.max_tokens_per_gpu = 16192 if gpus else 1536
    backend = _use(asm, pm, "train_backends", cfg.train.backend, "--train.backend")
    if mode != "ppo":
        models = [("--model.model_name_or_path", cfg.model.model_name_or_path)]
        if mode in ("dpo", "kto"):
            models.append(("--ref.model_name_or_path", cfg.ref.model_name_or_path))
        if mode == "kd":
            models.append(("--teacher.model_name_or_path", cfg.teacher.model_name_or_path))
        _refuse(
            check_models(models, "--model.model_name_or_path", asm)
            + _check_moe(section=cfg.model, name="model")
        )
        try:
            preflight(mode, cfg)
        except SetupError as exc:
            raise RunConfigError(str(exc)) from None
        ranks = cfg.model.num_nodes * cfg.model.num_gpus_per_node
        asm.roles = {"actor": RoleDemand(ranks)}
        asm.single_process = _single_process(cfg, ranks, backend)
        _resolve_zero_stage(asm, [ranks])
        return asm

    estimator = _use(
        asm, pm, "advantage_estimators", cfg.algo.advantage.estimator, "--algo.advantage.estimator"
    )
    _use(asm, pm, "policy_losses", cfg.actor.policy_loss_type, "--actor.policy_loss_type")
    _use(asm, pm, "kl_estimators", cfg.algo.kl.estimator, "--algo.kl.estimator")
    engine = choose_engine(cfg, pm)
    factory = _use(asm, pm, "rollout_engines", engine, "--rollout.engine")
    reason = factory.available() or getattr(factory, "config_problem", lambda cfg: None)(cfg)
    if reason:
        raise RunConfigError(f"--rollout.engine {engine} cannot run here: {reason}")
    if cfg.train.agent_executor:
        _use(asm, pm, "agent_executors", cfg.train.agent_executor, "--train.agent_executor")
    if cfg.train.env:
        _use(asm, pm, "environments", cfg.train.env, "--train.env")
    models = [
        (f"--{role}.model_name_or_path", getattr(cfg, role).model_name_or_path)
        for role in ("actor", "critic", "ref", "reward")
    ]
    problems = check_models(models, "--actor.model_name_or_path", asm)
    _check_opd(cfg, problems, asm)
    problems += _check_moe(
        section=cfg.actor, name="actor", vllm_lora=cfg.ds.lora if engine == "vllm" else None
    )
    if cfg.actor.router_replay:
        problems += router_replay_problems(cfg, engine)
    from rlhf_agents.plugin import executor_class
    from rlhf_agents.rewards import check_reward_config

    for check in (executor_class, check_reward_config):  # imports the agent and reward files
        try:
            check(cfg, pm)
        except UserError as exc:
            problems.append(str(exc))
    _check_rl_options(cfg, estimator, problems)
    asm.vision = _check_vision(cfg, estimator, engine)
    prm_reward = _check_prm_reward(cfg)
    if cfg.algo.kl.use_loss and cfg.algo.kl.init_coef <= 0:
        asm.notes.append(
            "--algo.kl.use_loss with --algo.kl.init_coef 0: the KL loss term is zero (no reference "
            "model is loaded); set --algo.kl.init_coef > 0 to regularise towards the reference"
        )

    roles = {"actor": RoleDemand(cfg.actor.num_nodes * cfg.actor.num_gpus_per_node)}
    if cfg.algo.kl.init_coef > 0:
        roles["ref"] = RoleDemand(cfg.ref.num_nodes * cfg.ref.num_gpus_per_node)
    if estimator.needs_critic:
        roles["critic"] = RoleDemand(cfg.critic.num_nodes * cfg.critic.num_gpus_per_node)
    if cfg.reward.model_name_or_path and not prm_reward:  # a PRM scores in the rollout actors
        roles["reward"] = RoleDemand(cfg.reward.num_nodes * cfg.reward.num_gpus_per_node)
    roles["rollout"] = RoleDemand(
        cfg.vllm.num_engines, cfg.vllm.tensor_parallel_size if engine == "vllm" else 1
    )
    asm.roles = roles
    hosts_roles = getattr(
        backend, "hosts_roles", False
    )  # the optional part of the training contract (TrainGroup)
    can_single = handles.single_process(cfg, 1, getattr(backend, "single_process", False))
    if (
        not gpus
        and strategy_name(cfg) == "separate"
        and not cfg.train.placement
        and hosts_roles
        and can_single
        and not cfg.rollout.node_resource
        and _fits_one_process(roles, engine, cfg, gpus)
    ):
        cfg.train.colocate_all = True  # on CPU every pool is the same cores: colocating costs nothing
        asm.default_placement = True
    strategy = _use(asm, pm, "placement_strategies", strategy_name(cfg), "--train.placement")
    try:
        asm.plan = strategy.plan(roles, cfg, gpus)
    except ValueError as exc:
        raise RunConfigError(str(exc)) from None
    if cfg.rollout.node_resource:
        pin_rollout_pool(asm.plan, cfg.rollout.node_resource)
    if hosts_roles:
        asm.in_actor = roles_in_actor(asm.plan, engine, cfg)
    processes = sum(g.num_workers for g in asm.plan.groups if g.role not in asm.in_actor)
    asm.single_process = _single_process(cfg, processes, backend)
    _resolve_zero_stage(asm, [r.num_workers for role, r in roles.items() if role != "rollout"])
    if (
        processes > 1
        and strategy_name(cfg) != "colocate_all"
        and hosts_roles
        and can_single
        and _fits_one_process(roles, engine, cfg, gpus)
    ):
        asm.notes.append(
            f"this run starts Ray and {processes} worker processes; with --train.colocate_all it "
            "would fit one process and start no Ray (seconds sooner, hundreds of MB less)"
        )
    return asm


def _fits_one_process(roles: dict[str, RoleDemand], engine: str, cfg, gpus: bool) -> bool:
    """Whether ``--train.colocate_all`` would leave the run one worker process (one rank hosting the rest)."""
    together = plan_pools(roles, [set(ROLE_ORDER)], gpus)
    in_actor = roles_in_actor(together, engine, cfg)
    return sum(g.num_workers for g in together.groups if g.role not in in_actor) == 1


# bf16 keeps 8 significant bits: each rounding is off by up to 2^-9 (relative), and a logit of size ~10 that
# went through a few dozen roundings in a different order on each side differs by ~1e-2 from its twin.
BF16_GAP_NOTE = (
    "--ds.param_dtype bf16: the rollout engine and the trainer both compute in bf16 but in a different order "
    "(token by token with a KV cache, against one forward pass), and bf16 keeps 8 significant bits, so expect "
    "their log-probs of the same token to differ by ~1e-2 (policy/rollout_train_logprob_gap; 0.04 on "
    "SmolLM2-135M, ~1e-5 in fp32): importance ratios are off by about that much per token, and "
    "--algo.advantage.is_correction_enable corrects for it"
)


def _resolve_precision(asm: Assembly, gpus: bool) -> None:
    """Make ``--ds.param_dtype auto`` concrete (bf16 on GPUs, fp32 on CPU) before anything reads it, say why in
    the plan, and note what bf16 does to an RL run's engine-trainer agreement."""
    ds = asm.cfg.ds
    asked = ds.param_dtype
    ds.param_dtype = resolve_param_dtype(asked, gpus)
    where = "GPUs" if gpus else "CPU"
    asm.precision = ds.param_dtype + (
        f" (--ds.param_dtype auto on {where}: bf16 on GPUs, fp32 on CPU)"
        if asked == "auto"
        else " (--ds.param_dtype)"
    )
    if asm.mode == "ppo" and ds.param_dtype == "bf16":
        asm.notes.append(BF16_GAP_NOTE)


def _resolve_zero_stage(asm: Assembly, group_ranks: list[int]) -> None:
    """Make the default ``--ds.zero_stage`` concrete in the driver (:func:`resolve_zero_stage`), and say so."""
    ds = asm.cfg.ds
    asked = ds.zero_stage
    ds.zero_stage = resolve_zero_stage(asked, max(group_ranks, default=1))
    asm.zero = f"{ds.zero_stage}" + (
        " (--ds.zero_stage)"
        if asked is not None
        else " (default: 0 with one rank per training group, else 2)"
    )


def _single_process(cfg, processes: int, backend) -> bool:
    try:
        return handles.single_process(cfg, processes, getattr(backend, "single_process", False))
    except ValueError as exc:
        raise RunConfigError(str(exc)) from None


def pin_rollout_pool(plan: PlacementPlan, resource: str) -> None:
    """``--rollout.node_resource``: every bundle of the engines' pool also asks for one unit of ``resource``,
    so Ray places the pool on the nodes that offer it."""
    (pool_name,) = [g.pool for g in plan.groups if g.role == "rollout"]
    sharing = [g.role for g in plan.groups if g.pool == pool_name and g.role != "rollout"]
    if sharing:
        raise RunConfigError(
            f"--rollout.node_resource {resource} puts the rollout engines on their own nodes, but the placement "
            f"shares their devices with {', '.join(sharing)} (--train.placement / --train.colocate_all)"
        )
    for pool in plan.pools:
        if pool.name == pool_name:
            pool.bundles = [{**b, resource: 1.0} for b in pool.bundles]


def write_run_dir(asm: Assembly, files: dict[Path, str] | None = None) -> Path:
    """Create the run directory with the resolved config, the plugin versions used and ``files`` (path: text)."""
    out = Path(asm.cfg.ckpt.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(
        f"# rlhf train {asm.mode}: resolved configuration\n" + config_to_yaml(asm.cfg, asm.mode)
    )
    meta = {
        "mode": asm.mode,
        "plugins": {s: {"name": n, "from": asm.provenance[s]} for s, n in asm.chosen.items()},
        "pid": os.getpid(),
    }
    func = getattr(getattr(asm.cfg, "reward", None), "func", None)
    if func is not None:  # not in config.yaml: a Python object has no flag
        meta["reward_func"] = (
            f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', type(func).__name__)}"
        )
    (out / "run.json").write_text(json.dumps(meta, indent=2) + "\n")
    for path, text in (files or {}).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return out
