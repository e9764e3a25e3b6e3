"""Where a worker object lives, decided once when it is built, and one way to call it wherever that is.

A :class:`Handle` stands for an object in this process (:func:`local`, :func:`threaded`), inside a training
rank's process (:func:`hosted`) or in a Ray actor (:func:`ray_actor`). ``handle.method(*args, **kwargs)`` runs
``obj.method`` there and returns a :class:`Future`; :func:`wait` gives its value or raises the call's error,
and ``await future`` does the same in asyncio code. A Future passed as an argument reaches the object as its
value. Code above this module cannot tell which placement it got. Ray is imported here only, and only by a run
that uses it (a single-process run never does: ``--ray.single_process``, :func:`single_process`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

DEAD_PEER_WAIT_S = 30.0
"""How long :func:`wait` waits for the other ranks of a failed call, looking for a dead one."""

SHARED_THREADS = ThreadPoolExecutor(thread_name_prefix="rlhf-call")
"""Runs the calls of a :func:`threaded` object that has no thread of its own."""


class Future:
    """The result of one call: a ``concurrent.futures.Future`` (``pending``: of a call run on a thread, or one
    already done, see :func:`done`), or a Ray ObjectRef (``ref``: of a call run by a Ray actor)."""

    __slots__ = ("pending", "ref")

    def __init__(self, pending: concurrent.futures.Future | None = None, ref: Any = None):
        self.pending, self.ref = pending, ref

    def result(self) -> Any:
        """The value, waiting for it; raises the call's error (a Ray actor's as Ray raises it)."""
        if self.ref is not None:
            import ray

            return ray.get(self.ref)
        return self.pending.result()

    def __await__(self):
        return (self.ref if self.ref is not None else asyncio.wrap_future(self.pending)).__await__()


class Joined(Future):
    """Several futures as one: ``fn`` of their values in order (by default the list), computed once, when it is
    first waited for; a failed part raises its error there (the first, as :func:`wait` picks it)."""

    __slots__ = ("parts", "fn")

    def __init__(self, parts: list, fn: Callable[[list], Any] = list):
        super().__init__()
        self.parts, self.fn = parts, fn

    def result(self) -> Any:
        if self.pending is None:
            try:
                self.pending = done(self.fn(wait(self.parts)))
            except Exception as exc:  # noqa: BLE001 - kept, and raised to every waiter
                self.pending = done(error=exc)
        return self.pending.result()

    def __await__(self):
        return asyncio.to_thread(self.result).__await__()


def done(value: Any = None, error: BaseException | None = None) -> Future:
    """A Future already there: ``value``, or ``error`` raised where it is waited for."""
    pending = concurrent.futures.Future()
    if error is not None:
        pending.set_exception(error)
    else:
        pending.set_result(value)
    return Future(pending)


def as_future(x):
    """``x`` as a Future: a Ray ObjectRef (what a third-party backend may return) is waited on through Ray;
    any other object that is not a Future is its own value."""
    if isinstance(x, Future):
        return x
    return Future(ref=x) if isinstance(x, getattr(sys.modules.get("ray"), "ObjectRef", ())) else done(x)


def wait(futures: Any) -> Any:
    """The value of one future, or the values of a list of them in order; raises the first error. When a rank
    dies its peers' collectives fail too (gloo: "connection reset by peer"), and one of those errors may be
    the first: the dead rank's error, the cause, is raised instead once Ray knows it died."""
    if not isinstance(futures, list):
        return as_future(futures).result()
    futures = [as_future(f) for f in futures]
    refs = [f.ref for f in futures if f.ref is not None]
    fetched = iter(_ray_get(refs) if refs else ())  # fetched together, as one ray.get
    return [next(fetched) if f.ref is not None else f.result() for f in futures]


def first_done(futures: list[Future]) -> Future:
    """The first of ``futures`` to finish, once it has (calls run by Ray actors are waited on through Ray,
    those of this process only when no Ray call is among them)."""
    for f in futures:
        if f.ref is None and f.pending.done():
            return f
    refs = [f.ref for f in futures if f.ref is not None]
    if not refs:
        concurrent.futures.wait([f.pending for f in futures], return_when=concurrent.futures.FIRST_COMPLETED)
        return first_done(futures)
    import ray

    (ref,), _ = ray.wait(refs, num_returns=1)
    return next(f for f in futures if f.ref is not None and f.ref == ref)


def _ray_get(refs):
    import ray

    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError:
        for ref in ray.wait(refs, num_returns=len(refs), timeout=DEAD_PEER_WAIT_S)[0]:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                raise
            except Exception:  # noqa: BLE001 - another rank's own error: the first one is raised below
                pass
        raise


def worker_died() -> type[BaseException] | tuple:
    """The error a call raises when the process behind its handle died (Ray's), to catch; nothing where Ray
    was never imported (every object then lives in this process, which is still alive)."""
    ray = sys.modules.get("ray")
    return ray.exceptions.RayActorError if ray is not None else ()


def share(value: Any) -> Future:
    """``value`` stored once for many calls that take it as an argument: in Ray's object store when this
    process is connected to Ray (each call then sends a reference), else the value itself."""
    ray = sys.modules.get("ray")
    return Future(ref=ray.put(value)) if ray is not None and ray.is_initialized() else done(value)


class Handle:
    """An object wherever it lives: ``handle.method(*args, **kwargs)`` returns a :class:`Future` of
    ``obj.method(*args, **kwargs)``. Every attribute that does not start with ``_`` is a method of the object;
    :func:`kill` ends the object."""

    __slots__ = ("_call", "_kill")

    def __init__(self, call: Callable[..., Future], kill: Callable[[], Any] = lambda: None):
        self._call, self._kill = call, kill

    def __getattr__(self, method: str) -> Callable[..., Future]:
        if method.startswith("_"):
            raise AttributeError(method)
        return partial(self._call, method)


def kill(handle: Handle) -> None:
    """End the object: a Ray actor is killed, an object of this process has its ``close()`` called (if it has
    one), a hosted one ends with its rank."""
    handle._kill()


def _run(obj, method, args, kwargs):
    """``obj.method(*args, **kwargs)``, Future arguments replaced by their values (a failed one raises)."""
    args = [wait(a) if isinstance(a, Future) else a for a in args]
    return getattr(obj, method)(
        *args, **{k: wait(v) if isinstance(v, Future) else v for k, v in kwargs.items()}
    )


def _closer(obj):
    return lambda: getattr(obj, "close", lambda: None)()


def local(obj: Any) -> Handle:
    """``obj`` in this process: a call runs at once, in the caller's thread; its error is kept and raised by
    :func:`wait`, where a Ray actor's is raised."""

    def call(method, *args, **kwargs):
        try:
            return done(_run(obj, method, args, kwargs))
        except Exception as exc:  # noqa: BLE001 - raised again by wait()
            return done(error=exc)

    return Handle(call, _closer(obj))


def threaded(obj: Any, thread: ThreadPoolExecutor | None = None) -> Handle:
    """``obj`` in this process, its calls run on ``thread`` (one worker: the thread that built it, so that its
    torch work stays on one thread) or, without one, on :data:`SHARED_THREADS`; the caller goes on."""
    threads = thread or SHARED_THREADS
    return Handle(
        lambda method, *args, **kwargs: Future(threads.submit(_run, obj, method, args, kwargs)), _closer(obj)
    )


def hosted(rank: Handle, name: str) -> Handle:
    """The object a training rank hosts under ``name`` (``TrainWorker.host``): a call runs in the rank's
    process, in turn with the rank's own calls (``call_hosted``). It ends with the rank."""
    return Handle(partial(rank.call_hosted, name))


def as_handle(obj: Any) -> Handle:
    """``obj`` as a Handle: a Handle is kept, a Ray actor handle is called through Ray, and any other object
    runs its calls on :data:`SHARED_THREADS`."""
    if isinstance(obj, Handle):
        return obj
    if isinstance(obj, getattr(getattr(sys.modules.get("ray"), "actor", None), "ActorHandle", ())):
        return _ray_handle(obj)
    return threaded(obj)


def ray_actor(cls: type, *args: Any, options: dict[str, Any] | None = None, **kwargs: Any) -> Handle:
    """``cls(*args, **kwargs)`` started as a Ray actor with ``options`` (``ray.remote``'s: ``num_cpus``,
    ``num_gpus``, ``scheduling_strategy``, ``runtime_env``, ``max_concurrency``...); :func:`kill` ends it."""
    import ray

    return _ray_handle(ray.remote(cls).options(**(options or {})).remote(*_refs(args), **_refs(kwargs)))


def _refs(args):
    """Future arguments (a tuple's or a dict's) as Ray passes them: an ObjectRef, which Ray resolves in the
    actor, else the value."""

    def ref(x):
        return (x.ref if x.ref is not None else x.result()) if isinstance(x, Future) else x

    return {k: ref(v) for k, v in args.items()} if isinstance(args, dict) else [ref(a) for a in args]


def _ray_handle(actor) -> Handle:
    import ray

    return Handle(
        lambda method, *args, **kwargs: Future(
            ref=getattr(actor, method).remote(*_refs(args), **_refs(kwargs))
        ),
        partial(ray.kill, actor),
    )


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
