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


def test_evaluation_after_a_checkpointed_step_adds_no_aux_loss(tiny_moe):
    worker = rank(tiny_moe, ModelConfig(aux_loss_coef=0.5), grad_ckpt=True)
    try:
        train(worker, 1)  # its backward recomputes the routers' forward
        ((metrics, _, _),) = worker.eval_supervised(sequences(1), SFT)
    finally:
        worker.close()
    assert "aux_loss" not in metrics and metrics["loss"] == pytest.approx(metrics["nll"])


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


def replay_measurement(path: str, dtype: str, updates: int) -> dict[str, float]:
    """After ``updates`` SFT steps synced into an HF engine that records routing: the mean |engine - trainer|
    log-prob of the sampled tokens and the fraction of (token, layer) whose experts differ, without and with
    router replay in the trainer's log-prob forward."""
    from rlhf_core.moe import replay_rows
    from rlhf_core.rollout.hf_engine import HFEngine
    from rlhf_core.types import GenerationRequest, SamplingParams
    from rlhf_train_deepspeed import weights

    # the shared-prompt forward runs each prompt once: its rows are not the batch's, which replay indexes
    worker = rank(path, ModelConfig(), ds=DSConfig(zero_stage=0, param_dtype=dtype, shared_prefix=False))
    try:
        train(worker, updates)
        engine = HFEngine(path, dtype=dtype)
        engine.update_weights(weights.engine_weights(worker._module()))
        engine.record_routing()
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(7, 60, (4 + i % 5,), generator=g).tolist() for i in range(8)]
        params = SamplingParams(n=2, max_new_tokens=16, seed=1, ignore_eos=True)
        outs = [o for req in engine.generate([GenerationRequest(p, params) for p in prompts]) for o in req]
        rows = [p for p in prompts for _ in range(2)]
        batch = make_sequence_batch(rows, [o.token_ids for o in outs], 0)
        engine_lp = torch.zeros(len(outs), batch.num_response_positions)
        for i, o in enumerate(outs):
            engine_lp[i, : len(o.logprobs)] = torch.tensor(o.logprobs)
        mask = batch.response_mask().float()
        experts = replay_rows(
            [o.routed_experts for o in outs], batch.attention_mask.sum(-1).tolist(), batch.input_ids.shape[1]
        )
        model = worker.model
        (own,) = model.compute_logprobs([batch], 1.0, False, False, 0)
        model.routing.disagreement = [0.0, 0.0]
        with model.routing.replaying(experts):
            (replayed,) = model.compute_logprobs([batch], 1.0, False, False, 0)
        differ, total = model.routing.disagreement

        def gap(lp: torch.Tensor) -> float:
            return float(((lp.float() - engine_lp).abs() * mask).sum() / mask.sum())

        return {"gap": gap(own), "gap_replayed": gap(replayed), "experts_differ": differ / total}
    finally:
        worker.close()


def test_router_replay_uses_the_engines_experts_in_the_trainers_forward(tiny_moe):
    from rlhf_core.moe import replay_rows
    from rlhf_core.rollout.hf_engine import HFEngine
    from rlhf_core.types import GenerationRequest, SamplingParams

    # replaying the engine's own routing changes nothing in fp32 (the two agree on every expert), so the rows
    # are laid out right; the measurement itself (bf16, after updates) is in docs/moe.md
    fp32 = replay_measurement(tiny_moe, "fp32", updates=2)
    assert fp32["experts_differ"] == 0 and fp32["gap"] < 1e-5 and fp32["gap_replayed"] == fp32["gap"]
    # forced experts are used: each token's experts shifted by one disagree everywhere and move the log-probs
    engine = HFEngine(tiny_moe)
    engine.record_routing()
    (outs,) = engine.generate([GenerationRequest([7, 8, 9], SamplingParams(n=2, max_new_tokens=5, seed=0))])
    first = outs[0].routed_experts
    assert (
        first.shape == (3 + len(outs[0].token_ids), 2, 2)
        and (first[:-1] >= 0).all()
        and (first[-1] == -1).all()
    )
    worker = rank(tiny_moe, ds=DSConfig(zero_stage=0, param_dtype="fp32", shared_prefix=False))
    try:
        batch = make_sequence_batch([[7, 8, 9]] * 2, [o.token_ids for o in outs], 0)
        lengths = batch.attention_mask.sum(-1).tolist()
        experts = replay_rows([o.routed_experts for o in outs], lengths, batch.input_ids.shape[1])
        shifted = torch.where(experts >= 0, (experts + 1) % 4, experts)
        (own,) = worker.model.compute_logprobs([batch], 1.0, False, False, 0)
        worker.model.routing.disagreement = [0.0, 0.0]
        with worker.model.routing.replaying(shifted):
            (forced,) = worker.model.compute_logprobs([batch], 1.0, False, False, 0)
        differ, total = worker.model.routing.disagreement
        assert total == 2 * sum(n - 1 for n in lengths) and differ == total
        assert (forced - own).abs().max() > 1e-3
    finally:
        worker.close()
