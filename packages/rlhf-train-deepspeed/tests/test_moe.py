"""Mixture-of-experts training on one rank (no Ray): the router load-balancing loss (``aux_loss_coef``) is the
model family's own, computed on the training forward's router logits, logged and added to the gradient with its
coefficient; a frozen router keeps its weights while the experts train; the routing metrics come every step;
a dense model refuses the flags."""

from __future__ import annotations

import dataclasses
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
        ((metrics, _),) = worker.forward(sequences(1), head="sft", loss_cfg=SFT)
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
        old = worker.forward(seqs)
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
        (ActorConfig(router_replay=True), "router_replay True"),
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
        worker.save_state(str(tmp_path / "ckpt"))
        after_resume_point = train(worker, 2)
        trained = dict(weights.named_weights(worker._module()))  # LoRA merged, HF names
        engine = HFEngine(tiny_moe)
        engine.update_weights(weights.engine_weights(worker._module()))
        worker.export(str(tmp_path / "export"))
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
        resumed.load_state(str(tmp_path / "ckpt"))
        assert train(resumed, 2) == after_resume_point
        assert all(torch.equal(t, trained[n]) for n, t in weights.named_weights(resumed._module()))
    finally:
        resumed.close()


def test_lora_on_the_experts_trains_them_alone_and_its_exported_adapter_merges_back(tiny_moe, tmp_path):
    """The checkpoint's per-expert names as targets: PEFT puts the adapter on transformers' fused expert
    parameters (an RL policy's weight sync: the next test)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlhf_train_deepspeed import weights

    ds = DSConfig(zero_stage=0, param_dtype="fp32")
    experts = ["w1", "w2", "w3"] if "mixtral" in tiny_moe else ["gate_proj", "up_proj", "down_proj"]
    ds.lora.rank, ds.lora.target_modules = 4, experts
    worker = rank(tiny_moe, ModelConfig(), ds=ds)
    try:
        train(worker, 2)
        trained = dict(weights.named_weights(worker._module()))  # merged, HF names
        worker.export(str(tmp_path / "adapter"))
    finally:
        worker.close()
    base = params(AutoModelForCausalLM.from_pretrained(tiny_moe))
    changed = {n for n, t in trained.items() if not torch.equal(t, base[n])}
    assert changed == {
        f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")
    }
    merged = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_moe), str(tmp_path / "adapter")
    )
    reloaded = params(merged.merge_and_unload())
    assert all(torch.equal(reloaded[n], t) for n, t in trained.items())


def expert_targets(path: str) -> list[str]:
    """The checkpoint's per-expert layer names, as ``--ds.lora.target_modules`` takes them."""
    return ["w1", "w2", "w3"] if "mixtral" in path else ["gate_proj", "up_proj", "down_proj"]


def merge_tolerance(
    base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, merges: int
) -> torch.Tensor:
    """How far two fp32 computations of ``W0 + B @ A`` (``B`` scaled) may be apart, per element: each rounds
    the sum of its ``r`` products (at most ``r * eps * |B| @ |A|`` apart, both ways) and the addition to
    ``W0`` (``eps / 2 * |W|``), and every merge and unmerge of the trainer's adapter (peft adds the update to
    its base weight and subtracts it again) moves the trainer's base by up to ``eps * |W|``."""
    eps = torch.finfo(torch.float32).eps
    products = lora_b.abs() @ lora_a.abs()
    size = base.abs() + products
    return 2 * (lora_a.shape[-2] + 1) * eps * products + (2 * merges + 1) * eps * size


@pytest.mark.parametrize("targets", ["experts", "all-linear"])
def test_grpo_with_lora_on_the_experts_syncs_them_into_the_engine_and_exports_them(
    tiny_moe, tmp_path, targets
):
    """Two GRPO steps of a policy with LoRA on its experts (``all-linear``: on its routers and attention too):
    after each, the adapter-only weight sync brings the HF engine to the trainer's merged weights, under their
    Hugging Face names, and the engine samples the next step from them; the exported adapter merges back."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlhf_core.rollout.hf_engine import HFEngine
    from rlhf_core.types import GenerationRequest, SamplingParams
    from rlhf_train_deepspeed import weights

    ds = DSConfig(zero_stage=0, param_dtype="fp32")
    ds.lora.rank, ds.lora.target_modules = 4, expert_targets(tiny_moe) if targets == "experts" else [targets]
    engine = HFEngine(tiny_moe, dtype="fp32")
    base = params(engine.model)
    prompts = [[7, 8, 9], [10, 11, 12, 13, 14]]
    worker = rank(tiny_moe, ActorConfig(lr_warmup_ratio=0.0), ds=ds)
    try:
        for step in range(2):
            params_ = SamplingParams(n=4, max_new_tokens=6, seed=step, ignore_eos=True)
            outs = [o for r in engine.generate([GenerationRequest(p, params_) for p in prompts]) for o in r]
            batch = make_sequence_batch(
                [p for p in prompts for _ in range(4)], [o.token_ids for o in outs], 0
            )
            rewards = torch.tensor([float(sum(t % 2 for t in o.token_ids)) for o in outs]).view(2, 4)
            advantages = (
                (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
            ).view(-1)
            (old,) = worker.forward([batch])
            mask = batch.response_mask().float()
            counts = {"num_tokens": float(mask.sum()), "num_sequences": float(len(batch))}
            mb = PolicyMicroBatch(batch, old, advantages[:, None] * mask)
            worker.forward_backward([mb], "policy", PolicyStepConfig(loss="ppo"), counts)
            worker.optim_step()
            sent = dict(weights.engine_weights(worker._module()))
            engine.update_weights(sent)
            trained = dict(
                weights.named_weights(worker._module())
            )  # merged (merge + unmerge number step + 1)
            got = params(engine.model)
            assert got.keys() == trained.keys()
            adapted = {n.removesuffix(".lora_A") for n in sent if n.endswith(".lora_A")}
            weight_of = {layer: layer if layer in got else layer + ".weight" for layer in adapted}
            for layer, name in weight_of.items():
                bound = merge_tolerance(
                    base[name], sent[layer + ".lora_A"], sent[layer + ".lora_B"], step + 1
                )
                assert ((got[name] - trained[name]).abs() <= bound).all(), name
                assert not torch.equal(got[name], base[name]), name  # the update arrived
            for name in got.keys() - set(weight_of.values()):
                assert torch.equal(got[name], base[name]) and torch.equal(trained[name], base[name]), name
        worker.export(str(tmp_path / "adapter"))
    finally:
        worker.close()
    experts = {f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")}
    routers = {f"model.layers.{i}.mlp.gate.weight" for i in (0, 1)}
    if targets == "experts":
        assert set(weight_of.values()) == experts
    else:
        assert experts | routers < set(weight_of.values())
    merged = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_moe), str(tmp_path / "adapter")
    )
    reloaded = params(merged.merge_and_unload())
    for layer, name in weight_of.items():
        bound = merge_tolerance(base[name], sent[layer + ".lora_A"], sent[layer + ".lora_B"], 3)
        assert ((reloaded[name] - trained[name]).abs() <= bound).all(), name


def engine_samples(path: str, dtype: str = "fp32", worker: TrainWorker | None = None):
    """Samples of an HF engine that records routing (with ``worker``'s weights synced in first): a batch of
    2 prompts x 2 samples carrying the recorded experts, and the engine's ``[B, T]`` log-probs."""
    from rlhf_core.rollout.hf_engine import HFEngine
    from rlhf_core.types import GenerationRequest, SamplingParams
    from rlhf_train_deepspeed import weights

    engine = HFEngine(path, dtype=dtype, record_routing=True)
    if worker is not None:
        engine.update_weights(weights.engine_weights(worker._module()))
    prompts = [[7, 8, 9], [10, 11, 12, 13, 14]]
    params = SamplingParams(n=2, max_new_tokens=6, seed=1, ignore_eos=True)
    outs = [o for req in engine.generate([GenerationRequest(p, params) for p in prompts]) for o in req]
    rows = [p for p in prompts for _ in range(2)]
    batch = make_sequence_batch(
        rows, [o.token_ids for o in outs], 0, routed_experts=[o.routed_experts for o in outs]
    )
    engine_lp = torch.tensor([o.logprobs for o in outs])
    return batch, engine_lp


def used_experts(worker: TrainWorker) -> list[list[torch.Tensor]]:
    """A hook after the replaying one on each router: the experts each forward's routers used."""
    used: list[list[torch.Tensor]] = []

    def hook(i):
        def keep(module, args, output):
            if i == 0:
                used.append([])
            used[-1].append(output[-1].detach().clone())

        return keep

    for i, router in enumerate(worker.model.routing.routers):
        router.register_forward_hook(hook(i))
    return used


def shifted(batch):
    """``batch`` with each recorded expert moved to the next one: routing the model would not choose."""
    e = batch.routed_experts
    return dataclasses.replace(batch, routed_experts=torch.where(e >= 0, (e + 1) % 4, e))


def test_router_replay_gives_the_engines_log_probs_with_the_engines_experts(tiny_moe):
    batch, engine_lp = engine_samples(tiny_moe)
    recorded = batch.routed_experts.flatten(0, 1).transpose(0, 1).long()  # [layers, B * L, k]
    has = recorded[0, :, 0] >= 0  # the real tokens but each row's last (no forward ran on it)
    assert int(has.sum()) == int(batch.attention_mask.sum()) - len(batch)
    # the default config would run the shared-prompt layout: replay runs the padded batch instead
    worker = rank(tiny_moe, ActorConfig(router_replay=True))
    try:
        used = used_experts(worker)
        (lp,) = worker.forward([batch])
        differ = [worker.model.routing.take()[1]["moe_experts_differ"]]
        (forced_lp,) = worker.forward([shifted(batch)])
        differ.append(worker.model.routing.take()[1]["moe_experts_differ"])
        (own_lp,) = worker.forward([dataclasses.replace(batch, routed_experts=None)])
    finally:
        worker.close()
    mask = batch.response_mask()
    # fp32, the same weights: the engine's numbers up to the summation order of two implementations
    torch.testing.assert_close(lp * mask, engine_lp * mask, rtol=0, atol=2e-5)
    forced = shifted(batch).routed_experts.flatten(0, 1).transpose(0, 1).long()
    for forward, experts in ((0, recorded), (1, forced)):
        for layer, got in enumerate(used[forward]):
            assert torch.equal(got[has].sort(-1).values, experts[layer][has].sort(-1).values)
    # the metric: none differ; shifted, all of layer 0 (half the pairs) and those of layer 1 its change moved
    assert differ[0] == 0 and 0.5 <= differ[1] <= 1
    assert (forced_lp - lp).abs().max() > 1e-3  # and the shifted experts change the log-probs
    torch.testing.assert_close(own_lp, lp, rtol=0, atol=1e-6)  # fp32: the trainer chose the same


def test_router_replay_of_a_multi_turn_episode_is_aligned_with_its_tokens(tiny_moe):
    """An episode keeps its last call's routing, whose input was the episode so far (prompt, first reply,
    feedback): replayed, no expert differs from the trainer's own and every action token's log-prob is the
    engine's (misaligned, the experts would differ: see the shifted ones above)."""
    import asyncio

    from transformers import AutoTokenizer

    from rlhf_agents import AgentInstanceBase, MultiTurnAgentExecutor
    from rlhf_core.rollout.async_engine import AsyncEngine
    from rlhf_core.rollout.hf_engine import HFEngine
    from rlhf_core.types import SamplingParams

    class TwoTurns(AgentInstanceBase):
        turns = 0

        async def step(self, states):
            self.turns += 1
            return {"rewards": 0.0, "environment_feedback": "w3 w4 w5", "done": self.turns == 2}

    engine = AsyncEngine(HFEngine(tiny_moe, record_routing=True))
    params = SamplingParams(max_new_tokens=4, seed=0, ignore_eos=True)
    episode = MultiTurnAgentExecutor(TwoTurns).execute(
        "w1 w2", None, params, 64, AutoTokenizer.from_pretrained(tiny_moe), engine
    )
    t = asyncio.run(episode)
    assert t.action_mask == [1] * 4 + [0] * 3 + [1] * 4 + [0] * 3
    assert len(t.routed_experts) == len(t.prompt_ids) + 11  # the feedback after the last call: none
    batch = make_sequence_batch(
        [t.prompt_ids], [t.response_ids], 0, [t.action_mask], None, [t.routed_experts]
    )
    worker = rank(tiny_moe, ActorConfig(router_replay=True))
    try:
        (lp,) = worker.forward([batch])
        assert worker.model.routing.take()[1]["moe_experts_differ"] == 0
    finally:
        worker.close()
    actions = torch.tensor(t.action_mask, dtype=torch.bool)
    torch.testing.assert_close(lp[0][actions], torch.tensor(t.rollout_logprobs)[actions], rtol=0, atol=2e-5)


def test_replayed_packed_forwards_and_checkpointed_gradients_equal_the_padded_plain_ones(tiny_moe):
    batch, _ = engine_samples(tiny_moe)
    forced = shifted(batch)
    counts = {"num_tokens": float(batch.response_mask().sum()), "num_sequences": float(len(batch))}
    mb = PolicyMicroBatch(forced, None, torch.linspace(-1, 1, 4)[:, None] * forced.response_mask().float())
    results = {}
    for name, ckpt, packing in (("plain", False, False), ("ckpt", True, False), ("packed", False, True)):
        ds = DSConfig(zero_stage=0, param_dtype="fp32", packing_samples=packing)
        worker = rank(tiny_moe, ActorConfig(router_replay=True), ds=ds, grad_ckpt=ckpt)
        try:
            (lp,) = worker.forward([forced])
            worker.forward_backward([mb], "policy", PolicyStepConfig(loss="ppo"), counts)
            grads = {n: p.grad.clone() for n, p in worker._module().named_parameters() if p.grad is not None}
            results[name] = lp, grads
        finally:
            worker.close()
    lp, grads = results["plain"]
    routers = [n for n in grads if n.endswith("gate.weight")]
    assert len(routers) == 2 and all(grads[n].abs().max() > 0 for n in routers)  # the router still learns
    for name in ("ckpt", "packed"):
        torch.testing.assert_close(results[name][0], lp, rtol=0, atol=1e-5)
        assert results[name][1].keys() == grads.keys()
        for n, g in grads.items():  # the recompute replayed the same experts: the same gradient
            torch.testing.assert_close(results[name][1][n], g, rtol=1e-4, atol=1e-6, msg=n)
