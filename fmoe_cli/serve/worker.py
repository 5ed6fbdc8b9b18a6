"""One engine, one answer at a time: requests wait in a FIFO queue and one thread decodes them
one after another through the chat session's answer loop (`ChatSession.generate`: KV reuse
between requests, counters, recovery), so there is one generation loop in fmoe.

Why not batch: the engine runs on one card and pages experts per token; two answers decoded
together would route to the union of their experts, so every token would move more bytes over
the link, which is what bounds TPOT. A queue keeps every answer at the engine's single-stream
speed, and the next request often continues the previous one's KV cache (a chat client sends
the whole conversation again).

`Worker` is the queue and the thread and nothing else (testable without a model); `answer` is
what the thread does with one request. Results go back through `Job.emit` (thread-safe: the
HTTP side hands in a function that posts to its event loop).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fmoe_cli.offload.link import on_current_device
from fmoe_cli.serve.protocol import StopText, Usage

log = logging.getLogger("fmoe.serve")


@dataclass
class Started:
    """The worker has taken the job (a stream's headers go out now, not while it waits)."""


@dataclass
class Piece:
    text: str  # new answer text (stop strings already cut)


@dataclass
class Done:
    finish: str  # "eos", "length", "stop" (a stop string), or "cancelled" (nobody is listening)
    text: str  # the whole answer
    usage: Usage


@dataclass
class Failed:
    message: str
    status: int = 500


@dataclass
class Stopped:
    """Not from the worker: the server's grace period is over, the answer ends now (the worker,
    told at the same time, stops within one token)."""


@dataclass
class Job:
    ids: list[int]  # the prompt's token ids
    max_tokens: int
    sampling: object  # generate.SamplingParams
    emit: Callable[[object], None]  # Started, Piece…, then Done or Failed (a job refused while it waits: Failed alone)
    stops: tuple[str, ...] = ()
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    started: float = 0.0  # when the worker took it (perf_counter)
    number: int = 0  # the request's sequence number (routing traces)
    generated: int = 0  # tokens generated so far
    generated_at_cancel: int | None = None  # tokens generated when the worker saw the cancellation


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class Closed(Exception):
    """The server is shutting down."""


class Worker:
    """The FIFO queue and the one thread that answers from it. `handle(job)` answers a job (and
    must emit Done or Failed); `idle()` runs after a job when nothing is waiting (re-planning and
    saving the statistics: never while a request waits). `max_queue`: requests waiting behind the
    one being answered, counting those `reserve`d (admitted, their prompt still being tokenised)."""

    def __init__(self, handle: Callable[[Job], None], max_queue: int, idle: Callable[[], object] | None = None) -> None:
        self.handle, self.max_queue, self.idle = handle, max_queue, idle
        self._waiting: collections.deque[Job] = collections.deque()
        self._reserved = 0  # places held by requests whose prompt is being tokenised
        self._cond = threading.Condition()
        self._closed = False
        self.current: Job | None = None
        self.durations: collections.deque[float] = collections.deque(maxlen=32)  # seconds per answered job
        self.answered = 0
        self.idling = False  # the idle work (a re-plan) is running on the engine, between answers
        self._thread = threading.Thread(target=lambda: self._run(), name="fmoe-serve", daemon=True)
        self._run = self._loop  # `start` puts it on the current CUDA device
        self._numbers = 0

    def start(self) -> Worker:
        self._run = on_current_device(self._loop)  # the device the model was loaded on (not GPU 0 for cuda:1)
        self._thread.start()
        return self

    @property
    def queue_length(self) -> int:
        """Requests admitted and not yet answered: waiting, or their prompt still being tokenised."""
        return len(self._waiting) + self._reserved

    def retry_after(self) -> int:
        """Seconds until a place is likely free: the typical answer's time, at least 1."""
        typical = statistics.median(self.durations) if self.durations else 1.0
        return max(1, math.ceil(typical))

    def reserve(self) -> None:
        """Hold a place in the queue for a request about to be tokenised (the work before the queue
        is admitted as the queue is): QueueFull or Closed as `submit`. `submit(job, reserved=True)`
        takes the place, `release()` gives it back."""
        with self._cond:
            self._admit()
            self._reserved += 1

    def release(self) -> None:
        with self._cond:
            self._reserved -= 1

    def submit(self, job: Job, reserved: bool = False) -> None:
        with self._cond:
            if reserved:
                self._reserved -= 1  # the place is the job's now, or nobody's if the server is closing
                if self._closed:
                    raise Closed
            else:
                self._admit()
            self._numbers += 1
            job.number = self._numbers
            self._waiting.append(job)
            self._cond.notify()

    def _admit(self) -> None:
        """Whether one more request may wait (called holding the lock)."""
        if self._closed:
            raise Closed
        waiting = len(self._waiting) + self._reserved
        if waiting >= self.max_queue and (self.current is not None or waiting):
            raise QueueFull(self.retry_after())

    def cancel(self, job: Job) -> None:
        """Nobody is listening for `job` any more: drop it if it waits, stop it within one token if it runs."""
        with self._cond:
            job.cancelled.set()
            with contextlib.suppress(ValueError):
                self._waiting.remove(job)

    def close(self, cancel_current: bool = False) -> None:
        """Take no more jobs; the waiting ones fail (503); the current one finishes (or is cancelled)."""
        with self._cond:
            self._closed = True
            dropped = list(self._waiting)
            self._waiting.clear()
            if cancel_current and self.current is not None:
                self.current.cancelled.set()
            self._cond.notify_all()
        for job in dropped:
            job.emit(Failed("the server is shutting down", 503))

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if not self._waiting:
                    return  # closed, nothing waits
                job = self.current = self._waiting.popleft()
            start = time.perf_counter()
            try:
                job.emit(Started())
                self.handle(job)
            except BaseException as exc:  # handle reports its own failures; this is the last guard
                log.error("request %d failed: %s: %s", job.number, exc.__class__.__name__, exc)
                job.emit(Failed("the answer failed: internal error"))
            self.durations.append(time.perf_counter() - start)
            with self._cond:
                self.current = None
                self.answered += 1
                idle = not self._waiting and not self._closed
            if idle and self.idle is not None:
                self.idling = True
                try:
                    self.idle()
                except Exception as exc:  # the server goes on; the log says why
                    log.error("re-planning failed: %s: %s", exc.__class__.__name__, str(exc).splitlines()[0] if str(exc) else "")
                finally:
                    self.idling = False


def answer(session, job: Job, observe: Callable[[Job, list, int], None] = lambda *a: None) -> None:
    """Answer `job` on the chat session's answer loop: text with stop strings cut, checked for
    cancellation after every token (so a client that is gone frees the engine within one token).
    `observe(job, events, cached_tokens)` records the answer's figures (metrics)."""
    stops = StopText(job.stops)
    events, pieces, finish = [], [], "length"
    if session.recorder is not None:  # one routing-trace sequence per request
        session.recorder.start_sequence(job.number)
    try:
        with contextlib.closing(session.generate(job.ids, job.max_tokens, job.sampling)) as stream:
            for event in stream:
                events.append(event)
                job.generated = len(events)
                text, hit = stops.add(event.text)
                if text:
                    pieces.append(text)
                    job.emit(Piece(text))
                if hit:
                    finish = "stop"
                    break
                if event.finish_reason is not None:
                    finish = event.finish_reason
                elif job.cancelled.is_set():
                    finish, job.generated_at_cancel = "cancelled", len(events)
                    break
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        log.error("request %d failed: %s: %s", job.number, exc.__class__.__name__, first)
        job.emit(Failed(f"the answer failed: {exc.__class__.__name__}: {first}"))
        return
    if finish in ("eos", "length") and (rest := stops.flush()):
        pieces.append(rest)
        job.emit(Piece(rest))
    usage = Usage(len(job.ids), len(events), session.reused)
    observe(job, events, session.reused)
    job.emit(Done(finish, "".join(pieces), usage))
