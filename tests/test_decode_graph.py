"""Issue 37 §1: decode steps replayed from CUDA graphs (generate.DecodeGraph): a resident step as one graph, a loading
policy's step as graph segments between the routing reads of its layers, each cut running the engine's experts
forward eagerly. This machine has no GPU: the graphs are tests/fake_graphs.py's recorder, no kinder than CUDA (the
captured Python does not run at a replay, what a capture computes is garbage until replayed, a host read while
capturing is refused). What is checked is DecodeGraph's logic — the static KV cache and its positions, capture after
warm-up steps, the cuts and their static tensors, the engine told which layers' routing each segment copied, the
embedding hook's work at each replay — and the eager fallback. Whether CUDA captures the segments, and what they save
in time, only a GPU can say (benchmarks/gpu_check.py)."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
import transformers

import fake_gpu  # tests/fake_gpu.py
from fake_graphs import CAPTURING, RecordedGraphs  # tests/fake_graphs.py
from fmoe_cli import kernels
from fmoe_cli.generate import DecodeGraph, StepCapture, stream_generate
from fmoe_cli.models.demo import TINY_FAMILIES
from fmoe_cli.models.load import load_model
from fmoe_cli.offload.engine import Engine
from fmoe_cli.offload.link import CudaLink, EmulatedLink, VirtualClock
from fmoe_cli.planning.plan import uniform_plan
from fmoe_cli.planning.presets import make_settings
from fmoe_cli.profiling.ops import count_host_waits
from fmoe_cli.types import EngineSettings, Timings

PROMPT = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11, 64, 128]])
NEW_TOKENS = 12
TIMINGS = Timings(t_att=1e-4, t_moe=2e-4, t_head=1e-4, t_load=3e-4, top_k=2)  # moepic's configurator (as exactness)


class FailingGraphs(RecordedGraphs):
    """A capture refused at its `fail_at`-th segment (0: the first), as CUDA refuses one."""

    fail_at = 0

    def begin(self) -> None:
        if len(self.segments) == self.fail_at:
            raise RuntimeError(CAPTURING)
        super().begin()


def reference_tokens(path, tokens: int = NEW_TOKENS) -> list[int]:
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    return reference.generate(PROMPT, max_new_tokens=tokens, do_sample=False)[0, PROMPT.shape[1]:].tolist()


def device_path_engine(path, graph_factory, monkeypatch, veto=None, link=None):
    """The model at `path` and an engine on the device's path (torch's matmuls, device_side) over `link` (default an
    instant emulated link), DecodeGraph's graphs made by `graph_factory` (None: none, as on the CPU)."""
    monkeypatch.setattr(kernels, "library", lambda: None)  # torch's matmuls: the device's path
    lm = load_model(str(path), device="cpu", dtype="float32")
    if hasattr(lm.model, "decode_token"):
        lm.model.decode_token.enabled = False
    engine = Engine(lm.layers, lm.store, lm.shape, link if link is not None else EmulatedLink(None), lm.device,
                    lm.dtype)
    engine.device_side = True
    engine.graph_factory = graph_factory
    engine.graph_veto = veto
    engine.install(lm.model)
    return lm, engine


def budget(shape) -> int:
    return shape.all_experts_bytes // 2 + 2 * shape.top_k * shape.expert_bytes


def generate(path, graph_factory, monkeypatch, family_tokens=NEW_TOKENS, policy="resident", veto=None):
    lm, engine = device_path_engine(path, graph_factory, monkeypatch, veto)
    shape = lm.shape
    engine.configure(make_settings(policy, shape, budget(shape), timings=TIMINGS))
    runs, counted = [], []
    for _ in range(2):  # the second generation replays the first one's graphs
        before = engine.counters()
        runs.append([e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine,
                                                         max_new_tokens=family_tokens, stop_on_eos=False)])
        counted.append(engine.counters() - before)
    graphs = dict(engine.decode_graphs)
    engine.close()
    assert runs[0] == runs[1] and counted[0].activations == counted[1].activations
    if policy == "resident":  # every layer's routing bookkept (all whole); the host waited only in the prefill
        assert counted[0].hits_full == counted[0].activations > 0 and counted[0].host_waits == shape.num_layers
    return runs[0], graphs, counted[0]


# --- the recorder itself: no kinder than CUDA -----------------------------------------------------------------------
def test_the_recorder_replays_what_was_captured_and_leaves_garbage_until_then():
    x, total = torch.tensor([1.0, 2.0]), torch.zeros(2)
    graphs = RecordedGraphs(None)
    graphs.begin()
    y = x * 2 + 1  # allocated by the capture
    total.add_(y)  # written into a tensor from before
    index = torch.argmax(y)
    graphs.end()
    assert torch.isnan(y).all() and torch.equal(total, torch.zeros(2))  # nothing ran; what it made is garbage
    assert int(index) == torch.iinfo(torch.long).max
    x.copy_(torch.tensor([3.0, -1.0]))
    graphs.replay(0)
    assert torch.equal(y, torch.tensor([7.0, -1.0])) and torch.equal(total, y) and int(index) == 0
    graphs.replay(0)
    assert torch.equal(total, 2 * y)  # the in-place add ran again


@pytest.mark.parametrize("read", [lambda t: t.sum().item(), lambda t: int(t[0]), lambda t: bool(t[0]), lambda t: t.tolist(),
                                  lambda t: t.cpu(), lambda t: t.nonzero(), lambda t: t[t > 0]],
                         ids=["item", "int", "bool", "tolist", "cpu", "nonzero", "mask"])
def test_the_recorder_refuses_a_host_read_while_capturing(read):
    graphs = RecordedGraphs(None)
    graphs.begin()
    with pytest.raises(RuntimeError, match=CAPTURING):
        read(torch.arange(3) + 1)
    graphs.abort()
    assert read(torch.arange(3) + 1) is not None  # not capturing: allowed


# --- a resident step: one graph ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_replayed_decode_steps_give_the_eager_tokens(checkpoints, family, monkeypatch):
    path = checkpoints[family]
    want = reference_tokens(path)
    eager, none, eager_counted = generate(path, None, monkeypatch)  # no factory on the CPU: the eager step
    assert not none and eager == want
    RecordedGraphs.reset()
    replayed, graphs, counted = generate(path, RecordedGraphs, monkeypatch)
    assert replayed == want and counted.activations == eager_counted.activations
    (graph,) = graphs.values()
    assert graph.segments == 1 and graph.captured.graphed == [list(range(len(graph.engine.layers)))]
    assert RecordedGraphs.captured == 1 and RecordedGraphs.replayed == 2 * (NEW_TOKENS - 1)  # every step replayed


@pytest.mark.parametrize("fail_at", [0, 2])
def test_a_capture_that_fails_runs_the_step_eagerly_with_one_line(checkpoints, monkeypatch, capsys, fail_at):
    """Refused at the first segment (a resident step), or in the middle of a segmented one (lru)."""
    path = checkpoints["qwen3_moe"]
    policy = "resident" if fail_at == 0 else "lru"
    eager, _, eager_counted = generate(path, None, monkeypatch, policy=policy)
    FailingGraphs.fail_at = fail_at
    RecordedGraphs.reset()
    got, graphs, counted = generate(path, FailingGraphs, monkeypatch, policy=policy)
    assert got == eager and counted.misses == eager_counted.misses
    assert all(graph.eager and graph.segments == 0 for graph in graphs.values())
    assert RecordedGraphs.captured == fail_at and RecordedGraphs.replayed == 0
    err = capsys.readouterr().err
    assert err.count("CUDA graphs: the decode step could not be captured") == 1


def test_a_layer_that_reads_the_host_cannot_hide_in_a_graph(checkpoints, monkeypatch, capsys):
    """Were lru's layers computed inside the graph (no cut), their routing read would run in the capture: refused, as
    CUDA refuses it, and the step runs eagerly with one line."""
    path = checkpoints["qwen3_moe"]

    def no_cut(capture, i, experts, *inputs):
        engine = experts._fmoe_engine
        engine.capturing = None
        try:
            return engine.experts_forward(experts, *inputs)
        finally:
            engine.capturing = capture

    monkeypatch.setattr(StepCapture, "graph_break", no_cut)
    RecordedGraphs.reset()
    lm, engine = device_path_engine(path, RecordedGraphs, monkeypatch)
    engine.configure(make_settings("lru", lm.shape, budget(lm.shape)))
    got = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=NEW_TOKENS,
                                               stop_on_eos=False)]
    (graph,) = engine.decode_graphs.values()
    engine.close()
    assert got == reference_tokens(path) and graph.eager and graph.segments == 0
    assert RecordedGraphs.made == 1 and RecordedGraphs.captured == RecordedGraphs.replayed == 0
    assert "could not be captured (operation not permitted when stream is capturing" in capsys.readouterr().err


@pytest.mark.parametrize("policy", ["resident", "lru"])
def test_fmoe_cuda_graphs_0_decodes_eagerly_on_the_static_cache(checkpoints, monkeypatch, policy):
    path = checkpoints["qwen3_moe"]
    monkeypatch.setenv("FMOE_CUDA_GRAPHS", "0")
    RecordedGraphs.reset()
    got, graphs, _ = generate(path, RecordedGraphs, monkeypatch, policy=policy)
    assert got == reference_tokens(path) and RecordedGraphs.made == RecordedGraphs.replayed == 0
    assert len(graphs) == 1 and all(g.eager and g.segments == 0 and g.length > 0 for g in graphs.values())


def test_a_veto_keeps_a_plan_eager(checkpoints, monkeypatch):
    """`Engine.graph_veto` (fmoe bench --replay-routing: a routing Python picks token by token, which a graph would
    freeze at the capture's token): the steps run eagerly on the static cache, none replayed, segments neither."""
    path = checkpoints["qwen3_moe"]
    RecordedGraphs.reset()
    replayed, _, _ = generate(path, RecordedGraphs, monkeypatch)
    assert RecordedGraphs.replayed > 0
    for policy in ("resident", "lru"):
        RecordedGraphs.reset()
        vetoed, graphs, _ = generate(path, RecordedGraphs, monkeypatch, veto="routing replayed", policy=policy)
        assert vetoed == replayed and RecordedGraphs.made == 0 and all(g.eager for g in graphs.values())


# --- a loading policy's step: segments between the routing reads -----------------------------------------------------
def loading_settings(shape) -> dict[str, EngineSettings]:
    """Every policy that loads experts (the configurator's moepic, the uniform ones) and two host-lane plans."""
    out = {name: make_settings(name, shape, budget(shape), timings=TIMINGS, theta=0.5 if name == "uniform" else None)
           for name in ("moepic", "lru", "lfu", "uniform", "cache-only", "ondemand", "prefetch-only")}
    split, whole = uniform_plan(shape, budget(shape), 0.5), uniform_plan(shape, budget(shape), 1.0)
    out["host bottoms"] = EngineSettings("host bottoms", replace(split, layers=tuple(
        replace(layer, host=True) for layer in split.layers)), "lcp", True, 128.0, 0.25)
    out["alternating link / host"] = EngineSettings("alternating", replace(whole, layers=tuple(
        replace(layer, host=i % 2 == 0) for i, layer in enumerate(whole.layers))), "lcp", True, 128.0, 0.25)
    return out


COUNTED = ("activations", "hits_full", "hits_top", "misses", "bytes_demand", "bytes_prefetch", "prefetch_issued",
           "prefetch_used", "needed_loads", "prefetch_covered", "host_segments", "predicts", "host_waits")


def decode_each(lm, engine, settings, segmented: bool, monkeypatch):
    """Two generations of `settings` from a fresh plan, segmented or eager (FMOE_CUDA_GRAPHS=0) on the static cache:
    their tokens, the counters that decide (not times) with the passes the predictor was shown (the embedding hook's
    work: each pass's index and its embedding's sum), the segments of the DecodeGraph."""
    monkeypatch.setenv("FMOE_CUDA_GRAPHS", "1" if segmented else "0")
    engine.configure(settings)
    passes = []
    real_begin = engine.predictor.begin

    def begin(it):
        passes.append((it.index, None if it.embedding is None else float(it.embedding.sum())))
        return real_begin(it)

    monkeypatch.setattr(engine.predictor, "begin", begin)
    runs = [[e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=NEW_TOKENS,
                                                 stop_on_eos=False)] for _ in range(2)]
    monkeypatch.setattr(engine.predictor, "begin", real_begin)
    counters = engine.counters()
    (graph,) = engine.decode_graphs.values()
    assert len(passes) == (2 * NEW_TOKENS if settings.prefetch else 0)
    return runs, {"passes": passes, **{name: getattr(counters, name) for name in COUNTED}}, graph.segments


@pytest.mark.parametrize("link", ["emulated", "cuda"])
def test_every_loading_policy_decodes_through_segments_with_the_eager_tokens(checkpoints, monkeypatch, link):
    """Each MoE layer of a loading policy cuts the step (its routing read): layers + 1 segments, all replayed every
    token, the eager step's tokens (transformers'). On the emulated link (a virtual clock) the same hits, loads,
    prefetches and host waits as the eager step; on CudaLink over the NaN-filling fake GPU (tests/fake_gpu.py), whose
    copies land when they land, the same tokens."""
    path = checkpoints["qwen3_moe"]
    want = reference_tokens(path)
    with fake_gpu.installed() if link == "cuda" else contextlib.nullcontext() as gpu:
        made = CudaLink(torch.device("cuda"), chunk_bytes=4096) if link == "cuda" else EmulatedLink(
            gbps=20, clock=VirtualClock(), copy=True)
        lm, engine = device_path_engine(path, RecordedGraphs, monkeypatch, link=made)
        layers = lm.shape.num_layers
        try:
            for name, settings in loading_settings(lm.shape).items():
                eager, eager_counted, none = decode_each(lm, engine, settings, False, monkeypatch)
                RecordedGraphs.reset()
                got, counted, segments = decode_each(lm, engine, settings, True, monkeypatch)
                assert eager == got == [want, want], name
                assert none == 0 and segments == RecordedGraphs.captured == layers + 1, name
                assert RecordedGraphs.replayed == 2 * (NEW_TOKENS - 1) * (layers + 1), name
                assert counted["misses"] + counted["hits_top"] > 0, name  # it really loaded
                if name.startswith(("host", "alternating")):
                    assert counted["host_segments"] > 0, name
                if link == "emulated":
                    assert counted == eager_counted, name
        finally:
            engine.close()
        if gpu is not None:
            assert gpu.chunks_played == gpu.chunks_issued > 0


@pytest.mark.parametrize("link", ["emulated", "cuda"])
def test_grouped_loads_decode_through_segments_with_the_eager_tokens(tmp_path_factory, monkeypatch, link):
    """K = 8 with the store's grouping on (a GPU's): at each cut a loading layer computes its loaded whole experts in
    one grouped call over the staging pool's slots (Engine._loaded_decode), with the eager step's tokens
    (transformers') and, on the emulated link, its counters; on CudaLink over the NaN-filling fake GPU the same
    tokens."""
    from fmoe_cli.models.demo import build_random_moe
    from fmoe_cli.offload import layout

    path = build_random_moe(tmp_path_factory.mktemp("top8") / "qwen3-top8", family="qwen3_moe", seed=1,
                            num_experts=16, num_experts_per_tok=8)
    want = reference_tokens(path)
    grouped = []
    real = layout.grouped_forward


    def pooled(x, segments, act):  # a grouped call over the staging pool's slots (a cache's experts: their own stack)
        if segments[0].stack is engine.pool.stacked_rows(lm.store)[0].stack:
            grouped.append(len(segments))
        return real(x, segments, act)

    monkeypatch.setattr(layout, "grouped_forward", pooled)
    with fake_gpu.installed() if link == "cuda" else contextlib.nullcontext():
        made = CudaLink(torch.device("cuda"), chunk_bytes=4096) if link == "cuda" else EmulatedLink(
            gbps=20, clock=VirtualClock(), copy=True)
        lm, engine = device_path_engine(path, RecordedGraphs, monkeypatch, link=made)
        lm.store.grouping = True
        shape = lm.shape
        timings = replace(TIMINGS, top_k=shape.top_k)
        try:
            for name in ("lru", "ondemand", "moepic"):
                settings = make_settings(name, shape, budget(shape) // 2, timings=timings)
                eager, eager_counted, _ = decode_each(lm, engine, settings, False, monkeypatch)
                RecordedGraphs.reset()
                grouped.clear()
                got, counted, segments = decode_each(lm, engine, settings, True, monkeypatch)
                assert eager == got == [want, want], name
                assert segments == shape.num_layers + 1 and counted["misses"] > 0, name
                assert grouped, name  # the loads really went through torch's grouped matmul, over the pool
                if link == "emulated":
                    assert counted == eager_counted, name
        finally:
            engine.close()


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_lru_decodes_through_segments_in_every_family(checkpoints, monkeypatch, family):
    """Every family's layers (shared experts, a dense first layer, MLA, group-limited routing) cut at their MoE
    layers' routing reads: MoE layers + 1 segments, transformers' tokens, the eager step's counters."""
    path = checkpoints[family]
    lm, engine = device_path_engine(path, RecordedGraphs, monkeypatch,
                                    link=EmulatedLink(gbps=20, clock=VirtualClock(), copy=True))
    settings = make_settings("lru", lm.shape, budget(lm.shape))
    try:
        eager, eager_counted, _ = decode_each(lm, engine, settings, False, monkeypatch)
        got, counted, segments = decode_each(lm, engine, settings, True, monkeypatch)
    finally:
        engine.close()
    assert eager == got == [reference_tokens(path)] * 2 and counted == eager_counted
    assert segments == lm.shape.num_layers + 1 and counted["misses"] > 0


@pytest.mark.parametrize("policy", ["moepic", "lru", "lfu", "cache-only"])
def test_a_model_that_fits_decodes_as_one_graph_whatever_the_policy(checkpoints, monkeypatch, policy):
    """Issue 37 §1: "a step whose experts are all resident (policy resident, or a model that fits) is one graph". A
    budget that holds every expert whole gives any caching policy's plan every expert in every layer
    (planning/presets.py `settings_for`): it runs as resident — filled when configured, no staging pool, no
    prefetch, every layer graphed — one segment a step, transformers' tokens, every activation a whole hit with no
    byte moved. One expert less and the same policy loads: a segment per layer."""
    path = checkpoints["qwen3_moe"]
    want = reference_tokens(path, 8)
    lm, engine = device_path_engine(path, RecordedGraphs, monkeypatch)
    shape = lm.shape
    fits = shape.all_experts_bytes + 2 * shape.top_k * shape.expert_bytes
    for budget, one_graph in ((fits, True), (fits - shape.expert_bytes - 2 * shape.top_k * shape.expert_bytes, False)):
        settings = make_settings(policy, shape, budget, timings=TIMINGS)
        assert settings.plan.resident == one_graph and (settings.plan.staging_slots == 0) == one_graph
        engine.configure(settings)
        before = engine.counters()
        got = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=8,
                                                   stop_on_eos=False)]
        counted = engine.counters() - before
        (graph,) = [g for g in engine.decode_graphs.values() if g.segments]
        assert got == want, (policy, one_graph)
        if one_graph:
            assert graph.segments == 1 and counted.hits_full == counted.activations > 0
            assert counted.bytes_demand == counted.bytes_prefetch == 0 and counted.predicts == 0
        else:
            assert graph.segments == shape.num_layers + 1 and counted.bytes_demand > 0
    engine.close()


@pytest.mark.parametrize("policy", ["resident", "lru", "ondemand", "prefetch-only", "uniform"])
def test_host_waits_of_a_segmented_step(checkpoints, monkeypatch, policy):
    """Counted on CudaLink over the fake GPU (as tests/test_host_waits.py): a replayed step waits for the device at
    most once per MoE layer, at its routing read (`read_to_host`, in the cut), never in a graphed layer (resident:
    none), and once outside the experts (the sampled token)."""
    path = checkpoints["qwen3_moe"]
    with fake_gpu.installed():
        lm, engine = device_path_engine(path, RecordedGraphs, monkeypatch,
                                        link=CudaLink(torch.device("cuda"), chunk_bytes=4096))
        shape = lm.shape
        engine.configure(make_settings(policy, shape, budget(shape), theta=0.5 if policy == "uniform" else None))
        steps = stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=6, stop_on_eos=False)
        got = [next(steps).token_id for _ in range(3)]
        (graph,) = engine.decode_graphs.values()
        static = [graph.logits, *(t for cut in graph.captured.breaks
                                  for t in (cut.hidden_states, cut.top_k_index, cut.top_k_weights, cut.out))]
        counts = []
        for _ in range(3):
            box = []
            counts.append(count_host_waits(lambda: box.append(next(steps)), engine, lm.model, inputs=static))
            got.append(box[0].token_id)
        engine.close()
    assert got == reference_tokens(path, 6)
    assert graph.segments == (1 if policy == "resident" else shape.num_layers + 1)
    for count in counts:
        assert count["moe_layers"] == (0 if policy == "resident" else shape.num_layers), count
        moe_waits = count["waits"].get("moe", 0)
        if policy == "resident":
            assert moe_waits == 0 and count["waits"].get("settle", 0) == 0, count["where"]
        else:
            assert 0 < moe_waits <= shape.num_layers, count["where"]
            assert {w for w in count["where"] if w.startswith("moe:")} == {"moe:read_to_host"}, count["where"]
        assert count["where"].get("other:__int__") == count["waits"]["other"] == 1, count["where"]


def test_a_resident_plan_whose_grouped_matmul_is_refused_decodes_through_segments(checkpoints, monkeypatch):
    """Float32 on a GPU: torch's grouped matmul refuses the dtype, so resident layers read their routing on the host
    (`Engine._resident_decode`); the step is then cut at every layer, L + 1 segments, with transformers' tokens and
    the eager step's counters (where it used to run eagerly)."""
    path = checkpoints["qwen3_moe"]
    lm, engine = device_path_engine(path, RecordedGraphs, monkeypatch)
    engine._grouped_on_device = False  # what the first refused call leaves (Engine._resident_device_decode)
    settings = make_settings("resident", lm.shape, lm.shape.all_experts_bytes)
    try:
        eager, eager_counted, _ = decode_each(lm, engine, settings, False, monkeypatch)
        RecordedGraphs.reset()
        got, counted, segments = decode_each(lm, engine, settings, True, monkeypatch)
    finally:
        engine.close()
    assert eager == got == [reference_tokens(path)] * 2 and counted == eager_counted
    assert segments == RecordedGraphs.captured == lm.shape.num_layers + 1
    assert counted["hits_full"] == counted["activations"] > 0


def test_graphed_layers_between_cuts_are_bookkept_in_layer_order(checkpoints, monkeypatch):
    """A step whose graphed layers sit between cuts (here a resident plan with every odd layer taken as needing the
    host): segments [emb … layer 1's router] [… layer 3's router] [… logits], layers 0 and 2 inside them. The routing
    each segment copied is bookkept before the next cut runs: the observers see the layers in order, as eagerly."""
    path = checkpoints["qwen3_moe"]
    real = Engine.graphed_layer
    monkeypatch.setattr(Engine, "graphed_layer", lambda self, i: i % 2 == 0 and real(self, i))
    seen = {}
    for factory in (None, RecordedGraphs):
        lm, engine = device_path_engine(path, factory, monkeypatch)
        order = seen[factory] = []
        engine.observers.append(lambda event: order.append(event.layer))
        engine.configure(make_settings("resident", lm.shape, lm.shape.all_experts_bytes))
        tokens = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=NEW_TOKENS,
                                                      stop_on_eos=False)]
        assert tokens == reference_tokens(path)
        if factory is not None:
            (graph,) = engine.decode_graphs.values()
            assert graph.segments == 3 and graph.captured.graphed == [[0], [2], []]
            assert [cut.layer for cut in graph.captured.breaks] == [1, 3]
        engine.close()
    assert seen[RecordedGraphs] == seen[None] == list(range(4)) * NEW_TOKENS


@pytest.mark.parametrize("policy", ["cache-only", "lru"])
def test_a_layer_whose_cache_holds_every_expert_is_resident_in_a_loading_plan(checkpoints, monkeypatch, policy):
    """A plan whose layers 0 and 2 cache every expert whole (C = N, θ = 1) and whose layers 1 and 3 load: the full
    layers are filled when the engine is configured (no byte loaded there, every activation a whole hit from the
    first token) and, without a prefetcher (cache-only), decode as resident layers inside the graph segments: cuts
    at layers 1 and 3 only, 3 segments, where they were 5. With a prefetcher (lru) every layer still reads its routing
    on the host (the prediction for the next layer needs it): L + 1 segments, the full layers filled all the same.
    transformers' tokens in both; the eager step's too."""
    from fmoe_cli.planning.plan import layer_plan

    path = checkpoints["qwen3_moe"]
    want = reference_tokens(path)
    for factory in (None, RecordedGraphs):
        lm, engine = device_path_engine(path, factory, monkeypatch)
        shape = lm.shape
        loading = uniform_plan(shape, budget(shape), 1.0, source=policy)
        full = layer_plan(shape, shape.num_experts, 1.0)
        plan = replace(loading, layers=tuple(full if i % 2 == 0 else lp for i, lp in enumerate(loading.layers)))
        assert [plan.resident_layer(i, shape) for i in range(4)] == [True, False, True, False]
        engine.configure(make_settings(policy, shape, 0, plan=plan))
        assert engine.settings.prefetch == (policy == "lru")
        assert [state.resident for state in engine.layers] == [True, False, True, False]
        got = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=NEW_TOKENS,
                                                   stop_on_eos=False)]
        assert got == want, (policy, factory)
        for i, state in enumerate(engine.layers):
            c = state.counters
            if i % 2 == 0:
                assert c.hits_full == c.activations > 0 and c.bytes_demand == c.bytes_prefetch == 0, (i, c)
            else:
                assert c.bytes_demand > 0, (i, c)
        if factory is not None:
            (graph,) = engine.decode_graphs.values()
            if policy == "cache-only":
                assert graph.segments == 3 and graph.captured.graphed == [[0], [2], []]
            else:
                assert graph.segments == shape.num_layers + 1
        engine.close()


# --- a conversation ---------------------------------------------------------------------------------------------------
def chat_turns(path, graph_factory, monkeypatch, replan_between: bool = False, policy: str = "resident"):
    """Two turns of a chat session (chat and serve answer through ChatSession.generate) on the device's path; with a
    graph factory the conversation's KV cache is the engine's DecodeGraph (its StaticCache), as on a GPU.
    `replan_between`: the engine configured again between the turns, as an idle re-plan does."""
    from fmoe_cli.chat.session import ChatSession

    lm, engine = device_path_engine(path, graph_factory, monkeypatch)
    settings = make_settings(policy, lm.shape, lm.shape.all_experts_bytes if policy == "resident" else budget(lm.shape))
    engine.configure(settings)
    session = ChatSession(lm, engine, max_new_tokens=8, context=300)
    answers, reused, graphs = [], [], []
    prompts = ([5, 17, 42, 99, 7, 3], [11, 64, 128, 9])
    conversation: list[int] = []
    for turn, prompt in enumerate(prompts):
        if turn and replan_between:
            engine.configure(settings, warm=True)
        conversation = conversation + prompt
        events = list(session.generate(conversation, 8, session.sampling))
        answers.append([e.token_id for e in events])
        reused.append(session.reused)
        graphs.append(session._kv)
        conversation = conversation + answers[-1][:-3]  # the next turn shares less than the cache holds: a crop
    engine.close()
    return answers, reused, graphs


@pytest.mark.parametrize("policy", ["resident", "lru"])
def test_a_conversation_continues_on_the_static_cache_and_replays_its_steps(checkpoints, monkeypatch, policy):
    """Chat and serve on a GPU: the conversation's KV cache is the engine's DecodeGraph, kept between answers, cropped
    to the shared prefix and extended by the new turn, its decode steps replayed from graphs captured once (or, after
    a re-plan, once more: the graphs read the old plan's buffers, the cache is the conversation's) — the tokens of
    the CPU's growing cache, turn for turn."""
    path = checkpoints["qwen3_moe"]
    want, want_reused, caches = chat_turns(path, None, monkeypatch, policy=policy)
    assert not isinstance(caches[0], DecodeGraph) and want_reused[1] == 6 + len(want[0]) - 3
    segments = 1 if policy == "resident" else 5
    for replan, captures in ((False, 1), (True, 2)):
        RecordedGraphs.reset()
        got, reused, graphs = chat_turns(path, RecordedGraphs, monkeypatch, replan_between=replan, policy=policy)
        assert got == want and reused == want_reused  # the second turn pre-filled only what the first had not
        assert isinstance(graphs[0], DecodeGraph) and graphs[1] is graphs[0] and graphs[1].segments == segments
        assert RecordedGraphs.made == captures and RecordedGraphs.captured == captures * segments
        assert RecordedGraphs.replayed == 2 * (len(want[0]) - 1) * segments
        assert graphs[1].length == 6 + len(got[0]) - 3 + 4 + len(got[1]) - 1  # prompt, answer, prompt, answer


# --- what CUDA itself asks of the captures (torch.cuda stubbed as torch's source behaves) ---------------------------
class StubStream:
    def __init__(self, name: str, state) -> None:
        self.name, self.state = name, state

    def wait_stream(self, other) -> None:
        """An event recorded on a capturing stream cannot be waited on from outside the capture."""
        if any(graph.stream is other for graph in self.state.open):
            raise RuntimeError("cudaErrorStreamCaptureIsolation: a wait on a capturing stream")

    def __repr__(self) -> str:
        return self.name


def stub_cuda(monkeypatch, pool_size: int = 32):
    """torch.cuda as far as CudaGraphs and CudaLink use it: torch.cuda.Stream() hands out the next of `pool_size`
    pooled streams, round robin (c10's getStreamFromPool), and a capture ends only on the stream it began on
    (CUDAGraph::capture_end's check), and a stream does not wait on one that is capturing. Returns the state: the
    current stream, the captures still open."""
    import itertools
    import types

    import fmoe_cli.generate as generate_module

    state = types.SimpleNamespace(open=[])
    state.current = StubStream("default", state)
    pool = [StubStream(f"pool{i}", state) for i in range(pool_size)]
    draws = itertools.count()

    @contextlib.contextmanager
    def stream(s):
        previous, state.current = state.current, s
        try:
            yield
        finally:
            state.current = previous

    class Graph:
        def capture_begin(self, pool=None, capture_error_mode="global"):
            self.stream = state.current
            state.open.append(self)

        def capture_end(self):
            if state.current is not self.stream:
                raise RuntimeError("Capture must end on the same stream it began on.")
            state.open.remove(self)

    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: pool[next(draws) % pool_size])
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: state.current)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 1))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(generate_module, "_CAPTURE_STREAMS", {})
    return state


def stub_decode(link=None):
    import types
    return types.SimpleNamespace(engine=types.SimpleNamespace(device=torch.device("cuda", 0), link=link))


def test_a_capture_that_raises_is_ended_on_its_own_stream(monkeypatch):
    """A forward refused mid-capture (a host read, an allocation the pool cannot make) leaves `capturing` on the
    current stream: the capture is ended inside it, on the side stream it began on, not by the caller's abort on the
    default stream (which torch refuses, leaving the thread capturing and its next host read refused)."""
    from fmoe_cli.generate import CudaGraphs

    state = stub_cuda(monkeypatch)
    graphs = CudaGraphs(stub_decode())
    with pytest.raises(RuntimeError, match="not permitted"):
        with graphs.capturing():
            graphs.begin()
            raise RuntimeError("operation not permitted when stream is capturing")
    graphs.abort()  # DecodeGraph._capture's except clause: nothing left to end
    assert state.open == [] and state.current.name == "default"
    graphs = CudaGraphs(stub_decode())  # an abort from another stream ends the capture on its own stream
    with torch.cuda.stream(graphs.stream):
        graphs.begin()
    graphs.abort()
    assert state.open == []


def test_the_capture_stream_is_never_the_links_copy_stream(monkeypatch):
    """torch.cuda.Stream() draws the next of 32 pooled streams: captures that each drew one (re-plans, bench
    configurations, capacities) would reach the link's copy stream, and capture the copies it issues meanwhile."""
    from fmoe_cli.generate import CudaGraphs, capture_stream

    stub_cuda(monkeypatch)
    link = CudaLink(torch.device("cuda", 0), pump_thread=False)
    streams = [CudaGraphs(stub_decode(link)).stream for _ in range(40)]
    assert all(s is not link.stream for s in streams) and len(set(map(id, streams))) == 1
    for _ in range(32):  # a later link drawn onto the capture stream: the capture stream is drawn again
        newer = CudaLink(torch.device("cuda", 0), pump_thread=False)
        if newer.stream is streams[0]:
            break
    assert newer.stream is streams[0]
    assert capture_stream(torch.device("cuda", 0), newer.stream) is not newer.stream


def test_a_cuda_device_is_made_the_current_one(monkeypatch):
    """--device cuda:1: every CUDA call that names no device (the capture's stream and synchronize, an event's
    record) must be about cuda:1, or a capture records nothing of the step and the routing's events cover nothing;
    an index beyond the machine's GPUs is refused in one line."""
    from fmoe_cli.errors import FmoeError
    from fmoe_cli.models.load import pick_device

    made = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", made.append)
    assert pick_device("cuda:1") == torch.device("cuda", 1) and made == [torch.device("cuda", 1)]
    with pytest.raises(FmoeError, match=r"device cuda:2 requested but this machine has 2 CUDA GPUs \(cuda:0 to cuda:1\)"):
        pick_device("cuda:2")


def test_a_replayed_step_is_bookkept_before_the_next_replay_overwrites_its_routing(checkpoints, monkeypatch):
    """Two replayed steps with nothing reading the counters between them: the first step's deferred bookkeeping reads
    its own routing, not the next replay's (the host copies are rewritten by each replay)."""
    from fmoe_cli.generate import decode_graph

    path = checkpoints["qwen3_moe"]
    seen = {}
    for settle_each in (True, False):
        RecordedGraphs.reset()
        lm, engine = device_path_engine(path, RecordedGraphs, monkeypatch)
        engine.configure(make_settings("resident", lm.shape, budget(lm.shape), timings=TIMINGS))
        routed = seen[settle_each] = []
        real = engine.resident_routed
        monkeypatch.setattr(engine, "resident_routed", lambda i, ids, weights: (routed.append((i, ids.tolist())),
                                                                               real(i, ids, weights)))
        graph = decode_graph(lm.model, engine, PROMPT.shape[1] + 8)
        token = int(graph.prefill(PROMPT).argmax())
        engine.counters()
        routed.clear()
        for _ in range(5):
            token = int(graph.step(torch.tensor([[token]])).argmax())
            if settle_each:
                engine.counters()
        engine.counters()
        assert graph.segments == 1 and RecordedGraphs.replayed >= 3
        engine.close()
    assert seen[False] == seen[True] and len(seen[True]) == 5 * lm.shape.num_layers
    assert len({tuple(map(tuple, ids)) for _, ids in seen[True]}) > 1  # the steps routed differently


def test_a_sliding_window_cache_decodes_eagerly_with_one_line(tmp_path, monkeypatch, capsys):
    """transformers' sliding-window cache layers count their positions in a Python int, which a replay never
    advances: such a model's steps are not captured (one line), and give transformers' tokens past the window."""
    from fmoe_cli.models.demo import build_random_moe

    path = build_random_moe(tmp_path / "sliding", family="mixtral", seed=1, sliding_window=6)
    want = reference_tokens(path)
    RecordedGraphs.reset()
    got, graphs, _ = generate(path, RecordedGraphs, monkeypatch)
    assert got == want
    assert all(graph.eager and graph.segments == 0 for graph in graphs.values()) and RecordedGraphs.captured == 0
    assert capsys.readouterr().err.count("count their positions on the host") == 1


def test_bench_s_warm_up_and_run_share_one_decode_cache(checkpoints, monkeypatch):
    """A GPU's decode cache is made for a capacity (rounded up to 256 positions): bench's warm-up (4 tokens) and its
    run (60) round differently after a prompt of 200, and each kept its own cache where the plan reserves one."""
    from fmoe_cli.bench.run import bench_policy

    lm, engine = device_path_engine(checkpoints["mixtral"], RecordedGraphs, monkeypatch)
    prompt = torch.randint(3, 60, (1, 200))
    bench_policy(lm, engine, make_settings("resident", lm.shape, budget(lm.shape), timings=TIMINGS), prompt, 60, 4)
    assert list(engine.decode_graphs) == [512]
    engine.close()
