"""The engine advances each layer's policy clock token by token, prompt tokens included
(MoEpic's ν counts tokens: after a prefill, the experts of its last tokens are young)."""

from __future__ import annotations

import torch

from fmoe_cli.models.load import load_model
from fmoe_cli.offload.engine import Engine
from fmoe_cli.offload.link import EmulatedLink
from fmoe_cli.planning.presets import make_settings


def test_prefill_stamps_each_token_at_its_own_step(checkpoints):
    lm = load_model(str(checkpoints["mixtral"]), device="cpu", dtype="float32")
    engine = Engine(lm.layers, lm.store, lm.shape, EmulatedLink(None), lm.device, lm.dtype)
    engine.install(lm.model)
    routes: dict[int, list[list[int]]] = {}
    engine.observers.append(lambda event: routes.setdefault(event.layer, event.top_k_index.tolist()))
    budget = 2 * lm.shape.top_k * lm.shape.expert_bytes + lm.shape.all_experts_bytes // 4
    engine.configure(make_settings("lru", lm.shape, budget))
    prompt = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11, 64, 128]])
    with torch.no_grad():
        lm.model(prompt)
    try:
        for i, state in enumerate(engine.layers):
            assert state.cache.step == prompt.shape[1]  # T tokens: T steps
            last = {}
            for t, row in enumerate(routes[i]):
                for e in row:
                    last[e] = t
            policy = state.cache.policy
            assert {e: policy.last[e] for e in last} == last  # each expert stamped at its last token
            assert sum(policy.count) == sum(len(r) for r in routes[i])
    finally:
        engine.close()
