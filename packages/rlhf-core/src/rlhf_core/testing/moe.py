"""Tiny random mixture-of-experts models for tests (nothing is downloaded): Mixtral and Qwen3-MoE shapes with
2 layers, 4 experts, top-2 routing, hidden size 64 and 2 heads of 32, saved with the tiny word-level tokenizer."""

from __future__ import annotations

from pathlib import Path

from rlhf_core.testing.tiny import make_tiny_tokenizer

SHAPE = dict(
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,  # head_dim 32: the smallest vLLM's CPU attention runs
    num_key_value_heads=1,
    num_experts_per_tok=2,
    max_position_embeddings=512,
)


def make_tiny_moe(path: str | Path, family: str = "mixtral", seed: int = 0, num_words: int = 60) -> str:
    """Save a randomly initialised fp32 ``MixtralForCausalLM`` (``family="mixtral"``) or
    ``Qwen3MoeForCausalLM`` (``"qwen3_moe"``) and its tokenizer to ``path``; returns it."""
    import torch
    import transformers as tf

    path = Path(path)
    tok = make_tiny_tokenizer(path, num_words=num_words)
    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    common = dict(SHAPE, vocab_size=len(tok), tie_word_embeddings=False, **ids)
    if family == "mixtral":
        config = tf.MixtralConfig(**common, num_local_experts=4)
    elif family == "qwen3_moe":
        config = tf.Qwen3MoeConfig(**common, num_experts=4, moe_intermediate_size=32, head_dim=32)
    else:
        raise ValueError(f"unknown family {family!r}: mixtral or qwen3_moe")
    torch.manual_seed(seed)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return str(path)
