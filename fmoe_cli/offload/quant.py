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
contiguous segment with its scales, and a segment computes alone:

    segment_forward(x, seg) = layout.segment_forward(x, dequantize(seg), act)

dequantising on the device (the fused int8/int4 matmuls torch ships take per-output-
channel scales or their own tiled layouts, neither of which splits by neuron: see
docs/quantization.md for the measurement).

Exactness contract: the engine's tokens equal transformers' generate on the same
checkpoint with its experts replaced by `dequantize` of the stored rows.
"""

from __future__ import annotations

import torch

from fmoe_cli.offload import hqq, layout
from fmoe_cli.offload.store import HostStore
from fmoe_cli.types import EXPERT_FORMATS, ExpertShape, QuantFormat


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
               workspace: torch.Tensor | None = None) -> torch.Tensor:
    """[n, 3, projection_bytes] uint8 -> [n, 3, H] of `dtype` (ŵ computed in float32, then rounded to dtype once).

    `workspace`: float32 memory of at least n·3·H elements to compute in (reused: no fresh pages per call)."""
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
    return w if dtype == torch.float32 else w.to(dtype)


QUANTIZE_ROWS = 128  # neurons quantised at once while loading (bounds the load's transient memory)


class QuantStore(HostStore):
    """Experts stored quantised: rows of (3, projection_bytes) uint8 (see the module docstring)."""

    def __init__(self, shape: ExpertShape, compute_dtype: torch.dtype, pin: bool) -> None:
        super().__init__(shape, torch.uint8, pin)
        self.format = EXPERT_FORMATS[shape.experts]
        assert self.format is not None, shape.experts
        self.compute_dtype = compute_dtype
        # float32 [I, 3, H] blocks the loader assembles experts in: the codes do not depend on --dtype
        self._blocks: list[torch.Tensor] = []
        self._workspace: torch.Tensor | None = None  # float32 [I·3·H] where segments are dequantised (one at a time)

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (3, self.format.projection_bytes(self.shape.hidden))

    def segment_forward(self, x: torch.Tensor, segment: torch.Tensor, act) -> torch.Tensor:
        n = segment.shape[0] * 3 * self.shape.hidden
        if self._workspace is None or self._workspace.numel() < n or self._workspace.device != segment.device:
            with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode
                self._workspace = torch.empty(self.shape.intermediate * 3 * self.shape.hidden, dtype=torch.float32,
                                              device=segment.device)
        w = dequantize(segment, self.format, self.shape.hidden, x.dtype, self._workspace)
        return layout.segment_forward(x, w, act)

    def dequantized(self, layer: int) -> torch.Tensor:
        """[N, I, 3, H] of the compute dtype: the weights this store computes with (for the reference model)."""
        packed = self.layers[layer]
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


def make_store(shape: ExpertShape, dtype: torch.dtype, pin: bool) -> HostStore:
    """The host store for `shape.experts`: unquantised rows of `dtype`, or quantised rows."""
    return HostStore(shape, dtype, pin) if EXPERT_FORMATS[shape.experts] is None else QuantStore(shape, dtype, pin)
