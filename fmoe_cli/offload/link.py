"""The host→device link (docs/architecture.md § Device memory and the link), with a CUDA
copy stream's semantics on every device.

`submit(dst, src, priority, after) -> Transfer` queues a copy of `src` (host store)
into `dst` (a device buffer). Lower priority numbers go first, so demand loads
(priority 0) overtake queued prefetches; a copy runs only after everything in
`after` (fences of compute that still reads `dst`, or an earlier copy into it).

What the host sees is what a CUDA copy stream gives it, on every link:

- `poll(t)` / `t.ready()`: the only way completion is seen;
- `wait(t)`: orders the compute issued next after the copy; it never blocks the host
  (CUDA: the compute stream waits on the copy's event);
- `acquire(t, tag)`: the segment, readable by the compute issued next. This is where
  the data is really read: on CUDA it is `wait` plus the destination buffer (still no
  host block); an emulated link blocks the host here, and only here, until the
  modelled transfer time has passed. The stall is reported by `stalls()`. A copy a
  poll has already seen done is handed out as it is (no wait, no stall to time);
- `record_reads()`: a fence after the compute issued so far. A copy submitted with
  `after=[fence]` does not start before that compute has finished reading its
  buffer (no write-after-read).

Links:
- `EmulatedLink`: a model of one copy engine, no thread. Time comes from a `Clock`
  (`host_clock()` for `--emulate-link`: `MonotonicClock`, or `CpuClock` with
  FMOE_EMULATED_CLOCK=cpu; `VirtualClock` in tests, which only moves when told or when
  the host "sleeps"). Copies move in `chunk_bytes` pieces; between
  pieces the most urgent eligible copy goes next, so a demand load overtakes a long
  prefetch after at most one chunk. With `copy=False` (the CPU, which is its own
  device) no byte moves: `acquire` returns the host store's tensor once the modelled
  time has passed, so emulation costs no compute. With `copy=True` (tests of the data
  path; CUDA `--emulate-link`) the bytes land in `dst` when the copy completes.
  `gbps=None` is an instant link (the CPU without emulation).
- `CudaLink`: a dedicated copy stream, non-blocking copies from pinned memory in
  chunks, one event per chunk, at most `max_in_flight_bytes` (2 chunks' worth) handed
  to the GPU: enough small copies queued to keep the copy engine busy, and a demand
  load never stuck behind a long tail of issued prefetches.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from fmoe_cli.errors import FmoeError
from fmoe_cli.kernels import one_thread
from fmoe_cli.offload import check_bandwidth

DEMAND = 0  # priority of a load the current layer is waiting for
PREFETCH = 1  # prefetches: PREFETCH + rank, so higher-scored experts go first
URGENT = -1  # a load the compute has asked for (`wait`): next on the link
CHUNK_BYTES = 16 * 1024**2  # 16 MiB: a demand load waits at most one chunk (≈ 1 ms at 16 GB/s)


class TransferState(enum.Enum):
    QUEUED = "queued"  # submitted, not started
    RUNNING = "running"  # on the link (some bytes may have landed)
    DONE = "done"
    CANCELLED = "cancelled"  # dropped before its last chunk went on the link: no further chunk will; the
    # destination holds whatever the chunks already on the link wrote (nobody reads it)


# The states as module names, for the link's and the pool's bookkeeping (some twenty looks a loading layer): on
# Python 3.11 `TransferState.DONE` goes through the enum's class machinery, ~70 ns a look against ~10 ns for a global.
QUEUED, RUNNING, DONE, CANCELLED = (TransferState.QUEUED, TransferState.RUNNING, TransferState.DONE,
                                    TransferState.CANCELLED)
_INF = float("inf")


@dataclass(eq=False, slots=True)
class Fence:
    """Compute issued up to some point has finished. `ready_at`: when (emulated time;
    inf = not yet known); `event`: the CUDA event recorded on the compute stream."""

    ready_at: float = 0.0
    event: object = None

    def ready(self) -> bool:
        if self.event is not None:
            return self.event.query()
        return self.ready_at != _INF


@dataclass(eq=False, slots=True)
class Transfer:
    dst: torch.Tensor
    src: torch.Tensor
    priority: int
    nbytes: int
    link: Link | None = field(default=None, repr=False)
    after: tuple = ()  # Fences / Transfers this copy must follow
    state: TransferState = QUEUED
    submitted_at: float = 0.0
    started_at: float | None = None
    done_at: float | None = None  # emulated: when the last byte lands
    sent: int = 0  # bytes on the link so far (emulated: whole chunks)
    event: object = field(default=None, repr=False)  # torch.cuda.Event of the last chunk (CudaLink)
    seq: int = field(default_factory=itertools.count().__next__)  # submission order (ties in priority)

    def ready(self) -> bool:
        state = self.state
        if state is DONE:  # settled: what a poll would answer, without asking the link
            return True
        return state is not CANCELLED and self.link.poll(self)

    def wait(self) -> None:
        self.link.wait(self)

    def cancel(self) -> bool:
        """Drop the copy: a queued one moves nothing, a running one stops at the next chunk boundary
        (its chunks already on the link finish). Returns whether it was dropped; a copy whose last
        chunk is on the link runs to the end (it may be read: DONE, then)."""
        if self.finished:  # settled: nothing to drop (every link answers so)
            return False
        return self.link.cancel(self)

    @property
    def issued(self) -> bool:
        """Every chunk of it that will ever go on the link is there (CUDA: a copy issued after it on the
        same stream lands after it)."""
        return self.event is not None or self.state is CANCELLED

    @property
    def finished(self) -> bool:
        """DONE or CANCELLED as last seen (no poll)."""
        state = self.state
        return state is DONE or state is CANCELLED


class Link(Protocol):
    kind: str  # "emulated", "host", "cuda"
    gbps: float | None
    bytes_moved: int
    copy: bool  # bytes land in `dst`; False: `acquire` hands out `src`, the host store's own rows (the CPU)

    def label(self) -> str: ...

    def submit(self, dst: torch.Tensor, src: torch.Tensor, priority: int, after: tuple = ()) -> Transfer: ...

    def reprioritise(self, t: Transfer, priority: int) -> None: ...

    def poll(self, t: Transfer) -> bool: ...

    def wait(self, t: Transfer) -> None: ...

    def acquire(self, t: Transfer, tag: object = None) -> torch.Tensor: ...

    def record_reads(self) -> Fence: ...

    def stalls(self) -> list[tuple[object, float]]: ...

    def cancel(self, t: Transfer) -> bool: ...

    def synchronize(self) -> None: ...  # block the host until every copy not cancelled has finished

    def close(self) -> None: ...


def device_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` between two buffers on the device, in the compute's order: an admission into a cache slot
    (offload/engine.py `_offer`), a host-lane fill, an emulated link's landing bytes. On a GPU, torch's copy on the
    current (compute) stream. On a CPU, on the calling thread: one memmove for two contiguous tensors of one shape and
    dtype (the cache's case), else torch's copy under `one_thread`. An expert's top is the one tensor of a decode
    step large enough for torch to split its copy over the intra-op threads (grain 32,768 elements; the demo's top
    is 147,456 floats), and the OpenMP worker that wakes sleeps between ops (OMP_WAIT_POLICY=PASSIVE, fmoe_cli/
    __init__.py): in `fmoe bench demo --emulate-link 16 --policy lru` (2 threads) torch's copy took 94–141 µs median
    and 0.59–0.95 ms mean per admission (a tail of 1.8–5 ms wakes) at a load of 4–5, 0.24 ms on the quiet machine,
    where a memmove took 55–59 µs median and 87–91 µs mean (docs/bench.md § `moepic` across links). The same
    bits either way."""
    if not dst.is_cpu:
        dst.copy_(src)
    elif (dst.dtype == src.dtype and dst.shape == src.shape and src.is_cpu and dst.is_contiguous()
          and src.is_contiguous()):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.nbytes)
    else:
        with one_thread():
            dst.copy_(src)


def on_current_device(target: Callable) -> Callable:
    """`target` for a new thread, run on the CUDA device that is current in the thread making it: a thread starts on
    device 0, so with --device cuda:1 its calls that name no device (an event's record, a capture check) would
    create a context on GPU 0 and record on its streams. Nothing on the CPU."""
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def run(*args, **kwargs):
        if device is not None:
            torch.cuda.set_device(device)
        return target(*args, **kwargs)

    return run


# --- the device's results on the host ---------------------------------------------------
def read_to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host, now: the one way the engine reads a device result it must act on (a layer's routing,
    offload/engine.py `Routing.of`), and so the one place a decode step's host waits for the GPU: on CUDA the
    copy returns once the compute stream has drained up to `t` (every launch after it starts from an idle GPU).
    profiling/ops.py `count_host_waits` counts these calls. On the CPU, `t` itself."""
    return t if t.is_cpu else t.cpu()


class HostCopy:
    """A device result copied to the host without waiting for it (a resident layer's routing, whose bookkeeping
    can wait until the token is done: offload/engine.py `_defer`). On CUDA a non-blocking copy into a pinned
    buffer made once per (shape, dtype) and reused (`slot`), and an event after it: `result()` waits on the event
    only if the copy has not finished already (the token's sampling has usually synchronised by then). Inside a
    CUDA graph the copy is one of the graph's nodes; `record()` after the replay. On the CPU, a copy of `t`."""

    def __init__(self, like: torch.Tensor) -> None:
        self.cuda = like.is_cuda
        self.device = like.device
        self.host = torch.empty(like.shape, dtype=like.dtype, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None

    def copy(self, t: torch.Tensor) -> None:
        self.host.copy_(t, non_blocking=self.cuda)
        self.record()

    def record(self) -> None:
        if self.event is not None and not torch.cuda.is_current_stream_capturing():  # a replay records after it
            self.event.record(torch.cuda.current_stream(self.device))  # the copy's device's stream, not device 0's

    def result(self) -> tuple[torch.Tensor, bool]:
        """The host copy, and whether the host had to wait for it."""
        waited = False
        if self.event is not None and not self.event.query():
            self.event.synchronize()
            waited = True
        return self.host, waited


# --- clocks ---------------------------------------------------------------------------
WAKE_SPIN_S = 200e-6  # the last stretch of an emulated wait is polled, not slept (MonotonicClock)


class MonotonicClock:
    """Wall time; `sleep_until` really blocks the host.

    `spin` (s): the last `spin` seconds of a wait are spent polling the clock instead of
    sleeping. time.sleep wakes 70–90 µs late on Linux (timer slack), while a CUDA event
    wait sees completion within microseconds; without the spin every emulated stall would
    cost that much extra host time. The emulated link waits with a spin; CudaLink's
    throttle, which sleeps in its pump thread, does not (a poll there would hold the GIL)."""

    now: Callable[[], float]  # the time (s): the source itself (no frame of ours: ~12 reads a loading layer)

    def __init__(self, spin: float = 0.0, now: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.spin = spin
        self.now = self._now = now
        self._sleep = sleep

    def sleep_until(self, t: float) -> None:
        remaining = t - self._now()
        if remaining > self.spin:
            self._sleep(remaining - self.spin)
        while self._now() < t:  # the rest: poll, as a CUDA event wait does
            pass


class VirtualClock:
    """Time that moves only when a test says so (`advance`) or the host waits (`sleep_until`)."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start
        self.slept = 0.0  # total time the host spent blocked

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt

    def sleep_until(self, t: float) -> None:
        if t > self.t:
            self.slept += t - self.t
            self.t = t


class CpuClock:
    """The process's CPU time plus the time it waited on the emulated link (`sleep_until` adds the wait
    and returns at once): a clock that stops while the OS runs other processes. On a machine shared
    with other work, wall time counts every time slice the OS gives away, and an emulated link timed
    on it runs on while the process is not running (its loads land "for free"); on this clock the
    host's compute counts as much CPU time as it took and the link's transfers as their modelled
    time, whatever else runs (FMOE_EMULATED_CLOCK=cpu; benchmarks/link_policies.py). The
    process's CPU time is one core's time only with one compute thread: `host_clock` sets torch's
    (and the CPU kernels', which follow torch) to 1. Not a measure of a GPU's link (CudaLink, real
    copies, keeps wall time: make_link refuses the pair)."""

    def __init__(self, cpu: Callable[[], float] = time.process_time) -> None:
        self._cpu = cpu
        self.slept = 0.0  # total time the host waited on the link

    def now(self) -> float:
        return self._cpu() + self.slept

    def sleep_until(self, t: float) -> None:
        wait = t - self.now()
        if wait > 0:
            self.slept += wait


CLOCK_ENV = "FMOE_EMULATED_CLOCK"  # wall (default) or cpu: the clock of the emulated link and of fmoe's timings
CLOCKS = ("wall", "cpu")
_host_clocks: dict = {}  # kind -> clock, and the variable's value as os.environ holds it -> clock


def clock_kind() -> str:
    """FMOE_EMULATED_CLOCK, checked: `wall` (default) or `cpu`."""
    kind = os.environ.get(CLOCK_ENV, "").strip().lower() or "wall"
    if kind not in CLOCKS:
        raise FmoeError(f"{CLOCK_ENV}={os.environ[CLOCK_ENV]!r}: expected one of {', '.join(CLOCKS)}")
    return kind


def _clock_variable():
    """FMOE_EMULATED_CLOCK as os.environ holds it (None: unset): read from the mapping's own dict where it has one
    (CPython's os.environ, the one this module was imported with), without `os.environ.get`'s key encoding and
    KeyError when unset: a decode step asks several times a layer, and that path cost about 1 µs an ask, ten times
    this one."""
    environ = os.environ
    return _environ_data.get(_CLOCK_KEY) if environ is _environ else environ.get(CLOCK_ENV)


_environ = os.environ if hasattr(os.environ, "encodekey") and isinstance(getattr(os.environ, "_data", None), dict) \
    else None  # CPython's mapping: `setenv`, `del`, monkeypatch.setenv change its `_data` in place
_environ_data = _environ._data if _environ is not None else None
_CLOCK_KEY = _environ.encodekey(CLOCK_ENV) if _environ is not None else CLOCK_ENV


def host_clock():
    """The process's one clock for the emulated link and every timing fmoe takes (token latencies,
    profiles, the engine's counters): wall time (`MonotonicClock`), or with FMOE_EMULATED_CLOCK=cpu the
    process's CPU time plus its waits on the link (`CpuClock`; one compute thread). Looked up by the variable's
    value as it is (a decode step asks several times a layer: no parsing then)."""
    raw = _clock_variable()
    clock = _host_clocks.get(raw)
    if clock is not None:
        return clock
    kind = clock_kind()
    clock = _host_clocks.get(kind)
    if clock is None:
        if kind == "cpu":
            torch.set_num_threads(1)  # CPU time = one core's time
            clock = CpuClock()
        else:
            clock = MonotonicClock(spin=WAKE_SPIN_S)
        _host_clocks[kind] = clock
    _host_clocks[raw] = clock  # (a bad value raised above)
    return clock


def host_now() -> float:
    """Now on `host_clock()` (s): the clock found by the variable's value as it is (`_clock_variable`; the engine asks
    about seven times a loading layer), `host_clock` only for a value not seen yet."""
    clock = _host_clocks.get(_clock_variable())
    return (clock if clock is not None else host_clock()).now()


def _promote(t: Transfer, priority: int) -> None:
    """Raise t's priority, and that of the copies it must follow (they stand in its way)."""
    if priority < t.priority and not t.finished:
        t.priority = priority
        for dep in t.after:
            if isinstance(dep, Transfer):
                _promote(dep, priority)


def _urgency(t: Transfer) -> tuple[int, int]:
    """Which of the copies that may start goes first: the lowest priority number, then the oldest."""
    return t.priority, t.seq


def _drop(t: Transfer, queue: list[Transfer]) -> None:
    """No further chunk of `t` goes on the link (it is out of the queue if it was waiting there)."""
    t.state = CANCELLED
    if t in queue:
        queue.remove(t)


def _eligible_at(t: Transfer) -> float:
    """Earliest time `t` may start: after its submission and everything in `after`."""
    at = t.submitted_at
    for dep in t.after:
        if isinstance(dep, Transfer):
            if dep.state is CANCELLED:
                continue
            at = max(at, dep.done_at if dep.state is DONE else _INF)
        else:
            at = max(at, dep.ready_at)
    return at


class EmulatedLink:
    """One modelled copy engine of `gbps` GB/s plus `latency_s` per transfer (see the module doc)."""

    def __init__(self, gbps: float | None, latency_s: float = 10e-6, *, clock=None, copy: bool = False,
                 chunk_bytes: int = CHUNK_BYTES, note: str | None = None) -> None:
        if gbps is not None and gbps <= 0:
            raise ValueError("emulated link bandwidth must be > 0 GB/s")
        self.gbps = gbps
        self.note = note  # what the bandwidth stands for, shown in the label
        self.latency_s = latency_s if gbps else 0.0
        self.kind = "emulated" if gbps else "host"
        self.clock = clock or host_clock()
        self.copy = copy
        self.chunk_bytes = chunk_bytes
        self.bytes_moved = 0
        self._queue: list[Transfer] = []  # queued, and running ones between chunks
        self._current: tuple[Transfer, float, int] | None = None  # (transfer, chunk end, chunk bytes)
        self._free_at = float("-inf")  # when the copy engine finished its last chunk
        self._stalls: list[tuple[object, float]] = []

    def label(self) -> str:
        if self.gbps:
            clock = ", on the process's CPU-time clock" if isinstance(self.clock, CpuClock) else ""
            return f"link: emulated {self.gbps:.3g} GB/s" + (f" ({self.note})" if self.note else "") + clock
        return "link: none (the CPU is the device; experts are read from host memory)"

    def duration(self, nbytes: int) -> float:
        """bytes / bandwidth + latency (one transfer)."""
        if not self.gbps:
            return 0.0
        return nbytes / (self.gbps * 1e9) + self.latency_s

    # --- the model -------------------------------------------------------------
    def _advance(self, now: float, until: Transfer | None = None) -> None:
        """Play the copy engine forward to `now` (or until `until` is done)."""
        queue = self._queue
        while True:
            current = self._current
            if current is not None:
                t, end, nbytes = current
                if end > now:
                    return
                self._current = None
                self._free_at = end
                t.sent += nbytes
                self.bytes_moved += nbytes
                if t.state is CANCELLED:
                    pass  # dropped while this chunk was on the link: it stops here
                elif t.sent >= t.nbytes:  # its last chunk: the copy is done (copy mode: its bytes land now)
                    if self.copy:
                        device_copy(t.dst, t.src)
                    t.done_at = end
                    t.state = DONE
                    if t is until:
                        return
                else:
                    queue.append(t)  # between chunks: it competes again by priority
            if not queue:
                return
            if len(queue) == 1:  # the common case: no choice to make
                t = queue[0]
                start = max(self._free_at, _eligible_at(t))
                if start > now or start == _INF:
                    return
                queue.clear()
            else:
                eligible = [(_eligible_at(x), x) for x in queue]
                start = max(self._free_at, min(at for at, _ in eligible))
                if start > now or start == _INF:
                    return
                t = min((x for at, x in eligible if at <= start), key=_urgency)
                queue.remove(t)
            if t.state is QUEUED:
                t.state = RUNNING
                t.started_at = start
            nbytes = min(self.chunk_bytes, t.nbytes - t.sent) if t.nbytes else 0
            chunk_time = nbytes / (self.gbps * 1e9) + (self.latency_s if t.sent == 0 else 0.0) if self.gbps else 0.0
            self._current = (t, start + chunk_time, nbytes)  # (its first chunk pays the latency)

    # --- the protocol ------------------------------------------------------------
    def submit(self, dst: torch.Tensor, src: torch.Tensor, priority: int, after: tuple = ()) -> Transfer:
        now = self.clock.now()
        if self._current is not None or self._queue:  # (an idle link has nothing to play)
            self._advance(now)  # the choices made before now, without `t`
        t = Transfer(dst, src, priority, src.nbytes, link=self, after=tuple(after), submitted_at=now)
        self._queue.append(t)
        if self._current is None:  # (the chunk on a busy link ends after now: nothing else starts before it does)
            self._advance(now)
        return t

    def reprioritise(self, t: Transfer, priority: int) -> None:
        if priority >= t.priority or t.finished:
            return  # nothing to raise (`_promote` would change nothing)
        self._advance(self.clock.now())  # the copies begun before now were chosen without it
        _promote(t, priority)

    def poll(self, t: Transfer) -> bool:
        if t.state is QUEUED or t.state is RUNNING:
            self._advance(self.clock.now())
        return t.state is DONE

    def wait(self, t: Transfer) -> None:
        if t.state is CANCELLED:
            raise RuntimeError("waiting on a cancelled transfer")
        self.reprioritise(t, URGENT)  # as CudaLink issues it at once; the host does not block

    def acquire(self, t: Transfer, tag: object = None) -> torch.Tensor:
        if t.state is DONE:  # seen done by a poll: nothing to order, nothing to wait for
            return t.dst if self.copy else t.src
        if t.state is CANCELLED:
            raise RuntimeError("waiting on a cancelled transfer")
        # `wait` (next on the link), on one look at the clock: the model played to now at the priorities its choices
        # were made with, then `t` promoted; every later choice (the rest of the model, to t's end) sees the promotion
        now = self.clock.now()
        self._advance(now)
        _promote(t, URGENT)
        if t.state is not DONE:
            self._advance(_INF, until=t)
            if t.state is not DONE:
                raise RuntimeError("a transfer waits on a fence that never completes")
            self.clock.sleep_until(t.done_at)
            self._stalls.append((tag, t.done_at - now))
        return t.dst if self.copy else t.src

    def record_reads(self) -> Fence:
        return Fence(self.clock.now())  # host compute is synchronous: the reads have finished

    def stalls(self) -> list[tuple[object, float]]:
        out, self._stalls = self._stalls, []
        return out

    def cancel(self, t: Transfer) -> bool:
        if t.finished:
            return False
        self._advance(self.clock.now())
        current = self._current
        if t.finished or (current is not None and current[0] is t and t.sent + current[2] >= t.nbytes):
            return False  # done, or its last chunk is on the link
        _drop(t, self._queue)
        return True

    def synchronize(self) -> None:
        """The host waits (on the clock) until every copy not cancelled has finished, a stopped one's
        last chunk included; afterwards the link holds no transfer (nor a view of its buffer)."""
        self._advance(_INF)
        if self._queue:
            raise RuntimeError("a transfer waits on a fence that never completes")
        self.clock.sleep_until(self._free_at)

    def close(self) -> None:
        for t in self._queue:
            if t.state is QUEUED:
                t.state = CANCELLED
        self._queue = [t for t in self._queue if t.state is RUNNING]
        self._advance(_INF)  # running copies finish (the clock does not move)


class CudaLink:
    """Host→GPU copies on a dedicated stream in chunks, at most `max_in_flight_bytes` issued at once.

    A transfer is issued chunk by chunk; between chunks the most urgent queued
    transfer goes next, so a demand load is never behind more than `max_in_flight_bytes`
    (default 2 × CHUNK_BYTES). Bytes, not chunks: with small experts (Qwen3-30B-A3B:
    9 MiB bf16, 2.6 MiB int4, one chunk each) a count of 2 chunks would leave the copy
    engine idle between copies while the pump waits for the GIL; a byte budget queues
    as many small copies as one long one. `after` fences make the copy stream wait on events recorded on the
    compute stream (no write-after-read); an `after` transfer is on the same stream,
    so issuing after it is enough. `wait` makes the compute stream wait on the
    transfer's last event; the host never blocks. With `throttle_gbps` (CUDA
    `--emulate-link`) a transfer's chunks are issued no faster than that bandwidth.

    The link is kept busy by a pump thread: it waits for the oldest chunk in flight
    (`Event.synchronize` releases the GIL, so the compute thread runs meanwhile) and
    issues the next chunk at once, instead of at the engine's next poll. Chunk events
    are blocking (cudaEventBlockingSync): that wait sleeps instead of spinning a core.
    Only `max_in_flight_bytes` are ever handed to the GPU, so a demand load that arrives
    later waits for at most that many bytes (32 MiB ≈ 2.6 ms at 12 GB/s) — the
    alternative, every copy on the stream at submit, would put a demand load behind
    every prefetch already queued. (docs/bench.md, "The link".)
    """

    kind = "cuda"
    copy = True

    def __init__(self, device: torch.device, max_in_flight_bytes: int | None = None, chunk_bytes: int = CHUNK_BYTES,
                 throttle_gbps: float | None = None, pump_thread: bool = True) -> None:
        self.device = device
        self.gbps = throttle_gbps
        self.stream = torch.cuda.Stream(device)
        self.max_in_flight_bytes = max_in_flight_bytes or 2 * chunk_bytes
        self.chunk_bytes = chunk_bytes
        self._in_flight_bytes = 0
        self.clock = MonotonicClock()
        self._queue: list[Transfer] = []
        self._in_flight: list[tuple[Transfer, object, int]] = []  # (transfer, chunk event, chunk bytes)
        self._next_issue = 0.0  # throttle: when the next chunk may be issued
        self._pending_stalls: list[tuple[object, object, object]] = []  # (tag, before, after) compute-stream events
        self.bytes_moved = 0
        if throttle_gbps is not None:
            self.kind = "emulated"
        self._lock = threading.RLock()  # the engine's thread and the pump thread
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._pump_thread = None  # without it (tests), chunks are issued only when the link is called
        if pump_thread:
            self._pump_thread = threading.Thread(target=self._pump_loop, name="fmoe-cuda-link", daemon=True)
            self._pump_thread.start()

    def _pump_loop(self) -> None:
        with torch.cuda.device(self.device):
            while True:
                with self._lock:
                    if self._closed:
                        return
                    self._pump()
                    oldest = self._in_flight[0][1] if self._in_flight else None
                    delay = self._next_issue - time.perf_counter() if self.gbps and self._queue else 0.0
                    if oldest is None and delay <= 0:
                        self._wake.wait(timeout=0.05 if self._queue else None)  # submit and close wake it
                        continue
                if oldest is not None:
                    oldest.synchronize()  # this thread only, GIL released
                else:
                    time.sleep(delay)

    def label(self) -> str:
        name = torch.cuda.get_device_name(self.device)
        if self.gbps:
            return f"link: emulated {self.gbps:g} GB/s (throttled copies to {name})"
        return f"link: {name} (copy stream)"

    def submit(self, dst: torch.Tensor, src: torch.Tensor, priority: int, after: tuple = ()) -> Transfer:
        t = Transfer(dst, src, priority, src.nbytes, link=self, after=tuple(after), submitted_at=time.perf_counter())
        with self._lock:
            self._queue.append(t)
            self._pump()
            self._wake.notify()
        return t

    def reprioritise(self, t: Transfer, priority: int) -> None:
        with self._lock:
            _promote(t, priority)

    def _chunk(self, t: Transfer) -> tuple[int, int]:
        """The elements [first, last) of `t`'s next chunk."""
        per = max(1, self.chunk_bytes // max(1, t.src.element_size()))
        first = t.sent // t.src.element_size()
        return first, min(t.src.numel(), first + per)

    def _issue_chunk(self, t: Transfer) -> None:
        flat_dst, flat_src = t.dst.reshape(-1), t.src.reshape(-1)
        first, last = self._chunk(t)
        with torch.cuda.stream(self.stream):
            if t.sent == 0:
                for dep in t.after:
                    if isinstance(dep, Fence) and dep.event is not None:
                        self.stream.wait_event(dep.event)  # compute that still reads dst finishes first
            flat_dst[first:last].copy_(flat_src[first:last], non_blocking=True)
            event = torch.cuda.Event(blocking=True)  # the pump's wait on it sleeps, not spins
            event.record(self.stream)
        nbytes = (last - first) * t.src.element_size()
        if t.state is QUEUED:
            t.state = RUNNING
        t.sent += nbytes
        if t.sent >= t.nbytes:  # its last chunk: completion is this event's
            t.event = event
            self._queue.remove(t)
        self._in_flight.append((t, event, nbytes))
        self._in_flight_bytes += nbytes
        if self.gbps:
            self._next_issue = max(self._next_issue, time.perf_counter()) + nbytes / (self.gbps * 1e9)

    @staticmethod
    def _issuable(t: Transfer) -> bool:
        """A copy `after` an earlier copy goes on the stream once every chunk of that one is on it (the
        stream runs in order); one chunk issued is not enough (its other chunks would land later)."""
        return all(dep.issued for dep in t.after if isinstance(dep, Transfer))

    def _pump(self) -> None:
        still = []
        for t, event, nbytes in self._in_flight:
            if event.query():
                self.bytes_moved += nbytes
                self._in_flight_bytes -= nbytes
                if event is t.event:
                    t.state = DONE
            else:
                still.append((t, event, nbytes))
        self._in_flight = still
        while self._queue:
            if self.gbps and time.perf_counter() < self._next_issue:
                break
            ready = [t for t in self._queue if self._issuable(t)]
            if not ready:
                break
            t = min(ready, key=_urgency)
            first, last = self._chunk(t)
            if self._in_flight and self._in_flight_bytes + (last - first) * t.src.element_size() > self.max_in_flight_bytes:
                break  # the most urgent waits for room (a smaller, less urgent copy does not go ahead of it)
            self._issue_chunk(t)

    def poll(self, t: Transfer) -> bool:
        if t.finished:  # final: no need to look
            return t.state is DONE
        with self._lock:
            self._pump()
            return t.state is DONE

    def wait(self, t: Transfer) -> None:
        with self._lock:
            self._wait(t)

    def _wait(self, t: Transfer) -> None:
        if t.state is CANCELLED:
            raise RuntimeError("waiting on a cancelled transfer")
        _promote(t, URGENT)
        self._issue_all(t)
        # The compute stream waits on the copy; the host does not.
        torch.cuda.current_stream(self.device).wait_event(t.event)

    def _issue_all(self, t: Transfer) -> None:
        """The compute needs `t` now: issue the rest of it, after the rest of the copies it follows."""
        for dep in t.after:
            if isinstance(dep, Transfer) and not dep.issued:
                self._issue_all(dep)
        while not t.issued:
            if self.gbps:
                self.clock.sleep_until(self._next_issue)
            self._issue_chunk(t)

    def acquire(self, t: Transfer, tag: object = None) -> torch.Tensor:
        if t.state is DONE:  # its last event has completed: nothing to wait on, no stall to time
            return t.dst
        compute = torch.cuda.current_stream(self.device)
        before = torch.cuda.Event(enable_timing=True)
        before.record(compute)
        self.wait(t)
        after = torch.cuda.Event(enable_timing=True)
        after.record(compute)
        self._pending_stalls.append((tag, before, after))  # the stall happens on the GPU: timed by events
        return t.dst

    def record_reads(self) -> Fence:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return Fence(event=event)

    def stalls(self) -> list[tuple[object, float]]:
        """Compute-stream time spent waiting on copies, for every wait whose events have completed."""
        out, pending = [], []
        for tag, before, after in self._pending_stalls:
            if after.query():
                out.append((tag, before.elapsed_time(after) / 1e3))
            else:
                pending.append((tag, before, after))
        self._pending_stalls = pending
        return out

    def cancel(self, t: Transfer) -> bool:
        if t.issued:  # done, dropped, or its last chunk is on the stream: nothing left to stop
            return False
        with self._lock:
            if t.issued:
                return False
            _drop(t, self._queue)
            return True

    def synchronize(self) -> None:
        """Issue the rest of every copy not cancelled, and block the host until the stream has played them;
        afterwards the link holds no transfer (nor a view of its buffer)."""
        with self._lock:
            for t in list(self._queue):
                self._issue_all(t)
        self.stream.synchronize()
        with self._lock:
            self._pump()

    def close(self) -> None:
        with self._lock:
            for t in list(self._queue):
                if t.state is QUEUED:
                    _drop(t, self._queue)
            self._closed = True
            self._wake.notify()
        if self._pump_thread is not None:
            self._pump_thread.join(timeout=5)
        self.synchronize()  # a transfer begun is finished (its slot may be read)


def make_link(device: torch.device, emulate_gbps: float | None, note: str | None = None) -> Link:
    """The link every command uses: emulated if asked (throttled real copies on CUDA, no bytes
    moved on the CPU), the copy stream on CUDA, else none (the CPU reads the host store).
    `note`: what an emulated bandwidth stands for (its label shows it)."""
    if emulate_gbps is not None:
        check_bandwidth(emulate_gbps)
        if device.type == "cuda":
            if clock_kind() == "cpu":
                raise FmoeError(f"{CLOCK_ENV}=cpu emulates the link on the CPU's own time; a GPU's copies are real "
                                f"(unset it, or run on the CPU)")
            return CudaLink(device, throttle_gbps=emulate_gbps)
        return EmulatedLink(emulate_gbps, note=note)
    if device.type == "cuda":
        return CudaLink(device)
    return EmulatedLink(None)  # the CPU is its own device
