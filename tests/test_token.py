"""A resident float32 or bf16 decode token in one C call (models/token.py, decode.c fmoe_decode_token, _bf16): the
per-step path's logits bit for bit, every expert format and dense format, through the KV cache's growth; the engine's
bookkeeping (observers, policies, counters) as the per-step path leaves it; the one call ran for every decode token
(a silent fallback fails); anything it does not take (a hook, a prefetching plan, another family) runs the per-step
path."""

from __future__ import annotations

import pytest
import torch

from fmoe_cli import generate, kernels
from fmoe_cli.generate import new_cache, next_logits
from fmoe_cli.models import attention
from fmoe_cli.models.load import load_model
from fmoe_cli.offload.engine import Engine
from fmoe_cli.offload.link import EmulatedLink
from fmoe_cli.planning.presets import make_settings
from test_decoder import perturb_norms  # tests/test_decoder.py

pytestmark = pytest.mark.skipif(not kernels.library(), reason="no C compiler")

PROMPT = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])
STEPS = 10


def load_perturbed(path, **options):
    """load_model with every norm's weight random (a random checkpoint's are ones, under which a norm given another's
    weight would not show), the decode forwards installed again over them."""
    lm = load_model(str(path), device="cpu", **options)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in lm.model.model.layers:
            layer.self_attn.__dict__.pop("forward", None)
            for norm in (getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None)):
                if norm is not None:
                    norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=g))
    attention.install_decode_attention(lm.model)
    return perturb_norms(lm)  # the layers' norms and the final one, the decoder's forwards installed again


def engine_for(lm, policy: str = "resident") -> Engine:
    shape = lm.shape
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(None), lm.device, lm.dtype)
    engine.install(lm.model)
    engine.configure(make_settings(policy, shape, 2 * shape.top_k * shape.expert_bytes + shape.all_experts_bytes))
    return engine


def greedy(lm, engine, in_c: bool, steps: int = STEPS):
    """The logits of the prompt's forward and `steps` greedy decode tokens (token in C on or off), and the decode
    tokens the one call computed."""
    token = lm.model.decode_token
    token.enabled = in_c
    runs = token.runs
    cache, ids, out = new_cache(lm.model), PROMPT, []
    with torch.inference_mode():
        for _ in range(steps + 1):
            logits = next_logits(lm.model, ids, cache)
            out.append(logits.clone())
            ids = torch.tensor([[int(logits.argmax())]])
    token.enabled = True
    return out, token.runs - runs


def routing_log(engine) -> list:
    seen = []
    engine.observers.append(lambda e: seen.append((e.layer, e.routed, e.top_k_weights.tolist(), e.cache.step)))
    return seen


@pytest.mark.parametrize("dense", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("experts", ["bf16", "int8", "int4", "int2"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_token_in_c_gives_the_per_step_bits(checkpoints, dtype, family, experts, dense, monkeypatch):
    """float32 and bf16 compute, each expert format (bf16 stored experts computed as rows of the compute dtype) and
    dense format (bf16: the rows as stored, in the compute dtype): the same logits bit for bit as the per-step path
    at every decode token, the KV cache's buffers grown under it (from 4 positions), the same routing (and router
    weights: bf16 beside Qwen's routers, float32 beside Mixtral's) seen by an observer, the same counters and policy
    state; the one call ran for every decode token, never for the prompt."""
    monkeypatch.setattr(generate, "MIN_CAPACITY", 4)
    lm = load_perturbed(checkpoints[family], dtype=dtype, experts=experts, dense=dense)
    results = {}
    for in_c in (True, False):
        engine = engine_for(lm)
        seen = routing_log(engine)
        logits, runs = greedy(lm, engine, in_c)
        policy = [(state.cache.step, list(state.cache.policy.count)) for state in engine.layers]
        results[in_c] = logits, runs, seen, engine.counters(), policy
        engine.close()
    got, runs, seen, counters, policy = results[True]
    want, none, want_seen, want_counters, want_policy = results[False]
    assert runs == STEPS and none == 0
    assert len(got) == len(want) == STEPS + 1
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step}: max |Δ| {(a - b).abs().max()}"
    assert seen == want_seen and len(seen) == (STEPS + 1) * len(lm.model.model.layers)
    assert counters == want_counters and policy == want_policy


def test_what_it_does_not_take_runs_the_per_step_path(checkpoints):
    """A forward hook on a layer's MoE block, a forward put over a module's, a prefetching plan, a family it does not
    take: no token in C, the per-step path's logits."""
    path = str(checkpoints["qwen3_moe"])
    lm = load_model(path, device="cpu", dtype="float32", experts="int8", dense="int8")
    engine = engine_for(lm)
    want, runs = greedy(lm, engine, True, steps=3)
    assert runs == 3

    def per_step() -> bool:  # the per-step path ran every token, with the same logits
        got, runs = greedy(lm, engine, True, steps=3)
        return runs == 0 and all(torch.equal(a, b) for a, b in zip(got, want))

    mlp = lm.model.model.layers[1].mlp
    handle = mlp.register_forward_hook(lambda *a: None)
    assert per_step()
    handle.remove()
    forward = mlp.forward
    mlp.forward = lambda *a, **kw: forward(*a, **kw)  # (what benchmarks/decode_profile.py does to time a part)
    assert per_step()
    del mlp.forward
    mlp.forward = forward
    assert greedy(lm, engine, True, steps=3)[1] == 3
    engine.close()
    engine = engine_for(lm, "prefetch-only")
    assert greedy(lm, engine, True, steps=3)[1] == 0
    engine.close()
    for dtype, family in (("bfloat16", "qwen2_moe"), ("float32", "qwen2_moe"), ("float32", "olmoe")):
        lm = load_model(str(checkpoints[family]), device="cpu", dtype=dtype, experts="int8", dense="int8")
        engine = engine_for(lm)
        assert greedy(lm, engine, True, steps=2)[1] == 0, (dtype, family)
        engine.close()


def test_a_bf16_routers_exception_comes_out_of_the_token_in_c(checkpoints, monkeypatch):
    """At bf16 decode.c calls each layer's router module back (models/token.py `_router_callback`): an exception
    there comes out of the model's forward as itself (not swallowed by the C frames, not a MemoryError), and the
    next token runs in C again."""
    lm = load_model(str(checkpoints["qwen3_moe"]), device="cpu", dtype="bfloat16", experts="int8", dense="int8")
    engine = engine_for(lm)
    assert greedy(lm, engine, True, steps=2)[1] == 2
    real = torch.topk
    calls = {"n": 0}

    def failing(*args, **kwargs):  # the prompt's routers pass; the first decode token's first router raises, once
        calls["n"] += 1  # (a swallowed exception would let the per-step path compute the token: no error)
        if calls["n"] == len(lm.model.model.layers) + 1:
            raise RuntimeError("router failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "topk", failing)
    with pytest.raises(RuntimeError, match="router failed"):
        greedy(lm, engine, True, steps=1)
    monkeypatch.setattr(torch, "topk", real)
    assert greedy(lm, engine, True, steps=2)[1] == 2
    engine.close()


def test_a_new_plan_is_built_after_the_old_plans_caches_are_freed(checkpoints):
    """Engine.configure frees the old plan's buffers before it builds the new one's; the token in C, which checks
    each token whether the plan changed, must not keep them alive (it held the plan's layers: fmoe bench, which
    re-plans between its policies, peaked with two policies' caches at once, issue 39 §6)."""
    import weakref

    lm = load_model(str(checkpoints["qwen3_moe"]), device="cpu", dtype="float32", experts="int8", dense="int8")
    shape = lm.shape
    engine = engine_for(lm)
    engine.configure(make_settings("lru", shape, 2 * shape.top_k * shape.expert_bytes + shape.all_experts_bytes // 2))
    assert greedy(lm, engine, True, steps=3)[1] == 0  # an offloaded plan: the per-step path, the plan checked each token
    old = weakref.ref(engine.layers[0].tops)  # lru's cache (a resident plan's tops are the host store itself)
    alive_at_build = []
    build = engine._build

    def watched(*args, **kwargs):
        alive_at_build.append(old() is not None)
        return build(*args, **kwargs)

    engine._build = watched
    engine.configure(make_settings("uniform", shape, 2 * shape.top_k * shape.expert_bytes + shape.all_experts_bytes // 3))
    assert alive_at_build == [False]
    engine.close()


def test_without_the_kernels_the_token_is_declined_before_any_look_up(checkpoints, without_kernels, monkeypatch):
    """FMOE_KERNELS=torch (a GPU's per-step path, the host-work measure's): TokenInC.forward says no at once, without
    looking its engine up or asking `ready` (no structure is ever made without the kernels), and the per-step path
    decodes every token."""
    from fmoe_cli.models.token import TokenInC

    lm = load_model(str(checkpoints["mixtral"]), device="cpu", dtype="float32")
    shape = lm.shape
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(None), lm.device, lm.dtype)
    engine.install(lm.model)
    engine.configure(make_settings("resident", shape, shape.all_experts_bytes))

    def refused(*args):
        raise AssertionError("looked up without the kernels")

    monkeypatch.setattr(TokenInC, "engine", refused)
    monkeypatch.setattr(TokenInC, "ready", refused)
    steps = [e.token_id for e in generate.stream_generate(lm.model, torch.tensor([[5, 6, 7]]), engine=engine,
                                                          max_new_tokens=4, stop_on_eos=False)]
    engine.close()
    assert len(steps) == 4 and lm.model.decode_token.runs == 0
