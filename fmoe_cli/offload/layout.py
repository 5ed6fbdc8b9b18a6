"""The split expert: neuron-major packing (docs/architecture.md § The split expert).

Every gated expert computes

    E(x) = W_down · ( act(W_gate · x) ⊙ (W_up · x) )

and neuron n contributes W_down[:, n] · act(W_gate[n] · x) · (W_up[n] · x), so E(x)
is a sum over neurons. Packing expert e as an [I, 3, H] block whose row n holds
(gate row n, up row n, down column n) makes the top segment (neurons [0, k)) and
the bottom segment ([k, I)) contiguous for every k: one copy moves a segment, and
the partial results of the two segments sum to E(x).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GATE, UP, DOWN = 0, 1, 2


def pack_experts(experts: nn.Module) -> torch.Tensor:
    """transformers' fused experts ([N, 2I, H] gate_up, [N, H, I] down) -> [N, I, 3, H].

    `models.families.check_experts` has already refused layouts this cannot serve exactly.
    """
    gate_up = experts.gate_up_proj.detach()
    down = experts.down_proj.detach()
    if getattr(experts, "is_transposed", False):  # stored as [N, H, 2I] and [N, I, H]
        gate_up = gate_up.transpose(1, 2)
        down = down.transpose(1, 2)
    intermediate = down.shape[-1]
    # The default _apply_gate splits gate_up as [gate; up] (`chunk(2)`).
    gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
    return torch.stack([gate, up, down.transpose(1, 2)], dim=2).contiguous()


def segment_forward(x: torch.Tensor, segment, act) -> torch.Tensor:
    """Partial expert output of the neurons in `segment` ([n, 3, H], or its `split_rows`) for tokens x ([T, H]).

    Five ops for a segment whose rows were split once (a cached top, a staging slot): every op the host
    dispatches costs it microseconds on a GPU (docs/architecture.md § Host work per token)."""
    rows = segment if isinstance(segment, tuple) else segment.unbind(1)
    gate = F.linear(x, rows[GATE])  # [T, n]
    up = F.linear(x, rows[UP])
    return (act(gate) * up) @ rows[DOWN]  # [T, H]


def split_rows(segment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[n, 3, H] -> (gate [n, H], up [n, H], down [n, H]): views, made once per buffer instead of per forward."""
    return tuple(segment.unbind(1))
