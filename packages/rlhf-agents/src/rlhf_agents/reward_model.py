"""Scoring with a reward model: an HF ``AutoModelForSequenceClassification`` whose value head (``score``)
gives one number per sequence, read at its last non-pad token. Used by ``rlhf serve-rm`` (text in) and by the
``reward_model`` reward source when no Ray reward-model workers are given (token ids in)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from rlhf_core.config import resolve_param_dtype

logger = logging.getLogger(__name__)


def right_padded(seqs: list[list[int]], pad_id: int, device: Any) -> tuple[Any, Any]:
    """``[B, L]`` token ids and attention mask of ``seqs``, padded on the right (which keeps positions
    ``0..len-1`` as in an unpadded pass)."""
    ids = torch.full((len(seqs), max(1, max(len(s) for s in seqs))), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
    return ids.to(device), mask.to(device)


class RewardModelScorer:
    """A reward model loaded from a local HF directory, scoring batches of sequences. Sequences longer than
    ``max_len`` keep their last ``max_len`` tokens (the reward is read at the end). With ``normalize``,
    rewards become ``(r - mean) / std`` using ``config.mean`` and ``config.std`` as stored at RM training
    time."""

    def __init__(
        self,
        model_name_or_path: str,
        value_head_prefix: str = "score",
        normalize: bool = False,
        max_len: int = 2048,
        batch_size: int = 16,
        dtype: str = "fp32",
        attn_implementation: str = "sdpa",
        use_fast_tokenizer: bool = True,
        device: str | None = None,
        model_kwargs: dict[str, Any] | None = None,
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from rlhf_core.rollout.hf_engine import DTYPES

        if dtype not in DTYPES:
            raise ValueError(f"--ds.param_dtype {dtype}: expected one of {', '.join(DTYPES)}")
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, use_fast=use_fast_tokenizer)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            model_name_or_path,
            num_labels=1,
            dtype=DTYPES[dtype],
            attn_implementation=attn_implementation,
            **(model_kwargs or {}),
        ).to(self.device)
        self.model.eval()
        self.head = getattr(self.model, value_head_prefix, None)
        if not isinstance(self.head, torch.nn.Module):
            children = ", ".join(name for name, _ in self.model.named_children())
            raise ValueError(
                f"--ds.value_head_prefix {value_head_prefix}: the model at {model_name_or_path} "
                f"has no such module (it has: {children})"
            )
        pad = self.tokenizer.pad_token_id
        self.pad_id = (self.tokenizer.eos_token_id or 0) if pad is None else pad
        self.max_len, self.batch_size = max_len, batch_size
        self.mean, self.std = 0.0, 1.0
        if normalize:
            mean, std = getattr(self.model.config, "mean", None), getattr(self.model.config, "std", None)
            if mean is None or std is None:
                logger.warning(
                    "--reward.normalize_enable: %s stores no mean/std in its config.json; rewards "
                    "are not normalised",
                    model_name_or_path,
                )
            else:
                self.mean, self.std = float(mean), max(float(std), 1e-8)

    def compute_rewards(self, sequences: list[list[int]]) -> list[float]:
        """One reward per token-id sequence; NaN for an empty sequence."""
        rewards: list[float] = []
        for start in range(0, len(sequences), self.batch_size):
            chunk = [list(s)[-self.max_len :] for s in sequences[start : start + self.batch_size]]
            ids, mask = right_padded(chunk, self.pad_id, self.device)
            with torch.no_grad():
                out = self.model.base_model(input_ids=ids, attention_mask=mask)
                values = self.head(out.last_hidden_state).squeeze(-1).float()  # [b, L, H] -> [b, L]
            last = (mask.sum(-1) - 1).clamp(min=0)  # index of the last real token
            out = (values.gather(1, last[:, None]).squeeze(1) - self.mean) / self.std
            rewards += [float("nan") if len(seq) == 0 else float(r) for seq, r in zip(chunk, out.tolist())]
        return rewards

    def score_texts(self, texts: list[str]) -> list[float]:
        """One reward per text (prompt and response together, as decoded with special tokens kept)."""
        return self.compute_rewards([self.tokenizer.encode(t, add_special_tokens=False) for t in texts])

    @classmethod
    def from_config(cls, cfg: Any) -> RewardModelScorer:
        """The reward model of ``cfg.reward.model_name_or_path``, in this process."""
        return cls(
            cfg.reward.model_name_or_path,
            value_head_prefix=cfg.ds.value_head_prefix,
            normalize=cfg.reward.normalize_enable,
            max_len=cfg.data.max_len,
            batch_size=cfg.rollout.micro_batch_size,
            dtype=resolve_param_dtype(cfg.ds.param_dtype),
            attn_implementation=cfg.ds.attn_implementation,
        )
