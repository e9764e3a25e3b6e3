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



def test_over_generation_needs_async_and_at_least_a_batch():
    base = ["--pretrain", "/m", "--remote_rm_url", "http://127.0.0.1:9/x", "--rollout_batch_size", "8",
            "--train_batch_size", "8", "--micro_train_batch_size", "1"]
    with pytest.raises(RunConfigError, match="only the async pipeline does: add --train.async_enable"):
        assemble("ppo", parse_config("ppo", base + ["--vllm_generate_batch_size", "16"])[0], gpus=False)
    with pytest.raises(RunConfigError, match="vllm_generate_batch_size 4 is below --rollout.batch_size"):
        assemble("ppo", parse_config("ppo", base + ["--vllm_generate_batch_size", "4", "--async_train"])[0],
                 gpus=False)
    assemble("ppo", parse_config("ppo", base + ["--vllm_generate_batch_size", "16", "--async_train"])[0], gpus=False)
