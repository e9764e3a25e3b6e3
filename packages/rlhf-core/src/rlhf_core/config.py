"""Run configuration: one dataclass per section, dotted flags, flat aliases and YAML files.

Every field is documented once, by the string under it; ``rlhf train <mode> --help`` prints those strings.
Flags are the dotted paths of OpenRLHF's current release (``--algo.advantage.estimator``); the flat
spellings of its earlier releases and seed documents (``--advantage_estimator``, ``--pretrain``) are
rewritten to them by :mod:`rlhf_core.config_aliases`. Defaults follow OpenRLHF unless a field says why not.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import Any

RL_MODES = ("ppo",)
SUPERVISED_MODES = ("sft", "rm", "dpo", "kto", "prm", "kd")


def option(
    default=MISSING,
    *,
    default_factory=MISSING,
    modes: tuple[str, ...] | None = None,
    refused: str | None = None,
    noted: str | None = None,
    secret: bool = False,
    requires: str | None = None,
):
    """A field with rules that :func:`rlhf_core.config_parser.parse_config` enforces before anything starts.

    ``modes``: the only modes whose parser accepts it (the code of the others does not read it); ``refused``:
    why a value other than the default cannot run here; ``noted``: why a value other than the default changes
    nothing (a note is printed); ``secret``: shown and saved as ``***`` only, never in a repr; ``requires``: a
    module that a value other than the default needs installed.
    """
    meta = {"modes": modes, "refused": refused, "noted": noted, "secret": secret, "requires": requires}
    return field(default=default, default_factory=default_factory, repr=not secret, metadata=meta)


def view(section: type, fields: str, docs: dict[str, str] | None = None, **defaults: Any):
    """A shared section as the commands of one root config read it: ``fields`` are accepted, in this order
    (``--help`` and the saved config follow it), whatever their ``option(modes=...)``, and setting another is
    refused; ``defaults`` and ``docs`` (by field name) are the root's own where the shared ones do not fit."""
    meta = {"fields": fields.split(), "docs": docs or {}}
    return field(default_factory=lambda: section(**defaults), metadata=meta)


def resolve_param_dtype(name: str, cuda: bool | None = None) -> str:
    """``--ds.param_dtype`` made concrete: ``auto`` is ``bf16`` with a CUDA device and ``fp32`` without one;
    any other name is returned as given. ``cuda``: whether the models run on a GPU (default: whether this
    process has one). On CPU, fp32 keeps engine and trainer log-probs within ~1e-5 per token (bf16: ~1e-2)
    and is faster without AMX or AVX-512 bf16 (bench/grpo_vs_trl.md)."""
    if name != "auto":
        return name
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    return "bf16" if cuda else "fp32"


def resolve_zero_stage(stage: int | None, ranks: int) -> int:
    """``--ds.zero_stage`` made concrete for training groups of at most ``ranks`` ranks: the stage asked for,
    else 0 with one rank (alone, ZeRO only adds a flat copy of the weights), else 2 (OpenRLHF's default)."""
    if stage is not None:
        return stage
    return 0 if ranks <= 1 else 2


# --- shared pieces ---------------------------------------------------------------------------------------


@dataclass
class AdamConfig:
    lr: float = 1e-6
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam beta1 and beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""


MUON_REFUSED = "the Muon optimizer is not implemented: the deepspeed backend trains with AdamW (--*.adam.*)"


@dataclass
class MuonConfig:
    """Accepted for OpenRLHF compatibility; any value other than the default is refused."""

    lr: float = option(0.02, refused=MUON_REFUSED)
    """Muon learning rate."""
    momentum: float = option(0.95, refused=MUON_REFUSED)
    """Muon momentum."""
    ns_steps: int = option(5, refused=MUON_REFUSED)
    """Newton-Schulz iterations."""
    nesterov: bool = option(True, refused=MUON_REFUSED)
    """Use Nesterov momentum."""


@dataclass
class OptimizerFields:
    """Optimizer and schedule settings shared by every trained model (actor, critic, model)."""

    optim: str = option("adam", refused="only AdamW (adam) is implemented")
    """Optimizer: ``adam`` (AdamW), the only one implemented."""
    adam: AdamConfig = field(default_factory=AdamConfig)
    muon: MuonConfig = field(default_factory=MuonConfig)
    lr_scheduler: str = "cosine_with_min_lr"
    """Learning-rate schedule after warm-up: ``cosine_with_min_lr``, ``linear``, ``constant``."""
    lr_warmup_ratio: float = 0.03
    """Fraction of the optimizer steps spent warming the learning rate up linearly from 0."""
    min_lr_ratio: float = 0.1
    """Floor of the cosine schedule, as a fraction of the peak learning rate."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""


# --- models ----------------------------------------------------------------------------------------------


@dataclass
class ActorConfig(OptimizerFields):
    model_name_or_path: str | None = None
    """The policy: a local HF model directory (or hub id where the hub is reachable)."""
    num_nodes: int = 1
    """Nodes for the policy's training ranks."""
    num_gpus_per_node: int = 1
    """Training ranks per node (on a machine without GPUs: CPU ranks)."""
    gradient_checkpointing_enable: bool = False
    """Recompute activations in the backward pass to save memory."""
    gradient_checkpointing_reentrant: bool = False
    """Use the reentrant checkpointing implementation."""
    eps_clip: float = 0.2
    """PPO clip range: the ratio is clipped to [1 - eps, 1 + eps]."""
    eps_clip_low_high: tuple[float, float] | None = None
    """Asymmetric clip (clip-higher): [1 - low, 1 + high]; overrides ``eps_clip``."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens; None disables it."""
    policy_loss_type: str = "ppo"
    """Registered policy loss: ``ppo`` or ``gspo`` (or a plugin's)."""
    loss_agg_mode: str | None = None
    """How token losses become one number: ``token_mean`` (over the whole optimizer step, across
    gradient accumulation and data-parallel ranks), ``seq_mean_token_mean``, ``seq_mean_token_sum_norm``
    (Dr. GRPO). Default: the policy loss's own (``ppo``: token_mean, ``gspo``: seq_mean_token_mean).
    OpenRLHF has no such flag."""
    aux_loss_coef: float = 0.0
    """Mixture-of-experts models: weight of the router load-balancing loss, the model family's own
    (transformers' ``load_balancing_loss_func``); logged as ``aux_loss``. A dense model refuses it."""
    freeze_moe_router: bool = False
    """Mixture-of-experts models: keep the router (gate) weights frozen; the experts still train."""
    router_replay: bool = False
    """Mixture-of-experts models: the HF rollout engine records each token's experts and the policy's
    log-prob and training forwards use them instead of their own top-k (R3); see docs/moe.md."""
    entropy_coef: float = 0.0
    """Entropy bonus weight; 0 only logs the entropy."""
    freeze_visual_encoder: bool = False
    """Vision-language models: train the language model only; the vision tower keeps its weights (and is not
    sent to the engines, which already have them)."""


@dataclass
class CriticConfig(OptimizerFields):
    model_name_or_path: str | None = None
    """The critic's initial weights (default: the reward model, else the actor)."""
    num_nodes: int = 1
    """Nodes for the critic's training ranks."""
    num_gpus_per_node: int = 1
    """Critic training ranks per node."""
    gradient_checkpointing_enable: bool = False
    """Recompute activations in the backward pass."""
    value_clip: float = 0.5
    """Value-loss clip range around the old values."""
    freezing_steps: int = -1
    """Critic warm-up: train only the critic for this many steps; -1 disables it."""
    save_value_network: bool = False
    """Also export the critic at the end."""
    adam: AdamConfig = field(default_factory=lambda: AdamConfig(lr=9e-6))


@dataclass
class RefConfig:
    model_name_or_path: str | None = None
    """The frozen reference model (default: the actor's initial weights); the teacher of
    ``--algo.advantage.estimator opd``."""
    num_nodes: int = option(1, modes=RL_MODES)
    """Nodes for the reference model (DPO/KTO run it on the trained model's ranks)."""
    num_gpus_per_node: int = option(1, modes=RL_MODES)
    """Reference ranks per node."""
    offload: bool = False
    """Keep the reference weights in CPU memory between uses."""


@dataclass
class RewardConfig:
    model_name_or_path: str | None = None
    """A reward model (value head ``score``) served from Ray workers."""
    remote_url: str | None = None
    """A Python reward file (``reward.py`` exporting ``reward_func``) or HTTP reward server URL(s),
    comma-separated."""
    source: str | None = None
    """Pick a registered reward source by name instead of inferring it from the fields above."""
    func: Any = field(default=None, repr=False, metadata={"python_only": True})
    """The Python API's ``reward_func=``: a function called as a reward file's ``reward_func`` is (sync or
    async); no flag, and not in the saved config."""
    # rlhf generate: each generation worker loads its own reward model
    num_nodes: int = option(1, modes=RL_MODES)
    """Nodes for the reward model."""
    num_gpus_per_node: int = option(1, modes=RL_MODES)
    """Reward-model ranks per node."""
    offload: bool = option(False, modes=RL_MODES)
    """Keep the reward-model weights in CPU memory between uses."""
    normalize_enable: bool = False
    """Normalise reward-model outputs with the mean/std stored at RM training time."""
    # RL shaping of the rewards: rlhf generate writes the reward sources' raw rewards
    clip_range: tuple[float, float] = option((-10.0, 10.0), modes=RL_MODES)
    """Clamp each sequence reward into this range."""
    overlong_buffer_len: int | None = option(None, modes=RL_MODES)
    """DAPO overlong penalty: the last this-many tokens before ``max_new_tokens`` are penalised."""
    overlong_penalty_factor: float = option(1.0, modes=RL_MODES)
    """DAPO overlong penalty at the full buffer."""
    stop_properly_penalty_coef: float | None = option(None, modes=RL_MODES)
    """Samples cut at ``max_new_tokens``: reward *= coef when coef >= 0, reward = coef when negative."""
    timeout: float = 180.0
    """Seconds one HTTP reward request (or one call of a reward function) may take."""
    max_retries: int = 5
    """Attempts per HTTP reward request (4xx answers are not retried)."""
    max_concurrency: int = 32
    """Concurrent HTTP requests to the reward servers."""
    max_failure_fraction: float = option(0.1, modes=RL_MODES)
    """Stop the run when more than this fraction of a step's samples cannot be scored."""
    weights: list[float] | None = None
    """Weights of several reward sources (comma-separated ``remote_url``s), one each."""
    request_batch_size: int = 64
    """Most samples per HTTP reward request; a step's batch is split over the URLs in requests this big."""
    prm_step_separator: str = "\\n"
    """A process reward model (``--reward.model_name_or_path`` trained by ``rlhf train prm``) splits each
    response into steps at this string and scores each step; escapes such as ``\\n`` are decoded."""
    prm_aggregation: str = "min"
    """How a PRM's step scores become the sample's reward: ``min``, ``last``, ``mean`` or ``prod``."""


# --- rollout -----------------------------------------------------------------------------------------------


@dataclass
class RolloutConfig:
    engine: str = "auto"
    """Rollout engine: ``hf`` (built in), ``vllm``, or ``auto`` (vllm when importable with a GPU, else hf)."""
    batch_size: int = 1024
    """Prompts per RL step (each sampled ``n_samples_per_prompt`` times)."""
    micro_batch_size: int = 8
    """Sequences per forward pass when computing log-probs, values and rewards."""
    vllm_generate_batch_size: int | None = None
    """Prompts per generation round (default: ``batch_size``). Above ``batch_size`` (async only), a round
    generates for several steps ahead and the steps after it take the waiting groups (over-generation)."""
    n_samples_per_prompt: int = 1
    """Samples per prompt; group estimators need 2 or more."""
    max_new_tokens: int = 1024
    """Most tokens generated per sample (per turn for agents)."""
    min_new_tokens: int = 0
    """EOS and stop ids are suppressed until a sample has this many tokens (benchmarks fix lengths with it)."""
    temperature: float = 1.0
    """Sampling temperature (the trainer's log-probs use the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Top-k sampling; 0 disables it."""
    repetition_penalty: float = option(1.0, modes=("generate",))
    """Must stay 1.0: the rollout engines sample without a repetition penalty (other values are refused)."""
    max_tokens_per_gpu: int | None = None
    """Token budget per forward pass when computing log-probs and values with ``--train.dynamic_batch_enable``
    (default: ``--train.max_tokens_per_gpu``)."""
    node_resource: str | None = None
    """Put the rollout engines on Ray nodes that offer this custom resource (inference nodes started with
    ``ray start --resources '{"NAME": N}'``): each bundle of the engines' pool (one per engine on CPU, one
    per GPU) takes one unit. Not with a placement that shares the engines' devices with training."""
    max_engine_restarts: int | None = option(None, modes=RL_MODES)
    """Rollout engines that may die during generation in one run and be replaced: a new engine process on
    the dead one's placement gets the current policy weights and generates the dead engine's prompts again
    with the same seeds (metric ``rollout/engine_restarts``). One more death stops the run naming the engine
    and the cause; 0 stops at the first. Default: 3 with the sync pipeline; 0 with ``--train.async_enable``,
    where more keeps a copy of the weights the engines hold in Ray's object store at every sync (the
    trainers have moved on when an engine dies), and ``--train.partial_rollout_enable`` refuses more.
    Engines hosted in the policy's ranks die with their rank, which stops the run."""


@dataclass
class VllmConfig:
    num_engines: int = 1
    """Rollout engines (vLLM or HF)."""
    tensor_parallel_size: int = 1
    """GPUs per vLLM engine."""
    sync_backend: str = "nccl"
    """Weight-sync backend: ``nccl`` (GPU) or ``gloo`` (CPU); CPU runs use gloo whatever this says."""
    sync_with_ray: bool = False
    """Send weights through Ray's object store instead of a collective group."""
    enable_prefix_caching: bool = False
    """vLLM automatic prefix caching (worth it with n > 1)."""
    enforce_eager: bool = False
    """Disable CUDA graphs in vLLM (on vLLM's CPU build: its torch.compile of the model, minutes at start-up)."""
    enable_sleep: bool = False
    """Let engines release memory between rollouts (needs ``--train.colocate_all``; GPU only, refused on CPU)."""
    gpu_memory_utilization: float = 0.95
    """Fraction of GPU memory vLLM may take (on CPU: of host memory the engines' KV caches may take)."""
    sync_timeout: float = 600.0
    """Seconds a weight sync may take before it raises instead of hanging."""


# --- training loop ---------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    backend: str = "deepspeed"
    """Registered training backend."""
    batch_size: int = 128
    """Sequences per optimizer step (global, across data-parallel ranks)."""
    micro_batch_size: int = 1
    """Sequences per forward/backward on each rank."""
    max_epochs: int = 1
    """Passes over each rollout batch (RL) or over the dataset (SFT/RM/DPO/KTO/PRM/KD)."""
    num_episodes: int = 1
    """Passes over the prompt dataset (RL)."""
    max_steps: int = -1
    """Stop after this many steps (-1: run the episodes/epochs out)."""
    seed: int = 42
    """Seed of data order, initialisation and rollout sampling."""
    full_determinism_enable: bool = False
    """Deterministic algorithms everywhere (slower)."""
    colocate_all: bool = False
    """Hybrid engine: every model and the rollout engines share the same devices."""
    colocate_actor_ref: bool = False
    """Actor and reference model share devices."""
    colocate_critic_reward: bool = False
    """Critic and reward model share devices."""
    placement: str | None = None
    """Pick a registered placement strategy by name (overrides the colocate flags)."""
    async_enable: bool = False
    """Rollout and training run concurrently through a bounded queue."""
    async_queue_size: int = 1
    """Rollout batches generated ahead of training in async mode (at least 1): batch k is generated by the
    weights after step k - 1 - N, so its samples are N policy versions old when trained."""
    max_staleness: int | None = None
    """Async only: a prompt group generated by policy version v is trained at version u only if u - v <= this;
    older groups (over-generation leftovers) are dropped and their prompts generated again. At least
    ``--train.async_queue_size``; default: no limit."""
    partial_rollout_enable: bool = False
    """Async only: keep generating during weight sync (samples may mix two policy versions; runs are then not
    reproducible bit for bit, nor resumed exactly)."""
    agent_func_path: str | None = None
    """A Python file exporting ``AgentExecutor`` (multi-turn agents)."""
    agent_executor: str | None = None
    """A registered agent executor by name (default: ``single_turn``, or the agent file's)."""
    env: str | None = None
    """A registered multi-turn environment by name (driven by the ``multi_turn`` executor)."""
    agent_command: str | None = None
    """A program run once per episode as the agent, in any language (split into argv like a shell line, but
    run without a shell): it gets the episode's OpenAI-compatible endpoint in ``OPENAI_BASE_URL`` and the
    prompt row as JSON on stdin, and prints its reward as the last line of stdout (a number, or a JSON
    object with ``reward``). Bounded by ``--train.env_step_timeout``."""
    per_call_samples: str = "auto"
    """OpenAI-endpoint agents (``--train.agent_command`` or an ``OpenAIServerAgentExecutor``): ``auto`` trains
    an episode whose model calls do not extend one another (a chat template that drops earlier reasoning)
    as one sample per call, all sharing its reward; ``always`` does that for every episode; ``never`` makes
    such an episode unscorable."""
    tool_parser: str | None = None
    """How OpenAI-endpoint agents' replies are read for tool calls: a registered parser (``hermes``,
    ``llama3_json``, ``mistral``, ``deepseek_v3``, ``qwen3_coder``, ``glm45``, ``harmony``); default: the one
    the chat template's format names."""
    env_step_timeout: float = 300.0
    """Seconds an environment step (or a whole OpenAI-endpoint agent episode) may take before it is ended
    and counted."""
    episode_timeout: float = 1800.0
    """Seconds one episode's agent code (an ``--train.agent_func_path`` executor's ``execute``, its
    environment's calls, a closing ``close``) may run, not counting the time it waits for the rollout engine;
    past it the episode is ended, unscorable, and counted in ``error/episode_timeout``; 0: no limit."""
    check_retokenization: bool = False
    """Debug: re-tokenize each finished sample's text and report drift from its token ids (metric
    ``tokenize/drift_samples`` and one warning)."""
    dynamic_batch_enable: bool = False
    """Form micro-batches by token budget instead of sequence count: the training steps' (see
    ``max_tokens_per_gpu``) and the log-prob / value passes' (``--rollout.max_tokens_per_gpu``); every rank
    still runs the same number of micro-batches. Without it, an RL step whose micro-batches of
    ``micro_batch_size`` rows would pass the budget is cut by the budget all the same."""
    max_tokens_per_gpu: int | None = None
    """Token budget per rank and RL micro-batch, counted as the forward runs them: the sum of the sequence
    lengths with ``--ds.packing_samples`` or ``--ds.shared_prefix`` (a shared prompt once for its rows), rows
    x the longest row when padded. A longer sequence gets a micro-batch of its own (never truncated). With
    ``--ds.ring_attn_size R`` a micro-batch holds up to R budgets, since each rank of the ring runs 1/R of it.
    Default: 16192 on GPUs; 1536 on CPU, where a training token's activations take process memory (~1.9 MB
    on SmolLM2-135M in fp32, docs/long-responses.md)."""
    enable_ema: bool = False
    """Keep an exponential moving average of the policy weights (fp32, updated after every applied optimizer
    step) and export it as ``<output_dir>/model`` and ``best_model``; the rollout engines keep getting the
    trained weights."""
    ema_beta: float = 0.992
    """EMA decay: ``ema = beta * ema + (1 - beta) * weights``, in [0, 1)."""
    max_nonfinite_steps: int = 3
    """Stop after this many consecutive steps with a non-finite loss (each is skipped on all ranks)."""


@dataclass
class AdvantageConfig:
    estimator: str = "gae"
    """Registered advantage estimator: ``gae``, ``reinforce``, ``reinforce_baseline``, ``rloo``,
    ``group_norm``, ``dr_grpo``, ``opd`` (on-policy distillation from ``--ref.model_name_or_path``)."""
    gamma: float = 1.0
    """Discount factor."""
    lambd: float = 1.0
    """GAE lambda."""
    no_std_norm: bool = False
    """Do not divide advantages by their standard deviation."""
    is_correction_enable: bool = False
    """Correct for the rollout/train log-prob mismatch with importance weights."""
    is_correction_threshold: tuple[float, float] = (0.5, 5.0)
    """Low and high bounds of the importance weight."""
    is_correction_type: str = "tis"
    """``tis`` (truncate), ``icepop`` (mask outside the bounds) or ``seq-mask-tis``."""


@dataclass
class KLConfig:
    init_coef: float = 0.01
    """KL coefficient (0: no reference model is loaded)."""
    target: float | None = None
    """Adaptive controller: the KL to steer towards; None keeps the coefficient fixed."""
    horizon: int = 10000
    """Adaptive controller horizon in samples."""
    use_loss: bool = False
    """Add KL as a loss term instead of folding it into the reward."""
    estimator: str = "k1"
    """Registered KL estimator: ``k1``, ``k2``, ``k3``."""


@dataclass
class OPDConfig:
    task_reward_coef: float = 0.0
    """``--algo.advantage.estimator opd``: weight of the task reward's group-normalised advantage added to
    the teacher's per-token signal; 0 distils only, and needs no reward source."""
    teachers: list[str] | None = None
    """Multi-teacher OPD: ``NAME=PATH`` per teacher (instead of ``--ref.model_name_or_path``); the
    reference group loads them all and scores each sample with the teacher its prompt names in the
    ``--algo.opd.teacher_key`` column."""
    teacher_key: str = ""
    """The prompt dataset's column naming each prompt's teacher (a NAME of ``--algo.opd.teachers``)."""


def opd_teachers(cfg: Any) -> dict[str, str]:
    """``--algo.opd.teachers`` as ``{name: path}``, in the order given (the first is the reference group's own
    model); empty without the flag. A ``ValueError`` naming the flag for an item that is not ``NAME=PATH``
    or a name given twice."""
    algo = getattr(cfg, "algo", None)
    out: dict[str, str] = {}
    for item in (algo.opd.teachers if algo is not None else None) or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--algo.opd.teachers {item!r}: give each teacher as NAME=PATH")
        if name in out:
            raise ValueError(f"--algo.opd.teachers: the name {name!r} is given twice")
        out[name] = path
    return out


def distills_only(cfg: Any) -> bool:
    """Whether an RL run is on-policy distillation with no task reward (``--algo.advantage.estimator opd`` and
    ``--algo.opd.task_reward_coef 0``): it needs no reward source, and its samples get reward 0."""
    algo = getattr(cfg, "algo", None)
    return algo is not None and algo.advantage.estimator == "opd" and not algo.opd.task_reward_coef


@dataclass
class AlgoConfig:
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    opd: OPDConfig = field(default_factory=OPDConfig)
    dynamic_filtering_enable: bool = False
    """Keep a prompt group only when its mean score lies strictly inside ``dynamic_filtering_range``;
    filtered groups are replaced by new prompts."""
    dynamic_filtering_range: tuple[float, float] = (0.0, 1.0)
    """Open interval of kept group mean scores."""


# --- engine and data -------------------------------------------------------------------------------------


@dataclass
class LoraConfig:
    rank: int = 0
    """LoRA rank; 0 trains all weights."""
    alpha: int = 16
    """LoRA alpha."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Modules that get adapters."""
    dropout: float = 0.0
    """LoRA dropout."""


@dataclass
class DSConfig:
    zero_stage: int | None = None
    """DeepSpeed ZeRO stage 0-3. Default: 0 when every training group has one rank (ZeRO partitions state
    across ranks; with one rank it only adds a copy of the weights and time to each step), else 2 (OpenRLHF's)."""
    param_dtype: str = "auto"
    """Precision of every model of the run (policy, rollout engine, reference, critic, reward): ``bf16``,
    ``fp32`` (``fp16`` is refused), or ``auto``: ``bf16`` on a GPU, ``fp32`` on CPU, where bf16 steps are
    slower and its rounding puts ~1e-2 per token between the engine's and the trainer's log-probs."""
    zpg: int = 1
    """ZeRO++ hierarchical partition group size."""
    adam_offload: bool = False
    """Keep optimizer states in CPU memory (DeepSpeed CPU Adam)."""
    overlap_comm: bool = False
    """Overlap gradient reduction with the backward pass."""
    grad_accum_dtype: str | None = None
    """Gradient accumulation dtype (default: the parameter dtype)."""
    deepcompile: bool = option(False, refused="DeepSpeed deepcompile is not wired into rlhf-train-deepspeed")
    """DeepSpeed deepcompile (OpenRLHF's; refused here)."""
    tensor_parallel_size: int = option(
        1,
        refused=(
            "DeepSpeed AutoTP is not wired into rlhf-train-deepspeed; shard with ZeRO-3 (--ds.zero_stage 3)"
        ),
    )
    """DeepSpeed AutoTP degree (OpenRLHF's; any value but 1 is refused here)."""
    ring_attn_size: int = 1
    """Ranks per ring-attention group: each packed micro-batch is split over them (needs packing; on CUDA
    also ring-flash-attn and flash-attn; on CPU an exact all-gather attention is used)."""
    ring_attn_head_stride: int = 1
    """Heads per ring-attention step."""
    packing_samples: bool = False
    """Pack sequences without padding (flash-attn varlen on GPU; an equivalent path on CPU)."""
    enable_sleep: bool = option(False, modes=RL_MODES)
    """Offload the trainers' state while they wait for the rollout engines (hybrid engine; in async mode,
    while they wait for the next batch)."""
    attn_implementation: str = "sdpa"
    """HF attention implementation: ``eager``, ``sdpa``, ``flash_attention_2``."""
    shared_prefix: bool = True
    """Run a prompt shared by several sequences of a micro-batch (the samples of one prompt, DPO's chosen and
    rejected) through the policy, reference and critic once, and the micro-batch's responses packed without
    padding (docs/long-responses.md); exact. Applies with ``sdpa``, without packing or ring
    attention, on Llama, Mistral, Qwen2/3 and their MoE variants without sliding windows."""
    experts_implementation: str | None = None
    """MoE experts implementation of the trained and reference models, passed to transformers
    (``eager``, ``grouped_mm``, ``batched_mm``; default: transformers' choice)."""
    use_liger_kernel: bool = option(False, refused="Liger kernels are not wired into rlhf-train-deepspeed")
    """Liger fused kernels (OpenRLHF's; refused here)."""
    load_in_4bit: bool = False
    """QLoRA: load the base model in 4 bits (bitsandbytes, GPU)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    value_head_prefix: str = option("score", modes=("ppo", "rm"))
    """Name of the value head of critic and reward models."""
    use_universal_ckpt: bool = option(
        False,
        refused=(
            "DeepSpeed universal checkpoints are not written by rlhf-train-deepspeed; its checkpoints resume at "
            "the world size that saved them"
        ),
    )
    """Save DeepSpeed universal checkpoints (OpenRLHF's; refused here)."""


@dataclass
class DataConfig:
    prompt_dataset: list[str] | None = option(None, modes=RL_MODES)
    """RL prompt datasets: json/jsonl/parquet/csv/arrow files, local dataset directories, or Hugging Face hub
    dataset names (``name`` or ``name@data_dir``, loaded with ``datasets.load_dataset``)."""
    prompt_probs: list[float] | None = option(None, modes=RL_MODES)
    """Mixing probabilities of the prompt datasets."""
    prompt_split: str = option("train", modes=RL_MODES)
    """Split of the prompt datasets."""
    dataset: list[str] | None = option(None, modes=SUPERVISED_MODES)
    """SFT/RM/DPO/KTO/PRM/KD datasets: data files, local dataset directories or hub dataset names
    (``name@data_dir``)."""
    dataset_probs: list[float] | None = option(None, modes=SUPERVISED_MODES)
    """Mixing probabilities of ``dataset``."""
    dataset_split: str = option("train", modes=SUPERVISED_MODES)
    """Split of ``dataset``."""
    input_key: str = "input"
    """Column holding the prompt (or the conversation, with ``apply_chat_template``)."""
    output_key: str | None = option(None, modes=("sft", "kto", "prm", "kd"))
    """SFT/KD: column holding the response (KTO: the completion; PRM refuses it)."""
    label_key: str | None = option(None, modes=(*RL_MODES, "prm"))
    """RL: column passed to reward functions as the label. PRM: column of the per-step labels (default
    ``label``)."""
    prompt_key: str | None = option(None, modes=("rm", "dpo"))
    """RM/DPO: column holding the shared prompt of chosen and rejected."""
    chosen_key: str = option("chosen", modes=("rm", "dpo"))
    """RM/DPO: column of the preferred response."""
    rejected_key: str = option("rejected", modes=("rm", "dpo"))
    """RM/DPO: column of the other response."""
    label_kto_key: str = option("label", modes=("kto",))
    """KTO: column holding whether the completion is desirable (bool)."""
    input_template: str | None = None
    """Format string with ``{}`` for the prompt, used when no chat template is applied."""
    apply_chat_template: bool = False
    """Format prompts with the tokenizer's chat template."""
    tokenizer_chat_template: str | None = None
    """Replace the tokenizer's chat template (a Jinja template string) wherever prompts are rendered."""
    multiturn: bool = option(False, modes=("sft", "kd", "prm"))
    """SFT: the input is a conversation; train on every assistant turn."""
    max_len: int = 2048
    """Most tokens per sequence (prompt + response) in training."""
    prompt_max_len: int | None = option(None, modes=RL_MODES)
    """Most prompt tokens (default: ``max_len - rollout.max_new_tokens``)."""
    overlong_prompt_policy: str = "error"
    """A prompt longer than its budget: ``error`` (names file and row), ``skip`` (counted) or
    ``truncate_left`` (counted)."""
    skip_bad_rows: bool = False
    """Skip and count rows with a missing or mistyped key instead of failing on the first."""
    max_samples: int = 100_000_000
    """Use at most this many rows."""
    image_key: str | None = option(None, modes=RL_MODES)
    """Vision-language models: the column holding each prompt's images (a path, ``file://`` URL, data URI or
    bytes, or a list of them; see ``rlhf_core.vision``)."""
    max_images_per_prompt: int = option(0, modes=RL_MODES)
    """Vision-language models: most images in a prompt, and in a multi-turn episode with the images its
    environment returns (those past it are dropped); 0: no limit. A row over it is a data error."""
    disable_fast_tokenizer: bool = option(
        False,
        noted=(
            "transformers 5 has one tokenizer implementation and ignores use_fast (OpenRLHF passes it on unread too)"
        ),
    )
    """OpenRLHF's switch to the slow tokenizer; changes nothing with transformers 5."""
    dataloader_num_workers: int = option(
        0,
        refused=(
            "rlhf has no DataLoader worker processes: the driver reads and tokenizes the whole dataset once, "
            "before training starts"
        ),
    )
    """OpenRLHF's DataLoader worker processes (refused unless 0: rlhf tokenizes the data once, in the driver)."""


@dataclass
class EvalConfig:
    dataset: list[str] | None = None
    """Evaluation datasets (prompts with labels in RL)."""
    split: str = "train"
    """Split of the evaluation datasets."""
    steps: int = -1
    """Evaluate every this many steps (-1: only at the end, when a dataset is given)."""
    temperature: float = option(0.6, modes=RL_MODES)
    """RL evaluation sampling temperature."""
    n_samples_per_prompt: int = option(4, modes=RL_MODES)
    """RL evaluation samples per prompt (pass@k)."""
    max_samples: int = 100_000_000
    """Evaluate at most this many rows."""


@dataclass
class CkptConfig:
    output_dir: str = "./runs/rlhf"
    """The run directory: resolved config, metrics, TensorBoard events, checkpoints, final model."""
    path: str | None = None
    """Checkpoint directory (default: ``<output_dir>/checkpoints``)."""
    save_steps: int = -1
    """Save a resumable checkpoint every this many steps (-1: never)."""
    save_hf: bool = False
    """Also export HF safetensors with each checkpoint."""
    disable_ds: bool = False
    """Skip the resumable DeepSpeed state (HF export only)."""
    max_num: int = 3
    """Keep at most this many checkpoints (the newest is always complete before older ones go)."""
    max_mem: int = 1000
    """Keep the checkpoints under this many GB."""
    load_enable: bool = False
    """Resume from the latest complete checkpoint."""
    best_metric_key: str = option("", modes=RL_MODES)
    """Track the best checkpoint by this eval metric (default: the first ``eval_*_pass1``)."""


@dataclass
class WandbConfig:
    key: str | None = option(None, secret=True, requires="wandb")
    """W&B API key; setting it turns W&B logging on. Never printed or saved (``***``)."""
    org: str | None = None
    """W&B entity."""
    group: str | None = None
    """W&B group."""
    project: str = "rlhf"
    """W&B project."""
    run_name: str | None = None
    """W&B run name."""


@dataclass
class LoggerConfig:
    logging_steps: int = 1
    """Log every this many steps."""
    tensorboard_dir: str | None = None
    """TensorBoard directory (default: ``<output_dir>/tensorboard``)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class RayConfig:
    address: str | None = None
    """Join this Ray cluster (default: ``$RAY_ADDRESS``, else start a local one)."""
    dashboard: bool = False
    """Start the dashboard of a local cluster (bound to 127.0.0.1)."""
    single_process: str = option("auto", modes=(*RL_MODES, *SUPERVISED_MODES))
    """Run a job that fits one process (one training rank hosting its reference model and HF engine) in the
    driver's process without starting Ray: ``auto`` (when it fits and no cluster or dashboard is asked for),
    ``true`` (refuse the run when it does not fit), ``false`` (always Ray)."""


# --- supervised models -------------------------------------------------------------------------------------


@dataclass
class ModelConfig(OptimizerFields):
    """The trained model of ``rlhf train sft|rm|dpo|kto``."""

    model_name_or_path: str | None = None
    """The model to train: a local HF model directory."""
    num_nodes: int = 1
    """Nodes for the training ranks."""
    num_gpus_per_node: int = 1
    """Training ranks per node (on a machine without GPUs: CPU ranks)."""
    gradient_checkpointing_enable: bool = False
    """Recompute activations in the backward pass."""
    gradient_checkpointing_reentrant: bool = False
    """Use the reentrant checkpointing implementation."""
    aux_loss_coef: float = 0.0
    """Mixture-of-experts models: weight of the router load-balancing loss, the model family's own
    (transformers' ``load_balancing_loss_func``); logged as ``aux_loss``. A dense model refuses it."""
    freeze_moe_router: bool = False
    """Mixture-of-experts models: keep the router (gate) weights frozen; the experts still train."""
    pretrain_mode_enable: bool = option(False, modes=("sft", "kd"))
    """SFT: train on the whole text, not just the response."""
    compute_fp32_loss_enable: bool = option(
        False, modes=("rm",), noted=("rlhf always computes the reward-model loss in fp32")
    )
    """RM: compute the loss in fp32 (always the case here)."""
    margin_loss_enable: bool = option(False, modes=("rm",))
    """RM: subtract the dataset's ``margin`` column inside the sigmoid loss."""
    loss_type: str = option("sigmoid", modes=("rm",))
    """RM loss: ``sigmoid`` or ``logexp``."""
    beta: float = option(0.1, modes=("dpo", "kto"))
    """DPO/KTO temperature."""
    ipo_enable: bool = option(False, modes=("dpo",))
    """DPO: use the IPO loss."""
    label_smoothing: float = option(0.0, modes=("dpo",))
    """cDPO label smoothing."""
    nll_loss_coef: float = option(0.0, modes=("dpo",))
    """DPO: weight of an NLL term on the chosen responses."""
    desirable_weight: float = option(1.0, modes=("kto",))
    """KTO: weight of desirable examples."""
    undesirable_weight: float = option(1.0, modes=("kto",))
    """KTO: weight of undesirable examples."""
    adam: AdamConfig = field(default_factory=lambda: AdamConfig(lr=5e-6))


# --- roots ---------------------------------------------------------------------------------------------


@dataclass
class RLConfig:
    """``rlhf train ppo``: every PPO-family algorithm (the estimator picks which)."""

    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    ds: DSConfig = field(default_factory=DSConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    ray: RayConfig = field(default_factory=RayConfig)


@dataclass
class SupervisedConfig:
    """``rlhf train sft`` and ``rlhf train rm``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = view(
        TrainConfig,
        "backend batch_size micro_batch_size max_epochs max_steps seed full_determinism_enable max_nonfinite_steps",
    )
    ds: DSConfig = field(default_factory=DSConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    ray: RayConfig = field(default_factory=RayConfig)


@dataclass
class PreferenceConfig(SupervisedConfig):
    """``rlhf train dpo`` and ``rlhf train kto``: a trained model and a frozen reference."""

    ref: RefConfig = field(default_factory=RefConfig)


@dataclass
class PRMFields:
    placeholder_token: str | None = None
    """The step marker the dataset puts after every step (e.g. ``ки``); it must be one token. The loss sits
    on the model's prediction of the token after each marker."""
    reward_tokens: list[str] | None = None
    """The tokens a step label may be, each one token, positive first (e.g. ``+ -``): the loss compares
    only these. Soft (float) labels need exactly two. None: hard labels over the whole vocabulary."""


@dataclass
class PRMConfig(SupervisedConfig):
    """``rlhf train prm``: a process reward model, a causal LM that emits a reward token after each step."""

    prm: PRMFields = field(default_factory=PRMFields)


@dataclass
class TeacherConfig:
    model_name_or_path: str | None = None
    """The frozen teacher; it must share the student's tokenizer (logits are compared word by word)."""
    offload: bool = False
    """Keep the teacher's weights in CPU memory between uses (ZeRO-3 offload)."""
    kd_coef: float = 0.4
    """Weight of the distillation term: ``loss = (1 - kd_coef) * NLL + kd_coef * distil``."""


@dataclass
class KDConfig(SupervisedConfig):
    """``rlhf train kd``: knowledge distillation from a teacher into ``--model.model_name_or_path``."""

    teacher: TeacherConfig = field(default_factory=TeacherConfig)


MODES: dict[str, type] = {
    "ppo": RLConfig,
    "sft": SupervisedConfig,
    "rm": SupervisedConfig,
    "dpo": PreferenceConfig,
    "kto": PreferenceConfig,
    "prm": PRMConfig,
    "kd": KDConfig,
}


# --- rlhf generate and rlhf chat ------------------------------------------------------------------------
# They read the sections of ``rlhf train ppo`` (a :func:`view` of each: the fields they honour, in their own
# words), so that the rollout-engine and reward-source plugins get the same section objects as in RL.


@dataclass
class PolicyConfig:
    model_name_or_path: str | None = None
    """The policy: a local HF model directory (``--pretrain``)."""


@dataclass
class GenerateTaskConfig:
    task: str = "generate"
    """``generate``: sample responses to the prompts of ``--data.dataset`` with the policy (scored when a
    reward source is given); ``generate_vllm``: the same on the vllm engine; ``rm``: score the rows'
    own ``--data.input_key`` / ``--data.output_key`` texts, no policy (OpenRLHF's ``--eval_task``)."""
    output_path: str | None = None
    """The result, JSON lines, written whole at the end. Samples stream into
    ``<output_path>.samples.jsonl`` as they are made: a rerun of the same command resumes from it."""
    post_processor: str | None = None
    """A registered post-processor run over the scored samples: ``rs`` (best of n), ``iter_dpo`` (best
    and worst as a pair), ``csft`` (reward condition in the prompt), or a plugin's."""
    reward_template: str | None = None
    """``csft``: how the condition is written, with ``{input}`` and ``{reward}`` (default
    ``"{input} <rm_score>: {reward} "``)."""
    normalize_reward: bool = False
    """``csft``: z-score the rewards over the whole output before writing them into the prompts."""
    enable_csft: bool = False
    """Append ``--generate.csft_prompt`` to every prompt (generating from a conditional-SFT policy)."""
    csft_prompt: str = "<rm_score>: 5.00"
    """The condition appended with ``--generate.enable_csft`` (stripped, then one space after it)."""
    iter: int | None = None
    """Use the prompts ``[iter * R, (iter + 1) * R)`` with R = ``--rollout.batch_size``, so that each
    iteration of a pipeline gets fresh prompts; None: the first ``--data.max_samples`` rows."""
    seed: int = 1234
    """Seed of sampling: sample j of prompt i draws from ``derive_seed(seed, iter, i, j)``, so a resumed
    run draws what the uninterrupted one would have."""


INFERENCE_DTYPE = (
    "Weights dtype of the policy and reward model: ``bf16``, ``fp32``, or ``auto`` (``bf16`` on a GPU, "
    "``fp32`` on CPU)."
)
CHAT_TEMPLATE = "Override the tokenizer's chat template."


@dataclass
class GenerateConfig:
    """``rlhf generate``: sample n responses per prompt on Ray workers, score them, post-process them."""

    model: PolicyConfig = field(default_factory=PolicyConfig)
    generate: GenerateTaskConfig = field(default_factory=GenerateTaskConfig)
    rollout: RolloutConfig = view(
        RolloutConfig,
        "engine n_samples_per_prompt max_new_tokens temperature top_p top_k repetition_penalty batch_size "
        "micro_batch_size",
        {
            "engine": "Rollout engine: ``hf``, ``vllm``, or ``auto`` (vllm when it can run here, else hf).",
            "n_samples_per_prompt": "Samples per prompt (``--best_of_n``).",
            "max_new_tokens": "Most tokens generated per sample.",
            "temperature": "Sampling temperature; 0 is greedy (``--greedy_sampling``).",
            "batch_size": "Prompts per pipeline iteration, with ``--generate.iter`` "
            "(``--rollout_batch_size``).",
            "micro_batch_size": "Prompts per engine call, and sequences per reward-model forward; the unit "
            "of progress and resume.",
        },
        batch_size=2048,
        micro_batch_size=16,
    )
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The whole reward section of ``rlhf train ppo``, so that every reward source (a plugin's with fields of
    its own too) is configured as in RL; the RL-only shaping fields are refused by ``rlhf generate``."""
    data: DataConfig = view(
        DataConfig,
        "dataset dataset_probs dataset_split input_key output_key label_key input_template "
        "apply_chat_template tokenizer_chat_template max_len prompt_max_len overlong_prompt_policy "
        "skip_bad_rows max_samples disable_fast_tokenizer",
        {
            "dataset": "Prompt datasets: json/jsonl/parquet/csv files or local HF dataset directories.",
            "output_key": "``--generate.task rm``: column holding the response to score.",
            "label_key": "Column passed to reward functions as the label (and kept in the output).",
            "tokenizer_chat_template": CHAT_TEMPLATE,
            "max_len": "``--generate.task rm`` and reward models: most tokens of prompt + response.",
            "prompt_max_len": "Most prompt tokens.",
            "overlong_prompt_policy": "A prompt longer than its budget: ``error`` (names file and row), "
            "``skip`` or ``truncate_left``.",
            "max_samples": "Use at most this many rows (without ``--generate.iter``).",
        },
        output_key="output",
        prompt_max_len=1024,
    )
    ds: DSConfig = view(
        DSConfig,
        "param_dtype attn_implementation value_head_prefix",
        {"param_dtype": INFERENCE_DTYPE, "value_head_prefix": "Name of the reward model's value head."},
    )
    vllm: VllmConfig = view(
        VllmConfig,
        "num_engines tensor_parallel_size gpu_memory_utilization enable_prefix_caching enforce_eager",
        {
            "num_engines": "Generation workers, one rollout engine each; the prompts are shared out among "
            "them.",
            "tensor_parallel_size": "GPUs per vLLM engine (``--tp_size``).",
            "gpu_memory_utilization": "Fraction of GPU memory vLLM may take.",
            "enable_prefix_caching": "vLLM automatic prefix caching (worth it with several samples per "
            "prompt).",
            "enforce_eager": "Disable CUDA graphs in vLLM.",
        },
    )
    ray: RayConfig = field(default_factory=RayConfig)


@dataclass
class ChatOptions:
    max_len: int = 4096
    """Most tokens of the whole conversation; older turns are dropped (with a note) to make room."""
    max_new_tokens: int = 1024
    """Most tokens of one reply."""
    temperature: float = 0.2
    """Sampling temperature; 0 is greedy (``--greedy_sampling``)."""
    top_p: float = 0.9
    """Nucleus sampling mass."""
    repetition_penalty: float = 1.2
    """Penalty on tokens already in the conversation (1.0: none)."""
    ta_prompt: str | None = None
    """A text file that starts every conversation: the system message with a chat template, else the
    opening text of the history."""
    enable_csft: bool = False
    """Append ``--chat.csft_prompt`` to every user turn (talking to a conditional-SFT policy)."""
    csft_prompt: str = "<rm_score>: 5.00"
    """The condition appended with ``--chat.enable_csft``."""
    stream: str = "auto"
    """Print reply tokens as they are made: ``auto`` (when stdout is a terminal), ``true``, ``false``."""
    seed: int = 1234
    """Seed of sampling."""


@dataclass
class ChatConfig:
    """``rlhf chat``: talk to a checkpoint, in a terminal or through stdin."""

    model: PolicyConfig = field(default_factory=PolicyConfig)
    chat: ChatOptions = field(default_factory=ChatOptions)
    data: DataConfig = view(
        DataConfig,
        "input_template apply_chat_template tokenizer_chat_template",
        {
            "input_template": "Format string with ``{}`` for each user turn, used when no chat template is "
            "applied.",
            "apply_chat_template": "Format the conversation with the tokenizer's chat template.",
            "tokenizer_chat_template": CHAT_TEMPLATE,
        },
        input_template="User: {}\nAssistant: ",
    )
    ds: DSConfig = view(DSConfig, "param_dtype attn_implementation", {"param_dtype": INFERENCE_DTYPE})


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    """Interface to listen on. Anything but loopback needs ``--api_key`` or ``--insecure``."""
    port: int = 5000
    """Port (0: any free port; the address is printed)."""
    batch_size: int = 16
    """Queries per forward pass."""
    api_key: str | None = option(None, secret=True)
    """Require ``Authorization: Bearer KEY`` on /get_reward (default: ``$RLHF_RM_API_KEY``)."""
    insecure: bool = False
    """Allow a non-loopback ``--host`` without an API key."""
    max_body_bytes: int = 8 * 1024 * 1024
    """Larger request bodies get 413."""
    max_batch: int = 1024
    """Requests with more queries get 422."""
    log_level: str = "info"
    """``debug``, ``info``, ``warning`` or ``error``."""
    use_ms: bool = option(False, refused="ModelScope is not supported; pass a local model directory")
    """Load the model from ModelScope (OpenRLHF's; refused here)."""


@dataclass
class ServeRMConfig:
    """``rlhf serve-rm``: serve a reward model over HTTP (OpenRLHF's ``POST /get_reward``)."""

    reward: RewardConfig = view(
        RewardConfig,
        "model_name_or_path normalize_enable",
        {
            "model_name_or_path": "Local HF reward model (AutoModelForSequenceClassification with value head "
            "``--ds.value_head_prefix``); required.",
        },
    )
    ds: DSConfig = view(
        DSConfig,
        "param_dtype attn_implementation experts_implementation value_head_prefix packing_samples load_in_4bit",
        {
            "param_dtype": "Model precision: ``bf16``, ``fp16``, ``fp32``, or ``auto`` (``bf16`` on a GPU, "
            "``fp32`` on CPU).",
            "packing_samples": "Accepted for OpenRLHF scripts; no effect (batches are padded).",
            "load_in_4bit": "Not supported: refused with a message.",
        },
    )
    data: DataConfig = view(
        DataConfig,
        "max_len disable_fast_tokenizer",
        {"max_len": "Most tokens per query; longer queries keep their last max_len tokens."},
        max_len=2048,
    )
    serve: ServeOptions = field(default_factory=ServeOptions)


# Every command whose flags the config parser reads: the training modes, then the inference commands.
COMMANDS: dict[str, type] = {
    **MODES,
    "generate": GenerateConfig,
    "chat": ChatConfig,
    "serve-rm": ServeRMConfig,
}
