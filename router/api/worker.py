"""The front door's one worker thread for heavy request work (parsing large bodies, chat
templates, tokenization), and whether it is idle.

Why one thread: a tokenizer is not safe to share between threads (a ``tokenizer(...)``
call may set its truncation state), so everything that tokenizes runs on this one, and
the event loop that serves /health and every other tenant never waits behind a large
request. Why it says when it is idle: a small job (a prompt whose stretches are mostly
known, :mod:`.text_cache`) costs less on the loop than the hop here and back (~50 us of
CPU and two thread wake-ups), and is safe there while nothing runs or waits here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class Worker:
    """``await worker.run(fn)``: ``fn()`` on the thread; :meth:`idle` while no job runs or
    waits there. Counters, each with one writer: jobs sent (the loop), jobs ended on the
    thread (the thread), jobs cancelled before they ran (whoever cancelled: the loop, or
    :meth:`close`)."""

    def __init__(self, name: str) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._sent = self._ran = self._dropped = 0

    async def run(self, fn: Callable[[], Any]) -> Any:
        self._sent += 1
        job = self.pool.submit(self._job, fn)
        job.add_done_callback(self._drop)
        return await asyncio.wrap_future(job)

    def _job(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        finally:
            self._ran += 1

    def _drop(self, job: Future[Any]) -> None:
        if job.cancelled():  # it never ran
            self._dropped += 1

    def idle(self) -> bool:
        """Nothing runs on the thread nor waits for it: the caller (the loop) may do the
        thread's kind of work itself without sharing what the thread uses."""
        return self._sent == self._ran + self._dropped

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
