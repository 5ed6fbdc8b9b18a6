"""The host store: every routed expert, packed, in host RAM (pinned when a GPU will read it).

The engine's interface to it (shared with the quantized stores):
- `row_shape`: the shape of one neuron's row (bf16/fp32: (3, H), offload/layout.py);
- `dtype`: the storage dtype of rows; the engine allocates its staging slots and cached
  tops as [n, neurons, *row_shape] of `dtype` and copies rows byte for byte;
- `segment_forward(x, segment, act)`: the partial expert output of a segment of rows;
- `expert(layer, e)`: one expert's rows [I, *row_shape] (a view: segments are slices of it).
"""

from __future__ import annotations

import torch

from fmoe_cli.offload import layout


class HostStore:
    """One [N, I, 3, H] tensor per MoE layer."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.layers: list[torch.Tensor] = []

    def add_layer(self, packed: torch.Tensor) -> None:
        self.layers.append(packed.pin_memory() if self.pin else packed)

    def expert(self, layer: int, expert: int) -> torch.Tensor:
        return self.layers[layer][expert]

    @property
    def row_shape(self) -> tuple[int, ...]:
        return tuple(self.layers[0].shape[2:])

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    def segment_forward(self, x: torch.Tensor, segment: torch.Tensor, act) -> torch.Tensor:
        return layout.segment_forward(x, segment, act)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)
