"""The host store: every routed expert, packed, in host RAM (pinned when a GPU will read it)."""

from __future__ import annotations

import torch


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
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)
