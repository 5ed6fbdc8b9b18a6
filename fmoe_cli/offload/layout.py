"""The split expert: neuron-major packing (docs/architecture.md § The split expert).

Every gated expert computes

    E(x) = W_down · ( act(W_gate · x) ⊙ (W_up · x) )

and neuron n contributes W_down[:, n] · act(W_gate[n] · x) · (W_up[n] · x), so E(x)
is a sum over neurons. Packing expert e as an [I, 3, H] block whose row n holds
(gate row n, up row n, down column n) makes the top segment (neurons [0, k)) and
the bottom segment ([k, I)) contiguous for every k: one copy moves a segment, and
the partial results of the two segments sum to E(x).

torch's path (a GPU; a CPU without the expert kernels) reads a segment [n, 3, H] through
two views made once per buffer (`Rows`): its gate and up rows as one [2, H, n] batched
matrix, so one matmul gives both (x · W_gateᵀ, x · W_upᵀ), and its down columns [n, H].
Every op the host dispatches costs it microseconds on a GPU (docs/architecture.md § Host
work per token): a whole segment is 6 ops (4 kernel launches; a decode token's 5, into a `GateUp` workspace), a
split expert 7 (6 launches), and a decode step's n ≥ 3 whole experts of one buffer 11 together on a GPU (torch's
grouped matmul, `grouped_forward`; 9 on the CPU), whatever n: a layer's cache (every expert when resident), and on
the device path the staging pool's slots its loads landed in (offload/pool.py `stacked_rows`), so a layer of
Qwen3-30B-A3B (K = 8) that loads every expert it routes computes them in 11 ops, not 40. A decode step's n ≥ 3 split
experts there are 15 ops and 2 each on the CPU (`grouped_tops`, `grouped_bottoms`; on a GPU 19 and, in bf16, 4 each:
the down projections summed in float32), not 7 each. The matmuls are torch's kernels called directly (`gate_up_mm`, torch.mm), not through
torch.matmul, which decides on them in a dozen more host steps each.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.modules import module as _module

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


class Stack(NamedTuple):
    """A buffer of same-sized segments [C, n, 3, H] (a layer's cached tops; every expert when resident) as
    torch's grouped matmul reads it: views made once."""

    gate: torch.Tensor  # [C, H, n]
    up: torch.Tensor  # [C, H, n]
    down: torch.Tensor  # [C, n, H]


class Rows(NamedTuple):
    """A segment [n, 3, H] as torch's path reads it: views of its rows, made once per buffer."""

    gate_up: torch.Tensor  # [2, H, n]: W_gateᵀ and W_upᵀ (strides H, 1, 3H: no copy)
    down: torch.Tensor  # [n, H]: W_downᵀ
    stack: Stack | None = None  # the buffer it is one slot of, if any (`grouped_forward`)
    slot: int = 0


def hooked(module) -> bool:
    """Whether calling `module` would run a forward hook (its own or a global one) around its forward."""
    return bool(module._forward_hooks or module._forward_pre_hooks or _module._global_forward_hooks
                or _module._global_forward_pre_hooks)


def called(act):
    """What calling the activation `act` runs: an nn.Module's forward without nn.Module's per-call steps (hooks,
    tracing: 2–3 µs a call, one call a segment) where no hook would run (models/dense.py `forward_of`); else `act`."""
    return act.forward if isinstance(act, nn.Module) and not hooked(act) else act


def split_rows(segment: torch.Tensor) -> Rows:
    """[n, 3, H] -> Rows (views), made once per buffer (a cached top, a staging slot) instead of per forward."""
    return Rows(segment[:, :DOWN].permute(1, 2, 0), segment[:, DOWN])


def stack_rows(buffer: torch.Tensor) -> list[Rows]:
    """[C, n, 3, H] -> each slot's Rows, all of them knowing their Stack (views, made once per buffer)."""
    stack = Stack(buffer[:, :, GATE].transpose(1, 2), buffer[:, :, UP].transpose(1, 2), buffer[:, :, DOWN])
    return [split_rows(segment)._replace(stack=stack, slot=slot) for slot, segment in enumerate(buffer.unbind(0))]


def segment_forward(x: torch.Tensor, segment, act, workspace: GateUp | None = None,
                    pair: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Partial expert output of the neurons in `segment` ([n, 3, H], or its `Rows`) for tokens x ([T, H]).

    Six ops on Rows: x's broadcast (a view) and one batched matmul for gate and up (`gate_up_mm`), the split into
    both (a view), the activation, the product and the down matmul; five into a `workspace` of x's tokens and the
    segment's neurons (the matmul writes its views: no split; the same kernel, the same bits); four with x's
    broadcast given (`pair`: made once for several segments). `out`: where the down matmul writes ([T, H], a row of
    several segments' outputs: store.py `_torch_decode`)."""
    rows = segment if isinstance(segment, Rows) else split_rows(segment)
    if workspace is None:
        gate, up = gate_up_mm(x, rows.gate_up, pair=pair).unbind(0)  # [2, T, n] -> [T, n] each
    else:
        gate_up_mm(x, rows.gate_up, out=workspace.both, pair=pair)
        gate, up = workspace.gate, workspace.up
    hidden = called(act)(gate) * up
    return torch.mm(hidden, rows.down) if out is None else torch.mm(hidden, rows.down, out=out)  # [T, H]


def gate_up_mm(x: torch.Tensor, gate_up: torch.Tensor, out: torch.Tensor | None = None,
               pair: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] · gate_up [2, H, n] -> [2, T, n] (into `out`): the one batched matmul (bmm of x broadcast over gate
    and up: `pair`, made here unless given) that torch.matmul(x, gate_up) calls, called directly. matmul decides it
    in 12 more aten calls first (mT, transpose, expand ×2, reshape ×3, their as_strided: 17 calls against 5 into a
    decode workspace, issue 37 §2), which a TorchDispatchMode does not see; the same kernel on the same operands, so
    the same bits (tests/test_layout.py)."""
    if pair is None:
        pair = x.expand(2, *x.shape)  # [2, T, H], stride 0 over gate and up: matmul's own broadcast
    return torch.bmm(pair, gate_up) if out is None else torch.bmm(pair, gate_up, out=out)


class GateUp(NamedTuple):
    """Where a whole segment's gate and up land ([2, T, n]) and its views, made once (a decode step's: store.py)."""

    both: torch.Tensor  # [2, T, n]
    gate: torch.Tensor  # [T, n]
    up: torch.Tensor  # [T, n]

    @classmethod
    def make(cls, tokens: int, neurons: int, dtype: torch.dtype, device: torch.device) -> GateUp:
        with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode
            both = torch.empty(2, tokens, neurons, dtype=dtype, device=device)
        return cls(both, *both.unbind(0))


def grouped_mm(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """torch's grouped matmul: rows [offsets[g-1], offsets[g]) of x ([S, D]) times weights[g] ([G, D, N])."""
    grouped = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return grouped(x, weights, offs=offsets)


def group_ends(stack: Stack, slots: list[int], device: torch.device) -> torch.Tensor:
    """The offsets of a group that gives each listed slot of `stack` one row (ascending `slots`) and the others
    none: [C] int32, each slot's last row + 1, on `device` (1 op; 3 on a GPU, the pinned copy)."""
    counts = [0] * stack.down.shape[0]
    for slot in slots:
        counts[slot] = 1
    ends = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32)
    if device.type != "cpu":  # pinned: the copy does not wait for the compute stream
        ends = ends.pin_memory().to(device, non_blocking=True)
    return ends


def grouped_hidden(xs: torch.Tensor, stack: Stack, ends: torch.Tensor, act) -> torch.Tensor:
    """h = act(x · W_gateᵀ) ⊙ (x · W_upᵀ) of a group's slots, rows xs [n, H] -> [n, neurons] (4 ops: one grouped
    matmul each for gate and up, the activation, the product)."""
    return called(act)(grouped_mm(xs, stack.gate, ends)) * grouped_mm(xs, stack.up, ends)


def grouped_forward(x: torch.Tensor, segments: list[Rows], act) -> list[torch.Tensor]:
    """Whole segments of one Stack for one token x ([1, H]), in 9 ops whatever their number (11 on a GPU, the
    offsets' copy): one grouped matmul each for gate, up and down over the stack's slots in order, the
    activated ones given the token's row and the others none (each slot's rows the same products as
    `segment_forward`'s, to float rounding)."""
    stack = segments[0].stack
    slots = sorted(s.slot for s in segments)
    ends = group_ends(stack, slots, x.device)
    xs = x.repeat(len(slots), 1)  # [K, H]: the token once per activated slot
    h = grouped_hidden(xs, stack, ends, act)  # [K, n]
    rows = grouped_mm(h, stack.down, ends).split(1)  # [1, H] each, by slot
    return [rows[slots.index(s.slot)] for s in segments]


class GroupedTop(NamedTuple):
    """A split expert's top computed with the other tops of its layer (`grouped_tops`) while its bottom loads: its
    whole share, h and the partial down projection."""

    partial: torch.Tensor  # [1, H]: h_top · W_down,top (float32 for bf16 / fp16: `split_sum` rounds once)
    xs: torch.Tensor  # [n, H]: the token once per top of its group (the bottoms' grouped matmul reads it)


def grouped_tops(x: torch.Tensor, tops: list[Rows], act) -> list[GroupedTop]:
    """Split experts' tops of one Stack (a layer's cached tops) for one token x ([1, H]), begun while their bottoms
    load: gate and up by one grouped matmul each, one activation and one product for all of them, then each top's
    partial down projection (`top_down`): 8 ops and one a top (10 on a GPU). Unlike `top_forward` the whole top is
    done before the bottom arrives; the bottom's neurons get the same activation and product (elementwise: the same
    bits as over all I neurons at once)."""
    stack = tops[0].stack
    slots = sorted(t.slot for t in tops)
    xs = x.repeat(len(slots), 1)
    hidden = grouped_hidden(xs, stack, group_ends(stack, slots, x.device), act).split(1)  # [1, k] each, by slot
    return [GroupedTop(top_down(hidden[slots.index(t.slot)], t.down, x.dtype), xs) for t in tops]


def grouped_bottoms(x: torch.Tensor, bottoms: list[Rows], act, tops: list[GroupedTop]) -> list[torch.Tensor]:
    """The split experts' outputs [1, H] once their bottoms (Rows of one Stack: the staging pool's rows [k, I) of the
    slots they loaded into) are here, each continuing its top (`tops`, in the same order): h of every bottom by one
    grouped matmul each for gate and up, one activation and one product, then each one's down projection added to
    its top's (`split_sum`): 7 ops and one a bottom (9 on a GPU; bf16: three a bottom)."""
    stack = bottoms[0].stack
    slots = sorted(b.slot for b in bottoms)
    xs = tops[0].xs if tops[0].xs.shape[0] == len(slots) else x.repeat(len(slots), 1)
    hidden = grouped_hidden(xs, stack, group_ends(stack, slots, x.device), act).split(1)  # [1, I - k] each, by slot
    return [split_sum(top.partial, hidden[slots.index(b.slot)], b.down, x.dtype) for b, top in zip(bottoms, tops)]


def bottom_alone(x: torch.Tensor, bottom: Rows, act, top: GroupedTop) -> torch.Tensor:
    """`grouped_bottoms` of one bottom (where the bottoms are not computed together): its h, then `split_sum`."""
    gate, up = gate_up_mm(x, bottom.gate_up).unbind(0)
    return split_sum(top.partial, called(act)(gate) * up, bottom.down, x.dtype)


@dataclass(frozen=True)
class SplitWorkspace:
    """Where a split expert's gate and up land: one [2, T, I] buffer, the top's neurons [0, k) beside the
    bottom's [k, I), so that one activation and one product serve both. Views made once."""

    top: torch.Tensor  # [2, T, k]: the top's gate and up
    bottom: torch.Tensor  # [2, T, I - k]: the bottom's
    gate: torch.Tensor  # [T, I]; after `bottom_forward`, h = act(gate) ⊙ up
    up: torch.Tensor  # [T, I]
    top_hidden: torch.Tensor  # [T, k] of h
    bottom_hidden: torch.Tensor  # [T, I - k] of h

    @classmethod
    def make(cls, tokens: int, top_neurons: int, neurons: int, dtype: torch.dtype,
             device: torch.device) -> SplitWorkspace:
        with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode
            buffer = torch.empty(2, tokens, neurons, dtype=dtype, device=device)
        gate, up = buffer.unbind(0)
        k = top_neurons
        return cls(buffer[..., :k], buffer[..., k:], gate, up, gate[:, :k], gate[:, k:])


class Top(NamedTuple):
    """A split expert's top segment, begun while its bottom loads: its gate and up in the workspace."""

    workspace: SplitWorkspace
    down: torch.Tensor  # the top's down columns [k, H]
    pair: torch.Tensor  # x broadcast over gate and up [2, T, H] (gate_up_mm), the bottom's too


def top_forward(x: torch.Tensor, top: Rows, workspace: SplitWorkspace, pair: torch.Tensor | None = None) -> Top:
    """The top's share of a split expert that needs no bottom yet: gate and up ([2, T, k]), one batched matmul
    (and x's broadcast view, which the bottom reuses; `pair`: that view made before, for several tops)."""
    if pair is None:
        pair = x.expand(2, *x.shape)
    gate_up_mm(x, top.gate_up, out=workspace.top, pair=pair)
    return Top(workspace, top.down, pair)


def bottom_forward(x: torch.Tensor, bottom, act, top: Top) -> torch.Tensor:
    """The split expert's output [T, H] once its bottom ([I - k, 3, H], or its Rows) is here, in five ops:
    the bottom's gate and up beside the top's, act(gate) ⊙ up over all I neurons at once (h), then the
    down projection, top first and the bottom added in the same matmul (addmm: top + h_bottom · W_down):
    the top + bottom order of every split result, equal to the whole expert's output to float rounding.
    On a GPU the top's activation and down projection thus wait for the bottom's load (the top's gate and
    up, two thirds of its work, do not): the price of one op for both instead of two each."""
    rows = bottom if isinstance(bottom, Rows) else split_rows(bottom)
    ws = top.workspace
    gate_up_mm(x, rows.gate_up, out=ws.bottom, pair=top.pair)  # [2, T, I - k]
    torch.mul(called(act)(ws.gate), ws.up, out=ws.gate)  # h [T, I]
    return split_sum(top_down(ws.top_hidden, top.down, x.dtype), ws.bottom_hidden, rows.down, x.dtype)  # [T, H]


def top_down(top_hidden: torch.Tensor, down: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A split expert's top partial down projection h_top · W_down,top: in float32 for bf16 / fp16 (`split_sum`)."""
    return torch.mm(top_hidden, down) if dtype == torch.float32 else matmul_f32(top_hidden, down)


def split_sum(top_partial: torch.Tensor, bottom_hidden: torch.Tensor, down: torch.Tensor,
              dtype: torch.dtype) -> torch.Tensor:
    """top + h_bottom · W_down,bottom, the split expert's output: float32 in one addmm; bf16 / fp16 the two partial
    down projections summed in float32 and rounded once, as the whole expert's one matmul (float32 accumulation)
    rounds once; the top's partial rounded to bf16 first would be a second rounding (27-30 % of the outputs off by
    an ulp in tests/test_engine.py's check, and other greedy tokens on a GPU: mixtral `uniform` in bf16 departed at
    token 12 on the first H200 run)."""
    if dtype == torch.float32:
        return torch.addmm(top_partial, bottom_hidden, down)
    return (top_partial + matmul_f32(bottom_hidden, down)).to(dtype)


def matmul_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (bf16 or fp16) accumulated and returned in float32, not rounded to a's dtype: on CUDA torch's mm with
    out_dtype where this torch has it, else the operands widened first."""
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            pass
    return a.float() @ b.float()


def routed_forward(x: torch.Tensor, stack: Stack, slots: torch.Tensor, act) -> torch.Tensor:
    """A decode token's experts, whole segments of one Stack, chosen on the device: x [1, H], `slots` [K] (on x's
    device, the routing's experts' slots in routing order) -> their outputs [K, H] in routing order. grouped_forward's
    9 ops and 5 more to build the groups and put the rows back in routing order, none of which reads a value on the
    host: no wait for the GPU, and the same launches whatever the routing (a CUDA graph can replay them)."""
    k = slots.shape[0]
    order = torch.argsort(slots)  # [K]: grouped_mm's groups go in slot order
    counts = torch.zeros(stack.down.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, slots, torch.ones(k, dtype=torch.int32, device=x.device))  # [C]: 1 per routed slot
    ends = counts.cumsum(0, dtype=torch.int32)  # [C]: each slot's last row + 1
    xs = x.repeat(k, 1)  # [K, H]: the token once per routed slot
    h = grouped_hidden(xs, stack, ends, act)  # [K, n], by slot
    rows = grouped_mm(h, stack.down, ends)  # [K, H], by slot
    return torch.empty_like(rows).index_copy_(0, order, rows)  # row order[j] of the output is the j-th by slot
