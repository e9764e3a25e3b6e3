"""`rlhf train ppo --rollout.engine vllm` end to end on CPU with vLLM's CPU build (``make setup`` installs it):
local Ray, 2 DeepSpeed ZeRO-3 ranks (one where the ranks are not what a test checks), vLLM engines as Ray
actors receiving weights after every step.

The model is the e2e tests' tiny Llama at head size 32 (the CPU attention kernel's smallest), with tied
embeddings (the case whose LM head went stale before the worker extension repacked it). fp32 throughout, so
``policy/rollout_train_logprob_gap`` (mean |engine - trainer| log-prob of the sampled tokens) is asserted
<= 1e-5 after every sync.
"""

import json
import shutil

import pytest
import test_rl_e2e
import torch
from safetensors.torch import load_file
from test_rl_e2e import REPO, REWARD, base_args, metrics, one_rank_on_ray, train, without

from rlhf_rollout_vllm.plugin import VLLMEngineFactory

REASON = VLLMEngineFactory().available()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("rl_vllm"),
    pytest.mark.skipif(REASON is not None, reason=f"needs a runnable vLLM: {REASON}"),
]
GAP = 1e-5
ray_session = test_rl_e2e.ray_session  # the e2e runs' fixture: one local Ray session for this module


def held_out_score(model_dir: str, prompts: list[str]) -> float:
    """Mean reward of greedy 4-token answers on prompts never trained on, with the HF engine (not vLLM)."""
    from transformers import AutoTokenizer

    from rlhf_core.rollout.hf_engine import HFEngine
    from rlhf_core.types import GenerationRequest, SamplingParams

    namespace: dict = {}
    exec(REWARD, namespace)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    outs = HFEngine(model_dir, dtype="fp32").generate(
        [GenerationRequest(i, SamplingParams(temperature=0.0, max_new_tokens=4)) for i in ids]
    )
    queries = [p + " " + tok.decode(o.token_ids) for p, (o,) in zip(prompts, outs, strict=True)]
    scores = namespace["reward_func"](queries, prompts, [None] * len(prompts))
    return sum(scores) / len(scores)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from rlhf_core.testing.tiny import make_tiny_llama

    root = tmp_path_factory.mktemp("rl_vllm")
    model = make_tiny_llama(
        root / "model", num_words=100, hidden_size=128, intermediate_size=256, tie_word_embeddings=True
    )
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


def vllm_args(assets, out, steps=2):
    return base_args(assets, out, steps) + ["--rollout.engine", "vllm", "--vllm.enforce_eager"]


def assert_synced(rows):
    gaps = [r["policy/rollout_train_logprob_gap"] for r in rows]
    assert max(gaps) <= GAP, f"engine and trainer log-probs differ after a sync: {gaps}"


def test_grpo_on_vllm_raises_reward_and_held_out_score_and_resumes_exactly(
    assets, ray_session, tmp_path, capfd
):
    """A run that learns on vLLM; then the same run resumed from its step-10 checkpoint ends on its weights,
    bit for bit (vLLM's seeded samples of steps 11-12 are the same after the engine is rebuilt)."""
    out = tmp_path / "learn"
    args = vllm_args(assets, out, steps=12) + [
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
        "--ckpt.save_steps",
        "10",
    ]
    assert train(args) == 0
    rows = metrics(out)
    assert len(rows) == 12
    assert_synced(rows)
    rewards = [r["reward/mean"] for r in rows]
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.15, f"reward did not rise: {rewards}"
    held_out = [f"w{50 + i} w{(i * 11) % 100} w{(i * 17 + 3) % 100}" for i in range(40)]  # not in the 48
    before, after = held_out_score(assets["model"], held_out), held_out_score(str(out / "model"), held_out)
    assert after > before + 0.15, (before, after)
    run = json.loads((out / "run.json").read_text())
    assert run["plugins"]["rollout_engines"]["name"] == "vllm"

    resumed = tmp_path / "resumed"  # the run as it stood after step 10's checkpoint
    shutil.copytree(out, resumed, ignore=shutil.ignore_patterns("model"))
    args[args.index("--ckpt.output_dir") + 1] = str(resumed)
    capfd.readouterr()
    assert train(args + ["--ckpt.load_enable"]) == 0
    assert (
        "resumed from" in capfd.readouterr().err
        and "step_00000010" in (resumed / "checkpoints" / "latest").read_text()
    )
    assert_synced(metrics(resumed)[10:])
    want, got = (load_file(str(d / "model" / "model.safetensors")) for d in (out, resumed))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_async_pipeline_with_partial_rollout_on_vllm(assets, ray_session, tmp_path):
    """Generation runs ahead of training, and weights land in the engine while it may be generating (a second
    concurrent actor call). (The plain async pipeline is the same run without that second call.)"""
    out = tmp_path / "async"
    args = one_rank_on_ray(vllm_args(assets, out, steps=4)) + [
        "--algo.advantage.estimator",
        "group_norm",
        "--train.async_enable",
        "--train.async_queue_size",
        "1",
        "--train.partial_rollout_enable",
    ]
    assert train(args) == 0
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert max(r["async/max_queue_size"] for r in rows) <= 1
    assert any(r["policy_version_lag"] >= 1 for r in rows[1:])  # generation really ran ahead of training


def test_multi_turn_agent_file_on_two_vllm_engines(assets, ray_session, tmp_path):
    out = tmp_path / "agent"
    args = one_rank_on_ray(
        without(vllm_args(assets, out), "--reward.remote_url")
    )  # the environment gives the reward
    args += [
        "--algo.advantage.estimator",
        "group_norm",
        "--train.agent_func_path",
        str(REPO / "examples" / "agent_multistep.py"),
        "--data.max_len",
        "48",
        "--vllm.num_engines",
        "2",
    ]
    assert train(args) == 0
    rows = metrics(out)
    assert len(rows) == 2 and rows[-1]["reward/unscorable"] == 0
    assert_synced(rows)


def test_opd_on_vllm_moves_the_student_towards_the_teacher(ray_session, tmp_path):
    """On-policy distillation with the student's samples from vLLM: the teacher (the reference model) scores
    every token, and the run's per-token KL to the teacher falls; the engine holds the trainer's weights
    after every sync."""
    from test_opd import make_teacher, opd_args, prompts

    from rlhf_core.testing.tiny import make_tiny_llama

    student = make_tiny_llama(
        tmp_path / "student", seed=0, num_words=20, hidden_size=128, intermediate_size=128
    )  # head dim 32, as vLLM's CPU attention needs
    task = {
        "student": student,
        "teacher": make_teacher(tmp_path / "teacher"),
        "data": str(tmp_path / "p.jsonl"),
    }
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"input": p}) + "\n" for p in prompts(1, 64)))
    out = tmp_path / "opd"
    args = opd_args(task, out, 4)[2:] + ["--rollout.engine", "vllm", "--vllm.enforce_eager"]
    assert train(args + ["--ray.single_process", "false"]) == 0
    rows = metrics(out)
    kl = [r["kl/mean"] for r in rows]
    assert len(kl) == 4 and all(r["reward/mean"] == 0 for r in rows)
    assert kl[-1] < 0.75 * kl[0], kl
    assert_synced(rows)
    assert json.loads((out / "run.json").read_text())["plugins"]["rollout_engines"]["name"] == "vllm"


def test_a_lora_policy_on_vllm_trains_and_serves_its_adapter(assets, ray_session, tmp_path):
    """A LoRA policy (rank 4) whose syncs send the adapter to vLLM, which serves it as a new LoRA request:
    the engine's log-probs are the trainer's after every sync, and the run exports the adapter."""
    out = tmp_path / "lora"
    args = one_rank_on_ray(vllm_args(assets, out, steps=3)) + [
        *("--algo.advantage.estimator", "group_norm", "--actor.adam.lr", "2e-2"),
        *("--ds.lora.rank", "4", "--ds.lora.alpha", "8"),
    ]
    assert train(args) == 0
    rows = metrics(out)
    assert len(rows) == 3 and all(r["policy/grad_norm"] > 0 for r in rows)
    assert_synced(rows)  # with the adapter trained, as the next line checks: vLLM served it
    adapter = load_file(str(out / "model" / "adapter_model.safetensors"))
    assert any("lora_B" in k and v.abs().max() > 1e-3 for k, v in adapter.items())  # B starts at zero
