"""Policy weight EMA (``--train.enable_ema``): the update formula against a hand computation, ZeRO-3 on 2
ranks against ZeRO-0 on 1 rank, exact resume, raw weights for the engines, skipped steps."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.batches import PolicyMicroBatch, PolicyStepConfig, make_sequence_batch
from rlhf_core.config import DSConfig, ModelConfig, RLConfig
from rlhf_core.handles import wait
from rlhf_train_deepspeed.backend import spec_for_role
from rlhf_train_deepspeed.models import load_causal_lm, response_logprobs
from rlhf_train_deepspeed.testing import train_step
from rlhf_train_deepspeed.worker import ModelSpec, ema_update_

BETA = 0.5  # large enough that every step visibly moves the average
# Adam with a large eps is smooth in the gradient: with the default 1e-8 a gradient entry that is float noise
# (~1e-9, summed in another order under ZeRO-3 x 2 ranks than under ZeRO-0 x 1 rank) becomes an lr-sized step.
LR, ADAM_EPS = 1e-2, 1e-4
PPO = PolicyStepConfig(loss="ppo")


def ray_test(test):
    """The Ray tests: the directory's shared Ray session and worker groups (conftest.reused_groups)."""
    return pytest.mark.slow(pytest.mark.xdist_group("ray")(test))


def spec(path: str, grad_accum: int, beta: float | None = BETA) -> ModelSpec:
    opt = ModelConfig(lr_scheduler="constant", lr_warmup_ratio=0.0, max_norm=1.0)
    opt.adam.lr, opt.adam.eps = LR, ADAM_EPS
    return ModelSpec(
        path=path,
        kind="causal",
        trainable=True,
        optim=opt,
        micro_batch_size=2,
        grad_accum=grad_accum,
        total_steps=10,
        ema_beta=beta,
    )


def zero(stage: int) -> DSConfig:
    return DSConfig(zero_stage=stage, param_dtype="fp32")


def exported(out_dir) -> dict[str, torch.Tensor]:
    return load_file(f"{out_dir}/model.safetensors")


def assert_weights_close(got: dict, want: dict, atol: float) -> None:
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=0, msg=lambda m, n=name: f"{n}:{m}")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from rlhf_core.testing.tiny import make_tiny_llama

    # MLP weights of 32 x 3200 elements are above ZeRO-3's persistence threshold (1e5): they stay partitioned
    # between steps while the small parameters stay gathered ("persistent"); the EMA swap must handle both.
    return make_tiny_llama(tmp_path_factory.mktemp("ema-llama"), num_words=60, intermediate_size=3200)


@pytest.fixture(scope="module")
def micro_batches(model_path) -> list[PolicyMicroBatch]:
    """4 micro-batches of 2 sequences, old log-probs of the initial model, random advantages."""
    g = torch.Generator().manual_seed(0)
    model = load_causal_lm(model_path, torch.float32).eval()

    def ids(n):
        return torch.randint(7, 60, (n,), generator=g).tolist()

    out = []
    for k in range(4):
        seq = make_sequence_batch([ids(2 + k), ids(3)], [ids(4), ids(1 + k)], pad_token_id=0)
        with torch.no_grad():
            old = response_logprobs(model, seq)[0]
        out.append(PolicyMicroBatch(seq, old, torch.randn(old.shape, generator=g)))
    return out


@pytest.fixture(scope="module")
def groups(reused_groups, model_path):
    return {
        2: reused_groups[2]("actor", spec(model_path, 2), zero(3), 2, 42),
        1: reused_groups[1]("actor", spec(model_path, 4), zero(0), 1, 42),
    }


@pytest.fixture(scope="module")
def zero3_run(groups, model_path, micro_batches, tmp_path_factory) -> dict:
    """3 policy steps under ZeRO-3 on 2 ranks: the raw weights before and after each step, a checkpoint after
    step 2, the EMA and raw exports at the end and the engines' weights after those exports. An EMA export
    after step 1 (as ``best_model`` is written mid-run) and a hybrid-engine sleep/wake-up after step 2 must
    not disturb the training that follows: the ZeRO-0 run it is compared with has neither."""
    group, tmp = groups[2], tmp_path_factory.mktemp("ema-run")
    group.init_model(spec(model_path, 2), zero(3))
    raw = [wait(group.weights())]
    for step in (1, 2, 3):
        assert train_step(group, micro_batches, "policy", PPO)["skipped"] == 0.0
        raw.append(wait(group.weights()))
        if step == 1:
            wait(group.export(str(tmp / "mid-run")))
        if step == 2:
            wait(group.save_state(str(tmp / "ckpt")))
            group.sleep()  # the EMA goes to CPU memory and back (a no-op move on CPU ranks)
            group.wake_up()
    wait(group.export(str(tmp / "ema")))  # the default with an EMA: the average
    wait(group.export(str(tmp / "raw"), ema=False))
    return {
        "raw": raw,
        "ema": exported(tmp / "ema"),
        "raw_export": exported(tmp / "raw"),
        "engines_after": wait(group.weights()),
        "ckpt": tmp / "ckpt",
        "tmp": tmp,
    }


def test_ema_update_is_the_convex_combination():
    ema = [torch.tensor([1.0, 2.0]), torch.zeros(2, 3)]
    ema_update_(ema, [torch.tensor([3.0, -2.0], dtype=torch.bfloat16), torch.ones(2, 3)], 0.75)
    torch.testing.assert_close(ema[0], torch.tensor([0.75 * 1 + 0.25 * 3, 0.75 * 2 - 0.25 * 2]))
    torch.testing.assert_close(ema[1], torch.full((2, 3), 0.25))
    assert ema[0].dtype == torch.float32
    with pytest.raises(ValueError, match="2 EMA tensors for 1 parameters"):
        ema_update_(ema, [torch.ones(2)], 0.5)


def test_the_rl_config_turns_the_ema_on_for_the_actor_only():
    cfg = RLConfig()
    cfg.actor.model_name_or_path = "some/model"
    assert spec_for_role("actor", cfg, 1).ema_beta is None
    cfg.train.enable_ema, cfg.train.ema_beta = True, 0.9
    assert spec_for_role("actor", cfg, 1).ema_beta == 0.9
    assert spec_for_role("critic", cfg, 1).ema_beta is None
    cfg.train.ema_beta = 1.5
    with pytest.raises(ValueError, match="--train.ema_beta"):
        spec_for_role("actor", cfg, 1)


@ray_test
def test_the_exported_ema_follows_the_formula(zero3_run):
    raw, ema = zero3_run["raw"], zero3_run["ema"]
    want = {name: w.double() for name, w in raw[0].items()}
    for weights in raw[1:]:
        want = {name: BETA * w + (1 - BETA) * weights[name].double() for name, w in want.items()}
    assert_weights_close({name: e.double() for name, e in ema.items()}, want, atol=1e-6)
    # the average is not the trained model (else the check above proves nothing)
    assert max((ema[n] - raw[3][n]).abs().max() for n in ema) > 100 * 1e-6


@ray_test
def test_the_engines_and_a_raw_export_get_the_trained_weights(zero3_run):
    trained, after = zero3_run["raw"][3], zero3_run["engines_after"]
    assert all(torch.equal(after[n], trained[n]) for n in trained), "an export left EMA weights in the model"
    assert all(torch.equal(zero3_run["raw_export"][n], trained[n]) for n in trained)


@ray_test
def test_zero3_on_two_ranks_matches_zero0_on_one(groups, model_path, micro_batches, zero3_run, tmp_path):
    group = groups[1]
    group.init_model(spec(model_path, 4), zero(0))
    for _ in range(3):
        train_step(group, micro_batches, "policy", PPO)
    wait(group.export(str(tmp_path / "ema")))
    assert_weights_close(exported(tmp_path / "ema"), zero3_run["ema"], atol=1e-5)


@ray_test
def test_a_resumed_run_continues_the_ema_exactly(groups, model_path, micro_batches, zero3_run, tmp_path):
    group = groups[2]
    group.init_model(spec(model_path, 2), zero(3))
    wait(group.load_state(str(zero3_run["ckpt"])))
    train_step(group, micro_batches, "policy", PPO)
    wait(group.export(str(tmp_path / "resumed")))
    assert_weights_close(exported(tmp_path / "resumed"), zero3_run["ema"], atol=1e-6)


@ray_test
def test_a_checkpoint_without_ema_starts_it_from_the_loaded_weights(groups, model_path, zero3_run, tmp_path):
    ckpt = tmp_path / "no-ema"
    shutil.copytree(zero3_run["ckpt"], ckpt, ignore=shutil.ignore_patterns("ema_rank*.pt"))
    group = groups[2]
    group.init_model(spec(model_path, 2), zero(3))
    wait(group.load_state(str(ckpt)))
    wait(group.export(str(tmp_path / "ema")))
    ema, loaded = exported(tmp_path / "ema"), zero3_run["raw"][2]
    assert all(torch.equal(ema[n], loaded[n]) for n in loaded)


@ray_test
@pytest.mark.parametrize("stage", [0, 3])
def test_a_skipped_step_leaves_the_ema_unchanged(groups, model_path, micro_batches, stage, tmp_path):
    group = groups[2]
    group.init_model(spec(model_path, 2), zero(stage))
    train_step(group, micro_batches, "policy", PPO)  # the EMA now differs from the weights
    wait(group.export(str(tmp_path / "before")))
    bad = list(micro_batches)
    nan = torch.full_like(bad[3].advantages, float("nan"))  # the last micro-batch of rank 1 only
    bad[3] = PolicyMicroBatch(bad[3].seq, bad[3].old_logprobs, nan)
    assert train_step(group, bad, "policy", PPO)["skipped"] == 1.0
    wait(group.export(str(tmp_path / "after")))
    before, after = exported(tmp_path / "before"), exported(tmp_path / "after")
    assert all(torch.equal(after[n], before[n]) for n in before), "a skipped step moved the EMA"
