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
a match whose target has already routed is dropped).

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
from concurrent.futures import Future, ThreadPoolExecutor

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
        self._worker = None if synchronous else ThreadPoolExecutor(1, thread_name_prefix="fmoe-expert-map")
        self._pending: collections.deque[Future] = collections.deque()
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

    def _submit(self, job, *args) -> None:
        if self._worker is None:
            done: Future = Future()
            done.set_result(job(*args))
            self._pending.append(done)
        else:
            self._pending.append(self._worker.submit(job, *args))

    def _ready(self, now: int) -> list[Prediction]:
        """Predictions of every finished job, in order; never waits."""
        out = []
        while self._pending and self._pending[0].done():
            for key, target, row, score, _issued in self._pending.popleft().result():
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
            self._submit(self._semantic_job, self._pass, self._semantic.clone())
        return self._ready(-1)

    def after_layer(self, it: Iteration, layer: int) -> list[Prediction]:
        if self._pass != (it.request, it.index):  # no `begin` seen for this pass
            self.begin(it)
        self._rows[layer] = it.distribution(layer)
        self._submit(self._trajectory_job, self._pass, self._rows[: layer + 1].clone(), layer)
        if layer == self.num_layers - 1 and self._semantic is not None:
            self._submit(self._store_job, self._rows.clone(), self._semantic.clone())
        return self._ready(layer)

    def close(self) -> None:
        """Stop the worker (after this, matching runs inline: a closed engine no longer calls it)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True, cancel_futures=True)
            self._worker = None

    def drain(self) -> None:
        """Wait for the worker (tests, and before inspecting the store)."""
        for future in list(self._pending):
            future.result()
