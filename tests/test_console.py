"""What a run prints: rlhf's bar and messages on the terminal; vLLM's, transformers' and DeepSpeed's output in the
run's train.log, and on the terminal too with --debug (rlhf_core.console). Real commands in subprocesses, their
stdout and stderr captured: a vLLM run of the real model on Ray workers and single-process runs on the HF
engine."""

import os
import subprocess
import sys

import pytest
import test_rl_vllm
from test_rl_e2e import base_args, without

from rlhf_rollout_vllm.plugin import VLLMEngineFactory

pytestmark = [pytest.mark.slow]
assets = test_rl_vllm.assets  # the tiny Llama of head size 32 that vLLM's CPU kernel takes
THIRD_PARTY = (
    "Initializing a V1 LLM engine",
    "non-default args",
    "Loading safetensors checkpoint shards",
    "Loading weights",
    "Attempted to load weight",
    "Started a local Ray instance",
)


def rlhf_train(args: list[str]) -> tuple[str, str]:
    """The console (stdout and stderr together) of ``rlhf train ppo args``, which must succeed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RLHF_NO_PROGRESS", None)
    out = subprocess.run(
        [sys.executable, "-m", "rlhf_cli.main", "train", "ppo", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout + out.stderr


def run_args(assets, out) -> list[str]:
    args = without(base_args(assets, out, steps=1), "--actor.num_gpus_per_node")
    return args + ["--algo.advantage.estimator", "group_norm", "--ds.zero_stage", "0"]


def test_hf_single_process_quiet_and_debug(assets, tmp_path):
    console = rlhf_train(run_args(assets, tmp_path / "quiet") + ["--train.colocate_all"])
    assert "the worker in this process (no Ray)" in console
    assert "Loading weights" not in console and "Started a local Ray instance" not in console, console[-3000:]
    console = rlhf_train(run_args(assets, tmp_path / "debug") + ["--train.colocate_all", "--debug"])
    assert "Loading weights" in console  # transformers' bar, as without rlhf's quieting


@pytest.mark.real_model
@pytest.mark.skipif(VLLMEngineFactory().available() is not None, reason="needs a runnable vLLM")
def test_one_grpo_step_on_vllm_with_the_real_model(smollm2, tmp_path):
    """The issue's command, shrunk (2 chat prompts x 4 samples of 4 tokens, 1 step): SmolLM2 through
    `rlhf train ppo --rollout.engine vllm` on Ray workers; it runs, its bf16 engine stays near the trainer, and
    the terminal shows rlhf's lines only."""
    import json

    (tmp_path / "prompts.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "input": [{"role": "user", "content": f"What is {a}+{b}? Answer with one number."}],
                    "label": str(a + b),
                }
            )
            + "\n"
            for a, b in ((2, 3), (4, 1))
        )
    )
    # the answer's length in characters: differs between a prompt's samples, so group_norm moves the policy
    (tmp_path / "reward.py").write_text(
        "def reward_func(queries, prompts, labels, **kw):\n"
        "    return [len(q) - len(p) for q, p in zip(queries, prompts)]\n"
    )
    out = tmp_path / "run"
    console = rlhf_train(
        [
            "--pretrain",
            smollm2,
            "--remote_rm_url",
            str(tmp_path / "reward.py"),
            "--prompt_data",
            str(tmp_path / "prompts.jsonl"),
            "--label_key",
            "label",
            "--apply_chat_template",
            "--advantage_estimator",
            "group_norm",
            "--n_samples_per_prompt",
            "4",
            "--rollout_batch_size",
            "2",
            "--train_batch_size",
            "8",
            "--micro_train_batch_size",
            "4",
            "--generate_max_len",
            "4",
            "--max_len",
            "64",
            "--max_steps",
            "1",
            "--rollout.engine",
            "vllm",
            "--vllm.enforce_eager",
            "--ray.single_process",
            "false",
            "--save_path",
            str(out),
        ]
    )
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["rollout/samples"] == 8 and row["policy/grad_norm"] > 0
    assert row["policy/rollout_train_logprob_gap"] < 0.2  # bf16 by default: see the engine's real-model test
    assert [s for s in THIRD_PARTY if s in console] == [], console[-3000:]
    log = (out / "train.log").read_text()
    assert "Initializing a V1 LLM engine" in log and "Loading weights" in log  # vLLM's and transformers'
    assert "worker processes up in" in console and "rlhf ppo" in console and "report:" in console
