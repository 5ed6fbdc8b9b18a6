"""The host lane (docs/architecture.md § The host lane): a layer's misses and bottoms computed on the host.

In a decode step through a layer whose plan says `host` (LayerPlan.host), nothing is loaded
over the link on the critical path. Its activated experts split three ways:

- whole on the device: cached whole (k = I);
- split: the cached top [0, k) on the device, the bottom [k, I) on the host, at the same time;
- on the host: a miss, computed whole from the host store (RAM).

The cache still learns: after the host computed a miss, its top is offered to the cache
(the policy decides, LCP by default) and copied into the slot over the link at prefetch
priority, off the critical path, one such fill per layer at a time; until the copy has
landed, that expert is computed on the host (its slot is never read half-written).

This module is the lane's decisions, pure (`split_work`, `Fills`: no tensor data; the
simulator runs them on meta tensors), and `HostLane`, the engine's worker threads.
"""

from __future__ import annotations

from dataclasses import dataclass

from fmoe_cli.offload.hits import Hits
from fmoe_cli.offload.link import PREFETCH, Link, Transfer


@dataclass(frozen=True)
class HostWork:
    """One host-lane layer's decode step, split between device and host (expert ids, ascending)."""

    device_whole: tuple[int, ...]  # cached whole: computed on the device
    split: tuple[int, ...]  # top on the device, bottom [k, I) on the host
    host_whole: tuple[int, ...]  # computed whole on the host (misses; a top whose fill has not landed)


def split_work(hits: Hits, filling: int | None) -> HostWork:
    """The host lane's split of a classified layer (offload/hits.py); `filling`: the expert whose top is still
    being copied into its slot (it counts as cached, but the slot is not read before the copy lands)."""
    whole = tuple(e for e in hits.whole if e != filling)
    split = tuple(e for e in hits.top_hits if e != filling)
    host = tuple(sorted(hits.misses + tuple(e for e in hits.whole + hits.top_hits if e == filling)))
    return HostWork(whole, split, host)


@dataclass
class Fill:
    expert: int
    slot: int
    transfer: Transfer


class Fills:
    """The host lane's cache fills, at most one per layer in flight (see the module docstring)."""

    def __init__(self, layers: int) -> None:
        self.pending: list[Fill | None] = [None] * layers

    def in_flight(self, layer: int) -> int | None:
        """The expert whose fill is still in flight in this layer (after `landed` was asked), or None."""
        fill = self.pending[layer]
        return None if fill is None else fill.expert

    def landed(self, layer: int) -> Fill | None:
        """The layer's fill if its copy has landed (then it is no longer pending), else None."""
        fill = self.pending[layer]
        if fill is not None and fill.transfer.ready():
            self.pending[layer] = None
            return fill
        return None

    def offer(self, layer: int, expert: int, cache, link: Link, destination, source, after: tuple = ()) -> int:
        """After the host computed miss `expert`: offer it to the layer's cache and, if admitted, copy its top
        (`source`, the store's rows [0, k)) into `destination(slot)` at prefetch priority. One fill per layer at
        a time: while one is in flight, nothing is offered. Returns the bytes submitted."""
        if self.pending[layer] is not None:
            return 0
        admission = cache.admit(expert)
        if admission is None:
            return 0
        transfer = link.submit(destination(admission.slot), source, PREFETCH, after=after)
        self.pending[layer] = Fill(expert, admission.slot, transfer)
        return transfer.nbytes

    def clear(self, link: Link) -> None:
        """Drop every fill (a new plan): a queued copy moves nothing, a running one stops at its next chunk."""
        for fill in self.pending:
            if fill is not None:
                link.cancel(fill.transfer)
        self.pending = [None] * len(self.pending)


class HostLane:
    """The engine's host lane (offload/engine.py calls `forward` for a host-lane layer's decode step).

    The hidden row goes to the host once; the host's segments (bottoms of split hits, whole misses) are
    computed from the host store by `threads` worker threads (torch releases the GIL) while the calling
    thread computes the device's segments; the host's partial results come back to the device in one copy;
    a split expert's output is top + bottom, in that order, as on the fetch path (offload/engine.py), so the
    result does not depend on the lane or on the thread count."""

    def __init__(self, layers: int, threads: int = 1) -> None:
        if threads < 1:
            raise ValueError("the host lane needs at least one thread")
        self.threads = threads
        self.fills = Fills(layers)
        self._pool = None

    def _executor(self):
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="fmoe-host")
        return self._pool

    def forward(self, engine, i: int, act, hidden_states, routing, hits: Hits) -> dict:
        """One host-lane layer's decode step (hidden_states [1, H]); returns expert -> output [1, H] on the device."""
        import time

        import torch

        state, store, link = engine.layers[i], engine.store, engine.link
        width, k = engine.shape.intermediate, state.top_neurons
        self.settle(engine, i, wait=False)
        work = split_work(hits, self.fills.in_flight(i))
        jobs = [(e, k) for e in work.split] + [(e, 0) for e in work.host_whole]  # (expert, first neuron)
        x_host = hidden_states.to("cpu") if hidden_states.device.type != "cpu" else hidden_states  # once per layer

        def run(part: list[tuple[int, int]]) -> tuple[list, float]:
            start = time.perf_counter()
            out = [store.segment_forward(x_host, store.rows(store.expert(i, e)[first:]), act) for e, first in part]
            return out, time.perf_counter() - start

        parts = [jobs[n::self.threads] for n in range(self.threads)] if jobs else []
        futures = [self._executor().submit(run, part) for part in parts if part]
        outputs: dict = {}
        top_outputs: dict = {}
        for e in work.device_whole:  # the device's work meanwhile
            outputs[e] = store.segment_forward(hidden_states, state.top_rows[state.cache.slot(e)], act)
        for e in work.split:
            top_outputs[e] = store.segment_forward(hidden_states, state.top_rows[state.cache.slot(e)], act)
        host_parts: dict = {}
        busy = 0.0
        for n, future in enumerate(f for f in futures):
            out, seconds = future.result()
            busy += seconds
            for (e, _first), part in zip(jobs[n::self.threads], out):
                host_parts[e] = part
        if host_parts:
            order = sorted(host_parts)
            back = torch.cat([host_parts[e] for e in order]).to(hidden_states.device)  # the partial sums, once
            host_parts = dict(zip(order, back.split(1)))
        for e in work.split:  # exact: top + bottom, always in this order
            outputs[e] = top_outputs.pop(e) + host_parts[e]
        for e in work.host_whole:
            outputs[e] = host_parts[e]
        counters = state.counters
        counters.host_s += busy
        counters.host_segments += len(jobs)
        if k > 0:  # the cache learns: a miss's top copied into its slot off the critical path
            for e in hits.misses:
                counters.bytes_prefetch += self.fills.offer(
                    i, e, state.cache, link, lambda slot: state.tops[slot], store.expert(i, e)[:k],
                    after=(link.record_reads(),))
        return outputs

    def settle(self, engine, i: int, wait: bool) -> None:
        """Finish layer i's fill if it has landed (`wait`: wait for it, before anything else may write the cache:
        a prefill through the device path): its top in its slot (an emulated link hands out the source)."""
        fill = self.fills.pending[i]
        if fill is None or not (wait or fill.transfer.ready()):
            return
        self.fills.pending[i] = None
        got = engine.link.acquire(fill.transfer, tag=i)
        state = engine.layers[i]
        if state.aliased or got.data_ptr() != state.tops[fill.slot].data_ptr():  # aliased: `got` is the store's rows
            state.put_top(fill.slot, got, engine.store)

    def clear(self, link: Link) -> None:
        self.fills.clear(link)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
