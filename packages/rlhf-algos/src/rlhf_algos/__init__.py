"""rlhf-algos: the math of RLHF as pure torch functions (no Ray, vLLM or DeepSpeed); the package's README says
what it holds and how its estimators and losses are registered by name (``rlhf_algos.plugin``).
"""

import importlib.metadata

from rlhf_algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    check_n_samples_per_prompt,
    compute_advantages,
    gae_advantages,
    group_shaped_rewards,
    normalize_advantages,
    token_level_rewards,
)
from rlhf_algos.aggregation import AGGREGATION_MODES, aggregate
from rlhf_algos.distill import distill_cross_entropy, kd_loss
from rlhf_algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    k1,
    k2,
    k3,
    kl_loss,
    make_kl_controller,
)
from rlhf_algos.logits import entropy_from_logits, logprobs_and_entropy, logprobs_from_logits
from rlhf_algos.policy_loss import (
    IS_CORRECTION_TYPES,
    POLICY_LOSSES,
    entropy_loss,
    gspo_loss,
    ppo_loss,
    rollout_correction_weights,
)
from rlhf_algos.preference import dpo_loss, kto_loss, nll_loss, rm_loss
from rlhf_algos.prm import prm_loss, step_scores
from rlhf_algos.sft import sft_loss
from rlhf_algos.shaping import RunningMeanStd, dynamic_filter, overlong_penalty, stop_properly_penalty
from rlhf_algos.value_loss import value_loss

# The version lives in pyproject.toml only; an installed distribution reports it.
__version__ = importlib.metadata.version("rlhf-algos")

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "IS_CORRECTION_TYPES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "RunningMeanStd",
    "aggregate",
    "check_n_samples_per_prompt",
    "compute_advantages",
    "distill_cross_entropy",
    "dpo_loss",
    "dynamic_filter",
    "entropy_from_logits",
    "entropy_loss",
    "gae_advantages",
    "group_shaped_rewards",
    "gspo_loss",
    "k1",
    "k2",
    "k3",
    "kd_loss",
    "kl_loss",
    "kto_loss",
    "logprobs_and_entropy",
    "logprobs_from_logits",
    "make_kl_controller",
    "nll_loss",
    "normalize_advantages",
    "overlong_penalty",
    "ppo_loss",
    "prm_loss",
    "rm_loss",
    "rollout_correction_weights",
    "sft_loss",
    "step_scores",
    "stop_properly_penalty",
    "token_level_rewards",
    "value_loss",
]
