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
