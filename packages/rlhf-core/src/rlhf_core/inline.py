"""Actors without Ray: what a run that fits one process uses instead of a Ray cluster (``--ray.single_process``),
and the one calling convention (:class:`ActorLike`) every rank and engine handle follows; see
docs/plugin-hooks.md (train backends). An inline call runs at once, in the caller's thread; its exception is
kept and raised by :func:`get`, as Ray raises a worker's error there."""

from __future__ import annotations

import os
import sys
from functools import partial
from types import SimpleNamespace
from typing import Any


class InlineRef:
    """The result of a call made through an :class:`InlineActor` (the value, or the exception it raised)."""

    __slots__ = ("value", "error")

    def __init__(self, value: Any = None, error: BaseException | None = None):
        self.value, self.error = value, error

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class ActorLike:
    """``handle.method.remote(*args, **kwargs)`` returning a reference that :func:`get` waits for, as a Ray
    actor handle has it natively. Subclasses define ``_call`` (private, so that it never hides a method of
    the object called)."""

    def __getattr__(self, method: str) -> SimpleNamespace:
        if method.startswith("_"):
            raise AttributeError(method)
        return SimpleNamespace(remote=partial(self._call, method))


class InlineActor(ActorLike):
    """A worker in this process: a call runs ``obj.method`` now (arguments that are :class:`InlineRef` are
    resolved first, as Ray resolves object refs) and returns an :class:`InlineRef`."""

    def __init__(self, obj: Any):
        self.obj = obj

    def _call(self, method: str, *args: Any, **kwargs: Any) -> InlineRef:
        try:
            args = tuple(get(a) if isinstance(a, InlineRef) else a for a in args)
            kwargs = {k: get(v) if isinstance(v, InlineRef) else v for k, v in kwargs.items()}
            return InlineRef(getattr(self.obj, method)(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - raised again by get(), where Ray raises a worker's error
            return InlineRef(error=exc)


def get(refs: Any) -> Any:
    """``ray.get`` for :class:`InlineRef` results (one, or a list); Ray's own refs go to ``ray.get``."""
    if isinstance(refs, InlineRef):
        return refs.result()
    if isinstance(refs, list) and all(isinstance(r, InlineRef) for r in refs):
        return [r.result() for r in refs]
    import ray

    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError:
        # When a rank dies, its peers' collectives fail too (gloo: "connection reset by peer"), and one of those
        # errors may be the one raised: report the dead rank, the cause, once Ray knows it died.
        if isinstance(refs, list):
            for ref in ray.wait(refs, num_returns=len(refs), timeout=DEAD_PEER_WAIT_S)[0]:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    raise
                except Exception:  # noqa: BLE001 - another rank's own error: the first one is raised below
                    pass
        raise


DEAD_PEER_WAIT_S = 30.0
"""How long :func:`get` waits for the other ranks of a failed call, looking for a dead one."""


def kill(actor: Any) -> None:
    """``ray.kill`` for either kind of actor; an inline one calls its object's ``close()`` if it has one."""
    if isinstance(actor, InlineActor):
        if (close := getattr(actor.obj, "close", None)) is not None:
            close()
        return
    import ray

    ray.kill(actor)


def single_process(cfg: Any, processes: int, backend_can: bool = True) -> bool:
    """Whether a run whose workers need ``processes`` processes runs them in the driver's, without Ray
    (``--ray.single_process``: ``auto`` when it can, ``true`` or refuse, ``false`` never; ``reasons`` below
    say when it cannot). Raises ValueError naming the reason when ``true`` cannot be honoured.
    """
    setting = str(cfg.ray.single_process).lower()
    if setting not in ("auto", "true", "false"):
        raise ValueError(f"--ray.single_process {cfg.ray.single_process}: expected auto, true or false")
    if setting == "false":
        return False
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    named = "--ray.address" if cfg.ray.address else "$RAY_ADDRESS"
    reasons = [
        why
        for applies, why in (
            (
                processes != 1,
                f"the run needs {processes} worker processes (one per training rank, reference "
                "model, critic, reward model and rollout engine that cannot share the actor rank's "
                "process)",
            ),
            (
                not backend_can,
                f"--train.backend {cfg.train.backend} cannot run its rank in the driver's process",
            ),
            (address, f"a Ray cluster is named ({named} {address})"),
            (cfg.ray.dashboard, "--ray.dashboard asks for a Ray cluster"),
        )
        if applies
    ]
    if setting == "true" and reasons:
        raise ValueError("--ray.single_process true cannot be honoured: " + "; ".join(reasons))
    ray = sys.modules.get("ray")  # auto: a Ray session this process started (a test's, a notebook's) is used
    return not reasons and not (setting == "auto" and ray is not None and ray.is_initialized())
