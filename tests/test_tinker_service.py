"""``rlhf serve-tinker`` driven by the unmodified ``tinker`` SDK (the real client, over HTTP on loopback) on a
tiny random Llama: the SL loop, the losses against hand computations, sampling against the trainer's
log-probs, two sessions training at once, exact save/load, and the refusals."""

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from rlhf_cli.tinker_service import losses  # noqa: E402
from rlhf_cli.tinker_service.server import serve  # noqa: E402
from rlhf_cli.tinker_service.service import TinkerService  # noqa: E402

KEY = "tml-test-key"
ADAM = types.AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    service = TinkerService(tiny_model, str(tmp_path_factory.mktemp("tinker")), micro_batch_size=2)
    http = serve(service, "127.0.0.1", 0, KEY, 1 << 20)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    yield service, f"http://127.0.0.1:{http.server_address[1]}"
    http.shutdown()


def client(server) -> "tinker.ServiceClient":
    return tinker.ServiceClient(base_url=server[1], api_key=KEY)


def sequences(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 100, (int(torch.randint(5, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def sl_datum(tokens: list[int]) -> types.Datum:
    weights = [0.0] * 2 + [1.0] * (len(tokens) - 3)  # the first two targets are "prompt"
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def rl_datum(tokens: list[int], q: list[float], adv: list[float]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": q, "advantages": adv},
    )


def logprobs_of(result) -> list[torch.Tensor]:
    return [out["logprobs"].to_torch() for out in result.loss_fn_outputs]


def test_an_sl_loop_lowers_the_loss_and_reports_each_tokens_logprob(server):
    tc = client(server).create_lora_training_client(base_model=server[0].base, rank=8, seed=0).result()
    data = [sl_datum(s) for s in sequences(6, seed=1)]  # 3 micro-batches of 2
    losses_seen = []
    for _ in range(8):
        fb = tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(ADAM).result()
        # the loss is Tinker's: -sum(weights * logprob of each target), from the log-probs it returns
        by_hand = -sum(
            float((lp * d.loss_fn_inputs["weights"].to_torch()).sum()) for lp, d in zip(logprobs_of(fb), data)
        )
        assert fb.metrics["loss:sum"] == pytest.approx(by_hand, rel=1e-5)
        assert [len(lp) for lp in logprobs_of(fb)] == [d.model_input.length for d in data]
        losses_seen.append(fb.metrics["loss:sum"])
    assert losses_seen[-1] < 0.5 * losses_seen[0], losses_seen


def test_each_loss_matches_its_formula_and_gradient():
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]], requires_grad=True)
    q = torch.tensor([[-1.5, -1.0, -0.5], [-0.3, -2.0, 0.0]])
    adv = torch.tensor([[1.0, -2.0, 0.5], [-1.0, 3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    r = (lp - q).exp().detach()
    # hand computations, token by token (r: 1.649, 0.368, 1 | 1, 2.226)
    ppo = -sum(
        min(r[i, j] * adv[i, j], r[i, j].clamp(0.8, 1.2) * adv[i, j]) * mask[i, j]
        for i in range(2)
        for j in range(3)
    )
    cases = {
        "cross_entropy": (losses.cross_entropy(lp, adv), -(lp * adv).sum(), -adv),
        "importance_sampling": (
            losses.importance_sampling(lp, q, adv, mask),
            -(r * adv * mask).sum(),
            -r * adv * mask,
        ),
        "ppo": (losses.ppo(lp, q, adv, mask, 0.8, 1.2), ppo, None),
        "cispo": (
            losses.cispo(lp, q, adv, mask, 0.8, 1.2),
            -(r.clamp(0.8, 1.2) * lp * adv * mask).sum(),
            -r.clamp(0.8, 1.2) * adv * mask,  # the clipped weight is a constant
        ),
        "dro": (
            losses.dro(lp, q, adv, mask, 0.1),
            -((lp * adv - 0.05 * (lp - q) ** 2) * mask).sum(),
            -(adv - 0.1 * (lp - q)) * mask,
        ),
    }
    for name, (value, expected, grad) in cases.items():
        assert float(value) == pytest.approx(float(expected), rel=1e-6), name
        if grad is not None:
            (got,) = torch.autograd.grad(value, lp)
            torch.testing.assert_close(got, grad.detach(), msg=name)
    # ppo's gradient flows only where the unclipped term is the minimum: -r * A there, 0 elsewhere
    (got,) = torch.autograd.grad(losses.ppo(lp, q, adv, mask, 0.8, 1.2), lp)
    unclipped = (r * adv <= r.clamp(0.8, 1.2) * adv) & mask.bool()
    torch.testing.assert_close(got, torch.where(unclipped, -r * adv, 0.0))


def test_forward_serves_every_rl_loss_with_the_clients_config(server):
    tc = client(server).create_lora_training_client(base_model=server[0].base, rank=4, seed=1).result()
    seqs = sequences(3, seed=2)
    g = torch.Generator().manual_seed(3)
    qs = [(-torch.rand(len(s) - 1, generator=g) * 3).tolist() for s in seqs]
    advs = [torch.randn(len(s) - 1, generator=g).tolist() for s in seqs]
    data = [rl_datum(s, q, a) for s, q, a in zip(seqs, qs, advs)]
    config = {
        "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
        "cispo": {},
        "dro": {"beta": 0.3},
    }
    for name in ("importance_sampling", "ppo", "cispo", "dro"):
        out = tc.forward(data, name, config.get(name)).result()
        lps = logprobs_of(out)
        cfg = losses.TinkerLossConfig(name, **config.get(name, {}))
        by_hand = sum(
            float(
                losses.tinker_objective(cfg, lp, torch.ones_like(lp), None, torch.tensor(q), torch.tensor(a))
            )
            for lp, q, a in zip(lps, qs, advs)
        )
        assert out.metrics["loss:sum"] == pytest.approx(by_hand, rel=1e-5), name


def test_forward_backward_custom_runs_in_the_client_over_forward_and_cross_entropy(server):
    sc = client(server)
    data = [sl_datum(s) for s in sequences(3, seed=12)]
    twins = [
        sc.create_lora_training_client(base_model=server[0].base, rank=4, seed=5).result() for _ in range(2)
    ]

    def weighted_nll(data, logprobs_list):  # the cross-entropy, written as a custom loss
        loss = sum(-(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs_list))
        return loss, {"nll": float(loss)}

    custom = twins[0].forward_backward_custom(data, weighted_nll).result()
    builtin = twins[1].forward_backward(data, "cross_entropy").result()
    assert custom.metrics["nll"] == pytest.approx(builtin.metrics["loss:sum"], rel=1e-5)
    for tc in twins:  # the same gradients: the same step
        tc.optim_step(ADAM).result()
    a, b = (logprobs_of(tc.forward(data, "cross_entropy").result()) for tc in twins)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)


def test_optim_step_takes_each_steps_adam_params(server):
    sc = client(server)
    data = [sl_datum(s) for s in sequences(3, seed=13)]
    runs = {}
    for name, adam in {
        "a": [types.AdamParams(learning_rate=1e-2)] * 2,
        "a again": [types.AdamParams(learning_rate=1e-2)] * 2,
        "lr": [types.AdamParams(learning_rate=1e-2), types.AdamParams(learning_rate=3e-2)],
        "clipped": [types.AdamParams(learning_rate=1e-2, grad_clip_norm=1e-3)] * 2,
    }.items():
        tc = sc.create_lora_training_client(base_model=server[0].base, rank=4, seed=6).result()
        for params in adam:
            tc.forward_backward(data, "cross_entropy").result()
            norm = tc.optim_step(params).result().metrics["grad_norm"]
        runs[name] = logprobs_of(tc.forward(data, "cross_entropy").result())[0]
    assert norm > 1e-3  # so the clipped run's two steps were scaled, by different factors
    assert torch.equal(runs["a"], runs["a again"])
    assert not torch.equal(runs["a"], runs["lr"]) and not torch.equal(runs["a"], runs["clipped"])


def test_sampling_from_saved_weights_matches_the_trainers_logprobs(server):
    tc = client(server).create_lora_training_client(base_model=server[0].base, rank=4, seed=2).result()
    data = [sl_datum(s) for s in sequences(4, seed=4)]
    for _ in range(3):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(ADAM).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([5, 6, 7])
    params = types.SamplingParams(max_tokens=6, seed=11, temperature=1.0)
    first = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    again = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]  # seeded
    assert len(first.sequences) == 3 and all(len(s.tokens) == 6 for s in first.sequences)
    eos = server[0].config.eos_token_id  # a stop id ends a sample (kept); stop=[] turns EOS off
    stopped = sampler.sample(
        prompt, 8, types.SamplingParams(max_tokens=6, seed=3, stop=[eos, 9, 10])
    ).result()
    assert all(s.tokens[-1] in (eos, 9, 10) or len(s.tokens) == 6 for s in stopped.sequences)
    assert all(t not in (eos, 9, 10) for s in stopped.sequences for t in s.tokens[:-1])
    for seq in first.sequences:  # the sampler's log-probs are the trained model's
        tokens = [5, 6, 7, *seq.tokens]
        (trainer,) = logprobs_of(tc.forward([sl_datum(tokens)], "cross_entropy").result())
        torch.testing.assert_close(torch.tensor(seq.logprobs), trainer[2:], atol=1e-5, rtol=1e-5)
        prompt_lp = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
        assert prompt_lp[0] is None
        torch.testing.assert_close(torch.tensor(prompt_lp[1:]), trainer, atol=1e-5, rtol=1e-5)
    # a named snapshot keeps its weights while training goes on
    path = tc.save_weights_for_sampler("named").result().path
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    named = client(server).create_sampling_client(model_path=path).result()
    assert named.sample(prompt, 3, params).result().sequences[0].logprobs == pytest.approx(
        tc.create_sampling_client(path).result().sample(prompt, 3, params).result().sequences[0].logprobs
    )


def train(tc, data, steps: int) -> None:
    for _ in range(steps):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(ADAM).result()


def test_two_sessions_train_two_models_at_once_without_interference(server):
    service = server[0]
    data = {name: [sl_datum(s) for s in sequences(4, seed=seed)] for name, seed in (("a", 5), ("b", 6))}
    clients = {name: client(server) for name in data}
    models = {
        name: c.create_lora_training_client(base_model=service.base, rank=4, seed=7).result()
        for name, c in clients.items()
    }
    with ThreadPoolExecutor(2) as pool:  # both clients' requests interleave on the server
        list(pool.map(lambda n: train(models[n], data[n], 4), data))
    together = {n: logprobs_of(models[n].forward(data[n], "cross_entropy").result()) for n in data}
    for name in data:  # the same model trained alone ends at the same weights, bit for bit
        alone = clients[name].create_lora_training_client(base_model=service.base, rank=4, seed=7).result()
        train(alone, data[name], 4)
        for x, y in zip(logprobs_of(alone.forward(data[name], "cross_entropy").result()), together[name]):
            assert torch.equal(x, y)
    # one base in memory: every model's frozen weights are the first model's tensors
    modules = [m.worker.model.module for m in service.models.values()]
    frozen = [[p.data_ptr() for p in m.parameters() if not p.requires_grad] for m in modules]
    assert all(f == frozen[0] for f in frozen)
    # a session's ids are capabilities: another session's model id is not served to a made-up caller
    other = models["a"].model_id.replace(models["a"].model_id.split(":")[0], "0" * 32)
    reply = httpx.post(f"{server[1]}/api/v1/get_info", json={"model_id": other}, headers={"X-API-Key": KEY})
    assert reply.status_code == 404 and "unknown model_id" in reply.json()["detail"]


def test_save_state_and_load_state_resume_bit_exactly(server):
    sc = client(server)
    data = [sl_datum(s) for s in sequences(4, seed=8)]
    tc = sc.create_lora_training_client(base_model=server[0].base, rank=4, seed=3).result()
    train(tc, data, 2)
    path = tc.save_state("mid").result().path
    train(tc, data, 2)
    straight = logprobs_of(tc.forward(data, "cross_entropy").result())
    resumed = sc.create_training_client_from_state_with_optimizer(path).result()
    train(resumed, data, 2)
    for x, y in zip(logprobs_of(resumed.forward(data, "cross_entropy").result()), straight):
        assert torch.equal(x, y)
    # weights only (fresh Adam moments): the same start, a different next step
    fresh = sc.create_training_client_from_state(path).result()
    train(fresh, data, 2)
    assert not torch.equal(logprobs_of(fresh.forward(data, "cross_entropy").result())[0], straight[0])
    tc.load_state_with_optimizer(path).result()  # back in the same model
    train(tc, data, 2)
    assert torch.equal(logprobs_of(tc.forward(data, "cross_entropy").result())[0], straight[0])


def test_a_failed_forward_backward_leaves_the_model_as_it_was(server, monkeypatch):
    from rlhf_train_deepspeed.losses import LOSSES

    sc = client(server)
    data = [sl_datum(s) for s in sequences(4, seed=9)]  # 2 micro-batches: the second one fails
    twins = [
        sc.create_lora_training_client(base_model=server[0].base, rank=4, seed=4).result() for _ in range(2)
    ]
    twins[0].forward_backward(data[:2], "cross_entropy").result()
    real, calls = LOSSES["tinker"], []

    def fails_on_the_second_micro_batch(model, mb, cfg, counts):  # a fault no check can see before it runs
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected fault")
        return real(model, mb, cfg, counts)

    monkeypatch.setitem(LOSSES, "tinker", fails_on_the_second_micro_batch)
    with pytest.raises(tinker.RequestFailedError, match="injected fault"):
        twins[0].forward_backward(data, "cross_entropy").result()
    monkeypatch.setitem(LOSSES, "tinker", real)
    twins[1].forward_backward(data[:2], "cross_entropy").result()
    for tc in twins:  # the failed call left no gradient behind: both take the same step
        tc.optim_step(ADAM).result()
    a, b = (logprobs_of(tc.forward(data, "cross_entropy").result()) for tc in twins)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_bad_requests_get_a_4xx_with_the_reason(server):
    service, url = server
    tc = client(server).create_lora_training_client(base_model=service.base, rank=4).result()
    ok = sl_datum([5, 6, 7, 8])
    bad = {
        "outside the vocabulary": [sl_datum([5, 6, service.vocab_size + 3, 8])],
        "shifted by one": [
            types.Datum(
                model_input=types.ModelInput.from_ints([5, 6, 7]),
                loss_fn_inputs={"target_tokens": [9, 9, 9], "weights": [1.0] * 3},
            )
        ],
        "takes \\['weights'\\], got \\[\\]": [
            types.Datum(
                model_input=types.ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={"target_tokens": [6, 7, 8]}
            )
        ],
    }
    for reason, data in bad.items():
        with pytest.raises(tinker.BadRequestError, match=reason):
            tc.forward_backward(data, "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="gspo.*refused: its sequence-level ratio"):
        tc.forward_backward([ok], "gspo").result()
    with pytest.raises(tinker.BadRequestError, match="dro needs loss_fn_config"):
        tc.forward_backward([rl_datum([5, 6, 7], [0.0, 0.0], [1.0, 1.0])], "dro").result()
    with pytest.raises(tinker.BadRequestError, match="betas must be in"):
        tc.optim_step(types.AdamParams(beta1=1.5)).result()
    with pytest.raises(tinker.BadRequestError, match="is not served here"):
        client(server).create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="inflight"):
        tc.save_weights_and_get_sampling_client(kind="inflight").result()
    with pytest.raises(tinker.BadRequestError, match="max_tokens"):
        tc.save_weights_and_get_sampling_client().result().sample(
            ok.model_input, 1, types.SamplingParams()
        ).result()
    headers = {"X-API-Key": KEY}
    big = httpx.post(f"{url}/api/v1/create_session", content=b"x" * ((1 << 20) + 1024), headers=headers)
    assert big.status_code == 413 and "limit is 1048576" in big.json()["detail"]
    wrong = httpx.post(f"{url}/api/v1/create_session", json={}, headers={"X-API-Key": "tml-wrong"})
    assert wrong.status_code == 401
    assert httpx.get(f"{url}/api/v1/training_runs", headers=headers).status_code == 404
    # none of the refused requests changed the model: it still trains from where it was
    tc.forward_backward([ok], "cross_entropy").result()
    assert "grad_norm" in tc.optim_step(ADAM).result().metrics


def test_listening_beyond_loopback_needs_a_tml_key(capsys):
    from rlhf_cli.main import main as rlhf
    from rlhf_cli.tinker_service.server import main

    assert rlhf(["serve-tinker", "--base_model", "unused", "--host", "0.0.0.0"]) == 2
    assert "without --api_key" in capsys.readouterr().err
    assert main(["--base_model", "unused", "--api_key", "secret"]) == 2
    assert "'tml-'" in capsys.readouterr().err
