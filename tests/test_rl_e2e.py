"""`rlhf train ppo` end to end on CPU: local Ray, a tiny Llama built here, 2 DeepSpeed ZeRO-3 ranks, HF engine.

These runs share one Ray session (module fixture) and stay a few steps long; runs whose placement is not what
they test run in this process instead (in_one_process); the kill tests run the run they kill in a thread, and
the non-finite test drives the real command in a subprocess (its plugin reaches the workers through their
environment).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

# its own group: one test process holds this module's Ray session while the other runs the rest, Ray included
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray_e2e")]
REPO = Path(__file__).resolve().parents[1]

REWARD = '''
def reward_func(queries, prompts, labels, **kwargs):
    """Fraction of response words among w0..w49: dense, and learnable in a few steps."""
    out = []
    for q, p in zip(queries, prompts):
        words = q[len(p):].replace("</s>", " ").split()
        out.append(sum(w.startswith("w") and int(w[1:]) < 50 for w in words) / max(len(words), 1))
    return out
'''


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from rlhf_core.testing.tiny import make_tiny_llama

    root = tmp_path_factory.mktemp("rl")
    # 100 words: the reward's target set w0..w49 starts near half of the samples' words
    model = make_tiny_llama(root / "model", num_words=100, hidden_size=32, intermediate_size=64)
    with (root / "prompts.jsonl").open("w") as f:
        for i in range(48):
            f.write(
                json.dumps({"input": f"w{i} w{(i * 7) % 100} w{(i * 13) % 100}", "label": str(i % 10)}) + "\n"
            )
    (root / "reward.py").write_text(REWARD)
    return {
        "model": model,
        "prompts": str(root / "prompts.jsonl"),
        "reward": str(root / "reward.py"),
        "root": root,
    }


@pytest.fixture(scope="module")
def ray_session():
    import ray

    from rlhf_cli.ray_launch import init_ray
    from rlhf_core.config import RLConfig

    if ray.is_initialized():
        ray.shutdown()
    init_ray(RLConfig(), min_cpus=16)  # logical CPUs: enough bundles for every run of this module
    yield
    ray.shutdown()


def base_args(assets, out, steps=2):
    return [
        "--actor.model_name_or_path",
        assets["model"],
        "--reward.remote_url",
        assets["reward"],
        "--data.prompt_dataset",
        assets["prompts"],
        "--data.label_key",
        "label",
        "--rollout.n_samples_per_prompt",
        "4",
        "--rollout.batch_size",
        "4",
        "--rollout.max_new_tokens",
        "4",
        "--rollout.micro_batch_size",
        "8",
        "--data.max_len",
        "16",
        "--train.batch_size",
        "16",
        "--train.micro_batch_size",
        "4",
        "--actor.num_gpus_per_node",
        "2",
        "--ds.zero_stage",
        "3",
        "--ds.param_dtype",
        "fp32",
        "--algo.kl.init_coef",
        "0",
        "--actor.adam.lr",
        "1e-3",
        "--actor.lr_warmup_ratio",
        "0",
        "--train.max_steps",
        str(steps),
        "--ckpt.output_dir",
        str(out),
    ]


def without(args: list[str], flag: str) -> list[str]:
    i = args.index(flag)
    return args[:i] + args[i + 2 :]


def in_one_process(args: list[str]) -> list[str]:
    """``args`` as one rank in this process hosting the reference model and the HF engine, for runs whose
    placement is not what they test: no worker process starts (a few seconds instead of about a minute). The
    multi-process placements keep runs of their own: separate groups (reinforce_baseline, group_norm, the
    reward-model run with its critic, async, failure and kill tests) and colocate_all on two ranks (dr_grpo,
    the over-generation run)."""
    args = without(without(args, "--actor.num_gpus_per_node"), "--ds.zero_stage")
    return args + ["--ds.zero_stage", "0", "--train.colocate_all", "--ray.single_process", "true"]


def one_rank_on_ray(args: list[str]) -> list[str]:
    """``args`` with one policy rank, still on Ray with the engine in a process of its own: for runs that test
    the engine's process or the pipeline's schedule, not the ranks (two-rank async runs: the over-generation
    and kill-and-resume tests)."""
    args = without(without(args, "--actor.num_gpus_per_node"), "--ds.zero_stage")
    return args + ["--ds.zero_stage", "0", "--ray.single_process", "false"]


def train(args) -> int:
    from rlhf_cli.main import main

    os.environ["RLHF_NO_PROGRESS"] = "1"
    return main(["train", "ppo", *args])


def metrics(out) -> list[dict]:
    rows = {}
    for line in (Path(out) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = row  # a resumed run rewrites the steps it repeats
    return [rows[k] for k in sorted(rows)]


@pytest.mark.parametrize(
    "estimator,extra",
    [
        # gae (a critic group): the reward-model test below
        (
            "reinforce",
            ["--algo.kl.init_coef", "0.05"],
        ),  # KL folded into the reward: the rank hosts the reference
        # weights through the object store, not a group; a LoRA policy: only its adapter goes
        ("reinforce_baseline", ["--vllm.sync_with_ray", "--ds.lora.rank", "4", "--ds.lora.alpha", "8"]),
        ("rloo", ["--algo.kl.init_coef", "0.05", "--algo.kl.use_loss", "--algo.kl.estimator", "k3"]),
        # 2 engine processes, which a LoRA policy's adapter reaches through the sync group
        (
            "group_norm",
            [
                "--actor.eps_clip_low_high",
                "0.2",
                "0.28",
                "--vllm.num_engines",
                "2",
                "--ds.lora.rank",
                "4",
                "--ds.zero_stage",
                "2",
            ],
        ),
        # hybrid engine: every role and the engines on the same bundles, taking turns (sleep/wake); on CPU the
        # reference model and each engine live in the policy ranks' processes (engines get their weights by an
        # in-process copy)
        (
            "dr_grpo",
            [
                "--actor.loss_agg_mode",
                "seq_mean_token_sum_norm",
                "--train.colocate_all",
                "--vllm.enable_sleep",
                "--ds.enable_sleep",
                "--vllm.num_engines",
                "2",
                "--algo.kl.init_coef",
                "0.05",
                "--algo.kl.use_loss",
            ],
        ),
    ],
)
def test_each_estimator_runs_with_a_reward_file(assets, ray_session, tmp_path, capsys, estimator, extra):
    out = tmp_path / estimator
    args = base_args(assets, out) + ["--algo.advantage.estimator", estimator, *extra]
    one_process = estimator in ("reinforce", "rloo")  # what they test is the estimator and its KL term
    assert train(in_one_process(args) if one_process else args) == 0
    # 2 policy ranks, +1 or 2 engines unless hosted
    processes = {"group_norm": 4, "dr_grpo": 2}.get(estimator, 3)
    up = "the worker in this process (no Ray)" if one_process else f"{processes} worker processes"
    assert f"; {up} up in" in capsys.readouterr().err
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["policy/skipped"] == 0 and r["policy/grad_norm"] > 0
        assert 0.0 <= r["reward/mean"] <= 1.0
        # fp32: after every weight sync the engine's log-probs are the trainer's
        assert r["policy/rollout_train_logprob_gap"] < 1e-4
    if "--algo.kl.use_loss" in extra:
        assert "policy/kl_loss" in rows[-1]
    if estimator == "reinforce":
        assert rows[-1]["kl/mean"] != 0.0  # the policy moved away from the reference after step 1
    placement = json.loads((out / "run.json").read_text())["plugins"]["placement_strategies"]["name"]
    assert placement == ("colocate_all" if "--train.colocate_all" in extra or one_process else "separate")
    exported = (
        "adapter_config.json" if "--ds.lora.rank" in extra else "config.json"
    )  # LoRA exports the adapter
    assert (out / "model" / exported).is_file() and (out / "report" / "reward.png").is_file()


def test_multi_turn_environment_from_a_plugin(assets, ray_session, tmp_path):
    out = tmp_path / "env"
    args = base_args(assets, out) + [
        "--algo.advantage.estimator",
        "reinforce_baseline",
        "--train.env",
        "guess_number",
        "--data.max_len",
        "32",
    ]
    assert train(in_one_process(args)) == 0
    rows = metrics(out)
    assert len(rows) == 2 and rows[-1]["rollout/samples"] == 16


def test_multi_turn_agent_file(assets, ray_session, tmp_path):
    out = tmp_path / "agent"
    args = without(base_args(assets, out), "--reward.remote_url")  # the environment gives the reward
    args += [
        "--algo.advantage.estimator",
        "group_norm",
        "--train.agent_func_path",
        str(REPO / "examples" / "agent_multistep.py"),
        "--data.max_len",
        "48",
    ]
    assert train(in_one_process(args)) == 0  # on two vLLM engines: tests/test_rl_vllm.py
    rows = metrics(out)
    assert len(rows) == 2 and rows[-1]["reward/unscorable"] == 0


PER_CALL_AGENT = r"""
import json, os, sys, urllib.request
row = json.load(sys.stdin)
def complete(prompt):
    body = json.dumps({"prompt": prompt, "max_tokens": 4}).encode()
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/completions", body, {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req))["choices"][0]["text"]
first = complete(row["prompt"])
second = complete(row["prompt"] + " w1")  # without the first reply: the second call does not extend the first
words = (first + " " + second).replace("</s>", " ").split()
print(sum(w[1:].isdigit() and int(w[1:]) < 50 for w in words) / max(len(words), 1))
"""


def test_an_agent_program_whose_calls_do_not_extend_one_another(assets, ray_session, tmp_path):
    """--train.agent_command runs a program per episode (a process started by the rollout actor); its two calls
    do not extend one another, so each episode trains as two per-call samples."""
    agent = tmp_path / "agent.py"
    agent.write_text(PER_CALL_AGENT)
    out = tmp_path / "command"
    args = without(base_args(assets, out, steps=1), "--reward.remote_url")  # the program gives the reward
    args += ["--algo.advantage.estimator", "group_norm", "--train.agent_command", f"{sys.executable} {agent}"]
    assert train(in_one_process(args)) == 0
    (row,) = metrics(out)
    assert row["per_call/samples"] == 2.0 and row["reward/unscorable"] == 0
    assert row["train/skipped_rows"] == 0.0  # 16 episodes, 32 samples: two optimizer steps of 16


def test_grpo_raises_the_reward(assets, ray_session, tmp_path):
    out = tmp_path / "learn"
    args = base_args(assets, out, steps=12) + [
        "--algo.advantage.estimator",
        "group_norm",
        "--actor.adam.lr",
        "2e-2",
        "--rollout.batch_size",
        "8",
        "--train.batch_size",
        "32",
        "--train.num_episodes",
        "2",
    ]
    assert train(in_one_process(args)) == 0  # learning on 2 ZeRO-3 ranks: tests/test_rl_vllm.py
    rewards = [r["reward/mean"] for r in metrics(out)]
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert last > first + 0.15, f"reward did not rise: {rewards}"


@pytest.mark.parametrize("partial", [False, True])
def test_async_pipeline_respects_its_queue_bound(assets, ray_session, tmp_path, partial):
    out = tmp_path / "async"
    args = one_rank_on_ray(base_args(assets, out, steps=4)) + [
        "--algo.advantage.estimator",
        "group_norm",
        "--train.async_enable",
        "--train.async_queue_size",
        "1",
    ]
    if partial:  # weights land in the engine while it may be generating (a second concurrent actor call)
        args.append("--train.partial_rollout_enable")
    assert train(args) == 0
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert max(r["async/max_queue_size"] for r in rows) <= 1
    if partial:  # a batch counts the version its generation started on, which the next sync may have passed
        assert all(r["policy_version_lag"] in (0, 1) for r in rows)
        assert any(r["policy_version_lag"] == 1 for r in rows[1:])  # generation really ran ahead of training
    else:  # the schedule: batch k from the weights after step k - 2
        assert [r["policy_version_lag"] for r in rows] == [0, 1, 1, 1]


def test_async_over_generation_with_sleeping_trainers_and_hf_only_checkpoints(
    assets, ray_session, tmp_path, capsys
):
    """OpenRLHF's async recipe shape: one round of 8 prompts feeds two steps of 4 (over-generation), the hybrid
    trainers may sleep while they wait, and checkpoints hold an HF export only (--ckpt.disable_ds), which a
    resume refuses by name before starting anything."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "overgen"
    args = base_args(assets, out, steps=3) + [
        "--algo.advantage.estimator",
        "group_norm",
        "--train.async_enable",
        "--rollout.vllm_generate_batch_size",
        "8",
        "--train.colocate_all",
        "--ds.enable_sleep",
        "--ckpt.save_steps",
        "1",
        "--ckpt.save_hf",
        "--ckpt.disable_ds",
    ]
    assert train(args) == 0
    rows = metrics(out)
    assert [(r["step"], r["rollout/prompts_used"]) for r in rows] == [(1, 8), (2, 0), (3, 8)]
    step3 = out / "checkpoints" / "step_00000003"
    assert AutoModelForCausalLM.from_pretrained(step3 / "hf") is not None
    assert not (step3 / "actor").exists()
    capsys.readouterr()
    assert train(args + ["--ckpt.load_enable"]) == 1
    err = capsys.readouterr().err
    assert f"cannot resume from {step3}: it was saved with --ckpt.disable_ds" in err


def test_ppo_with_critic_and_a_reward_model_trained_by_rlhf_train_rm(assets, ray_session, tmp_path, capsys):
    """The gae estimator's case: a critic group, a reward-model group and a reference group beside 2 policy
    ranks, with token-budget micro-batches (the 1-rank critic groups its own); the log-prob gap check fails if
    make_experience puts a row's results back in the wrong place."""
    from rlhf_cli.main import main

    prefs = tmp_path / "prefs.jsonl"
    with prefs.open("w") as f:
        for i in range(64):
            f.write(
                json.dumps(
                    {
                        "prompt": f"w{i % 100}",
                        "chosen": f"w{i % 50} w{(i + 3) % 50}",
                        "rejected": f"w{50 + i % 50} w{50 + (i + 7) % 50}",
                    }
                )
                + "\n"
            )
    rm = tmp_path / "rm"
    assert (
        main(
            [
                "train",
                "rm",
                "--model.model_name_or_path",
                assets["model"],
                "--data.dataset",
                str(prefs),
                "--data.prompt_key",
                "prompt",
                "--data.max_len",
                "16",
                "--train.batch_size",
                "16",
                "--train.micro_batch_size",
                "8",
                "--model.adam.lr",
                "3e-3",
                "--ds.zero_stage",
                "0",
                "--ds.param_dtype",
                "fp32",
                "--ray.single_process",
                "true",
                "--ckpt.output_dir",
                str(rm),
            ]
        )
        == 0
    )
    out = tmp_path / "ppo"
    args = without(base_args(assets, out), "--reward.remote_url") + [
        "--algo.advantage.estimator",
        "gae",
        "--reward.model_name_or_path",
        str(rm),
        "--critic.adam.lr",
        "1e-3",
        "--algo.kl.init_coef",
        "0.01",
        "--train.dynamic_batch_enable",
        "--train.max_tokens_per_gpu",
        "24",
    ]
    capsys.readouterr()
    assert train(args) == 0
    # 2 policy ranks, +1 reference, +1 critic, +1 reward model, +1 engine
    assert "; 6 worker processes up in" in capsys.readouterr().err
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["reward/unscorable"] == 0 and r["policy/skipped"] == 0 and r["policy/grad_norm"] > 0
        assert r["policy/rollout_train_logprob_gap"] < 1e-4  # fp32: the engine's log-probs are the trainer's
    assert any(k.startswith("critic/") for k in rows[-1])
    assert json.loads((out / "run.json").read_text())["plugins"]["placement_strategies"]["name"] == "separate"
    assert (out / "model" / "config.json").is_file() and (out / "report" / "reward.png").is_file()


def test_ppo_with_a_process_reward_model_scoring_each_step(assets, ray_session, tmp_path):
    import shutil

    from transformers import AutoConfig

    prm = tmp_path / "prm"  # an (untrained) PRM as rlhf train prm saves one; each response word is a step
    shutil.copytree(assets["model"], prm)
    config = AutoConfig.from_pretrained(prm)
    config.prm_placeholder_token, config.prm_reward_tokens = "w97", ["w98", "w99"]
    config.save_pretrained(prm)
    out = tmp_path / "ppo"
    args = without(base_args(assets, out, steps=1), "--reward.remote_url") + [
        "--algo.advantage.estimator",
        "group_norm",
        "--reward.model_name_or_path",
        str(prm),
        "--reward.prm_step_separator",
        " ",
        "--reward.prm_aggregation",
        "mean",
    ]
    assert train(in_one_process(args)) == 0  # the PRM scores in the rollout worker, here the rank's process
    rows = metrics(out)
    assert len(rows) == 1 and rows[0]["policy/grad_norm"] > 0
    for r in rows:
        assert 0.0 < r["reward/mean"] < 1.0  # a mean of probabilities
        assert 1.0 <= r["prm/steps"] <= 4.0 and 0.0 < r["prm/min_step"] <= r["prm/mean_step"]


BROKEN_AGENT = """
import os

from rlhf_agents import SingleTurnAgentExecutor


class AgentExecutor(SingleTurnAgentExecutor):
    def __init__(self):
        super().__init__()
        if "AGENT_API_KEY" not in os.environ:  # the driver imports this file but does not build the executor
            raise RuntimeError("AGENT_API_KEY is not set")
"""


def test_an_agent_that_fails_in_its_worker_is_reported_by_its_message(assets, ray_session, tmp_path, capfd):
    """The executor is built in the rollout actor's process on the module's Ray session (whose workers do not
    have AGENT_API_KEY); capfd sees the driver's stderr and the workers' lines Ray forwards to it. It runs
    before the reward test, whose worker may log a traceback that Ray forwards after that test ends."""
    # the session's workers got this process's environment
    assert "AGENT_API_KEY" not in os.environ, "unset AGENT_API_KEY to run this test"
    agent = tmp_path / "agent.py"
    agent.write_text(BROKEN_AGENT)
    out = tmp_path / "run"
    args = one_rank_on_ray(base_args(assets, out)) + [
        "--algo.advantage.estimator",
        "group_norm",
        "--train.agent_func_path",
        str(agent),
    ]
    capfd.readouterr()
    assert train(args) == 1
    err = capfd.readouterr().err
    assert (
        f"rlhf train ppo: --train.agent_func_path {agent}: AgentExecutor() raised RuntimeError: "
        "AGENT_API_KEY is not set"
    ) in err
    assert "Traceback" not in err and "ray::" not in err, err[-3000:]
    log = (out / "train.log").read_text()
    assert "Traceback (most recent call last)" in log and "AGENT_API_KEY is not set" in log


def test_a_reward_function_that_always_raises_stops_the_run_with_its_message(
    assets, ray_session, tmp_path, capfd
):
    """The rollout worker's RolloutFailureError reaches the user as its message, not as Ray's traceback chain;
    the traceback goes to the run's log file. One policy rank: the failure is the rollout actor's, whose
    process is the engine's either way."""
    reward = tmp_path / "judge_reward.py"
    reward.write_text(
        "def reward_func(queries, prompts, labels):\n    raise ValueError('the judge is down')\n"
    )
    out = tmp_path / "run"
    args = base_args(assets, out)
    args[args.index(assets["reward"])] = str(reward)
    assert train(one_rank_on_ray(args) + ["--algo.advantage.estimator", "group_norm"]) == 1
    err = capfd.readouterr().err
    assert (
        "rlhf train ppo: step 1: 16 of 16 samples could not be scored, more than "
        f"--reward.max_failure_fraction 0.1 (reward source: reward_func in {reward})"
    ) in err
    assert "raised ValueError: the judge is down" in err
    assert "RayTaskError" not in err and "ray::" not in err
    # the reward function's own traceback may be logged once by the worker; no chain, no driver traceback
    assert err.count("Traceback (most recent call last)") <= 1, err
    log = (out / "train.log").read_text()
    assert "RolloutFailureError" in log and "Traceback (most recent call last)" in log


def _export_weights(out) -> dict:
    return load_file(str(Path(out) / "model" / "model.safetensors"))


def with_output(args: list[str], out) -> list[str]:
    """``args`` with their output directory "X" set to ``out``."""
    args = list(args)
    args[args.index("X")] = str(out)
    return args


KILL_HOOK = '''
import os
import time

_calls = 0
_reward_func = reward_func


def reward_func(queries, prompts, labels, **kwargs):
    """Step 2's rollout in the first engine process to get there stops here, with its pid written down, until
    the test kills it; the engine replacing it finds the file and goes on."""
    global _calls
    _calls += 1
    if _calls == 2 and not os.path.exists(MARK):
        with open(MARK + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(MARK + ".tmp", MARK)
        time.sleep(120)
    return _reward_func(queries, prompts, labels, **kwargs)
'''


def test_a_killed_engine_is_replaced_and_the_run_draws_the_same_samples(assets, ray_session, tmp_path, capfd):
    """Uninterrupted run A; in run B the engine process is SIGKILLed in the middle of step 2's rollout: it must
    be replaced (current weights, same seeds), the run must finish, and its prompts and weights must be A's.
    Both run on the module's Ray session (no Ray to start), B in a thread of this process while the test
    waits for the engine to stop."""
    import threading

    import psutil

    mark = tmp_path / "killed_engine_pid"
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD + f"\nMARK = {str(mark)!r}\n" + KILL_HOOK)
    common = one_rank_on_ray(without(base_args(assets, "X", steps=3), "--reward.remote_url")) + [
        "--reward.remote_url",
        str(reward),
        "--algo.advantage.estimator",
        "group_norm",
        "--actor.adam.lr",
        "1e-3",
    ]
    a, b = tmp_path / "a", tmp_path / "b"
    mark.write_text("")  # run A: no engine stops
    assert train(with_output(common, a)) == 0
    mark.unlink()

    capfd.readouterr()
    result = {}
    run_b = threading.Thread(target=lambda: result.update(rc=train(with_output(common, b))), daemon=True)
    run_b.start()
    deadline = time.time() + 300
    while time.time() < deadline and run_b.is_alive() and not mark.exists():
        time.sleep(0.05)
    assert mark.exists(), "the run ended before an engine reached step 2"
    engine = psutil.Process(int(mark.read_text()))
    assert "RolloutActor" in " ".join(engine.cmdline())
    os.kill(engine.pid, signal.SIGKILL)
    run_b.join(timeout=300)
    err = capfd.readouterr().err
    assert result.get("rc") == 0, err[-3000:]
    assert "starting a new one (restart 1 of --rollout.max_engine_restarts 3)" in err, err[-3000:]
    assert [r["rollout/engine_restarts"] for r in metrics(b)] == [0.0, 1.0, 1.0]
    # step 2 was generated by the replacement engine (its weights came through the object store, step 3's
    # through a new broadcast group): its samples, and so every weight after it, are A's
    wa, wb = _export_weights(a), _export_weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [r["rollout/prompt_digest"] for r in metrics(b)] == [
        r["rollout/prompt_digest"] for r in metrics(a)
    ]


def test_a_killed_engine_of_an_async_run_gets_the_weights_the_others_hold(
    assets, ray_session, tmp_path, capfd
):
    """The async pipeline (one batch ahead) with --rollout.max_engine_restarts: run B's engine is SIGKILLed
    while it generates step 3's batch, which is due from the policy of step 1 while the trainer trains step 2.
    The replacement gets that policy (kept at its sync), not the trainer's newer one, so B's samples, staleness
    and weights are uninterrupted run A's."""
    import threading

    import psutil

    mark = tmp_path / "killed_engine_pid"
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD + f"\nMARK = {str(mark)!r}\n" + KILL_HOOK.replace("_calls == 2", "_calls == 3"))
    common = one_rank_on_ray(without(base_args(assets, "X", steps=4), "--reward.remote_url")) + [
        *("--reward.remote_url", str(reward), "--algo.advantage.estimator", "group_norm"),
        *("--train.async_enable", "--train.max_staleness", "1", "--rollout.max_engine_restarts", "1"),
    ]
    a, b = tmp_path / "a", tmp_path / "b"
    mark.write_text("")  # run A: no engine stops
    assert train(with_output(common, a)) == 0
    mark.unlink()

    capfd.readouterr()
    result = {}
    run_b = threading.Thread(target=lambda: result.update(rc=train(with_output(common, b))), daemon=True)
    run_b.start()
    deadline = time.time() + 300
    while time.time() < deadline and run_b.is_alive() and not mark.exists():
        time.sleep(0.05)
    assert mark.exists(), "the run ended before an engine reached step 3"
    engine = psutil.Process(int(mark.read_text()))
    assert "RolloutActor" in " ".join(engine.cmdline())
    os.kill(engine.pid, signal.SIGKILL)
    run_b.join(timeout=300)
    err = capfd.readouterr().err
    assert result.get("rc") == 0, err[-3000:]
    assert "starting a new one (restart 1 of --rollout.max_engine_restarts 1)" in err, err[-3000:]
    assert metrics(b)[-1]["rollout/engine_restarts"] == 1.0
    keys = ("rollout/prompt_digest", "policy_version_lag", "reward/mean")
    assert [[r[k] for k in keys] for r in metrics(b)] == [[r[k] for k in keys] for r in metrics(a)]
    wa, wb = _export_weights(a), _export_weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_kill_a_training_worker_of_an_async_run_then_resume_exactly(assets, ray_session, tmp_path, capfd):
    """Uninterrupted async run A; run B gets one policy rank killed with SIGKILL mid-run, must stop with a clear
    error within a minute, and resuming from its last checkpoint must end on A's weights and prompts. The
    run generates one batch ahead, over-generates (rounds of 6 prompts for batches of 4) and drops groups
    more than one policy version old (the rest of a round, at its second step), so its checkpoints hold
    waiting groups and a batch generated ahead: all of it must come back as it was, not generated again by
    newer weights. All three runs use the module's Ray session (no Ray to start), B in a thread of this
    process while the test watches its metrics; B's workers are then this process's only TrainWorkers."""
    import threading

    import psutil

    common = base_args(assets, "X", steps=6) + [
        "--algo.advantage.estimator",
        "group_norm",
        "--ckpt.save_steps",
        "2",
        "--actor.adam.lr",
        "1e-3",
        "--train.async_enable",
        "--rollout.vllm_generate_batch_size",
        "6",
        "--train.max_staleness",
        "1",
    ]
    a, b = tmp_path / "a", tmp_path / "b"
    assert train(with_output(common, a)) == 0

    capfd.readouterr()
    result = {}
    run_b = threading.Thread(target=lambda: result.update(rc=train(with_output(common, b))), daemon=True)
    run_b.start()
    deadline = time.time() + 300
    killed = None
    while time.time() < deadline and killed is None and run_b.is_alive():
        if (
            (b / "checkpoints" / "latest").exists()
            and (b / "metrics.jsonl").exists()
            and len((b / "metrics.jsonl").read_text().splitlines()) >= 3
        ):
            workers = [
                p for p in psutil.Process().children(recursive=True) if "TrainWorker" in " ".join(p.cmdline())
            ]
            if workers:
                killed = workers[-1]
                os.kill(killed.pid, signal.SIGKILL)
                killed_at = time.time()
        time.sleep(0.05)
    assert killed is not None, "the run ended before a worker could be killed"
    run_b.join(timeout=120)
    err = capfd.readouterr().err
    assert not run_b.is_alive() and result.get("rc") not in (0, None), err[-2000:]  # None: main() raised
    assert time.time() - killed_at < 60
    assert "worker died" in err, err[-2000:]

    assert train(with_output(common, b) + ["--ckpt.load_enable"]) == 0
    assert "resumed from" in capfd.readouterr().err
    wa, wb = _export_weights(a), _export_weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    keys = ("rollout/prompt_digest", "policy_version_lag", "async/stale_groups_requeued")
    rows = {r["step"]: [r[k] for k in keys] for r in metrics(a)}
    assert {r["step"]: [r[k] for k in keys] for r in metrics(b)} == rows
    assert sum(r[2] for r in rows.values()) > 0  # groups were re-queued


def test_a_dead_rank_is_reported_rather_than_its_peers_collective_error(ray_session):
    """A rank's death makes its peers' collectives fail too, and ``ray.get`` of the group's calls may raise a
    peer's error first (seen: the kill test above, under load, ended with gloo's "connection reset by peer"
    from rank 0 instead of "a policy worker died"). ``rlhf_core.handles.wait`` reports the dead rank's
    RayActorError, which the controller turns into "a ... worker died"; a call in which nobody died keeps its
    own error."""
    import ray

    from rlhf_core.handles import wait

    @ray.remote(num_cpus=0)
    class Rank:
        def collective(self, peer_dies: bool):
            if peer_dies:
                raise RuntimeError("Read error: Connection reset by peer")
            time.sleep(1.0)
            os._exit(1)

        def fail(self):
            raise ValueError("a rank's own error")

    peer, dying = Rank.remote(), Rank.remote()
    with pytest.raises(ray.exceptions.RayActorError):
        wait([peer.collective.remote(True), dying.collective.remote(False)])
    with pytest.raises(ValueError, match="a rank's own error"):
        wait([peer.fail.remote(), peer.fail.remote()])


NAN_PLUGIN = '''
"""A third-party policy loss that turns non-finite after NAN_AFTER_CALLS calls in each process."""
import dataclasses
import os

from rlhf_algos.policy_loss import ppo_loss
from rlhf_core import hookimpl

calls = 0


def nan_after(batch):
    global calls
    calls += 1
    out = ppo_loss(batch)
    if calls > int(os.environ["NAN_AFTER_CALLS"]):
        out = dataclasses.replace(out, loss=out.loss * float("nan"))
    return out


nan_after.default_loss_agg_mode = ppo_loss.default_loss_agg_mode


@hookimpl
def rlhf_register_policy_losses(register):
    register("nan_after", nan_after)
'''


def _install_plugin(site: Path) -> None:
    """A plugin distribution found through PYTHONPATH, as a pip-installed one is (entry point ``rlhf``)."""
    site.mkdir()
    (site / "nan_after_plugin.py").write_text(NAN_PLUGIN)
    info = site / "nan_after_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nan-after-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[rlhf]\nnan_after = nan_after_plugin\n")


@pytest.mark.xdist_group("ray2")
def test_consecutive_nonfinite_losses_stop_the_run_keeping_the_last_good_checkpoint(assets, tmp_path):
    """Steps 1-2 train; from step 3 the loss is NaN on every rank: steps 3 and 4 are skipped and counted,
    the third in a row (step 5) stops the run with an error naming the flag. The checkpoints of the skipped
    steps hold exactly the step-2 optimizer state (nothing was applied)."""
    site = tmp_path / "site"
    _install_plugin(site)
    out = tmp_path / "run"
    args = base_args(assets, out, steps=8) + [
        "--algo.advantage.estimator",
        "group_norm",
        "--ckpt.save_steps",
        "1",
        "--ckpt.max_num",
        "10",
        "--actor.policy_loss_type",
        "nan_after",
    ]
    # 16 rows per step, micro-batches of 4 over 2 ranks: 2 loss calls per rank per step
    env = {
        **os.environ,
        "RLHF_NO_PROGRESS": "1",
        "NAN_AFTER_CALLS": "4",
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "rlhf_cli.main", "train", "ppo", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "3 policy steps in a row had a non-finite loss" in done.stderr
    assert "--train.max_nonfinite_steps" in done.stderr
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["policy/skipped"] for r in rows] == [0, 0, 1, 1]
    assert rows[-1]["policy/nonfinite_steps"] == 2
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000004"

    def optimizer_state(step: int) -> dict:
        files = sorted((ckpts / f"step_{step:08d}" / "actor" / "engine").glob("*optim_states.pt"))
        assert len(files) == 2, files  # one partition per ZeRO-3 rank
        return {f.name: torch.load(f, weights_only=False)["optimizer_state_dict"] for f in files}

    def tensors(obj, prefix=""):
        if isinstance(obj, torch.Tensor):
            yield prefix, obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                yield from tensors(v, f"{prefix}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                yield from tensors(v, f"{prefix}/{i}")

    s1, s2, s4 = (dict(tensors(optimizer_state(s))) for s in (1, 2, 4))
    assert s2.keys() == s4.keys() and len(s2) > 0
    assert any(not torch.equal(s1[k], s2[k]) for k in s2)  # a real step changes the state...
    for k in s2:
        assert torch.equal(s2[k], s4[k]), k  # ...the skipped ones change nothing


def test_a_damaged_checkpoint_stops_the_run_before_any_worker_starts(assets, tmp_path, capsys):
    from rlhf_core.checkpoint import CheckpointManager

    out = tmp_path / "run"
    model_states = out / "checkpoints" / "step_00000002" / "actor" / "engine" / "mp_rank_00_model_states.pt"

    def write(tmp):
        (tmp / "actor" / "engine").mkdir(parents=True)
        torch.save({}, tmp / "actor" / "engine" / model_states.name)

    CheckpointManager(out / "checkpoints").save(2, write, {"step": 2})
    model_states.unlink()
    assert train(base_args(assets, out) + ["--ckpt.load_enable"]) == 1
    err = capsys.readouterr().err
    assert (
        f"no intact checkpoint under {out / 'checkpoints'}: step_00000002 ({model_states} is missing)" in err
    )
    assert "workers up" not in err
