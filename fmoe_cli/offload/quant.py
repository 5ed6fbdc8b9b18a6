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

import math
import threading

import torch

from fmoe_cli.offload import hqq, layout
from fmoe_cli.offload.store import HostStore
from fmoe_cli.types import DEFAULT_ACTIVATIONS, DOWN_GROUP, EXPERT_FORMATS, MiB, ExpertShape, QuantFormat


def quantize(block: torch.Tensor, fmt: QuantFormat, down_by_neuron: bool = False) -> torch.Tensor:
    """[n, 3, H] float -> [n, 3, projection_bytes] uint8. down_by_neuron (ExpertShape.down_by_neuron; n a multiple
    of DOWN_GROUP, the rows starting at a group): the down columns quantised in groups along the neurons."""
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
    rows = torch.cat([codes, meta.reshape(n, three, -1)], dim=-1)
    if down_by_neuron and three == 3:
        rows[:, layout.DOWN] = quantize_down(block[:, layout.DOWN], fmt)
    return rows


def dequantize(segment: torch.Tensor, fmt: QuantFormat, hidden: int, dtype: torch.dtype,
               workspace: torch.Tensor | None = None, out: torch.Tensor | None = None,
               down_by_neuron: bool = False) -> torch.Tensor:
    """[n, 3, projection_bytes] uint8 -> [n, 3, H] of `dtype` (ŵ computed in float32, then rounded to dtype once).

    `workspace`: float32 memory of at least n·3·H elements to compute in, and `out`: `dtype` memory of as
    many for the result (both reused: no fresh pages per call). down_by_neuron: the down rows are quantize_down's
    (whole groups of DOWN_GROUP neurons)."""
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
    if down_by_neuron and three == 3:
        dequantize_down(segment[:, layout.DOWN], fmt, hidden, w[:, layout.DOWN])
    if dtype == torch.float32:
        return w
    if out is None:
        return w.to(dtype)
    result = out.view(-1)[:size].view(n, three, hidden)
    result.copy_(w)
    return result


# ---- the down projection grouped along the neurons (ExpertShape.down_by_neuron) ---------------------------------
#
# A group is DOWN_GROUP = 32 consecutive neurons (a split never cuts one: ExpertShape.neuron_block). Its down weights
# W[h, n] (h < H, n < 32) are stored in its 32 neurons' down projection rows: row p ("piece" p) holds the hidden values
# h ∈ [p·H/32, (p+1)·H/32) of all 32 neurons, so a group's bytes are its rows' and every row has the size it has
# along H. A tile of R = G/32 consecutive h × 32 neurons (G weights, as a group along H) shares its metadata:
#     int8: ŵ = q·s, s = max|w| / 127        int4: ŵ = q·s + m, s = (max − min) / 15, m = min
# so for one h the sum over the group's neurons is s·Σ_n q_n·a_n (+ m·Σ_n a_n): an integer dot when a is quantised
# per group (experts.c § down by neuron). Piece p: its codes, then its H/G tiles' metadata (float16 s, or (s, m)).
# Codes of the piece's hp = H/32 hidden values, in blocks of W = gcd(16, hp) of them (16 lanes of int32): for block b,
# neuron quad k (neurons 4k..4k+3), hidden value i of the block, neuron j of the quad,
#     int8: byte ((b·8 + k)·W + i)·4 + j                      (neuron 4k + j)
#     int4: byte ((b·4 + k)·W + i)·4 + j, low nibble neuron 4k + j, high nibble neuron 16 + 4k + j
# so one 4-byte lane is four neurons of one h: the operand of one vpdpbusd lane.


def _down_blocks(hidden: int) -> tuple[int, int]:
    """(hp, W): hidden values a piece holds, and a code block's width."""
    hp = hidden // DOWN_GROUP
    return hp, math.gcd(16, hp)


def quantize_down(down: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Down columns [n, H] float (n a multiple of DOWN_GROUP) -> their down projection rows [n, projection_bytes]."""
    n, hidden = down.shape
    groups, tile = n // DOWN_GROUP, fmt.group_size(hidden) // DOWN_GROUP  # R = G/32 hidden values a tile
    hp, width = _down_blocks(hidden)
    w = down.float().reshape(groups, DOWN_GROUP, DOWN_GROUP, hp).permute(0, 2, 3, 1)  # [groups, piece, hp, neuron]
    tiles = w.reshape(groups, DOWN_GROUP, hp // tile, tile * DOWN_GROUP)
    if fmt.bits == 8:
        scale = (tiles.abs().amax(-1) / 127).clamp(min=1e-8).half()  # [groups, piece, hp/R]
        q = torch.round(tiles / scale.float()[..., None]).clamp(-127, 127).to(torch.int8).view(torch.uint8)
        q = q.reshape(groups, DOWN_GROUP, hp // width, width, 8, 4).permute(0, 1, 2, 4, 3, 5)
        codes, meta = q.reshape(groups, DOWN_GROUP, -1), scale.view(torch.uint8)
    else:
        low, high = tiles.amin(-1), tiles.amax(-1)
        scale, offset = ((high - low) / 15).clamp(min=1e-8).half(), low.half()
        q = torch.round((tiles - offset.float()[..., None]) / scale.float()[..., None]).clamp(0, 15).to(torch.uint8)
        q = q.reshape(groups, DOWN_GROUP, hp // width, width, 2, 4, 4).permute(0, 1, 2, 5, 3, 6, 4)
        codes = q[..., 0] | (q[..., 1] << 4)
        codes = codes.reshape(groups, DOWN_GROUP, -1)
        meta = torch.stack([scale, offset], dim=-1).view(torch.uint8)
    return torch.cat([codes, meta.reshape(groups, DOWN_GROUP, -1)], dim=-1).reshape(n, -1)


def dequantize_down(rows: torch.Tensor, fmt: QuantFormat, hidden: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Down projection rows [n, projection_bytes] (quantize_down's) -> the down columns ŵ [n, H] float32, written
    into `out` (any [n, H] float32 view with unit stride along H: a workspace's down rows) through views: no float
    temporaries."""
    n = rows.shape[0]
    groups, tile = n // DOWN_GROUP, fmt.group_size(hidden) // DOWN_GROUP
    hp, width = _down_blocks(hidden)
    code_bytes = hidden * fmt.bits // 8
    if out is None:
        out = torch.empty(n, hidden, dtype=torch.float32, device=rows.device)
    pieces = rows.reshape(groups, DOWN_GROUP, -1)
    meta = pieces[..., code_bytes:].contiguous().view(torch.float16).float()  # [groups, piece, hp/R (·2)]
    codes = pieces[..., :code_bytes]
    target = out.view(groups, DOWN_GROUP, DOWN_GROUP, hp).permute(0, 2, 3, 1)  # [groups, piece, hp, neuron]
    blocks = target.view(groups, DOWN_GROUP, hp // width, width, 8, 4).permute(0, 1, 2, 4, 3, 5)  # the codes' order
    if fmt.bits == 8:
        blocks.copy_(codes.view(torch.int8).reshape(groups, DOWN_GROUP, hp // width, 8, width, 4))
        target.view(groups, DOWN_GROUP, hp // tile, tile, DOWN_GROUP).mul_(meta[..., None, None])
    else:
        nibbles = codes.reshape(groups, DOWN_GROUP, hp // width, 4, width, 4)
        halves = target.view(groups, DOWN_GROUP, hp // width, width, 2, 4, 4)  # neuron = 16·nibble + 4k + j
        halves[:, :, :, :, 0].permute(0, 1, 2, 4, 3, 5).copy_(nibbles & 0xF)
        halves[:, :, :, :, 1].permute(0, 1, 2, 4, 3, 5).copy_(nibbles >> 4)
        meta = meta.reshape(groups, DOWN_GROUP, hp // tile, 1, 1, 2)
        tiles = target.view(groups, DOWN_GROUP, hp // tile, tile, DOWN_GROUP)
        tiles.mul_(meta[..., 0]).add_(meta[..., 1])
    return out


QUANTIZE_ROWS = 128  # neurons quantised at once while loading (bounds the load's transient memory)
DEQUANT_WORKSPACE_BYTES = 64 * MiB  # a quantised forward's dequantisation memory (part of plan.WORKSPACE_BYTES)


def block_rows(hidden: int, dtype: torch.dtype, budget: int = DEQUANT_WORKSPACE_BYTES, down_group: int = 1) -> int:
    """Neurons dequantised at once: a row costs 3·H elements of float32 (ŵ), of `dtype` (the result, unless
    float32) and at most one byte of unpacking temporaries; whole down groups (`down_group` neurons) at least."""
    per_element = 4 + (0 if dtype == torch.float32 else dtype.itemsize) + 1
    rows = max(1, budget // (3 * hidden * per_element))
    return max(down_group, rows // down_group * down_group)


class QuantStore(HostStore):
    """Experts stored quantised: rows of (3, projection_bytes) uint8 (see the module docstring)."""

    def __init__(self, shape: ExpertShape, compute_dtype: torch.dtype, pin: bool,
                 activations: str = DEFAULT_ACTIVATIONS) -> None:
        super().__init__(shape, torch.uint8, pin, activations)
        self.format = EXPERT_FORMATS[shape.experts]
        assert self.format is not None, shape.experts
        self.compute_dtype = compute_dtype
        self.down_group = DOWN_GROUP if shape.down_by_neuron else 1  # neurons that dequantise together
        # float32 [I, 3, H] blocks the loader assembles experts in: the codes do not depend on --dtype
        self._blocks: list[torch.Tensor] = []
        # Where a block of a segment is dequantised: float32 ŵ, and the compute dtype's copy ([block_rows·3·H] each).
        self._workspace: dict = {}  # (device, dtype, thread) -> (float32 workspace, the compute dtype's or None)

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (3, self.format.projection_bytes(self.shape.hidden))

    def torch_forward(self, x: torch.Tensor, segment: torch.Tensor, act) -> torch.Tensor:
        """Dequantise `segment` block by block into the workspace, then torch's matmuls (a GPU; no kernels)."""
        hidden = self.shape.hidden
        rows = block_rows(hidden, x.dtype, down_group=self.down_group)
        ws, out = self._workspaces(segment.device, x.dtype, min(rows, segment.shape[0]) * 3 * hidden)
        result = None
        for start in range(0, segment.shape[0], rows):  # Σ over neuron blocks: exact partial sums
            w = dequantize(segment[start:start + rows], self.format, hidden, x.dtype, ws, out, self.shape.down_by_neuron)
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
        """The float32 workspace and the compute dtype's (None for float32), grown to `elements` if needed: one per
        device, dtype and thread (the host lane's workers dequantise at once, beside the device's own calls)."""
        key = (device, dtype, threading.get_ident())
        ws = self._workspace.get(key)
        if ws is None or ws[0].numel() < elements:
            with torch.inference_mode(False):  # normal tensors: written in and out of inference mode
                ws = self._workspace[key] = (torch.empty(elements, dtype=torch.float32, device=device),
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
                          self.compute_dtype, down_by_neuron=self.shape.down_by_neuron).reshape(n, i, 3, self.shape.hidden)

    def block(self, layer: int, expert: int) -> torch.Tensor:
        if self._blocks:
            return self._blocks.pop()
        return torch.empty(self.shape.intermediate, 3, self.shape.hidden, dtype=torch.float32)

    def put(self, layer: int, expert: int, block: torch.Tensor) -> None:
        target = self.layers[layer][expert]
        for start in range(0, block.shape[0], QUANTIZE_ROWS):  # a few rows at a time: small temporaries
            target[start:start + QUANTIZE_ROWS].copy_(quantize(block[start:start + QUANTIZE_ROWS], self.format,
                                                               self.shape.down_by_neuron))
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
