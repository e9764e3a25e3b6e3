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
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    # a pretrained instruct model, not a random one: greedy decoding answers the question
    out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "5" in tok.decode(out[0, len(ids) :])


def test_a_missing_wheel_is_a_clear_error(tmp_path, monkeypatch):
    from rlhf_core.testing.smollm2 import RealModelUnavailable, smollm2_dir

    monkeypatch.setenv("RLHF_SMOLLM2_WHEEL", str(tmp_path / "nowhere.whl"))
    with pytest.raises(RealModelUnavailable, match="RLHF_SMOLLM2_WHEEL=.*nowhere.whl: no such file"):
        smollm2_dir(tmp_path / "cache")
    assert not (tmp_path / "cache" / "SmolLM2-135M-Instruct").exists()


# --- the HF engine against the trainer's log-probs, on the real model ------------------------------------------

# Tolerances, per sampled token, |engine log-prob - one forward pass's log-prob|. The two sides run the same
# weights through different kernels and orders (token by token with a KV cache and fused projections, against
# one forward pass), so they agree to the rounding of the dtype, grown through 30 layers into logits of size
# ~10-30. fp32 (unit roundoff 2^-24 = 6e-8): measured mean 7e-6, max 4e-5; the RL run's criterion is a mean
# of 1e-4, and 1e-3 bounds any one token (a ~1e3 growth of 6e-8 on a logit of 20). bf16 keeps 8 significant
# bits (2^-9 = 2e-3 relative): one rounding of a logit of 20 is already ~0.04; measured mean 0.03-0.06, max
# 0.2-0.3, so a mean of 0.1 and a max of 1.0 bound that rounding with room for other machines' kernels.
AGREEMENT = {"fp32": (1e-4, 1e-3), "bf16": (0.1, 1.0)}


def _chat_prompts(model_dir: str) -> list[list[int]]:
    """Two-turn ChatML prompts: every turn ends with <|im_end|> (id 2, also the pad id) inside the prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    convs = [
        [
            {"role": "user", "content": "What is 2+3?"},
            {"role": "assistant", "content": "5"},
            {"role": "user", "content": "And 4+4?"},
        ],
        [{"role": "user", "content": "Name a color."}],
    ]
    return [
        list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
        for c in convs
    ]


def _nudged(state: dict, seed: int) -> dict:
    """The weights moved by 2% of each tensor's spread, as a few large optimizer steps would move them."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.02 * v.float().std() * torch.randn(v.shape, generator=gen) for k, v in state.items()}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_hf_engine_agrees_with_the_trainer_before_and_after_weight_syncs(smollm2, precision):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlhf_core.rollout.hf_engine import HFEngine, parse_dtype
    from rlhf_core.testing.engines import forward_logprobs
    from rlhf_core.types import GenerationRequest, SamplingParams

    dtype = parse_dtype(precision)
    prompts = _chat_prompts(smollm2)
    assert all(2 in p[:-1] for p in prompts[:1]) and prompts[1].count(2) >= 1  # the pad/EOS id inside
    engine = HFEngine(smollm2, dtype=precision, device="cpu")
    trainer = AutoModelForCausalLM.from_pretrained(smollm2, dtype=dtype).eval()  # the trainer's forward pass
    original = load_file(f"{smollm2}/model.safetensors")
    mean_tol, max_tol = AGREEMENT[precision]
    syncs = [None, _nudged(original, 1), _nudged(original, 2), original]  # before any sync, then three syncs
    means = []
    for i, weights in enumerate(syncs):
        if weights is not None:  # what the trainer sends: its own weights, in its dtype
            sent = {k: v.to(dtype) for k, v in weights.items()}
            trainer.load_state_dict(sent, strict=False)
            engine.update_weights(sent)
            engine.reset_prefix_cache()
        requests = [
            GenerationRequest(
                p, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=10 * i + j, ignore_eos=True)
            )
            for j, p in enumerate(prompts)
        ]
        gaps = []
        for req, outs in zip(requests, engine.generate(requests), strict=True):
            for out in outs:
                want = torch.tensor(forward_logprobs(trainer, req.prompt_ids, out.token_ids, 1.0))
                gaps.append((torch.tensor(out.logprobs) - want).abs())
        gap = torch.cat(gaps)
        means.append(float(gap.mean()))
        assert gap.mean() <= mean_tol and gap.max() <= max_tol, (precision, i, gap)
    print(f"{precision}: mean |engine - trainer| log-prob per sync: {means}")


@pytest.mark.slow
def test_a_run_without_precision_flags_keeps_engine_and_trainer_together(smollm2, tmp_path):
    """The new user's GRPO run, cut to one short step: no precision or placement flags. On CPU that is fp32 in
    one process, and the sampled tokens' log-probs of the engine and of the trainer agree (bf16 gave 0.04)."""
    import json
    import os
    import subprocess
    import sys

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n"
            for q in ("What is 2+3?", "Name a color.")
        )
    )
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def reward_func(queries, prompts, labels, **kw):\n"
        "    return [float(any(c.isdigit() for c in q[len(p):])) for q, p in zip(queries, prompts)]\n"
    )
    out = tmp_path / "run"
    env = {**os.environ, "RLHF_NO_PROGRESS": "1", "DS_ACCELERATOR": "cpu"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlhf_cli.main",
            "train",
            "ppo",
            "--pretrain",
            smollm2,
            "--remote_rm_url",
            str(reward),
            "--prompt_data",
            str(prompts),
            "--input_key",
            "messages",
            "--apply_chat_template",
            "--advantage_estimator",
            "group_norm",
            "--n_samples_per_prompt",
            "2",
            "--rollout_batch_size",
            "2",
            "--train_batch_size",
            "4",
            "--micro_train_batch_size",
            "4",
            "--generate_max_len",
            "4",
            "--max_steps",
            "1",
            "--save_path",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "--ds.param_dtype bf16" not in run.stderr  # no bf16, so no note about its gap
    assert (
        json.loads((out / "run.json").read_text())["plugins"]["placement_strategies"]["name"]
        == "colocate_all"
    )
    (row,) = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["policy/rollout_train_logprob_gap"] <= 1e-4, row["policy/rollout_train_logprob_gap"]


def test_hf_engine_static_cache_decodes_smollm2_like_the_growing_cache(smollm2):
    """The static-cache decoder (a GPU's default, there as a CUDA graph) on the real model in fp32 on CPU:
    the same tokens and log-probs as the default growing cache within 1e-4. Only the order of float32 sums
    over the masked cache columns differs: C * 2^-24 = 7.6e-6 relative per attention sum (C = 128 columns),
    through 30 layers into log-probs of magnitude ~10."""
    import torch

    from rlhf_core.rollout.hf_engine import HFEngine
    from rlhf_core.types import GenerationRequest, SamplingParams

    engine = HFEngine(smollm2, dtype="float32", device="cpu")
    requests = [
        GenerationRequest(p, SamplingParams(n=2, temperature=t, max_new_tokens=12, seed=j))
        for j, (p, t) in enumerate(zip(_chat_prompts(smollm2), (1.0, 0.0), strict=False))
    ]
    growing = engine.generate(requests)
    engine.static_cache = True
    static = engine.generate(requests)
    for a_outs, b_outs in zip(growing, static, strict=True):
        for a, b in zip(a_outs, b_outs, strict=True):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
