"""The offloading engine: transformers' experts forward, served from a split-expert cache.

One decode step through MoE layer i (DESIGN §5):
1. the router (run by the model) gives the activated set A_i;
2. the engine records statistics, drops this layer's prefetches that are not in A_i,
   and queues the missing segments of A_i as demand loads, ahead of any prefetch;
3. it computes what is on the device first (whole experts, cached top segments),
   then each missing segment as its transfer completes; partial results are summed
   in a fixed order (top + bottom, then experts by id), so results are deterministic;
4. it shows the predictor this routing and queues what it predicts (the default,
   speculative: layer i+1; the last layer predicts layer 0 of the next token) in
   descending priority: only the bottom when the top is cached, the whole expert
   otherwise (offload/prefetch.py);
5. a loaded expert's top segment is offered to the cache (LCP by default).

Prefill takes the same path with every activated expert; when the staging pool is
smaller than the activated set it works in waves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from fmoe_cli.models.families import MoeLayer
from fmoe_cli.offload.cache import LayerCache
from fmoe_cli.offload.layout import segment_forward
from fmoe_cli.offload.link import DEMAND, Transfer
from fmoe_cli.offload.policies import make_policy
from fmoe_cli.offload.prefetch import Prefetcher
from fmoe_cli.offload.store import HostStore
from fmoe_cli.types import EngineSettings, ExpertShape, Plan
from fmoe_cli.prediction import Iteration, Predictor, SpeculativePredictor

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

    def __add__(self, other: Counters) -> Counters:
        return Counters(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __sub__(self, other: Counters) -> Counters:
        return Counters(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

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


@dataclass(eq=False)
class Staged:
    """A segment [start, I) of one expert in a staging slot (start = 0: the whole expert)."""

    layer: int
    expert: int
    start: int
    slot: int
    transfer: Transfer
    prefetched: bool
    in_use: bool = False


class StagingPool:
    """Full-expert slots on the device for bottoms and missed experts (U_b)."""

    def __init__(self, slots: int, shape: ExpertShape, device: torch.device, dtype: torch.dtype) -> None:
        self.buffer = torch.empty(slots, shape.intermediate, 3, shape.hidden, device=device, dtype=dtype)
        self.entries: list[Staged | None] = [None] * slots
        self._draining: list[Staged] = []  # released while a copy was still writing the slot

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def find(self, layer: int, expert: int) -> Staged | None:
        for entry in self.entries:
            if entry is not None and entry.layer == layer and entry.expert == expert:
                return entry
        return None

    def of_layer(self, layer: int) -> list[Staged]:
        return [e for e in self.entries if e is not None and e.layer == layer]

    def free_slot(self) -> int | None:
        for slot, entry in enumerate(self.entries):
            if entry is None and not any(d.slot == slot for d in self._draining):
                return slot
        for entry in list(self._draining):  # a slot whose copy has finished is free again
            if entry.transfer.state in ("done", "cancelled"):
                self._draining.remove(entry)
                if self.entries[entry.slot] is None:
                    return entry.slot
        return None

    def reclaim(self, keep_layer: int) -> int | None:
        """A slot for a demand load: a free one, else one holding another layer's unused prefetch."""
        slot = self.free_slot()
        if slot is not None:
            return slot
        victims = [e for e in self.entries if e is not None and e.layer != keep_layer and not e.in_use]
        # Prefer prefetches not started (cancel is free), then finished ones, then running ones.
        victims.sort(key=lambda e: {"queued": 0, "done": 1}.get(e.transfer.state, 2))
        for entry in victims:
            self.release(entry)
            slot = self.free_slot()
            if slot is not None:
                return slot
        for entry in list(self._draining):
            entry.transfer.wait()
        return self.free_slot()

    def put(self, entry: Staged) -> None:
        self.entries[entry.slot] = entry

    def release(self, entry: Staged) -> None:
        self.entries[entry.slot] = None
        if not entry.transfer.cancel() and entry.transfer.state != "done":
            self._draining.append(entry)

    def clear(self) -> None:
        for entry in [e for e in self.entries if e is not None]:
            self.release(entry)
        for entry in self._draining:
            entry.transfer.wait()
        self._draining.clear()


@dataclass
class LayerState:
    cache: LayerCache
    tops: torch.Tensor  # [C_i, k_i, 3, H] on the device (for resident: all experts, whole)
    top_neurons: int  # k_i
    counters: Counters = field(default_factory=Counters)


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


class Engine:
    def __init__(
        self,
        layers: list[MoeLayer],
        store: HostStore,
        shape: ExpertShape,
        link,
        device: torch.device,
        dtype: torch.dtype,
        predictor: Predictor | None = None,
    ) -> None:
        self.moe_layers = layers
        self.store = store
        self.shape = shape
        self.link = link
        self.device = device
        self.dtype = dtype
        routers = [layer.router for layer in layers]
        self.predictor = predictor or SpeculativePredictor(routers)
        self.prefetcher = Prefetcher()
        self.iteration = Iteration(shape.num_layers, shape.num_experts, routers)  # what predictors see
        self._embedding_hook = None
        self.observers: list[RouteObserver] = []
        self.settings: EngineSettings | None = None
        self.layers: list[LayerState] = []
        self.pool: StagingPool | None = None
        self._predicted: list[list[int] | None] = [None] * shape.num_layers

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
        rebuild after re-planning, DESIGN §7).
        """
        plan = settings.plan
        old = self.layers if warm else []
        if self.pool is not None:
            self.pool.clear()
        shape = self.shape
        self.layers = []
        for i, lp in enumerate(plan.layers):
            if old:
                policy = old[i].cache.policy
            else:
                policy = make_policy(settings.eviction, shape.num_experts, omega=settings.omega, rho=settings.rho,
                                     seed=i)
            cache = LayerCache(lp.cache_size, policy)
            if plan.resident:
                tops = self.store.layers[i].to(self.device, self.dtype)  # no copy on the CPU
                for e in range(shape.num_experts):
                    cache.insert(e)
            else:
                tops = torch.empty(lp.cache_size, lp.top_neurons, 3, shape.hidden, device=self.device, dtype=self.dtype)
                if warm:
                    cache.step = old[i].cache.step
                    ranked = [e for e in policy.ranking(cache.step) if policy.count[e] > 0]
                    for e in ranked[: lp.cache_size]:
                        tops[cache.insert(e)].copy_(self.store.expert(i, e)[: lp.top_neurons])
            self.layers.append(LayerState(cache, tops, lp.top_neurons))
        self.pool = StagingPool(plan.staging_slots, shape, self.device, self.dtype)
        self.settings = settings
        self._predicted = [None] * shape.num_layers
        self.predictor.replan()  # `auto` re-chooses its predictor per layer with every plan

    def device_bytes(self) -> int:
        """Bytes the engine holds on the device: cached tops and the staging pool."""
        tops = sum(s.tops.numel() * s.tops.element_size() for s in self.layers)
        if self.settings is not None and self.settings.plan.resident and self.device.type == "cpu":
            tops = self.store.nbytes  # resident on the CPU shares the host store; count it once
        return tops + (self.pool.nbytes if self.pool else 0)

    def counters(self) -> Counters:
        total = Counters()
        for state in self.layers:
            total = total + state.counters
        return total

    def close(self) -> None:
        if self._embedding_hook is not None:
            self._embedding_hook.remove()
            self._embedding_hook = None
        self.predictor.close()
        if self.pool is not None:
            self.pool.clear()
        self.link.close()

    # --- the experts forward -------------------------------------------------
    def experts_forward(self, experts, hidden_states, top_k_index, top_k_weights):
        i = experts._fmoe_layer
        state = self.layers[i]
        pool = self.pool
        full = self.shape.intermediate
        k = state.top_neurons
        c = state.counters

        routed = top_k_index.reshape(-1).tolist()
        active = sorted(set(routed))
        if self.observers:
            event = RouteEvent(i, top_k_index, top_k_weights, routed, state.cache, self._predicted[i])
            for observe in self.observers:
                observe(event)
        self._predicted[i] = None  # a prediction is for one routing
        state.cache.record(top_k_index.tolist())  # token by token: ν counts prompt tokens too
        for e in active:
            state.cache.pin(e)
        c.activations += len(active)

        # 2. drop this layer's prefetches that were wrong; find what must be loaded
        active_set = set(active)
        for entry in pool.of_layer(i):
            if entry.expert not in active_set:
                pool.release(entry)
        whole, tops, needs = [], [], []  # needs: (expert, first neuron to load)
        for e in active:
            slot = state.cache.slot(e)
            if slot is not None and k == full:
                whole.append(e)
                c.hits_full += 1
            elif slot is not None:
                tops.append(e)
                needs.append((e, k))
                c.hits_top += 1
            else:
                needs.append((e, 0))
                c.misses += 1
        c.needed_loads += len(needs)

        loading: list[Staged] = []
        waiting: list[tuple[int, int]] = []
        for e, start in needs:
            entry = pool.find(i, e)
            if entry is not None and entry.start <= start:
                entry.in_use = True
                c.prefetch_used += 1
                c.prefetch_covered += 1
                self.link.reprioritise(entry.transfer, DEMAND)
                loading.append(entry)
            else:
                if entry is not None:
                    pool.release(entry)
                waiting.append((e, start))
        self._submit_demand(i, waiting, loading)

        # 3. compute what is on the device, then each load as it arrives
        rows = {e: torch.nonzero(top_k_index == e, as_tuple=True) for e in active}
        act = experts.act_fn
        outputs: dict[int, torch.Tensor] = {}
        top_outputs: dict[int, torch.Tensor] = {}
        for e in whole:
            outputs[e] = segment_forward(hidden_states[rows[e][0]], state.tops[state.cache.slot(e)], act)
        for e in tops:
            top_outputs[e] = segment_forward(hidden_states[rows[e][0]], state.tops[state.cache.slot(e)], act)

        prefetched = False
        while loading or waiting:
            if not waiting and not prefetched:
                self._prefetch(i, hidden_states, top_k_index)  # 4. speculate once every demand load is queued
                prefetched = True
            entry = next((x for x in loading if x.transfer.ready()), loading[0])
            if not entry.transfer.ready():
                t0 = time.perf_counter()
                entry.transfer.wait()
                c.exposed_s += time.perf_counter() - t0
            loading.remove(entry)
            e = entry.expert
            segment = pool.buffer[entry.slot]
            x = hidden_states[rows[e][0]]
            if e in top_outputs:  # exact: top + bottom, always in this order
                outputs[e] = top_outputs.pop(e) + segment_forward(x, segment[k:], act)
            else:
                outputs[e] = segment_forward(x, segment, act)
                self._offer(i, e, segment)
            pool.release(entry)
            self._submit_demand(i, waiting, loading)
        if not prefetched:
            self._prefetch(i, hidden_states, top_k_index)

        final = torch.zeros_like(hidden_states)
        for e in active:  # fixed order: by expert id
            token_idx, k_pos = rows[e]
            weighted = outputs[e] * top_k_weights[token_idx, k_pos, None]
            final.index_add_(0, token_idx, weighted.to(final.dtype))
        for e in active:
            state.cache.unpin(e)
        state.cache.advance()
        return final

    def _submit_demand(self, i: int, waiting: list[tuple[int, int]], loading: list[Staged]) -> None:
        while waiting:
            slot = self.pool.reclaim(keep_layer=i)
            if slot is None:
                return  # the pool is busy with this layer: the next wave gets the slot
            e, start = waiting.pop(0)
            src = self.store.expert(i, e)[start:]
            transfer = self.link.submit(self.pool.buffer[slot][start:], src, DEMAND)
            entry = Staged(i, e, start, slot, transfer, prefetched=False, in_use=True)
            self.pool.put(entry)
            loading.append(entry)
            self.layers[i].counters.bytes_demand += transfer.nbytes

    def _offer(self, i: int, e: int, segment: torch.Tensor) -> None:
        """Offer a whole loaded expert's top segment to layer i's cache (LCP decides)."""
        state = self.layers[i]
        if state.top_neurons == 0:
            return
        admission = state.cache.admit(e)
        if admission is not None:
            state.tops[admission.slot].copy_(segment[: state.top_neurons])

    def _prefetch(self, i: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor) -> None:
        """Show the predictor layer i's routing; queue what it predicts (fmoe_cli/offload/prefetch.py)."""
        if self.settings is None or not self.settings.prefetch:
            return
        self.iteration.observe(i, hidden_states, top_k_index)
        self.prefetcher.issue(self, self.predictor.after_layer(self.iteration, i))

    def _begin_pass(self, module, args, output) -> None:
        """Forward hook on the embedding layer: a new pass; its output is the predictors' semantic hint."""
        if self.settings is None or not self.settings.prefetch:
            return
        self.iteration.begin(output.detach())
        self.prefetcher.issue(self, self.predictor.begin(self.iteration))


def open_engine(lm, emulate_gbps: float | None = None, predictor: str = "speculative", link=None) -> Engine:
    """The engine every command runs on a loaded model (models.load.LoadedModel): its experts
    behind `link` (default: make_link, emulated if asked), the named predictor, installed in the model."""
    from fmoe_cli.offload.link import make_link
    from fmoe_cli.prediction import make_predictor

    shape = lm.shape
    link = link if link is not None else make_link(lm.device, emulate_gbps)
    engine = Engine(lm.layers, lm.store, shape, link, lm.device, lm.dtype,
                    predictor=make_predictor(predictor, lm.layers, shape.num_experts, shape.top_k))
    engine.install(lm.model)
    return engine
