"""One sequence at a time: requests wait in arrival order for the one engine.

A request becomes a :class:`Job`. :meth:`Scheduler.submit` puts it at the end of the queue (or raises
:class:`QueueFull`); one worker thread takes jobs in order and runs ``engine.complete`` for each,
passing the job's own cancel event, so that a client that goes away stops its reply within one
decode step (or is dropped from the queue before it starts).

A reply's text reaches the request's event loop through the job's mailbox: the worker appends each
piece under a lock and wakes the loop (``loop.call_soon_threadsafe``) only when the request waits for
it, so the loop wakes once per chunk it sends, not once per token, and takes everything that
arrived since in one piece (:meth:`Job.take`). On a machine whose cores the engine keeps busy (a
CPU model), every wake-up and every chunk written and parsed takes time from the decode.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from app.inference.api import Message, ReplyStats, SamplingParams, TextDelta


class QueueFull(Exception):
    """The queue holds ``max_queue`` requests already; ``retry_after_s``: when to try again."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"the queue is full; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class JobDone:
    """The last event of a job: its stats (None when it never ran) or the error that ended it."""

    stats: ReplyStats | None
    error: BaseException | None = None


_ids = itertools.count(1)


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


@dataclass
class Job:
    """One request: what to answer, and the mailbox its reply waits in for the request's loop."""

    messages: list[Message]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    cancel: threading.Event = field(default_factory=threading.Event)
    id: int = field(default_factory=lambda: next(_ids))
    submitted_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    done: JobDone | None = None
    # the mailbox (under _lock): text not taken yet, whether the reply started (its first event:
    # the prompt's reading or its first text) and whether a take saw that, its end, the loop's waiter
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _text: list[str] = field(default_factory=list, repr=False)
    _started: bool = False
    _start_taken: bool = False
    _end: JobDone | None = None
    _waiter: asyncio.Future | None = field(default=None, repr=False)
    _waiter_wants: str = "end"  # what wakes the waiter besides the end: "start", "text"

    def post(self, event: Any) -> None:
        """Hand an event of the reply to the request (from the worker thread): text is kept until
        taken; the loop is woken only when the waiting request wants what came."""
        with self._lock:
            if isinstance(event, TextDelta):
                self._text.append(event.text)
            elif isinstance(event, JobDone):
                self._end = event
            first = not self._started
            self._started = True
            waiter, wants = self._waiter, self._waiter_wants
            wake = waiter is not None and (
                isinstance(event, JobDone) or wants == "text" or (wants == "start" and first)
            )
            if wake:
                self._waiter = None
        if wake:
            try:
                self.loop.call_soon_threadsafe(_wake, waiter)
            except RuntimeError:  # the loop is closed: the server is shutting down
                self.cancel.set()

    async def take(self, not_before: float = 0.0, *, text: bool = True) -> tuple[str, JobDone | None]:
        """Wait for news of the reply and take it: ``(the text that came since the last take, in
        one piece; the end, or None while it runs)``. The wait ends at the reply's first event
        (the prompt's reading starts, or text comes), at its end, and — with ``text`` — when text
        is there at or after ``not_before`` (the loop's clock): text arriving earlier gathers
        until then. ``text=False``: only the end ends the wait (a reply sent whole)."""
        loop = self.loop
        while True:
            with self._lock:
                now = loop.time()
                news = self._end is not None or (
                    text and ((self._started and not self._start_taken) or (self._text and now >= not_before))
                )
                if news:
                    taken = "".join(self._text)
                    self._text.clear()
                    self._start_taken = self._started
                    return taken, self._end
                waiter = loop.create_future()
                self._waiter = waiter
                self._waiter_wants = "end" if not text else "text" if now >= not_before else "start"
            timer = loop.call_at(not_before, _wake, waiter) if text and now < not_before else None
            try:
                await waiter
            finally:
                if timer is not None:
                    timer.cancel()
                with self._lock:
                    if self._waiter is waiter:
                        self._waiter = None


class Scheduler:
    """The engine's single worker thread and its bounded FIFO queue."""

    def __init__(
        self, engine: Any, max_queue: int = 16, on_finished: Callable[[Job], None] | None = None
    ) -> None:
        if max_queue < 1:
            raise ValueError("max_queue must be at least 1")
        self.engine = engine
        self.max_queue = max_queue
        self.on_finished = on_finished
        self.running: Job | None = None
        self.finished: deque[Job] = deque(maxlen=64)  # the latest finished jobs (health, tests)
        self.completed = 0
        self.cancelled = 0
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._seconds_per_job = 1.0  # moving average, for Retry-After
        self._thread = threading.Thread(target=self._work, name="llmchat-serve-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._queue)

    def submit(self, job: Job) -> None:
        """Queue ``job`` behind the others; ``QueueFull`` when ``max_queue`` are already waiting."""
        with self._cond:
            if self._closed:
                raise QueueFull(1)
            if len(self._queue) >= self.max_queue:
                ahead = len(self._queue) + (1 if self.running else 0)
                raise QueueFull(max(1, round(ahead * self._seconds_per_job)))
            self._queue.append(job)
            self._cond.notify()

    def close(self) -> None:
        """Stop taking jobs, cancel the running and the waiting ones and end the worker."""
        with self._cond:
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            running = self.running
            self._cond.notify_all()
        for job in pending:
            job.cancel.set()
            job.post(JobDone(None, None))
        if running is not None:
            running.cancel.set()
        self._thread.join(timeout=30)

    def _next(self) -> Job | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            job = self._queue.popleft()
            self.running = job
            return job

    def _work(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            try:
                self._run(job)
            finally:
                with self._cond:
                    self.running = None
                    self.finished.append(job)
                if self.on_finished is not None:
                    self.on_finished(job)

    def _run(self, job: Job) -> None:
        if job.cancel.is_set():  # the client left while it waited
            job.done = JobDone(None, None)
            self.cancelled += 1
            job.post(job.done)
            return
        job.started_at = time.perf_counter()
        stats: ReplyStats | None = None
        try:
            for event in self.engine.complete(job.messages, job.params, cancel=job.cancel):
                if isinstance(event, ReplyStats):
                    stats = event
                else:
                    job.post(event)
            job.done = JobDone(stats, None)
        except Exception as err:  # reported to the client in OpenAI's error shape
            job.done = JobDone(stats, err)
        took = time.perf_counter() - job.started_at
        self._seconds_per_job = 0.8 * self._seconds_per_job + 0.2 * took
        if stats is not None and stats.finish_reason == "cancelled":
            self.cancelled += 1
        else:
            self.completed += 1
        job.post(job.done)
