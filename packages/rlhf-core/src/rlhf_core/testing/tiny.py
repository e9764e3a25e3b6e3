"""Tiny models and tokenizers built locally, for tests and benchmarks (nothing is downloaded).

The tokenizer is a whitespace word-level vocabulary: special tokens, chat-role markers, then the words
``w0 .. w{n-1}``. Text is written as space-separated words (``"w3 w17 w5"``), so token counts are exact.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]

# A chat template that is prefix-stable: rendering messages[:k] is a prefix of rendering messages[:k+1],
# which is what per-turn loss masks rely on.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def make_tiny_tokenizer(path: str | Path | None = None, num_words: int = 200):
    """A ``PreTrainedTokenizerFast`` with ``len(SPECIAL_TOKENS) + num_words`` tokens and a chat template.

    Padding is on the right; ``pad_token_id`` is 0, ``bos`` 1, ``eos`` 2. When ``path`` is given the
    tokenizer is saved there with ``save_pretrained``.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + [f"w{i}" for i in range(num_words)])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="right",
    )
    tok.chat_template = CHAT_TEMPLATE
    if path is not None:
        tok.save_pretrained(str(path))
    return tok


def _text_config(tok) -> dict:
    """The language model of every tiny model here: hidden 32, 2 layers, 4 heads (2 KV heads)."""
    return dict(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )


def make_tiny_llama(path: str | Path, seed: int = 0, num_words: int = 200, **overrides) -> str:
    """Save a randomly initialised tiny fp32 ``LlamaForCausalLM`` (:func:`_text_config`; ``overrides`` go to
    ``LlamaConfig``) and its tokenizer to ``path``; returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    tok = make_tiny_tokenizer(path, num_words=num_words)
    kwargs = {**_text_config(tok), "tie_word_embeddings": False, "attn_implementation": "sdpa", **overrides}
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**kwargs)).save_pretrained(str(path))
    return str(path)


def tiny_decoder(kind: str):
    """A random 2-layer decoder (in eval mode) of each Llama-family model type, with the feature that family
    adds: Llama with llama3 RoPE scaling and biases everywhere, Qwen2's q/k/v biases, Qwen3's per-head q/k
    norms and a head_dim that is not hidden/heads, Mistral's GQA. Biases and norm weights are random, so
    that a code path that misses one shows. ``kind``: llama, qwen2, qwen3, mistral."""
    import torch
    import transformers as tf

    common = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=2,
    )
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    families = {
        "llama": (
            tf.LlamaForCausalLM,
            tf.LlamaConfig,
            dict(attention_bias=True, mlp_bias=True, rope_parameters=rope),
        ),
        "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config, {}),
        "qwen3": (tf.Qwen3ForCausalLM, tf.Qwen3Config, dict(head_dim=16)),
        "mistral": (tf.MistralForCausalLM, tf.MistralConfig, dict(sliding_window=None)),
    }
    if kind not in families:
        raise ValueError(f"unknown kind {kind!r}: llama, qwen2, qwen3 or mistral")
    model_cls, config_cls, extra = families[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**common, **extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.3 if "norm" in name else 0.0, 0.2)
    return model.eval()


# The image tokens of the Qwen-VL family: a chat template writes VISION_START IMAGE_PAD VISION_END per image.
VLM_SPECIAL_TOKENS = [
    "<|vision_start|>",
    "<|image_pad|>",
    "<|vision_end|>",
    "<|video_pad|>",
    "<|im_start|>",
    "<|im_end|>",
]
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
# CHAT_TEMPLATE, with message contents that may be lists of {"type": "image"} and {"type": "text"} items
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    + IMAGE_PLACEHOLDER
    + " {% else %}{{ c['text'] }} "
    "{% endif %}{% endfor %}{% endif %} </s> {% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def make_tiny_vlm(
    path: str | Path,
    seed: int = 0,
    num_words: int = 200,
    kind: str = "qwen2_vl",
    text: dict | None = None,
    vision: dict | None = None,
) -> str:
    """Save a randomly initialised tiny Qwen2-VL (``kind`` ``qwen2_vl``) or Qwen2.5-VL (``qwen2_5_vl``) with
    its tokenizer (:func:`make_tiny_tokenizer` plus the image tokens) and its image processor to ``path``.

    Defaults: text hidden 32, 2 layers, 4 heads (2 KV heads); a 1-block vision tower of width 32 with 14-pixel
    patches merged 2 x 2, so a 56 x 56 image is 16 patches and 4 image tokens. Images are resized to between
    56 x 56 and 112 x 112 pixels. ``text`` / ``vision`` override the sub-configs.
    """
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = Path(path)
    tok = make_tiny_tokenizer(num_words=num_words)
    tok.add_special_tokens({"additional_special_tokens": VLM_SPECIAL_TOKENS})
    tok.chat_template = VLM_CHAT_TEMPLATE
    tok.save_pretrained(str(path))
    ids = {t: tok.convert_tokens_to_ids(t) for t in VLM_SPECIAL_TOKENS}
    text_config = {
        **_text_config(tok),
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
        **(text or {}),
    }
    per_kind = {
        "qwen2_vl": dict(embed_dim=32, mlp_ratio=2),
        "qwen2_5_vl": dict(
            intermediate_size=64, out_hidden_size=32, window_size=56, fullatt_block_indexes=[0]
        ),
    }
    if kind not in per_kind:
        raise ValueError(f"unknown kind {kind!r}: qwen2_vl or qwen2_5_vl")
    vision_config = {
        **dict(
            depth=1,
            hidden_size=32,
            num_heads=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_chans=3,
        ),
        **per_kind[kind],
        **(vision or {}),
    }
    config = AutoConfig.for_model(
        kind,
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(str(path))
    Qwen2VLImageProcessorPil(
        min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2, temporal_patch_size=2
    ).save_pretrained(str(path))
    return str(path)
