"""int8 / int4 experts: weight-only, group-wise along the hidden dimension, neuron-major.

Neuron n of an expert is the row (gate row n, up row n, down column n), three vectors
of length H (offload/layout.py). Each is quantised in groups of G consecutive weights
along H:

    int8 (symmetric):   s = max|w| / 127,            q = round(w / s) ∈ [-127, 127],  ŵ = q·s
    int4 (min / max):   s = (max w − min w) / 15,    q = round((w − m) / s) ∈ [0, 15], ŵ = q·s + m,  m = min w

(s and m in float16, rounded before q is computed). A stored neuron row is, for each
of the three projections, its H codes (int4: two per byte, low nibble first) followed
by its H/G groups of metadata: `row_shape` = (3, projection_bytes) bytes. Every
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

from fmoe_cli.offload import layout
from fmoe_cli.offload.store import HostStore
from fmoe_cli.types import EXPERT_FORMATS, ExpertShape, QuantFormat


def quantize(block: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """[n, 3, H] float -> [n, 3, projection_bytes] uint8."""
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
        q = q.reshape(n, three, hidden // 2, 2)
        codes = q[..., 0] | (q[..., 1] << 4)  # two codes a byte, low nibble first
        meta = torch.stack([scale, offset], dim=-1).view(torch.uint8).reshape(n, three, -1)  # (s, m) per group
    return torch.cat([codes, meta.reshape(n, three, -1)], dim=-1)


def dequantize(segment: torch.Tensor, fmt: QuantFormat, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, 3, projection_bytes] uint8 -> [n, 3, H] of `dtype` (ŵ computed in float32, then rounded to dtype once)."""
    n, three, _ = segment.shape
    g = fmt.group_size(hidden)
    groups = hidden // g
    code_bytes = hidden * fmt.bits // 8
    meta = segment[..., code_bytes:].contiguous().view(torch.float16).float()  # [n, 3, groups (·2)]
    codes = segment[..., :code_bytes]
    if fmt.bits == 8:
        q = codes.contiguous().view(torch.int8).float().reshape(n, three, groups, g)
        w = q * meta[..., None]
    else:
        q = torch.stack([codes & 0xF, codes >> 4], dim=-1).float().reshape(n, three, groups, g)
        meta = meta.reshape(n, three, groups, 2)
        w = q * meta[..., 0:1] + meta[..., 1:2]
    return w.reshape(n, three, hidden).to(dtype)


class QuantStore(HostStore):
    """Experts stored quantised: rows of (3, projection_bytes) uint8 (see the module docstring)."""

    def __init__(self, shape: ExpertShape, compute_dtype: torch.dtype, pin: bool) -> None:
        super().__init__(shape, torch.uint8, pin)
        self.format = EXPERT_FORMATS[shape.experts]
        assert self.format is not None, shape.experts
        self.compute_dtype = compute_dtype
        # float32 [I, 3, H] blocks the loader assembles experts in: the codes do not depend on --dtype
        self._blocks: list[torch.Tensor] = []

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (3, self.format.projection_bytes(self.shape.hidden))

    def segment_forward(self, x: torch.Tensor, segment: torch.Tensor, act) -> torch.Tensor:
        return layout.segment_forward(x, dequantize(segment, self.format, self.shape.hidden, x.dtype), act)

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
        self.layers[layer][expert].copy_(quantize(block, self.format))
        self._blocks.append(block)


def make_store(shape: ExpertShape, dtype: torch.dtype, pin: bool) -> HostStore:
    """The host store for `shape.experts`: unquantised rows of `dtype`, or int8/int4 rows."""
    return HostStore(shape, dtype, pin) if EXPERT_FORMATS[shape.experts] is None else QuantStore(shape, dtype, pin)
