"""Conformance suite for rollout engines: what the RL loop relies on, checked against a real model.

Subclass it and override ``make_engine(model_dir)``. The suite saves a tiny random Llama (fp32) and checks
the engine against transformers' forward pass of the same weights. Engines also provide
``init_weight_sync(master_addr, master_port, first_rank, world_size, backend, timeout_s)`` and
``receive_weights()``, the receiving side of :mod:`rlhf_core.weight_sync`.
"""

from __future__ import annotations

import json
import multiprocessing
import shutil
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from rlhf_core.testing.tiny import make_tiny_llama
from rlhf_core.types import GenerationOutput, GenerationRequest, SamplingParams

PROMPTS = [[7, 8, 9, 10], [30, 31], [50, 51, 52, 53, 54, 55, 56], [99]]


def perturbed_weights(model_dir: str | Path, seed: int = 1) -> dict[str, torch.Tensor]:
    """The model's weights with Gaussian noise (std 0.1) added: a clearly different policy, reproducibly."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    state = {k: v for f in files for k, v in load_file(str(f)).items()}
    gen = torch.Generator().manual_seed(seed)
    return {
        name: t + 0.1 * torch.randn(t.shape, generator=gen, dtype=t.dtype)
        for name, t in sorted(state.items())
    }


def send_weights_process(model_dir: str, ports, world_size: int, seed: int, timeout_s: float = 60.0) -> None:
    """A weight sender for tests: forms a gloo sync group as rank 0 on 127.0.0.1 (its port goes into the queue
    ``ports``) and sends :func:`perturbed_weights`. Runs in its own process (``multiprocessing`` spawn)."""
    from rlhf_core.weight_sync import init_sync_group, listening_store

    store = listening_store()
    ports.put(store.port)
    group = init_sync_group("127.0.0.1", store.port, 0, world_size, "gloo", timeout_s, store=store)
    group.send(perturbed_weights(model_dir, seed).items(), bucket_bytes=16 << 10)
    group.close()


def copy_with_eos(model_dir: str | Path, eos_ids: list[int], dest: str | Path) -> str:
    """A copy of a model directory whose config and generation config end samples at ``eos_ids``."""
    dest = Path(dest)
    shutil.copytree(model_dir, dest, dirs_exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        path = dest / name
        if path.exists():
            data = {**json.loads(path.read_text()), "eos_token_id": list(eos_ids)}
            path.write_text(json.dumps(data, indent=2))
    return str(dest)


def hf_model(model_dir: str, state: dict[str, torch.Tensor] | None = None):
    """The transformers model of ``model_dir`` in fp32 eval mode, with ``state`` loaded when given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state)
    return model


@torch.no_grad()
def forward_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    """Trainer-style recomputation: ``log_softmax(logits / T)`` of each response token, one forward."""
    ids = torch.tensor([prompt + response])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    return logp.gather(1, torch.tensor(response)[:, None]).squeeze(1).tolist()


class RolloutEngineConformance:
    """Behaviour every rollout engine must show; override :meth:`make_engine`."""

    logprob_atol: ClassVar[float] = 1e-4
    model_overrides: ClassVar[dict[str, Any]] = {}
    """``LlamaConfig`` overrides of the tiny model (e.g. a head size a GPU attention kernel supports)."""

    def make_engine(self, model_dir: str) -> Any:
        raise NotImplementedError("subclasses build their engine from model_dir (fp32)")

    def close_engine(self, engine: Any) -> None:
        """Release an engine made by :meth:`make_engine` (GPU memory, actors)."""
        if hasattr(engine, "shutdown"):
            engine.shutdown()

    # --- fixtures (one engine per test class) -----------------------------------------------------

    @pytest.fixture(scope="class")
    def model_dir(self, tmp_path_factory) -> str:
        return make_tiny_llama(tmp_path_factory.mktemp("conformance_model"), seed=0, **self.model_overrides)

    @pytest.fixture(scope="class")
    def engine(self, model_dir):
        engine = self.make_engine(model_dir)
        yield engine
        self.close_engine(engine)

    @pytest.fixture(scope="class")
    def reference(self, model_dir):
        return hf_model(model_dir)

    @pytest.fixture(scope="class")
    def original_weights(self, reference) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in reference.state_dict().items()}

    # --- helpers ----------------------------------------------------------------------------------

    @staticmethod
    def generate_one(engine, prompt: list[int], **params) -> list[GenerationOutput]:
        (outs,) = engine.generate([GenerationRequest(list(prompt), SamplingParams(**params))])
        return outs

    @staticmethod
    def set_weights(engine, weights: dict[str, torch.Tensor]) -> None:
        engine.update_weights(weights)
        engine.reset_prefix_cache()

    def greedy(self, engine, prompt: list[int], max_new_tokens: int = 8, **params) -> GenerationOutput:
        return self.generate_one(engine, prompt, temperature=0.0, max_new_tokens=max_new_tokens, **params)[0]

    def assert_logprobs_match(self, model, prompt, out: GenerationOutput, temperature: float) -> None:
        want = forward_logprobs(model, prompt, out.token_ids, temperature)
        got = torch.tensor(out.logprobs, dtype=torch.float64)
        torch.testing.assert_close(
            got, torch.tensor(want, dtype=torch.float64), atol=self.logprob_atol, rtol=0
        )

    @staticmethod
    def stop_point(tokens: list[int], avoid: set[int], start: int = 2) -> int:
        """An index k >= start whose token first appears there, with no ``avoid`` token up to it."""
        for k in range(start, len(tokens)):
            if tokens[k] not in tokens[:k] and not avoid & set(tokens[: k + 1]):
                return k
        pytest.skip(f"greedy sequence {tokens} has no usable stop point")

    # --- the contract -----------------------------------------------------------------------------

    def test_shapes_and_types(self, engine, reference):
        vocab = reference.config.vocab_size
        requests = [
            GenerationRequest(PROMPTS[i], SamplingParams(n=n, max_new_tokens=6, seed=i))
            for i, n in enumerate([1, 2, 3])
        ]
        results = engine.generate(requests)
        assert [len(r) for r in results] == [1, 2, 3]
        for out in [out for outs in results for out in outs]:
            assert isinstance(out, GenerationOutput)
            assert 1 <= len(out.token_ids) <= 6 and len(out.logprobs) == len(out.token_ids)
            assert all(isinstance(t, int) and 0 <= t < vocab for t in out.token_ids)
            assert all(isinstance(x, float) and -1e4 < x <= 1e-6 for x in out.logprobs)
            assert out.finish_reason in ("stop", "length")
            if out.finish_reason == "length":
                assert len(out.token_ids) == 6

    def test_max_new_tokens_ends_with_length(self, engine):
        outs = self.generate_one(engine, PROMPTS[0], n=3, max_new_tokens=5, ignore_eos=True, seed=3)
        assert [len(o.token_ids) for o in outs] == [5, 5, 5]
        assert {o.finish_reason for o in outs} == {"length"}

    def test_stop_token_ids_end_sample_and_are_kept(self, engine, reference):
        eos = reference.config.eos_token_id
        base = self.greedy(engine, PROMPTS[2], max_new_tokens=10, ignore_eos=True).token_ids
        k = self.stop_point(base, {eos})
        out = self.greedy(engine, PROMPTS[2], max_new_tokens=10, stop_token_ids=(base[k],))
        assert out.token_ids == base[: k + 1]
        assert out.finish_reason == "stop"

    def test_min_new_tokens_suppresses_stops(self, engine, reference):
        eos = reference.config.eos_token_id
        base = self.greedy(engine, PROMPTS[1], max_new_tokens=8, ignore_eos=True).token_ids
        k = self.stop_point(base, {eos}, start=1)
        stop = base[k]
        free = self.greedy(engine, PROMPTS[1], max_new_tokens=8, stop_token_ids=(stop,))
        assert free.token_ids == base[: k + 1]
        held = self.greedy(engine, PROMPTS[1], max_new_tokens=8, stop_token_ids=(stop,), min_new_tokens=k + 2)
        assert held.token_ids[:k] == base[:k]
        assert held.token_ids[k] != stop  # suppressed: the next most likely token instead
        assert len(held.token_ids) >= k + 2
        assert not {stop, eos} & set(held.token_ids[: k + 2])
        fixed = self.generate_one(engine, PROMPTS[1], n=4, max_new_tokens=6, min_new_tokens=6, seed=5)
        assert [len(o.token_ids) for o in fixed] == [6] * 4

    def test_eos_ends_sample_unless_ignored(self, engine, model_dir, reference, tmp_path):
        base = self.greedy(engine, PROMPTS[3], max_new_tokens=10, ignore_eos=True)
        k = self.stop_point(base.token_ids, {reference.config.eos_token_id})
        other = self.make_engine(copy_with_eos(model_dir, [base.token_ids[k]], tmp_path / "eos_model"))
        try:
            out = self.greedy(other, PROMPTS[3], max_new_tokens=10)
            assert out.token_ids == base.token_ids[: k + 1] and out.finish_reason == "stop"
            out = self.greedy(other, PROMPTS[3], max_new_tokens=10, ignore_eos=True)
            assert out.token_ids == base.token_ids and out.finish_reason == "length"
        finally:
            self.close_engine(other)

    def test_n_samples_are_distinct_draws(self, engine):
        outs = self.generate_one(engine, PROMPTS[0], n=4, max_new_tokens=8, ignore_eos=True, seed=7)
        assert len(outs) == 4
        assert len({tuple(o.token_ids) for o in outs}) > 1

    def test_same_seed_same_tokens_whatever_the_batch(self, engine):
        target = GenerationRequest(
            PROMPTS[0], SamplingParams(n=2, temperature=0.9, top_p=0.9, max_new_tokens=8, seed=11)
        )
        alone = engine.generate([target])[0]
        crowd = [
            GenerationRequest(PROMPTS[2], SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=1)),
            target,
            GenerationRequest(PROMPTS[3], SamplingParams(n=1, temperature=0.0, max_new_tokens=3)),
        ]
        batched = engine.generate(crowd)[1]
        again = engine.generate([crowd[0], target])[1]
        for outs in (batched, again):
            assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
            for a, b in zip(outs, alone, strict=True):
                torch.testing.assert_close(a.logprobs, b.logprobs, atol=self.logprob_atol, rtol=0)
        reseeded = self.generate_one(
            engine, PROMPTS[0], n=2, temperature=0.9, top_p=0.9, max_new_tokens=8, seed=12
        )
        assert [o.token_ids for o in reseeded] != [o.token_ids for o in alone]

    @pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
    def test_logprobs_match_a_forward_pass(self, engine, reference, temperature):
        requests = [
            GenerationRequest(p, SamplingParams(n=2, temperature=temperature, max_new_tokens=10, seed=21 + i))
            for i, p in enumerate(PROMPTS)
        ]
        for req, outs in zip(requests, engine.generate(requests), strict=True):
            for out in outs:
                self.assert_logprobs_match(reference, req.prompt_ids, out, temperature)

    def test_logprobs_are_taken_before_top_k_top_p(self, engine, reference):
        outs = self.generate_one(
            engine, PROMPTS[2], n=3, temperature=0.8, top_k=20, top_p=0.8, max_new_tokens=10, seed=4
        )
        for out in outs:
            self.assert_logprobs_match(reference, PROMPTS[2], out, 0.8)

    def test_update_weights_changes_generation(self, engine, model_dir, reference, original_weights):
        before = self.greedy(engine, PROMPTS[0], max_new_tokens=10, ignore_eos=True)
        new = perturbed_weights(model_dir, seed=3)
        self.set_weights(engine, new)
        try:
            after = self.greedy(engine, PROMPTS[0], max_new_tokens=10, ignore_eos=True)
            assert after.token_ids != before.token_ids
            self.assert_logprobs_match(hf_model(model_dir, new), PROMPTS[0], after, 0.0)
        finally:
            self.set_weights(engine, original_weights)
        assert (
            self.greedy(engine, PROMPTS[0], max_new_tokens=10, ignore_eos=True).token_ids == before.token_ids
        )

    def test_weights_through_a_sync_group(self, engine, model_dir, original_weights):
        spawn = multiprocessing.get_context("spawn")
        ports = spawn.Queue()
        sender = spawn.Process(target=send_weights_process, args=(model_dir, ports, 2, 5), daemon=True)
        sender.start()
        try:
            engine.init_weight_sync("127.0.0.1", ports.get(timeout=60), 1, 2, "gloo", 60.0)
            engine.receive_weights()
            engine.reset_prefix_cache()
            sender.join(60)
            assert sender.exitcode == 0
            out = self.greedy(engine, PROMPTS[1], max_new_tokens=10, ignore_eos=True)
            self.assert_logprobs_match(
                hf_model(model_dir, perturbed_weights(model_dir, 5)), PROMPTS[1], out, 0.0
            )
        finally:
            if sender.is_alive():
                sender.terminate()
            self.set_weights(engine, original_weights)

    def test_sleep_and_wake(self, engine, original_weights):
        def tokens():
            return self.greedy(engine, PROMPTS[2], max_new_tokens=8, ignore_eos=True).token_ids

        before = tokens()
        engine.sleep(1)
        with pytest.raises(RuntimeError):
            self.greedy(engine, PROMPTS[2])
        engine.wake_up()
        assert tokens() == before
        engine.sleep(2)
        engine.wake_up()
        self.set_weights(engine, original_weights)  # level 2 discarded the weights
        assert tokens() == before

    def test_bad_requests_are_refused_with_the_reason(self, engine, reference):
        vocab = reference.config.vocab_size
        with pytest.raises(ValueError, match="request 1.*empty"):
            engine.generate(
                [
                    GenerationRequest([5], SamplingParams(max_new_tokens=2)),
                    GenerationRequest([], SamplingParams(max_new_tokens=2)),
                ]
            )
        with pytest.raises(ValueError, match=f"request 0.*{vocab}"):
            engine.generate([GenerationRequest([5, vocab], SamplingParams(max_new_tokens=2))])
        with pytest.raises(ValueError, match="top_p"):
            engine.generate([GenerationRequest([5], SamplingParams(max_new_tokens=2, top_p=0.0))])
