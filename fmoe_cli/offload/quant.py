"""int8 / int4 / int2 experts: weight-only, group-wise along the hidden dimension, neuron-major.

Neuron n of an expert is the row (gate row n, up row n, down column n), three vectors
of length H (offload/layout.py). Each is quantised in groups of G consecutive weights
along H:

    int8 (symmetric):   s = max|w| / 127,            q = round(w / s) ∈ [-127, 127],  ŵ = q·s
    int4 (min / max):   s = (max w − min w) / 15,    q = round((w − m) / s) ∈ [0, 15], ŵ = q·s + m,  m = min w

(s and m in float16, rounded before q is computed), and

    int2 (HQQ):         ŵ = (q − z)·s, q ∈ [0, 3], G = 16, z from HQQ's half-quadratic solver,
                        s and z themselves stored as 8-bit codes (offload/hqq.py).

A stored neuron row is, for each of the three projections, its H codes (int4: byte j holds
code j in its low nibble and code j + H/2 in its high one, so unpacking writes two contiguous
halves; int2: four quarters) followed by its H/G groups of metadata: `row_shape` = (3, projection_bytes) bytes. Every
neuron carries its own scales, so any top/bottom split [0, k) / [k, I) is still one
contiguous segment with its scales, and a segment computes alone.

This module keeps the storage. On the CPU the expert kernels (fmoe_cli/kernels) compute from these
rows in one pass, unpacking in registers. On a GPU (and on a CPU without the kernels) `torch_forward`
dequantises:

    segment_forward(x, seg) = Σ_blocks layout.segment_forward(x, dequantize(seg[block]), act)

(the fused int8/int4 matmuls torch ships take per-output-channel scales or their own tiled layouts,
neither of which splits by neuron: see docs/quantization.md for the measurement). A segment is
dequantised in blocks of neurons (`block_rows`), each straight into a compute-dtype workspace, so the
memory a quantised forward needs is bounded by DEQUANT_WORKSPACE_BYTES (counted in the device budget's
workspace), not by the expert (a Mixtral expert dequantised whole would take 672 MiB of float32 and
336 MiB of bf16). Like the split into top and bottom, the blocks are a partition of the neurons:
exact partial sums.

Exactness contract: the engine's tokens equal transformers' generate on the same
checkpoint with its experts replaced by `dequantize` of the stored rows.
"""

from __future__ import annotations

import torch

from fmoe_cli.offload import hqq, layout
from fmoe_cli.offload.store import HostStore
from fmoe_cli.types import DEFAULT_ACTIVATIONS, EXPERT_FORMATS, MiB, ExpertShape, QuantFormat


def quantize(block: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """[n, 3, H] float -> [n, 3, projection_bytes] uint8."""
    if fmt.scheme == "hqq":
        return hqq.quantize(block, fmt)
    n, three, hidden = block.shape
    g = fmt.group_size(hidden)
    w = block.float().reshape(n, three, hidden // g, g)
    if fmt.bits == 8:
        scale = (w.abs().amax(-1) / 127).clamp(min=1e-8).half()  # [n, 3, H/G]
        q = torch.round(w / scale.float()[..., None]).clamp(-127, 127).to(torch.int8).view(torch.uint8)
        meta = scale.view(torch.uint8)  # [n, 3, 2·H/G]
        codes = q.reshape(n, three, hidden)
    else:
        low, high = w.amin(-1), w.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-8).half()
        offset = low.half()
        q = torch.round((w - offset.float()[..., None]) / scale.float()[..., None]).clamp(0, 15).to(torch.uint8)
        q = q.reshape(n, three, hidden)
        codes = q[..., : hidden // 2] | (q[..., hidden // 2:] << 4)  # byte j: code j (low nibble), code j + H/2
        meta = torch.stack([scale, offset], dim=-1).view(torch.uint8).reshape(n, three, -1)  # (s, m) per group
    return torch.cat([codes, meta.reshape(n, three, -1)], dim=-1)


def dequantize(segment: torch.Tensor, fmt: QuantFormat, hidden: int, dtype: torch.dtype,
               workspace: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """[n, 3, projection_bytes] uint8 -> [n, 3, H] of `dtype` (ŵ computed in float32, then rounded to dtype once).

    `workspace`: float32 memory of at least n·3·H elements to compute in, and `out`: `dtype` memory of as
    many for the result (both reused: no fresh pages per call)."""
    n, three, _ = segment.shape
    size = n * three * hidden
    if fmt.scheme == "hqq":
        w = (torch.empty(size, dtype=torch.float32, device=segment.device) if workspace is None
             else workspace.view(-1)[:size]).view(n, three, hidden)
        w = hqq.dequantize_into(segment, fmt, hidden, w)
        return w if dtype == torch.float32 else w.to(dtype)
    g = fmt.group_size(hidden)
    groups = hidden // g
    code_bytes = hidden * fmt.bits // 8
    meta = segment[..., code_bytes:].contiguous().view(torch.float16).float()  # [n, 3, groups (·2)]
    codes = segment[..., :code_bytes]  # a view: rows of the segment
    w = (torch.empty(size, dtype=torch.float32, device=segment.device) if workspace is None
         else workspace.view(-1)[:size]).view(n, three, groups, g)
    if fmt.bits == 8:
        w.copy_(codes.view(torch.int8).reshape(n, three, groups, g))
        w.mul_(meta[..., None])
    else:
        halves = w.view(n, three, hidden)  # two contiguous halves: cheap to unpack
        halves[..., : hidden // 2].copy_(codes & 0xF)
        halves[..., hidden // 2:].copy_(codes >> 4)
        meta = meta.reshape(n, three, groups, 2)
        w.mul_(meta[..., 0:1]).add_(meta[..., 1:2])
    w = w.view(n, three, hidden)
    if dtype == torch.float32:
        return w
    if out is None:
        return w.to(dtype)
    result = out.view(-1)[:size].view(n, three, hidden)
    result.copy_(w)
    return result


QUANTIZE_ROWS = 128  # neurons quantised at once while loading (bounds the load's transient memory)
DEQUANT_WORKSPACE_BYTES = 64 * MiB  # a quantised forward's dequantisation memory (part of plan.WORKSPACE_BYTES)


def block_rows(hidden: int, dtype: torch.dtype, budget: int = DEQUANT_WORKSPACE_BYTES) -> int:
    """Neurons dequantised at once: a row costs 3·H elements of float32 (ŵ), of `dtype` (the result, unless
    float32) and at most one byte of unpacking temporaries."""
    per_element = 4 + (0 if dtype == torch.float32 else dtype.itemsize) + 1
    return max(1, budget // (3 * hidden * per_element))


class QuantStore(HostStore):
    """Experts stored quantised: rows of (3, projection_bytes) uint8 (see the module docstring)."""

    def __init__(self, shape: ExpertShape, compute_dtype: torch.dtype, pin: bool,
                 activations: str = DEFAULT_ACTIVATIONS) -> None:
        super().__init__(shape, torch.uint8, pin, activations)
        self.format = EXPERT_FORMATS[shape.experts]
        assert self.format is not None, shape.experts
        self.compute_dtype = compute_dtype
        # float32 [I, 3, H] blocks the loader assembles experts in: the codes do not depend on --dtype
        self._blocks: list[torch.Tensor] = []
        # Where a block of a segment is dequantised: float32 ŵ, and the compute dtype's copy ([block_rows·3·H] each).
        self._workspace: tuple[torch.Tensor, torch.Tensor | None] | None = None

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (3, self.format.projection_bytes(self.shape.hidden))

    def torch_forward(self, x: torch.Tensor, segment: torch.Tensor, act) -> torch.Tensor:
        """Dequantise `segment` block by block into the workspace, then torch's matmuls (a GPU; no kernels)."""
        hidden = self.shape.hidden
        rows = block_rows(hidden, x.dtype)
        ws, out = self._workspaces(segment.device, x.dtype, min(rows, segment.shape[0]) * 3 * hidden)
        result = None
        for start in range(0, segment.shape[0], rows):  # Σ over neuron blocks: exact partial sums
            w = dequantize(segment[start:start + rows], self.format, hidden, x.dtype, ws, out)
            part = layout.segment_forward(x, w, act)  # [T, H]
            result = part if result is None else result.add_(part)
        return result

    def torch_top(self, x: torch.Tensor, segment: torch.Tensor, act, lane: int) -> torch.Tensor:
        """A split expert's top: its whole partial output (the blocks' loop has no one-op share to begin)."""
        return self.torch_forward(x, segment, act)

    def torch_bottom(self, x: torch.Tensor, segment: torch.Tensor, act, top: torch.Tensor) -> torch.Tensor:
        """top + bottom, in that order."""
        return top + self.torch_forward(x, segment, act)

    def _workspaces(self, device: torch.device, dtype: torch.dtype, elements: int):
        """The float32 workspace and the compute dtype's (None for float32), grown to `elements` if needed."""
        ws = self._workspace
        if ws is None or ws[0].numel() < elements or ws[0].device != device or (ws[1] is None) != (dtype == torch.float32) \
                or (ws[1] is not None and ws[1].dtype != dtype):
            with torch.inference_mode(False):  # normal tensors: written in and out of inference mode
                self._workspace = ws = (torch.empty(elements, dtype=torch.float32, device=device),
                                        None if dtype == torch.float32 else torch.empty(elements, dtype=dtype,
                                                                                       device=device))
        return ws

    def rows(self, segment: torch.Tensor) -> torch.Tensor:
        return segment  # bytes: read by the kernels, or dequantised block by block in torch_forward

    def dequantized(self, layer: int, expert: int | None = None) -> torch.Tensor:
        """[N, I, 3, H] of the compute dtype: the weights this store computes with (for the reference model);
        [1, I, 3, H] of `expert` alone (one expert's memory, not a layer's: profiling/model.py expert_compute_s)."""
        packed = self.layers[layer] if expert is None else self.layers[layer][expert:expert + 1]
        n, i = packed.shape[:2]
        return dequantize(packed.reshape(n * i, *packed.shape[2:]), self.format, self.shape.hidden,
                          self.compute_dtype).reshape(n, i, 3, self.shape.hidden)

    def block(self, layer: int, expert: int) -> torch.Tensor:
        if self._blocks:
            return self._blocks.pop()
        return torch.empty(self.shape.intermediate, 3, self.shape.hidden, dtype=torch.float32)

    def put(self, layer: int, expert: int, block: torch.Tensor) -> None:
        target = self.layers[layer][expert]
        for start in range(0, block.shape[0], QUANTIZE_ROWS):  # a few rows at a time: small temporaries
            target[start:start + QUANTIZE_ROWS].copy_(quantize(block[start:start + QUANTIZE_ROWS], self.format))
        self._blocks.append(block)

    def end_load(self) -> None:
        """The float32 blocks the loader quantised from go (one expert each: 12 MiB at H = I = 1024, kept for
        the whole run before)."""
        self._blocks.clear()


def make_store(shape: ExpertShape, dtype: torch.dtype, pin: bool, activations: str = DEFAULT_ACTIVATIONS) -> HostStore:
    """The host store for `shape.experts`: unquantised rows of `dtype`, or quantised rows (multiplied on the CPU
    with `activations`: types.ACTIVATIONS)."""
    if EXPERT_FORMATS[shape.experts] is None:
        return HostStore(shape, dtype, pin)
    return QuantStore(shape, dtype, pin, activations)
