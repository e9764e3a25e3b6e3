"""Weight sync: the bucketed broadcast protocol, its timeouts, and a real two-process sync into an engine."""

from __future__ import annotations

import errno
import multiprocessing
import threading
import time

import pytest
import torch

from rlhf_core.testing.engines import forward_logprobs, perturbed_weights
from rlhf_core.testing.tiny import make_tiny_llama
from rlhf_core.weight_sync import (
    WeightSyncError,
    WeightSyncTimeout,
    init_sync_group,
    listening_store,
)


def run_group(world_size: int, sender, receiver, timeout_s: float = 30.0):
    """Rank 0 runs ``sender(group)`` in this thread, ranks 1.. run ``receiver(group)`` in threads."""
    store = listening_store()
    port = store.port
    results, errors = {}, {}

    def member(rank):
        try:
            group = init_sync_group("127.0.0.1", port, rank, world_size, "gloo", timeout_s)
            results[rank] = receiver(group)
        except Exception as exc:  # reported to the test below
            errors[rank] = exc

    threads = [threading.Thread(target=member, args=(r,)) for r in range(1, world_size)]
    for t in threads:
        t.start()
    group = init_sync_group("127.0.0.1", port, 0, world_size, "gloo", timeout_s, store=store)
    results[0] = sender(group)
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def test_every_receiver_gets_every_tensor_exactly():
    gen = torch.Generator().manual_seed(0)
    tensors = [
        ("embed.weight", torch.randn(50, 8, generator=gen)),
        ("bf16", torch.randn(7, 3, generator=gen).bfloat16()),
        ("scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("ints", torch.arange(13, dtype=torch.int32)),
        ("mask", torch.tensor([True, False, True])),
        ("strided", torch.randn(6, 4, generator=gen).t()),  # not contiguous
        ("big", torch.randn(300, 11, generator=gen)),  # larger than a bucket on its own
        ("empty", torch.zeros(0, 5)),
    ]

    def receive(group):
        return {name: t.clone() for name, t in group.receive()}

    results = run_group(3, lambda g: g.send(iter(tensors), bucket_bytes=1024), receive)
    stats = results[0]
    assert stats["tensors"] == len(tensors) and stats["buckets"] >= 3
    for rank in (1, 2):
        got = results[rank]
        assert list(got) == [name for name, _ in tensors]  # order kept
        for name, t in tensors:
            assert got[name].dtype == t.dtype and got[name].shape == t.shape
            assert torch.equal(got[name], t), name


def test_an_empty_send_ends_the_receivers_loop():
    results = run_group(2, lambda g: g.send([]), lambda g: list(g.receive()))
    assert results[0]["tensors"] == 0 and results[1] == []


def test_the_group_leaves_the_default_process_group_alone():
    """Trainer ranks already have a default group; the sync group must not need, create or change it. (An
    in-process run of an earlier test in this worker may have left one: then it must stay the same group.)"""
    import torch.distributed as dist

    before = dist.group.WORLD  # None without a default group
    run_group(2, lambda g: g.send([("a", torch.ones(2))]), lambda g: list(g.receive()))
    assert dist.group.WORLD is before


def test_a_sender_that_never_sends_makes_the_receiver_raise_within_the_timeout():
    store = listening_store()
    port = store.port
    joined = threading.Event()

    def silent_sender():
        group = init_sync_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=2.0, store=store)
        joined.set()
        time.sleep(6)  # alive, in the group, never calls send()
        group.close()

    thread = threading.Thread(target=silent_sender, daemon=True)
    thread.start()
    group = init_sync_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=2.0)
    assert joined.wait(10)
    started = time.monotonic()
    with pytest.raises(WeightSyncTimeout) as info:
        list(group.receive())
    assert time.monotonic() - started < 5
    message = str(info.value)
    assert "rank 1" in message and "rank 0 (the sender)" in message and "header of bucket 0" in message
    assert f"127.0.0.1:{port}" in message


def test_a_sender_that_leaves_makes_the_receiver_raise_at_once():
    store = listening_store()
    port = store.port

    def leaving_sender():
        group = init_sync_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=30.0, store=store)
        group.close()  # drops its end of the connections, as a dying process would

    thread = threading.Thread(target=leaving_sender)
    thread.start()
    group = init_sync_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=30.0)
    thread.join()
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match="did the peer exit"):
        list(group.receive())
    assert time.monotonic() - started < 10


def test_a_receiver_that_never_joins_makes_the_sender_raise_within_the_timeout():
    store = listening_store()
    started = time.monotonic()
    with pytest.raises(WeightSyncTimeout, match=r"rank 0 waited 2s .* for all 2 ranks to join"):
        init_sync_group("127.0.0.1", store.port, 0, 2, "gloo", timeout_s=2.0, store=store)
    assert time.monotonic() - started < 6


def test_a_listening_store_holds_its_port_from_the_start():
    """Its port is taken before anyone is told it (a port found free and released could be taken by another
    process before the group listens on it); only rank 0 joins with it (run_group above joins through one)."""
    import socket

    store = listening_store()
    with socket.socket() as s, pytest.raises(OSError) as info:
        s.bind(("127.0.0.1", store.port))
    assert info.value.errno == errno.EADDRINUSE
    with pytest.raises(ValueError, match=f"rank 0's, on port {store.port}; got rank 1"):
        init_sync_group("127.0.0.1", store.port, 1, 2, "gloo", timeout_s=2.0, store=store)


def test_wrong_use_is_refused():
    with pytest.raises(ValueError, match="backend"):
        init_sync_group("127.0.0.1", 1, 0, 2, backend="mpi")
    with pytest.raises(ValueError, match="rank 2 is outside"):
        init_sync_group("127.0.0.1", 1, 2, 2)

    def receiver_sends(group):
        with pytest.raises(WeightSyncError, match="only rank 0 sends"):
            group.send([])
        return list(group.receive())

    run_group(2, lambda g: g.send([]), receiver_sends)


# --- two processes: a trainer-side sender and an engine holder ------------------------------------------


def sender_process(model_dir: str, requests, answers) -> None:
    """Rank 0: a 'trained' policy (the tiny model with new weights) sends its weights, then scores
    the sequences the engine holder sends back with its own forward pass. Its group's port is its first answer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(perturbed_weights(model_dir, seed=8))
    store = listening_store()
    answers.put(store.port)
    group = init_sync_group("127.0.0.1", store.port, 0, 2, "gloo", timeout_s=60, store=store)
    group.send(model.state_dict().items(), bucket_bytes=32 << 10)
    group.close()
    while (item := requests.get(timeout=60)) is not None:
        prompt, response, temperature = item
        answers.put(forward_logprobs(model, prompt, response, temperature))


@pytest.mark.slow
def test_after_a_sync_engine_and_sender_compute_the_same_logprobs(tmp_path):
    from rlhf_core.rollout.hf_engine import HFEngine
    from rlhf_core.types import GenerationRequest, SamplingParams

    model_dir = make_tiny_llama(tmp_path, seed=4)
    engine = HFEngine(model_dir, device="cpu")
    prompt = [12, 13, 14]
    request = GenerationRequest(prompt, SamplingParams(n=2, temperature=0.8, max_new_tokens=10, seed=3))
    before = engine.generate([request])[0]

    ctx = multiprocessing.get_context("spawn")
    requests, answers = ctx.Queue(), ctx.Queue()
    sender = ctx.Process(target=sender_process, args=(model_dir, requests, answers), daemon=True)
    sender.start()
    try:
        engine.init_weight_sync("127.0.0.1", answers.get(timeout=60), 1, 2, "gloo", 60)
        engine.receive_weights()
        after = engine.generate([request])[0]
        assert [o.token_ids for o in after] != [o.token_ids for o in before]
        for out in after:
            requests.put((prompt, out.token_ids, 0.8))
            torch.testing.assert_close(out.logprobs, answers.get(timeout=60), atol=1e-4, rtol=0)
        requests.put(None)
        sender.join(30)
        assert sender.exitcode == 0
    finally:
        engine.close_weight_sync()
        if sender.is_alive():
            sender.terminate()


def test_lora_pairs_merge_into_the_base_and_out_of_order_tensors_are_refused():
    """W = W0 + B @ A written into the target, in float32 and (computed in float32, then cast) in bf16; exact
    here (small integers). Pairs come as consecutive A then B of one layer; anything else is an error."""
    from rlhf_core.weight_sync import lora_pairs, merge_lora_pair

    base = torch.ones(2, 3)
    a, b = torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[1.0], [2.0]])
    want = torch.tensor([[2.0, 3.0, 4.0], [3.0, 5.0, 7.0]])
    assert torch.equal(merge_lora_pair(base, a, b, out=torch.empty(2, 3)), want)
    assert torch.equal(
        merge_lora_pair(base.bfloat16(), a, b, out=torch.empty(2, 3, dtype=torch.bfloat16)).float(), want
    )
    with pytest.raises(WeightSyncError, match=r"does not fit a weight of shape \(3, 2\)"):
        merge_lora_pair(torch.ones(3, 2), a, b, out=torch.empty(3, 2))
    assert [n for n, _, _ in lora_pairs([("l.lora_A", a), ("l.lora_B", b)])] == ["l"]
    with pytest.raises(WeightSyncError, match="'m.lora_B' is not the next half of a LoRA pair"):
        list(lora_pairs([("l.lora_A", a), ("m.lora_B", b)]))
    with pytest.raises(WeightSyncError, match="arrived without its .lora_B"):
        list(lora_pairs([("l.lora_A", a)]))
    # a fused expert stack: one pair per expert, stacked (expert 1's update is twice expert 0's)
    stack_a, stack_b = torch.stack([a, 2 * a]), torch.stack([b, b])
    got = merge_lora_pair(torch.ones(2, 2, 3), stack_a, stack_b, out=torch.empty(2, 2, 3))
    assert torch.equal(got, torch.stack([want, 2 * want - 1]))
    with pytest.raises(WeightSyncError, match=r"does not fit a weight of shape \(2, 2, 3\)"):
        merge_lora_pair(torch.ones(2, 2, 3), stack_a[:1], stack_b, out=torch.empty(2, 2, 3))
