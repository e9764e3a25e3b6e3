"""A second train backend for the tests: plain torch, one Ray actor per rank, gradients all-reduced over gloo.

It speaks the training contract of ``rlhf_core`` (``TrainGroup``, ``rlhf_core.batches``) and imports
nothing of ``rlhf_train_deepspeed``: if the controller needed anything beyond the contract, the runs with
this backend would fail. Policy role only (GRPO-style runs: no critic, reference or reward model), fp32,
AdamW with a constant learning rate, no supervised trainers.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from rlhf_core import hookimpl, weight_sync
from rlhf_core.batches import PolicyMicroBatch, PolicyStepConfig, SequenceBatch
from rlhf_core.errors import UserError
from rlhf_core.handles import Joined

# Ray pickles the rank class by value: the workers cannot import this test module
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def response_logprobs(model, seq: SequenceBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` log-probs of the response tokens (zero past each row's end) and the ``[B, T]`` mask.

    Response position ``t`` of row ``i`` is token ``prompt_lens[i] + t``, predicted by the logits one
    position earlier.
    """
    logits = model(input_ids=seq.input_ids, attention_mask=seq.attention_mask).logits.float() / temperature
    logp = (
        torch.log_softmax(logits[:, :-1], -1).gather(-1, seq.input_ids[:, 1:, None]).squeeze(-1)
    )  # [B, L-1]
    t = seq.num_response_positions
    index = (seq.prompt_lens[:, None] - 1 + torch.arange(t)[None, :]).clamp(max=logp.shape[1] - 1)  # [B, T]
    mask = seq.response_mask()
    return logp.gather(1, index) * mask, mask


class PlainRank:
    """One rank: a transformers model, AdamW, and the default gloo process group."""

    def __init__(self, rank: int, world_size: int, threads: int):
        self.rank, self.world_size = rank, world_size
        self.stores: dict[int, dist.TCPStore] = {}  # what master_address opened, by port, until it is joined
        torch.set_num_threads(threads)

    def master_address(self) -> tuple[str, int]:
        """This node's address and the port of a store rank 0 listens on already, kept for the group it is for."""
        store = weight_sync.listening_store()
        self.stores[store.port] = store
        return ray.util.get_node_ip_address(), store.port

    def init(self, addr: str, port: int, model_dir: str, lr: float, seed: int) -> None:
        from transformers import AutoModelForCausalLM

        store = self.stores.pop(port) if self.rank == 0 else dist.TCPStore(addr, port, is_master=False)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
        torch.manual_seed(seed)
        self.model_dir = model_dir
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.step = {"loss": 0.0, "gap": 0.0, "tokens": 0.0}  # the forward_backward calls since optim_step

    @torch.no_grad()
    def forward(self, batches: list[SequenceBatch], temperature: float) -> list:
        return [response_logprobs(self.model, b, temperature)[0] for b in batches]

    def forward_backward(
        self, mbs: list[PolicyMicroBatch], loss: str, cfg: PolicyStepConfig, counts: dict
    ) -> dict:
        """Gradients of the policy loss accumulate until :meth:`optim_step`; returns this call's part."""
        from rlhf_core.plugins import get_plugin_manager, resolve
        from rlhf_core.types import LossAggregation, PolicyLossInput

        if loss != "policy":
            raise NotImplementedError(f"the plain torch backend trains the policy loss only, not {loss!r}")
        if cfg.kl_coef or cfg.entropy_coef:
            raise NotImplementedError("the plain torch backend has no KL or entropy loss terms")
        policy_loss = resolve(get_plugin_manager(), "policy_losses", cfg.loss, "--actor.policy_loss_type")
        agg = LossAggregation(
            mode=cfg.agg_mode,
            num_tokens=counts["num_tokens"],
            num_sequences=counts["num_sequences"],
            max_len=cfg.max_len,
            dp_size=self.world_size,
        )
        part = {"loss": 0.0, "gap": 0.0, "tokens": 0.0}
        for mb in mbs:
            lp, mask = response_logprobs(self.model, mb.seq, cfg.temperature)
            old = lp.detach() if mb.old_logprobs is None else mb.old_logprobs
            out = policy_loss(
                PolicyLossInput(
                    logprobs=lp,
                    old_logprobs=old,
                    advantages=mb.advantages,
                    action_mask=mask,
                    rollout_logprobs=mb.rollout_logprobs,
                    eps_clip_low=cfg.eps_clip_low,
                    eps_clip_high=cfg.eps_clip_high,
                    dual_clip=cfg.dual_clip,
                    is_correction=cfg.is_correction,
                    is_threshold=tuple(cfg.is_threshold),
                    aggregation=agg,
                )
            )
            out.loss.backward()
            part["loss"] += (
                float(out.loss.detach()) / self.world_size
            )  # the aggregation multiplied by the ranks
            if mb.old_logprobs is None and mb.rollout_logprobs is not None:
                part["gap"] += float(((lp.detach() - mb.rollout_logprobs).abs() * mask).sum())
                part["tokens"] += float(mask.sum())
        self.step = {k: v + part[k] for k, v in self.step.items()}
        return part

    def optim_step(self) -> dict:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)  # sum over ranks, then the mean, as data-parallel training does
        flat /= self.world_size
        finite = math.isfinite(float(flat.sum()))
        if finite:
            offset = 0
            for p in self.model.parameters():
                p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            self.optimizer.step()
        self.optimizer.zero_grad()
        step, self.step = self.step, {"loss": 0.0, "gap": 0.0, "tokens": 0.0}
        return {**step, "skipped": float(not finite)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def broadcast_weights(self, addr: str, port: int, world_size: int, backend: str, timeout_s: float) -> int:
        if self.rank:
            return 0
        # the engines keep the group for every sync; another address means a new group (an engine was replaced)
        if getattr(self, "sync", None) is None or self.sync.address != f"{addr}:{port}":
            self.sync = weight_sync.init_sync_group(
                addr, port, 0, world_size, backend, timeout_s, store=self.stores.pop(port)
            )
        self.sync.send(self.model.state_dict().items())
        return len(self.model.state_dict())

    def save(self, path: str) -> None:
        if self.rank == 0:  # the ranks hold the same weights and optimizer state
            Path(path).mkdir(parents=True, exist_ok=True)
            torch.save(
                {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()},
                Path(path) / "plain.pt",
            )
        dist.barrier()

    def load(self, path: str) -> None:
        state = torch.load(Path(path) / "plain.pt", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def export(self, out_dir: str) -> None:
        from transformers import AutoTokenizer

        if self.rank == 0:
            self.model.save_pretrained(out_dir, safe_serialization=True)
            AutoTokenizer.from_pretrained(self.model_dir).save_pretrained(out_dir)


def merged(results: list[dict]) -> dict:
    """The ranks' parts of a step as one: the global loss, the skip flag, the rollout/train log-prob gap."""
    out = {"loss": sum(r["loss"] for r in results)}
    if "skipped" in results[0]:
        out["skipped"] = results[0]["skipped"]
    tokens = sum(r["tokens"] for r in results)
    if tokens:
        out["rollout_train_logprob_gap"] = sum(r["gap"] for r in results) / tokens
    return out


class PlainGroup:
    """The ``TrainGroup`` handle of the plain backend."""

    ring_size = 1

    def __init__(self, ranks: list):
        self.actors = ranks
        self.dp_size = len(ranks)

    def wait_ready(self) -> None:
        pass  # create_group waits for the ranks

    def forward(self, batches: list, temperature: float = 1.0, head=None, teacher: int = 0, loss_cfg=None):
        if head not in (None, "logprobs") or teacher:
            raise NotImplementedError(f"the plain torch backend computes policy log-probs only, not {head!r}")
        per = math.ceil(len(batches) / self.dp_size)
        shares = [batches[r * per : (r + 1) * per] for r in range(self.dp_size)]
        refs = [a.forward.remote(s, temperature) for a, s in zip(self.actors, shares, strict=True) if s]
        return Joined(refs, lambda res: [x for r in res for x in r])

    def forward_backward(self, micro_batches: list, loss: str, loss_cfg, counts: dict | None = None):
        if len(micro_batches) % self.dp_size:
            raise ValueError(f"{len(micro_batches)} micro-batches do not split over {self.dp_size} ranks")
        masks = [mb.seq.response_mask() for mb in micro_batches]
        counts = counts or {
            "num_tokens": float(sum(m.sum() for m in masks)),
            "num_sequences": float(sum(m.any(-1).sum() for m in masks)),
        }
        per = len(micro_batches) // self.dp_size
        refs = [
            a.forward_backward.remote(micro_batches[r * per : (r + 1) * per], loss, loss_cfg, counts)
            for r, a in enumerate(self.actors)
        ]
        return Joined(refs, merged)

    def optim_step(self):
        return Joined([a.optim_step.remote() for a in self.actors], merged)

    def save_state(self, path: str):
        return Joined([a.save.remote(path) for a in self.actors])

    def load_state(self, path: str):
        return Joined([a.load.remote(path) for a in self.actors])

    def weights(self):
        return Joined([self.actors[0].state_dict.remote()], lambda res: res[0])

    def export(self, path: str, config_updates=None, ema=None):
        if config_updates or ema:
            raise NotImplementedError("the plain torch backend exports the weights as they are")
        return Joined([a.export.remote(path) for a in self.actors])

    def weight_sync_address(self) -> tuple[str, int]:
        return ray.get(self.actors[0].master_address.remote())

    def broadcast_weights_to_engines_async(
        self, master_addr, master_port, world_size, backend="gloo", timeout_s=600.0
    ) -> list:
        return [
            a.broadcast_weights.remote(master_addr, master_port, world_size, backend, timeout_s)
            for a in self.actors
        ]

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a)
        self.actors = []


class PlainTorchBackend:
    """Registered as ``plain_torch`` by the tests (``rlhf_register_train_backends``)."""

    name = "plain_torch"

    def create_group(
        self,
        role: str,
        cfg,
        pool=None,
        num_workers: int = 1,
        *,
        bundle_indices=None,
        num_cpus_per_worker: float = 1.0,
        num_threads: int | None = None,
        **_options,
    ):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if role != "actor":
            raise UserError(f"the plain_torch backend trains the policy only, not a {role} group")
        threads = num_threads or max(1, (os.cpu_count() or 1) // num_workers)
        ranks = []
        for r in range(num_workers):
            options = {"num_cpus": num_cpus_per_worker, "num_gpus": 0}
            if pool is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=pool,
                    placement_group_bundle_index=bundle_indices[r] if bundle_indices else r,
                )
            ranks.append(ray.remote(PlainRank).options(**options).remote(r, num_workers, threads))
        group = PlainGroup(ranks)
        try:
            addr, port = ray.get(ranks[0].master_address.remote())
            ray.get(
                [
                    a.init.remote(addr, port, cfg.actor.model_name_or_path, cfg.actor.adam.lr, cfg.train.seed)
                    for a in ranks
                ]
            )
        except BaseException:
            group.shutdown()  # ranks outside a placement group would hold their CPUs for the tests after
            raise
        return group

    def run_trainer(self, mode: str, cfg):
        raise UserError(f"the plain_torch backend runs RL only, not rlhf train {mode}")


class Plugin:
    """The plugin object the tests register."""

    @hookimpl
    def rlhf_register_train_backends(self, register):
        register("plain_torch", PlainTorchBackend())
