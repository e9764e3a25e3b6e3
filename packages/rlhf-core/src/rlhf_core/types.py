"""The data that crosses seams, and the interfaces plugins implement.

Shapes use these letters throughout:

- ``B``: sequences in a batch. Rows that sample the same prompt are consecutive: with ``n`` samples per
  prompt, rows ``[g*n, (g+1)*n)`` form group ``g``.
- ``T``: response positions (everything after the prompt), right-padded to the longest response.

Everything here is plain data or an abstract interface: no Ray, vLLM or DeepSpeed.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from rlhf_core.handles import Future
from rlhf_core.primitives import Learner

FinishReason = Literal["stop", "length", "abort"]


def derive_seed(*parts: int | str) -> int:
    """A stable 63-bit seed from its parts, e.g. ``derive_seed(run_seed, step, prompt_uid, sample_idx)``.

    Counter-based seeding lets a resumed run sample exactly the tokens the uninterrupted run sampled,
    without saving any generator state. Python's ``hash`` is salted per process, so this uses blake2b.
    """
    data = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


# --- rollout engines -----------------------------------------------------------------------------------


@dataclass
class SamplingParams:
    """How to sample one request. Engines must honour every field.

    Log-probs returned with the tokens are those of the sampled token under ``softmax(logits /
    temperature)``, before top-k/top-p filtering: the same quantity the trainer recomputes, so that the
    two can be compared (IS correction, ``rollout/train`` KL). Greedy samples (temperature 0) use
    ``softmax(logits)``; the ``min_new_tokens`` suppression of stop ids does not change log-probs either,
    nor does excluding a vision-language model's image token (only images fill those positions).
    """

    n: int = 1
    """Samples drawn for this prompt."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 disables it."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 (or -1) disables it."""
    max_new_tokens: int = 1024
    """Most tokens to generate for each sample."""
    min_new_tokens: int = 0
    """EOS and stop ids are suppressed until this many tokens exist (benchmarks fix lengths with it)."""
    stop_token_ids: tuple[int, ...] = ()
    """Ids that end a sample besides the tokenizer's EOS; the stop id is kept in the output."""
    ignore_eos: bool = False
    """Never stop at EOS or stop ids: every sample runs to ``max_new_tokens``."""
    seed: int | None = None
    """Seed of this request; sample ``i`` draws from ``derive_seed(seed, i)``. None: unseeded."""


@dataclass(eq=False)
class ImageInput:
    """One image of a prompt (or of an environment's feedback), as the model's image processor made it.

    It is made once and shared by reference (the samples of a group, their engine requests and trajectories;
    Ray sends an object that one message references several times once), so its tensors exist once per
    prompt in each process. ``eq=False``: images compare (and hash) by identity, which is how engines and
    trainers find the samples that share one. Memory per pixel: ``12 * temporal_patch`` bytes of
    ``pixel_values`` (24 for the Qwen-VL family) plus 3 of the decoded image.
    """

    pixel_values: torch.Tensor
    """``[P, D]`` float32 patches, ``P = t * h * w`` (the grid), ``D = 3 * temporal_patch * patch^2``."""
    grid_thw: torch.Tensor
    """``[3]`` long: the patch grid ``(t, h, w)``."""
    num_tokens: int
    """Image tokens it fills in the sequence: ``t * h * w / merge^2``."""
    image: Any = None
    """The decoded RGB image (PIL), for engines that run their own image processor (vLLM)."""


@dataclass
class GenerationRequest:
    """One prompt, as token ids (image tokens already expanded), with its sampling parameters and images."""

    prompt_ids: list[int]
    params: SamplingParams
    images: Sequence[ImageInput] = ()
    """The images whose tokens appear in ``prompt_ids``, in order (vision-language models only)."""


@dataclass
class GenerationOutput:
    """One sample: the tokens after the prompt, their log-probs, and why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    """``len(logprobs) == len(token_ids)``; see :class:`SamplingParams` for which distribution."""
    finish_reason: FinishReason
    """``stop``: EOS or a stop id (included in ``token_ids``); ``length``: hit ``max_new_tokens``."""
    routed_experts: torch.Tensor | None = None
    """MoE models, engines that record routing: ``[len(prompt) + len(token_ids), layers, k]`` the experts each
    token was routed to (-1 where no forward ran on it: the last token); see :mod:`rlhf_core.moe`."""


class RolloutEngine(ABC):
    """What every rollout engine does. ``rlhf_core.testing.RolloutEngineConformance`` checks it."""

    @abstractmethod
    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[GenerationOutput]]:
        """Sample ``request.params.n`` outputs for each request; returns one list per request, in order."""

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights (HF parameter names) in place; later samples use them."""

    @abstractmethod
    def sleep(self, level: int = 1) -> None:
        """Release memory: level 1 drops the KV cache and offloads weights, level 2 discards weights."""

    @abstractmethod
    def wake_up(self) -> None:
        """Take memory back after :meth:`sleep`; after a level-2 sleep weights must be sent again."""

    @abstractmethod
    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes (after a weight update they are stale)."""


@runtime_checkable
class RolloutEngineFactory(Protocol):
    """The object registered under ``rlhf_register_rollout_engines``."""

    def available(self) -> str | None:
        """None when the engine can run here, else the reason it cannot (e.g. 'vllm is not installed')."""

    def create(self, cfg: Any, **kwargs: Any) -> Any:
        """Build the engine (or its Ray actor handle) from the run configuration."""


# --- trajectories and rewards ---------------------------------------------------------------------------


@dataclass
class Trajectory:
    """One sampled episode, token in and token out.

    ``response_ids`` holds everything after the prompt: model tokens (``action_mask`` 1) and, for
    multi-turn episodes, environment feedback tokens (``action_mask`` 0). Engine tokens are appended
    verbatim; nothing is ever re-tokenized.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    action_mask: list[int]
    """Same length as ``response_ids``; 1 where the policy produced the token."""
    rollout_logprobs: list[float]
    """Same length as ``response_ids``; the engine's log-prob, 0.0 where ``action_mask`` is 0."""
    prompt_uid: int = 0
    """Stable id of the dataset prompt (resume and dynamic filtering key on it)."""
    sample_index: int = 0
    """Which of the ``n`` samples of its prompt this is."""
    reward: float | None = None
    """The scalar reward; None means unscorable (excluded from baselines and the loss)."""
    score: float | None = None
    """The task score used for metrics and dynamic filtering (defaults to the reward)."""
    finish_reason: FinishReason = "stop"
    truncated: bool = False
    """The episode hit the context budget or ``max_new_tokens``."""
    prompt_text: str = ""
    label: Any = None
    error: str | None = None
    """Why the sample is unscorable, when it is."""
    extra_logs: dict[str, float] = field(default_factory=dict)
    images: list[ImageInput] = field(default_factory=list)
    """The images whose tokens appear in ``prompt_ids + response_ids``, in order: the prompt's, then any an
    environment returned (vision-language models only; shared with the prompt, not copied)."""
    segments: list[Trajectory] = field(default_factory=list)
    """Per-call samples: when not empty, the episode is trained as these samples instead of its own ids,
    all sharing its reward. Each holds one model call's input as its prompt and the call's output as its
    response (or a run of calls whose inputs extend one another, with the feedback between them masked
    out). The episode's own ids are then its last segment's, the final conversation that a reward
    function scores. Set by agents whose calls do not extend one another (``--train.per_call_samples``)."""
    routed_experts: torch.Tensor | None = None
    """Router replay (``--actor.router_replay``): the last model call's ``GenerationOutput.routed_experts``,
    which covers ``prompt_ids + response_ids`` up to that call's end (feedback after it: none recorded)."""

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if len(self.action_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(
                f"Trajectory lengths differ: response_ids {n}, action_mask {len(self.action_mask)}, "
                f"rollout_logprobs {len(self.rollout_logprobs)}"
            )


@dataclass
class RewardRequest:
    """A batch of finished samples to score. Text exists here only for reward functions and logs."""

    queries: list[str]
    """Decoded prompt + response of each sample (special tokens kept), as OpenRLHF passes them."""
    prompts: list[str]
    labels: list[Any]
    prompt_ids: list[list[int]] = field(default_factory=list)
    response_ids: list[list[int]] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    """``stop`` or ``length`` per sample (see :class:`GenerationOutput`)."""
    responses: list[str] = field(default_factory=list)
    """Decoded response of each sample, special tokens skipped."""


@dataclass
class RewardResult:
    """Scores for a :class:`RewardRequest`, one entry per sample, in order."""

    rewards: list[float | None]
    """None marks an unscorable sample."""
    scores: list[float | None]
    extra_logs: dict[str, list[float]] = field(default_factory=dict)
    errors: list[str | None] = field(default_factory=list)
    step_scores: list[list[float]] | None = None
    """Process reward models: each sample's per-step scores (empty when it has no step); None otherwise."""


class RewardSource(ABC):
    """Scores batches of samples."""

    @abstractmethod
    async def score(self, request: RewardRequest) -> RewardResult: ...

    async def aclose(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release connections or workers."""


@runtime_checkable
class RewardSourceFactory(Protocol):
    """The object registered under ``rlhf_register_reward_sources``.

    It may also have ``check(cfg)``, which the driver calls before any worker starts (and in ``--dry-run``):
    cheap, it starts nothing, and raises naming the flag or file when the configuration cannot work.
    """

    def accepts(self, cfg: Any) -> bool:
        """Whether the reward section of the config (``remote_url``, ``model_name_or_path``) is for it."""

    def create(self, cfg: Any) -> RewardSource: ...


# --- post-processing generated samples (rlhf generate) ---------------------------------------------------


@dataclass
class ScoredSample:
    """One response to one prompt, with its reward."""

    input: str
    """The prompt text as the model saw it (templates applied)."""
    output: str
    """The response text, special tokens skipped."""
    reward: float
    prompt_index: int
    """Which prompt of the run (its position in the selected rows); groups key on it."""
    sample_index: int
    """Which of the prompt's samples this is."""
    label: Any = None
    """The ``--data.label_key`` value of the prompt's row, when given."""


@dataclass
class PostProcessOptions:
    """The ``--generate.*`` settings a post-processor may read."""

    reward_template: str | None = None
    """How a reward condition is written into a prompt (``{input}`` and ``{reward}``); None: the
    processor's default."""
    normalize_reward: bool = False
    """Z-score the rewards over the whole output first."""


@dataclass
class PostProcessInput:
    """Every scored sample of a run, grouped by prompt."""

    groups: list[list[ScoredSample]]
    """One list per prompt, in prompt order, its samples in sample order. Unscorable samples are left out
    (and counted) before post-processing; a group is never empty."""
    options: PostProcessOptions = field(default_factory=PostProcessOptions)


@runtime_checkable
class PostProcessor(Protocol):
    """The object registered under ``rlhf_register_post_processors``."""

    def check(self, options: PostProcessOptions) -> None:
        """Raise ValueError naming the flag when ``options`` cannot work; called before any worker starts."""

    def __call__(self, batch: PostProcessInput) -> list[dict]:
        """The output rows: JSON-serialisable dicts, written one per line in the order returned."""


# --- algorithms ----------------------------------------------------------------------------------------


@dataclass
class AdvantageInput:
    """Everything an advantage estimator may read. ``B`` sequences, ``T`` response positions."""

    rewards: torch.Tensor
    """``[B]`` sequence rewards after length penalties, before group shaping and clipping."""
    action_mask: torch.Tensor
    """``[B, T]`` bool; True where the policy produced the token."""
    n_samples_per_prompt: int = 1
    valid: torch.Tensor | None = None
    """``[B]`` bool; False marks unscorable samples: excluded from group baselines and statistics,
    and given zero advantage. None means all valid."""
    kl: torch.Tensor | None = None
    """``[B, T]`` per-token KL(policy || ref), which the estimator must fold into the reward as
    ``-kl_coef * kl`` on the action tokens (nothing else applies it); None when KL is a loss term or there
    is no reference model."""
    kl_coef: float = 0.0
    values: torch.Tensor | None = None
    """``[B, T]`` critic values (estimators with ``needs_critic``)."""
    gamma: float = 1.0
    lambd: float = 1.0
    reward_clip: tuple[float, float] | None = None
    """The estimator must clamp the (group-shaped) sequence reward into this range before it goes on the
    last token (``--reward.clip_range``; nothing else applies it)."""
    no_std_norm: bool = False
    """Subtract the mean but do not divide by the std in the estimator's normalisation step."""
    task_reward_coef: float = 0.0
    """``opd``: weight of the task reward's group-normalised advantage beside the teacher's KL
    (``--algo.opd.task_reward_coef``); other estimators ignore it."""


@dataclass
class AdvantageOutput:
    advantages: torch.Tensor
    """``[B, T]``, zero where ``action_mask`` is False."""
    returns: torch.Tensor
    """``[B, T]``, the critic's regression target (zero where ``action_mask`` is False)."""


@runtime_checkable
class AdvantageEstimator(Protocol):
    """The object registered under ``rlhf_register_advantage_estimators``."""

    needs_critic: bool
    min_samples_per_prompt: int
    """Estimators with group baselines need 2 or more; the trainer refuses fewer up front."""

    def __call__(self, batch: AdvantageInput) -> AdvantageOutput: ...


AGGREGATION_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


@dataclass
class LossAggregation:
    """How per-token losses become one scalar (``mode`` is one of :data:`AGGREGATION_MODES`).

    ``mode``:

    - ``token_mean``: ``sum(loss * m) / num_tokens``, where ``num_tokens`` counts the action tokens of the
      whole optimizer step (every micro-batch of the gradient-accumulation window on every data-parallel
      rank), so the result does not depend on how the batch was split.
    - ``seq_mean_token_mean``: the mean over sequences of each sequence's token mean, over
      ``num_sequences`` sequences of the step.
    - ``seq_mean_token_sum_norm`` (Dr. GRPO): ``sum(loss * m) / (num_sequences * max_len)``.

    The result is multiplied by ``dp_size`` because data-parallel gradient reduction averages over ranks.
    With the defaults (None counts, ``dp_size`` 1) the aggregation is over the local batch.
    """

    mode: str = "token_mean"
    num_tokens: float | None = None
    num_sequences: float | None = None
    max_len: int | None = None
    dp_size: int = 1


@dataclass
class PolicyLossInput:
    """One micro-batch for a policy loss. All tensors are ``[B, T]``."""

    logprobs: torch.Tensor
    """Log-probs of the current policy (carry gradients)."""
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    action_mask: torch.Tensor
    rollout_logprobs: torch.Tensor | None = None
    """The engine's log-probs, for rollout/train mismatch correction."""
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    dual_clip: float | None = None
    is_correction: str | None = None
    """``tis``, ``icepop``, ``seq-mask-tis`` or None."""
    is_threshold: tuple[float, float] = (0.5, 5.0)
    aggregation: LossAggregation = field(default_factory=LossAggregation)


@dataclass
class LossOutput:
    loss: torch.Tensor
    """A scalar ready for ``backward()``."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Detached diagnostics, e.g. ``clip_ratio``, ``ppo_kl``, ``rollout_kl``."""


@runtime_checkable
class PolicyLoss(Protocol):
    """The object registered under ``rlhf_register_policy_losses``.

    It may carry ``default_loss_agg_mode``: the :class:`LossAggregation` mode the trainer uses when
    ``--actor.loss_agg_mode`` is not set (``gspo`` aggregates per sequence). Without it, ``token_mean``.
    """

    def __call__(self, batch: PolicyLossInput) -> LossOutput: ...


@runtime_checkable
class KLEstimator(Protocol):
    """The object registered under ``rlhf_register_kl_estimators``: ``[B, T], [B, T] -> [B, T]``."""

    def __call__(self, logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor: ...


# --- placement -----------------------------------------------------------------------------------------


@dataclass
class WorkerGroupSpec:
    """One group of identical Ray actors, e.g. 2 policy ranks or 4 rollout engines."""

    role: str
    num_workers: int
    pool: str
    """The bundle pool it is placed on; groups that share a pool share its devices (colocation)."""
    num_gpus_per_worker: float = 0.0
    num_cpus_per_worker: float = 1.0


@dataclass
class BundlePool:
    """A Ray placement group: ``bundles`` resource dicts placed with ``strategy``."""

    name: str
    bundles: list[dict[str, float]]
    strategy: str = "PACK"


@dataclass
class PlacementPlan:
    pools: list[BundlePool]
    groups: list[WorkerGroupSpec]

    def describe(self) -> str:
        """A human-readable table of pools and groups, as ``--dry-run`` prints it."""
        lines = []
        for pool in self.pools:
            total: Counter[str] = Counter()
            for b in pool.bundles:
                total.update(b)
            res = ", ".join(f"{k}={v:g}" for k, v in sorted(total.items()))
            lines.append(f"pool {pool.name}: {len(pool.bundles)} bundles ({pool.strategy}; {res})")
            for g in self.groups:
                if g.pool == pool.name:
                    lines.append(
                        f"  {g.role:<8} {g.num_workers} worker(s) x "
                        f"(GPU {g.num_gpus_per_worker:g}, CPU {g.num_cpus_per_worker:g})"
                    )
        return "\n".join(lines)


@dataclass
class RoleDemand:
    """What one role of a run needs, before placement decides where it goes."""

    num_workers: int
    gpus_per_worker: int = 1
    """GPUs each worker needs when GPUs exist (a vLLM engine's tensor-parallel size, else 1)."""


@runtime_checkable
class PlacementStrategy(Protocol):
    """The object registered under ``rlhf_register_placement_strategies``."""

    def plan(self, roles: dict[str, RoleDemand], cfg: Any, gpus_available: bool) -> PlacementPlan:
        """Place ``roles`` (``actor``, ``critic``, ``ref``, ``reward``, ``rollout``; absent roles are
        not needed by this run) into Ray bundle pools."""


@runtime_checkable
class TrainBackend(Protocol):
    """The object registered under ``rlhf_register_train_backends``.

    ``create_group(role, cfg, pool, num_workers, **options)`` starts a group of training workers for
    ``role`` (``actor``, ``critic``, ``ref``, ``reward``) of an ``RLConfig`` on a Ray placement group
    (``pool``, or None) and returns a :class:`TrainGroup`. Options the driver passes: ``total_steps``
    (optimizer steps of the run), ``bundle_indices`` (rank ``r`` goes to bundle ``bundle_indices[r]``),
    ``num_gpus_per_worker``, ``num_cpus_per_worker``, ``num_threads`` (torch threads per rank), ``wait``
    (False: return while the ranks still start, see ``TrainGroup.wait_ready``), for a backend with
    ``hosts_roles = True`` also ``with_ref`` (the actor's ranks hold the reference model too), and for one
    with ``single_process = True`` also ``inline_rank`` (the group's one rank lives in the driver's process,
    no Ray, ``pool`` None; its rank's handle is ``rlhf_core.handles.local``).
    ``run_trainer(mode, cfg)`` runs ``sft``, ``rm``, ``dpo``, ``kto``, ``prm`` or ``kd``.
    ``rlhf_core.testing.TrainBackendConformance`` checks a backend against this contract.
    """

    def create_group(
        self, role: str, cfg: Any, pool: Any, num_workers: int, **options: Any
    ) -> TrainGroup: ...

    def run_trainer(self, mode: str, cfg: Any) -> Any: ...


@runtime_checkable
class TrainGroup(Learner, Protocol):
    """The handle of one role's training ranks: a :class:`rlhf_core.primitives.Learner` (the RL loop calls
    ``forward`` with the ``logprobs``, ``values`` and ``rewards`` heads, ``forward_backward`` with the
    ``policy`` and ``value`` losses, ``optim_step``, ``save_state``, ``load_state``, ``weights``, ``export``),
    and what placing and syncing it needs.

    Arguments and results are the plain data of :mod:`rlhf_core.batches` (CPU tensors). Micro-batches are
    split over the data-parallel ranks in contiguous shares; results come back in the order given. A rank that
    dies surfaces as ``rlhf_core.handles.worker_died()`` from the wait. ``forward_backward`` takes a multiple
    of ``dp_size`` micro-batches; ``optim_step``'s metrics hold at least ``loss`` (the step's global loss) and
    ``skipped`` (1.0 when a non-finite loss skipped the step).
    """

    actors: list
    """The ``rlhf_core.handles.Handle`` of each rank (the driver counts processes with it)."""
    dp_size: int
    """Data-parallel ranks: micro-batches of one optimizer step are split this many ways."""
    ring_size: int
    """Ranks that share each micro-batch (sequence parallelism); 1 without it."""

    def wait_ready(self) -> None:
        """Return once every rank is up (raising its set-up error): a no-op unless made with ``wait=False``."""

    # Only with ``hosts_roles = True`` on the backend; the driver then places the reference model and HF
    # engines that share the actor's pool inside its ranks' processes (``rlhf_cli.placement.roles_in_actor``):
    # ``host(name, cls, args)`` builds ``cls(*args[r])`` in rank ``r`` and returns their handles
    # (``rlhf_core.handles.hosted``), ``hosted_ref()`` is the reference learner the ranks hold (``with_ref``),
    # and ``push_weights_to_hosted(name)`` copies each rank's weights into what it hosts.

    def weight_sync_address(self) -> tuple[str, int]:
        """Rank 0's host and a port for the weight-broadcast group. Rank 0 holds the port from now on (as the
        store of ``rlhf_core.weight_sync.listening_store``, passed to ``init_sync_group``): a port found free
        and released can be taken by another process before the group forms."""

    def broadcast_weights_to_engines_async(
        self,
        master_addr: str,
        master_port: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 600.0,
    ) -> list[Future]:
        """Start sending the weights as rank 0 of an ``rlhf_core.weight_sync`` group whose other ranks are
        the engines; returns futures to wait on. The first call joins the group; the engines stay in it, so
        later calls with the same address send through the same group, and a call with another address (after
        an engine was replaced) closes it and joins a new one."""

    def sleep(self) -> None:
        """Free device memory for colocated engines (``--ds.enable_sleep``); may do nothing."""

    def wake_up(self) -> None: ...

    def shutdown(self) -> None: ...
