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
