"""Predicted TPOT: a deterministic event simulation of the engine's own decisions.

Over recorded routing (an fmoe trace, which carries the prefetcher's rankings, or a
vLLM trace with a routing-only predictor), one decode token at a time, every MoE
layer goes through what `offload/engine.py` does, on a virtual clock:

- the cache is the engine's `LayerCache` with the engine's policy objects, built from
  the policy's own plan (`planning/presets.py`, the configurator's plan
  for `moepic`), fed token by token as the engine feeds it;
- the link is a `VirtualLink`: one copy engine, transfers in priority order (demand
  loads first, then prefetches by rank), each lasting latency + bytes / bandwidth, a
  started transfer never pre-empted, a queued one cancelled for free;
- the staging pool has the plan's slots, with the engine's rules: a wrong prefetch of
  the routing layer is released, a demand load takes a free slot or one of another
  layer's unused prefetches, a prefetch only a free slot or that of a lower-priority
  queued prefetch; a released slot whose copy is running is reusable once it ends;
- the prefetcher issues the prediction's best Y = K experts for the next MoE layer
  (the last layer: layer 0 of the next token) once the layer's demand loads are
  queued, the bottom only when the top is cached, skipping what is staged or whole.

Compute, on one stream (MoEpic's symbols, seconds per decode token; `Timings`, whose
T_load is not used: the link's bandwidth and latency time every segment):
    per MoE layer:  T_att, then T_exp · (neurons / I) per expert segment, in the engine's
                    order: whole and cached-top segments first, then each load as it arrives
    per token:      T_head (LM head, final norm, layers before the first MoE layer)
A wait for a transfer moves the clock to its end; everything else overlaps.

TPOT = the median over the measured decode tokens. It is a prediction (labelled
"simulated" wherever it is printed), as good as its inputs: the compute times (measured
on this machine, from a profile, or estimated from the memory bandwidth) and the
link's figures.
"""

from __future__ import annotations

import heapq
import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fmoe_cli.offload.cache import LayerCache
from fmoe_cli.offload.policies import make_policy
from fmoe_cli.planning.configurator import Timings
from fmoe_cli.types import ExpertShape, Plan

DEMAND = 0
PREFETCH = 1


# --- the link on a virtual clock ----------------------------------------------


@dataclass(eq=False)
class VirtualTransfer:
    nbytes: int
    priority: int
    submitted: float
    state: str = "queued"  # queued → running → done, or queued → cancelled
    start: float = 0.0
    end: float = 0.0


class VirtualLink:
    """One copy engine on a virtual clock: transfers in priority order (FIFO among equals),
    each latency + bytes / bandwidth long, never pre-empted once started.

    Time only moves forward: `submit(now)`, `ready(now)` and `wait(now)` are called with
    non-decreasing `now` (the compute stream's clock)."""

    def __init__(self, bandwidth: float, latency: float = 0.0) -> None:
        if not bandwidth > 0:
            raise ValueError("link bandwidth must be > 0 bytes/s")
        self.bandwidth = bandwidth
        self.latency = latency
        self._queue: list[tuple[int, int, VirtualTransfer]] = []
        self._seq = itertools.count()
        self._running: VirtualTransfer | None = None
        self._free_at = 0.0  # when the copy engine last became idle
        self.bytes_moved = 0
        self.busy_s = 0.0

    def duration(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth

    def _start_next(self) -> None:
        while self._queue:
            _, _, t = heapq.heappop(self._queue)
            if t.state != "queued":
                continue
            t.state = "running"
            t.start = max(self._free_at, t.submitted)
            t.end = t.start + self.duration(t.nbytes)
            self._running = t
            return

    def _run_until(self, now: float) -> None:
        """Finish every transfer that ends by `now`, starting the next in priority order."""
        while True:
            if self._running is None:
                self._start_next()
                if self._running is None:
                    return
            t = self._running
            if t.end > now:
                return
            t.state = "done"
            self._free_at = t.end
            self.bytes_moved += t.nbytes
            self.busy_s += t.end - t.start
            self._running = None

    def submit(self, nbytes: int, priority: int, now: float) -> VirtualTransfer:
        self._run_until(now)  # what started before now keeps its place
        t = VirtualTransfer(nbytes, priority, now)
        heapq.heappush(self._queue, (priority, next(self._seq), t))
        if self._running is None:
            self._start_next()
        return t

    def reprioritise(self, t: VirtualTransfer, priority: int) -> None:
        if t.state == "queued" and priority < t.priority:
            t.priority = priority
            heapq.heappush(self._queue, (priority, next(self._seq), t))

    def cancel(self, t: VirtualTransfer) -> bool:
        if t.state == "queued":
            t.state = "cancelled"
            return True
        return False

    def ready(self, t: VirtualTransfer, now: float) -> bool:
        self._run_until(now)
        return t.state == "done"

    def wait(self, t: VirtualTransfer, now: float) -> float:
        """The time `t` is done (≥ now)."""
        if t.state == "cancelled":
            raise RuntimeError("waiting on a cancelled transfer")
        while t.state != "done":
            if self._running is None:
                self._start_next()
            self._run_until(self._running.end)
        return max(now, t.end)


# --- the staging pool (bookkeeping only) ----------------------------------------


@dataclass(eq=False)
class SimStaged:
    layer: int
    expert: int
    start: int  # first neuron loaded (0: the whole expert)
    transfer: VirtualTransfer
    prefetched: bool
    priority: float = 0.0  # the prefetcher's priority (score · weight)
    in_use: bool = False


class SimPool:
    def __init__(self, slots: int, link: VirtualLink) -> None:
        self.slots = slots
        self.link = link
        self.entries: list[SimStaged] = []
        self.draining: list[SimStaged] = []  # released while their copy runs: the slot is busy until it ends

    def find(self, layer: int, expert: int) -> SimStaged | None:
        return next((e for e in self.entries if e.layer == layer and e.expert == expert), None)

    def has_free(self, now: float) -> bool:
        self.draining = [d for d in self.draining if not self.link.ready(d.transfer, now)]
        return len(self.entries) + len(self.draining) < self.slots

    def release(self, entry: SimStaged) -> None:
        self.entries.remove(entry)
        if not self.link.cancel(entry.transfer) and entry.transfer.state != "done":
            self.draining.append(entry)

    def reclaim(self, keep_layer: int, now: float) -> float | None:
        """Room for a demand load: a free slot, else another layer's unused entry (queued first,
        then finished, then running); as a last resort wait for a draining copy. Returns the
        time the slot is free (None: every slot holds this layer's work)."""
        if self.has_free(now):
            return now
        victims = [e for e in self.entries if e.layer != keep_layer and not e.in_use]
        victims.sort(key=lambda e: {"queued": 0, "done": 1}.get(e.transfer.state, 2))
        for entry in victims:
            self.release(entry)
            if self.has_free(now):
                return now
        if self.draining:
            first = min(self.draining, key=lambda d: d.transfer.end)
            now = self.link.wait(first.transfer, now)
            if self.has_free(now):
                return now
        return None


# --- the simulation ------------------------------------------------------------


@dataclass(frozen=True)
class Token:
    """One token's routing: per MoE layer the activated experts, and the prefetcher's ranking
    for that layer if the routing source carries one."""

    experts: tuple[tuple[int, ...], ...]  # [layer] -> experts
    predicted: tuple[tuple[int, ...] | None, ...] | None = None  # [layer] -> ranking, best first


@dataclass
class SimCounters:
    activations: int = 0
    hits_full: int = 0
    hits_top: int = 0
    misses: int = 0
    bytes_demand: int = 0
    bytes_prefetch: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    exposed_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return (self.hits_full + self.hits_top) / self.activations if self.activations else 0.0


@dataclass(frozen=True)
class SimResult:
    policy: str
    tpot_s: float  # median over the measured decode tokens
    mean_tpot_s: float
    tokens: int
    hit_rate: float
    exposed_s_per_token: float
    bytes_per_token: float
    prefetch_precision: float
    plan: str


@dataclass
class _Layer:
    cache: LayerCache
    top_neurons: int
    counters: SimCounters = field(default_factory=SimCounters)


class Simulator:
    """The engine's decisions for one policy's settings (EngineSettings) on a virtual clock."""

    def __init__(self, shape: ExpertShape, settings, times: Timings, bandwidth: float, latency: float = 0.0,
                 predictor=None) -> None:
        self.shape = shape
        self.settings = settings
        self.times = times
        self.link = VirtualLink(bandwidth, latency)
        plan: Plan = settings.plan
        self.resident = plan.resident
        self.layers = []
        for i, lp in enumerate(plan.layers):
            policy = make_policy(settings.eviction, shape.num_experts, omega=settings.omega, rho=settings.rho,
                                 seed=i)
            cache = LayerCache(lp.cache_size, policy)
            if self.resident:
                for e in range(shape.num_experts):
                    cache.insert(e)
            self.layers.append(_Layer(cache, lp.top_neurons))
        self.pool = SimPool(plan.staging_slots, self.link)
        self.width = shape.top_k  # Y
        self.predictor = predictor  # routing-only predictor (ranking from routing so far), or None
        self.now = 0.0

    # --- one forward -----------------------------------------------------------
    def prefill(self, tokens: Sequence[Token]) -> None:
        """A prompt: its tokens recorded token by token, every missed expert loaded whole and
        offered to the cache (time is not simulated; the TTFT is not predicted)."""
        if not tokens:
            return
        for i, state in enumerate(self.layers):
            rows = [t.experts[i] for t in tokens]
            active = sorted({e for row in rows for e in row})
            for entry in [e for e in self.pool.entries if e.layer == i]:
                self.pool.release(entry)
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
        for entry in list(self.pool.entries):  # the prompt's loads used the whole pool
            self.pool.release(entry)
        if self.predictor is not None:
            self.predictor.begin(tokens)

    def decode(self, token: Token, next_token: Token | None) -> float:
        """One decode step; returns its time (s)."""
        t = self.times
        start = self.now
        if self.predictor is not None:
            self.predictor.begin([token])
        for i in range(len(self.layers)):
            self.now += t.t_att
            self._moe_layer(i, token, next_token)
        self.now += t.t_head
        return self.now - start

    def _moe_layer(self, i: int, token: Token, next_token: Token | None) -> None:
        shape, pool, link = self.shape, self.pool, self.link
        state = self.layers[i]
        c = state.counters
        full = shape.intermediate
        k = state.top_neurons
        t_neuron = self.times.t_exp / full
        active = sorted(set(token.experts[i]))
        state.cache.record([token.experts[i]])
        for e in active:
            state.cache.pin(e)
        c.activations += len(active)
        for entry in [x for x in pool.entries if x.layer == i and x.expert not in active]:
            pool.release(entry)
        on_device, needs = [], []  # needs: (expert, first neuron to load)
        for e in active:
            cached = state.cache.slot(e) is not None
            if cached and (k == full or self.resident):
                on_device.append(full)
                c.hits_full += 1
            elif cached:
                on_device.append(k)
                needs.append((e, k))
                c.hits_top += 1
            else:
                needs.append((e, 0))
                c.misses += 1
        loading: list[SimStaged] = []
        waiting: list[tuple[int, int]] = []
        for e, first in needs:
            entry = pool.find(i, e)
            if entry is not None and entry.start <= first:
                entry.in_use = True
                c.prefetch_used += 1
                link.reprioritise(entry.transfer, DEMAND)
                loading.append(entry)
            else:
                if entry is not None:
                    pool.release(entry)
                waiting.append((e, first))
        self._submit_demand(i, waiting, loading)
        for neurons in on_device:  # whole experts and cached tops: on the device already
            self.now += neurons * t_neuron
        prefetched = False
        while loading or waiting:
            if not waiting and not prefetched:
                self._prefetch(i, token, next_token)
                prefetched = True
            entry = next((x for x in loading if link.ready(x.transfer, self.now)), loading[0])
            if entry.transfer.state != "done":
                done = link.wait(entry.transfer, self.now)
                c.exposed_s += done - self.now
                self.now = done
            loading.remove(entry)
            self.now += (full - entry.start) * t_neuron
            if entry.start == 0 and k > 0:
                state.cache.admit(entry.expert)
            pool.release(entry)
            self._submit_demand(i, waiting, loading)
        if not prefetched:
            self._prefetch(i, token, next_token)
        for e in active:
            state.cache.unpin(e)
        state.cache.advance()

    def _submit_demand(self, i: int, waiting: list[tuple[int, int]], loading: list[SimStaged]) -> None:
        state = self.layers[i]
        while waiting:
            free_at = self.pool.reclaim(keep_layer=i, now=self.now)
            if free_at is None:
                return  # the next wave gets the slot
            if free_at > self.now:
                state.counters.exposed_s += free_at - self.now
                self.now = free_at
            e, first = waiting.pop(0)
            nbytes = (self.shape.intermediate - first) * self.shape.neuron_bytes
            entry = SimStaged(i, e, first, self.link.submit(nbytes, DEMAND, self.now), prefetched=False, in_use=True)
            self.pool.entries.append(entry)
            loading.append(entry)
            state.counters.bytes_demand += nbytes

    def _ranking(self, i: int, token: Token, next_token: Token | None) -> tuple[int, list[int]] | None:
        """(target layer, ranking) of the speculative prediction made after layer i."""
        last = len(self.layers) - 1
        target, source = (i + 1, token) if i < last else (0, next_token)
        if source is None:
            return None
        if self.predictor is not None:
            ranking = self.predictor.after_layer(i, token.experts[i])
        elif source.predicted is not None:
            ranking = source.predicted[target]
        else:
            ranking = None
        return (target, list(ranking)) if ranking else None

    def _prefetch(self, i: int, token: Token, next_token: Token | None) -> None:
        if not self.settings.prefetch or self.resident:
            return
        predicted = self._ranking(i, token, next_token)
        if predicted is None:
            return
        j, ranking = predicted
        shape, pool = self.shape, self.pool
        target = self.layers[j]
        for position, e in enumerate(ranking[: self.width]):
            if pool.find(j, e) is not None:
                continue
            cached = target.cache.slot(e) is not None
            if cached and target.top_neurons == shape.intermediate:
                continue  # whole on the device
            priority = float(self.width - position)  # score order: the earlier, the more urgent
            if not pool.has_free(self.now) and not self._displace(priority):
                break  # the pool is full of more urgent work
            first = target.top_neurons if cached else 0
            nbytes = (shape.intermediate - first) * shape.neuron_bytes
            transfer = self.link.submit(nbytes, PREFETCH + position, self.now)
            pool.entries.append(SimStaged(j, e, first, transfer, prefetched=True, priority=priority))
            target.counters.prefetch_issued += 1
            target.counters.bytes_prefetch += nbytes

    def _displace(self, priority: float) -> bool:
        victims = [e for e in self.pool.entries if e.prefetched and not e.in_use and e.transfer.state == "queued"
                   and e.priority < priority]
        if not victims:
            return False
        self.pool.release(min(victims, key=lambda e: e.priority))
        return self.pool.has_free(self.now)

    def counters(self) -> SimCounters:
        total = SimCounters()
        for state in self.layers:
            for name in SimCounters.__dataclass_fields__:
                setattr(total, name, getattr(total, name) + getattr(state.counters, name))
        return total


class RoutingPredictor:
    """A routing-only predictor for traces without the prefetcher's rankings (vLLM traces):
    MoE-Infinity's EAM (`prediction/eam.py`, the engine's class) fed the trace's routing.
    Of its multi-layer predictions the simulator uses the one for the next MoE layer."""

    name = "eam"

    def __init__(self, num_layers: int, num_experts: int, top_k: int) -> None:
        from fmoe_cli.prediction import EamPredictor, Iteration

        self.num_layers = num_layers
        self.eam = EamPredictor(num_layers, num_experts, top_k)
        self.iteration = Iteration(num_layers, num_experts)

    def begin(self, tokens: Sequence[Token]) -> None:
        """A forward pass: a prompt (several tokens) starts a new request, one token continues it."""
        self.iteration.begin(None, tokens=len(tokens))
        self.eam.begin(self.iteration)
        if len(tokens) > 1:  # the prompt's routing counts in the request's EAM
            import torch

            for i in range(self.num_layers):
                self.iteration.observe(i, None, torch.tensor([t.experts[i] for t in tokens]))
                self.eam.after_layer(self.iteration, i)

    def start_sequence(self) -> None:
        self.iteration.begin(None, tokens=2)  # a new request, even without a prompt
        self.eam.begin(self.iteration)

    def after_layer(self, layer: int, experts: Sequence[int]) -> list[int] | None:
        import torch

        self.iteration.observe(layer, None, torch.tensor([list(experts)]))
        target = (layer + 1) % self.num_layers
        for p in self.eam.after_layer(self.iteration, layer):
            if p.target == target and p.distance == 1:
                return p.ranking()
        return None


def tokens_of(trace) -> list[list[Token]]:
    """A read trace (bench/trace.py: Trace) as token sequences for the simulator."""
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


def simulate_policy(shape: ExpertShape, settings, times: Timings, sequences: Sequence[Sequence[Token]], *,
                    bandwidth: float, latency: float = 0.0, prompt_tokens: int = 0, warmup: int = 0,
                    predictor_factory=None) -> SimResult:
    """Simulate one policy over every sequence: the first `prompt_tokens` of a sequence are its
    prefill; `warmup` decode tokens run first (as `fmoe bench` warms up on the same prompt) and
    are not measured. One Simulator for all sequences (caches carry over, as in a session)."""
    sim = Simulator(shape, settings, times, bandwidth, latency,
                    predictor=predictor_factory() if predictor_factory is not None else None)
    steps: list[float] = []
    before = None
    for tokens in sequences:
        if sim.predictor is not None:
            sim.predictor.start_sequence()
        prompt, rest = list(tokens[:prompt_tokens]), list(tokens[prompt_tokens:])
        for measured in ((False, True) if warmup else (True,)):
            run = rest if measured else rest[:warmup]
            sim.prefill(prompt)
            if measured and before is None:
                before = sim.counters()
            for n, token in enumerate(run):
                step = sim.decode(token, run[n + 1] if n + 1 < len(run) else None)
                if measured:
                    steps.append(step)
    total = sim.counters()
    base = before or SimCounters()
    measured = SimCounters(**{f: getattr(total, f) - getattr(base, f) for f in SimCounters.__dataclass_fields__})
    n = max(1, len(steps))
    return SimResult(
        policy=settings.policy,
        tpot_s=statistics.median(steps) if steps else 0.0,
        mean_tpot_s=statistics.fmean(steps) if steps else 0.0,
        tokens=len(steps),
        hit_rate=measured.hit_rate,
        exposed_s_per_token=measured.exposed_s / n,
        bytes_per_token=(measured.bytes_demand + measured.bytes_prefetch) / n,
        prefetch_precision=measured.prefetch_used / measured.prefetch_issued if measured.prefetch_issued else 0.0,
        plan=settings.plan.summary(),
    )


def stats_from(sequences: Sequence[Sequence[Token]], shape: ExpertShape, predictor=None):
    """Routing statistics (planning/stats.py) of recorded routing, as the engine's recorder would
    have gathered them: each token ranked by LCP priority before it, with the prefetcher's
    ranking (the trace's, or the routing-only predictor's)."""
    from fmoe_cli.planning.stats import RoutingStats, lcp_ranking

    stats = RoutingStats.empty("trace", shape.num_layers, shape.num_experts, shape.top_k)
    policies = [make_policy("lcp", shape.num_experts) for _ in range(shape.num_layers)]
    step = 0
    last = shape.num_layers - 1
    for tokens in sequences:
        if predictor is not None:
            predictor.start_sequence()
        ahead: list[int] | None = None  # the ranking predicted for layer 0 by the previous token's last layer
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
                stats.observe(i, sorted(set(experts)), lcp_ranking(policies[i], step), predicted)
                for e in experts:
                    policies[i].touch(e, step)
                if predictor is not None:
                    ranking = predictor.after_layer(i, experts)
                    if i == last:
                        ahead = ranking
            step += 1
    return stats


def predict_policies(shape: ExpertShape, budget_bytes: int, timings: Timings, bandwidth: float, latency: float,
                     *, sequences: Sequence[Sequence[Token]], policies: Sequence[str], prompt_tokens: int = 0,
                     progress: Callable[[str], None] | None = None) -> dict[str, SimResult]:
    """Simulated TPOT of every policy over the same routing. Without the prefetcher's rankings
    in the routing, the routing-only `eam` predictor makes them. `moepic` gets the configurator's
    plan from statistics of this routing and these timings."""
    from fmoe_cli.planning.presets import PlanInputs, settings_for

    has_rankings = any(t.predicted is not None for seq in sequences for t in seq)

    def predictor():
        return None if has_rankings else RoutingPredictor(shape.num_layers, shape.num_experts, shape.top_k)

    stats = stats_from(sequences, shape, predictor())
    out = {}
    for name in policies:
        if progress is not None:
            progress(name)  # called before each policy
        settings = settings_for(name, PlanInputs(shape, budget_bytes, timings, stats))
        out[name] = simulate_policy(shape, settings, timings, sequences, bandwidth=bandwidth, latency=latency,
                                    prompt_tokens=prompt_tokens, predictor_factory=predictor)
    return out
