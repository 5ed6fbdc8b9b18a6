"""Issue 37 §2: a decode token's whole segment on torch's path writes its gate and up into a workspace made once
(layout.GateUp, store.torch_forward) and calls its activation's forward without nn.Module's per-call steps
(layout.called): the same bits as the plain forward, every output its own tensor, and the plain path where a
workspace cannot serve (several tokens, a forward under autograd) or a hook must run."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN

from fmoe_cli.offload import layout
from fmoe_cli.offload.store import HostStore
from fmoe_cli.types import ExpertShape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_segment_in_its_workspace_is_the_plain_forward_bit_for_bit(dtype):
    torch.manual_seed(0)
    hidden, neurons = 64, 96
    store = HostStore(ExpertShape(1, 4, 2, hidden, neurons, 4), dtype, pin=False)
    act = ACT2FN["silu"]  # a module, as the experts' act_fn
    segments = [layout.split_rows((torch.randn(neurons, 3, hidden) * 0.05).to(dtype)) for _ in range(3)]
    xs = [torch.randn(1, hidden).to(dtype) for _ in range(3)]
    outs = [store.torch_forward(x, rows, act) for x, rows in zip(xs, segments)]
    assert len(store._gate_up) == 1  # one workspace, made once, for every segment of that size
    for x, rows, out in zip(xs, segments, outs):  # each output still its own (a later segment overwrote nothing)
        assert out.dtype == dtype and torch.equal(out, layout.segment_forward(x, rows, act))
    several = torch.randn(5, hidden).to(dtype)  # a prefill's tokens: the plain path
    assert torch.equal(store.torch_forward(several, segments[0], act), layout.segment_forward(several, segments[0], act))
    with torch.enable_grad():  # autograd refuses out=: the plain path, the same values
        x = xs[0].clone().requires_grad_(True)
        assert torch.equal(store.torch_forward(x, segments[0], act).detach(), outs[0])


def test_the_activation_skips_the_module_call_only_where_no_hook_would_run():
    act = ACT2FN["silu"]
    assert layout.called(act) == act.forward and layout.called(torch.nn.functional.silu) is torch.nn.functional.silu
    seen = []
    handle = act.register_forward_hook(lambda module, args, out: seen.append(1))
    try:
        assert layout.called(act) is act  # a hook: the module's call, which runs it
        layout.segment_forward(torch.randn(1, 8), torch.randn(4, 3, 8), act)
        assert seen == [1]
    finally:
        handle.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5])
def test_the_direct_batched_matmul_is_torch_matmuls_bit_for_bit(dtype, tokens):
    """layout.gate_up_mm calls the bmm torch.matmul(x, gate_up) decides on (issue 37 §2: 19 dispatched steps fewer):
    the same bits, into a fresh tensor and into a workspace's strided view, for a segment's rows anywhere in an
    expert (a top, a bottom: views with their own offsets)."""
    torch.manual_seed(1)
    hidden, neurons, top = 64, 96, 40
    act = ACT2FN["silu"]
    expert = (torch.randn(neurons, 3, hidden) * 0.05).to(dtype)
    x = torch.randn(tokens, hidden).to(dtype)
    for rows in (layout.split_rows(expert), layout.split_rows(expert[:top]), layout.split_rows(expert[top:])):
        n = rows.down.shape[0]
        expected = torch.matmul(x, rows.gate_up)  # what the layout called before
        assert torch.equal(layout.gate_up_mm(x, rows.gate_up), expected)
        workspace = torch.full((2, tokens, neurons + 7), float("nan"), dtype=dtype)[..., 3:3 + n]  # strided, like
        layout.gate_up_mm(x, rows.gate_up, out=workspace)  # SplitWorkspace's top and bottom
        assert torch.equal(workspace, expected)
        gate, up = expected.unbind(0)
        assert torch.equal(layout.segment_forward(x, rows, act), (act(gate) * up) @ rows.down)
    # a split expert's two parts, as the layout called them before
    ws = layout.SplitWorkspace.make(tokens, top, neurons, dtype, torch.device("cpu"))
    head, tail = layout.split_rows(expert[:top]), layout.split_rows(expert[top:])
    out = layout.bottom_forward(x, tail, act, layout.top_forward(x, head, ws))
    h = act(torch.cat([torch.matmul(x, head.gate_up), torch.matmul(x, tail.gate_up)], dim=-1)[0]) * torch.cat(
        [torch.matmul(x, head.gate_up), torch.matmul(x, tail.gate_up)], dim=-1)[1]
    if dtype == torch.float32:
        expected = torch.addmm(h[:, :top] @ head.down, h[:, top:], tail.down)
    else:
        expected = (h[:, :top].float() @ head.down.float() + h[:, top:].float() @ tail.down.float()).to(dtype)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_steps_segments_share_the_tokens_broadcast(dtype):
    """A decode token's segments on torch's path (issue 37 §2), whole ones in one call (store.segments_forward),
    tops (partial) and a loaded one alone (store.segment_forward), from the same x: x's broadcast over gate and
    up made once for them all (one `expand`, not one a segment), the whole segments' outputs stacked by their
    down matmuls into one buffer (`stacked`: no `cat`), every output the bits of its segment computed alone, and
    the tops continued by their bottoms as alone. Another x (the next layer's) gets its own broadcast."""
    from fmoe_cli.profiling.ops import OpCounter

    torch.manual_seed(2)
    hidden, neurons, top = 64, 96, 40
    store = HostStore(ExpertShape(1, 4, 2, hidden, neurons, 4), dtype, pin=False)
    act = ACT2FN["silu"]
    experts = [(torch.randn(neurons, 3, hidden) * 0.05).to(dtype) for _ in range(4)]
    segments = [layout.split_rows(e) for e in experts]
    x = torch.randn(1, hidden).to(dtype)
    alone = [layout.segment_forward(x, rows, act) for rows in segments]
    tops = [layout.split_rows(e[:top]) for e in experts[:3]]
    counter = OpCounter()
    with counter:
        stacked = store.segments_forward([x] * 3, segments[:3], act, stacked=True)
        outputs = store.segments_forward([x] * 3, segments[:3], act)
        begun = store.segments_forward([x] * 3, tops, act, partial=True)
        loaded = store.segment_forward(x, segments[3], act)
    names = [name for (_, name) in counter.ops.elements()]
    assert names.count("expand") == 1 and "cat" not in names and names.count("bmm") == 3 + 3 + 3 + 1, counter.ops
    assert torch.equal(stacked, torch.cat(alone[:3])) and torch.equal(loaded, alone[3])
    assert all(torch.equal(a, b) for a, b in zip(outputs, alone))
    for expert, begun_top in zip(experts, begun):
        ws = layout.SplitWorkspace.make(1, top, neurons, dtype, torch.device("cpu"))
        want = layout.bottom_forward(x, layout.split_rows(expert[top:]), act,
                                     layout.top_forward(x, layout.split_rows(expert[:top]), ws))
        got = store.segment_forward(x, layout.split_rows(expert[top:]), act, acc=begun_top)
        assert torch.equal(got, want)
    counter.ops.clear()
    with counter:
        store.segment_forward(torch.randn(1, hidden).to(dtype), segments[0], act)
    assert counter.ops[("other", "expand")] == 1
