"""The rlhf command: dry runs, help, refusals, and `rlhf plugins`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_cli.assemble import HUB_OFFLINE_VARS, RunConfigError, assemble
from rlhf_core.config_parser import parse_config


def rlhf(*args, env=None):
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "rlhf_cli.main", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=120,
    )


def rlhf_here(capsys, *args) -> subprocess.CompletedProcess:
    """``rlhf ARGS`` in this process, for commands that need no environment of their own (a process of its own
    spends seconds importing torch, transformers and DeepSpeed): its exit code, stdout and stderr."""
    from rlhf_cli.main import main

    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def test_dry_run_prints_config_plugins_and_plan(tmp_path, tiny_model, capsys):
    reward = tmp_path / "reward.py"
    reward.write_text("def reward_func(queries, prompts, labels, **kw):\n    return [0.0] * len(queries)\n")
    out = rlhf_here(
        capsys,
        "train",
        "ppo",
        "--dry-run",
        "--pretrain",
        tiny_model,
        "--advantage_estimator",
        "group_norm",
        "--n_samples_per_prompt",
        "4",
        "--remote_rm_url",
        str(reward),
        "--colocate_all_models",
        "--actor_num_gpus_per_node",
        "2",
        "--ckpt.output_dir",
        str(tmp_path / "run"),
    )
    assert out.returncode == 0, out.stderr
    assert "estimator: group_norm" in out.stdout
    assert "advantage_estimators   group_norm" in out.stdout and "rlhf-algos" in out.stdout
    assert "pool actor+ref+rollout" in out.stdout
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


def test_dry_run_says_which_checkpoint_a_resume_would_use(tmp_path, tiny_model, capsys):
    from rlhf_core.checkpoint import CheckpointManager

    args = [
        "train",
        "sft",
        "--dry-run",
        "--pretrain",
        tiny_model,
        "--dataset",
        "d.jsonl",
        "--ckpt.output_dir",
        str(tmp_path),
        "--ckpt.load_enable",
    ]
    assert "no checkpoint under" in rlhf_here(capsys, *args).stdout
    mgr = CheckpointManager(tmp_path / "checkpoints")
    for step in (2, 4):
        mgr.save(step, lambda d: (d / "model_states.pt").write_bytes(b"never loaded"), {"step": step})
    out = rlhf_here(capsys, *args)  # model_states.pt is not a torch file: both are damaged
    assert out.returncode == 1
    assert f"no intact checkpoint under {mgr.root}: step_00000004 ({mgr.root / 'step_00000004'}" in out.stderr
    (mgr.root / "step_00000002" / "model_states.pt").unlink()
    mgr.save(2, lambda d: None, {"step": 2})  # an intact step 2 again; latest names it now
    (mgr.root / "latest").write_text("step_00000004\n")
    out = rlhf_here(capsys, *args)
    assert out.returncode == 0, out.stderr
    assert f"# --ckpt.load_enable: resumes from {mgr.root / 'step_00000002'}" in out.stdout
    assert "skipped step_00000004" in out.stderr


def test_help_shows_field_documentation(capsys):
    out = rlhf_here(capsys, "train", "ppo", "--help")
    assert out.returncode == 0
    assert "--algo.advantage.estimator" in out.stdout and "Registered advantage estimator" in out.stdout


def test_conflicting_options_are_refused_with_reasons(tiny_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not importable, as without the [wandb] extra
    cfg, _ = parse_config(
        "ppo",
        [
            "--pretrain",
            tiny_model,
            "--advantage_estimator",
            "rloo",
            "--n_samples_per_prompt",
            "1",
            "--train.partial_rollout_enable",
            "--vllm.enable_sleep",
            "--use_dynamic_batch",
            "--train_max_tokens_per_gpu",
            "0",
            "--rollout_max_tokens_per_gpu",
            "-5",
            "--enable_ema",
            "--ema_beta",
            "1.5",
            "--logger.wandb.key",
            "k",
            "--ds.lora.rank",
            "8",
            "--ds.lora.target_modules",
            "q_proj,lm_head",
            "--rollout.max_engine_restarts",
            "-1",
            "--train.episode_timeout",
            "-1",
        ],
    )
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
    assert "--logger.wandb.key: wandb is not installed (pip install 'rlhf-cli[wandb]')" in msg
    assert (
        "--ds.lora.target_modules lm_head: a LoRA policy's weight sync sends adapters of linear decoder"
        in msg
    )
    assert "--rollout.max_engine_restarts -1: a number of engine restarts must be 0 or more" in msg
    assert "--train.episode_timeout -1: seconds must be 0 (no limit) or more" in msg
    cfg, _ = parse_config(
        "ppo",
        [
            "--pretrain",
            tiny_model,
            "--remote_rm_url",
            "http://127.0.0.1:9/x",
            "--train.async_enable",
            "--train.partial_rollout_enable",
            "--rollout.max_engine_restarts",
            "2",
        ],
    )
    with pytest.raises(
        RunConfigError, match="max_engine_restarts 2 with --train.partial_rollout_enable: weights land"
    ):
        assemble("ppo", cfg, gpus=False)


def test_missing_estimator_says_which_package_to_install(tiny_model):
    out = rlhf(
        "train",
        "ppo",
        "--dry-run",
        "--pretrain",
        tiny_model,
        "--remote_rm_url",
        "http://127.0.0.1:9/x",
        env={"RLHF_DISABLE_PLUGINS": "rlhf-algos"},
    )
    assert out.returncode == 2
    assert "no advantage estimator named 'gae'" in out.stderr
    assert "pip install rlhf-algos" in out.stderr


def test_unknown_estimator_lists_the_registered_ones(tiny_model, capsys):
    out = rlhf_here(
        capsys,
        "train",
        "ppo",
        "--dry-run",
        "--pretrain",
        tiny_model,
        "--remote_rm_url",
        "http://127.0.0.1:9/x",
        "--algo.advantage.estimator",
        "grpo",
    )
    assert out.returncode == 2
    assert "no advantage estimator named 'grpo'" in out.stderr
    for name in ("gae", "group_norm", "rloo", "dr_grpo"):
        assert name in out.stderr


def test_plugins_json_lists_every_package_and_its_registrations(capsys):
    out = rlhf_here(capsys, "plugins", "--json")
    assert out.returncode == 0, out.stderr
    info = {d["distribution"]: d for d in json.loads(out.stdout)}
    assert set(info["rlhf-algos"]["seams"]["advantage_estimators"]) >= {
        "gae",
        "reinforce",
        "reinforce_baseline",
        "rloo",
        "group_norm",
        "dr_grpo",
    }
    assert set(info["rlhf-cli"]["seams"]["placement_strategies"]) == {
        "colocate_all",
        "colocate_actor_ref",
        "colocate_critic_reward",
        "separate",
    }
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


def test_async_with_deepspeed_sleep_is_accepted_and_vllm_sleep_is_not(monkeypatch):
    """OpenRLHF forbids only vLLM sleep with async: the trainers may sleep while they wait for a batch."""
    for var in HUB_OFFLINE_VARS:  # the script names a hub model, which a user with hub access can use
        monkeypatch.delenv(var, raising=False)
    agent = Path(__file__).resolve().parents[1] / "examples" / "agent_multistep.py"
    argv = ASYNC_AGENT_SCRIPT.replace("AGENT", str(agent)).split()
    cfg, _ = parse_config("ppo", argv)
    assert cfg.train.async_enable and cfg.ds.enable_sleep and cfg.train.colocate_all
    asm = assemble("ppo", cfg, gpus=True)
    assert {g.role for g in asm.plan.groups} >= {"actor", "ref", "rollout"}
    cfg.vllm.enable_sleep = True
    with pytest.raises(RunConfigError, match="cannot sleep: drop --vllm.enable_sleep"):
        assemble("ppo", cfg, gpus=True)


def test_kl_loss_with_a_zero_coefficient_is_accepted_with_a_note(tiny_model):
    cfg, _ = parse_config(
        "ppo",
        [
            "--pretrain",
            tiny_model,
            "--remote_rm_url",
            "http://127.0.0.1:9/x",
            "--use_kl_loss",
            "--init_kl_coef",
            "0",
        ],
    )
    asm = assemble("ppo", cfg, gpus=False)
    assert "ref" not in asm.roles  # no reference model: the KL term is 0
    assert any(
        "--algo.kl.use_loss with --algo.kl.init_coef 0: the KL loss term is zero" in n for n in asm.notes
    )


def test_over_generation_needs_async_and_at_least_a_batch(tiny_model):
    base = [
        "--pretrain",
        tiny_model,
        "--remote_rm_url",
        "http://127.0.0.1:9/x",
        "--rollout_batch_size",
        "8",
        "--train_batch_size",
        "8",
        "--micro_train_batch_size",
        "1",
    ]
    with pytest.raises(RunConfigError, match="only the async pipeline does: add --train.async_enable"):
        assemble("ppo", parse_config("ppo", base + ["--vllm_generate_batch_size", "16"])[0], gpus=False)
    with pytest.raises(RunConfigError, match="vllm_generate_batch_size 4 is below --rollout.batch_size"):
        assemble(
            "ppo",
            parse_config("ppo", base + ["--vllm_generate_batch_size", "4", "--async_train"])[0],
            gpus=False,
        )
    assemble(
        "ppo",
        parse_config("ppo", base + ["--vllm_generate_batch_size", "16", "--async_train"])[0],
        gpus=False,
    )
    # the staleness limit: async only, and no lower than the schedule's own lag
    with pytest.raises(RunConfigError, match="--train.max_staleness limits .* add --train.async_enable"):
        assemble("ppo", parse_config("ppo", base + ["--train.max_staleness", "2"])[0], gpus=False)
    with pytest.raises(RunConfigError, match=r"max_staleness 1 is below --train.async_queue_size \(2\)"):
        assemble(
            "ppo",
            parse_config(
                "ppo", base + ["--async_train", "--async_queue_size", "2", "--train.max_staleness", "1"]
            )[0],
            gpus=False,
        )
    with pytest.raises(
        RunConfigError, match="--train.async_queue_size 0: the async pipeline generates at least"
    ):
        assemble(
            "ppo", parse_config("ppo", base + ["--async_train", "--async_queue_size", "0"])[0], gpus=False
        )
    assemble(
        "ppo", parse_config("ppo", base + ["--async_train", "--train.max_staleness", "1"])[0], gpus=False
    )


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
    assert code == 2 and "--teacher.model_name_or_path is an option of 'rlhf train kd' only" in out.err


def test_a_prm_reward_starts_no_reward_model_workers(tmp_path):
    from transformers import AutoConfig

    from rlhf_core.testing.tiny import make_tiny_llama

    prm = make_tiny_llama(tmp_path / "prm", num_words=60)
    args = [
        "--pretrain",
        prm,
        "--reward_pretrain",
        prm,
        "--advantage_estimator",
        "group_norm",
        "--n_samples_per_prompt",
        "4",
        "--init_kl_coef",
        "0",
    ]
    cfg, _ = parse_config("ppo", args)
    assert "reward" in assemble("ppo", cfg, gpus=False).roles  # a plain model: reward-model workers
    with pytest.raises(
        RunConfigError, match="--reward.prm_aggregation and --reward.prm_step_separator apply to"
    ):
        assemble("ppo", parse_config("ppo", args + ["--reward.prm_aggregation", "mean"])[0], gpus=False)
    with pytest.raises(
        RunConfigError, match="--reward.source prm: .* is not a PRM trained by rlhf train prm"
    ):
        assemble("ppo", parse_config("ppo", args + ["--reward.source", "prm"])[0], gpus=False)
    config = AutoConfig.from_pretrained(prm)
    config.prm_placeholder_token, config.prm_reward_tokens = "w50", ["w51", "w52"]
    config.save_pretrained(prm)
    assert "reward" not in assemble("ppo", cfg, gpus=False).roles  # the PRM scores in the rollout actors
    with pytest.raises(
        RunConfigError, match="--reward.prm_aggregation 'max'(.|\n)*--reward.normalize_enable"
    ):
        bad = ["--reward.prm_aggregation", "max", "--reward.normalize_enable"]
        assemble("ppo", parse_config("ppo", args + bad)[0], gpus=False)


# --- what the driver checks before any worker starts (and --dry-run with it) --------------------------------

REWARD_OK = "def reward_func(queries, prompts, labels, **kwargs):\n    return [0.0] * len(queries)\n"


def train_in_process(capsys, *args) -> tuple[int, str]:
    """``rlhf train ARGS`` in this process: its exit code and what it printed on stderr."""
    out = rlhf_here(capsys, "train", *args)
    return out.returncode, out.stderr


def ppo(model: str, out, *extra: str) -> list[str]:
    return [
        "ppo",
        "--pretrain",
        model,
        "--advantage_estimator",
        "group_norm",
        "--n_samples_per_prompt",
        "4",
        "--ckpt.output_dir",
        str(out),
        *extra,
    ]


@pytest.mark.parametrize(
    "source,message",
    [
        (
            "import numpy_typo\n" + REWARD_OK,
            "importing the file raised ModuleNotFoundError: No module named 'numpy_typo'",
        ),
        ("def reward_func(queries prompts):\n    return []\n", "importing the file raised SyntaxError"),
        (
            "def score(queries, prompts, labels):\n    return []\n",
            "the file defines no 'reward_func'; it defines: score",
        ),
        (
            "def reward_func(queries):\n    return []\n",
            "reward_func(queries) cannot be called as reward_func(queries, prompts, labels, **kwargs)",
        ),
        ("reward_func = 3\n", "reward_func is a int (3), not a function"),
    ],
)
def test_a_reward_file_that_cannot_work_is_refused_by_the_dry_run(
    tmp_path, capsys, tiny_model, source, message
):
    reward = tmp_path / "reward.py"
    reward.write_text(source)
    code, err = train_in_process(
        capsys, *ppo(tiny_model, tmp_path / "run", "--remote_rm_url", str(reward)), "--dry-run"
    )
    assert code == 2
    assert f"--reward.remote_url {reward}: {message}" in err
    assert "Traceback" not in err


def test_the_checks_run_before_ray_starts_and_nothing_is_written(tmp_path, capsys, tiny_model):
    import ray

    reward = tmp_path / "reward.py"
    reward.write_text("import numpy_typo\n" + REWARD_OK)
    assert not ray.is_initialized()
    code, err = train_in_process(capsys, *ppo(tiny_model, tmp_path / "run", "--remote_rm_url", str(reward)))
    assert code == 2 and "No module named 'numpy_typo'" in err
    assert not ray.is_initialized() and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--reward.source", "pyhton_file"],
            "no reward source named 'pyhton_file' (asked for by --reward.source "
            "pyhton_file). Did you mean 'python_file'?",
        ),
        (
            ["--train.env", "guess_numbr"],
            "no environment named 'guess_numbr' (asked for by --train.env guess_numbr). "
            "Did you mean 'guess_number'?",
        ),
        (["--train.agent_executor", "multi_trun"], "Did you mean 'multi_turn'?"),
        (["--reward.remote_url", "reward.txt"], "no reward source accepts 'reward.txt'"),
        (
            ["--train.agent_executor", "multi_turn", "--reward.remote_url", "http://127.0.0.1:9/x"],
            "--train.agent_executor multi_turn cannot be built from the flags (missing a required argument: "
            "'agent_instance_cls'): multi_turn needs --train.env NAME",
        ),
    ],
)
def test_misspelled_names_are_refused_with_a_suggestion(tmp_path, capsys, tiny_model, flags, message):
    code, err = train_in_process(capsys, *ppo(tiny_model, tmp_path / "run", *flags), "--dry-run")
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "source,message",
    [
        (
            "from rlhf_agents import MultiTurnAgentExecutor\n",
            "the file defines no 'AgentExecutor'; it defines: MultiTurnAgentExecutor",
        ),
        ("def AgentExecutor():\n    pass\n", "AgentExecutor is a function"),
        (
            "from rlhf_agents import AgentExecutorBase\n\n\nclass AgentExecutor(AgentExecutorBase):\n    pass\n",
            "AgentExecutor leaves execute unimplemented",
        ),
        (
            "from rlhf_agents import MultiTurnAgentExecutor\n\n\nclass AgentExecutor(MultiTurnAgentExecutor):\n    pass\n",
            "AgentExecutor cannot be built from the flags (missing a required argument: 'agent_instance_cls')",
        ),
    ],
)
def test_an_agent_file_without_a_usable_agent_executor_is_refused(
    tmp_path, capsys, tiny_model, source, message
):
    agent = tmp_path / "agent.py"
    agent.write_text(source)
    code, err = train_in_process(
        capsys, *ppo(tiny_model, tmp_path / "run", "--agent_func_path", str(agent)), "--dry-run"
    )
    assert code == 2 and f"--train.agent_func_path {agent}: {message}" in err and "Traceback" not in err


def test_an_agent_command_whose_program_is_missing_is_refused(tmp_path, capsys, tiny_model):
    agent = tmp_path / "agent.sh"
    code, err = train_in_process(
        capsys, *ppo(tiny_model, tmp_path / "run", "--train.agent_command", f"{agent} --fast"), "--dry-run"
    )
    assert code == 2 and f"--train.agent_command '{agent} --fast': {agent} does not exist" in err
    assert "Traceback" not in err


def test_model_paths_that_are_not_model_directories_are_named(tmp_path, capsys, tiny_model, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "runs" / "rl" / "model").mkdir(parents=True)
    (tmp_path / "runs" / "rl" / "model" / "config.json").write_text("{}")
    code, err = train_in_process(
        capsys,
        *ppo(
            "/no/such/model",
            tmp_path / "out",
            "--remote_rm_url",
            "http://127.0.0.1:9/x",
            "--ref.model_name_or_path",
            "empty",
            "--critic.model_name_or_path",
            "runs/rl",
            "--reward.model_name_or_path",
            "runs/rm",
        ),
        "--dry-run",
    )
    assert code == 2 and "Traceback" not in err and "Repo id" not in err
    assert "--actor.model_name_or_path /no/such/model: no such directory" in err
    assert "--ref.model_name_or_path empty: not a model directory (it has no config.json)" in err
    assert (
        "--critic.model_name_or_path runs/rl: not a model directory (it has no config.json); did you mean "
        "runs/rl/model?" in err
    )
    assert (
        "--reward.model_name_or_path runs/rm: no such directory" in err
    )  # runs/ exists here: a path, not a hub id
    code, err = train_in_process(
        capsys,
        "dpo",
        "--pretrain",
        tiny_model,
        "--ref_pretrain",
        "./sft_out",
        "--dataset",
        "prefs.jsonl",
        "--dry-run",
    )
    assert code == 2 and "--ref.model_name_or_path ./sft_out: no such directory" in err
    code, err = train_in_process(capsys, "sft", "--dataset", "sft.jsonl", "--dry-run")
    assert code == 2 and "--model.model_name_or_path is required" in err


def test_a_hub_id_is_accepted_online_and_must_be_cached_offline(tmp_path, tiny_model):
    """``org/name`` that is not a local path is a hub id: online the workers download it (a note says how it was
    read); with HF_HUB_OFFLINE=1 it must be in the local cache, which this test fills for one id."""
    snapshot = tmp_path / "hub" / "models--org--cached" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--cached" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--cached" / "refs" / "main").write_text("abc123")
    args = [
        "train",
        "ppo",
        "--dry-run",
        "--pretrain",
        "org/cached",
        "--ref_pretrain",
        "org/elsewhere",
        "--remote_rm_url",
        "http://127.0.0.1:9/x",
        "--advantage_estimator",
        "group_norm",
        "--n_samples_per_prompt",
        "4",
    ]
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"}
    online = rlhf(*args, env=env)
    assert online.returncode == 0, online.stderr
    assert (
        "note: --ref.model_name_or_path org/elsewhere is not a local directory: it is read as a Hugging "
        "Face Hub id" in online.stderr
    )
    offline = rlhf(*args, env={**env, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 2
    assert (
        "--ref.model_name_or_path org/elsewhere: no such directory, and as a Hugging Face Hub id it is not in "
        "the local cache (HF_HUB_OFFLINE is set" in offline.stderr
    )
    assert "org/cached" not in offline.stderr  # in the cache: accepted offline too


def test_debug_prints_the_traceback_too(tmp_path, capsys, tiny_model):
    reward = tmp_path / "reward.py"
    reward.write_text("import numpy_typo\n" + REWARD_OK)
    args = ppo(tiny_model, tmp_path / "run", "--remote_rm_url", str(reward))
    code, err = train_in_process(capsys, *args, "--dry-run", "--debug")
    assert code == 2 and "Traceback (most recent call last)" in err and "No module named 'numpy_typo'" in err
    assert err.rstrip().splitlines()[-1].startswith("  - --reward.remote_url")  # the message still ends it


def _install_dist(site, name: str, module: str, source: str) -> dict:
    """A distribution ``name`` with entry point ``hooks`` found through PYTHONPATH, as a pip-installed one is."""
    site.mkdir(exist_ok=True)
    (site / f"{module}.py").write_text(source)
    info = site / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[rlhf]\nhooks = {module}\n")
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.parametrize(
    "source,message",
    [
        # a plain function as an estimator: it has no needs_critic / min_samples_per_prompt
        (
            "from rlhf_core import hookimpl\n\ndef median(batch):\n    return None\n\n@hookimpl\n"
            "def rlhf_register_advantage_estimators(register):\n    register('median', median)\n",
            "median-dist (entry point 'hooks', hook rlhf_register_advantage_estimators) registered 'median' as an "
            "advantage estimator, but it has no min_samples_per_prompt, needs_critic (got function median)",
        ),
        (
            "import os\nfrom rlhf_core import hookimpl\n\n@hookimpl\ndef rlhf_register_advantage_estimators(register):\n"
            "    register('median', os.environ['MEDIAN_HOME'])\n",
            "median-dist (entry point 'hooks', hook rlhf_register_advantage_estimators) raised KeyError: 'MEDIAN_HOME'",
        ),
    ],
)
def test_a_broken_plugin_is_named_with_how_to_skip_it(tmp_path, tiny_model, source, message):
    env = _install_dist(tmp_path / "site", "median-dist", "median_plugin", source)
    out = rlhf(
        "train",
        *ppo(tiny_model, tmp_path / "run", "--remote_rm_url", "http://127.0.0.1:9/x"),
        "--dry-run",
        "--advantage_estimator",
        "median",
        env=env,
    )
    assert out.returncode == 2
    assert message in out.stderr and "RLHF_DISABLE_PLUGINS=median-dist" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr


@pytest.mark.parametrize("mode", ["ppo", "sft"])
@pytest.mark.parametrize(
    "flags,message",
    [
        (["--deepcompile"], "--ds.deepcompile"),
        (["--use_liger_kernel"], "--ds.use_liger_kernel"),
        (["--ds_tensor_parallel_size", "2"], "--ds.tensor_parallel_size"),
        (["--use_ds_universal_ckpt"], "--ds.use_universal_ckpt"),
    ],
)
def test_deepspeed_features_a_rank_cannot_run_are_refused_by_the_dry_run(
    tmp_path, capsys, tiny_model, mode, flags, message
):
    """These once passed --dry-run and failed inside a training rank; the driver now refuses them, by name."""
    if mode == "ppo":
        args = ppo(tiny_model, tmp_path / "run", "--remote_rm_url", "http://127.0.0.1:9/x", *flags)
    else:
        data = tmp_path / "sft.jsonl"
        data.write_text(json.dumps({"input": "w1", "output": "w2"}) + "\n")
        args = [
            "sft",
            "--pretrain",
            tiny_model,
            "--dataset",
            str(data),
            "--ckpt.output_dir",
            str(tmp_path / "run"),
            *flags,
        ]
    code, err = train_in_process(capsys, *args, "--dry-run")
    assert (
        code == 2
        and message in err
        and ("not wired into" in err or "not written by" in err)
        and "Traceback" not in err
    )
