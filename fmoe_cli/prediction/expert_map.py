"""`expert-map` (fMoE): iteration-level expert maps, semantic and trajectory matching.

An expert map is one iteration's L×N routing distribution (row l: layer l's router
probabilities averaged over the pass's tokens). The map store keeps C maps, each
with the pass's semantic vector (the embedding layer's output, averaged over its
tokens). While a pass runs:

- for the first d layers (targets 0..d−1) there is no trajectory yet: the stored
  map whose semantic vector is most similar (cosine) to this pass's gives them;
- after layer l has routed, the observed rows 0..l are matched (cosine of the
  flattened rows) against the same rows of every stored map; the best map's row
  l + d is the prediction for layer l + d (prefetch distance d).

How many experts: δ = clip(1 − score, 0, 1) with score the best match's
similarity; the prefetcher takes the fewest best experts whose probabilities sum
to at least δ, and at least K. Priority p / (l − l_now) (p: the expert's
probability in the matched row; l − l_now: the distance when issued).

Map store replacement (capacity C): when full, the new map replaces the stored map
with the highest redundancy

    RDY = (d / L) · semantic similarity + ((L − d) / L) · trajectory similarity

(trajectory similarity: cosine of the whole maps), i.e. the one the newcomer makes
most redundant.

Off the critical path: matching and store updates run on one worker thread, in
submission order; a layer never waits. `after_layer` returns the predictions of
every match that has finished by then (matches of earlier passes are dropped;
a match whose target has already routed is dropped). The worker's queue is bounded:
a match not started yet is cancelled as soon as it is stale (an earlier pass's, or
its target has routed), and at most `STORE_BACKLOG` map-store updates wait (the
oldest go first), so a worker slower than the tokens falls behind by a bounded amount
instead of for good (with 1000 maps a match reads 1000·L·N floats).

Choices the paper leaves open (decided here):
- Semantic vector: mean of the embedding output over the pass's tokens (a prefill:
  the prompt; a decode step: the new token).
- Every pass is stored, prefill and decode alike, when its last layer has routed.
- The number of experts from δ: the cumulative-probability rule above (fewest top
  experts whose probabilities sum to ≥ δ, never fewer than K): a confident match
  (δ → 0) loads K, a poor one (δ → 1) loads nearly the whole row.
- Semantic predictions for targets 0..d−1 count their distance from the embedding
  (target + 1); target 0 is usually too late for them (it routes before the worker
  answers), which is what `auto` is for.
- Ties in matching and replacement go to the oldest map.
- An empty store predicts nothing.
- Memory per entry: L·N + H float32 = 4·(L·N + H) bytes (`entry_bytes`).
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from fmoe_cli.prediction.base import BasePredictor, Iteration, Prediction, cosine_rows, distribution_part

DEFAULT_CAPACITY = 1000  # C (fMoE)
DEFAULT_DISTANCE = 3  # d (fMoE)


class MapStore:
    """C expert maps [C, L, N] with their semantic vectors [C, H] (allocated on the first add)."""

    def __init__(self, capacity: int, num_layers: int, num_experts: int, distance: int) -> None:
        if capacity < 1:
            raise ValueError("the map store needs a capacity of at least 1")
        self.capacity = capacity
        self.num_layers = num_layers
        self.distance = distance
        self.maps = torch.zeros(capacity, num_layers, num_experts)
        self.semantic: torch.Tensor | None = None
        self.count = 0

    def entry_bytes(self, hidden: int) -> int:
        return (self.num_layers * self.maps.shape[2] + hidden) * self.maps.element_size()

    def redundancy(self, expert_map: torch.Tensor, semantic: torch.Tensor) -> torch.Tensor:
        """RDY of the new map against every stored one: (d/L)·semantic + ((L−d)/L)·trajectory."""
        big_l, d = self.num_layers, min(self.distance, self.num_layers)
        sem = cosine_rows(self.semantic[: self.count], semantic)
        traj = cosine_rows(self.maps[: self.count].flatten(1), expert_map.flatten())
        return (d / big_l) * sem + ((big_l - d) / big_l) * traj

    def add(self, expert_map: torch.Tensor, semantic: torch.Tensor) -> int:
        if self.semantic is None:
            self.semantic = torch.zeros(self.capacity, semantic.numel())
        if self.count < self.capacity:
            slot = self.count
            self.count += 1
        else:
            slot = int(torch.argmax(self.redundancy(expert_map, semantic)))
        self.maps[slot] = expert_map
        self.semantic[slot] = semantic
        return slot

    def match_semantic(self, semantic: torch.Tensor) -> tuple[int, float] | None:
        if self.count == 0:
            return None
        sim = cosine_rows(self.semantic[: self.count], semantic)
        best = int(torch.argmax(sim))
        return best, float(sim[best])

    def match_trajectory(self, rows: torch.Tensor) -> tuple[int, float] | None:
        """rows: the observed distributions [l+1, N] of layers 0..l."""
        if self.count == 0:
            return None
        sim = cosine_rows(self.maps[: self.count, : rows.shape[0]].flatten(1), rows.flatten())
        best = int(torch.argmax(sim))
        return best, float(sim[best])


def prefetch_count(row: torch.Tensor, score: float, top_k: int) -> int:
    """fMoE: δ = clip(1 − score, 0, 1); the fewest best experts whose probabilities sum to ≥ δ, at least K."""
    delta = min(1.0, max(0.0, 1.0 - score))
    cumulative = torch.cumsum(torch.sort(row, descending=True).values, dim=0)
    n = int(torch.searchsorted(cumulative, torch.tensor(delta - 1e-9)).item()) + 1
    return max(top_k, min(n, row.numel()))


STORE_BACKLOG = 4  # map-store updates that may wait for the worker; older ones are dropped


@dataclass(eq=False, slots=True)
class Pending:
    """A job for the worker: the pass it belongs to, the layer a match predicts (-1: targets from the
    first on; None: a store update), and its result."""

    key: tuple[int, int] | None
    target: int | None
    run: object  # () -> list of matches
    future: Future = field(default_factory=Future)


class Worker:
    """One thread that runs jobs in submission order. Unlike a ThreadPoolExecutor, a job dropped before it
    starts leaves the queue at once (its arguments with it), so a bounded backlog is bounded in memory."""

    def __init__(self) -> None:
        self._queue: collections.deque[Pending] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="fmoe-expert-map", daemon=True)
        self._thread.start()

    def submit(self, job: Pending) -> None:
        with self._cv:
            self._queue.append(job)
            self._cv.notify()

    def drop(self, job: Pending) -> bool:
        """Cancel a job that has not started; returns whether it was."""
        with self._cv:
            if not job.future.cancel():
                return False
            self._queue.remove(job)
            return True

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                job = self._queue.popleft()
                if not job.future.set_running_or_notify_cancel():
                    continue
            try:
                job.future.set_result(job.run())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever reads the result
                job.future.set_exception(exc)

    def close(self) -> None:
        with self._cv:
            for job in self._queue:
                job.future.cancel()
            self._queue.clear()
            self._closed = True
            self._cv.notify()
        self._thread.join()


class ExpertMapPredictor(BasePredictor):
    name = "expert-map"

    def __init__(self, num_layers: int, num_experts: int, top_k: int, capacity: int = DEFAULT_CAPACITY,
                 distance: int = DEFAULT_DISTANCE, synchronous: bool = False) -> None:
        if distance < 1:
            raise ValueError("the prefetch distance d must be at least 1")
        self.num_layers = num_layers
        self.top_k = top_k
        self.distance = distance
        self.store = MapStore(capacity, num_layers, num_experts, distance)
        self._worker = None if synchronous else Worker()
        self._pending: collections.deque[Pending] = collections.deque()  # submitted, result not collected
        self._rows = torch.zeros(num_layers, num_experts)  # this pass's map so far
        self._semantic: torch.Tensor | None = None
        self._pass: tuple[int, int] | None = None

    # --- the worker's jobs (they alone touch the store) ---------------------
    def _semantic_job(self, key, semantic: torch.Tensor) -> list[tuple]:
        found = self.store.match_semantic(semantic)
        if found is None:
            return []
        best, score = found
        targets = range(min(self.distance, self.num_layers))
        return [(key, t, self.store.maps[best, t].clone(), score, -1) for t in targets]

    def _trajectory_job(self, key, rows: torch.Tensor, layer: int) -> list[tuple]:
        target = layer + self.distance
        if target >= self.num_layers:
            return []
        found = self.store.match_trajectory(rows)
        if found is None:
            return []
        best, score = found
        return [(key, target, self.store.maps[best, target].clone(), score, layer)]

    def _store_job(self, expert_map: torch.Tensor, semantic: torch.Tensor) -> list[tuple]:
        self.store.add(expert_map, semantic)
        return []

    def _submit(self, job, *args, target: int | None = None) -> None:
        """Queue a job; `target`: the layer a match predicts (-1: targets from the first on; None: a
        store update)."""
        pending = Pending(self._pass, target, lambda: job(*args))
        self._pending.append(pending)
        if self._worker is None:
            pending.future.set_result(pending.run())
        else:
            self._worker.submit(pending)

    def _drop_stale(self, now: int) -> None:
        """Cancel the queued jobs whose result would be dropped: matches of an earlier pass, or for a layer
        that has routed (≤ now); and store updates beyond the newest STORE_BACKLOG."""
        if self._worker is None:
            return
        stores = sum(1 for p in self._pending if p.target is None and not p.future.done())
        kept = collections.deque()
        for p in self._pending:
            if p.target is None:
                stale = stores > STORE_BACKLOG
            else:
                stale = p.key != self._pass or 0 <= p.target <= now
            if stale and self._worker.drop(p):  # not started: gone; running: it finishes, its result is dropped
                stores -= p.target is None
            else:
                kept.append(p)
        self._pending = kept

    def _ready(self, now: int) -> list[Prediction]:
        """Predictions of every finished job, in order; never waits."""
        self._drop_stale(now)
        out = []
        while self._pending and self._pending[0].future.done():
            future = self._pending.popleft().future
            for key, target, row, score, _issued in future.result():
                if key != self._pass or target <= now:
                    continue  # an earlier pass's match, or its target has already routed
                out.append(Prediction(target, row, distance=target - now,
                                      count=prefetch_count(row, score, self.top_k)))
        return out

    # --- the interface -------------------------------------------------------
    def device_part(self, it: Iteration, layer: int, hidden: torch.Tensor) -> dict:
        if it.routers is None:
            return {}
        return {("distribution", layer): distribution_part(it.routers[layer], hidden)}

    def begin(self, it: Iteration) -> list[Prediction]:
        self._pass = (it.request, it.index)
        self._rows.zero_()
        self._semantic = it.semantic()  # on the host, as the map store
        if self._semantic is not None:
            self._submit(self._semantic_job, self._pass, self._semantic.clone(), target=-1)
        return self._ready(-1)

    def after_layer(self, it: Iteration, layer: int) -> list[Prediction]:
        if self._pass != (it.request, it.index):  # no `begin` seen for this pass
            self.begin(it)
        self._rows[layer] = it.distribution(layer)
        self._submit(self._trajectory_job, self._pass, self._rows[: layer + 1].clone(), layer,
                     target=layer + self.distance)
        if layer == self.num_layers - 1 and self._semantic is not None:
            self._submit(self._store_job, self._rows.clone(), self._semantic.clone())
        return self._ready(layer)

    def close(self) -> None:
        """Stop the worker (after this, matching runs inline: a closed engine no longer calls it)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None
            self._pending = collections.deque(p for p in self._pending if not p.future.cancelled())

    def drain(self) -> None:
        """Wait for the worker (tests, and before inspecting the store)."""
        for p in list(self._pending):
            if not p.future.cancelled():
                p.future.result()
