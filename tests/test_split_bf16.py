"""Issue 37 §4: on torch's path (a GPU; the CPU without its kernels) a split expert in bf16 gives the whole expert's
bits: its top's and bottom's partial down projections are summed in float32 and rounded once, as the whole expert's
one matmul rounds once (offload/layout.py `bottom_forward`)."""

from __future__ import annotations

import pytest
import torch

from fmoe_cli.offload import layout


@pytest.mark.parametrize("top_neurons", [64, 256, 448])
def test_a_split_bf16_expert_is_the_whole_expert_bit_for_bit(top_neurons):
    torch.manual_seed(top_neurons)
    hidden, neurons = 256, 512
    segment = (torch.randn(neurons, 3, hidden) * 0.05).bfloat16()
    act = torch.nn.functional.silu
    for _ in range(4):
        x = torch.randn(1, hidden).bfloat16()
        whole = layout.segment_forward(x, segment, act)
        workspace = layout.SplitWorkspace.make(1, top_neurons, neurons, torch.bfloat16, torch.device("cpu"))
        top = layout.top_forward(x, layout.split_rows(segment[:top_neurons]), workspace)
        split = layout.bottom_forward(x, segment[top_neurons:], act, top)
        assert split.dtype == torch.bfloat16 and torch.equal(split, whole)


def test_split_policies_give_the_resident_tokens_in_bf16_on_torchs_path(checkpoints, monkeypatch):
    """The engine end to end on torch's path in bf16: `uniform` (every expert split, θ = 0.5) gives `resident`'s
    greedy tokens."""
    from fmoe_cli import kernels
    from fmoe_cli.generate import stream_generate
    from fmoe_cli.models.load import load_model
    from fmoe_cli.offload.engine import Engine
    from fmoe_cli.offload.link import EmulatedLink, VirtualClock
    from fmoe_cli.planning.presets import make_settings

    monkeypatch.setattr(kernels, "library", lambda: None)
    lm = load_model(str(checkpoints["mixtral"]), device="cpu", dtype="bfloat16")
    if hasattr(lm.model, "decode_token"):
        lm.model.decode_token.enabled = False
    shape = lm.shape
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(20, clock=VirtualClock(), copy=True), lm.device, lm.dtype)
    engine.install(lm.model)
    prompt = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11, 64, 128]])
    tokens = {}
    for policy, theta in (("resident", None), ("uniform", 0.5)):
        engine.configure(make_settings(policy, shape, 2 * shape.top_k * shape.expert_bytes + shape.all_experts_bytes,
                                       theta=theta))
        tokens[policy] = [e.token_id for e in stream_generate(lm.model, prompt, engine=engine, max_new_tokens=24,
                                                              stop_on_eos=False)]
    counters = engine.counters()
    engine.close()
    assert counters.hits_top > 0  # the split really ran
    assert tokens["uniform"] == tokens["resident"]
