"""Vision-language runs from the command line: OpenRLHF's VLM script plans with --dry-run, what cannot work
with images is refused before anything starts, and `rlhf doctor` says which image processing exists."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_cli.assemble import RunConfigError, assemble
from rlhf_core.config_parser import parse_config

ROOT = Path(__file__).resolve().parents[1]

# OpenRLHF's examples/scripts/train_vlm_math_hybrid_engine.sh (flat-flag release), with our reward file for
# theirs (its --init_kl_coef 0 with --use_kl_loss is accepted with a note that the KL term is zero).
OPENRLHF_VLM_SCRIPT = [
    "--ref_num_nodes",
    "1",
    "--ref_num_gpus_per_node",
    "4",
    "--actor_num_nodes",
    "1",
    "--actor_num_gpus_per_node",
    "4",
    "--vllm_num_engines",
    "4",
    "--vllm_tensor_parallel_size",
    "1",
    "--colocate_all_models",
    "--vllm_gpu_memory_utilization",
    "0.7",
    "--init_kl_coef",
    "0",
    "--gamma",
    "1.0",
    "--use_kl_loss",
    "--kl_estimator",
    "k2",
    "--advantage_estimator",
    "reinforce_baseline",
    "--pretrain",
    "Qwen/Qwen3.5-2B",
    "--remote_rm_url",
    "examples/reward_math.py",
    "--save_hf_ckpt",
    "--save_steps",
    "5",
    "--eval_steps",
    "-1",
    "--micro_train_batch_size",
    "1",
    "--micro_rollout_batch_size",
    "1",
    "--train_batch_size",
    "1024",
    "--rollout_batch_size",
    "128",
    "--n_samples_per_prompt",
    "8",
    "--num_episodes",
    "100",
    "--max_len",
    "4096",
    "--max_new_tokens",
    "2048",
    "--zero_stage",
    "3",
    "--param_dtype",
    "bf16",
    "--actor_learning_rate",
    "2e-6",
    "--prompt_data",
    "hiyouga/geometry3k",
    "--input_key",
    "prompt",
    "--label_key",
    "label",
    "--image_key",
    "images",
    "--max_images_per_prompt",
    "1",
    "--freeze_visual_encoder",
    "--apply_chat_template",
    "--gradient_checkpointing",
    "--attn_implementation",
    "eager",
    "--vllm_sync_backend",
    "nccl",
    "--enforce_eager",
    "--vllm_enable_sleep",
    "--deepspeed_enable_sleep",
]


def test_openrlhfs_vlm_script_plans_with_dry_run(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlhf_cli.main",
            "train",
            "ppo",
            "--dry-run",
            *OPENRLHF_VLM_SCRIPT,
            "--save_path",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "RLHF_NO_PROGRESS": "1"},
    )
    assert out.returncode == 0, out.stderr
    plan = out.stdout.split("# placement plan:")[1]
    # colocate_all: policy and engines share the bundles; with --init_kl_coef 0 no reference model is loaded
    assert "pool actor+rollout: 4 bundles" in plan
    for line in (
        "# vision-language model:",
        "model: Qwen/Qwen3.5-2B (not a local directory: not read)",
        "images: from --data.image_key images, 1 per prompt",
        "trained: the language model (the vision encoder is frozen)",
        "no critic, no packing",
    ):
        assert line in plan, plan
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from rlhf_core.testing.tiny import make_tiny_llama, make_tiny_vlm

    root = tmp_path_factory.mktemp("models")
    reward = root / "reward.py"
    reward.write_text("def reward_func(queries, prompts, labels, **kw):\n    return [0.0] * len(queries)\n")
    return {
        "vlm": make_tiny_vlm(root / "vlm"),
        "llama": make_tiny_llama(root / "llama"),
        "reward": str(reward),
    }


def plan(models, *flags, model="vlm"):
    cfg, _ = parse_config(
        "ppo",
        [
            "--pretrain",
            models[model],
            "--remote_rm_url",
            models["reward"],
            "--advantage_estimator",
            "group_norm",
            "--n_samples_per_prompt",
            "4",
            *flags,
        ],
    )
    return assemble("ppo", cfg, gpus=False)


def test_a_local_vlm_is_read_and_what_cannot_work_with_images_is_refused(models):
    asm = plan(models, "--image_key", "images")
    assert (
        asm.vision[0].endswith("(qwen2_vl)") and "the vision encoder and the language model" in asm.vision[2]
    )
    assert plan(models).vision  # a VLM actor is a vision-language run even without images in its prompts
    assert plan(models, model="llama").vision == []
    refusals = [
        (
            ["--advantage_estimator", "gae"],
            "needs a critic, and a critic for a vision-language model is not supported",
        ),
        (["--packing_samples"], "--ds.packing_samples: images go with each sequence"),
        (["--lora_rank", "8"], "--ds.lora.rank: LoRA on a vision-language model is not supported yet"),
        (["--reward_pretrain", models["llama"]], "a reward model would score the text without the images"),
        (
            ["--train.agent_executor", "openai_server"],
            "openai_server sends text messages and cannot carry images",
        ),
    ]
    for flags, reason in refusals:
        with pytest.raises(RunConfigError, match="this vision-language run cannot start") as err:
            plan(models, "--image_key", "images", *flags)
        assert reason in str(err.value)
    for flag in (["--image_key", "images"], ["--freeze_visual_encoder"]):
        with pytest.raises(
            RunConfigError,
            match=rf"{flag[0].replace('--', '--(data|actor).')}: .*llama is not a "
            "vision-language model",
        ):
            plan(models, *flag, model="llama")


def test_the_vllm_engine_with_a_vlm_is_refused_where_torchvision_does_not_import(models):
    """vLLM's Qwen-VL modules import transformers' torchvision image processor; PyPI's torchvision does not
    import beside the pinned CPU torch, so here a VLM run on vLLM is refused before anything starts."""
    import importlib.util

    from rlhf_rollout_vllm.plugin import VLLMEngineFactory

    if VLLMEngineFactory().available() is not None:
        pytest.skip(f"needs a runnable vLLM: {VLLMEngineFactory().available()}")
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: vLLM can load the model")
    with pytest.raises(
        RunConfigError,
        match=r"--rollout.engine vllm cannot run here: vLLM's vision-language models "
        r"import torchvision, which does not import here \(ModuleNotFound",
    ):
        plan(models, "--rollout.engine", "vllm", "--image_key", "images")
    text_cfg, _ = parse_config("ppo", ["--pretrain", models["llama"], "--rollout.engine", "vllm"])
    assert "torchvision" not in (VLLMEngineFactory().config_problem(text_cfg) or "")  # a text model is not


def test_auto_engine_on_a_gpu_takes_hf_for_a_vlm_that_vllm_cannot_run_gpu_mocked(models, monkeypatch):
    """--rollout.engine auto prefers vLLM on a GPU, but not for a configuration vLLM refuses (here: a VLM
    without an importable torchvision). The GPU is mocked (torch.cuda.is_available): none exists here."""
    import torch

    from rlhf_cli.assemble import choose_engine
    from rlhf_core.plugins import get_plugin_manager

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "torchvision", None)  # not importable
    pm = get_plugin_manager()
    cfgs = {
        name: parse_config("ppo", ["--pretrain", models[name], "--remote_rm_url", models["reward"]])[0]
        for name in ("vlm", "llama")
    }
    assert cfgs["vlm"].rollout.engine == "auto"
    assert choose_engine(cfgs["llama"], pm) == "vllm"
    assert choose_engine(cfgs["vlm"], pm) == "hf"
