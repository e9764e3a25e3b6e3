"""The public primitives a training loop is written over: a :class:`Learner` per trained model, a
:class:`Sampler` over the rollout engines, and :class:`Sync` between them (docs/architecture.md, "The
primitives layer"). Every call returns a :class:`rlhf_core.handles.Future` (``wait`` gives its value); where
the objects live (this process, training ranks, Ray actors) was decided when they were built
(``rlhf_cli.primitives``) and does not show here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from rlhf_core.handles import Future

if TYPE_CHECKING:
    import torch


class Learner(Protocol):
    """One trained model (its data-parallel ranks): the policy, or a critic."""

    def forward(
        self,
        batches: list,
        temperature: float = 1.0,
        head: str | None = None,
        teacher: int = 0,
        loss_cfg: Any = None,
    ) -> Future:
        """A list, one entry per micro-batch, computed without gradients. ``head``: ``logprobs`` (a policy's
        default) the ``[B, T]`` response log-probs of each ``rlhf_core.batches.SequenceBatch`` under
        ``softmax(logits / temperature)``, zero past each row's end (``teacher`` i > 0: multi-teacher OPD's
        teacher i); ``values`` (a critic's default) the ``[B, T]`` values of the state before each response
        token; ``rewards`` a reward model's ``[B]`` rewards, read at each row's last token; or the name of a
        registered loss, evaluated with ``loss_cfg``: ``(metrics, weight)``, the metrics with the micro-batch's
        mean ``loss``. A backend may offer more heads (the ``deepspeed`` one: ``entropy``, ``ref``)."""

    def forward_backward(
        self, micro_batches: list, loss: str, loss_cfg: Any, counts: dict[str, float] | None = None
    ) -> Future:
        """``dict`` of metrics: the loss registered as ``loss`` (``policy``, ``value``, ``sft``, ``rm``,
        ``dpo``, ``kto``, ``prm``, ``kd``; ``loss_cfg`` is its config) over ``micro_batches``, spread over
        the ranks, gradients accumulated. ``counts``: the step's global ``num_tokens`` / ``num_sequences``
        that the loss is normalised by, counted from ``micro_batches`` when not given."""

    def optim_step(self) -> Future:
        """``dict`` of the step's metrics (``loss``, ``grad_norm``, ``lr``, ``skipped``...): the optimizer
        step over the gradients accumulated since the last one (skipped when a loss was not finite)."""

    def save_state(self, path: str) -> Future:
        """Weights, optimizer and RNG state under ``path``, for :meth:`load_state`."""

    def load_state(self, path: str) -> Future:
        """Continue from what :meth:`save_state` wrote."""

    def weights(self) -> Future:
        """``dict[str, Tensor]``: the weights as the engines take them (HF names), on CPU."""

    def export(self, path: str, config_updates: dict | None = None, ema: bool | None = None) -> Future:
        """An HF model (safetensors and tokenizer) in ``path``, loadable by ``AutoModelForCausalLM``, with
        ``config_updates`` merged into its config; a model that keeps an EMA writes it unless ``ema=False``."""


class Sampler(Protocol):
    """The rollout engines of a run, as one."""

    def sample(self, requests: list) -> Future:
        """``requests``: ``rlhf_core.types.GenerationRequest`` s (not imported: ``rlhf_core.types`` builds
        its ``TrainGroup`` on :class:`Learner`). Returns ``list[list[GenerationOutput]]``:
        ``request.params.n`` samples per request, in order, with their tokens' log-probs; a request's
        ``params.seed`` makes its samples repeatable."""

    def load_weights(self, weights: dict[str, torch.Tensor]) -> Future:
        """Every engine samples from ``weights`` (HF names) from now on."""

    def sleep(self) -> Future:
        """Release the engines' memory (KV cache, weights offloaded) while the learner trains."""

    def wake_up(self) -> Future:
        """Take it back before sampling."""


class Sync(Protocol):
    def __call__(self, learner: Learner, sampler: Sampler) -> Future:
        """The learner's current weights (or LoRA adapter) reach every engine of the sampler."""
