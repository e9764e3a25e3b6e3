"""The built-in post-processors of ``rlhf generate``; what each writes, and ties: docs/generation.md."""

from __future__ import annotations

import math

from rlhf_core.types import PostProcessInput, PostProcessOptions, PostProcessor, ScoredSample

DEFAULT_CSFT_TEMPLATE = "{input} <rm_score>: {reward} "


def best_and_worst(group: list[ScoredSample]) -> tuple[ScoredSample, ScoredSample]:
    """The samples of highest and lowest reward; among equals the first in sample order."""
    return (
        max(group, key=lambda s: (s.reward, -s.sample_index)),
        min(group, key=lambda s: (s.reward, s.sample_index)),
    )


def z_scores(rewards: list[float]) -> list[float]:
    """``(r - mean) / std`` over all rewards, float64, with the sample std (n - 1); all zeros when the
    rewards do not vary (or there is one)."""
    n = len(rewards)
    mean = math.fsum(rewards) / n if n else 0.0
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / (n - 1)) if n > 1 else 0.0
    return [(r - mean) / std if std > 0 else 0.0 for r in rewards]


class RejectionSampling(PostProcessor):  # the protocol's check: no option to check
    """``rs``: the best of each prompt's samples, as SFT data ``{"input", "output", "reward"}``."""

    def __call__(self, batch: PostProcessInput) -> list[dict]:
        return [
            {"input": b.input, "output": b.output, "reward": b.reward}
            for b, _ in map(best_and_worst, batch.groups)
        ]


class IterativeDPO(PostProcessor):  # the protocol's check: no option to check
    """``iter_dpo``: each prompt's best and worst samples as a preference pair; none where the rewards tie."""

    def __call__(self, batch: PostProcessInput) -> list[dict]:
        return [
            {
                "prompt": best.input,
                "chosen": best.output,
                "chosen_reward": best.reward,
                "rejected": worst.output,
                "rejected_reward": worst.reward,
            }
            for best, worst in map(best_and_worst, batch.groups)
            if best.reward != worst.reward
        ]


class ConditionalSFT:
    """``csft``: every sample, its reward (with ``--generate.normalize_reward`` its :func:`z_scores`) written
    into the prompt by ``--generate.reward_template``."""

    def check(self, options: PostProcessOptions) -> None:
        template = options.reward_template or DEFAULT_CSFT_TEMPLATE
        if missing := [f for f in ("{input}", "{reward}") if f not in template]:
            raise ValueError(f"--generate.reward_template {template!r} must contain {' and '.join(missing)}")
        try:
            template.format(input="", reward="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"--generate.reward_template {template!r}: only {{input}} and {{reward}} may be "
                f"filled in ({type(exc).__name__}: {exc}); write a literal brace as {{{{ or }}}}"
            ) from None

    def __call__(self, batch: PostProcessInput) -> list[dict]:
        template = batch.options.reward_template or DEFAULT_CSFT_TEMPLATE
        samples = [s for group in batch.groups for s in group]
        rewards = [s.reward for s in samples]
        if batch.options.normalize_reward:
            rewards = z_scores(rewards)
        return [
            {
                "input": template.format(input=s.input, reward=f"{r:.2f}"),
                "output": s.output,
                "reward": round(r, 2),
            }
            for s, r in zip(samples, rewards)
        ]


BUILTIN = {"rs": RejectionSampling(), "iter_dpo": IterativeDPO(), "csft": ConditionalSFT()}
