"""A fake GPU no kinder than CUDA, for running `CudaLink` (the real CUDA code path) on the CPU.

What CUDA promises the host, and no more:
- a copy on a stream is played by the copy engine later, chunk by chunk, in stream order;
  until a chunk has been played its destination holds garbage: here NaN (for integer
  buffers, the dtype's largest value), written the moment the chunk is issued;
- an event completes when everything recorded before it on its stream has been played,
  and the host sees that only through `query()` (which here lets the engine play one
  more op: time passes while the host polls) or `synchronize()`;
- a stream that waits on an event runs nothing after the wait until the event has
  completed;
- a staging slot the engine has released may be overwritten by the next load at once: it is poisoned then. The compute here is the host itself (the engine's tensors are on the CPU),
  so a compute-stream `wait_event` plays the awaited stream up to that event right then:
  the compute sees a slot's data only after its wait, and NaN if it reads without one.

The copy engine is never faster than that: a chunk lands when the host polls, waits or
synchronizes, or when the link's pump thread has waited a few ms on it. Use it with
`installed()`, which patches `torch.cuda` for the duration.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque

import torch
from torch.overrides import TorchFunctionMode

from fmoe_cli.offload.pool import StagingPool


class Event:
    def __init__(self, gpu: ChunkGpu, enable_timing: bool = False) -> None:
        self.gpu = gpu
        self.done = False
        self.stream: Stream | None = None

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or self.gpu.current
        with self.gpu.cv:
            self.stream = stream
            self.done = False
            stream.push(("record", self))

    def query(self) -> bool:
        with self.gpu.cv:
            if not self.done and self.stream is not None:
                self.stream.play_one()  # the GPU moves on while the host polls
            return self.done

    def synchronize(self) -> None:
        """Block until the event has been played: by someone else's poll or wait if that comes within a
        few ms (the link's pump thread waits here), else by the copy engine itself."""
        with self.gpu.cv:
            self.gpu.cv.wait_for(lambda: self.done, timeout=0.005)
            if not self.done:
                self.stream.play_until(self)

    def elapsed_time(self, other: Event) -> float:
        return 0.0  # ms


class Stream:
    def __init__(self, gpu: ChunkGpu, compute: bool = False) -> None:
        self.gpu = gpu
        self.compute = compute  # the host's own work: everything on it has happened when issued
        self.ops: deque = deque()

    def push(self, op: tuple) -> None:
        if self.compute:
            self.gpu.run(op)
        else:
            self.ops.append(op)

    def wait_event(self, event: Event) -> None:
        with self.gpu.cv:
            self.push(("wait", event))

    def play_one(self) -> None:
        if self.ops:
            self.gpu.run(self.ops.popleft())

    def play_until(self, event: Event) -> None:
        while not event.done:
            if not self.ops:
                raise AssertionError("waiting on an event that was never recorded on its stream")
            self.gpu.run(self.ops.popleft())

    def synchronize(self) -> None:
        with self.gpu.cv:
            while self.ops:
                self.gpu.run(self.ops.popleft())


def _poison(t: torch.Tensor) -> None:
    t.fill_(float("nan") if t.dtype.is_floating_point else torch.iinfo(t.dtype).max)


class _CopiesOnStream(TorchFunctionMode):
    """Inside `torch.cuda.stream(copy stream)`: a copy is queued on the stream, its destination poisoned."""

    def __init__(self, gpu: ChunkGpu, stream: Stream) -> None:
        super().__init__()
        self.gpu, self.stream = gpu, stream

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            dst, src = args[0], args[1]
            with self.gpu.cv:
                _poison(dst)
                self.stream.push(("copy", dst, src))
                self.gpu.chunks_issued += 1
            return dst
        return func(*args, **kwargs)


class ChunkGpu:
    def __init__(self) -> None:
        self.cv = threading.Condition(threading.RLock())
        self.compute = Stream(self, compute=True)
        self.current = self.compute
        self.chunks_issued = 0
        self.chunks_played = 0

    def run(self, op: tuple) -> None:
        kind = op[0]
        if kind == "copy":
            _, dst, src = op
            dst.copy_(src)
            self.chunks_played += 1
        elif kind == "record":
            op[1].done = True
        elif kind == "wait":
            event = op[1]
            if not event.done:
                event.stream.play_until(event)
        self.cv.notify_all()

    @contextlib.contextmanager
    def stream(self, s: Stream):
        previous, self.current = self.current, s
        mode = _CopiesOnStream(self, s) if not s.compute else contextlib.nullcontext()
        try:
            with mode:
                yield
        finally:
            self.current = previous


@contextlib.contextmanager
def installed():
    """Patch torch.cuda with a fresh ChunkGpu for the duration; yields it."""
    gpu = ChunkGpu()
    with pytest_monkeypatch() as mp:
        # Classes, not lambdas: modules imported meanwhile use them in annotations (`torch.cuda.Stream | None`).
        class CudaStream:
            def __new__(cls, device=None, **_):
                return Stream(gpu)

        class CudaEvent:
            def __new__(cls, enable_timing: bool = False, **_):
                return Event(gpu, enable_timing)

        mp.setattr(torch.cuda, "Stream", CudaStream)
        mp.setattr(torch.cuda, "Event", CudaEvent)
        mp.setattr(torch.cuda, "stream", gpu.stream)
        mp.setattr(torch.cuda, "current_stream", lambda device=None: gpu.compute)
        mp.setattr(torch.cuda, "device", lambda device=None: contextlib.nullcontext())
        mp.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake chunk-playing GPU")
        mp.setattr(StagingPool, "release", _released_is_garbage(StagingPool.release))
        yield gpu


def _released_is_garbage(release):
    """A staging slot, once released, is the copy engine's: the next load into it waits only for the fence of the
    reads issued before the release (`reads`), so whatever reads the slot after its release may see the next load's
    bytes on a GPU. Here the compute has run when it is issued, so the slot is poisoned the moment it is released: a
    read issued after the release (a compute, an admission into the cache) sees NaN. (A chunk of a cancelled load
    still on the copy stream lands later, as on a GPU.)"""
    def poisoning(self, entry, reads=None):
        release(self, entry, reads)
        _poison(self.buffer[entry.slot])

    return poisoning


def pytest_monkeypatch():
    import pytest

    return pytest.MonkeyPatch.context()
