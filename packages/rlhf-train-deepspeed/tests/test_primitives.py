"""The rank's learner primitives: ``forward_backward`` with a registered loss, then ``optim_step`` (the one way
the built-in loops train), over several steps and a skipped non-finite one, and ``forward`` evaluating a loss;
one rank in this process, no Ray. The driver's side, ``WorkerGroup`` as a ``rlhf_core.primitives.Learner``, is
tested at the end against the same calls made by hand on its ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhf_core.batches import PolicyMicroBatch, PolicyStepConfig, make_sequence_batch
from rlhf_core.config import DSConfig, ModelConfig
from rlhf_core.handles import wait
from rlhf_train_deepspeed.group import create_worker_group, merge_steps, policy_counts
from rlhf_train_deepspeed.losses import LOSSES, SupervisedConfigLite
from rlhf_train_deepspeed.supervised_data import PairExample, collate, step_counts
from rlhf_train_deepspeed.worker import ModelSpec, TrainWorker

pytestmark = pytest.mark.slow

# bf16 at ZeRO-0 and ZeRO-3: DeepSpeed's overflow path skips the step; fp32 at ZeRO-0: the learner drops the grads
SETTINGS = [(0, "fp32"), (0, "bf16"), (3, "fp32")]


def spec(path: str, **kw) -> ModelSpec:
    optim = ModelConfig(lr_scheduler="cosine_with_min_lr", lr_warmup_ratio=0.2, max_norm=0.5)
    optim.adam.lr = 1e-2
    return ModelSpec(path, "causal", True, optim, micro_batch_size=2, grad_accum=4, total_steps=8, **kw)


def rank(path: str, stage: int, dtype: str, **kw) -> TrainWorker:
    worker = TrainWorker(0, 1)
    worker.init_distributed(worker.master_address())
    worker.init_model(spec(path, **kw), DSConfig(zero_stage=stage, param_dtype=dtype), seed=3)
    return worker


def ids(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(7, 60, (n,), generator=g).tolist()


def sequences() -> list:
    g = torch.Generator().manual_seed(0)
    return [make_sequence_batch([ids(g, 2 + k), ids(g, 3)], [ids(g, 4), ids(g, 1 + k)], 0) for k in range(4)]


def result(r) -> dict:
    """A step's numbers, without the process's GPU memory (read at different times)."""
    out = dataclasses.asdict(r)
    out["metrics"] = {k: v for k, v in r.metrics.items() if not k.startswith("gpu_")}
    return out


def state(worker: TrainWorker) -> dict[str, torch.Tensor]:
    """The weights (gathered under ZeRO-3) and the EMA shards."""
    ema = worker.model.ema
    return worker.weights() | {f"ema.{i}": e.clone() for i, e in enumerate(ema.shards if ema else [])}


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def assert_same_results(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        # NaN (a skipped step's loss) compares unequal to itself: compare the text
        assert repr(x) == repr(y)


@pytest.mark.parametrize("stage,dtype", SETTINGS, ids=[f"zero{s}-{d}" for s, d in SETTINGS])
def test_policy_steps_through_the_primitives(tiny_llama, stage, dtype):
    seqs = sequences()
    counts = {"num_tokens": float(sum(b.response_mask().sum() for b in seqs)), "num_sequences": 8.0}
    cfg = PolicyStepConfig(loss="ppo", entropy_coef=0.01, kl_coef=0.05)
    worker = rank(tiny_llama, stage, dtype, ema_beta=0.9, ref_path=tiny_llama)
    try:
        old, ref = worker.forward(seqs), worker.forward(seqs, head="ref")
        g = torch.Generator().manual_seed(1)
        adv = [torch.randn(lp.shape, generator=g) for lp in old]
        good = [PolicyMicroBatch(s, *x, ref_logprobs=r) for s, *x, r in zip(seqs, old, adv, ref, strict=True)]
        bad = good[:2] + [dataclasses.replace(good[2], advantages=torch.full_like(adv[2], float("nan")))]
        steps, parts, states = [], [], [state(worker)]
        for mbs in (good, good, bad + good[3:], good):  # the third step is skipped
            parts.append(result(worker.forward_backward(mbs, "policy", cfg, counts)))
            steps.append(result(worker.optim_step()))
            states.append(state(worker))
    finally:
        worker.close()
    assert [r["skipped"] for r in steps] == [False, False, True, False]
    # forward_backward's part is the step's, but for the gradient norm that only the optimizer step knows
    assert_same_results(parts, [r | {"grad_norm": None} for r in steps])
    assert_bitwise(states[2], states[3])  # the skipped step leaves weights and EMA as they were
    assert not torch.equal(states[3]["model.embed_tokens.weight"], states[4]["model.embed_tokens.weight"])


@pytest.mark.parametrize("stage,dtype", SETTINGS[::2], ids=[f"zero{s}-{d}" for s, d in SETTINGS[::2]])
def test_dpo_steps_and_evaluation_through_the_primitives(tiny_llama, stage, dtype):
    g = torch.Generator().manual_seed(2)
    batches = [
        [
            collate("dpo", [PairExample(ids(g, 3), ids(g, 4), ids(g, 2 + k)) for _ in range(2)], 0)
            for k in range(4)
        ]
        for _ in range(3)
    ]
    cfg = SupervisedConfigLite("dpo", nll_loss_coef=0.2)
    worker = rank(tiny_llama, stage, dtype, ref_path=tiny_llama)
    try:
        first = worker.forward(batches[0], head="dpo", loss_cfg=cfg)
        for mbs in batches:
            part = result(worker.forward_backward(mbs, "dpo", cfg, step_counts("dpo", mbs)))
            assert_same_results([part], [result(worker.optim_step()) | {"grad_norm": None}])
        after = worker.forward(batches[0], head="dpo", loss_cfg=cfg)
    finally:
        worker.close()
    # evaluation: each micro-batch's mean loss and metrics, weighted by its pairs; training lowered the loss
    assert [w for _, w in first] == [2.0] * 4 and {"loss", "nll"} <= first[0][0].keys()
    assert sum(m["loss"] for m, _ in after) < sum(m["loss"] for m, _ in first)


def test_the_primitives_refuse_an_unknown_loss_and_a_step_without_gradients(tiny_llama):
    worker = rank(tiny_llama, 0, "fp32")
    try:
        with pytest.raises(ValueError, match="unknown loss 'sfft'; registered: .*sft"):
            worker.forward_backward(sequences(), "sfft", SupervisedConfigLite("sft"), {})
        with pytest.raises(RuntimeError, match="no forward_backward since the last optimizer step"):
            worker.optim_step()
    finally:
        worker.close()
    assert {"policy", "value", "sft", "rm", "dpo", "kto", "prm", "kd"} <= LOSSES.keys()


# --- the driver's side: a WorkerGroup is a rlhf_core.primitives.Learner ---


@pytest.mark.xdist_group("ray")
def test_a_two_rank_group_steps_through_the_primitives_as_its_ranks_do(reused_groups, tiny_llama):
    """Micro-batches shared out over the ranks, global counts taken from them, the ranks' results merged: the
    metrics and weights of the same steps made by hand on each rank, bitwise, over two steps and a skipped one."""
    seqs, cfg = sequences(), PolicyStepConfig(loss="ppo", entropy_coef=0.01)
    runs = {}
    for primitives in (False, True):
        group = reused_groups[2]("actor", spec(tiny_llama), DSConfig(zero_stage=2, param_dtype="fp32"), 2, 3)
        old = wait(group.forward(seqs)) if primitives else wait([a.forward(seqs) for a in group.actors])[0]
        g = torch.Generator().manual_seed(1)
        good = [PolicyMicroBatch(s, lp, torch.randn(lp.shape, generator=g)) for s, lp in zip(seqs, old)]
        bad = good[:3] + [dataclasses.replace(good[3], advantages=good[3].advantages * float("nan"))]
        results = []
        for mbs in (good, bad, good):
            if primitives:
                wait(group.forward_backward(mbs, "policy", cfg))
                results.append(wait(group.optim_step()))
            else:
                counts = policy_counts(mbs)
                wait(
                    [
                        a.forward_backward(mbs[2 * r : 2 * r + 2], "policy", cfg, counts)
                        for r, a in enumerate(group.actors)
                    ]
                )
                results.append(merge_steps(wait([a.optim_step() for a in group.actors])))
        runs[primitives] = old, results, wait(group.weights())
    got = runs[True][1]
    assert [r["skipped"] for r in got] == [0.0, 1.0, 0.0] and got[-1]["nonfinite_steps"] == 1
    assert all(torch.equal(a, b) for a, b in zip(runs[False][0], runs[True][0], strict=True))
    assert_same_results(runs[False][1], [{k: v for k, v in r.items() if k != "nonfinite_steps"} for r in got])
    assert_bitwise(runs[False][2], runs[True][2])


def test_a_group_saves_loads_and_exports_its_state_through_the_primitives(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    group = create_worker_group(
        "actor", spec(tiny_llama), DSConfig(zero_stage=0, param_dtype="fp32"), 1, inline_rank=True
    )
    try:
        seqs = sequences()
        sft = SupervisedConfigLite("sft")
        wait(group.save_state(str(tmp_path / "state")))
        saved = wait(group.weights())
        for _ in range(2):  # the first step's learning rate is 0 (warm-up)
            metrics = wait(group.forward_backward(seqs, "sft", sft))  # counts taken from the micro-batches
            assert metrics["loss"] > 0 and "grad_norm" not in metrics
            wait(group.optim_step())
        assert not torch.equal(
            wait(group.weights())["model.embed_tokens.weight"], saved["model.embed_tokens.weight"]
        )
        wait(group.load_state(str(tmp_path / "state")))
        assert_bitwise(saved, wait(group.weights()))
        wait(group.export(str(tmp_path / "hf")))
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
        assert torch.equal(exported["model.embed_tokens.weight"], saved["model.embed_tokens.weight"])
    finally:
        group.shutdown()
