"""`eam` (MoE-Infinity): request-level expert activation matrices.

An EAM M ∈ R^{L×N} counts, for one request, how many tokens each expert of each
layer processed (prefill and decode). Finished requests go to a collection of
capacity C. During a request, after layer l has routed, the current request's
rows 0..l are matched against the same rows of every stored EAM, and the future
layers i = l+1, … are prefetched with priority

    score_i(e) = M̂[i, e] · (1 − (i − l) / L)        (MoE-Infinity's layer-proximity weight)

where M̂ is the matched EAM with each row normalised to sum 1.

Choices the paper leaves open (decided here):
- Similarity: cosine of the row-normalised rows 0..l flattened (each layer weighs
  the same whatever the request's length).
- Matches: the `matches` most similar EAMs (default 1, MoE-Infinity's "most
  similar"), summed with their similarity as weight when more than one.
- Replacement when the collection is full: the new EAM replaces the stored EAM
  most similar to it (cosine of the whole normalised matrix), so near-duplicates
  give way and the collection stays diverse; ties go to the oldest entry.
- A request is finished when the next one starts (the engine's next multi-token
  pass) — then its EAM is added. Requests with no routed token are not stored.
- Empty collection: predict from the current request's own EAM (its earlier
  iterations), so one long request is not left without prefetch.
- Horizon: every later layer of this pass, then the next pass's layers up to
  L − 1 layers ahead (weights 1 − d/L > 0); per target the top-K experts.
- Memory per entry: L·N float32 counts = 4·L·N bytes (`entry_bytes`).
"""

from __future__ import annotations

import torch

from fmoe_cli.prediction.base import BasePredictor, Iteration, Prediction, cosine_rows

DEFAULT_CAPACITY = 300  # MoE-Infinity: a few hundred EAMs cover a workload's patterns


def normalise_rows(m: torch.Tensor) -> torch.Tensor:
    return m / m.sum(dim=-1, keepdim=True).clamp_min(1e-12)


class EamCollection:
    """Stored EAMs [count, L, N], capacity C, most-similar replacement."""

    def __init__(self, capacity: int, num_layers: int, num_experts: int) -> None:
        if capacity < 1:
            raise ValueError("the EAM collection needs a capacity of at least 1")
        self.capacity = capacity
        self.matrices = torch.zeros(capacity, num_layers, num_experts)
        self.count = 0

    @property
    def entry_bytes(self) -> int:
        return self.matrices[0].numel() * self.matrices.element_size()

    def stored(self) -> torch.Tensor:
        return self.matrices[: self.count]

    def add(self, eam: torch.Tensor) -> int:
        """Store an EAM; returns the slot it took."""
        if self.count < self.capacity:
            slot = self.count
            self.count += 1
        else:
            flat = normalise_rows(self.stored()).flatten(1)
            similarity = cosine_rows(flat, normalise_rows(eam).flatten())
            slot = int(torch.argmax(similarity))  # first maximum: the oldest of equals
        self.matrices[slot] = eam
        return slot

    def match(self, eam: torch.Tensor, layers: int, matches: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Similarities of rows [0, layers) and the indices of the `matches` best (best first)."""
        rows = normalise_rows(self.stored()[:, :layers]).flatten(1)
        similarity = cosine_rows(rows, normalise_rows(eam[:layers]).flatten())
        best = torch.argsort(similarity, descending=True, stable=True)[:matches]
        return similarity, best


class EamPredictor(BasePredictor):
    name = "eam"

    def __init__(self, num_layers: int, num_experts: int, top_k: int, capacity: int = DEFAULT_CAPACITY,
                 matches: int = 1) -> None:
        self.num_layers = num_layers
        self.top_k = top_k
        self.matches = matches
        self.collection = EamCollection(capacity, num_layers, num_experts)
        self.current = torch.zeros(num_layers, num_experts)  # this request's EAM
        self._request = None

    def begin(self, it: Iteration) -> list[Prediction]:
        if it.request != self._request:
            if self._request is not None and self.current.sum() > 0:
                self.collection.add(self.current.clone())
            self.current.zero_()
            self._request = it.request
        return []

    def after_layer(self, it: Iteration, layer: int) -> list[Prediction]:
        if it.request != self._request:  # no `begin` seen for this request
            self.begin(it)
        routed = it.routed[layer].reshape(-1)
        self.current[layer] += torch.bincount(routed, minlength=self.current.shape[1]).float()
        reference = self._reference(layer)
        if reference is None:
            return []
        big_l = self.num_layers
        out = []
        for d in range(1, big_l):  # d = i − l (wrapping into the next pass)
            i = (layer + d) % big_l
            row = reference[i]
            if row.sum() <= 0:
                continue
            out.append(Prediction(i, row, distance=d, count=self.top_k, weight=1.0 - d / big_l))
        return out

    def _reference(self, layer: int) -> torch.Tensor | None:
        """The aggregated, row-normalised EAM the future layers are read from."""
        if self.collection.count == 0:
            return normalise_rows(self.current) if self.current.sum() > 0 else None
        similarity, best = self.collection.match(self.current, layer + 1, self.matches)
        stored = self.collection.stored()
        if len(best) == 1:
            return normalise_rows(stored[best[0]])
        weights = similarity[best].clamp_min(0) + 1e-12
        return normalise_rows((weights[:, None, None] * normalise_rows(stored[best])).sum(dim=0))
