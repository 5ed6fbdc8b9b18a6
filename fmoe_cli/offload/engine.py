"""The offloading engine: transformers' experts forward, served from a split-expert cache.

One decode step through MoE layer i (docs/architecture.md § One decode step):
0. the router (run by the model) gives the activated set A_i; the predictor computes
   its scores on the device (`device_part`), and routing ids, weights and those scores
   reach the host in one copy (`Routing.of`); observers (statistics, traces) see them;
1. classify (offload/hits.py, pure): whole on the device / top hit / miss, and which
   loads a staged prefetch of this layer already covers; drop the staged rest;
2. submit: the missing segments as demand loads, ahead of any prefetch, into staging
   slots (offload/pool.py), each copy ordered after the compute that last read its slot;
3. compute what is on the device first (whole experts, cached top segments), then each
   loaded segment as its transfer completes — `link.acquire` right before the matmul is
   the only place the host may wait (offload/link.py); on the device path a decode step
   acquires all of its loads and computes the loaded whole experts in one grouped call
   over the staging pool's slots, the split experts' bottoms in one more (`_loaded_decode`);
   once every demand load is queued, show the predictor this routing and queue what it predicts (the default,
   speculative: layer i+1; the last layer predicts layer 0 of the next token): only the
   bottom when the top is cached, the whole expert otherwise (offload/prefetch.py); a
   whole loaded expert's top segment is offered to the cache (LCP by default);
4. combine the partial results in a fixed order (top + bottom, then each token's experts
   in routing order, as transformers' default `grouped_mm` experts forward sums them),
   so results are deterministic.

Prefill takes the same path with every activated expert; when the staging pool is
smaller than the activated set it works in waves (a slot freed by this layer's
finished load takes the next one).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from fmoe_cli import kernels
from fmoe_cli.errors import FmoeError, warn
from fmoe_cli.offload.cache import LayerCache, rebuild_order
from fmoe_cli.offload.hits import Hits
from fmoe_cli.offload.host import HostLane
from fmoe_cli.offload import layout
from fmoe_cli.offload.link import HostCopy, Link, device_copy, host_now, make_link, read_to_host
from fmoe_cli.offload.policies import make_policy
from fmoe_cli.offload.pool import Staged, StagingPool
from fmoe_cli.offload.prefetch import Prefetcher
from fmoe_cli.offload.store import HostStore
from fmoe_cli.prediction.base import Iteration, Predictor
from fmoe_cli.prediction.make import make_predictor
from fmoe_cli.prediction.speculative import SpeculativePredictor
from fmoe_cli.types import MiB, EngineSettings, ExpertShape, MoeLayer, Plan

IMPLEMENTATION_NAME = "fmoe"


def _experts_forward(experts, hidden_states, top_k_index, top_k_weights):
    """Registered in transformers' ExpertsInterface; dispatches to the engine that owns the module."""
    return experts._fmoe_engine.experts_forward(experts, hidden_states, top_k_index, top_k_weights)


@dataclass
class Counters:
    """Cumulative per-layer counters; `Counters.delta` gives them per token."""

    activations: int = 0  # activated experts (distinct per forward)
    hits_full: int = 0  # whole expert on the device, nothing to load
    hits_top: int = 0  # top segment cached, bottom loaded
    misses: int = 0  # nothing cached, whole expert loaded
    bytes_demand: int = 0
    bytes_prefetch: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0  # prefetched segments that their layer then used
    needed_loads: int = 0  # activated experts that needed any load
    prefetch_covered: int = 0  # … of which a prefetch had already been issued
    exposed_s: float = 0.0  # time the compute waited on the link
    lead_s: float = 0.0  # host time from submitting a forward's loads to its first compute (layout, gather)
    leads: int = 0  # … forwards that submitted loads (profiling/model.py: h_route = lead_s / leads)
    host_s: float = 0.0  # the host lane's compute (offload/host.py): misses and bottoms computed on the host
    host_segments: int = 0  # … segments it computed
    submit_s: float = 0.0  # host time submitting a forward's demand loads (slots, copy submits), before its first compute
    submitted: int = 0  # … demand loads it submitted (profiling/model.py: h_sub = submit_s / submitted)
    predict_s: float = 0.0  # host time of the prefetch path: the predictor's scores (device part, host part), ranking, issue
    predicts: int = 0  # … forwards that ran it (profiling/model.py: h_pf = predict_s / predicts)
    host_waits: int = 0  # times the host waited for the device's results (link.read_to_host; a deferred copy not done)

    def count(self, activated: int, hits: Hits) -> None:
        """Add one layer forward's classification (offload/hits.py)."""
        self.activations += activated
        self.hits_full += len(hits.whole)
        self.hits_top += len(hits.top_hits)
        self.misses += len(hits.misses)
        self.needed_loads += hits.needed
        self.prefetch_used += len(hits.covered)
        self.prefetch_covered += len(hits.covered)

    def __add__(self, other: Counters) -> Counters:
        a, b = self.__dict__, other.__dict__
        return Counters(*[a[name] + b[name] for name in COUNTER_FIELDS])

    def __sub__(self, other: Counters) -> Counters:
        a, b = self.__dict__, other.__dict__
        return Counters(*[a[name] - b[name] for name in COUNTER_FIELDS])

    @staticmethod
    def total(counters: list[Counters]) -> Counters:
        """Σ counters, each field added left to right from 0 (as `sum`: the same floats); one object, not one
        per term (generate.py asks for the engine's total twice a token)."""
        rows = [c.__dict__ for c in counters]
        out = []
        for name, value in Counters().__dict__.items():
            for row in rows:
                value = value + row[name]
            out.append(value)
        return Counters(*out)

    @property
    def bytes_moved(self) -> int:
        return self.bytes_demand + self.bytes_prefetch

    @property
    def hit_rate(self) -> float:
        return (self.hits_full + self.hits_top) / self.activations if self.activations else 0.0

    @property
    def prefetch_precision(self) -> float:
        return self.prefetch_used / self.prefetch_issued if self.prefetch_issued else 0.0

    @property
    def prefetch_recall(self) -> float:
        return self.prefetch_covered / self.needed_loads if self.needed_loads else 0.0


COUNTER_FIELDS = tuple(f.name for f in fields(Counters))  # in declaration order (the constructor's)
# Routed slots (T·K) from which Routing.layout sorts with torch (a prefill's: ~10 µs against ~0.3 ms of Python for
# 512 slots); fewer (a decode step's K) sort as a Python list, which costs less than the ops there.
LAYOUT_SORT_FROM = 64


@dataclass
class Routing:
    """One layer's routing on the host, from one device→host copy, and each expert's rows."""

    ids: torch.Tensor  # [T, K] activated experts per token (host)
    weights: torch.Tensor  # [T, K] their routing weights (host)
    flat: list[int]  # ids flattened, token-major
    active: list[int]  # distinct activated experts, ascending
    _layout: tuple | None = None
    _order: torch.Tensor | None = None  # layout's perm on the host
    _routing_order: torch.Tensor | None = None

    extra: dict = field(default_factory=dict)  # the predictor's device parts, on the host

    @classmethod
    def of(cls, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, extra: dict | None = None,
           pack: bool | None = None) -> Routing:
        """Ids, weights and `extra` (key -> tensor) to the host in one copy (float64 holds ids,
        bf16/fp32 weights and scores exactly). `pack`: default, only when they are not on the host."""
        extra = extra or {}
        if not (pack if pack is not None else not top_k_index.is_cpu):
            return cls._make(top_k_index, top_k_weights,  # (inference: nothing to detach from, no op)
                             {key: t.detach() if t.requires_grad else t for key, t in extra.items()} if extra else {})
        decode = top_k_index.shape[0] == 1  # a decode token: its [1, K] rows side by side, no view of them either way
        parts = [top_k_index, top_k_weights] if decode else [top_k_index.reshape(-1), top_k_weights.reshape(-1)]
        parts += [t.reshape(1, -1) if decode else t.reshape(-1) for t in extra.values()]
        host = read_to_host(torch.cat([(t.detach() if t.requires_grad else t).double()  # (inference: no detach op)
                                       for t in parts], dim=-1))  # the layer's one wait for the device
        pieces = iter(host.split([t.shape[-1] for t in parts], dim=-1))
        if decode:
            ids, weights = next(pieces).long(), next(pieces).to(top_k_weights.dtype)  # [1, K] each
        else:
            ids = next(pieces).long().view(top_k_index.shape)
            weights = next(pieces).to(top_k_weights.dtype).view(top_k_weights.shape)
        out = {key: next(pieces).to(t.dtype).view(t.shape) for key, t in extra.items()}
        return cls._make(ids, weights, out)

    @classmethod
    def _make(cls, ids: torch.Tensor, weights: torch.Tensor, extra: dict) -> Routing:
        rows = ids.tolist()
        flat = rows[0] if len(rows) == 1 else [e for row in rows for e in row]  # token-major ([T, K]: no reshape op)
        return cls(ids, weights, flat, sorted(set(flat)), extra=extra)

    def tokens(self) -> list[list[int]]:
        """Each token's K activated experts (from `flat`: no op)."""
        k = self.ids.shape[-1]
        flat = self.flat
        return [flat] if len(flat) == k else [flat[t:t + k] for t in range(0, len(flat), k)]

    def layout(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict[int, slice]]:
        """The routed (token, k) positions sorted by expert, tokens ascending within one: `perm`
        [T·K] (positions t·K + k, on `device`), their tokens (perm // K) and each expert's span.
        One host sort and one host→device copy; no per-expert sync."""
        if self._layout is None:
            if len(self.flat) > LAYOUT_SORT_FROM:  # a prefill's T·K slots: torch's stable sort, ~10 µs
                ids = self.ids.reshape(-1).cpu()
                order = torch.argsort(ids, stable=True)  # by expert, then position: the sort below's order
                counts = dict(zip(self.active, torch.bincount(ids)[self.active].tolist()))
            else:
                order = torch.tensor(sorted(range(len(self.flat)), key=self.flat.__getitem__), dtype=torch.long)
                counts = collections.Counter(self.flat)  # one pass, not one count per expert
            perm = order.to(device, non_blocking=True) if device.type != "cpu" else order
            spans, start = {}, 0
            for e in self.active:
                spans[e] = slice(start, start + counts[e])
                start += counts[e]
            self._layout = (perm, perm // self.ids.shape[-1], spans)
            self._order = order
        return self._layout

    def routing_order(self, device: torch.device) -> torch.Tensor:
        """[T·K]: for each routed position t·K + k, its row in `layout`'s expert-sorted order (perm's inverse),
        which puts rows sorted by expert back in routing order. One host→device copy."""
        if self._routing_order is None:
            self.layout(device)
            order = self._order
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(len(order))  # row of position order[r] is r
            self._routing_order = inverse.to(device, non_blocking=True) if device.type != "cpu" else inverse
        return self._routing_order


@dataclass
class LayerState:
    cache: LayerCache
    tops: torch.Tensor  # [C_i, k_i, *row_shape] on the device (for resident: all experts, whole); `aliased`: on "meta"
    top_neurons: int  # k_i
    top_rows: list  # store.rows(tops[slot]) per cache slot, made once (what segment_forward takes; store.stacked_rows)
    counters: Counters = field(default_factory=Counters)
    host: bool = False  # the host lane: misses and bottoms computed on the host in decode (LayerPlan.host)
    resident: bool = False  # every expert whole in `tops` (Plan.resident): nothing is ever staged, loaded or admitted
    expert_rows: list | None = None  # resident: top_rows of each expert by id (its slot never changes), made once
    slot_table: torch.Tensor | None = None  # resident, device side: [N] each expert's slot, on the device, made once
    # The CPU behind a link that moves no bytes (Engine.aliased): a cache slot is a view of the host store's rows of
    # the expert it holds, not a copy of them (the same bytes, read-only: no kernel writes its rows). `tops` is then
    # a tensor on "meta" (the plan's shape and bytes, no memory) and top_views[slot] the view (None: never filled).
    aliased: bool = False
    top_views: list | None = None

    @classmethod
    def of(cls, cache: LayerCache, tops: torch.Tensor, top_neurons: int, store: HostStore) -> LayerState:
        if tops.device.type == "meta":
            return cls(cache, tops, top_neurons, [None] * tops.shape[0], aliased=True, top_views=[None] * tops.shape[0])
        return cls(cache, tops, top_neurons, store.stacked_rows(tops))

    def top(self, slot: int) -> torch.Tensor:
        """What cache slot `slot` holds: [k_i, *row_shape]."""
        return self.top_views[slot] if self.aliased else self.tops[slot]

    def put_top(self, slot: int, rows: torch.Tensor, store: HostStore, made=None) -> None:
        """Expert rows [k_i, *row_shape] into cache slot `slot`, in the compute's order: a copy on the device
        (offload/link.py `device_copy`), or where `aliased`, the slot made a view of `rows`, which must then be the
        host store's own rows (offload/store.py `expert`), not a buffer that is reused (a staging slot)."""
        if not self.aliased:
            device_copy(self.tops[slot], rows)
            return
        self.top_views[slot] = rows
        self.top_rows[slot] = made if made is not None else store.rows(rows)  # made: store.rows(rows) made before


@dataclass
class RouteEvent:
    """What an observer (statistics, trace writer) sees at routing time, before the
    cache policy has seen the token(s)."""

    layer: int  # MoE layer index
    top_k_index: torch.Tensor  # [T, K] activated experts per token
    top_k_weights: torch.Tensor  # [T, K] their routing weights
    routed: list[int]  # top_k_index flattened (token-major)
    cache: LayerCache  # the layer's cache (policy state before this forward)
    predicted: list[int] | None  # the prefetcher's ranking for this layer (best first), if one was made


RouteObserver = Callable[[RouteEvent], None]


def fallback_settings(settings: EngineSettings, previous: EngineSettings | None, min_slots: int) -> list:
    """What to build when `settings` runs out of device memory, largest first ((what, settings) pairs):
    `settings` with every cache halved, again and again down to the staging pool alone (every expert
    loaded on demand), and the previous plan (it ran) where it is smaller."""
    plan = settings.plan
    out = []
    sizes = [lp.cache_size for lp in plan.layers]
    while any(sizes):
        sizes = [c // 2 for c in sizes]
        layers = tuple(replace(lp, cache_size=c, vram_bytes=lp.vram_bytes * c // lp.cache_size if c else 0)
                       for lp, c in zip(plan.layers, sizes))
        # A resident plan has no staging pool: the smaller ones load what they miss.
        smaller = replace(plan, layers=layers, resident=False, staging_slots=max(plan.staging_slots, min_slots))
        what = f"caching {sum(sizes)} segments" if any(sizes) else "loading every expert on demand"
        out.append((what, replace(settings, plan=smaller)))
    if previous is not None and previous.plan.total_bytes < plan.total_bytes:
        out.append(("kept the previous plan", previous))
    return sorted(out, key=lambda pair: -pair[1].plan.total_bytes)


class Engine:
    def __init__(
        self,
        layers: list[MoeLayer],
        store: HostStore,
        shape: ExpertShape,
        link: Link,
        device: torch.device,
        dtype: torch.dtype,
        predictor: Predictor | None = None,
        host_threads: int = 1,
    ) -> None:
        self.moe_layers = layers
        self.store = store
        self._combine_in_c = kernels.decode_steps_in_c()  # float32 weighted sums in C (_combine_decode, _combine)
        self.shape = shape
        self.link = link
        self.device = device
        # The CPU behind a link that hands out the host store's rows (no bytes moved): the caches' slots are views of
        # the store (LayerState.aliased), as the link's loads are: a copy would hold the same bytes twice in RAM.
        self.aliased = device.type == "cpu" and not link.copy
        self.dtype = dtype
        routers = [layer.choice for layer in layers]  # how each router chooses: what the predictors rank with
        self.predictor = predictor or SpeculativePredictor(routers)
        self.prefetcher: Prefetcher | None = None  # built with each plan's pool
        self.iteration = Iteration(shape.num_layers, shape.num_experts, routers)  # what predictors see
        self._embedding_hook = None
        self.observers: list[RouteObserver] = []
        self.settings: EngineSettings | None = None
        self.layers: list[LayerState] = []
        self.pool: StagingPool | None = None
        self._predicted: list[list[int] | None] = [None] * shape.num_layers
        self._stacks_for: dict = {}  # (dtype, activation) -> store.stacks of a CPU decode token (_stacks)
        # the host lane (offload/host.py): used by the layers whose plan computes misses and bottoms on the host
        self.host_lane = HostLane(shape.num_layers, host_threads)
        # The device's code path (a GPU; tests on the CPU set it, FMOE_DEVICE_PATH=1 for measurements): a resident
        # layer's decode computes on the device from the routing there (`_resident_device_decode`), its bookkeeping
        # waits until the token is done, and a layer's routing is read through `read_to_host`.
        self.device_side = device.type == "cuda" or os.environ.get("FMOE_DEVICE_PATH", "").strip() == "1"
        self._grouped_on_device = True  # False once torch's grouped matmul refused this device (routed_forward)
        self._deferred: list[int] = []  # layers whose routing is on its way to the host (`_defer`, `settle`)
        self._route_copies: dict[int, tuple[HostCopy, HostCopy]] = {}  # per layer: its ids' and weights' copies
        self.decode_graphs: dict = {}  # capacity -> generate.DecodeGraph: replayed decode steps (read the buffers)
        self.graph_factory = None  # what DecodeGraph captures with (None: torch's CUDA graphs on a GPU; tests set it)
        # Why a decode step must not be replayed from a graph, whatever the plan (None: it may): a routing that Python
        # picks per token (fmoe bench --replay-routing) would be frozen at the capture's token.
        self.graph_veto: str | None = None
        self.capturing = None  # while a DecodeGraph captures a decode step: its generate.StepCapture (`_captured`)

    # --- set-up --------------------------------------------------------------
    def install(self, model) -> None:
        """Route every experts module of `model` through this engine."""
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION_NAME, _experts_forward)
        for layer in self.moe_layers:
            layer.experts._fmoe_engine = self
            layer.experts._fmoe_layer = layer.index
        model.set_experts_implementation(IMPLEMENTATION_NAME)
        if self._embedding_hook is not None:
            self._embedding_hook.remove()
        self._embedding_hook = model.get_input_embeddings().register_forward_hook(self._begin_pass)

    def configure(self, settings: EngineSettings, warm: bool = False) -> None:
        """Build the caches and the staging pool for a plan.

        warm=False starts empty with fresh policies; warm=True keeps the policies'
        history and fills each cache with its top-C_i experts by priority (the
        rebuild after re-planning, docs/architecture.md § Statistics, configurator, re-planning).
        The old plan's buffers are freed before the new ones are allocated (every copy
        into them finished or stopped, no view of them left). If an allocation fails, the
        engine is never left half-built: it builds the first of `fallback_settings` that
        fits and says so in one line (FmoeError, the engine ready to run), or, when not
        even the staging pool fits, raises one line and holds no plan.
        """
        previous = self.settings
        policies = [state.cache.policy for state in self.layers] if warm and self.layers else None
        steps = [state.cache.step for state in self.layers] if policies else None
        self._release_buffers()
        try:
            self._build(settings, policies, steps)
        except torch.OutOfMemoryError as exc:
            self._release_buffers()
            wanted = f"out of device memory for the plan ({settings.plan.total_bytes / MiB:.0f} MiB)"
            for what, fallback in fallback_settings(settings, previous, self.shape.min_staging_slots):
                try:
                    self._build(fallback, policies, steps)
                except torch.OutOfMemoryError:
                    self._release_buffers()
                    continue
                self.predictor.replan()
                raise FmoeError(f"{wanted}: {what} ({fallback.plan.total_bytes / MiB:.0f} MiB) instead; "
                                f"use a smaller --vram-budget") from exc
            self.settings = None
            raise FmoeError(f"{wanted}: not even the staging pool alone "
                            f"({settings.plan.staging_bytes / MiB:.0f} MiB) fits beside what else is on the device; "
                            f"free device memory or use a smaller model") from exc
        self.predictor.replan()  # `auto` re-chooses its predictor per layer with every plan

    def _release_buffers(self) -> None:
        """Drop the cached tops and the staging pool: every copy into them stopped (released) or finished,
        so the link holds no view of them, and they are freed before anything new is allocated."""
        self.settle()
        self._collect_stalls()
        self.host_lane.clear(self.link)  # the cache fills in flight stop (they write into the tops)
        if self.pool is not None:
            self.pool.clear()  # releasing stops the copies still running (offload/pool.py)
        self.pool, self.prefetcher, self.layers = None, None, []
        self.link.synchronize()  # what is still on the link finishes; the link drops its transfers
        self._predicted = [None] * self.shape.num_layers
        for graph in self.decode_graphs.values():  # their graphs read the buffers being freed; their KV caches
            graph.release()  # (a conversation's) stay
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _build(self, settings: EngineSettings, policies: list | None, steps: list[int] | None) -> None:
        plan, shape, store = settings.plan, self.shape, self.store
        if len(plan.layers) != shape.num_layers:
            raise FmoeError(f"the plan has {len(plan.layers)} layers, the model {shape.num_layers}")
        layers = []
        for i, lp in enumerate(plan.layers):
            if policies is not None:
                policy = policies[i]
            else:
                policy = make_policy(settings.eviction, shape.num_experts, omega=settings.omega, rho=settings.rho,
                                     seed=i)
            cache = LayerCache(lp.cache_size, policy)
            resident = plan.resident_layer(i, shape)  # (a full layer of a loading plan too: nothing to load there)
            if resident:
                tops = store.layers[i].to(self.device, store.dtype)  # no copy on the CPU
                for e in range(shape.num_experts):
                    cache.insert(e)
                state = LayerState.of(cache, tops, lp.top_neurons, store)
            else:
                tops = torch.empty(lp.cache_size, lp.top_neurons, *store.row_shape,
                                   device="meta" if self.aliased else self.device, dtype=store.dtype)
                state = LayerState.of(cache, tops, lp.top_neurons, store)
                if steps is not None:
                    cache.step = steps[i]
                    ranked = [e for e in policy.ranking(cache.step) if policy.count[e] > 0]  # ever activated
                    for e in rebuild_order(ranked, lp):
                        state.put_top(cache.insert(e), store.expert(i, e)[: lp.top_neurons], store)
            state.host = lp.host and not resident
            state.resident = resident
            layers.append(state)
        pool = StagingPool(plan.staging_slots, shape.intermediate, store.row_shape, store.dtype, self.device)
        self.layers, self.pool = layers, pool
        self.prefetcher = Prefetcher(pool, self.link, store, layers, shape)
        self.settings = settings
        self._predicted = [None] * shape.num_layers

    def device_bytes(self) -> int:
        """Bytes the engine holds on the device: cached tops and the staging pool."""
        tops = sum(s.tops.numel() * s.tops.element_size() for s in self.layers)
        if self.settings is not None and self.settings.plan.resident and self.device.type == "cpu":
            tops = self.store.nbytes  # resident on the CPU shares the host store; count it once
        return tops + (self.pool.nbytes if self.pool else 0)

    def counters(self) -> Counters:
        self.settle()
        self._collect_stalls()
        return Counters.total([state.counters for state in self.layers])

    def close(self) -> None:
        self.settle()
        if self._embedding_hook is not None:
            self._embedding_hook.remove()
            self._embedding_hook = None
        self.predictor.close()
        self.host_lane.clear(self.link)
        self.host_lane.close()
        if self.pool is not None:
            self.pool.clear()
        self.link.close()
        self._collect_stalls()

    # --- the experts forward -------------------------------------------------
    def experts_forward(self, experts, hidden_states, top_k_index, top_k_weights):
        """hidden_states [T, H], top_k_index / top_k_weights [T, K] -> [T, H]."""
        i = experts._fmoe_layer
        if not self.layers:
            raise FmoeError("no expert plan fits on the device (see the message above); nothing can run")
        state = self.layers[i]
        if self.capturing is not None:  # a decode step being captured: the layer stays in its graph or cuts it
            return self._captured(i, state, experts, hidden_states, top_k_index, top_k_weights)
        decode = hidden_states.shape[0] == 1
        if state.resident and decode and not self._prefetching:
            if self.device_side and self._routed_on_device(state):
                out = self._resident_device_decode(i, state, experts.act_fn, hidden_states, top_k_index,
                                                   top_k_weights)
                if out is not None:
                    return out
            return self._resident_decode(i, state, experts.act_fn, hidden_states, top_k_index, top_k_weights)
        self.settle()
        self._collect_stalls()
        extra = self._device_part(i, hidden_states)
        routing = Routing.of(top_k_index, top_k_weights, extra,  # the one device→host copy of the layer
                             pack=True if self.device_side else None)
        state.counters.host_waits += self.device_side or not top_k_index.is_cpu
        cache = state.cache
        pinned = ()
        try:
            hits = self._classify(i, routing.active)
            if hits.misses:  # only an admission reads pins, and only a whole loaded expert is admitted
                pinned = routing.active
                for e in pinned:
                    cache.pin(e)
            if state.host and decode:  # decode on a host-lane layer (prefill: the device)
                self._bookkeep(i, state, routing)
                outputs = self.host_lane.forward(self, i, experts.act_fn, hidden_states, routing, hits)
                self._prefetch(i, hidden_states, routing)
            elif decode and len(hits.whole) == len(routing.flat):  # every routed expert whole on the device
                stacked = self._whole_decode(state, experts.act_fn, hidden_states, routing)
                self._bookkeep(i, state, routing)  # while the device computes (as `_compute` orders them)
                self._prefetch(i, hidden_states, routing)  # what _compute does once nothing is left to load
                return self._combine_decode(hidden_states, stacked, top_k_weights)
            else:
                if state.host:  # a prefill admits into the cache: the layer's fill lands first
                    self.host_lane.settle(self, i, wait=True)
                start = host_now() if hits.loads else None
                loading, waiting = self._submit(i, hits)
                outputs = self._compute(i, experts.act_fn, hidden_states, routing, hits, loading, waiting, start)
            return self._combine(hidden_states, routing, outputs, top_k_weights)
        finally:
            for e in pinned:
                cache.unpin(e)
            cache.advance()

    def _bookkeep(self, i: int, state: LayerState, routing: Routing) -> None:
        """A layer's routing shown to the observers (statistics, traces: the policy's state before this forward) and
        recorded by its cache policy (LCP's priorities), token by token (ν counts prompt tokens too). On the device
        path it runs once the layer's work on what is already on the device has been issued (`_compute`), so it
        overlaps the GPU instead of delaying it; always before an admission (which reads the priorities)."""
        self._observe(i, state, routing.ids, routing.weights, routing.flat)
        state.cache.record(routing.tokens())  # from the host list: no op

    def _routed_on_device(self, state: LayerState) -> bool:
        """Whether a resident layer's experts are one Stack torch's grouped matmul reads (layout.routed_forward), and
        this device's grouped matmul has not refused it."""
        rows = state.top_rows[0] if state.top_rows else None
        return self._grouped_on_device and isinstance(rows, layout.Rows) and rows.stack is not None

    def _resident_device_decode(self, i: int, state: LayerState, act, hidden_states: torch.Tensor,
                                top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor | None:
        """A decode step of a resident layer on the device's path, with no host wait (issue 37 §1): the routing
        stays on the device, its experts' slots looked up there (`slot_table`), the K experts computed by one
        grouped matmul per projection (layout.routed_forward) in routing order and weighted as `_combine_decode`
        does. Its bookkeeping (observers, the policy's touches, counters) follows once the token is done: the
        routing goes to the host without a wait (`_defer`) and is taken up by `settle`. Nothing here depends on a
        value on the host, so the step can be captured in a CUDA graph (generate.DecodeGraph). None: this device's
        grouped matmul refused the call (said once); the general path computes the layer."""
        if state.slot_table is None:
            slot = state.cache.slot
            state.slot_table = torch.tensor([slot(e) for e in range(self.shape.num_experts)], dtype=torch.long,
                                            device=hidden_states.device)
        slots = state.slot_table[top_k_index[0]]  # [K]: the token's experts' slots, in routing order
        try:
            stacked = layout.routed_forward(hidden_states, state.top_rows[0].stack, slots, act)  # [K, H]
        except (RuntimeError, NotImplementedError, ValueError, TypeError) as exc:  # torch's checks refuse a card,
            if hidden_states.is_cpu:  # dtype or stride (TORCH_CHECK*), found on the first call: the general path
                raise
            warn(f"torch's grouped matmul does not run here ({str(exc).splitlines()[0][:120]}); resident layers read "
                 f"their routing on the host")
            self._grouped_on_device = False
            return None
        self._defer(i, top_k_index, top_k_weights)
        return self._combine_decode(hidden_states, stacked, top_k_weights)

    def _defer(self, i: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        """Layer i's routing on its way to the host (link.HostCopy: no wait); its bookkeeping runs at `settle`."""
        if i in self._deferred:  # a second forward of layer i before the first was settled
            self.settle()
        copies = self._route_copies.get(i)
        if copies is None or copies[0].host.shape != top_k_index.shape or copies[1].host.dtype != top_k_weights.dtype:
            copies = self._route_copies[i] = (HostCopy(top_k_index), HostCopy(top_k_weights))
        copies[0].copy(top_k_index)
        copies[1].copy(top_k_weights)
        self._deferred.append(i)

    def decode_graphable(self) -> bool:
        """Whether a decode step of this plan runs without a host wait in any layer, so that one CUDA graph can
        replay it (generate.DecodeGraph): every layer `graphed_layer`, no veto."""
        return bool(self.layers) and self.graph_veto is None and all(map(self.graphed_layer, range(len(self.layers))))

    # --- decode steps captured in graph segments (generate.DecodeGraph) ---------
    def graphed_layer(self, i: int) -> bool:
        """Whether layer i's decode step runs inside a captured graph: it takes `_resident_device_decode` (resident,
        routed on the device, no prefetcher: nothing read back on the host)."""
        state = self.layers[i]
        return self.device_side and not self._prefetching and state.resident and self._routed_on_device(state)

    def _captured(self, i: int, state: LayerState, experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
        """Layer i's experts forward while a DecodeGraph captures a decode step (`capturing`), or warms up for it: a
        graphed layer is computed inside the graph (`_resident_device_decode`, its routing deferred) and noted; any
        other needs the host (or this device's grouped matmul refused the call), so the step's segment ends at its
        router: the static output buffer the next segment reads, which each replay fills by calling `experts_forward`
        eagerly on the static inputs (generate.StepCapture.graph_break). Nothing here runs the general path: the
        counters, caches and policies see only the replayed steps."""
        if hidden_states.shape[0] == 1 and self.graphed_layer(i):
            out = self._resident_device_decode(i, state, experts.act_fn, hidden_states, top_k_index, top_k_weights)
            if out is not None:
                self.capturing.graphed_layer(i)
                return out
        return self.capturing.graph_break(i, experts, hidden_states, top_k_index, top_k_weights)

    def replayed_pass(self, output: torch.Tensor) -> None:
        """The embedding hook's work for a replayed decode step (its segment 0 wrote the embedding's `output`)."""
        self._begin_pass(None, (), output)

    def discard_deferred(self) -> None:
        """Forget the routing copies pending bookkeeping: a CUDA graph's warm-up and capture ran them, no token did."""
        self._deferred = []

    def defer_replayed(self, layers: list[int]) -> None:
        """A replayed CUDA graph copied these layers' routing into their host copies: their bookkeeping is due."""
        for i in layers:
            if i in self._deferred:
                self.settle()
            self._route_copies[i][0].record()
            self._route_copies[i][1].record()
            self._deferred.append(i)

    def settle(self) -> None:
        """The deferred layers' bookkeeping, in the order they ran: what `_resident_decode` does on the host
        (`resident_routed`), from the routing's host copies (a wait only if a copy has not finished yet)."""
        if not self._deferred:
            return
        pending, self._deferred = self._deferred, []
        for i in pending:
            (ids, waited), (weights, waited_too) = (copy.result() for copy in self._route_copies[i])
            self.layers[i].counters.host_waits += waited or waited_too
            self.resident_routed(i, ids.clone(), weights.clone())  # observers may keep them; the buffers are reused

    def _resident_decode(self, i: int, state: LayerState, act, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
        """`experts_forward` of a decode step on a resident layer without a prefetcher: the same steps on what such a
        step has — the routing's host list (the layer's one host wait where the routing is on a device), the K
        experts computed in routing order (`_stacked`: one kernel call on the CPU, one `segments_forward` on torch's
        path), then the observers, the policy's touches and the counters of K whole experts (nothing is staged,
        loaded, pinned or admitted, no stall to collect), and the weighted sum (`_combine_decode`)."""
        routed = top_k_index.tolist()[0]  # the token's K experts, in routing order (one host list, as Routing.of)
        state.counters.host_waits += self.device_side or not top_k_index.is_cpu
        try:
            rows = self.resident_rows(i)
            stacked = self._stacked(hidden_states, [rows[e] for e in routed], act)
            self._observe(i, state, top_k_index, top_k_weights, routed)  # while the device computes
            self._record_resident(state, routed)
            return self._combine_decode(hidden_states, stacked, top_k_weights)
        finally:
            state.cache.advance()

    def resident_routed(self, i: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        """`_resident_decode`'s bookkeeping for a decode token whose layer i was computed elsewhere with this
        routing (models/token.py: the whole token in one C call): the observers, the policy's touches, the
        counters, the clock — the same calls with the same data."""
        state = self.layers[i]
        routed = top_k_index.tolist()[0]
        self._observe(i, state, top_k_index, top_k_weights, routed)
        try:
            self._record_resident(state, routed)
        finally:
            state.cache.advance()

    def _observe(self, i: int, state: LayerState, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 routed: list[int]) -> None:
        """Layer i's routing shown to the observers, before its cache policy sees it; the layer's prediction spent."""
        if self.observers:
            event = RouteEvent(i, top_k_index, top_k_weights, routed, state.cache, self._predicted[i])
            for observe in self.observers:
                observe(event)
        self._predicted[i] = None  # a prediction is for one routing

    @staticmethod
    def _record_resident(state: LayerState, routed: list[int]) -> None:
        state.cache.record((routed,))
        activated = len(set(routed))
        counters = state.counters
        counters.activations += activated
        counters.hits_full += activated  # every activated expert is whole (_classify's resident Hits)

    def resident_rows(self, i: int) -> list:
        """A resident layer's rows of each expert by id (its slot never changes), made once."""
        state = self.layers[i]
        if state.expert_rows is None:
            slot = state.cache.slot
            state.expert_rows = [state.top_rows[slot(e)] for e in range(self.shape.num_experts)]
        return state.expert_rows

    def resident_decode(self, hidden_states: torch.Tensor, act) -> bool:
        """Whether a decode token x [1, H] of every layer takes `_resident_decode` with the CPU's kernels (one kernel
        call for its experts: what models/token.py's one-call token computes)."""
        return (bool(self.layers) and all(state.resident for state in self.layers) and not self._prefetching
                and self._stacks(hidden_states, act))

    def _stacks(self, hidden_states: torch.Tensor, act) -> bool:
        """`store.stacks` for a decode token of this dtype and activation on the CPU, asked once."""
        if not hidden_states.is_cpu:
            return False
        key = (hidden_states.dtype, act)
        stacks = self._stacks_for.get(key)
        if stacks is None:
            stacks = self._stacks_for[key] = self.store.stacks(hidden_states, act)
        return stacks

    def _classify(self, i: int, active: list[int]) -> Hits:
        """1. classify the activated experts (offload/hits.py); count; drop useless staged entries."""
        state = self.layers[i]
        if state.resident:  # every expert whole on the device: what classify gives, without the pool (nothing staged)
            hits = Hits(tuple(active), (), (), (), (), ())
        else:
            hits = self.pool.classify(i, active, state.cache, state.top_neurons, self.shape.intermediate)  # (no copy)
        state.counters.count(len(active), hits)
        return hits

    def _submit(self, i: int, hits: Hits) -> tuple[list[Staged], list[tuple[int, int]]]:
        """2. take the covering prefetches as demand loads; queue the rest ahead of any prefetch."""
        loading = self.pool.take_over(i, hits.covered, self.link)
        waiting = list(hits.loads)
        self._submit_demand(i, waiting, loading)
        return loading, waiting

    def _submit_demand(self, i: int, waiting: list[tuple[int, int]], loading: list[Staged]) -> None:
        self.layers[i].counters.bytes_demand += self.pool.submit_demand(i, waiting, loading, self.link, self.store)
        assert loading or not waiting, "every slot is in use by this layer's loads"

    def _compute(self, i: int, act, hidden_states: torch.Tensor, routing: Routing, hits: Hits,
                 loading: list[Staged], waiting: list[tuple[int, int]], submit_start: float | None = None) -> dict:
        """3. compute what is on the device, then each load as it arrives (speculating once every
        demand load is queued); returns expert -> output rows [T_e, H]. `submit_start`: the host time before
        the layer's demand loads were submitted (None: none were)."""
        state, pool, store = self.layers[i], self.pool, self.store
        submitted = host_now() if loading else 0.0
        if submit_start is not None and loading:  # h_sub: the first load is on the link while the others are submitted
            state.counters.submit_s += submitted - submit_start
            state.counters.submitted += len(hits.loads) - len(waiting)
        k = state.top_neurons
        decode = hidden_states.shape[0] == 1  # a decode step: every expert's one token is that row (no gather)
        if not decode:
            _perm, tokens, spans = routing.layout(hidden_states.device)
            xs = hidden_states[tokens]  # [T·K, H]: every expert's tokens, in one gather

        def x_of(e: int) -> torch.Tensor:
            return hidden_states if decode else xs[spans[e]]
        if loading:  # the host's lead on the first load (the configurator's h_route)
            state.counters.lead_s += host_now() - submitted
            state.counters.leads += 1
        # a decode step's loads on the device path: computed together once all are acquired (`_loaded_decode`)
        together = decode and bool(loading) and not waiting and self._loads_grouped(hidden_states)
        # what the cache holds, one call each for the whole experts and for the tops (store.segments_forward)
        slot, rows = state.cache.slot, state.top_rows
        outputs: dict[int, torch.Tensor] = dict(zip(hits.whole, store.segments_forward(
            [x_of(e) for e in hits.whole], [rows[slot(e)] for e in hits.whole], act))) if hits.whole else {}
        top_outputs = dict(zip(hits.top_hits, store.segments_forward(  # partial: the bottom continues them
            [x_of(e) for e in hits.top_hits], [rows[slot(e)] for e in hits.top_hits], act,
            partial=True, together=together))) if hits.top_hits else {}
        self._bookkeep(i, state, routing)  # while the GPU computes what is on it; before any admission (`_offer`)
        if together:
            self._loaded_decode(i, act, hidden_states, routing, loading, outputs, top_outputs)
            return outputs
        prefetched = False
        while loading or waiting:
            if not waiting and not prefetched:
                self._prefetch(i, hidden_states, routing)  # 4. speculate once every demand load is queued
                prefetched = True
            # Each load is polled once per pass: those seen done are computed first, then the rest in order
            # (on a GPU, acquire only makes the compute stream wait; a prefill wave's next loads: next pass).
            batch, loading[:] = loading[:], []
            done = [entry for entry in batch if entry.transfer.ready()]
            for entry in done + [entry for entry in batch if entry not in done]:
                segment = self.link.acquire(entry.transfer, tag=i)  # [I - start, *row]: the only place that waits
                e = entry.expert
                if e in top_outputs:  # exact: the bottom continues the top's sum (the whole's bits on the CPU)
                    bottom = pool.rows(store, segment) if k == entry.start else segment[k - entry.start:]
                    outputs[e] = store.segment_forward(x_of(e), bottom, act, acc=top_outputs.pop(e))
                else:
                    outputs[e] = store.segment_forward(x_of(e), pool.rows(store, segment), act)
                    self._offer(i, e, segment)
                pool.release(entry, self.link.record_reads())  # the next copy into the slot waits for these reads
                if waiting:  # a prefill wave: the freed slot takes the next load
                    self._submit_demand(i, waiting, loading)
        if not prefetched:
            self._prefetch(i, hidden_states, routing)
        return outputs

    def _loads_grouped(self, x: torch.Tensor) -> bool:
        """Whether a decode step's loads are computed together (`_loaded_decode`): the device path, a link that copies
        into the pool's slots (not the CPU's aliased store rows), the store grouping on x's device, and torch's path
        (the slots' rows know the pool's Stack: not the CPU's kernels, not a quantised store)."""
        return (self.device_side and not self.aliased and self.store.groups(x)
                and isinstance(self.pool.stacked_rows(self.store)[0], layout.Rows))

    def _loaded_decode(self, i: int, act, x: torch.Tensor, routing: Routing, loading: list[Staged], outputs: dict,
                       top_outputs: dict) -> None:
        """3. a decode step's loads on the device path, every one queued (`_compute`'s loop otherwise): all of them
        acquired first, then the loaded whole experts computed by one `segments_forward` call over the pool's slots
        (`StagingPool.stacked_rows`: on a GPU, from GROUP_FROM of them, torch's grouped matmul once per projection,
        layout.grouped_forward, instead of one segment forward of 5 ops per load as it arrives) and the split
        experts' bottoms by one more, each continuing its top (rows [k_i, I) of the slots, a Stack of their own:
        layout.grouped_bottoms after the tops' layout.grouped_tops, where they group). On a GPU `acquire` only
        makes the compute stream wait for the copy, never the host, so acquiring every load before the one call costs
        the host nothing; the price is that the GPU no longer computes one expert while the next one loads:
        microseconds of compute against a load's hundreds. The rest is the loop's, in its order where it matters:
        the prediction queued once every demand load is, each loaded whole expert offered to the cache (`_offer`)
        after its compute, and every slot released with a fence recorded after all the compute that read it (the
        next copy into a slot waits for these reads)."""
        pool, store, k = self.pool, self.store, self.layers[i].top_neurons
        self._prefetch(i, x, routing)  # 4. speculate: every demand load is queued
        acquired = [(entry, self.link.acquire(entry.transfer, tag=i)) for entry in loading]  # the host waits only here
        loading.clear()
        wholes = [(entry, segment) for entry, segment in acquired if entry.expert not in top_outputs]
        if wholes:
            slots = pool.stacked_rows(store)  # slot s: what a whole expert loaded into s reads (the link's dst)
            outputs.update(zip([entry.expert for entry, _ in wholes], store.segments_forward(
                [x] * len(wholes), [slots[entry.slot] for entry, _ in wholes], act)))
        if top_outputs:  # exact: each bottom continues its top (rows [k, I) of its slot, wherever the load began)
            bottoms, split = pool.stacked_rows(store, k), [entry for entry, _ in acquired if entry.expert in top_outputs]
            outputs.update(zip([entry.expert for entry in split], store.segments_forward(
                [x] * len(split), [bottoms[entry.slot] for entry in split], act,
                accs=[top_outputs.pop(entry.expert) for entry in split])))
        for entry, segment in wholes:
            self._offer(i, entry.expert, segment)
        reads = self.link.record_reads()  # after the loads' compute and the admissions' copies out of the slots
        for entry, _segment in acquired:
            pool.release(entry, reads)

    def _whole_decode(self, state: LayerState, act, hidden_states: torch.Tensor, routing: Routing):
        """A decode step whose activated experts are all whole on the device: their outputs in routing order, stacked
        [K, H] — by one kernel call where the store `stacks` (the CPU's kernels: store.stacked_forward), else by
        `segments_forward` (torch's path, a GPU's: one call for the K experts, stacked) — each expert's bits as
        alone, so as `_compute` and `_combine` give them, without the loads' machinery (nothing to submit, acquire,
        admit or time)."""
        slot, rows = state.cache.slot, state.top_rows
        return self._stacked(hidden_states, [rows[slot(e)] for e in routing.flat], act)

    def _stacked(self, hidden_states: torch.Tensor, segments: list, act) -> torch.Tensor:
        """Whole segments' outputs for one token x [1, H], in the given order, stacked [K, H]: one kernel call where
        the store `stacks` (store.stacked_forward), else one `segments_forward` call (stacked: on torch's path into
        one buffer, without a cat)."""
        if self._stacks(hidden_states, act):
            return self.store.stacked_forward(hidden_states, segments, act)
        return self.store.segments_forward([hidden_states] * len(segments), segments, act, stacked=True)

    def _combine_decode(self, hidden_states: torch.Tensor, stacked: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
        """`_combine` of one token from its experts' outputs already in routing order, stacked [K, H]: the same
        ops on the same rows (the product with the weights, the sum over K), without gathering them first."""
        if stacked.dtype == torch.float32 == top_k_weights.dtype and self._combine_in_c and stacked.is_cpu:
            return kernels.combine_decode(stacked, top_k_weights.contiguous())  # float32: in C (decode.c)
        final = (stacked * top_k_weights.t()).sum(0, keepdim=True)
        return final if final.dtype == hidden_states.dtype else final.to(hidden_states.dtype)

    def _combine(self, hidden_states: torch.Tensor, routing: Routing, outputs: dict,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        """4. the weighted sum as transformers' default experts forward (`grouped_mm`) makes it: each routed
        (token t, slot k) row's output y_tk times its weight w_tk, summed over the token's K slots in routing
        order, out_t = Σ_k w_tk · y_tk ([T, K, H].sum(1)). One fixed order and no atomics, so the same bits on
        every run and every policy; a handful of ops whatever K (docs/architecture.md § Host work per token)."""
        tokens, k = routing.ids.shape
        if tokens == 1:  # a decode step: the experts' one rows in routing order, [K, H] · [K, 1] summed over K
            return self._combine_decode(hidden_states, torch.cat([outputs[e] for e in routing.flat]), top_k_weights)
        elif self._combine_in_c and self._sums_in_c(outputs, top_k_weights):  # float32 on the CPU: in C, no gather
            _perm, _tokens, spans = routing.layout(hidden_states.device)
            final = kernels.combine_prefill(outputs, routing.ids, routing.routing_order(hidden_states.device),
                                            {e: span.start for e, span in spans.items()}, top_k_weights)
        else:  # every expert's rows (tokens ascending), in expert order, put back in routing order: [T, K, H]
            rows = torch.cat([outputs.pop(e) for e in routing.active])[routing.routing_order(hidden_states.device)]
            final = (rows.view(tokens, k, -1) * top_k_weights.unsqueeze(-1)).sum(1)
        return final if final.dtype == hidden_states.dtype else final.to(hidden_states.dtype)

    @staticmethod
    def _sums_in_c(outputs: dict, top_k_weights: torch.Tensor) -> bool:
        """Whether a prefill's weighted sum runs in C (kernels.combine_prefill): float32 outputs and weights, every
        output contiguous rows on the CPU."""
        return top_k_weights.dtype == torch.float32 and top_k_weights.is_cpu and all(
            y.dtype == torch.float32 and y.is_cpu and y.is_contiguous() for y in outputs.values())

    def _offer(self, i: int, e: int, segment: torch.Tensor) -> None:
        """Offer a whole loaded expert's top segment to layer i's cache (LCP decides).
        The copy runs on the compute stream, after every earlier read of the slot it replaces (on a CPU, on the
        calling thread: offload/link.py `device_copy`)."""
        state = self.layers[i]
        if state.top_neurons == 0:
            return
        admission = state.cache.admit(e)
        if admission is None:
            return
        k = state.top_neurons
        if not state.aliased:
            state.put_top(admission.slot, segment if k == segment.shape[0] else segment[:k], self.store)  # (no op)
            return
        rows = self.store.expert(i, e)  # aliased: the store's rows (segment may be a staging slot, which is reused)
        if k == rows.shape[0]:  # a whole expert: the store's own view, its rows as its loads' (made once: no op)
            state.put_top(admission.slot, rows, self.store, made=self.pool.rows(self.store, rows))
        else:
            state.put_top(admission.slot, rows[:k], self.store)

    @property
    def _prefetching(self) -> bool:
        return self.settings is not None and self.settings.prefetch

    def _device_part(self, i: int, hidden_states: torch.Tensor) -> dict:
        """The predictor's scores from layer i's input, computed on the device (to the host with the routing)."""
        if not self._prefetching:
            return {}
        start = host_now()
        part = self.predictor.device_part(self.iteration, i, hidden_states)
        self.layers[i].counters.predict_s += host_now() - start
        return part

    def _prefetch(self, i: int, hidden_states: torch.Tensor, routing: Routing) -> None:
        """Show the predictor layer i's routing (host); queue what it predicts (fmoe_cli/offload/prefetch.py).
        Its host time, with the device part's, is the layer's `predict_s` (the configurator's h_pf)."""
        if not self._prefetching:
            return
        start = host_now()
        self.iteration.observe(i, hidden_states, routing.ids, host=routing.extra)
        self._note_rankings(self.prefetcher.issue(self.predictor.after_layer(self.iteration, i)))
        counters = self.layers[i].counters
        counters.predict_s += host_now() - start
        counters.predicts += 1

    def _note_rankings(self, rankings: dict[int, list[int]]) -> None:
        for target, ranking in rankings.items():
            self._predicted[target] = ranking

    def _collect_stalls(self) -> None:
        """Exposed load time, where the compute really waited (link.stalls: emulated or CUDA events)."""
        for layer, seconds in self.link.stalls():
            if isinstance(layer, int) and layer < len(self.layers):
                self.layers[layer].counters.exposed_s += seconds

    def _begin_pass(self, module, args, output) -> None:
        """Forward hook on the embedding layer: a new pass; its output is the predictors' semantic hint. In a decode
        step being captured it only gives the output: the replay runs the hook (`replayed_pass`)."""
        if self.capturing is not None:
            self.capturing.pass_began(output)
            return
        self.settle()  # the previous pass's deferred bookkeeping, before this pass overwrites its copies
        if not self._prefetching:
            return
        self.iteration.begin(output.detach())
        self._note_rankings(self.prefetcher.issue(self.predictor.begin(self.iteration)))


def open_engine(lm, emulate_gbps: float | None = None, predictor: str = "speculative", link=None,
                host_threads: int = 1) -> Engine:
    """The engine every command runs on a loaded model (models.load.LoadedModel): its experts
    behind `link` (default: make_link, emulated if asked), the named predictor, installed in the model."""
    shape = lm.shape
    link = link if link is not None else make_link(lm.device, emulate_gbps)
    engine = Engine(lm.layers, lm.store, shape, link, lm.device, lm.dtype,
                    predictor=make_predictor(predictor, lm.layers, shape.num_experts, shape.top_k),
                    host_threads=host_threads)
    engine.install(lm.model)
    return engine
