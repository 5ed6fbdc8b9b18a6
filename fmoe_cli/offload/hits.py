"""Hit classification: what one layer's activated experts need, from the cache and the staging pool.

Pure logic (no tensors), shared by the engine and the simulator. For every activated
expert e of layer i (k = the layer's top neurons, I = neurons per expert):

- whole: e is cached and k = I: compute, nothing to load;
- top hit: the top [0, k) is cached: compute it, load the bottom [k, I);
- miss: nothing cached: load the whole expert [0, I);

and a needed load is *covered* when a prefetch of this layer already staged e from a
first neuron at or before the one needed. Staged entries of this layer that are not
activated, or that start too late to cover the need, are *dropped*.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from typing import NamedTuple


class Hits(NamedTuple):  # (a tuple: made once a layer, in a third of a frozen dataclass's time)
    whole: tuple[int, ...]  # cached whole: compute only
    top_hits: tuple[int, ...]  # top cached: top computed, bottom loaded
    misses: tuple[int, ...]  # whole expert loaded
    covered: tuple[tuple[int, int], ...]  # (expert, first neuron needed) a staged prefetch already holds
    loads: tuple[tuple[int, int], ...]  # (expert, first neuron) to submit as demand loads
    dropped: tuple[int, ...]  # staged experts of this layer that are of no use now

    @property
    def needed(self) -> int:
        """Activated experts that needed any load."""
        return len(self.top_hits) + len(self.misses)


def classify(active: Iterable[int], cached: Container[int], top_neurons: int, intermediate: int,
             staged: Mapping[int, int]) -> Hits:
    """active: the layer's activated experts; cached: experts whose top is cached; staged:
    expert -> first neuron of the segment this layer's staging entries hold."""
    whole_when_cached = top_neurons == intermediate
    whole, top_hits, misses, covered, loads = [], [], [], [], []
    for e in sorted(set(active)):
        if e in cached:
            if whole_when_cached:
                whole.append(e)
                continue
            top_hits.append(e)
            start = top_neurons
        else:
            misses.append(e)
            start = 0
        first = staged.get(e) if staged else None
        if first is not None and first <= start:
            covered.append((e, start))
        else:
            loads.append((e, start))
    dropped = tuple(sorted(staged.keys() - dict(covered))) if staged else ()  # (set arithmetic in C: no frame)
    return Hits(tuple(whole), tuple(top_hits), tuple(misses), tuple(covered), tuple(loads), dropped)
