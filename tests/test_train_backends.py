"""The training contract of rlhf-core, spoken by a second backend: plain torch ranks (tests/plain_torch_backend.py)
pass the train-backend suite and run GRPO through ``rlhf train ppo`` without anything of rlhf_train_deepspeed."""

import json
from pathlib import Path

import pytest
import torch
from plain_torch_backend import PlainTorchBackend, Plugin
from safetensors.torch import load_file

from rlhf_core.testing import TrainBackendConformance

REWARD = """
def reward_func(queries, prompts, labels, **kwargs):
    return [float(len(q) % 3 == 0) for q in queries]
"""


@pytest.mark.slow
@pytest.mark.xdist_group("train_backends")
class TestPlainTorchBackend(TrainBackendConformance):
    def make_backend(self):
        return PlainTorchBackend()


def test_only_a_backend_that_hosts_roles_gets_engines_in_its_ranks(register_plugin, tmp_path):
    """Hosting the reference model and engines in the policy ranks is the optional part of the contract."""
    from rlhf_cli.assemble import assemble
    from rlhf_core.config_parser import parse_config
    from rlhf_core.testing.tiny import make_tiny_llama

    register_plugin(Plugin(), "plain-torch-test")
    (tmp_path / "reward.py").write_text(REWARD)
    args = [
        "--pretrain",
        make_tiny_llama(tmp_path / "model", num_words=20),
        "--remote_rm_url",
        str(tmp_path / "reward.py"),
        "--advantage_estimator",
        "group_norm",
        "--n_samples_per_prompt",
        "2",
        "--init_kl_coef",
        "0.01",
        "--colocate_all_models",
        "--actor_num_gpus_per_node",
        "2",
    ]
    assert assemble("ppo", parse_config("ppo", args)[0], gpus=False).in_actor == {"ref", "rollout"}
    plain = parse_config("ppo", args + ["--train.backend", "plain_torch"])[0]
    assert assemble("ppo", plain, gpus=False).in_actor == set()


@pytest.mark.slow
@pytest.mark.xdist_group("train_backends")
def test_a_grpo_run_trains_and_syncs_on_the_plain_torch_backend(register_plugin, tmp_path):
    from rlhf_cli.main import main
    from rlhf_core.testing.tiny import make_tiny_llama

    register_plugin(Plugin(), "plain-torch-test")
    model = make_tiny_llama(tmp_path / "model", num_words=100)
    with (tmp_path / "prompts.jsonl").open("w") as f:
        for i in range(8):
            f.write(json.dumps({"input": f"w{i} w{i * 7 % 100}"}) + "\n")
    (tmp_path / "reward.py").write_text(REWARD)
    out = tmp_path / "run"
    code = main(
        [
            "train",
            "ppo",
            "--train.backend",
            "plain_torch",
            "--actor.model_name_or_path",
            model,
            "--reward.remote_url",
            str(tmp_path / "reward.py"),
            "--data.prompt_dataset",
            str(tmp_path / "prompts.jsonl"),
            "--algo.advantage.estimator",
            "group_norm",
            "--rollout.n_samples_per_prompt",
            "4",
            "--rollout.batch_size",
            "2",
            "--rollout.max_new_tokens",
            "4",
            "--train.batch_size",
            "8",
            "--train.micro_batch_size",
            "2",
            "--actor.num_gpus_per_node",
            "2",
            "--algo.kl.init_coef",
            "0",
            "--actor.adam.lr",
            "1e-3",
            "--ds.param_dtype",
            "fp32",
            "--train.max_steps",
            "2",
            "--ckpt.output_dir",
            str(out),
        ]
    )
    assert code == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["policy/skipped"] == 0
        # the HF engine runs in --ds.param_dtype (fp32 here, the plain ranks' dtype); step 2 samples from the
        # weights synced after step 1: the engine's log-probs are the trainer's
        assert r["policy/rollout_train_logprob_gap"] < 1e-4
    trained = load_file(str(out / "model" / "model.safetensors"))
    initial = load_file(str(Path(model) / "model.safetensors"))
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)
