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


@pytest.mark.parametrize("top_neurons", [64, 256, 448])
def test_grouped_split_bf16_experts_sum_their_halves_in_float32(top_neurons):
    """The device path's grouped split experts (offload/engine.py `_loaded_decode`): tops of one cache Stack
    (layout.grouped_tops), bottoms of the staging pool's rows [k, I) in other slots, in another order
    (layout.grouped_bottoms), and a bottom computed alone (layout.bottom_alone): each output is the rule's — the
    expert's two partial down projections summed in float32, rounded once — and the one-by-one split's bits
    (top_forward, bottom_forward), whatever slot pairs a top with its bottom."""
    torch.manual_seed(top_neurons)
    hidden, neurons, k = 256, 512, top_neurons
    act = torch.nn.functional.silu
    experts = (torch.randn(6, neurons, 3, hidden) * 0.05).bfloat16()
    pool = (torch.randn(5, neurons, 3, hidden) * 0.05).bfloat16()  # other experts' rows in the slots not read
    pairs = [(4, 1), (0, 3), (2, 0), (5, 4)]  # (cache slot = expert, pool slot of its bottom)
    for expert, slot in pairs:
        pool[slot, k:] = experts[expert, k:]
    tops, bottoms = layout.stack_rows(experts[:, :k].clone()), layout.stack_rows(pool[:, k:])
    for _ in range(3):
        x = torch.randn(1, hidden).bfloat16()
        begun = layout.grouped_tops(x, [tops[expert] for expert, _ in pairs], act)
        got = layout.grouped_bottoms(x, [bottoms[slot] for _, slot in pairs], act, begun)
        got.append(layout.bottom_alone(x, bottoms[pairs[0][1]], act, begun[0]))  # a bottom not computed with others
        for y, (expert, slot) in zip(got, pairs + pairs[:1]):
            rows = layout.split_rows(experts[expert])
            gate, up = layout.gate_up_mm(x, rows.gate_up).unbind(0)
            h = act(gate) * up  # [1, I]
            rule = (h[:, :k].float() @ rows.down[:k].float() + h[:, k:].float() @ rows.down[k:].float()).bfloat16()
            workspace = layout.SplitWorkspace.make(1, k, neurons, torch.bfloat16, torch.device("cpu"))
            one_by_one = layout.bottom_forward(x, bottoms[slot], act, layout.top_forward(x, tops[expert], workspace))
            assert y.dtype == torch.bfloat16 and torch.equal(y, rule) and torch.equal(y, one_by_one)


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
