"""Ray worker groups running DeepSpeed for real (CPU, gloo): one step checked against plain torch under
ZeRO 0/2/3 and 1 or 2 ranks, non-finite steps skipped on every rank, forward-only calls, bf16."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from rlhf_core.batches import PolicyMicroBatch, PolicyStepConfig, make_sequence_batch
from rlhf_core.config import DSConfig, ModelConfig
from rlhf_core.handles import wait
from rlhf_train_deepspeed.models import load_causal_lm, response_logprobs
from rlhf_train_deepspeed.testing import train_step
from rlhf_train_deepspeed.worker import ModelSpec, SupervisedConfigLite, TrainWorker

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

LR, MAX_NORM, WD, EPS = 1e-2, 0.5, 0.1, 1e-8
FP32_UNIT = 2.0**-24  # unit roundoff of float32
# fp32 gradients of this model, whatever the kernels and summation order, are within a few roundoffs of the
# tensor's largest gradient of the exact ones (measured on an AMD EPYC: plain torch's within 7.2 of the
# float64 ones; the DeepSpeed steps' weights fit a bound of 1.8); 64 leaves room for other CPUs' kernels.
GRAD_ERROR_UNITS = 64
SFT = SupervisedConfigLite("sft")


def optim() -> ModelConfig:
    opt = ModelConfig(lr_scheduler="constant", lr_warmup_ratio=0.0, max_norm=MAX_NORM)
    opt.adam.lr, opt.adam.weight_decay, opt.adam.eps = LR, WD, EPS
    return opt


def spec(path: str, grad_accum: int, **kw) -> ModelSpec:
    return ModelSpec(
        path=path,
        kind="causal",
        trainable=True,
        optim=optim(),
        micro_batch_size=2,
        grad_accum=grad_accum,
        total_steps=10,
        **kw,
    )


def global_batch() -> list:
    """4 micro-batches of 2 sequences with different prompt and response lengths; in micro-batches 0 and 2
    both sequences share a prompt, which the workers run once (``--ds.shared_prefix``, on by default)."""
    g = torch.Generator().manual_seed(0)

    def ids(n):
        return (torch.randint(7, 60, (n,), generator=g)).tolist()

    out = []
    for k in range(4):
        prompts = [ids(2 + k)] * 2 if k % 2 == 0 else [ids(2 + k), ids(3)]
        responses = [ids(4), ids(1 + k)]
        out.append(make_sequence_batch(prompts, responses, pad_token_id=0))
    return out


def counts(mbs) -> dict:
    return {"num_tokens": float(sum(b.response_mask().sum() for b in mbs)), "num_sequences": 8.0}


class Reference(NamedTuple):
    loss: float
    grad_norm: float
    """before clipping, as DeepSpeed reports it"""
    before: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    """after clipping"""
    after: dict[str, torch.Tensor]


def reference_step(path: str, mbs) -> Reference:
    """The same step in plain torch and float64, one unpadded sequence at a time: token-mean NLL over the
    whole batch, clip, AdamW."""
    model = load_causal_lm(path, torch.float64).train()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    n_tok = counts(mbs)["num_tokens"]
    loss = 0.0
    for b in mbs:
        for ids, n_real, n_prompt in zip(b.input_ids, b.attention_mask.sum(-1), b.prompt_lens, strict=True):
            ids = ids[:n_real]
            logp = model(ids[None]).logits[0, n_prompt - 1 : -1].log_softmax(-1)  # predicts ids[n_prompt:]
            loss = loss - logp.gather(-1, ids[n_prompt:, None]).sum() / n_tok
    loss.backward()
    params = list(model.parameters())
    grad_norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": WD},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=(0.9, 0.95),
        eps=EPS,
    )
    grads = {k: v.grad.detach().clone() for k, v in model.named_parameters()}
    opt.step()
    return Reference(
        loss.item(),
        float(grad_norm),
        before,
        grads,
        {k: v.detach().clone() for k, v in model.named_parameters()},
    )


def adam_first_step_tolerance(grad: torch.Tensor, weight: torch.Tensor, grad_error: float) -> torch.Tensor:
    """How far an fp32 AdamW first step may land from the exact one when its gradient is off by up to
    ``grad_error``; elementwise, same shape as ``grad`` (the clipped gradient) and ``weight`` (before the step).

    With bias correction the first step is ``w1 = w0 * (1 - lr * wd) - lr * f(g)``, ``f(g) = g / (|g| + eps)``.
    ``f`` increases with ``g``, so a gradient anywhere in ``[g - a, g + a]`` moves ``w1`` by at most
    ``lr * max(f(g + a) - f(g), f(g) - f(g - a))``: about ``lr * eps * a / g^2`` where ``|g| >> a``, up to
    ``lr`` where ``|g| <~ a`` (there the sign of the update is a matter of summation order). Add 8 fp32
    roundings of ``|w0| + lr`` for the optimizer's own arithmetic.
    """

    def f(x):
        return x / (x.abs() + EPS)

    g = grad.double()
    spread = torch.maximum(f(g + grad_error) - f(g), f(g) - f(g - grad_error))
    return LR * spread + 8 * FP32_UNIT * (weight.double().abs() + LR)


def test_first_step_tolerance_by_hand():
    w = torch.zeros(3, dtype=torch.float64)
    tol = adam_first_step_tolerance(torch.tensor([1e-3, 1e-8, 0.0]), w, grad_error=1e-9) - 8 * FP32_UNIT * LR
    # f(1e-3 - 1e-9) is the farther side: 1e-3 / (1e-3 + 1e-8) - (1e-3 - 1e-9) / (1e-3 - 1e-9 + 1e-8)
    far = 1e-3 / (1e-3 + 1e-8) - (1e-3 - 1e-9) / (1e-3 + 1e-8 - 1e-9)
    torch.testing.assert_close(
        tol,
        LR * torch.tensor([far, 1e-8 / 2e-8 - 0.9e-8 / 1.9e-8, 1e-9 / 1.1e-8], dtype=torch.float64),
        rtol=1e-6,
        atol=0,
    )


def cpu_adam_ready() -> bool:
    import os

    from torch.utils.cpp_extension import _get_build_directory

    if os.environ.get("RLHF_TEST_BUILD_OPS"):
        return True
    return any(Path(_get_build_directory("cpu_adam", False)).glob("cpu_adam*.so"))


@pytest.fixture(scope="module")
def groups(reused_groups, tiny_llama):
    ds = DSConfig(zero_stage=3, param_dtype="fp32")
    return {
        2: reused_groups[2]("actor", spec(tiny_llama, 2), ds, 2, 42),
        1: reused_groups[1]("actor", spec(tiny_llama, 4), ds, 1, 42),
    }


@pytest.mark.parametrize(
    "ranks,stage,grad_ckpt,offload",
    [
        (2, 0, False, False),
        (2, 2, False, False),
        (2, 3, False, False),
        (1, 3, False, False),
        (2, 3, True, False),
        (2, 2, False, True),
    ],
    ids=[
        "2ranks-zero0",
        "2ranks-zero2",
        "2ranks-zero3",
        "1rank-zero3",
        "zero3-grad-ckpt",
        "zero2-adam-offload",
    ],
)
def test_one_step_matches_plain_torch(groups, tiny_llama, ranks, stage, grad_ckpt, offload):
    if offload and not cpu_adam_ready():
        pytest.skip(
            "DeepSpeedCPUAdam is not built on this machine (a ~3 min JIT compile on 2 cores); build it once "
            "with `python -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()'` "
            "or set RLHF_TEST_BUILD_OPS=1"
        )
    mbs = global_batch()
    ref = reference_step(tiny_llama, mbs)
    group = groups[ranks]
    ds = DSConfig(zero_stage=stage, param_dtype="fp32", adam_offload=offload)  # offload: DeepSpeedCPUAdam
    group.init_model(spec(tiny_llama, 4 // ranks, grad_ckpt=grad_ckpt), ds)
    metrics = train_step(group, mbs, "sft", SFT, counts(mbs))
    assert metrics["loss"] == pytest.approx(ref.loss, abs=1e-5)
    assert metrics["grad_norm"] == pytest.approx(ref.grad_norm, rel=1e-5)
    weights = wait(group.weights())
    assert set(weights) == set(ref.after)
    for name, w in weights.items():
        assert w.shape == ref.after[name].shape, name
        # AdamW's first step maps a gradient near eps to any update in [-lr, lr] (summation order decides):
        # each weight may be off by what the gradient's fp32 rounding error can move it, no more
        grad_error = GRAD_ERROR_UNITS * FP32_UNIT * ref.grads[name].abs().max().item()
        tol = adam_first_step_tolerance(ref.grads[name], ref.before[name], grad_error)
        off = (w.double() - ref.after[name]).abs() - tol
        assert (off <= 0).all(), (
            f"{name}: {int((off > 0).sum())} weights beyond tolerance, worst by {off.max():.3g}"
        )


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_non_finite_loss_skips_the_step_on_every_rank(groups, tiny_llama, stage):
    group = groups[2]
    group.init_model(spec(tiny_llama, 2), DSConfig(zero_stage=stage, param_dtype="fp32"))
    seqs = global_batch()
    old = wait(group.forward(seqs))
    mbs = [PolicyMicroBatch(s, lp, torch.ones_like(lp)) for s, lp in zip(seqs, old, strict=True)]
    before = wait(group.weights())
    # the second micro-batch of rank 1 only: earlier micro-batches already accumulated gradients
    mbs[3] = PolicyMicroBatch(seqs[3], old[3], torch.full_like(old[3], float("nan")))
    metrics = train_step(group, mbs, "policy", PolicyStepConfig(loss="ppo"))
    assert metrics["skipped"] == 1.0 and metrics["nonfinite_steps"] == 1.0
    after = wait(group.weights())
    assert all(torch.equal(after[k], before[k]) for k in before), "a skipped step changed parameters"
    # a good step afterwards trains normally
    mbs[3] = PolicyMicroBatch(seqs[3], old[3], torch.ones_like(old[3]))
    metrics = train_step(group, mbs, "policy", PolicyStepConfig(loss="ppo"))
    assert metrics["skipped"] == 0.0 and metrics["nonfinite_steps"] == 1.0
    assert metrics["loss"] == pytest.approx(-1.0, abs=1e-5)  # ratio 1, advantage 1: -mean(1)
    changed = wait(group.weights())
    assert any(not torch.equal(changed[k], before[k]) for k in before)


def test_forward_calls_match_in_process_models(groups, tiny_llama, tmp_path):
    group = groups[2]
    group.init_model(spec(tiny_llama, 2), DSConfig(zero_stage=3, param_dtype="fp32", packing_samples=True))
    seqs = global_batch()[:3]  # 3 micro-batches over 2 ranks: one rank gets a padding copy
    got = wait(group.forward(seqs, temperature=0.8, head="entropy"))
    model = load_causal_lm(tiny_llama, torch.float32).eval()
    assert len(got) == 3
    for b, (lp, ent) in zip(seqs, got, strict=True):
        with torch.no_grad():
            want_lp, want_ent, _ = response_logprobs(model, b, 0.8, with_entropy=True)
        torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=0)
    # HF export of the ZeRO-3 model loads with AutoModelForCausalLM and gives the same log-probs
    wait(group.export(str(tmp_path / "hf")))
    exported = load_causal_lm(str(tmp_path / "hf"), torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            response_logprobs(exported, seqs[0])[0], response_logprobs(model, seqs[0])[0]
        )


def test_bf16_on_cpu_trains_close_to_fp32(groups, tiny_llama):
    mbs = global_batch()
    group = groups[2]
    group.init_model(spec(tiny_llama, 2), DSConfig(zero_stage=3, param_dtype="bf16"))
    bf16 = train_step(group, mbs, "sft", SFT, counts(mbs))
    ref_loss = reference_step(tiny_llama, mbs).loss
    assert bf16["skipped"] == 0.0
    assert bf16["loss"] == pytest.approx(ref_loss, rel=2e-2)
    weights = wait(group.weights())
    assert next(iter(weights.values())).dtype == torch.bfloat16


def test_critic_and_reward_groups(reused_groups, tiny_llama):
    from rlhf_core.batches import CriticMicroBatch
    from rlhf_train_deepspeed.models import load_value_model, response_values, sequence_rewards

    seqs = global_batch()[:2]
    critic_spec = ModelSpec(
        path=tiny_llama, kind="value", trainable=True, optim=optim(), micro_batch_size=2, total_steps=10
    )
    # the directory's 1-rank group with a value model loaded (init_model seeds with 42 first, as a new group
    # would): the role name only labels a group's errors, so this saves starting a rank
    critic = reused_groups[1]("critic", critic_spec, DSConfig(zero_stage=2, param_dtype="fp32"), 1, 42)
    values = wait(critic.forward(seqs, head="values"))
    torch.manual_seed(42)  # the worker seeds before loading: the fresh head is initialised alike
    model = load_value_model(tiny_llama, torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(values[0], response_values(model, seqs[0])[0], atol=1e-5, rtol=0)
    mbs = [CriticMicroBatch(b, v, v + 1.0) for b, v in zip(seqs, values, strict=True)]
    metrics = train_step(critic, mbs, "value", 0.5)
    assert metrics["loss"] == pytest.approx(0.5, abs=1e-5)  # 0.5 * (V - (V + 1))^2 before the update
    rewards = wait(critic.forward(seqs, head="rewards"))
    assert rewards[0].shape == (2,)
    with torch.no_grad():
        assert not torch.allclose(rewards[0], sequence_rewards(model, seqs[0]))  # it trained


def test_weights_reach_an_engine_through_the_sync_group(groups, tiny_llama):
    from rlhf_core.weight_sync import init_sync_group

    group = groups[2]
    group.init_model(spec(tiny_llama, 2), DSConfig(zero_stage=3, param_dtype="fp32"))
    want = wait(group.weights())
    addr, port = group.weight_sync_address()
    refs = group.broadcast_weights_to_engines_async(addr, port, world_size=2, timeout_s=60)
    engine_side = init_sync_group(
        addr, port, rank=1, world_size=2, timeout_s=60
    )  # this test plays the engine
    got = dict(engine_side.receive())

    assert wait(refs)[0] == len(want)
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    engine_side.close()


def test_a_frozen_vision_tower_is_not_sent_to_the_engines_and_a_trained_one_is(groups, tmp_path):
    """--actor.freeze_visual_encoder: the engines loaded the same vision weights, so only the language model
    (and head) is synced; without it every weight trains and every weight is sent."""
    from rlhf_core.testing.tiny import make_tiny_vlm

    vlm = make_tiny_vlm(tmp_path / "vlm")
    model = load_causal_lm(vlm, torch.float32)
    names = {n for n, _ in model.named_parameters()}
    visual = {n for n in names if n.startswith("model.visual.")}
    assert visual and visual != names
    group, ds = groups[1], DSConfig(zero_stage=3, param_dtype="fp32")
    group.init_model(spec(vlm, 4, freeze_vision=True), ds)
    frozen = wait(group.weights())
    assert set(frozen) == names - visual
    assert all(torch.equal(frozen[n], p) for n, p in model.named_parameters() if n in frozen)
    group.init_model(spec(vlm, 4), ds)
    assert set(wait(group.weights())) == names


def test_an_engine_hosted_in_each_rank_gets_its_weights_in_process(groups, tiny_llama):
    """``host`` builds an HF engine inside each rank's process; after a training step, ``push_weights_to_hosted``
    copies the rank's (ZeRO-3 gathered) weights into it, so the engine's log-probs of its own samples are the
    trainer's to fp32 rounding. Before the push they are the old weights' (the step moved them by > 1e-3)."""
    from rlhf_core.rollout.hf_engine import HFEngine
    from rlhf_core.types import GenerationRequest, SamplingParams

    group = groups[2]
    group.init_model(spec(tiny_llama, 2), DSConfig(zero_stage=3, param_dtype="fp32"))
    engines = group.host("engine", HFEngine, [(tiny_llama,), (tiny_llama,)])
    mbs = global_batch()
    train_step(group, mbs, "sft", SFT, counts(mbs))
    prompt = [5, 9, 13, 7]
    request = GenerationRequest(prompt, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3))

    def gaps() -> list[float]:

        outs = [o for out in wait([e.generate([request]) for e in engines]) for o in out[0]]
        batch = make_sequence_batch([prompt] * len(outs), [o.token_ids for o in outs], pad_token_id=0)
        (trainer,) = wait(group.forward([batch]))
        return [
            float((trainer[i, : len(o.logprobs)] - torch.tensor(o.logprobs)).abs().max())
            for i, o in enumerate(outs)
        ]

    assert min(gaps()) > 1e-3  # the engines still hold the weights they loaded
    group.push_weights_to_hosted("engine")
    assert max(gaps()) < 1e-5


def test_a_reference_model_hosted_in_the_policy_ranks_stays_frozen(groups, tiny_llama):
    """With ``ref_path`` the policy's ranks also hold the reference model (ZeRO-3 over the same ranks, as a
    colocated reference runs on CPU); ``hosted_ref()`` computes its log-probs, which after a policy step are
    still the initial model's while the policy's have moved."""
    group = groups[2]
    group.init_model(spec(tiny_llama, 2, ref_path=tiny_llama), DSConfig(zero_stage=3, param_dtype="fp32"))
    mbs = global_batch()
    train_step(group, mbs, "sft", SFT, counts(mbs))
    seqs = mbs[:3]  # 3 micro-batches over 2 ranks: one rank gets a padding copy
    ref, policy = wait(group.hosted_ref().forward(seqs, 0.8)), wait(group.forward(seqs, 0.8))
    model = load_causal_lm(tiny_llama, torch.float32).eval()
    for b, got, moved in zip(seqs, ref, policy, strict=True):
        with torch.no_grad():
            want = response_logprobs(model, b, 0.8)[0]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert float((moved - want).abs().max()) > 1e-3


def test_experts_implementation_reaches_the_trained_and_reference_moe_models(groups, tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    moe = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
        )
    )
    moe.save_pretrained(tmp_path / "moe")
    group = groups[1]
    chosen = {}
    for experts in (None, "batched_mm"):  # None: transformers' own choice (grouped_mm)
        group.init_model(
            spec(str(tmp_path / "moe"), 4, ref_path=str(tmp_path / "moe")),
            DSConfig(zero_stage=0, param_dtype="fp32", experts_implementation=experts),
        )
        # Ray's __ray_call__ runs the function on the rank's object; a Handle's methods are the object's
        # public ones, so the private call is made through the handle's own caller
        (chosen[experts],) = wait(
            [
                a._call(
                    "__ray_call__",
                    lambda w: (
                        w.hf_config._experts_implementation,
                        w.ref_engine.module.config._experts_implementation,
                    ),
                )
                for a in group.actors
            ]
        )
    assert chosen == {None: ("grouped_mm", "grouped_mm"), "batched_mm": ("batched_mm", "batched_mm")}


# A one-rank ZeRO-0 fp32 run (a single-process CPU run's default) saves memory without changing its numbers: an HF
# engine hosted in the rank decodes from the trainer's own parameters (no copy), and the lone rank skips
# DeepSpeed's all-reduce (the identity, through a flat copy of every gradient). One rank in this process, no Ray.


def test_a_group_whose_set_up_fails_gives_its_cpus_back(ray_cluster, tmp_path):
    """Ranks outside a placement group held their CPUs after a failed start while the error was kept (its
    traceback holds the group), and the next test's run could not place its pools (CI): the failed group's
    ranks are killed at once."""
    import time

    from rlhf_train_deepspeed.group import create_worker_group

    free = ray_cluster.available_resources()["CPU"]
    with pytest.raises(Exception, match="no_such_model") as kept:  # as pytest keeps a failed test's error
        create_worker_group(
            "actor", spec(str(tmp_path / "no_such_model"), 4), DSConfig(), 1, num_cpus_per_worker=2
        )
    deadline = time.monotonic() + 30  # a killed actor's resources come back asynchronously
    while ray_cluster.available_resources().get("CPU", 0) < free and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_cluster.available_resources().get("CPU", 0) == free and kept.traceback


def test_rank_0_listens_on_the_port_it_hands_out_until_its_group_is_joined():
    """A port found free and released before the group listened on it was taken by another process in CI
    (EADDRINUSE): the port master_address hands out is held from the start, and joining releases the hold."""
    import errno
    import socket

    import torch.distributed as dist

    worker = TrainWorker(0, 1)
    try:
        host, port = worker.master_address()
        with socket.socket() as s, pytest.raises(OSError) as info:
            s.bind(("", port))
        assert info.value.errno == errno.EADDRINUSE
        worker.init_distributed((host, port))
        assert dist.is_initialized() and not worker._stores
    finally:
        worker.close()


def inline_rank(path: str) -> TrainWorker:
    worker = TrainWorker(0, 1)
    worker.init_distributed(worker.master_address())
    worker.init_model(spec(path, 4), DSConfig(zero_stage=0, param_dtype="fp32"))
    return worker


def test_a_closed_rank_leaves_no_process_group_and_warns_of_nothing(tiny_llama, capfd, caplog):
    """close() ends the rank's weight-sync group and the process group (NCCL warns at exit of one never
    destroyed), silently: no Python warning, no log record of WARNING or above, nothing on stderr. A rank made
    after it in the same process joins a new group and trains."""
    import logging
    import warnings

    import torch.distributed as dist

    from rlhf_core import weight_sync

    worker = inline_rank(tiny_llama)
    store = weight_sync.listening_store()
    worker._sync_group = sync = weight_sync.init_sync_group("127.0.0.1", store.port, 0, 1, store=store)
    assert dist.is_initialized()
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        worker.close()
    assert not dist.is_initialized() and sync._pg is None
    assert not caught and not caplog.records and not capfd.readouterr().err
    worker = inline_rank(tiny_llama)
    try:
        assert dist.is_initialized()
        mbs = global_batch()
        assert not train_step(worker, mbs, "sft", SFT, counts(mbs)).skipped
    finally:
        worker.close()
    assert not dist.is_initialized()


def samples(engine) -> list:
    from rlhf_core.types import GenerationRequest, SamplingParams

    request = GenerationRequest([5, 9, 13, 7], SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=3))
    return [(o.token_ids, o.logprobs) for o in engine.generate([request])[0]]


def test_a_hosted_engine_decodes_from_the_trainers_tensors_with_the_numbers_of_its_own_copy(tiny_llama):
    """The hosted engine's parameters are the trainer's tensors (same storage), and its samples, before and
    after a training step, are bitwise those of an engine owning a copy that gets the weights by
    ``update_weights`` (the path before sharing): the same fused and packed weights, the same kernels.
    The step without DeepSpeed's all-reduce gives bitwise the parameters of the step with it (x1.0 and a
    one-rank all-reduce are exact)."""
    from rlhf_core.rollout.hf_engine import HFEngine

    worker = inline_rank(tiny_llama)
    try:
        worker.host("engine", HFEngine, tiny_llama, pack_weights=True)
        hosted = worker._hosted["engine"]
        owned = HFEngine(tiny_llama, pack_weights=True)
        trainer = dict(worker._module().named_parameters())
        assert hosted.borrowed and not worker.engine.enable_backward_allreduce
        assert all(p.data_ptr() == trainer[n].data_ptr() for n, p in hosted.model.named_parameters())
        assert samples(hosted) == samples(owned)

        before = samples(hosted)
        mbs = global_batch()
        assert not train_step(worker, mbs, "sft", SFT, counts(mbs)).skipped
        assert worker.push_weights_to_hosted("engine") == 0  # nothing copied
        owned.update_weights(dict(worker.named_weights()))
        after = samples(hosted)
        assert after == samples(owned) and after != before
        stepped = {n: p.detach().clone() for n, p in worker._module().named_parameters()}
    finally:
        worker.close()

    worker = inline_rank(tiny_llama)  # the same step through DeepSpeed's all-reduce
    try:
        worker.engine.enable_backward_allreduce = True
        assert not train_step(worker, mbs, "sft", SFT, counts(mbs)).skipped
        for n, p in worker._module().named_parameters():
            assert torch.equal(p, stepped[n]), n
    finally:
        worker.close()


def test_a_tied_policy_adds_its_embeddings_gradient_into_grad_with_the_same_step(tmp_path):
    """At ZeRO-0 in fp32 (DeepSpeed reads a plain ``.grad``) a policy whose head is tied to its input embedding
    has both add the tied weight's gradient into ``.grad`` themselves (``accumulate_tied_gradient_in_place``:
    no ``[V, H]`` transients at the end of each backward). An SFT step over 4 micro-batches gives the
    parameters of the same step through autograd's sum: AdamW's first step moves each entry by about
    ``lr * sign(g)``, so gradients equal to rounding give parameters equal to rounding (1e-6 here, where
    |parameter| < 1 and the step is 1e-2). Not at bf16, whose optimizer keeps gradients of its own."""
    from rlhf_core.testing.tiny import make_tiny_llama

    path = make_tiny_llama(tmp_path / "tied", num_words=60, tie_word_embeddings=True)
    stepped = {}
    for direct in (True, False):
        worker = inline_rank(path)
        try:
            embedding = worker._module().get_input_embeddings()
            assert embedding.accumulates_into_grad
            if not direct:
                del embedding.forward, embedding.accumulates_into_grad
            before = {n: p.detach().clone() for n, p in worker._module().named_parameters()}
            mbs = global_batch()
            assert not train_step(worker, mbs, "sft", SFT, counts(mbs)).skipped
            stepped[direct] = {n: p.detach().clone() for n, p in worker._module().named_parameters()}
        finally:
            worker.close()
    tied = "model.embed_tokens.weight"
    assert not torch.equal(stepped[True][tied], before[tied])
    for name, p in stepped[True].items():
        torch.testing.assert_close(p, stepped[False][name], atol=1e-6, rtol=0, msg=name)

    worker = TrainWorker(0, 1)
    try:
        worker.init_distributed(worker.master_address())
        worker.init_model(spec(path, 4), DSConfig(zero_stage=0, param_dtype="bf16"))
        assert not hasattr(worker._module().get_input_embeddings(), "accumulates_into_grad")
    finally:
        worker.close()


def resident_kib(ptr: int) -> int:
    """Rss of the mapping of this process that holds address ``ptr``, from /proc/self/smaps."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for k, line in enumerate(lines):
        span = line.split()[0]
        if "-" in span and not span.endswith(":"):
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= ptr < hi:
                return next(int(x.split()[1]) for x in lines[k + 1 :] if x.startswith("Rss:"))
    raise AssertionError(f"no mapping holds {ptr:#x}")


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/smaps")
def test_the_reference_models_file_pages_leave_the_rank_after_its_forward(tiny_llama, monkeypatch, tmp_path):
    """A CPU rank's reference model runs once a step; after its log-probs its weights' file mapping holds no
    resident page (they wait in the page cache), and the next forward reads back the same numbers. Before its
    forward, and before an export, the rank hands the heap's free pages back (``release_free_heap``, recorded
    here); not before the policy's own forward, whose activations reuse them."""
    import rlhf_train_deepspeed.rank_model as worker_module

    heap_releases = []
    monkeypatch.setattr(worker_module, "release_free_heap", lambda: heap_releases.append(True))
    worker = TrainWorker(0, 1)
    try:
        worker.init_distributed(worker.master_address())
        worker.init_model(
            spec(tiny_llama, 4, ref_path=tiny_llama), DSConfig(zero_stage=0, param_dtype="fp32")
        )
        weight = worker.ref_engine.module.get_input_embeddings().weight
        seqs = global_batch()[:2]
        first = worker.forward(seqs, head="ref")
        assert resident_kib(weight.data_ptr()) == 0
        for a, b in zip(first, worker.forward(seqs, head="ref"), strict=True):
            assert torch.equal(a, b)
        assert len(heap_releases) == 2
        policy = worker._module().get_input_embeddings().weight
        worker.forward(seqs)  # the policy's own weights stay where they are
        assert resident_kib(policy.data_ptr()) > 0 and len(heap_releases) == 2
        worker.export(str(tmp_path / "export"))
        assert len(heap_releases) == 3
    finally:
        worker.close()


def test_a_cpu_training_forward_hands_back_the_heaps_free_pages_before_the_head(tiny_llama, monkeypatch):
    """A CPU training step peaks where a micro-batch's forward reaches the head: every activation saved, the
    logits next. There, and only in a forward that builds a graph, the rank hands the heap's free pages back
    (``release_free_heap``, recorded here between the last layer's forward and the head's log-probs)."""
    import rlhf_train_deepspeed.models as models_module

    events = []
    monkeypatch.setattr(models_module, "release_free_heap", lambda: events.append("release"))
    head_logprobs = models_module.head_logprobs
    monkeypatch.setattr(models_module, "head_logprobs", lambda *a: events.append("head") or head_logprobs(*a))
    worker = inline_rank(tiny_llama)
    try:
        worker._module().model.layers[-1].register_forward_hook(lambda *a: events.append("layers"))
        mbs = global_batch()
        worker.forward(mbs)
        assert events == ["layers", "head"] * len(mbs)
        events.clear()
        assert not train_step(worker, mbs, "sft", SFT, counts(mbs)).skipped
        assert events == ["layers", "release", "head"] * len(mbs)
    finally:
        worker.close()


def test_a_lora_policy_syncs_only_its_adapters_and_the_engines_serve_the_trained_policy(
    groups, tiny_llama, tmp_path
):
    """A LoRA policy (rank 4 on q/v/down, ZeRO-3 over 2 ranks), trained two steps and synced after each, sends
    the engines its adapter pairs only: the bytes are counted (the base, 14x more, would fail it). An engine
    hosted in each rank (in-process copy) and one loaded from the path (the object-store path) then give the
    trainer's log-probs to 1e-5 (fp32: W0 + B @ A merged vs. peft's extra matmuls, ~1e-6 apart), and
    `rlhf lora-merge` of the exported adapter gives a model whose log-probs are the engine's to 1e-5."""
    from transformers import AutoModelForCausalLM

    from rlhf_cli.lora_merge import merge_lora
    from rlhf_core.config import LoraConfig
    from rlhf_core.rollout.hf_engine import HFEngine
    from rlhf_core.testing.engines import forward_logprobs
    from rlhf_core.types import GenerationRequest, SamplingParams

    group = groups[2]
    lora = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    # ZeRO-3: the frozen LM head is partitioned, and the checkpointed log-prob chunks recompute with it in backward
    group.init_model(spec(tiny_llama, 2), DSConfig(zero_stage=3, param_dtype="fp32", lora=lora))
    hosted = group.host("engine", HFEngine, [(tiny_llama,), (tiny_llama,)])
    engine = HFEngine(tiny_llama, device="cpu")
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    # hidden 32, intermediate 64, 2 KV heads of 8: per layer A [4, in] and B [out, 4] of q (32->32), v (32->16),
    # down (64->32), fp32, 2 layers
    adapter_bytes = 4 * 2 * 4 * ((32 + 32) + (32 + 16) + (64 + 32))
    base_bytes = sum(p.numel() * 4 for p in base.parameters())
    prompt = [5, 9, 13, 7]
    request = GenerationRequest(prompt, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3))
    mbs = global_batch()
    for _ in range(2):
        train_step(group, mbs, "sft", SFT, counts(mbs))
        group.push_weights_to_hosted("engine")
        sent = wait(group.weights())
        assert all(n.endswith((".lora_A", ".lora_B")) for n in sent) and len(sent) == 2 * 3 * 2
        assert sum(t.numel() * t.element_size() for t in sent.values()) == adapter_bytes < base_bytes / 10
        engine.update_weights(sent)
        outs = engine.generate([request])[0] + [o for e in hosted for o in wait(e.generate([request]))[0]]
        batch = make_sequence_batch([prompt] * len(outs), [o.token_ids for o in outs], pad_token_id=0)
        (trainer,) = wait(group.forward([batch]))
        for i, o in enumerate(outs):
            torch.testing.assert_close(
                trainer[i, : len(o.logprobs)], torch.tensor(o.logprobs), atol=1e-5, rtol=0
            )
    out = outs[0]
    assert (
        max(abs(a - b) for a, b in zip(out.logprobs, forward_logprobs(base, prompt, out.token_ids, 1.0)))
        > 1e-3
    )
    wait(group.export(str(tmp_path / "adapter")))
    merged = AutoModelForCausalLM.from_pretrained(
        merge_lora(tiny_llama, str(tmp_path / "adapter"), str(tmp_path / "merged")), dtype=torch.float32
    ).eval()
    torch.testing.assert_close(
        forward_logprobs(merged, prompt, out.token_ids, 1.0), out.logprobs, atol=1e-5, rtol=0
    )
