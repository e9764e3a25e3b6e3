"""Advantage estimators ``gae``, ``reinforce``, ``reinforce_baseline``, ``rloo``, ``group_norm``, ``dr_grpo``
and ``opd``, in OpenRLHF's order of operations (``docs/algorithms.md`` §2 has it, the formulas and the
deviations). Call an estimator once on the whole rollout batch (rows ``[g*n, (g+1)*n)`` form group ``g``).
Invalid samples get zero advantages and returns; the trainer should also drop them from the loss masks (a
zero advantage gives a zero policy loss, but the tokens would still count in a ``token_mean`` denominator).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_core.types import AdvantageInput, AdvantageOutput

GROUP_ESTIMATORS = ("rloo", "reinforce_baseline", "group_norm", "dr_grpo")
BATCH_NORMALIZED = ("gae", "reinforce", "reinforce_baseline")
ESTIMATOR_NAMES = ("gae", "reinforce", *GROUP_ESTIMATORS, "opd")


def check_n_samples_per_prompt(name: str, min_samples_per_prompt: int, n_samples_per_prompt: int) -> None:
    """Refuse (ValueError) a group estimator fewer samples per prompt than its ``min_samples_per_prompt``; the
    trainer calls it at start-up."""
    if n_samples_per_prompt < min_samples_per_prompt:
        raise ValueError(
            f"advantage estimator {name!r} compares the samples of each prompt and needs "
            f"--rollout.n_samples_per_prompt >= {min_samples_per_prompt} (got "
            f"{n_samples_per_prompt}); raise it, or pick an estimator without a group baseline "
            f"(gae, reinforce)"
        )


def group_shaped_rewards(
    rewards: torch.Tensor, n_samples_per_prompt: int, estimator: str, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Subtract each prompt group's baseline from the sequence rewards ``[B]``; returns ``[B]`` float32.

    With ``r`` one group's valid rewards (``k`` of them)::

        rloo:               r_i - (sum_j r_j - r_i) / (k - 1)          leave-one-out mean
        reinforce_baseline: r_i - mean(r)
        dr_grpo:            r_i - mean(r)
        group_norm:         (r_i - mean(r)) / (std(r) + 1e-9)           std unbiased, as torch.std
        gae, reinforce:     r_i                                         unchanged

    Invalid samples are left out of ``k``, the sums and the std, and get 0. A sample whose reward is NaN or
    Inf is invalid whatever ``valid`` says (None included), so it cannot poison its group. A group with
    fewer than two valid samples has nothing to compare against and gets 0 for every sample.
    A group whose valid rewards are all equal gets exactly 0: float rounding makes ``r - mean(r)`` about
    1e-8 there, which ``group_norm``'s ``1e-9`` epsilon would blow up to values near 1.
    """
    if estimator not in ESTIMATOR_NAMES:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; built-ins: {', '.join(ESTIMATOR_NAMES)}"
        )
    finite = torch.isfinite(rewards)
    valid = finite if valid is None else finite & valid.bool()
    r = torch.where(valid, rewards.float(), 0.0)
    if estimator not in GROUP_ESTIMATORS:
        return r
    n = n_samples_per_prompt
    if n < 2 or r.numel() % n:
        raise ValueError(f"{estimator} needs groups of n >= 2 rows; got {r.numel()} rows with n = {n}")
    r, v = r.view(-1, n), valid.view(-1, n)
    k = v.sum(-1, keepdim=True)
    total = r.sum(-1, keepdim=True)
    mean = total / k.clamp(min=1)
    if estimator == "rloo":
        shaped = r - (total - r) / (k - 1).clamp(min=1)
    elif estimator == "group_norm":
        var = torch.where(v, (r - mean).square(), 0.0).sum(-1, keepdim=True) / (k - 1).clamp(min=1)
        shaped = (r - mean) / (var.sqrt() + 1e-9)
    else:
        shaped = r - mean
    lo = torch.where(v, r, torch.inf).amin(-1, keepdim=True)
    hi = torch.where(v, r, -torch.inf).amax(-1, keepdim=True)
    informative = (k >= 2) & (lo < hi)
    return torch.where(v & informative, shaped, 0.0).flatten()


def token_level_rewards(
    rewards: torch.Tensor,
    action_mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    reward_clip: tuple[float, float] | None = None,
) -> torch.Tensor:
    """Per-token rewards ``[B, T]`` from sequence rewards ``[B]``::

        R_t = -kl_coef * kl_t + (t == last action token ? clamp(r, lo, hi) : 0)     on action tokens
        R_t = 0                                                                      elsewhere

    The last action token is the last position where ``action_mask`` is true (multi-turn masks may have
    holes). A row without action tokens gets no reward.
    """
    mask = action_mask.bool()
    r = rewards.float()
    if reward_clip is not None:
        r = r.clamp(reward_clip[0], reward_clip[1])
    t = mask.shape[-1]
    last = t - 1 - mask.flip(-1).int().argmax(-1)  # argmax returns the first maximum
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    out[torch.arange(mask.shape[0], device=mask.device), last] = torch.where(mask.any(-1), r, 0.0)
    if kl is not None and kl_coef != 0:
        out = out - kl_coef * torch.where(mask, kl.float(), 0.0)
    return out


def gae_advantages(
    token_rewards: torch.Tensor,
    action_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lambd: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2015, https://arxiv.org/abs/1506.02438).

    Over the action tokens of each row, ``t'`` being the next action token after ``t``::

        delta_t = R_t + gamma * V_t' - V_t        (V after the last action token is 0)
        A_t     = delta_t + gamma * lambd * A_t'
        ret_t   = A_t + V_t

    With ``values`` None (V = 0) and ``lambd`` 1 this is the discounted return ``sum_k gamma^k R_t+k``,
    which is what ``reinforce`` and the group estimators use. Positions outside the mask are skipped (they
    are not time steps: environment feedback in a multi-turn episode) and get 0. Returns
    ``(advantages, returns)``, both ``[B, T]`` float32.
    """
    mask = action_mask.bool()
    rew = torch.where(mask, token_rewards.float(), 0.0)
    if values is None and gamma == 1.0:
        # undiscounted, no critic: a reverse cumulative sum (masked positions hold 0, so skipping is moot)
        ret = torch.where(mask, rew.flip(-1).cumsum(-1).flip(-1), 0.0)
        return ret, ret.clone()
    v = torch.zeros_like(rew) if values is None else torch.where(mask, values.float(), 0.0)
    adv = torch.zeros_like(rew)
    last_adv = torch.zeros_like(rew[:, 0])
    next_value = torch.zeros_like(rew[:, 0])
    for t in reversed(range(rew.shape[-1])):
        m = mask[:, t]
        a = rew[:, t] + gamma * next_value - v[:, t] + gamma * lambd * last_adv
        adv[:, t] = torch.where(m, a, 0.0)
        last_adv = torch.where(m, a, last_adv)
        next_value = torch.where(m, v[:, t], next_value)
    return adv, torch.where(mask, adv + v, 0.0)


def normalize_advantages(
    advantages: torch.Tensor, mask: torch.Tensor, no_std_norm: bool = False
) -> torch.Tensor:
    """Whiten over all positions where ``mask`` ``[B, T]`` is true::

        A = (A - mean) * rsqrt(clamp(var, 1e-8))       or, with no_std_norm,  A = A - mean

    ``mean`` and ``var`` (biased) are over the masked positions; the result is 0 elsewhere.
    """
    mask = mask.bool()
    n = mask.sum().clamp(min=1)
    a = torch.where(mask, advantages.float(), 0.0)
    mean = a.sum() / n
    out = a - mean
    if not no_std_norm:
        var = torch.where(mask, out.square(), 0.0).sum() / n
        out = out * var.clamp(min=1e-8).rsqrt()
    return torch.where(mask, out, 0.0)


def opd_advantages(
    kl: torch.Tensor,
    kl_coef: float,
    action_mask: torch.Tensor,
    rewards: torch.Tensor | None = None,
    n_samples_per_prompt: int = 1,
    task_reward_coef: float = 0.0,
    valid: torch.Tensor | None = None,
    reward_clip: tuple[float, float] | None = None,
) -> torch.Tensor:
    """On-policy distillation: per-token advantages ``[B, T]`` from the student's reverse KL to a teacher::

        A_t = -kl_coef * kl_t + task_reward_coef * clamp(group_norm(r)_i, lo, hi)     on action tokens of valid rows
        A_t = 0                                                            elsewhere

    ``kl`` ``[B, T]`` is the k1 estimate ``log pi_student(y_t) - log pi_teacher(y_t)`` of the sampled token
    ``y_t``; each token's own KL is its advantage, with no sum over later tokens (a discount of 0), as in
    on-policy distillation (Agarwal et al. 2023, https://arxiv.org/abs/2306.13649; Lu and Thinking Machines
    2025). ``rewards`` ``[B]`` is an optional task reward, group-normalised as ``group_norm`` does
    (:func:`group_shaped_rewards`, groups of ``n_samples_per_prompt`` rows), clamped into ``reward_clip`` as
    the other estimators clamp theirs, and added to every action token; it is read only when
    ``task_reward_coef`` is not 0. There is no batch whitening: the KL's scale is the
    signal. Rows with ``valid`` False get 0.
    """
    mask = action_mask.bool()
    if valid is not None:
        mask = mask & valid.bool()[:, None]
    adv = -kl_coef * kl.float()
    if task_reward_coef:
        shaped = group_shaped_rewards(rewards, n_samples_per_prompt, "group_norm", valid)
        if reward_clip is not None:
            shaped = shaped.clamp(reward_clip[0], reward_clip[1])
        adv = adv + task_reward_coef * shaped[:, None]
    return torch.where(mask, adv, 0.0)


def compute_advantages(batch: AdvantageInput, estimator: str) -> AdvantageOutput:
    """Advantages and returns ``[B, T]`` for the built-in ``estimator`` (see the module docstring).

    ``batch.gamma`` applies to ``gae`` and ``reinforce`` (the group estimators use 1, as OpenRLHF forces),
    ``batch.lambd`` to ``gae``. ``batch.no_std_norm`` affects only step 4 (the batch normalisation), so it
    changes nothing for ``rloo``, ``group_norm`` and ``dr_grpo``, as in OpenRLHF. A sample whose reward is
    not finite counts as invalid even when ``batch.valid`` says otherwise. The input is not modified.
    """
    if estimator in GROUP_ESTIMATORS or (estimator == "opd" and batch.task_reward_coef):
        check_n_samples_per_prompt(estimator, 2, batch.n_samples_per_prompt)
    if estimator == "gae" and batch.values is None:
        raise ValueError("advantage estimator 'gae' needs critic values (AdvantageInput.values)")
    mask = batch.action_mask.bool()
    # a non-finite reward cannot be scored whatever `valid` says: treat it as invalid rather than poison
    valid = torch.isfinite(batch.rewards)
    if batch.valid is not None:
        valid &= batch.valid.bool()
    live = mask & valid[:, None]
    if estimator == "opd":
        kl = torch.zeros(mask.shape) if batch.kl is None else batch.kl  # no teacher: the task reward alone
        advantages = opd_advantages(
            kl,
            batch.kl_coef,
            mask,
            batch.rewards,
            batch.n_samples_per_prompt,
            batch.task_reward_coef,
            valid,
            batch.reward_clip,
        )
        return AdvantageOutput(advantages=advantages, returns=advantages.clone())

    shaped = group_shaped_rewards(batch.rewards, batch.n_samples_per_prompt, estimator, valid)
    token_rewards = token_level_rewards(shaped, live, batch.kl, batch.kl_coef, batch.reward_clip)
    gamma = batch.gamma if estimator in ("gae", "reinforce") else 1.0
    critic = estimator == "gae"  # else V = 0 and lambd = 1: discounted returns
    advantages, returns = gae_advantages(
        token_rewards, live, batch.values if critic else None, gamma, batch.lambd if critic else 1.0
    )
    if estimator in BATCH_NORMALIZED:
        advantages = normalize_advantages(advantages, live, batch.no_std_norm)
    return AdvantageOutput(advantages=advantages, returns=returns)


@dataclass(frozen=True)
class AdvantageEstimator:
    """A built-in estimator as registered: ``estimator(batch) -> AdvantageOutput`` plus what it needs."""

    name: str
    needs_critic: bool
    min_samples_per_prompt: int

    def __call__(self, batch: AdvantageInput) -> AdvantageOutput:
        return compute_advantages(batch, self.name)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    name: AdvantageEstimator(
        name, needs_critic=name == "gae", min_samples_per_prompt=2 if name in GROUP_ESTIMATORS else 1
    )
    for name in ESTIMATOR_NAMES
}
