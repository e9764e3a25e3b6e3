"""Mixture-of-experts training on one rank (no Ray): the router load-balancing loss (``aux_loss_coef``) is the
model family's own, computed on the training forward's router logits, logged and added to the gradient with its
coefficient; a frozen router keeps its weights while the experts train; the routing metrics come every step;
a dense model refuses the flags."""

from __future__ import annotations

import importlib

import pytest
import torch

from rlhf_core.batches import PolicyMicroBatch, PolicyStepConfig, make_sequence_batch
from rlhf_core.config import ActorConfig, DSConfig, ModelConfig
from rlhf_core.testing.moe import make_tiny_moe
from rlhf_train_deepspeed.losses import SupervisedConfigLite
from rlhf_train_deepspeed.supervised_data import PairExample, collate, step_counts
from rlhf_train_deepspeed.worker import ModelSpec, TrainWorker

pytestmark = pytest.mark.slow
SFT = SupervisedConfigLite("sft")


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def tiny_moe(request, tmp_path_factory) -> str:
    return make_tiny_moe(tmp_path_factory.mktemp(request.param), request.param)


def rank(path: str, optim=None, kind: str = "causal", ds: DSConfig | None = None, **kw) -> TrainWorker:
    optim = optim or ModelConfig()
    optim.adam.lr = 1e-2
    worker = TrainWorker(0, 1)
    worker.init_distributed(worker.master_address())
    spec = ModelSpec(path, kind, True, optim, total_steps=8, **kw)
    try:
        worker.init_model(spec, ds or DSConfig(zero_stage=0, param_dtype="fp32"), seed=3)
    except Exception:
        worker.close()
        raise
    return worker


def sequences(n: int = 2) -> list:
    """``n`` micro-batches of two rows of different lengths (padding in each)."""
    g = torch.Generator().manual_seed(0)

    def ids(k: int) -> list[int]:
        return torch.randint(7, 60, (k,), generator=g).tolist()

    return [make_sequence_batch([ids(3 + k), ids(5)], [ids(6), ids(2 + k)], 0) for k in range(n)]


def family_aux_loss(path: str, batch) -> tuple[torch.Tensor, torch.nn.Module]:
    """The aux loss transformers computes for ``batch``: the family's ``load_balancing_loss_func`` on the
    router logits of a forward with ``output_router_logits=True``, called here directly."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    family = importlib.import_module(type(model).__module__)
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_router_logits=True)
    cfg = model.config
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    aux = family.load_balancing_loss_func(
        out.router_logits, experts, cfg.num_experts_per_tok, batch.attention_mask
    )
    assert torch.allclose(aux, out.aux_loss)  # the model's own aux_loss output is the same number
    return aux, model


def means(result) -> dict[str, float]:
    """A step result's metrics (``name -> [weighted sum, weight]``) as weighted means."""
    return {k: s / w for k, (s, w) in result.metrics.items()}


def router_grads(worker: TrainWorker) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in worker._module().named_parameters() if n.endswith("gate.weight")}


def test_aux_loss_is_the_familys_and_its_gradient_scales_with_the_coefficient(tiny_moe):
    (mb,) = sequences(1)
    counts = step_counts("sft", [mb])
    want, hf = family_aux_loss(tiny_moe, mb)
    want.backward()
    aux_grads = {n: p.grad for n, p in hf.named_parameters() if n.endswith("gate.weight")}
    grads, metrics = {}, {}
    for coef in (0.0, 0.5):
        worker = rank(tiny_moe, ModelConfig(aux_loss_coef=coef))
        try:
            metrics[coef] = means(worker.forward_backward([mb], "sft", SFT, counts))
            grads[coef] = router_grads(worker)
        finally:
            worker.close()
    for coef in (0.0, 0.5):  # logged whatever the coefficient
        assert metrics[coef]["aux_loss"] == pytest.approx(want.item(), rel=1e-6)
        assert {"moe_load_max_over_mean", "moe_router_entropy"} <= metrics[coef].keys()
    assert metrics[0.5]["nll"] == metrics[0.0]["nll"]
    assert grads[0.0].keys() == aux_grads.keys() and len(aux_grads) == 2
    for name, g in aux_grads.items():
        diff = grads[0.5][name] - grads[0.0][name]  # the term's own gradient: coef * d(aux)
        assert diff.abs().max() > 1e-6
        torch.testing.assert_close(diff, 0.5 * g, rtol=1e-4, atol=1e-7)


def test_a_frozen_router_keeps_its_weights_while_the_experts_train_and_metrics_come_every_step(tiny_moe):
    worker = rank(tiny_moe, ModelConfig(freeze_moe_router=True, aux_loss_coef=0.01))
    try:
        before = {n: p.detach().clone() for n, p in worker._module().named_parameters()}
        steps = []
        for _ in range(3):
            mbs = sequences(2)
            worker.forward_backward(mbs, "sft", SFT, step_counts("sft", mbs))
            steps.append(means(worker.optim_step()))
        after = dict(worker._module().named_parameters())
    finally:
        worker.close()
    routers = [n for n in before if n.endswith("gate.weight")]
    experts = [n for n in before if ".experts." in n]
    assert len(routers) == 2 and experts
    for n in routers:
        assert torch.equal(before[n], after[n]), n
    for n in experts:
        assert not torch.equal(before[n], after[n]), n
    for m in steps:
        assert m["aux_loss"] > 0 and m["moe_router_entropy"] > 0
        assert 1.0 <= m["moe_load_max_over_mean"] <= 4 / 2  # between balanced and E / top_k


def test_the_aux_loss_in_dpo_rm_and_the_policy_loss_with_lora(tiny_moe):
    g = torch.Generator().manual_seed(2)

    def ids(k: int) -> list[int]:
        return torch.randint(7, 60, (k,), generator=g).tolist()

    pairs = [collate("dpo", [PairExample(ids(3), ids(4), ids(2 + k)) for _ in range(2)], 0) for k in range(2)]
    ds = DSConfig(zero_stage=0, param_dtype="fp32")
    ds.lora.rank, ds.lora.target_modules = 4, ["q_proj", "v_proj"]
    for mode, kind, extra in (("dpo", "causal", {"ref_path": tiny_moe}), ("rm", "value", {})):
        worker = rank(tiny_moe, ModelConfig(aux_loss_coef=0.01), kind, ds, **extra)
        try:
            worker.forward_backward(pairs, mode, SupervisedConfigLite(mode), step_counts(mode, pairs))
            assert means(worker.optim_step())["aux_loss"] > 0
        finally:
            worker.close()
    seqs = sequences(2)
    worker = rank(tiny_moe, ActorConfig(aux_loss_coef=0.01), ds=ds)
    try:
        old = worker.compute_logprobs(seqs)
        mbs = [PolicyMicroBatch(s, lp, torch.ones_like(lp)) for s, lp in zip(seqs, old, strict=True)]
        counts = {"num_tokens": float(sum(b.response_mask().sum() for b in seqs)), "num_sequences": 4.0}
        worker.forward_backward(mbs, "policy", PolicyStepConfig(loss="ppo"), counts)
        assert means(worker.optim_step())["aux_loss"] > 0
    finally:
        worker.close()


def test_a_dense_model_refuses_the_moe_flags(tiny_llama):
    for optim, flag in (
        (ModelConfig(aux_loss_coef=0.01), "aux_loss_coef 0.01"),
        (ActorConfig(freeze_moe_router=True), "freeze_moe_router True"),
    ):
        with pytest.raises(ValueError, match=rf"{flag}: the model \(llama\) is not a mixture-of-experts"):
            rank(tiny_llama, optim).close()


def train(worker: TrainWorker, steps: int) -> list[dict]:
    out = []
    for k in range(steps):
        mbs = sequences(2 + k % 2)
        worker.forward_backward(mbs, "sft", SFT, step_counts("sft", mbs))
        out.append(means(worker.optim_step()))
    return out


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_weight_sync_export_and_exact_resume_of_a_moe_policy(tiny_moe, tmp_path, lora):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from rlhf_core.rollout.hf_engine import HFEngine
    from rlhf_train_deepspeed import weights

    ds = DSConfig(zero_stage=0, param_dtype="fp32")
    if lora:  # attention only: the experts are fused 3-D parameters, no nn.Linear for an adapter
        ds.lora.rank, ds.lora.target_modules = 4, ["q_proj", "v_proj"]
    optim = ActorConfig(aux_loss_coef=0.01)
    worker = rank(tiny_moe, optim, ds=ds)
    try:
        train(worker, 1)
        worker.save_checkpoint(str(tmp_path / "ckpt"))
        after_resume_point = train(worker, 2)
        trained = dict(weights.named_weights(worker._module()))  # LoRA merged, HF names
        engine = HFEngine(tiny_moe)
        engine.update_weights(weights.engine_weights(worker._module()))
        worker.export_hf(str(tmp_path / "export"))
    finally:
        worker.close()
    # the engine's weights are the trainer's, experts included, under the same HF names
    got = params(engine.model)
    assert got.keys() == trained.keys() and any(".experts." in n for n in got)
    for n, t in trained.items():
        torch.testing.assert_close(got[n], t, rtol=0, atol=1e-6 if lora else 0)
    if not lora:  # the export is a Hugging Face checkpoint: per-expert tensors under the hub's names
        keys = [
            set(safe_open(f"{d}/model.safetensors", "pt").keys()) for d in (tmp_path / "export", tiny_moe)
        ]
        assert keys[0] == keys[1] and any(".experts.3." in k for k in keys[0])  # e.g. ...experts.3.w2.weight
        reloaded = params(AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")))
        assert all(torch.equal(reloaded[n], t) for n, t in trained.items())
    resumed = rank(tiny_moe, ActorConfig(aux_loss_coef=0.01), ds=ds)
    try:
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        assert train(resumed, 2) == after_resume_point
        assert all(torch.equal(t, trained[n]) for n, t in weights.named_weights(resumed._module()))
    finally:
        resumed.close()
