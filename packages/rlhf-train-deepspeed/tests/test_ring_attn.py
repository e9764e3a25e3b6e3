"""Ring attention (``--ds.ring_attn_size``) on CPU with gloo: slicing, padding and labels against the unsliced
row; the exact all-gather attention in one process; 2 Ray ranks in one ring group against 1 plain rank
(log-probs, a policy step, an SFT step, critic values); the refusals; and, on 2 GPUs, ring-flash-attn."""

from __future__ import annotations

import importlib.util
import socket

import pytest
import torch

from rlhf_algos.sft import sft_loss
from rlhf_core.batches import CriticMicroBatch, PolicyMicroBatch, PolicyStepConfig, make_sequence_batch
from rlhf_core.config import DSConfig, ModelConfig
from rlhf_core.handles import wait
from rlhf_core.types import LossAggregation
from rlhf_train_deepspeed import ring_attn
from rlhf_train_deepspeed.models import (
    load_causal_lm,
    load_value_model,
    model_inputs,
    response_logprobs,
    response_positions,
    response_values,
    sequence_rewards,
)
from rlhf_train_deepspeed.strategy import ConfigError, check_features
from rlhf_train_deepspeed.testing import train_step
from rlhf_train_deepspeed.worker import ModelSpec, SupervisedConfigLite

# Sequence lengths 7 + 5 + 5 = 17 tokens: not a multiple of 2 (nor of 4), so the ring pads.
PROMPTS = [[1, 7, 8], [1, 9], [1, 10, 11, 12]]
RESPONSES = [[14, 15, 16, 2], [17, 18, 19], [20]]


def packed_batch(shift: int = 0):
    return make_sequence_batch(
        [[t + shift for t in p] for p in PROMPTS],
        [[t + shift for t in r] for r in RESPONSES],
        pad_token_id=0,
        action_masks=[[1, 1, 0, 1], [1, 1, 1], [1]],
    )


def block_causal_mask(lengths: list[int]) -> torch.Tensor:
    """``[N, N]`` bool, by hand: token ``q`` sees token ``k`` iff same sequence and ``k <= q``."""
    owner = [s for s, n in enumerate(lengths) for _ in range(n)]
    n = len(owner)
    return torch.tensor([[owner[q] == owner[k] and k <= q for k in range(n)] for q in range(n)])


@pytest.mark.parametrize("size", [2, 4])
def test_slices_padding_and_labels_reassemble_the_unsliced_row(size):
    batch = packed_batch()
    inputs, offsets = model_inputs(batch, packing=True)
    ids = inputs["input_ids"][0]
    n = ids.numel()
    assert n == 17
    total = ring_attn.padded_length(n, size)
    assert total % size == 0 and n <= total < n + size
    slices = [
        ring_attn.shard_packed(inputs, batch.attention_mask.sum(-1), ring_attn.RingGroup(None, j, size))
        for j in range(size)
    ]
    assert [s.end - s.start for s in slices] == [total // size] * size
    assert [s.start for s in slices] == [j * total // size for j in range(size)]
    got_ids = torch.cat([s.inputs["input_ids"][0] for s in slices])
    got_pos = torch.cat([s.inputs["position_ids"][0] for s in slices])
    labels = torch.cat([s.labels for s in slices])
    torch.testing.assert_close(got_ids[:n], ids)
    torch.testing.assert_close(got_pos[:n], inputs["position_ids"][0])
    assert got_pos[n:].tolist() == list(range(total - n))  # the pad: a dummy sequence from position 0
    # labels are the next token of the *whole* row, also across slice boundaries
    assert labels[: n - 1].tolist() == ids[1:].tolist()
    # the positions that predict response tokens are labelled with exactly those tokens (as unsliced)
    pos, mask = response_positions(batch, offsets)
    assert labels[pos[mask]].tolist() == ids[pos[mask] + 1].tolist()
    lengths = batch.attention_mask.sum(-1).tolist()
    assert slices[0].cu_seqlens.tolist() == [0, 7, 12, 17, total]
    # the attention mask of the slices is the block-diagonal causal mask of the padded row
    allowed = torch.cat([s.allowed for s in slices])
    assert torch.equal(allowed, block_causal_mask(lengths + [total - n]))


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank in this process (the ring path's collectives of size 1); the one an
    in-process run of an earlier test left (it keeps its group until exit) where there is one."""
    import torch.distributed as dist

    own = not dist.is_initialized()
    if own:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        yield ring_attn.setup_ring(1)
    finally:
        ring_attn._GROUPS.clear()
        if own:
            dist.destroy_process_group()


def test_the_gather_attention_path_equals_the_unsliced_model(tiny_llama, one_rank_group):
    ring = one_rank_group
    name = ring_attn.attn_implementation(ring)
    assert name == ring_attn.ATTN_GATHER
    plain = load_causal_lm(tiny_llama, torch.float32)
    sliced = load_causal_lm(tiny_llama, torch.float32, name)
    assert sliced.config._attn_implementation == name
    batch = packed_batch()
    grads = []
    for model, r in ((plain, None), (sliced, ring)):
        lp, ent, mask = response_logprobs(model, batch, 0.7, packing=True, with_entropy=True, ring=r)
        loss = sft_loss(lp, mask, LossAggregation(num_tokens=float(mask.sum()))) + 0.1 * ent.sum()
        loss.backward()
        grads.append((lp.detach(), ent.detach(), {k: p.grad for k, p in model.named_parameters()}))
    (lp0, ent0, g0), (lp1, ent1, g1) = grads
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent1, ent0, atol=1e-5, rtol=0)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], atol=1e-5, rtol=0, msg=k)
    # value models take the same path
    torch.manual_seed(0)
    vplain = load_value_model(tiny_llama, torch.float32).eval()
    vsliced = load_value_model(tiny_llama, torch.float32, name).eval()
    vsliced.load_state_dict(vplain.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(
            response_values(vsliced, batch, True, ring)[0],
            response_values(vplain, batch, True)[0],
            atol=1e-5,
            rtol=0,
        )
        torch.testing.assert_close(
            sequence_rewards(vsliced, batch, True, ring),
            sequence_rewards(vplain, batch, True),
            atol=1e-5,
            rtol=0,
        )


def test_ring_attention_is_refused_where_it_cannot_run(monkeypatch):
    check_features(DSConfig(ring_attn_size=2, packing_samples=True))  # CPU: the exact gather path runs
    with pytest.raises(ConfigError, match="--ds.ring_attn_size > 1 needs --ds.packing_samples"):
        check_features(DSConfig(ring_attn_size=2))
    with pytest.raises(ConfigError, match="--ds.ring_attn_head_stride must be at least 1"):
        check_features(DSConfig(ring_attn_size=2, packing_samples=True, ring_attn_head_stride=0))
    # a CUDA machine without ring-flash-attn: the detection is faked, the refusal is real
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "ring_flash_attn" else real_find_spec(name, *a),
    )
    with pytest.raises(ConfigError) as err:
        check_features(DSConfig(ring_attn_size=2, packing_samples=True))
    msg = str(err.value)
    assert "--ds.ring_attn_size 2" in msg and "ring-flash-attn" in msg and "pip install" in msg


# --- two Ray ranks in one ring group against one plain rank ---------------------------------------------------

# Adam's first step moves a weight by lr * g / (|g| + eps): with the default eps (1e-8) a gradient entry near
# eps, whose value the ring's summation order decides, could move it by up to lr. With eps 1e-3 a gradient
# difference d moves it by at most lr * d / eps.
LR, ADAM_EPS, MAX_NORM = 1e-2, 1e-3, 1.0
FP32_UNIT = 2.0**-24
GRAD_ERROR_UNITS = (
    64  # fp32 gradients summed in another order: within 64 units of the largest entry (test_workers)
)


def optim() -> ModelConfig:
    opt = ModelConfig(lr_scheduler="constant", lr_warmup_ratio=0.0, max_norm=MAX_NORM)
    opt.adam.lr, opt.adam.eps = LR, ADAM_EPS
    return opt


def spec(path: str, kind: str = "causal", grad_ckpt: bool = False) -> ModelSpec:
    return ModelSpec(
        path=path,
        kind=kind,
        trainable=True,
        optim=optim(),
        micro_batch_size=3,
        grad_accum=2,
        total_steps=10,
        grad_ckpt=grad_ckpt,
    )


RING = DSConfig(zero_stage=3, param_dtype="fp32", packing_samples=True, ring_attn_size=2)
PLAIN = DSConfig(zero_stage=3, param_dtype="fp32", packing_samples=True)


@pytest.fixture(scope="module")
def groups(reused_groups, tiny_llama):
    return reused_groups[2]("actor", spec(tiny_llama), RING, 2, 42), reused_groups[1](
        "actor", spec(tiny_llama), PLAIN, 1, 42
    )


def assert_same_step(m_ring: dict, m_plain: dict) -> None:
    """Same loss, and the same gradient norm: Adam's update hardly depends on the gradient's scale, so the
    norm is what catches a wrong data-parallel loss multiplier."""
    assert m_ring["skipped"] == m_plain["skipped"] == 0.0
    assert m_ring["loss"] == pytest.approx(m_plain["loss"], abs=1e-5)
    assert m_ring["grad_norm"] == pytest.approx(m_plain["grad_norm"], rel=1e-5)


def assert_same_weights(a, b, grad_norm: float):
    """After one step from the same weights: within what two gradients of the step may differ by, which is
    at most GRAD_ERROR_UNITS roundings of the largest entry (at most the clipped norm), times lr / eps, plus
    a few roundings of the weights (at most about 1 in size)."""
    atol = LR / ADAM_EPS * GRAD_ERROR_UNITS * FP32_UNIT * min(grad_norm, MAX_NORM) + 8 * FP32_UNIT
    wa, wb = wait(a.weights()), wait(b.weights())
    assert set(wa) == set(wb)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=atol, rtol=0, msg=k)


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
def test_two_ring_ranks_match_one_plain_rank_for_logprobs_and_a_policy_step(groups):
    ring, plain = groups
    assert ring.dp_size == 1
    seqs = [packed_batch(), packed_batch(shift=20)]
    got = wait(ring.forward(seqs, temperature=0.8, head="entropy"))
    want = wait(plain.forward(seqs, temperature=0.8, head="entropy"))
    assert len(got) == 2
    for (lp, ent), (lp0, ent0) in zip(got, want, strict=True):
        torch.testing.assert_close(lp, lp0, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, ent0, atol=1e-5, rtol=0)
    # one PPO step with an entropy bonus: same loss, same weights after it
    g = torch.Generator().manual_seed(1)
    mbs = [
        PolicyMicroBatch(
            s, lp.detach() - 0.1 * torch.rand(lp.shape, generator=g), torch.randn(lp.shape, generator=g)
        )
        for s, (lp, _) in zip(seqs, want, strict=True)
    ]
    cfg = PolicyStepConfig(loss="ppo", temperature=0.8, entropy_coef=0.01)
    m_ring, m_plain = train_step(ring, mbs, "policy", cfg), train_step(plain, mbs, "policy", cfg)
    assert_same_step(m_ring, m_plain)
    assert m_ring["entropy"] == pytest.approx(m_plain["entropy"], abs=1e-5)
    assert_same_weights(ring, plain, m_plain["grad_norm"])


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
def test_two_ring_ranks_match_one_plain_rank_for_an_sft_step_and_a_critic_step(groups, tiny_llama):
    ring, plain = groups
    # gradient checkpointing recomputes the ring attention (and its K/V all-gathers) during backward
    ring.init_model(spec(tiny_llama, grad_ckpt=True), RING)
    plain.init_model(spec(tiny_llama), PLAIN)
    mbs = [packed_batch(), packed_batch(shift=20)]
    counts = {"num_tokens": float(sum(b.response_mask().sum() for b in mbs)), "num_sequences": 6.0}
    m_ring = train_step(ring, mbs, "sft", SupervisedConfigLite("sft"), counts)
    m_plain = train_step(plain, mbs, "sft", SupervisedConfigLite("sft"), counts)
    assert_same_step(m_ring, m_plain)
    assert_same_weights(ring, plain, m_plain["grad_norm"])
    # a critic: values gathered over the ring, then one value-loss step
    for group, ds in ((ring, RING), (plain, PLAIN)):
        group.init_model(spec(tiny_llama, "value"), ds)
    values = wait(ring.forward(mbs, head="values"))
    for v, v0 in zip(values, wait(plain.forward(mbs, head="values")), strict=True):
        torch.testing.assert_close(v, v0, atol=1e-5, rtol=0)
    cmbs = [CriticMicroBatch(b, v, v + 0.3 * b.response_mask()) for b, v in zip(mbs, values, strict=True)]
    m_ring, m_plain = train_step(ring, cmbs, "value", 0.5), train_step(plain, cmbs, "value", 0.5)
    assert_same_step(m_ring, m_plain)
    assert_same_weights(ring, plain, m_plain["grad_norm"])


# --- the CUDA path -----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.xdist_group("ray")
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (ring-flash-attn across 2 ranks)"
)
def test_ring_flash_attn_matches_unsliced_flash_attn_on_two_gpus(ray_cluster, tiny_llama):
    pytest.importorskip("ring_flash_attn", reason="ring-flash-attn is not installed")
    pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    from rlhf_train_deepspeed.group import create_worker_group

    s = ModelSpec(path=tiny_llama, kind="causal", trainable=False)
    ring = create_worker_group(
        "ref", s, DSConfig(param_dtype="bf16", packing_samples=True, ring_attn_size=2), 2
    )
    try:
        got = wait(ring.forward([packed_batch()]))[0]
    finally:
        ring.shutdown()
    flash = DSConfig(param_dtype="bf16", packing_samples=True, attn_implementation="flash_attention_2")
    plain = create_worker_group("ref", s, flash, 1)
    try:
        want = wait(plain.forward([packed_batch()]))[0]
    finally:
        plain.shutdown()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
