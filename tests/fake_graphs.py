"""CUDA graphs on the CPU, no kinder than CUDA: the stand-in for generate.CudaGraphs in the tests (issue 37 §1).

A segment's capture records every aten op the step runs (torch's dispatcher: `TorchDispatchMode`), and a replay runs
the recorded ops again, in order, on the same tensors. What CUDA does to a captured step, and this does too:
- the Python that ran during the capture does not run at a replay: its decisions (shapes, branches, which experts a
  layer took, any Python number passed to an op) are frozen at the capture's token;
- nothing the capture computes is real: after each segment, every tensor its ops allocated holds garbage (NaN, or
  for integers the dtype's largest value, True for bools) until a replay writes it; and what its ops wrote into
  tensors that existed before (the KV cache, the engine's buffers) is put back as it was (CUDA runs nothing while
  capturing);
- the host may not read what is being captured: `.item()`, `int()`, `bool()`, `.tolist()`, `.numpy()`, `.cpu()`,
  `torch.equal`, an op whose output size depends on the data (nonzero, masked_select, unique, bincount,
  repeat_interleave without its output size, indexing by a mask) and a blocking copy between devices raise
  "operation not permitted when stream is capturing", as CUDA does.

At a replay an out-of-place op is computed again and copied into the tensor it returned at the capture (the graph's
fixed address), an in-place or `out=` op runs again on its tensors, a view does nothing (it shares its base's
memory), an allocation (`empty`) does nothing.

Kinder than CUDA in one respect, said here: every tensor a capture used stays alive with the recording, so it cannot
show a tensor that Python freed during the capture being reused by a later allocation of the shared pool. The step's
code keeps what the replay's cuts read (generate.StepCapture), as it must on a GPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

CAPTURING = "operation not permitted when stream is capturing"
aten = torch.ops.aten

# Reads of a value on the host, at the dispatcher (.item(), int(), bool(), torch.equal) …
HOST_READ_OPS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.equal.default}
# … and outside it (Tensor methods that read the data without an aten op; `.cpu()` copies to the host)
HOST_READ_METHODS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.__array__}
# Ops whose output size depends on the values: CUDA reads the size back on the host
DATA_DEPENDENT_OPS = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
                      aten.unique_consecutive.default, aten.unique_dim.default, aten.bincount.default,
                      aten.repeat_interleave.Tensor, aten.nonzero_static.default}
ALLOCATIONS = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
               aten.new_empty_strided.default}


def _garbage(t: torch.Tensor) -> None:
    if t.dtype == torch.bool:
        t.fill_(True)
    elif t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    else:
        t.fill_(torch.iinfo(t.dtype).max)


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@dataclass
class Op:
    func: object
    args: tuple
    kwargs: dict
    out: object
    kind: str  # "compute" (out-of-place), "mutate" (in-place, out=), "view", "alloc"
    outs: list[torch.Tensor] = field(default_factory=list)  # a compute op's output tensors, where a replay copies


@dataclass
class Segment:
    ops: list[Op] = field(default_factory=list)
    fresh: list[torch.Tensor] = field(default_factory=list)  # what its ops allocated (garbage after the capture)
    fresh_storages: set = field(default_factory=set)
    saved: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # older tensors written, as they were

    def finish(self) -> None:
        """The capture is over: what it wrote into older tensors put back, what it allocated made garbage."""
        for t, before in reversed(self.saved):
            t.copy_(before)
        self.saved = []
        for t in self.fresh:
            _garbage(t)

    def replay(self) -> None:
        for op in self.ops:
            if op.kind in ("view", "alloc"):
                continue
            out = op.func(*op.args, **op.kwargs)
            if op.kind == "compute":
                if isinstance(out, torch.Tensor):  # most ops: one tensor (no tree to walk)
                    op.outs[0].copy_(out)
                    continue
                for recorded, new in zip(op.outs, _tensors(out)):
                    recorded.copy_(new)


class _Recorder(TorchDispatchMode):
    """Records every aten op of a segment's capture; refuses the host reads and data-dependent sizes."""

    def __init__(self, segment: Segment) -> None:
        super().__init__()
        self.segment = segment

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READ_OPS or func in DATA_DEPENDENT_OPS:
            raise RuntimeError(f"{CAPTURING} ({func})")
        if func is aten.index.Tensor and any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in args[1]):
            raise RuntimeError(f"{CAPTURING} (indexing by a mask)")
        segment = self.segment
        written = self._written(func, args, kwargs)
        self._check_copy(func, args, kwargs)
        for t in written:
            if _storage(t) not in segment.fresh_storages:
                segment.saved.append((t, t.clone()))
        out = func(*args, **kwargs)
        inputs = {_storage(t) for t in _tensors((args, kwargs))}
        outs = _tensors(out)
        if written:
            kind = "mutate"
        elif func in ALLOCATIONS:
            kind = "alloc"
        elif all(t.numel() == 0 or _storage(t) in inputs for t in outs):
            kind = "view"
        else:
            kind = "compute"
        segment.ops.append(Op(func, args, kwargs, out, kind, outs if kind == "compute" else []))
        if kind in ("compute", "alloc"):
            for t in outs:
                if t.numel() and _storage(t) not in inputs:
                    segment.fresh.append(t)
                    segment.fresh_storages.add(_storage(t))
        return out

    @staticmethod
    def _written(func, args, kwargs) -> list[torch.Tensor]:
        """The tensors an op writes (its schema's mutable arguments: self of an in-place op, out=)."""
        written = []
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            written.extend(_tensors(value))
        return written

    @staticmethod
    def _check_copy(func, args, kwargs) -> None:
        """A copy between devices is captured only when it does not block and its host side is pinned."""
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            if dst.device != src.device:
                host = dst if dst.device.type == "cpu" else src
                if not non_blocking or not host.is_pinned():
                    raise RuntimeError(f"{CAPTURING} (a blocking or pageable copy)")


class _HostReads(TorchFunctionMode):
    """The Tensor methods that read values on the host without an aten op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READ_METHODS:
            raise RuntimeError(f"{CAPTURING} ({getattr(func, '__name__', func)})")
        return func(*args, **(kwargs or {}))


class RecordedGraphs:
    """generate.CudaGraphs' interface (capturing, begin, end, abort, replay) on the recorder. Counts, over all
    instances, the segments captured and replayed (tests read and reset them)."""

    captured = 0  # segments whose capture ended
    replayed = 0  # segment replays
    made = 0  # instances (one per DecodeGraph capture)

    def __init__(self, decode) -> None:
        self.segments: list[Segment] = []
        self._modes: contextlib.ExitStack | None = None
        RecordedGraphs.made += 1

    @classmethod
    def reset(cls) -> None:
        cls.captured = cls.replayed = cls.made = 0

    def capturing(self):
        return contextlib.nullcontext()

    def begin(self) -> None:
        segment = Segment()
        self.segments.append(segment)
        self._modes = contextlib.ExitStack()
        self._modes.enter_context(_HostReads())
        self._modes.enter_context(_Recorder(segment))

    def end(self) -> None:
        self._modes.close()
        self._modes = None
        self.segments[-1].finish()
        RecordedGraphs.captured += 1

    def abort(self) -> None:
        if self._modes is not None:
            self._modes.close()
            self._modes = None
            self.segments[-1].finish()
        self.segments = []

    def replay(self, segment: int) -> None:
        self.segments[segment].replay()
        RecordedGraphs.replayed += 1
