"""Log-probs and entropy from logits."""

from __future__ import annotations

import math

import torch

from rlhf_algos.logits import entropy_from_logits, logprobs_and_entropy, logprobs_from_logits


def test_logprobs_hand_computed():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])
    out = logprobs_from_logits(logits, torch.tensor([[2, 0]]))
    lse = math.log(math.e + math.e**2 + math.e**3)
    torch.testing.assert_close(out, torch.tensor([[3.0 - lse, -math.log(3)]]))


def test_logprobs_in_bf16_are_computed_in_fp32():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 50, generator=gen) * 4
    labels = torch.randint(0, 50, (2, 4), generator=gen)
    expected = torch.log_softmax(logits.bfloat16().double(), -1).gather(-1, labels[..., None]).squeeze(-1)
    out = logprobs_from_logits(logits.bfloat16(), labels)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_entropy_hand_computed():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [math.log(3), 0.0, -1e4, -1e4], [100.0, 0.0, 0.0, 0.0]]])
    h = entropy_from_logits(logits)
    p = (0.75, 0.25)  # the -1e4 entries have probability 0 (underflow) and contribute nothing
    torch.testing.assert_close(
        h, torch.tensor([[math.log(4), -sum(x * math.log(x) for x in p), 0.0]]), atol=1e-6, rtol=1e-6
    )


def test_entropy_matches_definition_and_has_gradient():
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 5, 11, generator=gen) * 3).requires_grad_(True)
    p = torch.softmax(logits.detach().double(), -1)
    h = entropy_from_logits(logits)
    torch.testing.assert_close(h.double(), -(p * p.log()).sum(-1), atol=1e-5, rtol=1e-5)
    entropy_from_logits(logits).sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    # dH/dz_v = -p_v (log p_v + H)
    h = -(p * p.log()).sum(-1, keepdim=True)
    torch.testing.assert_close(logits.grad.double(), -p * (p.log() + h), atol=1e-5, rtol=1e-5)


def test_logprobs_and_entropy_in_one_pass_match_both_and_torch_autograd():
    """Values against the two separate functions; gradients of any mix of the two outputs against a float64
    autograd reference; an unused entropy adds nothing; bf16 logits get bf16 gradients."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, 11, generator=gen) * 3
    logits[0, 0, 4] = -1e4  # a probability that underflows to 0 stays finite, as in entropy_from_logits
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    w_lp, w_h = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    lp, h = logprobs_and_entropy(logits, labels)
    torch.testing.assert_close(lp, logprobs_from_logits(logits, labels), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(h, entropy_from_logits(logits), atol=1e-5, rtol=1e-5)

    for a, b in ((1.0, 0.0), (0.0, 1.0), (1.0, 0.5)):
        ref = logits.double().requires_grad_(True)
        logp = torch.log_softmax(ref, -1)
        want_h = -(logp.exp() * logp).sum(-1)
        (
            a * (logp.gather(-1, labels[..., None]).squeeze(-1) * w_lp).sum() + b * (want_h * w_h).sum()
        ).backward()
        z = logits.clone().requires_grad_(True)
        lp, h = logprobs_and_entropy(z, labels)
        loss = a * (lp * w_lp).sum() + (b * (h * w_h).sum() if b else 0.0)
        loss.backward()
        torch.testing.assert_close(z.grad.double(), ref.grad, atol=1e-5, rtol=1e-5)

    z = logits.bfloat16().requires_grad_(True)
    lp, h = logprobs_and_entropy(z, labels)
    (lp.sum() + h.detach().sum()).backward()
    assert lp.dtype == h.dtype == torch.float32 and z.grad.dtype == torch.bfloat16


def test_logprobs_and_entropy_hold_at_most_two_vocabulary_buffers_besides_the_logits():
    """The most float32 ``[n, V]`` buffers alive at once during forward and backward, besides the float32
    logits (the input, and the one ``[n, V]`` saved for backward): two with the entropy in the loss
    (backward's recomputed probabilities and the gradient), one with the log-probs alone (the gradient is
    built in the probabilities' buffer). The code that saved the probabilities too and multiplied ``p * z``
    out of place held four with both in the loss."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(5)
    n, vocab = 64, 5000
    logits = torch.randn(n, vocab, generator=gen) * 3
    labels = torch.randint(0, vocab, (n,), generator=gen)
    buffer = n * vocab * 4

    def most_alive(loss) -> float:
        # a function of its own, so that the previous call's graph, leaf and gradient are gone (and their frees
        # not recorded) before this one is profiled
        z = logits.clone().requires_grad_(True)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss(*logprobs_and_entropy(z, labels)).backward()
        # the raw allocator records, in time order (a free is a negative size): the function events would
        # attribute them to ops and lose the order
        records = sorted(
            (r for r in prof.profiler.kineto_results.events() if r.name() == "[memory]"),
            key=lambda r: r.start_ns(),
        )
        live = peak = 0
        for r in records:
            if abs(r.nbytes()) == buffer:
                live += r.nbytes()
                peak = max(peak, live)
        return peak / buffer

    assert most_alive(lambda lp, h: lp.sum() + 0.5 * h.sum()) == 2
    assert most_alive(lambda lp, h: lp.sum() + h.detach().sum()) == 1
    assert most_alive(lambda lp, h: h.sum()) == 2


def _head_problem(n=37, hidden=16, vocab=1000, seed=3):
    gen = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=gen) * 0.8)
    h = torch.randn(n, hidden, generator=gen)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    return head, h, labels


def test_head_logprobs_reentrant_recompute_gives_the_same_values_and_gradients(monkeypatch):
    """``reentrant=True`` (a frozen ZeRO-3 head) only changes how backward recomputes the chunks: the values and
    the hidden states' gradients are bitwise those of the default."""
    import rlhf_algos.logits as logits_mod
    from rlhf_algos.logits import head_logprobs

    head, h, labels = _head_problem()
    head.requires_grad_(False)  # frozen, as under LoRA
    monkeypatch.setattr(logits_mod, "CHUNK_BYTES", 8 * 4 * head.weight.shape[0])
    got = []
    for reentrant in (False, True):
        hx = h.clone().requires_grad_(True)
        lp, ent = head_logprobs(
            head, hx, labels, head.weight.shape[0], 0.7, with_entropy=True, reentrant=reentrant
        )
        (lp.sum() + 0.5 * ent.sum()).backward()
        got.append((lp.detach(), ent.detach(), hx.grad))
    assert all(torch.equal(a, b) for a, b in zip(*got))


def test_head_logprobs_in_chunks_equal_a_full_log_softmax_with_gradients(monkeypatch):
    """Chunks of 8 rows (5 chunks, the last one ragged) against a float64 log_softmax over all the logits at
    once, computed here by hand, at temperatures 1 and 0.7; gradients in the hidden states and the head's
    weight of a mix of log-probs and entropies; an entropy left out of the loss adds nothing.

    Tolerance: an fp32 logit, a 16-term dot product with sum |w_i h_i| ~ 10 here, carries a rounding error
    of at most 16 * 6e-8 * 10 ~ 1e-5; the log-softmax and entropy add at most one more such error, hence
    2e-5 on values and on the gradients, built from the same terms. Against the same computation in a
    single chunk the fp32 results agree to 1e-6 (the issue's bound): each row goes through the same ops."""
    import rlhf_algos.logits as logits_mod
    from rlhf_algos.logits import head_logprobs

    head, h, labels = _head_problem()
    vocab = head.weight.shape[0]
    monkeypatch.setattr(logits_mod, "CHUNK_BYTES", 8 * 4 * vocab)
    gen = torch.Generator().manual_seed(4)
    w_lp, w_h = torch.randn(len(h), generator=gen), torch.randn(len(h), generator=gen)
    for temperature in (1.0, 0.7):
        w = head.weight.detach().double().requires_grad_(True)
        x = h.double().requires_grad_(True)
        logp = torch.log_softmax((x @ w.T) / temperature, -1)
        want_lp = logp.gather(-1, labels[:, None]).squeeze(-1)
        want_h = -(logp.exp() * logp).sum(-1)
        ((want_lp * w_lp).sum() + 0.5 * (want_h * w_h).sum()).backward()

        head.zero_grad()
        hx = h.clone().requires_grad_(True)
        lp, ent = head_logprobs(head, hx, labels, vocab, temperature, with_entropy=True)
        ((lp * w_lp).sum() + 0.5 * (ent * w_h).sum()).backward()
        torch.testing.assert_close(lp.double(), want_lp.detach(), atol=2e-5, rtol=0)
        torch.testing.assert_close(ent.double(), want_h.detach(), atol=2e-5, rtol=0)
        torch.testing.assert_close(hx.grad.double(), x.grad, atol=2e-5, rtol=0)
        torch.testing.assert_close(head.weight.grad.double(), w.grad, atol=2e-5, rtol=0)

        with torch.no_grad():  # forward-only (compute_logprobs): the same numbers
            lp_ng, ent_ng = head_logprobs(head, h, labels, vocab, temperature, with_entropy=True)
        assert torch.equal(lp_ng, lp.detach()) and torch.equal(ent_ng, ent.detach())
        monkeypatch.setattr(logits_mod, "CHUNK_BYTES", 1 << 40)  # one chunk: the "same numbers"
        with torch.no_grad():
            lp_one, ent_one = head_logprobs(head, h, labels, vocab, temperature, with_entropy=True)
        monkeypatch.setattr(logits_mod, "CHUNK_BYTES", 8 * 4 * vocab)
        torch.testing.assert_close(lp_one, lp_ng, atol=1e-6, rtol=0)
        torch.testing.assert_close(ent_one, ent_ng, atol=1e-6, rtol=0)

    # the entropy detached (no entropy bonus): the gradient is the log-probs' alone
    head.zero_grad()
    hx = h.clone().requires_grad_(True)
    lp, ent = head_logprobs(head, hx, labels, vocab, with_entropy=True)
    (lp.sum() + ent.detach().sum()).backward()
    x = h.double().requires_grad_(True)
    torch.log_softmax(x @ head.weight.detach().double().T, -1).gather(-1, labels[:, None]).sum().backward()
    torch.testing.assert_close(hx.grad.double(), x.grad, atol=2e-5, rtol=0)
    lp_only, none = head_logprobs(head, h, labels, vocab)
    assert none is None
    torch.testing.assert_close(lp_only, lp.detach(), atol=1e-6, rtol=0)


def test_head_logprobs_keep_no_logits_for_backward(monkeypatch):
    """What autograd saves for backward (counted with saved_tensors_hooks, parameters aside) is the hidden
    states, the labels and the last chunk's logits (and a log-sum-exp and entropy per row): the other chunks'
    logits are recomputed in backward, and the probabilities in backward of each chunk. Materialising the
    logits of all rows, as the code before chunking did, saves them: 37 rows x 1000 x 4 bytes."""
    import rlhf_algos.logits as logits_mod
    from rlhf_algos.logits import head_logprobs, logprobs_and_entropy

    head, h, labels = _head_problem()
    vocab = head.weight.shape[0]
    monkeypatch.setattr(logits_mod, "CHUNK_BYTES", 8 * 4 * vocab)
    params = {head.weight.data_ptr()}

    def saved_bytes(fn) -> int:
        total = 0

        def pack(t):
            nonlocal total
            if t.data_ptr() not in params:
                total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return total

    hx = h.clone().requires_grad_(True)
    chunked = saved_bytes(lambda: head_logprobs(head, hx, labels, vocab, 0.7, with_entropy=True))
    whole = saved_bytes(lambda: logprobs_and_entropy(head(hx) / 0.7, labels))
    inputs = len(h) * (h.shape[1] * 4 + 8)  # the hidden states the head multiplies, and the int64 labels
    per_row = vocab * 4 + 2 * 4  # the float32 logits, a log-sum-exp and an entropy
    assert whole == inputs + len(h) * per_row
    last = len(h) % 8 or 8  # rows of the last chunk
    assert chunked == inputs + last * per_row
