"""rlhf_core.handles: one Future and one wait whether an object lives in this process, on a thread of its own
or in a Ray actor; errors are raised at wait (or await), a Future passed on reaches the callee as a value."""

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlhf_core import handles
from rlhf_core.handles import done, wait


class Counter:
    def __init__(self):
        self.calls = []
        self.closed = False

    def add(self, x, y=0):
        self.calls.append((x, y, threading.current_thread().name))
        return x + y

    def fail(self):
        raise KeyError("the worker's own error")

    def close(self):
        self.closed = True

    def die(self):
        os._exit(1)


def test_a_local_object_runs_calls_at_once_and_keeps_errors_for_wait():
    obj = Counter()
    counter = handles.local(obj)
    first = counter.add(1, y=2)
    second = counter.add(first, y=first)  # a Future argument reaches the object as its value
    failed = counter.fail()  # does not raise here: wait does, as for a Ray actor
    assert [c[:2] for c in obj.calls] == [(1, 2), (3, 3)]
    assert obj.calls[0][2] == threading.current_thread().name
    assert wait(first) == 3 and wait([first, second]) == [3, 6]
    with pytest.raises(KeyError, match="the worker's own error"):
        wait([second, failed])
    with pytest.raises(KeyError):  # a failed Future passed on fails the call that receives it
        wait(counter.add(failed))
    assert len(obj.calls) == 2
    with pytest.raises(AttributeError):
        counter._private  # noqa: B018 - private names are not methods to call
    handles.kill(counter)
    assert obj.closed


def test_a_threaded_object_runs_every_call_on_its_thread():
    obj = Counter()
    thread = ThreadPoolExecutor(1, thread_name_prefix="engine")
    counter = handles.threaded(obj, thread)
    futures = [counter.add(i) for i in range(3)] + [counter.add(counter.add(10), y=1)]
    assert wait(futures) == [0, 1, 2, 11]
    assert {name for *_, name in obj.calls} == {"engine_0"}
    with pytest.raises(KeyError):
        wait(counter.fail())
    shared = handles.threaded(Counter())  # without a thread of its own: the shared pool, not the caller's
    assert wait(shared.add(1)) == 1
    done = handles.first_done([counter.add(5), handles.local(obj).add(6)])
    assert wait(done) in (5, 6)
    thread.shutdown()


def test_futures_are_awaitable_whatever_backs_them():
    obj = Counter()

    async def main():
        local, threaded = handles.local(obj), handles.threaded(obj)
        values = [await local.add(1), await threaded.add(2), await handles.share(3)]
        with pytest.raises(KeyError):
            await threaded.fail()
        with pytest.raises(KeyError):
            await local.fail()
        return values

    assert asyncio.run(main()) == [1, 2, 3]


def test_joined_futures_are_one_future_of_their_values_in_order_computed_once():
    thread = ThreadPoolExecutor(1)
    counter, seen = handles.threaded(Counter(), thread), []
    joined = handles.Joined(
        [counter.add(1), handles.local(Counter()).add(2), 3], lambda v: seen.append(v) or sum(v)
    )
    assert wait(joined) == 6 and wait([joined, done(4)]) == [6, 4] and seen == [[1, 2, 3]]
    assert wait(counter.add(joined, y=1)) == 7  # passed on as its value
    assert wait(handles.Joined([counter.add(5)])) == [5]  # by default: the list of values

    async def awaited():
        return await handles.Joined([counter.add(8)], sum)

    assert asyncio.run(awaited()) == 8
    failed = handles.Joined([counter.add(1), counter.fail()], sum)
    for _ in range(2):  # the part's error, to every waiter
        with pytest.raises(KeyError, match="the worker's own error"):
            wait(failed)
    thread.shutdown()


def test_values_that_are_not_futures_are_their_own():
    """A backend may return plain values (or, on Ray, ObjectRefs) where the contract says Future."""
    assert wait(7) == 7 and wait([done(1), 2]) == [1, 2]
    assert handles.share({"w": 1}).result() == {"w": 1}  # no Ray in this process: the value itself


def test_hosted_objects_are_called_through_their_rank():
    class Rank:
        def __init__(self):
            self.hosted = {}

        def host(self, name, cls, *args):
            self.hosted[name] = cls(*args)

        def call_hosted(self, name, method, *args, **kwargs):
            return getattr(self.hosted[name], method)(*args, **kwargs)

    rank = handles.local(Rank())
    wait(rank.host("counter", Counter))
    counter = handles.hosted(rank, "counter")
    assert wait(counter.add(2, y=3)) == 5
    handles.kill(counter)  # ends with its rank: nothing to do


@pytest.mark.slow
def test_ray_actors_share_the_same_future_and_wait():
    ray = pytest.importorskip("ray")
    own = not ray.is_initialized()
    if own:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        counter = handles.ray_actor(Counter, options={"num_cpus": 0})
        first = counter.add(1, y=2)
        second = counter.add(first, y=handles.share(10))  # refs resolved by Ray in the actor
        local_arg = counter.add(handles.local(Counter()).add(4))  # a local Future goes as its value
        assert wait([first, second, local_arg]) == [3, 13, 4]
        assert handles.as_future(second.ref).result() == 13  # a bare ObjectRef is waited on too
        assert wait(counter.add(handles.Joined([first, second], sum))) == 16  # joined Ray futures, passed on
        assert wait(handles.first_done([counter.add(5)])) == 5
        with pytest.raises(KeyError, match="the worker's own error"):
            wait(counter.fail())

        async def main():
            return await counter.add(20)

        assert asyncio.run(main()) == 20
        with pytest.raises(handles.worker_died()):
            wait(counter.die())
        handles.kill(counter)
    finally:
        if own:
            ray.shutdown()
