"""An asyncio front for a rollout engine: concurrent requests share batched ``generate`` calls.

Agent episodes run as asyncio tasks and each awaits one turn at a time::

    llm = AsyncEngine(engine)
    outputs = await llm.generate(GenerationRequest(prompt_ids, params))

Requests that arrive while the engine is busy (or in the same event-loop tick) go into the next
``engine.generate`` call together, so many episodes cost one batched decode per round instead of one
decode each. Sampling is per sample seed (see :mod:`rlhf_core.rollout.sampling`), so how requests happen
to be batched does not change what they sample.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rlhf_core.handles import as_handle
from rlhf_core.types import GenerationOutput, GenerationRequest


class AsyncEngine:
    """Wraps an engine: a ``rlhf_core.handles.Handle`` of one, wherever it lives (its futures are awaited), or
    the engine itself (its ``generate`` then runs in a worker thread). ``max_batch_requests`` caps the
    requests per call (None: no cap)."""

    def __init__(self, engine: Any, max_batch_requests: int | None = None):
        self.engine = as_handle(engine)
        self.max_batch_requests = max_batch_requests
        self._pending: list[tuple[GenerationRequest, asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None
        self.calls = 0  # how many batched ``engine.generate`` calls were made (for tests and metrics)

    async def generate(self, request: GenerationRequest) -> list[GenerationOutput]:
        """The ``request.params.n`` outputs of one request."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._pending:
            await asyncio.sleep(0)  # let every task that is ready this tick add its request first
            cap = self.max_batch_requests or len(self._pending)
            batch, self._pending = self._pending[:cap], self._pending[cap:]
            batch = [(req, fut) for req, fut in batch if not fut.cancelled()]
            if not batch:
                continue
            self.calls += 1
            try:
                outputs = await self.engine.generate([req for req, _ in batch])
                if len(outputs) != len(batch):
                    raise RuntimeError(
                        f"the engine returned {len(outputs)} results for {len(batch)} requests"
                    )
            except Exception as exc:  # every waiter of the batch sees the engine's error
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut), out in zip(batch, outputs, strict=True):
                if not fut.done():
                    fut.set_result(out)
