"""The host→device link (DESIGN §4).

`submit(dst, src, priority) -> Transfer`; a transfer can be polled (`ready`), waited
for (`wait`) and cancelled before it starts. Lower priority numbers go first, so
demand loads (priority 0) overtake queued prefetches.

- `ThreadLink`: a worker thread copies and then holds the transfer until
  `bytes / bandwidth + latency` seconds of wall time have passed, so compute on the
  caller's thread really overlaps it. As `EmulatedLink` it stands in for a PCIe
  link on machines without a GPU; as a plain host copy it is the CPU "device".
- `CudaLink`: a dedicated copy stream, non-blocking copies from pinned memory, one
  event per transfer; the compute stream waits on the event, no host sync.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from dataclasses import dataclass, field

import torch

from fmoe_cli.errors import FmoeError

DEMAND = 0  # priority of a load the current layer is waiting for
PREFETCH = 1  # prefetches: PREFETCH + rank, so higher-scored experts go first


@dataclass(eq=False)
class Transfer:
    dst: torch.Tensor
    src: torch.Tensor
    priority: int
    nbytes: int
    state: str = "queued"  # queued → running → done, or queued → cancelled
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _link: object = field(default=None, repr=False)
    _event: object = field(default=None, repr=False)  # torch.cuda.Event on CudaLink

    def ready(self) -> bool:
        return self._link.poll(self)

    def wait(self) -> None:
        self._link.wait(self)

    def cancel(self) -> bool:
        """Cancel if not started yet; returns whether it was cancelled."""
        return self._link.cancel(self)


class _Queue:
    """Priority queue of transfers, FIFO among equal priorities."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Transfer]] = []
        self._seq = itertools.count()

    def push(self, t: Transfer) -> None:
        heapq.heappush(self._heap, (t.priority, next(self._seq), t))

    def pop(self) -> Transfer | None:
        while self._heap:
            _, _, t = heapq.heappop(self._heap)
            if t.state == "queued":
                return t
        return None

    def promote(self, t: Transfer, priority: int) -> None:
        if t.state == "queued" and priority < t.priority:
            t.priority = priority
            self.push(t)  # the stale entry is skipped later: pop() only sees it once started

    def __len__(self) -> int:
        return len(self._heap)


class ThreadLink:
    """Copies on a worker thread; each transfer lasts at least bytes/bandwidth + latency."""

    def __init__(self, gbps: float | None = None, latency_s: float = 0.0, kind: str | None = None) -> None:
        self.gbps = gbps
        self.latency_s = latency_s
        self.kind = kind or ("emulated" if gbps else "host-copy")
        self._queue = _Queue()
        self._cv = threading.Condition()
        self._closed = False
        self.bytes_moved = 0
        self._worker = threading.Thread(target=self._run, name="fmoe-link", daemon=True)
        self._worker.start()

    def label(self) -> str:
        if self.gbps:
            return f"link: emulated {self.gbps:g} GB/s"
        return "link: host copy (no device link)"

    def duration(self, nbytes: int) -> float:
        if not self.gbps:
            return 0.0
        return nbytes / (self.gbps * 1e9) + self.latency_s

    def submit(self, dst: torch.Tensor, src: torch.Tensor, priority: int) -> Transfer:
        t = Transfer(dst, src, priority, src.numel() * src.element_size(), _link=self)
        with self._cv:
            self._queue.push(t)
            self._cv.notify()
        return t

    def reprioritise(self, t: Transfer, priority: int) -> None:
        with self._cv:
            self._queue.promote(t, priority)

    def poll(self, t: Transfer) -> bool:
        return t.state == "done"

    def wait(self, t: Transfer) -> None:
        if t.state == "cancelled":
            raise RuntimeError("waiting on a cancelled transfer")
        t._done.wait()

    def cancel(self, t: Transfer) -> bool:
        with self._cv:
            if t.state == "queued":
                t.state = "cancelled"
                return True
            return False

    def _run(self) -> None:
        while True:
            with self._cv:
                t = self._queue.pop()
                while t is None and not self._closed:
                    self._cv.wait()
                    t = self._queue.pop()
                if t is None:
                    return
                t.state = "running"
            start = time.perf_counter()
            t.dst.copy_(t.src)
            remaining = start + self.duration(t.nbytes) - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
            self.bytes_moved += t.nbytes
            t.state = "done"
            t._done.set()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._worker.join(timeout=5)


def EmulatedLink(gbps: float, latency_s: float = 10e-6) -> ThreadLink:
    """A PCIe-like link of `gbps` GB/s for machines without a GPU (always labelled emulated)."""
    if gbps <= 0:
        raise ValueError("emulated link bandwidth must be > 0 GB/s")
    return ThreadLink(gbps, latency_s, kind="emulated")


class CudaLink:
    """Host→GPU copies on a dedicated stream, at most `max_in_flight` issued at once.

    Keeping few copies issued means a demand load that arrives later is never stuck
    behind a long tail of prefetches already handed to the GPU.
    """

    kind = "cuda"

    def __init__(self, device: torch.device, max_in_flight: int = 2) -> None:
        self.device = device
        self.gbps = None
        self.stream = torch.cuda.Stream(device)
        self.max_in_flight = max_in_flight
        self._queue = _Queue()
        self._in_flight: list[Transfer] = []
        self.bytes_moved = 0

    def label(self) -> str:
        return f"link: {torch.cuda.get_device_name(self.device)} (copy stream)"

    def submit(self, dst: torch.Tensor, src: torch.Tensor, priority: int) -> Transfer:
        t = Transfer(dst, src, priority, src.numel() * src.element_size(), _link=self)
        self._queue.push(t)
        self._pump()
        return t

    def reprioritise(self, t: Transfer, priority: int) -> None:
        self._queue.promote(t, priority)

    def _issue(self, t: Transfer) -> None:
        with torch.cuda.stream(self.stream):
            t.dst.copy_(t.src, non_blocking=True)
            t._event = torch.cuda.Event()
            t._event.record(self.stream)
        t.state = "running"
        self.bytes_moved += t.nbytes
        self._in_flight.append(t)

    def _pump(self) -> None:
        for t in [t for t in self._in_flight if t._event.query()]:
            t.state = "done"
            self._in_flight.remove(t)
        while len(self._in_flight) < self.max_in_flight:
            t = self._queue.pop()
            if t is None:
                break
            self._issue(t)

    def poll(self, t: Transfer) -> bool:
        self._pump()
        return t.state == "done"

    def wait(self, t: Transfer) -> None:
        if t.state == "cancelled":
            raise RuntimeError("waiting on a cancelled transfer")
        if t.state == "queued":  # the compute needs it now: issue it ahead of the queue
            t.state = "issuing"
            self._issue(t)
        # The compute stream waits on the copy; the host does not.
        torch.cuda.current_stream(self.device).wait_event(t._event)

    def cancel(self, t: Transfer) -> bool:
        if t.state == "queued":
            t.state = "cancelled"
            return True
        return False

    def close(self) -> None:
        self.stream.synchronize()


def check_bandwidth(emulate_gbps: float) -> None:
    """Refuse an emulated link of ≤ 0 GB/s (--emulate-link) in one line."""
    if not emulate_gbps > 0:
        raise FmoeError(f"--emulate-link needs a bandwidth > 0 GB/s, got {emulate_gbps:g}")


def make_link(device: torch.device, emulate_gbps: float | None):
    """The link every command uses: emulated if asked, the copy stream on CUDA, else a host copy."""
    if emulate_gbps is not None:
        check_bandwidth(emulate_gbps)
        return EmulatedLink(emulate_gbps)
    if device.type == "cuda":
        return CudaLink(device)
    return ThreadLink()  # the CPU is its own device: a plain host copy
