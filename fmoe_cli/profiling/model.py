"""Per-layer timings of a loaded model that need not fit on the device.

The model runs through the offloading engine (experts in the host store, loaded on
demand), and each MoE layer is timed alone with only its own experts made resident
(`resident_layer`). Then the engine's own costs, which the configurator and the simulator
charge beside compute and link time (docs/planning.md § `fmoe profile`): one expert's
forward as a decode step meets it (`expert_compute_s`), an admission's copy
(`admission_copy_s`), and from decode steps and single-layer forwards the host's work per
loaded segment, per prefetching layer and per split top hit, its lead on a layer's first
load, and a whole resident step (`host_work_s`). `fmoe profile --model` saves these
timings; a run set-up measures them quickly when no profile has them (fmoe_cli/run.py,
`find_timings`).
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import torch

from fmoe_cli.errors import FmoeError
from fmoe_cli.generate import DEFAULT_PROMPT, stream_generate
from fmoe_cli.offload.cache import LayerCache
from fmoe_cli.offload.engine import Engine, LayerState
from fmoe_cli.offload.policies import make_policy
from fmoe_cli.profiling.files import ModelTimings, model_identity
from fmoe_cli.profiling.layers import time_layers
from fmoe_cli.types import LayerPlan


@contextlib.contextmanager
def resident_layer(engine: Engine, moe_index: int) -> Iterator[None]:
    """Make every expert of one MoE layer whole on the device, and put the layer's cache back after."""
    old = engine.layers[moe_index]
    n = engine.shape.num_experts
    cache = LayerCache(n, make_policy("lcp", n))
    for e in range(n):
        cache.insert(e)
    tops = engine.store.layers[moe_index].to(engine.device, engine.store.dtype)
    engine.layers[moe_index] = LayerState.of(cache, tops, engine.shape.intermediate, engine.store)
    try:
        yield
    finally:
        engine.layers[moe_index] = old
        del tops


def prompt_ids(lm, length: int) -> torch.Tensor:
    """A real prompt (the bench's, repeated) cut to `length` tokens; token ids 0..V-1 without a tokenizer."""
    if length < 1:
        raise FmoeError(f"--prefill-len must be at least 1, got {length}")
    if lm.tokenizer is not None:
        ids = lm.tokenizer(DEFAULT_PROMPT)["input_ids"] or [0]
    else:
        ids = list(range(min(64, lm.model.config.get_text_config().vocab_size)))
    ids = (ids * (length // len(ids) + 1))[:length]
    return torch.tensor([ids])


def model_timings(lm, engine: Engine, prefill_len: int = 16, quick: bool = True,
                  advance: Callable[[], None] = lambda: None, observers: Sequence = ()) -> ModelTimings:
    """Per-layer times of a loaded model whose experts the installed, configured engine serves
    (on-demand loading is enough: every MoE layer is timed with its experts resident), and the
    engine's own costs. The engine's observers do not see the measurement; `observers` do (a
    scratch statistics recorder: the engine's costs include what recording costs a run)."""
    moe_index = {layer.decoder_index: layer.index for layer in lm.layers}
    # a measurement is not traffic: no trace, no statistics of the model's
    kept, engine.observers = engine.observers, list(observers)
    try:
        timings = time_layers(
            lm.model, prompt_ids(lm, prefill_len),
            model_identity=model_identity(lm.model_id, lm.path / "config.json"),
            top_k=lm.shape.top_k,
            decode_steps=2 if quick else 4,
            repeats=3 if quick else 7,
            resident=lambda i: resident_layer(engine, moe_index[i]),
            advance=advance,
            # h_load per layer block: only where whole resident steps cannot give it (host_work_s)
            loads=None if _resident_fits(lm) else (lambda: _loads(engine)),
        )
        t_admit = admission_copy_s(lm, repeats=20 if quick else 100)
        t_segment = segment_call_s(lm, repeats=50 if quick else 200)
        h_load, h_pf, c, step, route = host_work_s(
            lm, engine, prompt_ids(lm, prefill_len), block_h_load=timings.t_host_load or 0.0, t_admit=t_admit,
            t_segment=t_segment, rounds=5 if quick else 9, tokens=8 if quick else 16, budget_s=5.0 if quick else 60.0)
        return replace(timings, t_host_load=h_load, t_host_prefetch=h_pf, t_admit=t_admit, t_segment=c, t_token=step,
                       t_host_route=route, t_expert=expert_compute_s(lm, repeats=100 if quick else 400, cold=True))
    finally:
        engine.observers = kept


SPLIT_CACHE_BYTES = 512 * 2**20


def host_work_s(lm, engine: Engine, input_ids: torch.Tensor, *, block_h_load: float, t_admit: float,
                t_segment: float, rounds: int = 5, tokens: int = 8,
                budget_s: float = 5.0) -> tuple[float, float, float, float | None, float]:
    """(h_load, h_pf, c, resident step, h_route): the host's work per loaded segment, per MoE layer that prefetches (the
    predictor's scores and ranking, the prefetcher's submits and cancels) and per split top hit
    (two segment forwards and their sum instead of one forward), from whole decode tokens on the
    engine's link, in interleaved rounds: every expert resident; no cache, loaded on demand; the
    same with prefetch; and up to 4K experts' top halves cached per layer.
    Per configuration, the medians over tokens of net = TPOT − exposed and of its counters; then
        h_load = (net_ondemand − net_resident) / loaded segments
        h_pf   = what prefetch adds to one MoE layer's experts forward (`layer_forward_s`, less the
                 time it waited on the link: K fixed experts, every layer in turn, 200 times: the
                 prefetch path is the host's Python, not memory bound, and the difference of two
                 decode steps was too noisy to take it from)
        c      = (net_split − net_ondemand − misses_split · θ · a_e − Δ loaded segments · h_load) / top hits
    each the median over rounds (paired: a machine whose load drifts shifts a round's runs alike);
    h_route, the host's lead on a layer's first load, from the engine's counters of the on-demand runs.
    Whole tokens, not one layer run again: a layer re-run on one input finds its experts' weights
    warm in the CPU's caches, a decode step does not. Where the model does not fit on the device
    (a GPU), h_load is `block_h_load` (profiling/layers.py) and c is `t_segment` (one forward of a
    one-block segment). Rounds stop early once `budget_s` has passed (a model whose on-demand
    step takes long, on a slow link, gets one round). The engine is put back as it was."""
    import time

    shape, settings = lm.shape, engine.settings
    plan = settings.plan
    layers = len(plan.layers)
    no_cache = replace(plan, layers=tuple(LayerPlan(0, 0, 0, 0.0) for _ in plan.layers), resident=False,
                       prefetch=True, source="measurement")
    configs = {"demand": replace(settings, plan=no_cache, prefetch=False),
               "prefetch": replace(settings, plan=no_cache, prefetch=True)}
    half = shape.intermediate // 2 // shape.neuron_block * shape.neuron_block
    if _resident_fits(lm):
        full = LayerPlan(shape.num_experts * shape.expert_bytes, shape.num_experts, shape.intermediate, 1.0)
        configs["resident"] = replace(settings, plan=replace(plan, layers=(full,) * layers, staging_slots=0,
                                                             resident=True, source="measurement"), prefetch=False)
        # up to 4K cached tops per layer, at most SPLIT_CACHE_BYTES in all (the measurement's own memory)
        size = min(shape.num_experts, 4 * shape.top_k, SPLIT_CACHE_BYTES // max(1, layers * half * shape.neuron_bytes))
        if half > 0 and size > 0:
            tops = LayerPlan(size * half * shape.neuron_bytes, size, half, half / shape.intermediate)
            configs["split"] = replace(settings, plan=replace(no_cache, layers=(tops,) * layers), prefetch=False)
    h_loads, h_pfs, cs, steps, routes = [], [], [], [], []
    start = time.perf_counter()
    try:
        for r in range(rounds):
            if r and time.perf_counter() - start > budget_s:
                break
            net, count = {}, {}
            for name in (list(configs) if r % 2 == 0 else list(configs)[::-1]):
                engine.configure(configs[name])
                events = list(stream_generate(lm.model, input_ids, engine=engine, max_new_tokens=tokens + 1,
                                              stop_on_eos=False))[1:]
                net[name] = statistics.median(e.latency_s - e.counters.exposed_s for e in events)
                count[name] = {key: statistics.median(getattr(e.counters, key) for e in events)
                               for key in ("needed_loads", "hits_top", "misses")}
                if name == "demand":
                    routes += [e.counters.lead_s / e.counters.leads for e in events if e.counters.leads]
            od = count["demand"]
            if "resident" in net:
                steps.append(net["resident"])
            h_load = (net["demand"] - net["resident"]) / max(1, od["needed_loads"]) if "resident" in net else block_h_load
            h_loads.append(h_load)
            if "split" in net and count["split"]["hits_top"] > 0:
                sp = count["split"]
                cs.append((net["split"] - net["demand"] - sp["misses"] * half / shape.intermediate * t_admit
                           - (sp["needed_loads"] - od["needed_loads"]) * h_load) / sp["hits_top"])
        forward = {}
        for name in ("demand", "prefetch"):
            engine.configure(configs[name])
            before = engine.counters().exposed_s
            seconds = layer_forward_s(lm, engine, 200)
            forward[name] = seconds - (engine.counters().exposed_s - before) / (220 * layers)
        h_pfs.append(forward["prefetch"] - forward["demand"])
    finally:
        engine.configure(settings)
    c = statistics.median(cs) if cs else t_segment
    step = statistics.median(steps) if steps else None
    route = statistics.median(routes) if routes else 0.0
    return max(0.0, statistics.median(h_loads)), max(0.0, statistics.median(h_pfs)), max(0.0, c), step, route


def layer_forward_s(lm, engine: Engine, reps: int) -> float:
    """Seconds per experts forward of one MoE layer for one token routed to K fixed, distinct experts,
    every layer in turn, `reps` times after a warm-up: the engine's own work without attention,
    sampling and the model's other layers around it (far less noise than a decode step; the same
    experts every time, so their weights stay warm in a CPU's caches)."""
    import time

    shape = lm.shape
    ids = torch.arange(0, shape.num_experts, shape.num_experts // shape.top_k)[: shape.top_k].view(1, -1)  # [1, K]
    weights = torch.full((1, shape.top_k), 1.0 / shape.top_k, dtype=lm.dtype)
    x = torch.randn(1, shape.hidden, dtype=lm.dtype, generator=torch.Generator().manual_seed(0)).to(lm.device)
    ids, weights = ids.to(lm.device), weights.to(lm.device)
    experts = [layer.experts for layer in lm.layers]
    sync = (lambda: torch.cuda.synchronize(lm.device)) if lm.device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        for _ in range(20):
            for module in experts:
                engine.experts_forward(module, x, ids, weights)
        sync()
        start = time.perf_counter()
        for _ in range(reps):
            for module in experts:
                engine.experts_forward(module, x, ids, weights)
        sync()
        return (time.perf_counter() - start) / (reps * len(experts))


def _resident_fits(lm) -> bool:
    """Whether the measurement may make every expert resident: on the CPU, resident shares the host
    store (no copy), and the measurement's small split caches fit too; a GPU's model need not."""
    return lm.device.type == "cpu"


def _loads(engine: Engine) -> tuple[int, float]:
    """The engine's loaded segments and exposed seconds so far (profiling/layers.py: h_load)."""
    counters = engine.counters()
    return counters.needed_loads, counters.exposed_s


def admission_copy_s(lm, repeats: int = 20) -> float:
    """a_e: one whole expert copied into a cache slot on the device, as the engine admits a loaded expert
    (offload/engine.py: _offer; device to device on a GPU, a memcpy on the CPU): the median over `repeats`
    copies. On the CPU each copy reads another expert of the host store into another of 8 slots, as
    admissions meet them (a copy between two buffers kept warm in the CPU's caches runs faster); on a
    GPU, whose L2 holds no real expert, between two device buffers."""
    import time

    shape, store = lm.shape, lm.store
    if lm.device.type == "cpu":
        sources = [store.expert(j, e) for j in range(shape.num_layers) for e in range(shape.num_experts)]
        slots = [torch.empty_like(sources[0]) for _ in range(8)]
    else:
        sources = [store.expert(0, 0).to(lm.device)]
        slots = [torch.empty_like(sources[0])]
    sync = (lambda: torch.cuda.synchronize(lm.device)) if lm.device.type == "cuda" else (lambda: None)
    for slot in slots:
        slot.copy_(sources[0])  # warm-up (first touch of every slot's pages)
    times = []
    for r in range(repeats):
        sync()
        start = time.perf_counter()
        slots[r % len(slots)].copy_(sources[r % len(sources)])
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def segment_call_s(lm, repeats: int = 200) -> float:
    """c: the fixed cost of one segment forward (the store's own, on a one-block segment) on this device."""
    import time

    block = lm.shape.neuron_block if lm.shape.intermediate >= lm.shape.neuron_block else 1
    segment = lm.store.expert(0, 0)[:block].to(lm.device)
    x = torch.randn(1, lm.shape.hidden, dtype=lm.dtype, device=lm.device)
    act = torch.nn.functional.silu
    sync = (lambda: torch.cuda.synchronize(lm.device)) if lm.device.type == "cuda" else (lambda: None)
    for _ in range(10):
        lm.store.segment_forward(x, segment, act)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        lm.store.segment_forward(x, segment, act)
    sync()
    return (time.perf_counter() - start) / repeats


def expert_compute_s(lm, repeats: int = 200, unquantised: bool = False, cold: bool = False) -> float:
    """T_exp: one expert's forward for one token (decode) on this device, through the store's
    own segment_forward (the engine's compute): the mean over `repeats` after a warm-up.
    `unquantised`: of the expert's unquantised weights instead (quantised stores).
    `cold`: each forward of another expert, in turn over every layer's experts, as a decode step
    meets them (on a CPU, one expert's weights read again and again stay in its caches: up to 3 ×
    faster than in a decode step; a GPU's L2 holds no expert of a real model either way)."""
    import time

    from fmoe_cli.offload.layout import segment_forward

    packed = lm.store.expert(0, 0).to(lm.device)
    forward = lm.store.segment_forward
    if unquantised and hasattr(lm.store, "dequantized"):
        packed, forward = lm.store.dequantized(0)[0].to(lm.device), segment_forward
    x = torch.randn(1, lm.shape.hidden, dtype=lm.dtype, device=lm.device)
    act = torch.nn.functional.silu
    experts = [packed]
    if cold and not unquantised and lm.device.type == "cpu":  # every expert in turn (views of the host store)
        shape = lm.shape
        experts = [lm.store.expert(j, e).to(lm.device) for j in range(shape.num_layers) for e in range(shape.num_experts)]
    for i in range(10):
        forward(x, experts[i % len(experts)], act)
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)
    start = time.perf_counter()
    for i in range(repeats):
        forward(x, experts[i % len(experts)], act)
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)
    return (time.perf_counter() - start) / repeats
