"""When each step's batch is generated: in turn with training (sync, in ``step.rl_step``), or ahead of it in a
thread (async)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from rlhf_cli.rl.groups import trainers_asleep
from rlhf_cli.rl.rollout import Batch, Rollout


class BatchSchedule:
    def __init__(self, cfg, rollout: Rollout, trainers: list):
        self.cfg = cfg
        self.rollout = rollout
        self.trainers = trainers  # what sleeps with --train.colocate_all --ds.enable_sleep
        self.ready: list[Batch] = []  # async: batches generated for the steps after this one, in step order
        # async: the last step generated, whether the thread runs; guarded by _cv
        self._cv = threading.Condition()
        self._generated = 0
        self._producing = False
        self.max_queue_size_seen = 0

    def batches(self, step: int, total_steps: int) -> Iterator[Batch | None]:
        """The batches of steps ``step + 1`` to ``total_steps`` (fewer when the data runs out), each yielded
        once the step before it is finished: trained, synced, evaluated and checkpointed. The sync pipeline
        yields None: ``step.rl_step`` generates the batch then."""
        if self.cfg.train.async_enable:
            return self._async(step, total_steps)
        return self._sync(step, total_steps)

    def _sync(self, step: int, total_steps: int) -> Iterator[Batch | None]:
        for _ in range(step, total_steps):
            # None: the step generates its batch itself; a resumed async run's batches first
            yield self.ready.pop(0) if self.ready else None

    def _async(self, step: int, total_steps: int) -> Iterator[Batch]:
        """Generate in a thread, ``train.async_queue_size`` (Q) batches ahead of training: batch k by policy
        version k-1-Q, started once step k-1-Q is finished (the schedule and why: docs/async.md). With
        ``--train.colocate_all --ds.enable_sleep`` the trainers sleep whenever they wait for a batch."""
        hybrid_sleep = self.cfg.train.colocate_all and self.cfg.ds.enable_sleep
        ahead = self.cfg.train.async_queue_size
        cv = self._cv
        errors: list[BaseException] = []
        stop = threading.Event()
        finished = step  # steps trained, synced and checkpointed
        self._generated = step + len(self.ready)
        self._producing = True

        def produce():
            try:
                while self._generated < total_steps:
                    with cv:
                        cv.wait_for(lambda: stop.is_set() or finished >= self._generated - ahead)
                    if stop.is_set():
                        break
                    t0 = time.perf_counter()
                    batch = self.rollout.collect(self._generated + 1)
                    if batch is None:
                        break
                    batch.rollout_metrics["timing/generation"] = time.perf_counter() - t0
                    with cv:
                        self.ready.append(batch)
                        self._generated += 1
                        cv.notify_all()
            except BaseException as exc:  # surfaced in the training thread
                errors.append(exc)
            finally:
                with cv:
                    self._producing = False
                    cv.notify_all()

        thread = threading.Thread(target=produce, name="rlhf-rollout", daemon=True)
        thread.start()
        try:
            while True:
                with cv:
                    cv.notify_all()  # a step finished: the thread may start the batch it allows
                    self.max_queue_size_seen = max(self.max_queue_size_seen, len(self.ready))
                    asleep = (
                        hybrid_sleep and not self.ready
                    )  # a waiting batch is trained on at once: no sleep
                with trainers_asleep(self.trainers, asleep), cv:
                    cv.wait_for(lambda: self.ready or not self._producing)
                    batch = self.ready.pop(0) if self.ready else None
                if batch is None:
                    break
                yield batch
                with cv:
                    finished += 1
            if errors:
                raise errors[0]
        finally:
            stop.set()
            with cv:
                cv.notify_all()
            thread.join(timeout=30)

    def wait_generated(self, step: int) -> None:
        """Wait until the async thread has generated the batch of ``step`` (or stopped); at once otherwise."""
        with self._cv:
            self._cv.wait_for(lambda: self._generated >= step or not self._producing)
