"""The rlhf command: dry runs, help, refusals, and `rlhf plugins`."""

import json
import os
import subprocess
import sys

import pytest

from rlhf_cli.assemble import RunConfigError, assemble
from rlhf_core.config_parser import parse_config


def rlhf(*args, env=None):
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "rlhf_cli.main", *args], capture_output=True, text=True,
                          env=full_env, timeout=120)


def test_dry_run_prints_config_plugins_and_plan(tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text("def reward_func(queries, prompts, labels, **kw):\n    return [0.0] * len(queries)\n")
    out = rlhf("train", "ppo", "--dry-run", "--pretrain", "/m", "--advantage_estimator", "group_norm",
               "--n_samples_per_prompt", "4", "--remote_rm_url", str(reward), "--colocate_all_models",
               "--actor_num_gpus_per_node", "2", "--ckpt.output_dir", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr
    assert "estimator: group_norm" in out.stdout
    assert "advantage_estimators   group_norm" in out.stdout and "rlhf-algos" in out.stdout
    assert "pool actor+ref+rollout" in out.stdout
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


def test_help_shows_field_documentation():
    out = rlhf("train", "ppo", "--help")
    assert out.returncode == 0
    assert "--algo.advantage.estimator" in out.stdout and "Registered advantage estimator" in out.stdout


def test_conflicting_options_are_refused_with_reasons(tmp_path):
    cfg, _ = parse_config("ppo", ["--pretrain", "/m", "--advantage_estimator", "rloo", "--n_samples_per_prompt",
                                  "1", "--train.partial_rollout_enable", "--vllm.enable_sleep", "--use_dynamic_batch",
                                  "--train_max_tokens_per_gpu", "0", "--rollout_max_tokens_per_gpu", "-5",
                                  "--enable_ema", "--ema_beta", "1.5"])
    assert cfg.train.dynamic_batch_enable  # the OpenRLHF names map to the dotted ones
    with pytest.raises(RunConfigError) as err:
        assemble("ppo", cfg, gpus=False)
    msg = str(err.value)
    assert "needs --rollout.n_samples_per_prompt >= 2 (got 1)" in msg
    assert "no reward" in msg
    assert "--train.partial_rollout_enable only applies" in msg
    assert "need --train.colocate_all" in msg
    assert "--train.max_tokens_per_gpu 0: a token budget per micro-batch must be positive" in msg
    assert "--rollout.max_tokens_per_gpu -5: a token budget" in msg
    assert "--train.ema_beta 1.5: the EMA decay must be in [0, 1)" in msg


def test_missing_estimator_says_which_package_to_install():
    out = rlhf("train", "ppo", "--dry-run", "--pretrain", "/m", "--remote_rm_url", "http://127.0.0.1:9/x",
               env={"RLHF_DISABLE_PLUGINS": "rlhf-algos"})
    assert out.returncode == 2
    assert "no advantage estimator named 'gae'" in out.stderr
    assert "pip install rlhf-algos" in out.stderr


def test_unknown_estimator_lists_the_registered_ones():
    out = rlhf("train", "ppo", "--dry-run", "--pretrain", "/m", "--remote_rm_url", "http://127.0.0.1:9/x",
               "--algo.advantage.estimator", "grpo")
    assert out.returncode == 2
    assert "no advantage estimator named 'grpo'" in out.stderr
    for name in ("gae", "group_norm", "rloo", "dr_grpo"):
        assert name in out.stderr


def test_plugins_json_lists_every_package_and_its_registrations():
    out = rlhf("plugins", "--json")
    assert out.returncode == 0, out.stderr
    info = {d["distribution"]: d for d in json.loads(out.stdout)}
    assert set(info["rlhf-algos"]["seams"]["advantage_estimators"]) >= {
        "gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo"}
    assert set(info["rlhf-cli"]["seams"]["placement_strategies"]) == {
        "colocate_all", "colocate_actor_ref", "colocate_critic_reward", "separate"}
    assert "hf" in info["rlhf-core"]["seams"]["rollout_engines"]
    assert "deepspeed" in info["rlhf-train-deepspeed"]["seams"]["train_backends"]
    assert info["rlhf-algos"]["version"] == "0.1.0"


def test_example_plugin_appears_through_its_entry_point_and_can_be_disabled():
    shown = json.loads(rlhf("plugins", "--json").stdout)
    names = {d["distribution"]: d for d in shown}
    assert "group_median" in names["rlhf-example-plugin"]["seams"]["advantage_estimators"]
    hidden = json.loads(rlhf("plugins", "--json", env={"RLHF_DISABLE_PLUGINS": "rlhf-example-plugin"}).stdout)
    assert "rlhf-example-plugin" not in {d["distribution"] for d in hidden}
    only = json.loads(rlhf("plugins", "--json", env={"RLHF_LOAD_PLUGINS": "rlhf-example-plugin"}).stdout)
    assert {d["distribution"] for d in only} == {"rlhf-example-plugin"}


# OpenRLHF's examples/scripts/train_reinforce_baseline_ray_agent_async.sh, flat spellings, paths shortened
ASYNC_AGENT_SCRIPT = """
--pretrain Qwen/Qwen3-4B-Thinking-2507 --load_checkpoint --save_path exp --ckpt_path exp/ckpt --save_hf_ckpt
--max_ckpt_num 3 --save_steps 10 --agent_func_path AGENT --prompt_data zhuzilin/dapo-math-17k --input_key prompt
--label_key label --prompt_max_len 10240 --generate_max_len 64000 --apply_chat_template --packing_samples
--rollout_batch_size 128 --n_samples_per_prompt 8 --train_batch_size 1024 --dynamic_filtering
--dynamic_filtering_reward_range 0.0 1.0 --use_dynamic_batch --train_max_tokens_per_gpu 16192
--rollout_max_tokens_per_gpu 32768 --micro_train_batch_size 1 --micro_rollout_batch_size 8 --max_samples 128000
--max_epochs 1 --num_episodes 1 --async_train --ref_num_nodes 1 --ref_num_gpus_per_node 4 --actor_num_nodes 1
--actor_num_gpus_per_node 4 --vllm_num_engines 2 --vllm_tensor_parallel_size 2 --vllm_gpu_memory_utilization 0.7
--colocate_all_models --deepspeed_enable_sleep --vllm_sync_backend nccl --enforce_eager --gradient_checkpointing
--ring_attn_size 2 --ring_head_stride 2 --param_dtype bf16 --advantage_estimator reinforce_baseline
--actor_learning_rate 5e-7 --entropy_loss_coef 0.0 --init_kl_coef 1e-5 --use_kl_loss --kl_estimator k2
--enable_vllm_is_correction --vllm_is_correction_type icepop --use_tensorboard exp/runs --logging_steps 1
--eval_steps -1
"""


def test_async_with_deepspeed_sleep_is_accepted_and_vllm_sleep_is_not(tmp_path):
    """OpenRLHF forbids only vLLM sleep with async: the trainers may sleep while they wait for a batch."""
    agent = tmp_path / "agent.py"
    agent.write_text("# stand-in for the user's agent file\n")
    argv = ASYNC_AGENT_SCRIPT.replace("AGENT", str(agent)).split()
    cfg, _ = parse_config("ppo", argv)
    assert cfg.train.async_enable and cfg.ds.enable_sleep and cfg.train.colocate_all
    asm = assemble("ppo", cfg, gpus=True)
    assert {g.role for g in asm.plan.groups} >= {"actor", "ref", "rollout"}
    cfg.vllm.enable_sleep = True
    with pytest.raises(RunConfigError, match="cannot sleep: drop --vllm.enable_sleep"):
        assemble("ppo", cfg, gpus=True)


def test_kl_loss_with_a_zero_coefficient_is_accepted_with_a_note():
    cfg, _ = parse_config("ppo", ["--pretrain", "/m", "--remote_rm_url", "http://127.0.0.1:9/x", "--use_kl_loss",
                                  "--init_kl_coef", "0"])
    asm = assemble("ppo", cfg, gpus=False)
    assert "ref" not in asm.roles  # no reference model: the KL term is 0
    assert any("--algo.kl.use_loss with --algo.kl.init_coef 0: the KL loss term is zero" in n for n in asm.notes)


def test_over_generation_needs_async_and_at_least_a_batch():
    base = ["--pretrain", "/m", "--remote_rm_url", "http://127.0.0.1:9/x", "--rollout_batch_size", "8",
            "--train_batch_size", "8", "--micro_train_batch_size", "1"]
    with pytest.raises(RunConfigError, match="only the async pipeline does: add --train.async_enable"):
        assemble("ppo", parse_config("ppo", base + ["--vllm_generate_batch_size", "16"])[0], gpus=False)
    with pytest.raises(RunConfigError, match="vllm_generate_batch_size 4 is below --rollout.batch_size"):
        assemble("ppo", parse_config("ppo", base + ["--vllm_generate_batch_size", "4", "--async_train"])[0],
                 gpus=False)
    assemble("ppo", parse_config("ppo", base + ["--vllm_generate_batch_size", "16", "--async_train"])[0], gpus=False)
