"""CudaLink's logic on a fake CUDA (this machine has no GPU): chunks and priorities, at
most `max_in_flight_bytes` handed to the GPU (blocking events), wait() only orders the compute stream,
fences make the copy stream wait, completion only by polling, stalls timed by events,
and the pump thread issuing the next chunk when one completes, without a poll.

The fake records what CudaLink asks of the streams (events recorded, events waited on);
an event completes only when the test says so. Copies of CPU tensors run at once, which
does not matter here: what is checked is the order of what is handed to the streams.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from fmoe_cli.offload.link import DEMAND, PREFETCH, CudaLink, Fence, TransferState

KiB = 1024


class FakeEvent:
    def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
        self.done = threading.Event()
        self.stream = None
        self.blocking = blocking

    def record(self, stream=None) -> None:
        stream = stream or GPU.current
        self.stream = stream
        stream.ops.append(("record", self))
        GPU.recorded(self, stream)

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.done.wait(timeout=10)

    def elapsed_time(self, other: FakeEvent) -> float:
        return 2.5  # ms


class FakeStream:
    def __init__(self, device=None) -> None:
        self.ops: list[tuple[str, FakeEvent]] = []

    def wait_event(self, event: FakeEvent) -> None:
        self.ops.append(("wait", event))

    def synchronize(self) -> None:
        for kind, event in self.ops:
            if kind == "record":
                event.done.set()


class FakeGpu:
    def __init__(self) -> None:
        self.compute = FakeStream()
        self.current = self.compute
        self.cv = threading.Condition()
        self.copy_records: list[FakeEvent] = []

    def recorded(self, event: FakeEvent, stream: FakeStream) -> None:
        if stream is not self.compute:
            with self.cv:
                self.copy_records.append(event)
                self.cv.notify_all()

    def complete(self, n: int = 1) -> None:
        """The copy engine finishes the oldest `n` copies handed to it."""
        pending = [e for e in self.copy_records if not e.done.is_set()]
        for event in pending[:n]:
            event.done.set()

    @contextlib.contextmanager
    def stream(self, s):
        previous, self.current = self.current, s
        try:
            yield
        finally:
            self.current = previous


GPU = FakeGpu()


@pytest.fixture
def fake_cuda(monkeypatch):
    global GPU
    GPU = FakeGpu()
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: GPU.stream(s))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: GPU.compute)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    return GPU


def pair(kib: int):
    n = kib * KiB // 4
    return torch.zeros(n), torch.randn(n)


def test_chunks_priorities_and_the_in_flight_limit(fake_cuda):
    link = CudaLink(torch.device("cuda"), max_in_flight_bytes=2 * KiB, chunk_bytes=KiB, pump_thread=False)
    prefetch = link.submit(*pair(8), PREFETCH)  # 8 chunks
    assert len(link._in_flight) == 2 and prefetch.state is TransferState.RUNNING
    demand = link.submit(*pair(1), DEMAND)
    assert demand.state is TransferState.QUEUED  # two chunks in flight: it waits for one to finish
    fake_cuda.complete(1)
    assert not demand.ready()  # the poll issues it next: ahead of the prefetch's third chunk
    assert demand.state is TransferState.RUNNING and link._in_flight[-1][0] is demand
    fake_cuda.complete(2)
    assert demand.ready() and demand.state is TransferState.DONE
    assert torch.equal(demand.dst, demand.src)
    while not prefetch.ready():
        fake_cuda.complete(2)
    assert link.bytes_moved == 9 * KiB and torch.equal(prefetch.dst, prefetch.src)
    link.close()


def test_wait_orders_the_compute_stream_without_blocking_and_acquire_times_the_stall(fake_cuda):
    link = CudaLink(torch.device("cuda"), max_in_flight_bytes=KiB, chunk_bytes=KiB, pump_thread=False)
    busy = link.submit(*pair(4), PREFETCH)
    queued = link.submit(*pair(2), PREFETCH + 1)
    assert queued.state is TransferState.QUEUED
    segment = link.acquire(queued, tag=3)  # the compute needs it now: issued at once, the host goes on
    assert segment is queued.dst and queued.event is not None and not queued.event.query()
    kinds = [(kind, event) for kind, event in fake_cuda.compute.ops]
    assert ("wait", queued.event) in kinds  # the compute stream waits on the copy's last event
    before, wait, after = kinds[-3:]
    assert before[0] == "record" and wait == ("wait", queued.event) and after[0] == "record"
    assert link.stalls() == []  # not known until the events complete
    before[1].done.set()
    after[1].done.set()
    assert link.stalls() == [(3, 0.0025)]
    for _ in range(8):
        fake_cuda.complete(1)
        busy.ready()
    assert busy.state is queued.state is TransferState.DONE
    link.close()


def test_a_fence_makes_the_copy_stream_wait_for_the_readers(fake_cuda):
    link = CudaLink(torch.device("cuda"), chunk_bytes=KiB, pump_thread=False)
    reads = link.record_reads()  # after the compute that read the slot
    assert ("record", reads.event) in fake_cuda.compute.ops and isinstance(reads, Fence)
    refill = link.submit(*pair(2), DEMAND, after=(reads,))
    ops = link.stream.ops
    assert ops[0] == ("wait", reads.event)  # before the refill's first chunk
    assert ops[1][0] == "record" and refill.state is TransferState.RUNNING
    link.close()


def test_a_copy_after_an_earlier_copy_is_issued_after_it(fake_cuda):
    link = CudaLink(torch.device("cuda"), max_in_flight_bytes=KiB, chunk_bytes=KiB, pump_thread=False)
    link.submit(*pair(1), PREFETCH)  # keeps the one in-flight place
    old = link.submit(*pair(2), PREFETCH + 5)
    new = link.submit(*pair(1), DEMAND, after=(old,))
    fake_cuda.complete(1)
    new.ready()
    assert old.state is TransferState.RUNNING and new.state is TransferState.QUEUED  # not before `old` started
    link.close()


def test_the_pump_thread_issues_the_next_chunk_without_a_poll(fake_cuda):
    link = CudaLink(torch.device("cuda"), max_in_flight_bytes=KiB, chunk_bytes=KiB)
    t = link.submit(*pair(3), PREFETCH)
    with fake_cuda.cv:
        assert len(fake_cuda.copy_records) == 1
        fake_cuda.complete(1)  # the first chunk lands; nobody polls
        assert fake_cuda.cv.wait_for(lambda: len(fake_cuda.copy_records) == 2, timeout=10)
        fake_cuda.complete(1)
        assert fake_cuda.cv.wait_for(lambda: len(fake_cuda.copy_records) == 3, timeout=10)
        fake_cuda.complete(1)
    link.close()
    assert t.state is TransferState.DONE and torch.equal(t.dst, t.src)


def test_a_copy_seen_done_is_acquired_without_touching_the_compute_stream(fake_cuda):
    """A poll saw its last event complete: the copy has landed, so acquire hands out the buffer with no
    wait and no timing events on the compute stream (host work per loaded segment), and releasing it
    (cancel) does not take the link's lock path either: it has begun, so it cannot be cancelled."""
    link = CudaLink(torch.device("cuda"), max_in_flight_bytes=2 * KiB, chunk_bytes=KiB, pump_thread=False)
    t = link.submit(*pair(1), DEMAND)
    fake_cuda.complete(1)
    assert t.ready() and t.state is TransferState.DONE
    ops = list(fake_cuda.compute.ops)
    assert link.acquire(t, tag=0) is t.dst and fake_cuda.compute.ops == ops and link.stalls() == []
    assert not t.cancel() and t.state is TransferState.DONE
    pending = link.submit(*pair(1), DEMAND)  # not seen done yet: the compute stream waits on it
    link.acquire(pending, tag=1)
    assert ("wait", pending.event) in fake_cuda.compute.ops[len(ops):]
    link.close()


def test_a_released_copy_issues_no_further_chunks(fake_cuda):
    """Issue 20 §1: a prefetch released after its first chunk (its slot given to a demand load) must
    not write its remaining chunks over the demand load that follows it into the same slot. It stops
    at the chunk boundary, which also frees the link: only its first chunk is moved."""
    link = CudaLink(torch.device("cuda"), max_in_flight_bytes=KiB, chunk_bytes=KiB, pump_thread=False)
    slot = torch.zeros(2 * KiB)  # one 8 KiB slot of fp32: 8 chunks
    old = link.submit(slot, torch.full_like(slot, 1.0), PREFETCH)
    assert old.state is TransferState.RUNNING and old.sent == KiB
    assert old.cancel()  # the pool releases its slot: stopped at the next chunk boundary
    new = link.submit(slot, torch.full_like(slot, 2.0), DEMAND, after=(old,))
    while not new.ready():
        fake_cuda.complete(1)
    link.close()
    fake_cuda.complete(100)
    link.synchronize()
    assert int((slot == 1.0).sum()) == 0 and bool((slot == 2.0).all())
    assert link.bytes_moved == KiB + 8 * KiB
    assert old.state is TransferState.CANCELLED and new.state is TransferState.DONE


def test_a_copy_after_a_running_copy_waits_for_its_last_chunk(fake_cuda):
    """`after` a copy means after all of it: a copy into the same slot is not issued between its chunks."""
    link = CudaLink(torch.device("cuda"), max_in_flight_bytes=KiB, chunk_bytes=KiB, pump_thread=False)
    slot = torch.zeros(KiB)  # 4 chunks
    old = link.submit(slot, torch.full_like(slot, 1.0), PREFETCH + 3)
    new = link.submit(slot, torch.full_like(slot, 2.0), DEMAND, after=(old,))
    order = []
    while not new.ready():
        order.append(link._in_flight[-1][0] if link._in_flight else None)
        fake_cuda.complete(1)
    assert order[:4] == [old] * 4 and bool((slot == 2.0).all())
    link.close()


def test_in_flight_is_counted_in_bytes_and_chunk_events_block(fake_cuda):
    """Issue 20 §5: small copies (Qwen3-30B-A3B's 2.6 MiB int4 experts, one chunk each) fill the byte
    budget, not a count of 2 copies: the copy engine has work queued while the pump waits. A demand
    load still waits behind at most that many bytes, and goes ahead of the prefetches queued before it.
    The pump thread waits on chunk events: created blocking, so the wait sleeps instead of spinning."""
    link = CudaLink(torch.device("cuda"), max_in_flight_bytes=2 * KiB, chunk_bytes=KiB, pump_thread=False)
    small = [link.submit(torch.zeros(64), torch.randn(64), PREFETCH + i) for i in range(10)]  # 256 B each
    assert [t.state for t in small] == [TransferState.RUNNING] * 8 + [TransferState.QUEUED] * 2
    assert sum(n for _, _, n in link._in_flight) == 2 * KiB
    demand = link.submit(*pair(1), DEMAND)
    assert demand.state is TransferState.QUEUED  # the budget is full
    fake_cuda.complete(3)
    assert not demand.ready() and demand.state is TransferState.QUEUED  # 768 B free: not room for 1 KiB
    fake_cuda.complete(1)
    assert not demand.ready() and demand.state is TransferState.RUNNING  # ahead of the two prefetches left
    assert small[8].state is TransferState.QUEUED and sum(n for _, _, n in link._in_flight) == 2 * KiB
    while not all(t.ready() for t in [*small, demand]):
        assert sum(n for _, _, n in link._in_flight) <= 2 * KiB
        fake_cuda.complete(1)
    assert link.bytes_moved == 10 * 256 + KiB
    assert fake_cuda.copy_records and all(e.blocking for e in fake_cuda.copy_records)
    link.close()


def test_a_refused_read_only_page_lock_leaves_no_cuda_error_behind(monkeypatch):
    """cudaHostRegister refused read-only (a driver without it) and accepted writable: the refusal is cleared from the
    thread's last CUDA error (torch's binding does not; its next kernel launch would report it, anywhere)."""
    from fmoe_cli.offload import store as store_module

    calls, cleared = [], []

    class Runtime:
        def cudaHostRegister(self, pointer, nbytes, flags):
            calls.append(flags)
            return 801 if flags & store_module.HOST_REGISTER_READ_ONLY else 0  # cudaErrorNotSupported

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    monkeypatch.setattr(store_module, "clear_cuda_error", lambda: cleared.append(len(calls)))
    memory = torch.zeros(4096, dtype=torch.uint8)
    buffer = store_module.HostBuffer(4096, pin=True, memory=memory)
    assert buffer.registered and len(calls) == 2 and calls[0] & store_module.HOST_REGISTER_READ_ONLY
    assert cleared == [1]  # right after the refusal, before anything else runs on CUDA


def test_a_new_thread_runs_on_the_device_current_where_it_was_made(monkeypatch):
    """--device cuda:1: the serve worker's and the chat's idle threads make CUDA calls that name no device; they run
    on the device current in the thread that made them (a new thread starts on device 0)."""
    import threading

    from fmoe_cli.offload.link import on_current_device

    made = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: made.append((threading.current_thread().name, d)))
    worker = threading.Thread(target=on_current_device(lambda: None), name="worker")
    worker.start()
    worker.join()
    assert made == [("worker", 1)]
