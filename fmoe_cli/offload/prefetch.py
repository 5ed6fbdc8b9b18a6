"""The prefetcher: turns any predictor's predictions into staging-pool loads.

All predictions of one call compete in one order, by priority

    priority = score · weight        (weight: 1 / distance unless the predictor says otherwise,
                                      fMoE's p / (l − l_now); MoE-Infinity passes 1 − (i − l)/L)

so nearer layers go first. The candidates of a prediction are its `count` best
experts (default: Y = K); candidates already
staged or whole on the device are skipped, not replaced by lower-ranked ones.
Each load is only the bottom segment when the top is cached, the whole expert
otherwise. The link priority is PREFETCH + the position in that order.

Budget: loads only go into free staging slots (U_b is fixed by the plan). When
the pool is full, a load may take the slot of a *queued* prefetch (not started,
not in use) of lower priority; in-use and in-flight entries are never touched.
The walk stops at the first load that finds no slot (everything after it has a
lower priority).

A prediction issued d ≥ L layers ahead would name a layer that routes again
before it: such predictions are ignored.
"""

from __future__ import annotations

from fmoe_cli.offload.link import PREFETCH, QUEUED, Link
from fmoe_cli.offload.pool import Staged, StagingPool
from fmoe_cli.prediction.base import Prediction
from fmoe_cli.types import ExpertShape


class Prefetcher:
    """Built for one plan (the engine's `configure`): the pool, link and store it loads with,
    and the engine's per-layer states (cache, top width, counters)."""

    def __init__(self, pool: StagingPool, link: Link, store, layers: list, shape: ExpertShape) -> None:
        self.pool = pool
        self.link = link
        self.store = store
        self.layers = layers  # engine LayerState per MoE layer
        self.shape = shape
        self.width = shape.top_k  # Y: the prefetch candidates of a prediction without its own count

    def issue(self, predictions: list[Prediction]) -> dict[int, list[int]]:
        """Queue the loads `predictions` call for; returns each target layer's ranking (best first)."""
        shape, pool, layers = self.shape, self.pool, self.layers
        rankings: dict[int, list[int]] = {}
        candidates = []  # (−priority, the prediction's index, rank, expert): sorted, the order loads are issued in
        for index, p in enumerate(predictions):
            if not 1 <= p.distance < shape.num_layers:
                continue  # it names a layer that routes again before it
            scores = p.scores.tolist()
            ranking = sorted(range(len(scores)), key=scores.__getitem__, reverse=True)  # stable: ties by expert id
            rankings[p.target] = ranking
            policy = layers[p.target].cache.policy
            if policy.uses_prediction:
                policy.see_prediction(scores)
            weight = p.priority_weight
            for rank, e in enumerate(ranking[: p.count if p.count is not None else self.width]):
                candidates.append((-scores[e] * weight, index, rank, e))
        candidates.sort()
        for position, (neg_priority, index, _rank, e) in enumerate(candidates):
            j = predictions[index].target
            target = layers[j]
            if target.host or pool.find(j, e) is not None:
                continue  # a host-lane layer (it loads nothing in decode: offload/host.py), or staged already
            cached = target.cache.slot(e) is not None
            if cached and target.top_neurons == shape.intermediate:
                continue  # already whole on the device
            slot = pool.free_slot()
            if slot is None:
                slot = self._displace(-neg_priority)
                if slot is None:
                    break  # the staging pool is full of more urgent work
            start = target.top_neurons if cached else 0  # only the bottom when the top is cached
            transfer = self.link.submit(pool.destination(slot, start), pool.source(self.store, j, e, start),
                                        PREFETCH + position, after=pool.after(slot))
            pool.put(Staged(j, e, start, slot, transfer, prefetched=True, priority=-neg_priority))
            counters = target.counters
            counters.prefetch_issued += 1
            counters.bytes_prefetch += transfer.nbytes
        return rankings

    def _displace(self, priority: float) -> int | None:
        """Free the slot of the lowest-priority queued prefetch below `priority`, if any."""
        pool = self.pool
        victims = [e for e in pool.live() if e.prefetched and not e.in_use
                   and e.transfer.state is QUEUED and e.priority < priority]
        if not victims:
            return None
        victim = min(victims, key=lambda e: (e.priority, e.slot))
        pool.release(victim)
        return victim.slot
