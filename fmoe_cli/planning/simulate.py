"""Predicted TPOT: a deterministic event simulation of the engine's own decisions.

Over recorded routing (an fmoe trace, which carries the prefetcher's rankings, or a
vLLM trace with a routing-only predictor), every MoE layer of every token goes through
the steps of `offload/engine.py: Engine.experts_forward`, with the engine's own classes
on a virtual clock and no tensor data (meta tensors: shapes and byte counts only):

- the cache: `LayerCache` with the engine's policy objects, from the policy's own plan
  (`planning/presets.py`; the configurator's plan for `moepic`), fed token by token;
- the hit classification: `offload/hits.py: classify` (through `StagingPool.classify`);
- the link: `EmulatedLink` (one copy engine, chunked, demand before prefetch, a queued
  copy cancelled for free) on a `VirtualClock`;
- the staging pool: `StagingPool` (slots, reclaim order, copies ordered after the
  compute that last read a slot);
- the prefetcher: `Prefetcher`, fed the trace's rankings (as speculative predictions
  for the next MoE layer; the last layer's for layer 0 of the next token) or the
  routing-only predictor's predictions.

Compute, on one stream, moves the clock (MoEpic's symbols, `Timings`, seconds per
decode token; its T_load is not used: the link's bandwidth and latency time every copy):
    per MoE layer:  T_att, then per expert segment of n neurons c + (T_exp − c) · n / I
                    (c: a split top hit's extra, Timings.t_segment) in the engine's
                    order: whole and cached-top segments first, then each load as acquired
                    (+ h_load of host work per loaded segment, of which h_sub is spent submitting it, before
                    the layer's first compute), h_pf before a prefetch is issued
                    (h_load, h_pf: the engine's host work, Timings.t_host_load and
                    t_host_prefetch; h_route of T_att is spent after the layer's loads
                    are submitted, as the engine lays out its routing)
    per token:      T_head (LM head, final norm, layers before the first MoE layer)
An acquire of a copy not yet landed sleeps the clock to its end (the exposed time).

TPOT = the median over the measured decode tokens. It is a prediction, labelled
"simulated" wherever it is printed, as good as its inputs: the compute times (measured,
from a profile, or estimated from the memory bandwidth) and the link's figures.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from fmoe_cli.offload.cache import LayerCache
from fmoe_cli.offload.engine import Counters
from fmoe_cli.offload.host import Fills, split_work
from fmoe_cli.offload.link import EmulatedLink, VirtualClock
from fmoe_cli.offload.policies import LCP_OMEGA, LCP_RHO, make_policy
from fmoe_cli.offload.pool import Staged, StagingPool
from fmoe_cli.offload.prefetch import Prefetcher
from fmoe_cli.planning.presets import PlanInputs, settings_for
from fmoe_cli.planning.stats import RoutingStats, held_order, lcp_ranking
from fmoe_cli.prediction.base import Iteration, Prediction, ranked_prediction
from fmoe_cli.prediction.eam import EamPredictor
from fmoe_cli.types import EngineSettings, ExpertShape, Timings

META = torch.device("meta")


@dataclass(frozen=True)
class Token:
    """One token's routing: per MoE layer the activated experts, and the prefetcher's ranking
    for that layer if the routing source carries one."""

    experts: tuple[tuple[int, ...], ...]  # [layer] -> experts
    predicted: tuple[tuple[int, ...] | None, ...] | None = None  # [layer] -> ranking, best first


@dataclass(frozen=True)
class SimResult:
    policy: str
    tpot_s: float  # median over the measured decode tokens
    mean_tpot_s: float
    tokens: int
    hit_rate: float  # activated experts whose top segment (or the whole expert) was on the device
    exposed_s_per_token: float
    bytes_per_token: float
    host_s_per_token: float  # the host lane's compute (0 without it)
    prefetch_precision: float
    plan: str
    whole_hit_rate: float = 0.0  # … of which the whole expert was: nothing loaded


@dataclass
class _Layer:  # what the prefetcher reads of the engine's LayerState (no tops: no data)
    cache: LayerCache
    top_neurons: int
    counters: Counters = field(default_factory=Counters)
    host: bool = False  # the host lane (offload/host.py)


class _MetaStore:
    """The host store's interface without bytes: expert(j, e) is a meta tensor of I rows of
    `neuron_bytes` bytes (any storage format: only the byte counts matter to the link)."""

    def __init__(self, shape: ExpertShape) -> None:
        self.row_shape = (shape.neuron_bytes,)
        self.dtype = torch.uint8
        self._expert = torch.empty(shape.intermediate, *self.row_shape, dtype=self.dtype, device=META)

    def expert(self, layer: int, expert: int) -> torch.Tensor:
        return self._expert


class Simulator:
    """The engine's decisions for one policy's settings on a virtual clock."""

    def __init__(self, shape: ExpertShape, settings: EngineSettings, times: Timings, bandwidth: float,
                 latency: float = 0.0, predictor=None) -> None:
        self.shape = shape
        self.settings = settings
        self.times = times
        # The engine's own costs come from the timings (profiling/model.py measures them):
        # c, a split top hit's extra, as one segment's fixed cost: a segment of n neurons takes
        # c + (T_exp − c)·n/I, so a split expert (top + bottom) costs c more than a whole one;
        self.segment_overhead = min(times.t_segment, times.t_exp)
        # h_load per loaded segment (pool slot, link submit, acquire, release: the host's, not the link's)
        # and h_pf per layer that prefetches (the predictor's ranking and the prefetcher's bookkeeping).
        self.load_host = times.t_host_load
        # h_sub, the part of h_load spent submitting a demand load, before the layer's first compute (≤ h_load)
        self.submit_host = times.submit_share
        self.prefetch_host = times.t_host_prefetch
        self.clock = VirtualClock()
        self.link = EmulatedLink(bandwidth / 1e9, latency, clock=self.clock)
        plan = settings.plan
        self.resident = plan.resident
        self.layers: list[_Layer] = []
        for i, lp in enumerate(plan.layers):
            policy = make_policy(settings.eviction, shape.num_experts, omega=settings.omega, rho=settings.rho,
                                 seed=i)
            cache = LayerCache(lp.cache_size, policy)
            resident = plan.resident_layer(i, shape)  # filled from the start, as the engine fills it
            if resident:
                for e in range(shape.num_experts):
                    cache.insert(e)
            self.layers.append(_Layer(cache, lp.top_neurons, host=lp.host and not resident))
        self.store = _MetaStore(shape)
        self.fills = Fills(len(plan.layers))
        self.pool = StagingPool(plan.staging_slots, shape.intermediate, self.store.row_shape, self.store.dtype, META)
        self.prefetcher = Prefetcher(self.pool, self.link, self.store, self.layers, shape)
        self.predictor = predictor  # a RoutingPredictor, or None: the tokens' own rankings

    @property
    def now(self) -> float:
        return self.clock.now()

    # --- forward passes ---------------------------------------------------------
    def prefill(self, tokens: Sequence[Token]) -> None:
        """A prompt: its tokens recorded token by token, every missed expert loaded whole and
        offered to the cache. Time is not simulated (the TTFT is not predicted)."""
        if not tokens:
            return
        self.pool.clear()
        if self.predictor is not None:
            self.predictor.begin(tokens)
        for i, state in enumerate(self.layers):
            rows = [t.experts[i] for t in tokens]
            active = sorted({e for row in rows for e in row})
            state.cache.record(rows)
            for e in active:
                state.cache.pin(e)
            if state.top_neurons > 0 and not self.resident:
                for e in active:
                    if e not in state.cache:
                        state.cache.admit(e)
            for e in active:
                state.cache.unpin(e)
            state.cache.advance()
        self.clock.advance(1e3)  # whatever the prompt left on the link has landed before the first decode step

    def decode(self, token: Token, next_token: Token | None) -> float:
        """One decode step; returns its time (s)."""
        start = self.now
        if self.predictor is not None:
            self.predictor.begin([token])
        route = min(self.times.t_host_route, self.times.t_att)  # part of T_att, after the layer's loads are submitted
        for i in range(len(self.layers)):
            self.clock.advance(self.times.t_att - route)
            self._moe_layer(i, token, next_token, route)
        self.clock.advance(self.times.t_head)
        return self.now - start

    def _moe_layer(self, i: int, token: Token, next_token: Token | None, route: float = 0.0) -> None:
        """Engine.experts_forward, step by step (offload/engine.py), compute as clock time."""
        if self.layers[i].host:
            return self._host_layer(i, token, next_token, route)
        shape, pool, link = self.shape, self.pool, self.link
        state = self.layers[i]
        c = state.counters
        t_call = self.segment_overhead
        t_neuron = (self.times.t_exp - t_call) / shape.intermediate
        k = shape.intermediate if self.resident else state.top_neurons
        active = sorted(set(token.experts[i]))
        state.cache.record([token.experts[i]])
        for e in active:
            state.cache.pin(e)
        # 1. classify
        hits = pool.classify(i, active, state.cache.cached(), k, shape.intermediate)
        c.count(len(active), hits)
        # 2. covering prefetches become demand loads; the rest is queued ahead of any prefetch
        loading = pool.take_over(i, hits.covered, link)
        waiting = list(hits.loads)
        self._submit_demand(i, waiting, loading)  # h_sub each, the first already on the link
        self.clock.advance(route)  # h_route: the routing layout and token gather, the loads already on the link
        # 3. compute what is on the device, then each load as it arrives
        on_device = len(hits.whole) + len(hits.top_hits)
        self.clock.advance(on_device * t_call + (len(hits.whole) * shape.intermediate + len(hits.top_hits) * k) * t_neuron)
        prefetched = False
        while loading or waiting:
            if not waiting and not prefetched:
                self._prefetch(i, token, next_token)
                prefetched = True
            entry = next((x for x in loading if x.transfer.ready()), loading[0])
            loading.remove(entry)
            link.acquire(entry.transfer, tag=i)
            # h_load, less h_sub: spent submitting the load (a taken-over prefetch's submission was the prefetcher's,
            # in h_pf)
            host = self.load_host - self.submit_host
            self.clock.advance(host + t_call + (shape.intermediate - max(entry.start, k if entry.expert in hits.top_hits else 0))
                               * t_neuron)
            if entry.expert not in hits.top_hits and state.top_neurons > 0:
                if state.cache.admit(entry.expert) is not None:  # the top copied into the cache: k/I of a_e
                    self.clock.advance(self.times.t_admit * k / shape.intermediate)
            pool.release(entry, link.record_reads())
            self._submit_demand(i, waiting, loading)
        if not prefetched:
            self._prefetch(i, token, next_token)
        self._end_layer(state, active)

    def _host_layer(self, i: int, token: Token, next_token: Token | None, route: float) -> None:
        """A host-lane layer (offload/host.py, the engine's HostLane): whole and top hits on the device, bottoms
        and misses on the host at the same time; the layer takes the longer of the two, plus the lane's round
        trip t_host_sync; a host-computed miss's top is offered to the cache and filled over the link."""
        shape, times, link = self.shape, self.times, self.link
        state = self.layers[i]
        c = state.counters
        width, k = shape.intermediate, state.top_neurons
        t_call = self.segment_overhead
        t_neuron = (times.t_exp - t_call) / width
        active = sorted(set(token.experts[i]))
        state.cache.record([token.experts[i]])
        for e in active:
            state.cache.pin(e)
        self.fills.landed(i)
        hits = self.pool.classify(i, active, state.cache.cached(), k, width)
        c.count(len(active), hits)
        work = split_work(hits, self.fills.in_flight(i))
        self.clock.advance(route)
        device = (len(work.device_whole) * (t_call + width * t_neuron) + len(work.split) * (t_call + k * t_neuron))
        host = len(work.split) * times.t_host(width - k, width) + len(work.host_whole) * times.t_host(width, width)
        if work.split or work.host_whole:
            host += times.t_host_sync
        self.clock.advance(max(device, host))
        c.host_s += host
        c.host_segments += len(work.split) + len(work.host_whole)
        if k > 0:
            for e in hits.misses:
                c.bytes_prefetch += self.fills.offer(i, e, state.cache, link, lambda slot: self._fill_rows(k),
                                                     self.store.expert(i, e)[:k], after=(link.record_reads(),))
        self._prefetch(i, token, next_token)
        self._end_layer(state, active)

    def _end_layer(self, state, active: list[int]) -> None:
        """A layer's end, on either lane: the link's stalls charged to the layers that waited, its experts unpinned."""
        for tag, seconds in self.link.stalls():
            self.layers[tag].counters.exposed_s += seconds
        for e in active:
            state.cache.unpin(e)
        state.cache.advance()

    def _fill_rows(self, k: int) -> torch.Tensor:
        return torch.empty(k, *self.store.row_shape, dtype=self.store.dtype, device=META)

    def _submit_demand(self, i: int, waiting: list[tuple[int, int]], loading: list[Staged]) -> None:
        """Queue the demand loads that find a slot (at the clock's time: one copy engine runs them in turn), then
        spend h_sub on each (the engine submits them one after another before it computes)."""
        before = len(loading)
        self.layers[i].counters.bytes_demand += self.pool.submit_demand(i, waiting, loading, self.link, self.store)
        self.clock.advance((len(loading) - before) * self.submit_host)

    def _prefetch(self, i: int, token: Token, next_token: Token | None) -> None:
        if not self.settings.prefetch or self.resident:
            return
        self.clock.advance(self.prefetch_host)
        if self.predictor is not None:
            predictions = self.predictor.after_layer(i, token.experts[i])
        else:  # the recorded ranking for the next MoE layer (the last layer: layer 0 of the next token)
            target, source = (i + 1, token) if i + 1 < len(self.layers) else (0, next_token)
            ranking = source.predicted[target] if source is not None and source.predicted is not None else None
            predictions = [ranked_prediction(target, ranking, self.shape.num_experts)] if ranking else []
        self.prefetcher.issue(predictions)

    def counters(self) -> Counters:
        total = Counters()
        for state in self.layers:
            total = total + state.counters
        return total


class RoutingPredictor:
    """A routing-only predictor for traces without the prefetcher's rankings (vLLM traces):
    MoE-Infinity's EAM (`prediction/eam.py`, the engine's class) fed the trace's routing;
    its multi-layer predictions go to the prefetcher as the engine's would."""

    name = "eam"

    def __init__(self, num_layers: int, num_experts: int, top_k: int) -> None:
        self.num_layers = num_layers
        self.eam = EamPredictor(num_layers, num_experts, top_k)
        self.iteration = Iteration(num_layers, num_experts)

    def begin(self, tokens: Sequence[Token]) -> None:
        """A forward pass: a prompt (several tokens) starts a new request, one token continues it."""
        self.iteration.begin(None, tokens=len(tokens))
        self.eam.begin(self.iteration)
        if len(tokens) > 1:  # the prompt's routing counts in the request's EAM
            for i in range(self.num_layers):
                self.iteration.observe(i, None, torch.tensor([t.experts[i] for t in tokens]))
                self.eam.after_layer(self.iteration, i)

    def start_sequence(self) -> None:
        self.iteration.begin(None, tokens=2)  # a new request, even without a prompt
        self.eam.begin(self.iteration)

    def after_layer(self, layer: int, experts: Sequence[int]) -> list[Prediction]:
        self.iteration.observe(layer, None, torch.tensor([list(experts)]))
        return self.eam.after_layer(self.iteration, layer)


def next_ranking(predictions: Sequence[Prediction], layer: int, num_layers: int) -> list[int] | None:
    """The ranking predicted for the MoE layer after `layer` (wrapping to layer 0), if any."""
    target = (layer + 1) % num_layers
    return next((p.ranking() for p in predictions if p.target == target and p.distance == 1), None)


def tokens_of(trace) -> list[list[Token]]:
    """A read trace (fmoe_cli/trace.py: Trace) as token sequences for the simulator."""
    out = []
    for seq in trace.sequences:
        layers = seq.records  # [layer position][token position]
        tokens = []
        for t in range(len(seq.tokens)):
            experts = tuple(layers[j][t].experts for j in range(len(layers)))
            predicted = tuple(layers[j][t].predicted for j in range(len(layers)))
            tokens.append(Token(experts, predicted if any(p is not None for p in predicted) else None))
        out.append(tokens)
    return out


def simulate_policy(shape: ExpertShape, settings: EngineSettings, times: Timings, sequences: Sequence[Sequence[Token]], *,
                    bandwidth: float, latency: float = 0.0, prompt_tokens: int = 0, warmup: int = 0,
                    predictor_factory=None, before_prefill: Callable | None = None) -> SimResult:
    """Simulate one policy over every sequence: the first `prompt_tokens` of a sequence are its
    prefill; `warmup` decode tokens run first (as `fmoe bench` warms up on the same prompt) and
    are not measured. One Simulator for all sequences (caches carry over, as in a session).
    `before_prefill(sim, prompt, n)`: told before the measured prefill of sequence n (its cache state)."""
    sim = Simulator(shape, settings, times, bandwidth, latency,
                    predictor=predictor_factory() if predictor_factory is not None else None)
    steps: list[float] = []
    before = None
    for n_seq, tokens in enumerate(sequences):
        if sim.predictor is not None:
            sim.predictor.start_sequence()
        prompt, rest = list(tokens[:prompt_tokens]), list(tokens[prompt_tokens:])
        for measured in ((False, True) if warmup else (True,)):
            run = rest if measured else rest[:warmup]
            if measured and before_prefill is not None:
                before_prefill(sim, prompt, n_seq)
            sim.prefill(prompt)
            if measured and before is None:
                before = sim.counters()
            for n, token in enumerate(run):
                step = sim.decode(token, run[n + 1] if n + 1 < len(run) else None)
                if measured:
                    steps.append(step)
    measured = sim.counters() - (before or Counters())
    n = max(1, len(steps))
    return SimResult(
        policy=settings.policy,
        tpot_s=statistics.median(steps) if steps else 0.0,
        mean_tpot_s=statistics.fmean(steps) if steps else 0.0,
        tokens=len(steps),
        hit_rate=measured.hit_rate,
        exposed_s_per_token=measured.exposed_s / n,
        bytes_per_token=(measured.bytes_demand + measured.bytes_prefetch) / n,
        host_s_per_token=measured.host_s / n,
        prefetch_precision=measured.prefetch_precision,
        plan=settings.plan.summary(),
        whole_hit_rate=measured.hits_full / measured.activations if measured.activations else 0.0,
    )


def stats_from(sequences: Sequence[Sequence[Token]], shape: ExpertShape, predictor=None):
    """Routing statistics (planning/stats.py) of recorded routing, as the engine's recorder would
    have gathered them: each token ranked by LCP priority before it, with the prefetcher's
    ranking (the trace's, or the routing-only predictor's)."""
    stats = RoutingStats.empty("trace", shape.num_layers, shape.num_experts, shape.top_k)
    policies = [make_policy("lcp", shape.num_experts) for _ in range(shape.num_layers)]
    step = 0
    last = shape.num_layers - 1
    for tokens in sequences:
        if predictor is not None:
            predictor.start_sequence()
        ahead: list[int] | None = None  # the ranking predicted for layer 0 by the previous token's last layer
        ranking: list[int] | None = None  # the ranking predicted for the next layer by the current one
        for n, token in enumerate(tokens):
            if predictor is not None:
                predictor.begin([token])
            for i, experts in enumerate(token.experts):
                if predictor is not None:
                    predicted = ahead if i == 0 else ranking
                elif token.predicted is not None:
                    predicted = token.predicted[i]
                else:
                    predicted = None
                stats.observe(i, sorted(set(experts)), held_order(lcp_ranking(policies[i], step), policies[i].last, step),
                              predicted)
                for e in experts:
                    policies[i].touch(e, step)
                if predictor is not None:
                    ranking = next_ranking(predictor.after_layer(i, experts), i, shape.num_layers)
                    if i == last:
                        ahead = ranking
            step += 1
    return stats


def predictor_for(sequences: Sequence[Sequence[Token]], shape: ExpertShape) -> Callable[[], RoutingPredictor | None]:
    """What makes the prefetch rankings of recorded routing: none when it carries the prefetcher's own,
    else the routing-only predictor (a new one per call)."""
    has_rankings = any(t.predicted is not None for seq in sequences for t in seq)
    return lambda: None if has_rankings else RoutingPredictor(shape.num_layers, shape.num_experts, shape.top_k)


def trace_stats(sequences: Sequence[Sequence[Token]], shape: ExpertShape) -> RoutingStats:
    """The statistics the simulation plans `moepic` from: those of the routing itself (`fmoe plan --trace`
    plans from them too, so its per-layer plan is the simulated one)."""
    return stats_from(sequences, shape, predictor_for(sequences, shape)())


def predict_policies(shape: ExpertShape, budget_bytes: int, timings: Timings, bandwidth: float, latency: float,
                     *, sequences: Sequence[Sequence[Token]], policies: Sequence[str], prompt_tokens: int = 0,
                     progress: Callable[[str], None] | None = None, stats: RoutingStats | None = None,
                     plans: dict | None = None) -> dict[str, SimResult]:
    """Simulated TPOT of every policy over the same routing. Without the prefetcher's rankings
    in the routing, the routing-only `eam` predictor makes them. `moepic` gets the configurator's
    plan from statistics of this routing (`trace_stats`, unless given) and these timings. `plans`: more
    plans by name (e.g. llama.cpp's pattern, configurator.host_baselines), simulated after the policies
    with LCP and no prefetch."""
    predictor = predictor_for(sequences, shape)
    stats = trace_stats(sequences, shape) if stats is None else stats
    out = {}
    for name in policies:
        if progress is not None:
            progress(name)  # called before each policy
        settings = settings_for(name, PlanInputs(shape, budget_bytes, timings, stats, min_predictions=0))
        out[name] = simulate_policy(shape, settings, timings, sequences, bandwidth=bandwidth, latency=latency,
                                    prompt_tokens=prompt_tokens, predictor_factory=predictor)
    for name, plan in (plans or {}).items():
        settings = EngineSettings(name, plan, "lcp", plan.prefetch, LCP_OMEGA, LCP_RHO)
        out[name] = simulate_policy(shape, settings, timings, sequences, bandwidth=bandwidth, latency=latency,
                                    prompt_tokens=prompt_tokens, predictor_factory=predictor)
    return out
