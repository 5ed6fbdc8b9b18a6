"""The staging pool U_b: full-expert slots on the device for bottoms, missed experts and prefetches.

An entry (`Staged`) is one segment [start, I) of one expert in one slot, with the
transfer that fills it. The pool only keeps the bookkeeping; the link orders the
copies:

- a slot is free as soon as its entry is released, even while the copy that was
  filling it is still in flight. Releasing drops that copy (`Transfer.cancel`): a queued
  one moves nothing, a running one stops at its next chunk boundary (no later chunk of
  it can land over the slot's next copy, and the link is free sooner). The next copy
  into the slot is submitted with `after(slot)` = the slot's last copy if it still runs
  (the link issues it after every chunk of that one: CUDA's copy stream is in order;
  the emulated link models the same) and the fence recorded when compute last read the
  slot (no write-after-read: the copy stream waits on the compute stream's event). The
  host never waits here;
- a demand load takes a free slot, else the slot of another layer's entry that is not
  in use (a queued prefetch first: cancelling it is free; then a finished one; then one
  in flight). So a layer that needs more experts than there are slots (a prefill wave)
  only waits for its own loads: with 2·K slots every wave length works.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

import torch

from fmoe_cli.offload.hits import Hits, classify
from fmoe_cli.offload.link import CANCELLED, DEMAND, DONE, QUEUED, RUNNING, Fence, Transfer


@dataclass(eq=False, slots=True)
class Staged:
    """A segment [start, I) of one expert in a staging slot (start = 0: the whole expert)."""

    layer: int
    expert: int
    start: int
    slot: int
    transfer: Transfer
    prefetched: bool
    in_use: bool = False
    priority: float = float("inf")  # a prefetch: the priority it was issued with (offload/prefetch.py)


_RECLAIM_ORDER = {QUEUED: 0, DONE: 1, CANCELLED: 1, RUNNING: 2}


class StagingPool:
    def __init__(self, slots: int, neurons: int, row_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.buffer = torch.empty(slots, neurons, *row_shape, device=device, dtype=dtype)  # [U, I, *row]
        self._slot_views = list(self.buffer.unbind(0))  # [I, *row] per slot, made once
        self._sources: dict[tuple[int, int, int], torch.Tensor] = {}  # (layer, expert, start) -> store rows
        self._destinations: dict[tuple[int, int], torch.Tensor] = {}  # (slot, start) -> its view, made once
        self._rows: dict[int, tuple[torch.Tensor, object]] = {}  # id(view) -> (view, store.rows(view))
        self._stacked: dict[int, list] = {}  # start -> store.stacked_rows of rows [start, I) of every slot
        self.entries: list[Staged | None] = [None] * slots
        self._staged: dict[int, dict[int, Staged]] = {}  # layer -> expert -> its entry (at most one)
        self._writer: list[Transfer | None] = [None] * slots  # the last copy into each slot
        self._reads: list[Fence | None] = [None] * slots  # compute that last read each slot

    def destination(self, slot: int, start: int) -> torch.Tensor:
        """Where a segment [start, I) is copied into `slot`: [I - start, *row]."""
        if not start:
            return self._slot_views[slot]
        view = self._destinations.get((slot, start))
        if view is None:
            view = self._destinations[(slot, start)] = self._slot_views[slot][start:]
        return view

    def source(self, store, layer: int, expert: int, start: int) -> torch.Tensor:
        """The host store's rows [start, I) of one expert (a view, made once per segment and plan)."""
        key = (layer, expert, start)
        rows = self._sources.get(key)
        if rows is None:
            rows = store.expert(layer, expert)
            rows = self._sources[key] = rows[start:] if start else rows
        return rows

    def rows(self, store, segment: torch.Tensor):
        """`store.rows(segment)` for a segment the link handed out (a slot's view, or the store's rows it was
        copied from), made once per view: a loaded segment's forward then dispatches no op to split it."""
        cached = self._rows.get(id(segment))
        if cached is None or cached[0] is not segment:
            cached = self._rows[id(segment)] = (segment, store.rows(segment))
        return cached[1]

    def stacked_rows(self, store, start: int = 0) -> list:
        """`store.stacked_rows` of rows [start, I) of every slot ([U, I - start, *row] views, made once per start): on
        torch's path each slot's Rows know the pool's Stack (layout.Stack), so that a decode step's loaded whole
        experts (start 0) or bottoms (start k_i) are computed by one grouped matmul a projection over the pool's slots
        (Engine._loaded_decode); slot s's rows are what a segment [start, I) loaded into s reads."""
        rows = self._stacked.get(start)
        if rows is None:
            rows = self._stacked[start] = store.stacked_rows(self.buffer[:, start:] if start else self.buffer)
        return rows

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def find(self, layer: int, expert: int) -> Staged | None:
        of_layer = self._staged.get(layer)
        return of_layer.get(expert) if of_layer else None

    def classify(self, layer: int, active: list[int], cached: Container[int], top_neurons: int,
                 intermediate: int) -> Hits:
        """Classify a layer's activated experts against its cache and this pool (offload/hits.py), and
        release the layer's staged entries that serve none of them."""
        of_layer = self._staged.get(layer)
        staged = {e: entry.start for e, entry in of_layer.items()} if of_layer else {}
        hits = classify(active, cached, top_neurons, intermediate, staged)
        for e in hits.dropped:
            self.release(self.find(layer, e))
        return hits

    def take_over(self, layer: int, covered, link) -> list[Staged]:
        """The staged prefetches that cover this layer's loads ((expert, start) pairs) become its demand
        loads: in use, and at demand priority on the link."""
        loading = []
        for e, _start in covered:
            entry = self.find(layer, e)
            entry.in_use = True
            link.reprioritise(entry.transfer, DEMAND)
            loading.append(entry)
        return loading

    def submit_demand(self, layer: int, waiting: list[tuple[int, int]], loading: list[Staged], link, store) -> int:
        """Queue `waiting` loads ((expert, first neuron), in order) into free or reclaimed slots, ahead of any
        prefetch; each submitted one moves to `loading`. A load that finds no slot stays in `waiting` for
        the next wave (the slot this layer's next finished load frees). Returns the bytes submitted."""
        nbytes = 0
        while waiting:
            slot = self.reclaim(keep_layer=layer)
            if slot is None:
                return nbytes
            e, start = waiting.pop(0)
            transfer = link.submit(self.destination(slot, start), self.source(store, layer, e, start), DEMAND,
                                   after=self.after(slot))
            entry = Staged(layer, e, start, slot, transfer, prefetched=False, in_use=True)
            self.put(entry)
            loading.append(entry)
            nbytes += transfer.nbytes
        return nbytes

    def live(self) -> list[Staged]:
        return [e for e in self.entries if e is not None]

    def free_slot(self) -> int | None:
        """The lowest free slot (a full pool, common in decode, without raising ValueError: µs a load)."""
        entries = self.entries
        return entries.index(None) if None in entries else None

    def after(self, slot: int) -> tuple:
        """What a new copy into `slot` must follow: the copy still writing it, the compute still reading it."""
        writer, reads = self._writer[slot], self._reads[slot]
        follow = () if writer is None or writer.finished else (writer,)
        return follow if reads is None else (*follow, reads)

    def reclaim(self, keep_layer: int) -> int | None:
        """A slot for a demand load of `keep_layer`: a free one, else one holding another layer's
        entry that is not in use. None only when every slot holds an entry in use or of `keep_layer`."""
        slot = self.free_slot()
        if slot is not None:
            return slot
        victims = [e for e in self.entries if e is not None and e.layer != keep_layer and not e.in_use]
        if not victims:
            return None
        victim = min(victims, key=lambda e: (_RECLAIM_ORDER[e.transfer.state], e.slot))
        self.release(victim)
        return victim.slot

    def put(self, entry: Staged) -> None:
        assert self.entries[entry.slot] is None, "a slot holds one entry"
        of_layer = self._staged.setdefault(entry.layer, {})
        assert entry.expert not in of_layer, "an expert of a layer is staged once"
        self.entries[entry.slot] = entry
        of_layer[entry.expert] = entry
        self._writer[entry.slot] = entry.transfer

    def release(self, entry: Staged, reads: Fence | None = None) -> None:
        """Let the slot go; `reads`: the fence after the compute that read it (if it was read)."""
        assert self.entries[entry.slot] is entry, "an entry is released once"
        self.entries[entry.slot] = None
        del self._staged[entry.layer][entry.expert]
        entry.in_use = False
        entry.transfer.cancel()  # dropped, or stopped at its next chunk; one whose last chunk is issued runs out
        if reads is not None:
            self._reads[entry.slot] = reads

    def clear(self) -> None:
        for entry in self.live():
            self.release(entry)
        self._sources.clear()
        self._rows.clear()
        self._stacked.clear()
