"""The real-model fixture itself: what SmolLM2-135M-Instruct holds that toy models do not."""

import pytest

pytestmark = pytest.mark.real_model


def test_smollm2_is_an_ordinary_hf_directory_with_the_real_properties(smollm2):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(smollm2)
    assert getattr(config, "quantization_config", None) is None  # de-quantized: loads without gguf
    assert (config.vocab_size, config.num_attention_heads, config.num_key_value_heads) == (49152, 9, 3)
    assert config.tie_word_embeddings and config.rope_parameters["rope_theta"] == 1e5
    tok = AutoTokenizer.from_pretrained(smollm2)
    assert tok.pad_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    # a pretrained instruct model, not a random one: greedy decoding answers the question
    out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "5" in tok.decode(out[0, len(ids):])


def test_a_missing_wheel_is_a_clear_error(tmp_path, monkeypatch):
    from rlhf_core.testing.smollm2 import RealModelUnavailable, smollm2_dir

    monkeypatch.setenv("RLHF_SMOLLM2_WHEEL", str(tmp_path / "nowhere.whl"))
    with pytest.raises(RealModelUnavailable, match="RLHF_SMOLLM2_WHEEL=.*nowhere.whl: no such file"):
        smollm2_dir(tmp_path / "cache")
    assert not (tmp_path / "cache" / "SmolLM2-135M-Instruct").exists()
