"""The engine's behaviour that keeps tokens identical, checked through counters and shapes:
hit classification (pure), each layer built from its own plan, the bytes a top hit and a
prefetch move, and exposed time measured where the compute waits."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from fmoe_cli import kernels
from fmoe_cli.generate import stream_generate
from fmoe_cli.models.load import load_model
from fmoe_cli.offload.engine import Engine
from fmoe_cli.offload.hits import classify
from fmoe_cli.offload.link import EmulatedLink, VirtualClock
from fmoe_cli.planning.plan import layer_plan, uniform_plan
from fmoe_cli.types import EngineSettings, Plan

PROMPT = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11, 64, 128]])


# --- hit classification: no tensors ------------------------------------------------------
def test_classify_whole_top_miss_and_covered():
    cached = {1, 2, 5}
    h = classify([5, 1, 3, 4, 1], cached, top_neurons=8, intermediate=16, staged={3: 0, 4: 0, 6: 0, 1: 8})
    assert h.whole == () and h.top_hits == (1, 5) and h.misses == (3, 4)
    assert h.covered == ((1, 8), (3, 0), (4, 0))  # staged from a neuron at or before the one needed
    assert h.loads == ((5, 8),)
    assert h.dropped == (6,) and h.needed == 4  # a staged expert nobody routed to
    whole = classify([1, 2, 3], cached, top_neurons=16, intermediate=16, staged={})
    assert whole.whole == (1, 2) and whole.misses == (3,) and whole.loads == ((3, 0),)


def test_classify_drops_a_staged_bottom_that_cannot_serve_a_miss():
    h = classify([7], cached=set(), top_neurons=8, intermediate=16, staged={7: 8})
    assert h.misses == (7,) and h.covered == () and h.loads == ((7, 0),) and h.dropped == (7,)


def test_counters_total_is_the_left_sum_of_every_layers():
    """engine.counters() (twice a token in generate.py) adds every field from 0 in layer order, as a chain of `+`
    does: the same integers and the same floats."""
    import random
    from dataclasses import fields

    from fmoe_cli.offload.engine import Counters

    rng = random.Random(0)
    layers = [Counters(*[rng.random() if f.type == "float" else rng.randrange(100) for f in fields(Counters)])
              for _ in range(7)]
    chain = Counters()
    for c in layers:
        chain = chain + c
    assert Counters.total(layers).__dict__ == chain.__dict__
    assert (chain - layers[0]).__dict__ == {k: v - layers[0].__dict__[k] for k, v in chain.__dict__.items()}
    assert type(Counters.total([]).exposed_s) is float and Counters.total([]) == Counters()


# --- the engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixtral(checkpoints):
    return load_model(str(checkpoints["mixtral"]), device="cpu", dtype="float32")


def want_tokens(lm, n):
    engine = Engine(lm.layers, lm.store, lm.shape, EmulatedLink(None), lm.device, lm.dtype)
    engine.install(lm.model)
    from fmoe_cli.planning.presets import make_settings

    engine.configure(make_settings("resident", lm.shape, 0))
    out = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=n, stop_on_eos=False)]
    engine.close()
    return out


def test_configure_builds_every_layer_from_its_own_plan(mixtral):
    lm = mixtral
    shape = lm.shape
    thetas = [0.25, 0.5, 1.0, 0.75, 0.5, 0.25]
    layers = tuple(layer_plan(shape, (i % shape.num_experts) + 1, thetas[i % len(thetas)])
                   for i in range(shape.num_layers))
    plan = Plan(layers, 2 * shape.top_k, shape.expert_bytes, "test")
    assert len({(lp.cache_size, lp.top_neurons) for lp in layers}) > 1
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(20, clock=VirtualClock(), copy=True), lm.device, lm.dtype)
    engine.install(lm.model)
    engine.configure(EngineSettings("test", plan, "lcp", True, 128.0, 0.25))
    for state, lp in zip(engine.layers, layers):
        assert state.cache.capacity == lp.cache_size and state.top_neurons == lp.top_neurons
        assert tuple(state.tops.shape) == (lp.cache_size, lp.top_neurons, *lm.store.row_shape)
    got = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=6, stop_on_eos=False)]
    engine.close()
    assert got == want_tokens(lm, 6)


def split_engine(lm, prefetch: bool):
    """θ = 0.5, every expert's top cached in every layer: every activation is a top hit."""
    shape = lm.shape
    k = shape.top_neurons(0.5)
    plan = Plan(tuple(layer_plan(shape, shape.num_experts, 0.5) for _ in range(shape.num_layers)),
                2 * shape.top_k, shape.expert_bytes, "test")
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(20, clock=VirtualClock(), copy=True), lm.device, lm.dtype)
    engine.install(lm.model)
    engine.configure(EngineSettings("test", plan, "lcp", prefetch, 128.0, 0.25))
    for i, state in enumerate(engine.layers):
        for e in range(shape.num_experts):
            state.tops[state.cache.insert(e)].copy_(lm.store.expert(i, e)[:k])
    return engine, k


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_top_hit_and_a_prefetch_of_a_cached_top_load_only_the_bottom(mixtral, prefetch):
    lm = mixtral
    engine, k = split_engine(lm, prefetch=prefetch)
    got = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=6, stop_on_eos=False)]
    c = engine.counters()
    engine.close()
    assert got == want_tokens(lm, 6)
    bottom = (lm.shape.intermediate - k) * lm.shape.neuron_bytes
    assert c.hits_top == c.activations > 0 and c.misses == 0
    assert c.bytes_demand == (c.hits_top - c.prefetch_covered) * bottom  # not the whole expert
    if prefetch:
        assert c.prefetch_issued > 0 and c.prefetch_covered > 0
        assert c.bytes_prefetch == c.prefetch_issued * bottom


def test_exposed_time_is_the_time_the_compute_waited(mixtral):
    """On a virtual clock the host only waits inside acquire: exposed time = the clock's sleep."""
    lm = mixtral
    shape = lm.shape
    clock = VirtualClock()
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(1.0, clock=clock), lm.device, lm.dtype)
    engine.install(lm.model)
    from fmoe_cli.planning.presets import make_settings

    engine.configure(make_settings("ondemand", shape, 2 * shape.top_k * shape.expert_bytes))
    list(stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=3, stop_on_eos=False))
    c = engine.counters()
    engine.close()
    assert c.exposed_s == pytest.approx(clock.slept) and clock.slept > 0
    # nothing overlaps on a virtual clock without compute time: every byte was waited for
    assert clock.slept == pytest.approx(c.bytes_demand / 1e9 + c.needed_loads * engine.link.latency_s, rel=1e-6)


def test_the_hosts_lead_on_the_first_load_is_counted_per_forward_that_loads(mixtral):
    """lead_s / leads (the profile's h_route): one lead per layer forward that submitted loads, none
    where everything was on the device."""
    from fmoe_cli.planning.presets import make_settings

    lm = mixtral
    engine = Engine(lm.layers, lm.store, lm.shape, EmulatedLink(None), lm.device, lm.dtype)
    engine.install(lm.model)
    for policy, budget in (("ondemand", 2 * lm.shape.top_k * lm.shape.expert_bytes), ("resident", 0)):
        engine.configure(make_settings(policy, lm.shape, budget))
        list(stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=3, stop_on_eos=False))
        c = engine.counters()
        forwards = 3 * lm.shape.num_layers  # the prompt's and two decode steps'
        assert c.leads == (forwards if policy == "ondemand" else 0)
        assert (c.lead_s > 0) == (policy == "ondemand")
    engine.close()


def test_the_submission_of_a_layers_loads_is_counted(mixtral):
    """submit_s / submitted (the profile's h_sub, the part of h_load spent before a layer's first compute): every
    demand load a decode step's layer submits (its misses: the staging pool holds 2K), none where everything was on
    the device."""
    from fmoe_cli.planning.presets import make_settings

    lm = mixtral
    engine = Engine(lm.layers, lm.store, lm.shape, EmulatedLink(None), lm.device, lm.dtype)
    engine.install(lm.model)
    for policy, budget in (("ondemand", 2 * lm.shape.top_k * lm.shape.expert_bytes), ("resident", 0)):
        engine.configure(make_settings(policy, lm.shape, budget))
        events = list(stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=3, stop_on_eos=False))
        for c in (e.counters for e in events[1:]):  # decode steps
            assert c.submitted == c.misses == (lm.shape.num_layers * lm.shape.top_k if policy == "ondemand" else 0)
            assert (c.submit_s > 0) == (policy == "ondemand")
    engine.close()


def test_the_prefetch_path_is_counted_per_layer_that_runs_it(mixtral):
    """predict_s / predicts (the profile's h_pf, profiling/model.py: host_work_s): one count per layer forward that
    runs the predictor (its scores, the ranking, the prefetcher's submits), with its host time; none without
    prefetch. The quick estimate read h_pf as a difference of paired forwards with and without prefetch (0.000 to
    0.46 ms on the demo, where the path takes 0.10-0.15); it now reads this counter in decode steps."""
    from fmoe_cli.offload.engine import open_engine
    from fmoe_cli.planning.presets import make_settings

    lm = mixtral
    engine = open_engine(lm, link=EmulatedLink(None))
    for policy in ("prefetch-only", "ondemand"):
        engine.configure(make_settings(policy, lm.shape, 4 * lm.shape.top_k * lm.shape.expert_bytes))
        events = list(stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=3, stop_on_eos=False))
        for c in (e.counters for e in events[1:]):  # decode steps
            assert c.predicts == (lm.shape.num_layers if policy == "prefetch-only" else 0)
            assert (c.predict_s > 0) == (policy == "prefetch-only")
    engine.close()


def test_routing_and_predictor_scores_reach_the_host_in_one_copy(monkeypatch):
    from fmoe_cli.offload import engine as engine_module
    from fmoe_cli.offload.engine import Routing

    ids = torch.tensor([[3, 1], [1, 0], [7, 3]])
    weights = torch.tensor([[0.7, 0.3], [0.55, 0.45], [0.9, 0.1]], dtype=torch.bfloat16)
    scores = {("speculative", 2): torch.rand(8), ("mol", 2): torch.rand(3, 8)}
    copies = []
    real_read = engine_module.read_to_host  # link.read_to_host: the one device→host read (tests/test_host_waits.py)
    monkeypatch.setattr(engine_module, "read_to_host", lambda t: copies.append(t.shape) or real_read(t))
    r = Routing.of(ids, weights, scores, pack=True)
    assert len(copies) == 1  # one device→host copy for all of it
    assert torch.equal(r.ids, ids) and torch.equal(r.weights, weights) and r.weights.dtype == torch.bfloat16
    assert all(torch.equal(r.extra[key], t) for key, t in scores.items())
    assert r.flat == [3, 1, 1, 0, 7, 3] and r.active == [0, 1, 3, 7]
    perm, tokens, spans = r.layout(torch.device("cpu"))
    assert tokens[spans[3]].tolist() == [0, 2] and (perm[spans[3]] % 2).tolist() == [0, 1]  # tokens ascending
    assert tokens[spans[1]].tolist() == [0, 1] and (perm[spans[1]] % 2).tolist() == [1, 0]  # their top-k slot


def test_a_decode_step_computes_each_prediction_once_and_no_nonzero(mixtral, monkeypatch):
    """The speculative scores are computed once per layer, on the device, before the routing copy
    (not again on the host side); and no per-expert nonzero (a host sync each on a GPU)."""
    from fmoe_cli.planning.presets import make_settings
    from fmoe_cli.prediction.speculative import SpeculativePredictor

    lm = mixtral
    engine = Engine(lm.layers, lm.store, lm.shape, EmulatedLink(20, clock=VirtualClock()), lm.device, lm.dtype)
    engine.install(lm.model)
    engine.configure(make_settings("uniform", lm.shape, 2 * lm.shape.top_k * lm.shape.expert_bytes
                                   + lm.shape.all_experts_bytes // 4))
    calls = []
    real = SpeculativePredictor._scores
    monkeypatch.setattr(SpeculativePredictor, "_scores", lambda self, *a: calls.append(a[0]) or real(self, *a))
    monkeypatch.setattr(torch, "nonzero", lambda *a, **k: (_ for _ in ()).throw(AssertionError("nonzero")))
    got = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=3, stop_on_eos=False)]
    engine.close()
    assert calls == list(range(lm.shape.num_layers)) * 3
    monkeypatch.undo()
    assert got == want_tokens(lm, 3)


def test_configure_frees_before_it_allocates_and_runs_a_smaller_plan_on_oom(mixtral, monkeypatch):
    from fmoe_cli.errors import FmoeError
    from fmoe_cli.offload import engine as engine_module
    from fmoe_cli.planning.presets import make_settings

    lm = mixtral
    shape = lm.shape
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(20, clock=VirtualClock(), copy=True), lm.device, lm.dtype)
    engine.install(lm.model)
    small = make_settings("lru", shape, 2 * shape.top_k * shape.expert_bytes + shape.expert_bytes)
    big = make_settings("lru", shape, 2 * shape.top_k * shape.expert_bytes + shape.all_experts_bytes // 2)
    engine.configure(small)
    seen = []
    real_pool = engine_module.StagingPool

    def pool_that_runs_out(*args, **kwargs):
        seen.append((engine.pool, list(engine.layers)))  # what the engine still held while allocating
        if len(seen) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return real_pool(*args, **kwargs)

    monkeypatch.setattr(engine_module, "StagingPool", pool_that_runs_out)
    with pytest.raises(FmoeError, match=r"^out of device memory for the plan \(\d+ MiB\): caching \d+ segments") as err:
        engine.configure(big)
    assert "\n" not in str(err.value)
    assert seen[0] == (None, [])  # the old buffers were let go before the new ones were allocated
    assert [s.cache.capacity for s in engine.layers] == [lp.cache_size // 2 for lp in big.plan.layers]
    monkeypatch.undo()
    got = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=4, stop_on_eos=False)]
    engine.close()
    assert got == want_tokens(lm, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combining_sums_each_tokens_experts_as_transformers_grouped_mm_does(dtype):
    """The weighted sum is transformers' default experts forward's (`grouped_mm`): every routed (token, k)
    row's output times its weight, [T, K, H] summed over K in routing order, converted to the hidden dtype
    once. One token or several, the same bits (the old per-expert `add_`/`index_add_` in expert order, with a
    rounding to the hidden dtype per expert, gives others here: the test fails on it)."""
    from fmoe_cli.offload.engine import Routing

    g = torch.Generator().manual_seed(0)
    k, hidden = 8, 4099  # K = 8 and a hidden size with a tail: where a sequential add rounds differently
    for tokens in (1, 3):
        ids = torch.stack([torch.randperm(16, generator=g)[:k] for _ in range(tokens)])  # [T, K] distinct per token
        weights = torch.rand(tokens, k, generator=g)  # the router's float32, as in a bf16 model
        state = torch.zeros(tokens, hidden, dtype=dtype)
        routing = Routing.of(ids, weights)
        _perm, rows, spans = routing.layout(state.device)
        scale = torch.logspace(-3, 3, k)
        per_slot = {(t, j): (torch.randn(hidden, generator=g) * scale[j]).to(dtype)
                    for t in range(tokens) for j in range(k)}  # the output of token t's k-th expert
        outputs = {e: torch.stack([per_slot[t, j] for t in range(tokens) for j in range(k) if ids[t, j] == e])
                   for e in routing.active}  # [T_e, H], tokens ascending
        proj = torch.stack([per_slot[t, j] for t in range(tokens) for j in range(k)])  # [T·K, H], routing order
        # transformers.integrations.moe.grouped_mm_experts_forward, after its down projection:
        expected = (proj * weights.reshape(-1).unsqueeze(-1)).view(tokens, k, hidden).sum(dim=1).to(dtype)
        torch_steps = SimpleNamespace(_combine_in_c=False)  # a float32 token's sum in C: test below
        torch_steps._combine_decode = partial(Engine._combine_decode, torch_steps)
        got = Engine._combine(torch_steps, state, routing, outputs, weights)
        assert got.dtype == dtype and torch.equal(got, expected)


@pytest.mark.skipif(not kernels.library(), reason="no C compiler")
def test_a_float32_tokens_combine_in_c():
    """A float32 decode token's weighted sum in C (kernels.combine_decode: each product rounded, then added in k
    order) where the kernels are built: within float32 rounding of transformers' `[K, H].sum(0)` (whose order is
    torch's own), and the same from both of the engine's decode paths (a resident layer's stacked outputs, and a
    policy's outputs by expert), so every policy keeps the resident run's bits."""
    from fmoe_cli.offload.engine import Routing

    g = torch.Generator().manual_seed(1)
    k, hidden = 8, 4099
    engine = SimpleNamespace(_combine_in_c=True)
    engine._combine_decode = partial(Engine._combine_decode, engine)
    for _ in range(4):
        ids = torch.randperm(16, generator=g)[:k][None]
        weights = torch.rand(1, k, generator=g)
        stacked = torch.randn(k, hidden, generator=g) * torch.logspace(-3, 3, k)[:, None]
        state = torch.zeros(1, hidden)
        want = (stacked * weights.t()).sum(0, keepdim=True)
        got = Engine._combine_decode(engine, state, stacked, weights)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
        by_hand = torch.zeros(1, hidden)
        for j in range(k):
            by_hand += stacked[j] * weights[0, j]  # each product rounded, added in k order
        assert torch.equal(got, by_hand)
        outputs = {int(e): stacked[j:j + 1] for j, e in enumerate(ids[0])}
        assert torch.equal(Engine._combine(engine, state, Routing.of(ids, weights), outputs, weights), got)


def test_routing_layout_sorts_by_expert_then_position_at_every_size():
    """Routing.layout's order (by expert, tokens ascending within one), its tokens and spans, and routing_order (its
    inverse): the same from the Python sort (a decode step's few slots) and torch's stable sort (a prefill's, from
    LAYOUT_SORT_FROM slots), against the definitions written out."""
    from fmoe_cli.offload import engine
    from fmoe_cli.offload.engine import Routing

    g = torch.Generator().manual_seed(5)
    for tokens, k, experts in ((1, 8, 64), (7, 8, 16), (8, 8, 16), (64, 8, 64), (100, 2, 8)):
        ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
        routing = Routing.of(ids, torch.rand(tokens, k, generator=g))
        perm, rows, spans = routing.layout(torch.device("cpu"))
        flat = ids.reshape(-1).tolist()
        order = sorted(range(len(flat)), key=lambda p: (flat[p], p))
        assert perm.tolist() == order and rows.tolist() == [p // k for p in order]
        assert routing.routing_order(torch.device("cpu")).tolist() == [order.index(p) for p in range(len(flat))]
        start = 0
        for e in sorted(set(flat)):
            assert spans[e] == slice(start, start + flat.count(e))
            start += flat.count(e)
        assert list(spans) == sorted(set(flat))
    assert 1 * 8 <= engine.LAYOUT_SORT_FROM < 64 * 8  # both sorts ran above


@pytest.mark.skipif(not kernels.library(), reason="no C compiler")
def test_a_float32_prefills_combine_in_c_reads_the_experts_rows_where_they_are():
    """A float32 prefill's weighted sum in C (kernels.combine_prefill: each token as a decode token's, each product
    rounded, added in k order, the tokens in chunks on the kernels' threads): the same bits as that sum by hand over
    the rows put in routing order, whether the experts' outputs are views of one buffer (a resident layer's one
    kernel call) or tensors of their own (a policy's loads), at token counts that end in a part chunk; within float32
    rounding of transformers' `[T, K, H].sum(1)`; and every chunk of tokens run exactly once."""
    from fmoe_cli.offload.engine import Routing

    g = torch.Generator().manual_seed(2)
    engine = SimpleNamespace(_combine_in_c=True, _sums_in_c=Engine._sums_in_c)
    torch_steps = SimpleNamespace(_combine_in_c=False, _sums_in_c=Engine._sums_in_c)
    lib = kernels.library()
    for tokens, k, hidden, experts in ((64, 8, 1024, 64), (7, 2, 4099, 8), (2, 8, 256, 16)):
        ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
        weights = torch.rand(tokens, k, generator=g)
        routing = Routing.of(ids, weights)
        _perm, _rows, spans = routing.layout(torch.device("cpu"))
        acc = torch.randn(tokens * k, hidden, generator=g) * torch.logspace(-3, 3, tokens * k)[:, None]
        shared = {e: acc[span] for e, span in spans.items()}  # views of one buffer, expert order
        own = {e: y.clone() for e, y in reversed(shared.items())}  # each its own tensor
        in_order = acc[routing.routing_order(torch.device("cpu"))].view(tokens, k, hidden)
        by_hand = torch.zeros(tokens, hidden)
        for j in range(k):
            by_hand += in_order[:, j] * weights[:, j:j + 1]  # each product rounded, added in k order
        state = torch.zeros(tokens, hidden)
        start = lib.fmoe_pool_chunks_run()
        got = Engine._combine(engine, state, routing, shared, weights)
        assert lib.fmoe_pool_chunks_run() - start == -(-tokens // 4)  # COMBINE_TOKENS a chunk, each run once
        assert got.shape == (tokens, hidden) and torch.equal(got, by_hand)
        assert torch.equal(Engine._combine(engine, state, routing, own, weights), got)
        want = Engine._combine(torch_steps, state, Routing.of(ids, weights), dict(shared), weights)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


@pytest.mark.parametrize("link_kind", ["emulated", "cuda"])
def test_configure_lets_the_old_pool_go_before_it_allocates(mixtral, link_kind):
    """Issue 20 §2: a copy still running into the old staging pool holds a view of it; re-planning
    stops or finishes every copy and drops every view, so the old buffer is freed before the new plan
    is allocated (a weakref to it is dead), on the emulated link and on CudaLink (fake GPU)."""
    import contextlib
    import gc
    import weakref

    import fake_gpu  # tests/fake_gpu.py
    from fmoe_cli.offload.link import PREFETCH, CudaLink
    from fmoe_cli.planning.presets import make_settings

    lm, shape = mixtral, mixtral.shape
    with fake_gpu.installed() if link_kind == "cuda" else contextlib.nullcontext():
        link = (CudaLink(torch.device("cuda"), chunk_bytes=1024, pump_thread=False) if link_kind == "cuda"
                else EmulatedLink(1, clock=VirtualClock(), copy=True, chunk_bytes=1024))
        engine = Engine(lm.layers, lm.store, shape, link, lm.device, lm.dtype)
        engine.install(lm.model)
        pool_bytes = 2 * shape.top_k * shape.expert_bytes
        engine.configure(make_settings("lru", shape, pool_bytes + shape.expert_bytes))
        list(stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=2, stop_on_eos=False))
        old = weakref.ref(engine.pool.buffer)
        link.submit(engine.pool.destination(0, 0), lm.store.expert(0, 1), PREFETCH)  # running, not in the pool
        staged = link.submit(engine.pool.destination(1, 0), lm.store.expert(0, 2), PREFETCH)  # queued behind it
        assert staged.state.value == "queued"
        del staged
        engine.configure(make_settings("lru", shape, pool_bytes + shape.all_experts_bytes // 2))
        gc.collect()
        assert old() is None
        got = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=3,
                                                   stop_on_eos=False)]
        engine.close()
    assert got == want_tokens(lm, 3)


def test_out_of_memory_falls_back_to_smaller_plans_and_never_leaves_the_engine_half_built(mixtral, monkeypatch):
    """Issue 20 §2: when the new plan and the previous one both run out of device memory, the engine builds
    a smaller one (every cache halved), and then the staging pool alone; it says so in one line and runs
    exactly. When not even the pool fits, one line, no plan, and a forward says so instead of IndexError."""
    from fmoe_cli.errors import FmoeError
    from fmoe_cli.planning.presets import make_settings

    lm, shape = mixtral, mixtral.shape
    want = want_tokens(lm, 3)
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(20, clock=VirtualClock(), copy=True), lm.device, lm.dtype)
    engine.install(lm.model)
    pool_bytes = 2 * shape.top_k * shape.expert_bytes
    small = make_settings("lru", shape, pool_bytes + shape.expert_bytes)
    big = make_settings("lru", shape, pool_bytes + shape.all_experts_bytes // 2)
    engine.configure(small)
    fits = {"cached": 0}  # a plan allocates when its caches hold at most this many segments
    real_build = Engine._build

    def build(self, settings, policies, steps):
        if sum(lp.cache_size for lp in settings.plan.layers) > fits["cached"]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return real_build(self, settings, policies, steps)

    monkeypatch.setattr(Engine, "_build", build)
    big_cached = sum(lp.cache_size for lp in big.plan.layers)
    assert sum(lp.cache_size for lp in small.plan.layers) > 0  # the previous plan does not fit either
    with pytest.raises(FmoeError, match=r"^out of device memory for the plan \(\d+ MiB\): loading every expert on "
                                        r"demand \(\d+ MiB\) instead") as err:
        engine.configure(big)
    assert "\n" not in str(err.value)
    assert [s.cache.capacity for s in engine.layers] == [0] * shape.num_layers and engine.pool is not None
    got = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=3, stop_on_eos=False)]
    assert got == want

    fits["cached"] = big_cached // 2  # a plan with every cache halved fits
    with pytest.raises(FmoeError, match=r"caching \d+ segments \(\d+ MiB\) instead"):
        engine.configure(big, warm=True)
    assert [s.cache.capacity for s in engine.layers] == [lp.cache_size // 2 for lp in big.plan.layers]
    got = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=3, stop_on_eos=False)]
    assert got == want

    fits["cached"] = -1  # nothing fits
    with pytest.raises(FmoeError, match="not even the staging pool alone"):
        engine.configure(big)
    assert engine.settings is None and engine.layers == [] and engine.pool is None
    with pytest.raises(FmoeError, match="no expert plan fits"):
        lm.model(PROMPT)
    engine.close()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_prefill_computes_the_lm_head_for_the_last_token_only(checkpoints, family):
    """Issue 20 §3: a prefill of T tokens never makes [1, T, V] logits (Qwen3's V = 151,936 would fill the
    workspace at about 1.8k tokens): the LM head sees one position per forward, and the tokens are
    unchanged."""
    from fmoe_cli.planning.presets import make_settings

    lm = load_model(str(checkpoints[family]), device="cpu", dtype="float32")
    engine = Engine(lm.layers, lm.store, lm.shape, EmulatedLink(None), lm.device, lm.dtype)
    engine.install(lm.model)
    engine.configure(make_settings("resident", lm.shape, 0))
    rows = []
    hook = lm.model.get_output_embeddings().register_forward_hook(lambda m, a, out: rows.append(out.shape[-2]))
    got = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=3, stop_on_eos=False)]
    hook.remove()
    assert rows == [1, 1, 1]
    with torch.no_grad():  # the same tokens as the full logits' argmax
        full = lm.model(torch.cat([PROMPT, torch.tensor([got[:2]])], dim=1)).logits[0, PROMPT.shape[1] - 1:]
    engine.close()
    assert full.argmax(-1).tolist() == got


OPS_SHAPES = {  # family, overrides of the tiny config: K = 2, K = 2 with a shared expert and a dense layer, K = 8
    "mixtral": ("mixtral", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "qwen3-a3b-top8": ("qwen3_moe", {"num_experts": 16, "num_experts_per_tok": 8}),
}


@pytest.fixture(scope="module")
def ops_checkpoints(tmp_path_factory):
    from fmoe_cli.models.demo import build_random_moe

    root = tmp_path_factory.mktemp("ops")
    return {name: build_random_moe(root / name, family=family, seed=1, **overrides)
            for name, (family, overrides) in OPS_SHAPES.items()}


OPS_PROMPT = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(0))  # every expert routed


def decode_step_ops(path: str, policy: str, grouping: bool | None = None, device_side: bool = False,
                    cached: float = 1.0) -> tuple[dict, object]:
    """count_decode_ops over the eleventh decode step of a run of `path` (a checkpoint) under `policy`, on an
    instant link; `grouping`: the store's (None: by device, off on the CPU); `device_side`: the engine's device path
    behind a link that copies into the staging slots (a GPU's; else the CPU's, whose loads are the store's rows);
    `cached`: the share of all experts the budget holds beside the staging pool."""
    from fmoe_cli import kernels
    from fmoe_cli.planning.presets import make_settings
    from fmoe_cli.profiling.ops import count_decode_ops
    from fmoe_cli.types import Timings

    lm = load_model(str(path), device="cpu", dtype="float32")
    if hasattr(lm.model, "decode_token"):  # the per-step path's ops (a resident token in C is one call: test_token.py)
        lm.model.decode_token.enabled = False
    lm.store.grouping = grouping
    shape = lm.shape
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(None, copy=device_side), lm.device, lm.dtype)
    if device_side:
        engine.device_side = True
    engine.install(lm.model)
    timings = Timings(t_att=1e-4, t_moe=2e-4, t_head=1e-4, t_load=3e-4, top_k=shape.top_k)  # moepic's configurator
    engine.configure(make_settings(policy, shape, 2 * shape.top_k * shape.expert_bytes
                                   + int(shape.all_experts_bytes * cached), timings=timings,
                                   theta=0.5 if policy == "uniform" else None))
    # a long prompt and 10 decode steps route to every expert (a split plan's bottoms: in decode): the views of
    # each buffer are made (once per buffer; the emulated link hands out the store's rows) before the count
    steps = stream_generate(lm.model, OPS_PROMPT, engine=engine, max_new_tokens=12, stop_on_eos=False)
    for _ in range(11):
        next(steps)
    ops = count_decode_ops(lambda: next(steps))
    engine.close()
    return ops, shape


@pytest.mark.parametrize("shape_name", list(OPS_SHAPES))
@pytest.mark.parametrize("policy", ["resident", "ondemand", "uniform"])
def test_host_work_per_decode_step_in_ops(ops_checkpoints, shape_name, policy, monkeypatch):
    """Issue 20 §6: every op the host dispatches costs it microseconds on a GPU. Counted with a
    TorchDispatchMode over one decode step on torch's path (the device's: the CPU's kernels switched off, the
    store's grouping on):
    - a whole expert's segment forward is at most 5 ops (x broadcast over gate and up, a view, and one batched
      matmul for both over the neuron-major rows into a decode workspace whose two views are made once, the
      activation, the product, the down matmul: 4 launches; the batched matmul and the down matmul called
      directly, not through torch.matmul, whose dozen more aten calls this count never saw: layout.gate_up_mm);
      a layer's K ≥ 3 resident experts at most 11 together (torch's grouped matmul, one per projection; 9 on the CPU);
    - a split expert (`uniform` θ = 0.5: a cached top and a loaded bottom) at most 7 (x's broadcast and the
      top's gate and up while the bottom loads; then the bottom's beside them, one activation and one product
      for both, the top's down matmul and the bottom's added to it in one addmm), 6 + 1/K with a layer's K tops
      begun together (one broadcast of x for them all: store.segments_forward);
    - a layer's whole segments (cached or loaded) 4 + 1/K each: x's broadcast made once for the layer's K
      (store._pair), and a resident layer's down matmuls written into one stacked buffer;
    - an MoE layer besides its segments and its predictor at most 12 whatever K (routing to the host; the
      weighted sum in one concatenation, one multiply and one sum), 5 where every expert is whole (resident:
      the routing's host list, the weights' transpose, the product, the sum; no concatenation);
    - the predictor's scores, ranking and prefetches (a plan that prefetches) at most 10 a layer, 19 where the router
      limits its choice to groups (DeepSeek-V3: the groups' two best scores summed, the best groups kept, the rest
      ranked after them: 9 ops, prediction/base.py router_scores; a prefetch outside the chosen groups moves bytes no
      token reads)."""
    from fmoe_cli import kernels

    monkeypatch.setattr(kernels, "library", lambda: None)
    ops, shape = decode_step_ops(ops_checkpoints[shape_name], policy, grouping=True)
    assert ops["layers"] == shape.num_layers
    assert ops["segments"] + ops["split_experts"] >= shape.num_layers * shape.top_k
    if policy == "uniform":  # every activated expert split: its top cached, its bottom loaded
        assert ops["split_experts"] >= shape.num_layers * shape.top_k and ops["segments"] == 0, ops
        assert ops["ops_per_split_expert"] <= 6 + 1 / shape.top_k, ops["by_op"]
    else:
        assert ops["split_experts"] == 0 and 0 < ops["ops_per_segment"] <= 4 + 1 / shape.top_k, ops["by_op"]
    if policy == "resident" and shape.top_k >= 3:
        assert ops["ops_per_segment"] * shape.top_k <= 11, ops["by_op"]
    assert ops["ops_per_layer_besides_segments"] <= (5 if policy == "resident" else 12), ops["by_op"]
    grouped = shape_name == "deepseek_v3"  # (n_group 2, topk_group 1: models/demo.py TINY_FAMILIES)
    assert ops["predictor_ops_per_layer"] <= ((19 if grouped else 10) if policy == "uniform" else 0), ops["by_op"]


@pytest.mark.parametrize("policy, bound", [("ondemand", 24), ("lru", 42), ("moepic", 40), ("uniform", 60)])
def test_a_loading_layers_loads_are_grouped_on_the_device_path(ops_checkpoints, policy, bound, monkeypatch):
    """Issue 37 §1: on the device path (K = 8, a quarter of the experts cached) a loading layer's decode step computes
    its loaded whole experts by one grouped matmul a projection over the staging pool's slots, and its split experts'
    tops over the cache and their bottoms over the pool's rows [k, I) (Engine._loaded_decode), not one segment forward
    per load (5 ops a whole expert, 7 a split one). Ops per MoE layer besides the predictor's, one by one before →
    grouped: ondemand 52 → 21 (every routed expert loaded whole: 8 × 5 → 9), lru 56.2 → 36.5, moepic 62.8 → 35,
    uniform (θ = 0.5) 72 → 56 (a split expert's two down projections stay its own: 2 ops)."""
    from fmoe_cli import kernels

    monkeypatch.setattr(kernels, "library", lambda: None)
    ops, shape = decode_step_ops(ops_checkpoints["qwen3-a3b-top8"], policy, grouping=True, device_side=True,
                                 cached=0.25)
    assert ops["layers"] == shape.num_layers and shape.top_k == 8
    per_layer = (ops["segments"] * ops["ops_per_segment"] + ops["split_experts"] * ops["ops_per_split_expert"]
                 + ops["layers"] * ops["ops_per_layer_besides_segments"]) / ops["layers"]
    assert per_layer <= bound, (per_layer, ops["by_op"])
    assert ops["by_op"]["segment:_grouped_mm"] >= 3, ops["by_op"]


@pytest.mark.skipif(not __import__("fmoe_cli.kernels").kernels.library(), reason="no C compiler")
@pytest.mark.parametrize("policy", ["resident", "uniform"])
def test_host_work_in_ops_with_the_cpu_kernels(ops_checkpoints, policy):
    """On the CPU the expert kernels compute a segment in one call, whose result is its one op; a split
    expert's top and bottom are two calls (the bottom continues the top's float32 accumulator)."""
    ops, shape = decode_step_ops(ops_checkpoints["qwen3-a3b-top8"], policy)
    if policy == "uniform":
        assert ops["split_experts"] >= shape.num_layers * shape.top_k and ops["ops_per_split_expert"] <= 2, ops
    else:
        assert 0 < ops["ops_per_segment"] <= 1, ops["by_op"]
    assert ops["ops_per_layer_besides_segments"] <= 12, ops["by_op"]


@pytest.mark.skipif(not __import__("fmoe_cli.kernels").kernels.library(), reason="no C compiler")
@pytest.mark.parametrize("policy, bound", [("resident", 6), ("cache-only", 6), ("ondemand", 14), ("uniform", 8)])
def test_a_decode_layers_engine_ops_with_the_cpu_kernels(ops_checkpoints, policy, bound):
    """The engine part of a decode step on the CPU (K = 8), counted in ops per MoE layer besides the predictor's: a
    layer whose experts are all whole (resident, whole cache hits) is 6: the routing's one copy to a host list
    (`tolist`: 2), one kernel call for its K experts (their output buffer: 1) and the weighted sum (the weights'
    transpose, the product, the sum over K: no gather). A layer that loads adds one output buffer per loaded whole
    expert, or for the split experts' tops one and its split into K (their bottoms continue them in place), and
    the outputs' concatenation before the sum."""
    ops, shape = decode_step_ops(ops_checkpoints["qwen3-a3b-top8"], policy)
    assert ops["layers"] == shape.num_layers and shape.top_k == 8
    per_layer = (ops["segments"] * ops["ops_per_segment"] + ops["split_experts"] * ops["ops_per_split_expert"]
                 + ops["layers"] * ops["ops_per_layer_besides_segments"]) / ops["layers"]
    assert per_layer <= bound, ops["by_op"]
    if policy in ("resident", "cache-only"):  # every activated expert whole: one call, no gather
        assert ops["segments"] == ops["layers"] * shape.top_k and "layer:cat" not in ops["by_op"], ops["by_op"]


@pytest.mark.skipif(not __import__("fmoe_cli.kernels").kernels.library(), reason="no C compiler")
@pytest.mark.parametrize("dtype, experts", [("float32", "bf16"), ("bfloat16", "bf16"), ("float32", "int4")])
def test_every_policy_gives_the_resident_decode_logits_bit_for_bit(ops_checkpoints, dtype, experts):
    """Each decode step's logits, not only its token, are the same bits under every policy on the CPU (K = 8): the
    resident layers' one-call path (all experts whole: stacked outputs in routing order) and the loading
    policies' path (top + bottom, loaded whole experts, their outputs gathered) weight and sum the same rows
    in the same order."""
    from fmoe_cli.planning.presets import make_settings

    lm = load_model(str(ops_checkpoints["qwen3-a3b-top8"]), device="cpu", dtype=dtype, experts=experts)
    shape = lm.shape  # K = 8: a sum in another order would differ
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(None), lm.device, lm.dtype)
    engine.install(lm.model)
    steps = []
    hook = lm.model.get_output_embeddings().register_forward_hook(lambda m, a, out: steps.append(out.clone()))
    logits = {}
    try:
        for policy, theta in [("resident", None), ("cache-only", None), ("uniform", 0.5), ("ondemand", None)]:
            engine.configure(make_settings(policy, shape, 2 * shape.top_k * shape.expert_bytes
                                           + shape.all_experts_bytes // 2, theta=theta))
            steps.clear()
            for _ in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=6, stop_on_eos=False):
                pass
            logits[policy] = list(steps)
    finally:
        hook.remove()
        engine.close()
    want = logits.pop("resident")
    assert len(want) == 6
    for policy, got in logits.items():
        assert all(torch.equal(a, b) for a, b in zip(got, want)), policy


@pytest.mark.parametrize("policy", ["resident", "cache-only"])
def test_grouped_experts_give_transformers_tokens(ops_checkpoints, policy, monkeypatch):
    """The device path's grouping (store.grouping: a layer's whole experts of one buffer in torch's grouped
    matmul), run on the CPU behind a link that copies (a device's caches: their own buffers, not views of the host
    store): greedy tokens equal transformers' generate, and the grouped form really ran."""
    import transformers

    from fmoe_cli import kernels
    from fmoe_cli.offload import layout
    from fmoe_cli.planning.presets import make_settings

    path = ops_checkpoints["qwen3-a3b-top8"]
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    want = reference.generate(PROMPT, max_new_tokens=8, do_sample=False)[0, PROMPT.shape[1]:].tolist()
    monkeypatch.setattr(kernels, "library", lambda: None)
    grouped = []
    real = layout.grouped_forward
    monkeypatch.setattr(layout, "grouped_forward", lambda x, segments, act: grouped.append(len(segments)) or
                        real(x, segments, act))
    lm = load_model(str(path), device="cpu", dtype="float32")
    lm.store.grouping = True
    shape = lm.shape
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(None, copy=True), lm.device, lm.dtype)
    engine.install(lm.model)
    engine.configure(make_settings(policy, shape, 2 * shape.top_k * shape.expert_bytes + shape.all_experts_bytes))
    got = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=8,
                                               stop_on_eos=False)]
    engine.close()
    assert got == want
    assert grouped and max(grouped) == shape.top_k


def test_each_load_is_polled_once_per_pass(mixtral, monkeypatch):
    """Issue 20 §6: the compute loop polls every loading transfer once per pass and then computes the done
    ones and the rest in order, not one load per pass with a poll of every other one (O(n²) polls)."""
    from fmoe_cli.planning.presets import make_settings

    lm, shape = mixtral, mixtral.shape
    clock = VirtualClock()
    link = EmulatedLink(1, clock=clock)  # slow: no load is done when the layer first looks
    engine = Engine(lm.layers, lm.store, shape, link, lm.device, lm.dtype)
    engine.install(lm.model)
    engine.configure(make_settings("ondemand", shape, 2 * shape.top_k * shape.expert_bytes))
    polls = []
    real = EmulatedLink.poll
    monkeypatch.setattr(EmulatedLink, "poll", lambda self, t: polls.append(t) or real(self, t))
    steps = stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=3, stop_on_eos=False)
    next(steps)
    polls.clear()
    next(steps)  # a decode step: K loads per layer
    engine.close()
    assert len(polls) == shape.num_layers * shape.top_k


@pytest.mark.parametrize("experts", ["bf16", "int8", "int4", "int2"])
@pytest.mark.parametrize("policy", ["resident", "ondemand"])
def test_prefill_computes_each_activated_expert_once_over_all_its_tokens(checkpoints, experts, policy, monkeypatch):
    """Issue 21 §1: a prefill groups tokens by expert, in every format: one segment forward per activated
    expert of a layer over all the tokens routed to it (not one per token), whether the expert is on the
    device (resident) or loaded in waves through a staging pool smaller than the activated set (ondemand)."""
    from fmoe_cli.offload.store import HostStore
    from fmoe_cli.planning.presets import make_settings

    lm = load_model(str(checkpoints["mixtral"]), device="cpu", dtype="float32", experts=experts)
    shape = lm.shape
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(None), lm.device, lm.dtype)
    engine.install(lm.model)
    engine.configure(make_settings(policy, shape, 2 * shape.top_k * shape.expert_bytes))
    if policy == "ondemand":
        assert engine.settings.plan.staging_slots < shape.num_experts  # waves
    routed = []  # per MoE layer forward: (token, expert) pairs
    engine.observers.append(lambda event: routed.append(
        {(t, e) for t, row in enumerate(event.top_k_index.tolist()) for e in row}))
    rows_per_call = []  # tokens of each segment the engine asks the store for (one call, or one of a grouped call)
    store_class, inside = type(lm.store), []
    assert store_class is HostStore or experts != "bf16"
    for name, xs_of in (("segment_forward", lambda args: [args[0]]), ("segments_forward", lambda args: args[0])):
        def spy(self, *args, _real=getattr(store_class, name), _xs_of=xs_of, **kwargs):
            if not inside:  # the engine's call, not one the store makes for itself
                rows_per_call.extend(x.shape[0] for x in _xs_of(args))
            inside.append(1)
            try:
                return _real(self, *args, **kwargs)
            finally:
                inside.pop()
        monkeypatch.setattr(store_class, name, spy)
    with torch.no_grad():
        lm.model(PROMPT)
    engine.close()
    assert len(routed) == shape.num_layers
    want = sorted(sum(1 for _t, e in pairs if e == expert)  # each activated expert: its token count
                  for pairs in routed for expert in {e for _t, e in pairs})
    assert sorted(rows_per_call) == want
    assert max(want) > 1  # some expert really has several tokens


def test_whole_expert_policies_give_the_same_bits(mixtral):
    """Every policy that computes each expert whole gives the same logits bit for bit, decode steps
    included: where an expert's weights come from (the resident buffer, a staging slot, a prefetch) and
    how many are grouped in one call never changes the arithmetic, and the weighted sum runs in one
    fixed order (issue 20 §6)."""
    from fmoe_cli.generate import next_logits
    from fmoe_cli.planning.presets import make_settings
    from transformers import DynamicCache

    lm, shape = mixtral, mixtral.shape
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(None), lm.device, lm.dtype)
    engine.install(lm.model)
    logits = {}
    for policy in ("resident", "ondemand", "prefetch-only"):
        engine.configure(make_settings(policy, shape, 2 * shape.top_k * shape.expert_bytes))
        cache = DynamicCache(config=lm.model.config)
        with torch.no_grad():
            steps = [next_logits(lm.model, PROMPT, cache)]  # a prefill, then decode steps
            steps += [next_logits(lm.model, torch.tensor([[t]]), cache) for t in (9, 33, 71, 5)]
        logits[policy] = torch.stack(steps)
    engine.close()
    assert torch.equal(logits["resident"], logits["ondemand"]) and torch.equal(logits["resident"],
                                                                              logits["prefetch-only"])


def test_a_decode_layer_whose_experts_are_all_whole_skips_the_loads_machinery(checkpoints, monkeypatch):
    """torch's path (a GPU's): a decode layer whose routed experts are all whole on the device computes them in one
    `segments_forward` call and combines them, without the loads' machinery (`_compute`: nothing to submit, acquire
    or admit) — a resident layer by `_resident_decode` (no Routing, no Hits), a cache's whole hits (lru with room for
    every expert) by `_whole_decode`; their logits are those of the path that loads every expert (ondemand), bit for
    bit."""
    from fmoe_cli.generate import next_logits
    from fmoe_cli.offload.engine import Engine as EngineClass
    from fmoe_cli.planning.presets import make_settings
    from transformers import DynamicCache

    monkeypatch.setattr(kernels, "library", lambda: None)  # torch's matmuls: the device's expert compute
    lm = load_model(str(checkpoints["mixtral"]), device="cpu", dtype="float32")
    shape = lm.shape
    calls = []
    for name in ("_compute", "_whole_decode", "_resident_decode"):
        real = getattr(EngineClass, name)
        monkeypatch.setattr(EngineClass, name, lambda self, i, *a, real=real, name=name, **kw: (
            calls.append(name) if a[2 if name == "_resident_decode" else 1].shape[0] == 1 else None) or real(self, i, *a, **kw))
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(None), lm.device, lm.dtype)
    engine.install(lm.model)
    logits, counts = {}, {}
    everything = 2 * shape.top_k * shape.expert_bytes + shape.all_experts_bytes
    for policy, budget in (("resident", everything), ("lru", everything), ("ondemand", 0)):
        budget += 2 * shape.top_k * shape.expert_bytes
        # lru caching all experts but one whole in every layer (a layer caching them all would be resident: types.py
        # Plan.resident_layer): the general path's caches, most steps' experts all in them
        plan = replace(uniform_plan(shape, budget, 1.0, source="lru"), layers=(
            layer_plan(shape, shape.num_experts - 1, 1.0),) * shape.num_layers) if policy == "lru" else None
        engine.configure(make_settings(policy, shape, budget, plan=plan))
        assert not engine.settings.prefetch or policy == "lru"
        engine.settings = replace(engine.settings, prefetch=False)
        cache = DynamicCache(config=lm.model.config)
        with torch.no_grad():
            steps = [next_logits(lm.model, PROMPT, cache)]  # a prefill (every expert activated), then decode steps
            calls.clear()
            steps += [next_logits(lm.model, torch.tensor([[t]]), cache) for t in (9, 33, 71, 5)]
        logits[policy], counts[policy] = torch.stack(steps), sorted(set(calls))
        assert len(calls) == 4 * shape.num_layers, (policy, calls)
    engine.close()
    assert counts["resident"] == ["_resident_decode"] and counts["ondemand"] == ["_compute"]
    assert "_whole_decode" in counts["lru"]  # (a layer may still miss an expert the prompt did not activate)
    assert torch.equal(logits["resident"], logits["ondemand"]) and torch.equal(logits["lru"], logits["ondemand"])


def test_an_admission_on_the_cpu_runs_on_the_calling_thread(mixtral, monkeypatch):
    """A whole loaded expert's top goes into its cache slot on the calling thread (offload/link.py `device_copy`),
    never through torch's copy over its intra-op threads: a top is the one tensor of a decode step large enough for
    torch to split, and the OpenMP worker it woke sleeps between ops (OMP_WAIT_POLICY=PASSIVE), so each admission
    waited for a wake: 0.24 ms mean on the demo on a quiet machine and 0.59-0.95 ms at a load of 4-5 (2 threads),
    against 0.09-0.11 ms on the calling thread (docs/bench.md § `moepic` across links). Spied: every Tensor.copy_
    into a cache slot while torch has more than one thread. The slots then hold the store's rows, bit for bit. (A
    link that copies: behind one that hands out the store's rows, a slot is a view of them, nothing is copied.)"""
    from fmoe_cli.planning.presets import make_settings

    lm, shape = mixtral, mixtral.shape
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(None, copy=True), lm.device, lm.dtype)
    engine.install(lm.model)
    engine.configure(make_settings("lru", shape, 4 * shape.top_k * shape.expert_bytes))
    slots = {state.tops.untyped_storage().data_ptr() for state in engine.layers if state.tops.numel()}
    assert slots
    on_team = []
    real = torch.Tensor.copy_

    def spy(self, src, *args, **kwargs):
        if torch.get_num_threads() > 1 and self.untyped_storage().data_ptr() in slots:
            on_team.append(tuple(self.shape))
        return real(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=6,
                                                   stop_on_eos=False)]
    finally:
        torch.set_num_threads(threads)
    c = engine.counters()
    for i, state in enumerate(engine.layers):
        for e in state.cache.cached():
            assert torch.equal(state.tops[state.cache.slot(e)], lm.store.expert(i, e)[: state.top_neurons])
    engine.close()
    monkeypatch.undo()
    assert c.misses > 0 and on_team == []
    assert got == want_tokens(lm, 6)


@pytest.mark.parametrize("copy", [False, True])
def test_a_cache_on_the_cpu_behind_a_link_that_moves_no_bytes_is_views_of_the_host_store(mixtral, copy):
    """The CPU is its own device: behind a link that hands out the host store's rows (the CPU's, copy=False), a cache
    slot is a view of the store's rows of the expert it holds, not a copy of them, so the caches hold no memory of
    their own (fmoe bench's default plans held 25 % of the experts a second time in RAM, issue 39 §6); a warm
    re-plan's rebuilt caches are views too. Behind a link that copies (a GPU's semantics, copy=True) the slots are
    the plan's own buffers, filled by copies, as before. Either way: the plan's device bytes, the resident run's
    tokens, and each cached slot the store's rows of its expert."""
    from fmoe_cli.planning.presets import make_settings

    lm, shape = mixtral, mixtral.shape
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(None, copy=copy), lm.device, lm.dtype)
    engine.install(lm.model)
    settings = make_settings("lru", shape, 4 * shape.top_k * shape.expert_bytes)
    engine.configure(settings)
    cache_bytes = sum(lp.cache_size * lp.top_neurons for lp in settings.plan.layers) * shape.neuron_bytes
    assert cache_bytes > 0 and engine.device_bytes() == cache_bytes + engine.pool.nbytes

    def held() -> tuple[int, int]:
        """(cached experts, bytes of memory the caches hold on the CPU); each slot checked against the store."""
        cached, nbytes = 0, 0
        for i, state in enumerate(engine.layers):
            assert state.aliased == (not copy)
            if state.tops.device.type == "cpu":
                nbytes += state.tops.untyped_storage().nbytes()
            for e, slot in state.cache.cached().items():
                top, rows = state.top(slot), lm.store.expert(i, e)[: state.top_neurons]
                assert torch.equal(top, rows)
                assert (top.data_ptr() == rows.data_ptr()) == (not copy)  # a view of the store, or a copy
                cached += 1
        return cached, nbytes

    got = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=6, stop_on_eos=False)]
    assert engine.counters().misses > 0
    cached, nbytes = held()
    assert cached > 0 and nbytes == (0 if not copy else cache_bytes)
    engine.configure(settings, warm=True)  # the rebuild after a re-plan: the caches refilled by priority
    cached, nbytes = held()
    assert cached > 0 and nbytes == (0 if not copy else cache_bytes)
    assert engine.device_bytes() == cache_bytes + engine.pool.nbytes
    again = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=6,
                                                 stop_on_eos=False)]
    engine.close()
    assert got == again == want_tokens(lm, 6)
