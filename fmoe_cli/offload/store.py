"""The host store: every routed expert, packed neuron-major, in host RAM.

One [N, I, *row_shape] tensor of `dtype` per MoE layer, each in one allocation of
exactly its size. When a GPU reads the store, that memory is page-locked in place
with cudaHostRegister (as MoE-Infinity does) instead of `pin_memory()`, whose
caching allocator rounds every block up to a power of two (Mixtral's 2.625 GiB
layers would take 4 GiB each); portable (any device's context may copy from it), and
read-only where it is a mapped converted store (registering a private mapping for
writing would copy every page into RAM first). The CPU path is the same minus the
registration.

The engine reads the store through three members only (agreed with offload/engine):
`row_shape` (one neuron's row), `dtype` (the rows' storage dtype) and
`segment_forward(x, segment, act, acc=None, partial=False)` (with `segments_forward`, several at
once): unquantised rows are (3, H) of the
compute dtype, quantised rows (offload/quant.py) are bytes. On the CPU both compute with the expert
kernels (fmoe_cli/kernels: one pass, split-exact: `acc`, the first part's `partial` result, continued by
the second part gives the whole's bits); on a GPU, or without the kernels, with torch
(layout.segment_forward; the parts' sum then equals the whole's to float rounding).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading

import torch

from fmoe_cli import kernels
from fmoe_cli.errors import FmoeError, warn
from fmoe_cli.offload import layout
from fmoe_cli.types import DEFAULT_ACTIVATIONS, ExpertShape


GROUP_FROM = 3  # whole segments of one buffer grouped from this many (layout.grouped_forward: 9–11 ops, not 5 each)

# cudaHostRegister flags (cuda_runtime_api.h)
HOST_REGISTER_PORTABLE = 0x01  # page-locked for every CUDA context, not only the current device's (cuda:1)
HOST_REGISTER_READ_ONLY = 0x08  # the GPU only reads it: no write access is asked for


def register_flags(mapped: bool) -> int:
    """Portable always (the run's device need not be the current one); read-only for a mapped file: a
    private writable mapping registered for writing has every page copied on write into RAM first."""
    return HOST_REGISTER_PORTABLE | (HOST_REGISTER_READ_ONLY if mapped else 0)


HUGE_PAGE = 2 << 20  # a transparent huge page (x86-64, arm64 with 4 KB pages)
MADV_HUGEPAGE = 14  # <sys/mman.h>


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back `tensor`'s whole 2 MB pages with transparent huge pages (madvise MADV_HUGEPAGE), before it
    is written: a decode step streams the store's rows, and with 4 KB pages each 4 KB costs a TLB miss's page walk.
    A plain two-thread read of 256 MB on the AMD EPYC VM (THP `madvise` mode) read 29.6–33.3 GB/s on 2 MB pages
    against 25.7–31.0 on 4 KB pages (docs/bench.md § CPU expert kernels, "huge pages"). No-op (False) elsewhere, for
    less than one whole page, or where the kernel refuses; the contents are never touched."""
    if sys.platform != "linux" or tensor.device.type != "cpu":
        return False
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if last <= first:
        return False
    return _madvise()(first, last - first, MADV_HUGEPAGE) == 0


@functools.cache
def _madvise():
    """libc's madvise, loaded and typed once."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


def clear_cuda_error() -> None:
    """Clear this thread's last CUDA error after a refused cudaHostRegister: torch's binding returns the status
    without clearing it, and torch's next kernel launch would report it there, anywhere (as "operation not
    supported"). Through the CUDA runtime torch loaded (never loaded anew: nothing where torch has none)."""
    lib = _loaded_cudart()
    if lib is not None:
        lib.cudaGetLastError()


@functools.cache
def _loaded_cudart():
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # only the one already in the process
        except (OSError, AttributeError):
            continue
    return None


@functools.cache
def _warn_not_read_only() -> None:
    warn("this GPU cannot page-lock memory read-only: the converted store's pages are copied into RAM")


class HostBuffer:
    """`nbytes` of ordinary host memory, page-locked for the GPU when `pin` (exact size, no rounding)."""

    def __init__(self, nbytes: int, pin: bool, memory: torch.Tensor | None = None) -> None:
        """`memory`: existing uint8 host memory of `nbytes` to register instead (a memory-mapped file),
        registered read-only."""
        self.tensor = torch.empty(nbytes, dtype=torch.uint8) if memory is None else memory
        if memory is None:
            advise_huge_pages(self.tensor)  # before the loader writes it (a mapped file's pages are the page cache's)
        self.registered = False
        if pin and nbytes > 0:
            flags = register_flags(mapped=memory is not None)
            status = self._register(nbytes, flags)
            if status != 0 and flags & HOST_REGISTER_READ_ONLY:
                # a driver or card without read-only registration: page-locked writable, which copies the
                # mapped pages into RAM (the store's size, as an unconverted store takes)
                _warn_not_read_only()
                status = self._register(nbytes, flags & ~HOST_REGISTER_READ_ONLY)
            if status != 0:
                raise FmoeError(f"cannot page-lock {nbytes / 2**30:.2f} GiB of host memory for the GPU "
                                f"(cudaHostRegister error {int(status)}); lower the memory limit (ulimit -l)?")
            self.registered = True

    def _register(self, nbytes: int, flags: int) -> int:
        """cudaHostRegister's status; a refusal is cleared from the thread's last CUDA error (`clear_cuda_error`)."""
        status = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, flags))
        if status != 0:
            clear_cuda_error()
        return status

    def close(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.registered = False


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing). A load frees many
    small and mid-sized temporaries (float32 non-expert weights before their conversion, the reader's pieces) that
    glibc otherwise keeps resident for the whole run: 18 MiB after a 614 MiB bf16 load, 33 MiB after its int4 store's
    (issue 39 §6)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class HostStore:
    """Unquantised experts: rows of (gate row n, up row n, down column n), (3, H) of the compute dtype."""

    def __init__(self, shape: ExpertShape, dtype: torch.dtype, pin: bool, activations: str = DEFAULT_ACTIVATIONS) -> None:
        self.shape = shape
        self.dtype = dtype
        self.pin = pin
        self.layers: list[torch.Tensor] = []  # [N, I, *row_shape] per MoE layer
        self._experts: list[tuple[torch.Tensor, ...]] = []  # each layer's [I, *row_shape] per expert, made once
        self._buffers: list[HostBuffer] = []
        self.kernel = kernels.spec_of(shape.experts, dtype, shape.hidden, shape.neuron_block, activations,
                                      shape.down_by_neuron)  # the kernels' view
        self._gate_up: dict[tuple, layout.GateUp] = {}  # torch's path: a decode step's whole segment's gate and up
        self._split_workspaces: dict[tuple, layout.SplitWorkspace] = {}  # torch's path: a split expert's gate and up
        self._stacked_outputs: dict[tuple, tuple] = {}  # torch's path: a decode step's stacked outputs (_decode_rows)
        self._last_pair: tuple | None = None  # torch's path: (x, x's broadcast over gate and up) of a decode token
        self.grouping: bool | None = None  # segments_forward groups (None: decided on the first call, by device)

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (3, self.shape.hidden)

    def segment_forward(self, x: torch.Tensor, segment, act, acc=None, partial: bool = False,
                        kernel: bool = True, lane: int = 0):
        """Partial expert output of the neurons in `segment` ([n, *row_shape], or its `rows`) for tokens x ([T, H]).

        partial: the top of a split expert, to be continued (the kernels' float32 accumulator; on torch's path
        a `layout.Top`: its gate and up only, in workspace `lane`: tops computed together need distinct lanes).
        acc: that top's result, continued by this segment, the bottom (-> the whole expert's output).
        kernel=False: torch's path even where the kernels run (benchmarks/kernels.py compares them)."""
        if kernel and self.kernel is not None and isinstance(segment, torch.Tensor) and kernels.runs(x, act):
            return kernels.segment_forward(x, segment, self.kernel, acc, partial)
        if partial:
            return self.torch_top(x, segment, act, lane)
        if acc is not None:
            return self.torch_bottom(x, segment, act, acc)
        return self.torch_forward(x, segment, act)

    def torch_forward(self, x: torch.Tensor, segment, act) -> torch.Tensor:
        """segment_forward with torch's ops (a GPU; a CPU without the kernels); a decode step's gate and up into a
        workspace made once per (neurons, dtype, device, thread: the host lane's threads compute too) (layout.GateUp:
        one op fewer a segment)."""
        if x.shape[0] != 1 or x.requires_grad:  # (autograd refuses out=: a forward under grad takes the plain path)
            return layout.segment_forward(x, segment, act)
        neurons = (segment.down if isinstance(segment, layout.Rows) else segment).shape[0]
        return layout.segment_forward(x, segment, act, self._decode_gate_up(neurons, x), self._pair(x))

    def _pair(self, x: torch.Tensor) -> torch.Tensor:
        """x's broadcast over gate and up [2, 1, H] (layout.gate_up_mm's pair, a view op) for a decode token x [1, H],
        made once for the token row: a layer's segments on torch's path (its whole ones, its tops, the experts it
        loads) are all computed from the same x, and share it. (The last one made is kept with its x, compared by
        identity: a later layer's or token's x is another tensor.)"""
        last = self._last_pair
        if last is not None and last[0] is x:
            return last[1]
        pair = x.expand(2, *x.shape)
        self._last_pair = (x, pair)
        return pair

    def _decode_gate_up(self, neurons: int, x: torch.Tensor) -> layout.GateUp:
        """The decode workspace of a whole segment of `neurons` for the token x [1, H] (torch_forward)."""
        key = (neurons, x.dtype, x.device, threading.get_ident())
        workspace = self._gate_up.get(key)
        if workspace is None:
            workspace = self._gate_up[key] = layout.GateUp.make(1, neurons, x.dtype, x.device)
        return workspace

    def torch_top(self, x: torch.Tensor, segment, act, lane: int) -> layout.Top:
        """A split expert's top on torch's path: its gate and up into a workspace beside where the bottom's
        go (layout.top_forward), decode's workspaces made once per (top size, lane), and x's broadcast (`_pair`)."""
        rows = segment if isinstance(segment, layout.Rows) else layout.split_rows(segment)
        tokens, neurons = x.shape[0], rows.down.shape[0]
        key = (tokens, neurons, lane, x.dtype, x.device)
        workspace = self._split_workspaces.get(key)
        if workspace is None:
            workspace = layout.SplitWorkspace.make(tokens, neurons, self.shape.intermediate, x.dtype, x.device)
            if tokens == 1:  # a decode step; a prefill's token counts vary: its workspaces are not kept
                self._split_workspaces[key] = workspace
        return layout.top_forward(x, rows, workspace, self._pair(x) if tokens == 1 else None)

    def torch_bottom(self, x: torch.Tensor, segment, act, top) -> torch.Tensor:
        """The split expert's output once its bottom is here (layout.bottom_forward; a top computed with its layer's
        others, `layout.GroupedTop`: layout.bottom_alone)."""
        if isinstance(top, layout.GroupedTop):
            rows = segment if isinstance(segment, layout.Rows) else layout.split_rows(segment)
            return layout.bottom_alone(x, rows, act, top)
        return layout.bottom_forward(x, segment, act, top)

    def segments_forward(self, xs: list[torch.Tensor], segments: list, act, partial: bool = False,
                         together: bool = False, accs: list | None = None, stacked: bool = False):
        """`segment_forward` of each (x, segment) pair, in one call: a layer's experts on the device (whole, or
        the tops of top hits, each in its own workspace lane; `accs`: bottoms continuing those tops, one each).
        Where `grouping` holds, a decode step's whole segments of one buffer (a layer's cache; every expert when
        resident; on the device path the staging pool's slots a layer's loads landed in: Engine._loaded_decode) go
        through torch's grouped matmul, 9–11 ops for all of them instead of 5 each (from GROUP_FROM of them); so do
        split experts' tops where their bottoms will be computed `together` too (layout.grouped_tops), and bottoms
        of one buffer continuing such tops (layout.grouped_bottoms). On the CPU with the kernels, the
        segments of one x (a decode step's) go in one kernel call (kernels.segments_forward: the bits of one call
        each), and segments of their own tokens each (a prefill's) in one too (kernels.experts_forward: likewise).
        A decode step's segments on torch's path share x's broadcast (`_torch_decode`). Else one segment_forward
        each. `stacked` (whole segments): their outputs stacked [n, H], not a list."""
        outputs = self._segments_forward(xs, segments, act, partial, together, accs, stacked)
        return torch.cat(outputs) if stacked and isinstance(outputs, list) else outputs

    def _segments_forward(self, xs: list[torch.Tensor], segments: list, act, partial: bool, together: bool,
                          accs: list | None, stacked: bool):
        if (accs is None and len(segments) > 1 and self.kernel is not None
                and all(isinstance(s, torch.Tensor) for s in segments)):
            if all(y is xs[0] for y in xs) and kernels.runs(xs[0], act):
                return kernels.segments_forward(xs[0], segments, self.kernel, partial)
            if all(y.dtype == xs[0].dtype and kernels.runs(y, act) for y in xs):  # a prefill's experts, own tokens each
                return kernels.experts_forward(xs, segments, self.kernel, partial)
        if len(segments) >= GROUP_FROM and self._groups(xs, segments):
            if accs is not None:
                if isinstance(accs[0], layout.GroupedTop):
                    grouped = self._grouped(layout.grouped_bottoms, xs[0], segments, act, accs)
                    if grouped is not None:
                        return grouped
            elif not partial or together:
                grouped = self._grouped(layout.grouped_tops if partial else layout.grouped_forward, xs[0], segments,
                                        act)
                if grouped is not None:
                    return grouped
        if accs is not None:
            return [self.segment_forward(x, segment, act, acc=acc) for x, segment, acc in zip(xs, segments, accs)]
        x = xs[0]
        if (len(segments) > 1 and x.shape[0] == 1 and not x.requires_grad and all(y is x for y in xs)
                and all(type(s) is layout.Rows for s in segments)):  # (Rows: torch's path, as segment_forward takes)
            return self._torch_decode(x, segments, act, partial, stacked)
        return [self.segment_forward(x, segment, act, partial=partial, lane=lane)
                for lane, (x, segment) in enumerate(zip(xs, segments))]

    def _torch_decode(self, x: torch.Tensor, segments: list, act, partial: bool, stacked: bool):
        """Segments (Rows) for one token x [1, H] on torch's path: each one's ops as torch_forward's (whole) or
        torch_top's (tops), x's broadcast shared (`_pair`), and where `stacked` the whole segments' down matmuls
        written into the rows of one [n, H] buffer made once (no concatenation after). The same kernels on the same
        operands: the same bits."""
        if partial:
            return [self.torch_top(x, rows, act, lane) for lane, rows in enumerate(segments)]
        pair = self._pair(x)
        into = self._decode_rows(len(segments), x) if stacked else None
        outputs = [layout.segment_forward(x, rows, act, self._decode_gate_up(rows.down.shape[0], x), pair,
                                          out=None if into is None else into[1][j]) for j, rows in enumerate(segments)]
        return outputs if into is None else into[0]

    def _decode_rows(self, n: int, x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """A buffer [n, H] for n whole segments' outputs of the token x [1, H] and its rows [1, H] (views), made
        once per (n, dtype, device, thread); its values are read before the next layer's segments overwrite them
        (the engine's weighted sum)."""
        key = (n, x.shape[1], x.dtype, x.device, threading.get_ident())
        made = self._stacked_outputs.get(key)
        if made is None:
            with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode
                buffer = torch.empty(n, x.shape[1], dtype=x.dtype, device=x.device)
            made = self._stacked_outputs[key] = (buffer, buffer.split(1))
        return made

    def _grouped(self, forward, x: torch.Tensor, *args) -> list | None:
        """`forward(x, *args)` (torch's grouped matmul); None where torch refuses it on this device: said in one line,
        grouping off from then on (the caller goes one by one)."""
        try:
            return forward(x, *args)
        except (RuntimeError, NotImplementedError, ValueError, TypeError) as exc:  # torch's checks refuse a
            # card, dtype or stride (TORCH_CHECK*): found on the first call, before its results are used
            if not self.may_refuse(x):
                raise
            warn(f"torch's grouped matmul does not run here ({str(exc).splitlines()[0][:120]}); a layer's experts go "
                 f"one by one")
            self.grouping = False
            return None

    @staticmethod
    def may_refuse(x: torch.Tensor) -> bool:
        """Whether torch's grouped matmul may refuse tokens x's device (a card, dtype or stride its checks do not
        take); on the CPU a refusal is a bug, and raises."""
        return x.device.type != "cpu"

    def stacks(self, x: torch.Tensor, act) -> bool:
        """Whether `stacked_forward` computes for tokens x: where the kernels do (the CPU)."""
        return self.kernel is not None and kernels.runs(x, act)

    def stacked_forward(self, x: torch.Tensor, segments: list, act) -> torch.Tensor:
        """The whole segments' outputs for one token x [1, H] (where `stacks`), in the given order, stacked [n, H] by
        one kernel call (kernels.segments_forward: each segment's bits as it has alone)."""
        return kernels.segments_forward(x, segments, self.kernel, stacked=True)

    def groups(self, x: torch.Tensor) -> bool:
        """Whether grouping is on for x's device (`grouping`; default: a CUDA card of sm_80 or newer, where one
        launch per projection replaces K; on the CPU the loop costs less: docs/bench.md § Host work in ops)."""
        if self.grouping is None:
            self.grouping = x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) >= (8, 0)
        return self.grouping

    def _groups(self, xs: list[torch.Tensor], segments: list) -> bool:
        """Whether `grouped_forward` takes these: one token (every xs[i] the same row), whole segments of one
        stack, and grouping on for the device (`groups`)."""
        x = xs[0]
        stack = getattr(segments[0], "stack", None)
        return (self.groups(x) and stack is not None and x.shape[0] == 1 and all(y is x for y in xs)
                and all(s.stack is stack for s in segments))

    def rows(self, segment: torch.Tensor):
        """What `segment_forward` takes for `segment`, prepared once for a buffer that is computed from many
        times (a cached top, a staging slot): on the CPU with the kernels the rows themselves, else its
        `layout.Rows` (views for torch's matmuls)."""
        if segment.device.type == "cpu" and self.kernel is not None and kernels.library() is not None:
            return segment
        return layout.split_rows(segment)

    def stacked_rows(self, buffer: torch.Tensor) -> list:
        """`rows` of each slot of a buffer [C, n, *row_shape] (a layer's cached tops), made once; on torch's path
        they know their buffer, so that `segments_forward` can group them."""
        slots = buffer.unbind(0)
        if slots and isinstance(self.rows(slots[0]), layout.Rows):
            return layout.stack_rows(buffer)
        return [self.rows(segment) for segment in slots]

    @property
    def layer_bytes(self) -> int:
        s = self.shape
        return s.num_experts * s.intermediate * s.neuron_bytes

    def allocate(self, memory: list[torch.Tensor] | None = None) -> None:
        """One exact-size buffer per MoE layer (contents undefined until `put`); or `memory`: one
        uint8 tensor of layer_bytes per layer that already holds them (a memory-mapped converted store)."""
        s = self.shape
        for i in range(s.num_layers):
            buffer = HostBuffer(self.layer_bytes, self.pin, None if memory is None else memory[i])
            self._buffers.append(buffer)
            self.layers.append(buffer.tensor.view(self.dtype).view(s.num_experts, s.intermediate, *self.row_shape))
            self._experts.append(self.layers[-1].unbind(0))  # one op per layer, not one per load

    def block(self, layer: int, expert: int) -> torch.Tensor:
        """Where the loader assembles an expert's packed [I, 3, H] block: here, its place in the store."""
        return self.layers[layer][expert]

    def put(self, layer: int, expert: int, block: torch.Tensor) -> None:
        """Write expert `expert` of MoE layer `layer` from its packed [I, 3, H] block."""
        target = self.layers[layer][expert]
        if block.data_ptr() != target.data_ptr():
            target.copy_(block)

    def end_load(self) -> None:
        """Every expert is `put`: the loader's scratch goes (here none: blocks are the store's own memory)."""

    def expert(self, layer: int, expert: int) -> torch.Tensor:
        """Expert `expert` of MoE layer `layer`: [I, *row_shape], a view made at allocation."""
        return self._experts[layer][expert]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)

    def close(self) -> None:
        for buffer in self._buffers:
            buffer.close()
