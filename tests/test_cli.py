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


def test_dry_run_says_which_checkpoint_a_resume_would_use(tmp_path):
    from rlhf_train_deepspeed.checkpoint import CheckpointManager

    args = ["train", "sft", "--dry-run", "--pretrain", "/m", "--dataset", "d.jsonl", "--ckpt.output_dir",
            str(tmp_path), "--ckpt.load_enable"]
    assert "no checkpoint under" in rlhf(*args).stdout
    mgr = CheckpointManager(tmp_path / "checkpoints")
    for step in (2, 4):
        mgr.save(step, lambda d: (d / "model_states.pt").write_bytes(b"never loaded"), {"step": step})
    out = rlhf(*args)  # model_states.pt is not a torch file: both are damaged
    assert out.returncode == 1
    assert f"no intact checkpoint under {mgr.root}: step_00000004 ({mgr.root / 'step_00000004'}" in out.stderr
    (mgr.root / "step_00000002" / "model_states.pt").unlink()
    mgr.save(2, lambda d: None, {"step": 2})  # an intact step 2 again; latest names it now
    (mgr.root / "latest").write_text("step_00000004\n")
    out = rlhf(*args)
    assert out.returncode == 0, out.stderr
    assert f"# --ckpt.load_enable: resumes from {mgr.root / 'step_00000002'}" in out.stdout
    assert "skipped step_00000004" in out.stderr


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


def test_prm_and_kd_dry_runs_check_their_tokens_and_teacher(tmp_path, capsys):
    from rlhf_cli.main import main
    from rlhf_core.testing.tiny import make_tiny_llama

    def run(*args):
        code = main(list(args))
        return code, capsys.readouterr()

    model = make_tiny_llama(tmp_path / "m", num_words=60)
    prm = ["train", "prm", "--dry-run", "--pretrain", model, "--dataset", "d.jsonl", "--label_key", "value"]
    code, out = run(*prm, "--placeholder_token", "w50", "--reward_tokens", "w51", "w52")
    assert code == 0, out.err
    assert "placeholder_token: w50" in out.out and "reward_tokens: [w51, w52]" in out.out
    code, out = run(*prm, "--placeholder_token", "w50", "--reward_tokens", "w51 w52", "w53")
    assert code == 2 and "--prm.reward_tokens 'w51 w52' is 2 tokens" in out.err
    code, out = run(*prm)
    assert code == 2 and "needs --prm.placeholder_token" in out.err

    kd = ["train", "kd", "--dry-run", "--pretrain", model, "--dataset", "d.jsonl"]
    code, out = run(*kd)
    assert code == 2 and "needs a teacher: --teacher.model_name_or_path" in out.err
    code, out = run(*kd, "--teacher_model", model, "--kd_coef", "0.5", "--teacher_offload")
    assert code == 0, out.err
    assert "kd_coef: 0.5" in out.out and "offload: true" in out.out
    code, out = run("train", "sft", "--dry-run", "--pretrain", model, "--teacher_model", model)
    assert code == 2 and "unknown option --teacher.model_name_or_path" in out.err


def test_a_prm_reward_starts_no_reward_model_workers(tmp_path):
    from transformers import AutoConfig

    from rlhf_core.testing.tiny import make_tiny_llama

    prm = make_tiny_llama(tmp_path / "prm", num_words=60)
    args = ["--pretrain", prm, "--reward_pretrain", prm, "--advantage_estimator", "group_norm",
            "--n_samples_per_prompt", "4", "--init_kl_coef", "0"]
    cfg, _ = parse_config("ppo", args)
    assert "reward" in assemble("ppo", cfg, gpus=False).roles  # a plain model: reward-model workers
    with pytest.raises(RunConfigError, match="--reward.prm_aggregation and --reward.prm_step_separator apply to"):
        assemble("ppo", parse_config("ppo", args + ["--reward.prm_aggregation", "mean"])[0], gpus=False)
    with pytest.raises(RunConfigError, match="--reward.source prm: .* is not a PRM trained by rlhf train prm"):
        assemble("ppo", parse_config("ppo", args + ["--reward.source", "prm"])[0], gpus=False)
    config = AutoConfig.from_pretrained(prm)
    config.prm_placeholder_token, config.prm_reward_tokens = "w50", ["w51", "w52"]
    config.save_pretrained(prm)
    assert "reward" not in assemble("ppo", cfg, gpus=False).roles  # the PRM scores in the rollout actors
    with pytest.raises(RunConfigError, match="--reward.prm_aggregation 'max'(.|\n)*--reward.normalize_enable"):
        bad = ["--reward.prm_aggregation", "max", "--reward.normalize_enable"]
        assemble("ppo", parse_config("ppo", args + bad)[0], gpus=False)
