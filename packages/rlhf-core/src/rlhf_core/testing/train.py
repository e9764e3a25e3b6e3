"""Conformance suite for train backends: the contract the RL controller speaks (``rlhf_core.types.TrainGroup``).

Subclass it with the ``name`` of a registered backend (or override ``make_backend``). The suite saves a tiny
random Llama (fp32), starts one two-rank policy group on a local Ray cluster for the whole class, and checks
it against transformers' forward pass of the weights the group reports. It needs Ray (a train backend's
workers are Ray actors); ``rlhf_core`` itself does not import it.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import pytest
import torch

from rlhf_core.batches import PolicyMicroBatch, PolicyStepConfig, SequenceBatch, make_sequence_batch
from rlhf_core.handles import wait
from rlhf_core.testing.engines import forward_logprobs
from rlhf_core.testing.tiny import make_tiny_llama

# One prompt, four samples of different lengths (a GRPO group), as two micro-batches of two rows.
PROMPT = [5, 6, 7]
RESPONSES = [[20, 21, 22], [30], [40, 41], [50, 51]]
ADVANTAGES = [1.0, -1.0, -1.0, 1.0]  # group-normalised rewards 1, 0, 0, 1
LOSS_ATOL = 1e-5  # float32 sums of 8 terms of size ~1


def micro_batches() -> list[SequenceBatch]:
    return [make_sequence_batch([PROMPT] * 2, RESPONSES[i : i + 2], pad_token_id=0) for i in (0, 2)]


def policy_micro_batches() -> list[PolicyMicroBatch]:
    """On-policy micro-batches (no old log-probs): the PPO ratio is 1, so the token-mean loss is
    ``-sum_i A_i |y_i| / sum_i |y_i|`` = -(3 - 1 - 2 + 2) / 8 = -0.25."""
    adv = torch.tensor(ADVANTAGES).view(2, 2, 1)
    return [
        PolicyMicroBatch(seq, None, adv[k] * seq.response_mask().float(), rollout_logprobs=None)
        for k, seq in enumerate(micro_batches())
    ]


def reference_logprobs(state: dict[str, torch.Tensor], model_dir: str) -> list[list[float]]:
    """Per-sample response log-probs of ``state`` loaded into a transformers model, one unpadded forward each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert not unexpected and set(missing) <= tied, (
        f"state dict names: missing {missing}, unexpected {unexpected}"
    )
    model.eval()
    return [forward_logprobs(model, PROMPT, r, 1.0) for r in RESPONSES]


class TrainBackendConformance:
    """What the RL controller relies on from a train backend's policy group."""

    name: ClassVar[str] = ""
    """Registered name (``--train.backend``)."""
    flags: ClassVar[list[str]] = []
    """Extra ``rlhf train ppo`` flags for the group's config."""
    logprob_atol: ClassVar[float] = 1e-4
    """Log-probs of a padded batch vs unpadded forward passes: float32 sums in another order."""

    def make_backend(self) -> Any:
        from rlhf_core.plugins import get_plugin_manager, resolve

        return resolve(get_plugin_manager(), "train_backends", self.name, "--train.backend")

    @pytest.fixture(scope="class")
    def model_dir(self, tmp_path_factory) -> str:
        return make_tiny_llama(tmp_path_factory.mktemp("train_backend") / "model", tie_word_embeddings=False)

    @pytest.fixture(scope="class")
    def group(self, model_dir):
        import ray

        from rlhf_core.config_parser import parse_config

        own = not ray.is_initialized()
        if own:
            ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        cfg, _ = parse_config(
            "ppo",
            [
                "--actor.model_name_or_path",
                model_dir,
                *"--train.micro_batch_size 2 --train.batch_size 4 --actor.adam.lr 1e-3 --actor.lr_warmup_ratio 0".split(),
                *self.flags,
            ],
        )
        group = self.make_backend().create_group("actor", cfg, None, 2, total_steps=10, num_threads=1)
        yield group
        self.release_group(group)
        if own:
            ray.shutdown()

    def release_group(self, group) -> None:
        """Called once the class is done with ``group``: shuts it down. A backend's test suite may keep it
        instead (e.g. to reuse its started ranks in later tests)."""
        group.shutdown()

    def logprobs(self, group, batches: list[SequenceBatch]) -> list[torch.Tensor]:
        return wait(group.forward(batches, 1.0))

    def policy_step(self, group) -> dict[str, float]:
        wait(group.forward_backward(policy_micro_batches(), "policy", PolicyStepConfig(loss="ppo")))
        return wait(group.optim_step())

    def test_the_group_is_two_data_parallel_ranks(self, group):
        assert (group.dp_size, group.ring_size) == (2, 1)

    def test_logprobs_match_a_forward_pass_of_the_reported_weights(self, group, model_dir):
        want = reference_logprobs(wait(group.weights()), model_dir)
        got = self.logprobs(group, micro_batches())
        assert [tuple(t.shape) for t in got] == [(2, 3), (2, 2)]
        rows = [row for t in got for row in t]
        for i, (row, expected) in enumerate(zip(rows, want, strict=True)):
            torch.testing.assert_close(
                row[: len(expected)], torch.tensor(expected), atol=self.logprob_atol, rtol=0
            )
            assert not row[len(expected) :].any(), f"sample {i}: non-zero log-probs past its end"

    def test_a_grpo_step_lowers_the_loss_and_keeps_the_ranks_equal(self, group, model_dir):
        before = torch.cat([lp.sum(-1) for lp in self.logprobs(group, micro_batches())])
        metrics = self.policy_step(group)
        assert metrics["skipped"] == 0.0
        assert metrics["loss"] == pytest.approx(-0.25, abs=LOSS_ATOL)
        after = torch.cat([lp.sum(-1) for lp in self.logprobs(group, micro_batches())])
        adv = torch.tensor(ADVANTAGES)
        # the objective sum_i A_i log p(y_i) rises: a small Adam step goes down the gradient
        assert float((adv * after).sum()) > float((adv * before).sum())
        # the ranks trained on different micro-batches; their weights must still agree (gradients reduced):
        # the same micro-batch on both ranks gives the same log-probs
        seq = micro_batches()[0]
        rank0, rank1 = self.logprobs(group, [seq, seq])
        torch.testing.assert_close(rank0, rank1, atol=1e-6, rtol=0)

    def test_the_weight_broadcast_delivers_the_reported_weights_each_step(self, group):
        """The engines join the broadcast group once; every later sync reuses it, as the controller does."""
        from rlhf_core.weight_sync import init_sync_group

        addr, port = group.weight_sync_address()
        engine, received = {}, []

        def receive():  # the engine's side, as rank 1
            if "sync" not in engine:
                engine["sync"] = init_sync_group(addr, port, 1, 2, "gloo", 60.0)
            received.append({name: t.clone() for name, t in engine["sync"].receive()})

        try:
            for sync_round in range(2):
                if sync_round:  # new weights to send
                    self.policy_step(group)
                want = wait(group.weights())
                sends = group.broadcast_weights_to_engines_async(addr, port, 2, "gloo", 60.0)
                thread = threading.Thread(target=receive)
                thread.start()
                wait(sends)
                thread.join(60)
                got = received[sync_round] if len(received) > sync_round else {}
                assert set(got) == set(want), f"sync {sync_round + 1}: names differ"
                assert all(torch.equal(got[k], want[k]) for k in want), (
                    f"sync {sync_round + 1}: values differ"
                )
            assert any(not torch.equal(received[0][k], received[1][k]) for k in received[0])
        finally:
            if "sync" in engine:
                engine["sync"].close()

    def test_a_checkpoint_restores_the_weights_and_export_writes_a_model(self, group, model_dir, tmp_path):
        from transformers import AutoModelForCausalLM

        wait(group.save_state(str(tmp_path / "ckpt")))
        saved = wait(group.weights())
        self.policy_step(group)
        assert any(not torch.equal(v, saved[k]) for k, v in wait(group.weights()).items())
        wait(group.load_state(str(tmp_path / "ckpt")))
        restored = wait(group.weights())
        assert all(torch.equal(restored[k], saved[k]) for k in saved)
        wait(group.export(str(export := tmp_path / "export")))
        exported = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).state_dict()
        assert all(torch.equal(exported[k], saved[k]) for k in saved)
        assert (export / "config.json").exists()
