"""Per-layer timings of a loaded model that need not fit on the device.

The model runs through the offloading engine with every MoE layer served whole
(`WholeLayers`: on the CPU from the host store itself; on a GPU, where the model need not
fit, one layer's experts stand in for all), so the passes and each MoE layer timed alone
move nothing over the link. Then the engine's own costs, which the configurator and the simulator
charge beside compute and link time (docs/planning.md § `fmoe profile`): one expert's
forward as a decode step meets it (`expert_compute_s`), an admission's copy
(`admission_copy_s`), and from decode steps and single-layer forwards the host's work per
loaded segment, per prefetching layer and per split top hit, its lead on a layer's first
load, and a whole resident step (`host_work_s`), with loads on one layer only: the quick
measurement moves at most LINK_LAYERS_BUDGET layers' experts (Mixtral bf16 on PCIe 4.0:
a few seconds, where loading every layer took minutes). `fmoe profile --model` saves these
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
from fmoe_cli.offload.engine import Counters, Engine, LayerState
from fmoe_cli.offload.link import DEMAND, device_copy, host_now
from fmoe_cli.offload.policies import make_policy
from fmoe_cli.profiling.device import fit_link
from fmoe_cli.profiling.files import LinkFit, ModelTimings, model_identity
from fmoe_cli.profiling.host import host_format
from fmoe_cli.profiling.layers import time_layers
from fmoe_cli.types import LayerPlan


LINK_LAYERS_BUDGET = 20  # the quick measurement moves at most 20 MoE layers' experts over the link (issue 20 §4)


class WholeLayers:
    """MoE layers served whole from the device without the link, so that a measurement moves bytes only
    for the one layer it measures loads on (`link_layer`): on the CPU every layer from the host store
    itself (no copy, the exact model); on a GPU, where the model need not fit, one layer's experts stand
    in for every layer's (the same shapes, so the same compute; the tokens are the measurement's own,
    never shown). `serve(keep)` after each `engine.configure`: every layer but `keep` whole; `loading(i)`
    gives layer i back to the engine's plan for a while (yields whether it did)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        store = engine.store
        on_cpu = engine.device.type == "cpu"
        self._standin = None if on_cpu else store.layers[0].to(engine.device, store.dtype)
        self._planned: dict[int, LayerState] = {}
        # the layer whose loads are measured: one a layer before it predicts (prefetch), away from the ends
        self.link_layer = min(engine.shape.num_layers - 1, engine.shape.num_layers // 2)

    def _whole(self, i: int) -> LayerState:
        engine, n = self.engine, self.engine.shape.num_experts
        cache = LayerCache(n, make_policy("lcp", n))
        for e in range(n):
            cache.insert(e)
        tops = self._standin if self._standin is not None else engine.store.layers[i].to(engine.device, engine.store.dtype)
        return LayerState.of(cache, tops, engine.shape.intermediate, engine.store)

    def serve(self, keep: int | None = None) -> None:
        self._planned = {}
        for i in range(len(self.engine.layers)):
            if i != keep:
                self._planned[i] = self.engine.layers[i]
                self.engine.layers[i] = self._whole(i)

    @contextlib.contextmanager
    def loading(self, i: int) -> Iterator[bool]:
        if i != self.link_layer or i not in self._planned:
            yield False
            return
        whole, self.engine.layers[i] = self.engine.layers[i], self._planned[i]
        try:
            yield True
        finally:
            self.engine.layers[i] = whole

    def close(self) -> None:
        self._standin, self._planned = None, {}


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
    settings = engine.settings
    whole = WholeLayers(engine)
    start_bytes = engine.link.bytes_moved
    try:
        whole.serve()  # the passes and every T_moe: each layer whole, nothing over the link
        timings = time_layers(
            lm.model, prompt_ids(lm, prefill_len),
            model_identity=model_identity(lm.model_id, lm.path / "config.json"),
            top_k=lm.shape.top_k,
            decode_steps=2 if quick else 4,
            repeats=3 if quick else 7,
            advance=advance,
            # h_load per layer block, on the link layer: only where whole resident steps cannot give it (host_work_s)
            loads=None if _resident_fits(lm) else (lambda: _loads(engine)),
            loaded=lambda i: whole.loading(moe_index[i]),
        )
        t_admit = admission_copy_s(lm, repeats=20 if quick else 100)
        t_segment = segment_call_s(lm, repeats=50 if quick else 200)
        h_load, h_pf, c, step, route, submit = host_work_s(
            lm, engine, prompt_ids(lm, 2), block_h_load=timings.t_host_load or 0.0, t_segment=t_segment, rounds=5 if quick else 9, tokens=4 if quick else 16, budget_s=5.0 if quick else 60.0,
            whole=whole, layer_reps=10 if quick else 100,
            link_bytes=(LINK_LAYERS_BUDGET * lm.shape.num_experts * lm.shape.expert_bytes
                        - (engine.link.bytes_moved - start_bytes)) if quick else None)
        return replace(timings, t_host_load=h_load, t_host_prefetch=h_pf, t_admit=t_admit, t_segment=c, t_token=step,
                       t_host_route=route, t_host_submit=submit, t_expert=expert_compute_s(lm, repeats=100 if quick else 400, cold=True),
                       link=engine_link(lm, engine.link, repeats=5 if quick else 15) if _real_link(lm, engine.link) else None,
                       formats=lm.formats)
    finally:
        engine.observers = kept
        whole.close()
        if settings is not None:
            engine.configure(settings)  # the engine's own plan back (no layer left whole)


SPLIT_CACHE_BYTES = 512 * 2**20
LINK_SPLITS = (0.5, 0.75)  # engine_link times the bottoms of these splits θ beside the whole expert


def _real_link(lm, link) -> bool:
    """Whether `link` moves bytes to a device at a speed worth measuring: a GPU's own copy stream, not an emulated
    (throttled) link, whose figures are its own, nor the CPU's, which moves nothing."""
    return lm.device.type == "cuda" and not getattr(link, "gbps", None)


def engine_copy_starts(shape) -> list[int]:
    """The first neuron of each copy engine_link times: 0 (one whole expert, a miss's load) and the split points k of
    LINK_SPLITS, in whole neuron blocks as plans make them (a top hit's bottom, a prefetch's)."""
    starts = [shape.top_neurons(theta) for theta in LINK_SPLITS]
    return list(dict.fromkeys([0, *(k for k in starts if 0 < k < shape.intermediate)]))


def engine_link(lm, link, repeats: int = 5, warmup: int = 1) -> LinkFit:
    """The engine's link (`link`: its own CudaLink, chunks, pump thread and the store's page-locked memory) timed at
    the copies it issues for this model: one whole expert and its bottoms (`engine_copy_starts`), from the host
    store's experts in turn into one device slot, each from `submit` until the compute stream holds the data
    (`wait`, then that stream synchronised: what a demand load costs a layer), the median of `repeats` after
    `warmup`. Issue 37 §5: the device's profile fits plain copies of 1–512 MiB; on the first H200 it read 39.7 GB/s
    where torch's pinned copies of one a3b expert (9.4 MiB) ran at 53.5, and the configurator planned with the
    lower figure."""
    shape, store = lm.shape, lm.store
    slot = torch.empty_like(store.expert(0, 0), device=lm.device)  # [I, *row]
    compute = torch.cuda.current_stream(lm.device)
    experts = [(j, e) for j in range(shape.num_layers) for e in range(shape.num_experts)]
    samples, n = [], 0
    for start in engine_copy_starts(shape):
        times = []
        for r in range(warmup + repeats):
            j, e = experts[n % len(experts)]
            n += 1
            source = store.expert(j, e)[start:]  # as the staging pool's loads: the expert from neuron `start` on
            begin = host_now()
            transfer = link.submit(slot[start:], source, DEMAND)
            link.wait(transfer)
            compute.synchronize()
            if r >= warmup:
                times.append(host_now() - begin)
        samples.append((source.nbytes, statistics.median(times)))
    latency, bandwidth = fit_link(samples)
    return LinkFit("measured", bandwidth, latency, tuple(samples),
                   f"the engine's link at this model's copies ({host_format(shape)}: one expert and its bottoms at θ "
                   f"{', '.join(f'{t:g}' for t in LINK_SPLITS)})")


def host_work_s(lm, engine: Engine, input_ids: torch.Tensor, *, block_h_load: float, t_segment: float, rounds: int = 5, tokens: int = 8, budget_s: float = 5.0,
                whole: WholeLayers | None = None, link_bytes: int | None = None,
                layer_reps: int = 100) -> tuple[float, float, float, float | None, float, float]:
    """(h_load, h_pf, c, resident step, h_route, h_sub): the host's work per loaded segment, per MoE layer that prefetches (the
    predictor's scores and ranking, the prefetcher's submits) and per split top hit (two segment forwards and their
    sum instead of one forward). h_load and c from one MoE layer's experts forward (`layer_forward_s`, `layer_reps`
    times in all, less the time it waited on the link) in up to 5 paired rounds, the median of the rounds'
    differences, per configuration of that layer: up to 4K whole experts cached (every expert resident where
    those do not fit in SPLIT_CACHE_BYTES), no cache loaded on demand, and as many experts' top halves cached. The
    forwards replay the decode steps' own tokens (their inputs and routings, `decode_inputs`; a fixed input routed
    to K fixed experts when there are none), those whose experts all fit in the caches, so that each is a hit:
        h_load = (demand − cached) / K           K segments loaded, K whole hits (resident: none loaded)
        c      = (split − demand) / K            K top hits, each loading its bottom: a second segment forward,
                                                 at least `t_segment` (a smaller difference is noise)
    h_pf is the engine's own counter of the prefetch path (Counters.predict_s / predicts) in whole decode steps with
    prefetch, of the layer that predicts for the one that loads (with `whole`: its prefetches are real loads, every
    other layer's target is whole and issues none), the median over every step of every round. It was the
    difference of paired forwards with and without prefetch (prefetch − demand): on the demo it read 0.000 to 0.46
    ms a layer from one quick estimate to the next, where the path takes 0.10-0.15 (docs/planning.md); the counter
    includes the prefetches' submissions, which a right prefetch's layer then does not make (the configurator and
    the simulator charge its load h_load − h_sub).
    Decode steps were too noisy to carry h_load and c as differences: h_load was the difference of one layer's K loads between the
    medians of 4 whole steps, which moved by a millisecond on a busy machine (the demo's quick estimates read
    h_load 0.000–0.235 ms and c 0.013–0.244 where a decode step pays about 0.03 and 0.02; forwards read
    0.015–0.035 and ~0). Whole decode tokens on the engine's link in interleaved rounds (every expert resident;
    on demand; on demand with prefetch) give the resident step, h_pf, h_route, the host's lead on a layer's first
    load, and h_sub, its work per demand load submitted (the part of h_load spent before the layer's first
    compute), from the engine's counters of the on-demand runs. Where the model does not fit on the device (a GPU), h_load is
    `block_h_load` (profiling/layers.py) and c is `t_segment` (one forward of a one-block segment). With `whole`
    only its link layer loads (every other layer whole, served without the link: each formula is per loaded
    segment, per top hit or per prefetching layer, so one layer gives it): of the two layers forwarded (the link
    layer and the one before it) one loads. Rounds stop early once `budget_s` has
    passed (a model whose on-demand step takes long, on a slow link, gets one round) or before a round would
    take the link past `link_bytes` (less what the forwards will move). The engine is put back as it was."""
    shape, settings = lm.shape, engine.settings
    plan = settings.plan
    split_size = None
    layers = len(plan.layers)
    no_cache = replace(plan, layers=tuple(LayerPlan(0, 0, 0, 0.0) for _ in plan.layers), resident=False,
                       prefetch=True, source="measurement")
    configs = {"demand": replace(settings, plan=no_cache, prefetch=False),  # the decode steps' configurations
               "prefetch": replace(settings, plan=no_cache, prefetch=True)}
    forwards = {"demand": configs["demand"]}
    half = shape.intermediate // 2 // shape.neuron_block * shape.neuron_block
    if _resident_fits(lm):
        full = LayerPlan(shape.num_experts * shape.expert_bytes, shape.num_experts, shape.intermediate, 1.0)
        configs["resident"] = replace(settings, plan=replace(plan, layers=(full,) * layers, staging_slots=0,
                                                             resident=True, source="measurement"), prefetch=False)
        forwards["resident"] = configs["resident"]
        # up to 4K cached tops per layer, at most SPLIT_CACHE_BYTES in all (the measurement's own memory); at least
        # K, so that a token's K experts are all top hits once the warm-up has admitted them (the forwards replay
        # only the decode tokens whose experts fit: _fitting)
        size = min(shape.num_experts, 4 * shape.top_k, SPLIT_CACHE_BYTES // max(1, layers * half * shape.neuron_bytes))
        if half > 0 and size >= shape.top_k:
            split_size = size
            tops = LayerPlan(size * half * shape.neuron_bytes, size, half, half / shape.intermediate)
            forwards["split"] = replace(settings, plan=replace(no_cache, layers=(tops,) * layers), prefetch=False)
        # the same number of whole experts cached, on the general path: a whole hit is what a load is measured
        # against (h_load: the work a hit saves). The resident plan's decode takes a fast path of its own
        # (offload/engine.py: _resident_decode) that no cache plan takes; against it, h_load also counted the
        # general path's own work, which every hit pays too (the demo at 16 GB/s: a whole hit saved 0.045 ms a
        # layer where the quick estimate read h_load 0.056–0.107 ms, docs/planning.md)
        if split_size is not None and split_size * layers * shape.expert_bytes <= SPLIT_CACHE_BYTES:
            wholes = LayerPlan(split_size * shape.expert_bytes, split_size, shape.intermediate, 1.0)
            forwards["cached"] = replace(settings, plan=replace(no_cache, layers=(wholes,) * layers), prefetch=False)
            del forwards["resident"]  # (its decode steps, configs["resident"], still give the resident step)
    keep = None if whole is None else whole.link_layer
    forwarded = None if whole is None else sorted({max(0, keep - 1), keep})  # MoE layers layer_forward_s runs
    per_layer = len(forwarded) if forwarded else 1  # forwards per loading layer: a difference per forward × this
    # h_pf: the engine's own counter of the prefetch path (Counters.predict_s / predicts) in the decode steps with
    # prefetch, of the layer that predicts for the link layer (its prefetches are real loads; every other layer's
    # target is whole and issues none); without `whole` every layer's
    watched = None if whole is None else [(keep - 1) % layers]
    captured: list = []  # the decode steps' tokens, replayed by the forwards (decode_inputs)
    warm = max(2, layer_reps // 10)
    # h_load, h_pf and c in paired rounds (the median of each round's difference: one round slowed by other work on
    # the machine does not carry it), as many forwards in all as one pass of `layer_reps` after `warm`
    pf_rounds = min(5, max(1, layer_reps // 3))
    pf_reps, pf_warm = max(1, layer_reps // pf_rounds), max(1, warm // pf_rounds)

    def configure(s) -> None:
        engine.configure(s)
        if whole is not None and not s.plan.resident:
            whole.serve(keep)

    link = getattr(engine, "link", None)
    moved = (lambda: link.bytes_moved) if link is not None else (lambda: 0)
    if link_bytes is not None:  # what the forwards will move: K whole experts (bottoms: split) per forward of the link layer
        loading = 1 + (0.5 if "split" in forwards else 0.0)  # demand, split
        link_bytes -= int(loading * pf_rounds * (max(pf_warm, tokens) + pf_reps)  # a warm-up of every replayed token
                          * shape.top_k * shape.expert_bytes * (1 if whole else layers))
    h_loads, h_pfs, cs, steps, routes, submits = [], [], [], [], [], []
    start, start_bytes, round_bytes = host_now(), moved(), 0
    try:
        for r in range(rounds):
            used = moved() - start_bytes
            if r and (host_now() - start > budget_s
                      or link_bytes is not None and used + round_bytes > link_bytes):
                break
            net = {}
            for name in (list(configs) if r % 2 == 0 else list(configs)[::-1]):
                configure(configs[name])
                marks = []  # the watched layers' counters after each token (the first: prefill and first token)
                with decode_inputs(lm, forwarded or range(layers), captured) if r == 0 and not captured \
                        else contextlib.nullcontext():  # the same tokens in every configuration: once
                    events = []
                    for event in stream_generate(lm.model, input_ids, engine=engine, max_new_tokens=tokens + 1,
                                                 stop_on_eos=False):
                        events.append(event)
                        if watched is not None:
                            marks.append(Counters.total([engine.layers[j].counters for j in watched]))
                    events = events[1:]
                net[name] = statistics.median(e.latency_s - e.counters.exposed_s for e in events)
                if name == "prefetch":  # per decode step: the prefetch path's host time per layer that ran it
                    paths = [b - a for a, b in zip(marks, marks[1:])] if watched is not None else \
                        [e.counters for e in events]
                    h_pfs += [c.predict_s / c.predicts for c in paths if c.predicts]
                    continue
                if name == "demand":
                    routes += [e.counters.lead_s / e.counters.leads for e in events if e.counters.leads]
                    submits += [e.counters.submit_s / e.counters.submitted for e in events if e.counters.submitted]
            round_bytes = max(round_bytes, moved() - start_bytes - used)
            if "resident" in net:
                steps.append(net["resident"])
        names = list(forwards)
        loading_at = [forwarded.index(keep)] if forwarded else list(range(layers))  # positions that load
        inputs = _fitting(captured, loading_at, split_size) if captured else None
        for r in range(pf_rounds):
            forward = {}
            for name in (names if r % 2 == 0 else names[::-1]):
                configure(forwards[name])
                before = engine.counters().exposed_s
                # every replayed token once before the timed forwards: the plan's views of what it loads are made (a
                # decode step's are, after its first tokens) and, split, every token's experts admitted (tops cached)
                warmup = max(pf_warm, len(inputs)) if inputs else pf_warm
                seconds = layer_forward_s(lm, engine, pf_reps, layers=forwarded, warmup=warmup, inputs=inputs)
                calls = (warmup + pf_reps) * (len(forwarded) if forwarded else layers)
                forward[name] = seconds - (engine.counters().exposed_s - before) / calls
            # K segments loaded against K whole hits (else against resident); K top hits against K whole loads
            hits = forward.get("cached", forward.get("resident"))
            if hits is not None:
                h_loads.append((forward["demand"] - hits) * per_layer / shape.top_k)
            if "split" in forward:
                cs.append((forward["split"] - forward["demand"]) * per_layer / shape.top_k)
    finally:
        engine.configure(settings)
    # a split top hit costs at least one more segment forward: a smaller c is the noise of a busy machine
    c = max(statistics.median(cs), t_segment) if cs else t_segment
    step = statistics.median(steps) if steps else None
    route = statistics.median(routes) if routes else 0.0
    submit = statistics.median(submits) if submits else 0.0
    h_load = statistics.median(h_loads) if h_loads else block_h_load
    h_pf = statistics.median(h_pfs) if h_pfs else 0.0
    # a load's host work includes its submission (h_sub, the engine's own counter, steady where the forwards'
    # differences are not): a smaller h_load is noise (quick estimates read 0.000 where a decode step pays 0.044 ms)
    return max(h_load, submit), h_pf, max(0.0, c), step, route, submit


def _fitting(tokens: list, loading_at: Sequence[int], size: int | None) -> list:
    """The first of `tokens` (decode_inputs) whose experts, in each loading layer (positions `loading_at`), number at
    most `size` (the split forwards' cache: every one a top hit once admitted); all of them without a size. At
    least the first (K experts ≤ size)."""
    if size is None:
        return tokens
    seen = [set() for _ in loading_at]
    for n, token in enumerate(tokens):
        for held, at in zip(seen, loading_at):
            held.update(token[at][1].reshape(-1).tolist())
        if n and any(len(held) > size for held in seen):
            return tokens[:n]
    return tokens


def layer_forward_s(lm, engine: Engine, reps: int, layers: Sequence[int] | None = None, warmup: int = 20,
                    inputs: Sequence[Sequence[tuple]] | None = None) -> float:
    """Seconds per experts forward of one MoE layer for one token, every layer (or the MoE layers `layers`) in
    turn, `reps` times after `warmup`: the engine's own work without attention, sampling and the model's other
    layers around it (far less noise than a decode step). The token: by default one fixed input routed to K
    fixed, distinct experts in every layer (their weights stay warm in a CPU's caches); `inputs`: real decode
    tokens instead, each the (x [1, H], ids [1, K], weights [1, K]) every forwarded layer saw (`decode_inputs`),
    in turn (the warm-up from the first, the timed forwards from the first again), so that a split cache holds
    what those decode steps would have it hold."""
    shape = lm.shape
    forwarded = list(range(len(lm.layers))) if layers is None else list(layers)
    if inputs is None:
        ids = torch.arange(0, shape.num_experts, shape.num_experts // shape.top_k)[: shape.top_k].view(1, -1)  # [1, K]
        weights = torch.full((1, shape.top_k), 1.0 / shape.top_k, dtype=lm.dtype)
        x = torch.randn(1, shape.hidden, dtype=lm.dtype, generator=torch.Generator().manual_seed(0)).to(lm.device)
        inputs = [[(x, ids.to(lm.device), weights.to(lm.device))] * len(forwarded)]
    experts = [lm.layers[i].experts for i in forwarded]
    sync = (lambda: torch.cuda.synchronize(lm.device)) if lm.device.type == "cuda" else (lambda: None)

    def one_pass(token: Sequence[tuple]) -> None:
        for module, (x, ids, weights) in zip(experts, token):
            engine.experts_forward(module, x, ids, weights)

    with torch.inference_mode():
        for r in range(warmup):
            one_pass(inputs[r % len(inputs)])
        sync()
        start = host_now()
        for r in range(reps):
            one_pass(inputs[r % len(inputs)])
        sync()
        return (host_now() - start) / (reps * len(experts))


@contextlib.contextmanager
def decode_inputs(lm, layers: Sequence[int], out: list) -> Iterator[None]:
    """While open, every decode token's experts-forward inputs of the MoE layers `layers` go into `out`: one
    list per token of (x [1, H], ids [1, K], weights [1, K]) in `layers`' order (layer_forward_s's `inputs`).
    Forward pre-hooks on the experts modules (transformers calls them with those three, positionally)."""
    order = {layer: n for n, layer in enumerate(layers)}
    token: dict[int, tuple] = {}

    def hook(layer: int):
        def seen(module, args) -> None:
            x, ids, weights = args[:3]
            if x.shape[0] != 1:  # a prefill: not a decode token
                return
            token[layer] = (x.detach().clone(), ids.detach().clone(), weights.detach().clone())
            if len(token) == len(order):
                out.append([token[j] for j in sorted(token, key=order.get)])
                token.clear()
        return seen

    handles = [lm.layers[i].experts.register_forward_pre_hook(hook(i)) for i in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _resident_fits(lm) -> bool:
    """Whether the measurement may make every expert resident: on the CPU, resident shares the host
    store (no copy), and the measurement's small split caches fit too; a GPU's model need not."""
    return lm.device.type == "cpu"


def _loads(engine: Engine) -> tuple[int, float]:
    """The engine's loaded segments and exposed seconds so far (profiling/layers.py: h_load)."""
    counters = engine.counters()
    return counters.needed_loads, counters.exposed_s


ADMISSION_SLOTS_BYTES = 64 << 20  # the CPU's admission slots span at most this much (more than its last-level cache) …
ADMISSION_SLOTS_SHARE = 16  # … and at most 1/16 of the host store: the quick estimate's memory in proportion to the model


def admission_slots(store) -> torch.Tensor:
    """[count, *expert]: the cold cache slots admission_copy_s copies into on the CPU, one expert each, their pages
    touched. They span at most ADMISSION_SLOTS_BYTES and 1/ADMISSION_SLOTS_SHARE of the host store's bytes, and
    hold at least 2 experts: transient host memory in proportion to the model (issue 39 §6). A fixed 64 MiB was 0.10 ×
    a 576 MiB bf16 store, 0.32 × its int4 store (165 MiB) and nearly the demo's whole store again; 1/16 of the store
    is 36 MiB (6 slots) of the former, 10 MiB of the int4 one."""
    expert = store.expert(0, 0)
    span = min(ADMISSION_SLOTS_BYTES, store.nbytes // ADMISSION_SLOTS_SHARE)
    count = max(2, min(128, span // max(1, expert.nbytes)))
    slots = torch.empty((count, *expert.shape), dtype=expert.dtype)
    slots.copy_(expert.expand_as(slots))  # first touch of every slot's pages
    return slots


def admission_copy_s(lm, repeats: int = 20) -> float:
    """a_e: one whole expert copied into a cache slot on the device, as the engine admits a loaded expert
    (offload/engine.py: _offer, link.py `device_copy`: device to device on a GPU, on the calling thread on the CPU).

    On the CPU, as a decode step pays it: the copy reads a cold expert of the host store into a cold slot (`admission_slots`:
    up to ADMISSION_SLOTS_BYTES, more than a last-level cache holds, and 1/16 of the store) and leaves the caches to the expert
    forward after it (`admission_in_context`: two forwards with a copy between them against the same two without,
    in alternate repeats). Timed alone, between slots the caches keep warm, the copy read 0.05–0.07 ms on the demo
    where the engine's admissions cost 0.11 ms each and a cache that admits on every miss measured 1.1 ms a token
    slower than the same cache left as warmed (docs/planning.md § `fmoe profile`). On a GPU, whose L2 holds no real
    expert, the median of copies between two device buffers."""
    shape, store = lm.shape, lm.store
    if lm.device.type != "cpu":
        sources = [store.expert(0, 0).to(lm.device)]
        slots = [torch.empty_like(sources[0])]
        sync = lambda: torch.cuda.synchronize(lm.device)  # noqa: E731
        slots[0].copy_(sources[0])
        times = []
        for r in range(repeats):
            sync()
            start = host_now()
            device_copy(slots[0], sources[0])
            sync()
            times.append(host_now() - start)
        return statistics.median(times)
    sources = [store.expert(j, e) for j in range(shape.num_layers) for e in range(shape.num_experts)]
    slots = admission_slots(store)
    count = len(slots)
    # the engine's bookkeeping of an admission (offload/engine.py: _offer): LCP's victim in a full cache of half
    # the layer's experts, then the copy into its slot
    n = shape.num_experts
    cache = LayerCache(max(1, n // 2), make_policy("lcp", n))
    for e in range(n):
        cache.policy.touch(e, e)
    for e in range(cache.capacity):
        cache.insert(e)

    def admit(r: int) -> None:
        cache.advance()
        newcomer = next((e for e in range(n) if e not in cache), None)
        admission = cache.admit(newcomer) if newcomer is not None else None
        slot = (5 * r + (admission.slot if admission else 0)) % count
        device_copy(slots[slot], sources[(3 * r + 1) % len(sources)])

    x = torch.randn(1, shape.hidden, dtype=lm.dtype)
    act = torch.nn.functional.silu
    return admission_in_context(lambda r: store.segment_forward(x, sources[(7 * r + 3) % len(sources)], act), admit,
                                2 * repeats)


def admission_in_context(forward: Callable[[int], object], copy: Callable[[int], object], repeats: int) -> float:
    """An admission's cost where it happens, between expert forwards: each repeat r times forward(2r), then in odd
    repeats copy(r), then forward(2r + 1); a_e is the median of the repeats with a copy less the median of those
    without, and at least the median time of the copies themselves (a noisy difference never reads below them)."""
    with_copy, without, copies = [], [], []
    for r in range(repeats):
        start = host_now()
        forward(2 * r)
        if r % 2:
            before = host_now()
            copy(r)
            copies.append(host_now() - before)
        forward(2 * r + 1)
        (with_copy if r % 2 else without).append(host_now() - start)
    return max(statistics.median(with_copy) - statistics.median(without), statistics.median(copies))


def segment_call_s(lm, repeats: int = 200) -> float:
    """c: the fixed cost of one segment forward (the store's own, on a one-block segment) on this device."""
    block = lm.shape.neuron_block if lm.shape.intermediate >= lm.shape.neuron_block else 1
    segment = lm.store.expert(0, 0)[:block].to(lm.device)
    x = torch.randn(1, lm.shape.hidden, dtype=lm.dtype, device=lm.device)
    act = torch.nn.functional.silu
    sync = (lambda: torch.cuda.synchronize(lm.device)) if lm.device.type == "cuda" else (lambda: None)
    for _ in range(10):
        lm.store.segment_forward(x, segment, act)
    sync()
    start = host_now()
    for _ in range(repeats):
        lm.store.segment_forward(x, segment, act)
    sync()
    return (host_now() - start) / repeats


def expert_compute_s(lm, repeats: int = 200, unquantised: bool = False, cold: bool = False) -> float:
    """T_exp: one expert's forward for one token (decode) on this device, through the store's
    own segment_forward (the engine's compute): the mean over `repeats` after a warm-up.
    `unquantised`: of the expert's unquantised weights instead (quantised stores).
    `cold`: each forward of another expert, in turn over every layer's experts, as a decode step
    meets them (on a CPU, one expert's weights read again and again stay in its caches: up to 3 ×
    faster than in a decode step; a GPU's L2 holds no expert of a real model either way)."""
    from fmoe_cli.offload.layout import segment_forward

    packed = lm.store.expert(0, 0).to(lm.device)
    forward = lm.store.segment_forward
    if unquantised and hasattr(lm.store, "dequantized"):
        packed, forward = lm.store.dequantized(0, expert=0)[0].to(lm.device), segment_forward  # one expert's memory
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
    start = host_now()
    for i in range(repeats):
        forward(x, experts[i % len(experts)], act)
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)
    return (host_now() - start) / repeats
