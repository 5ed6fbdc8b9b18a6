"""`mol` (FIRM-MoE): multi-layer intersection.

The target layer's router is applied to the router inputs of the P most recent
layers h_l, h_{l−1}, …, h_{l−P+1}; each gives its top-K candidates, and the experts
in every candidate set (the intersection) are the confident prediction.

Choices the paper leaves open (decided here):
- Ranking: intersection experts first, the rest after them; inside both groups the
  order of the nearest layer's scores (softmax(R_t(h_l)), i.e. `speculative`).
  So an empty intersection falls back to exactly the speculative ranking (and the
  ranking, used by the statistics, stays a full one).
- Fewer than P layers observed (the first layers of a pass): intersect the ones
  there are (layer 0 alone = the speculative prediction). The engine's `Iteration`
  keeps the router inputs of the last 3 layers, so P > 3 acts as P = 3. The last layer predicts
  layer 0 of the next token from the last P layers of this one, as speculative does.
- Several tokens (prefill): each layer's candidates come from its per-token
  probabilities averaged over the tokens (as speculative).
- What is prefetched: the intersection only (`count` = its size: FIRM-MoE trades
  recall for precision); an empty intersection falls back to the speculative
  candidates (the prefetcher's default count). Distance 1.
"""

from __future__ import annotations

import torch

from fmoe_cli.prediction.base import BasePredictor, Iteration, Prediction, router_choices, router_scores
from fmoe_cli.types import RouterChoice

DEFAULT_CANDIDATES = 3  # K: candidates per layer
DEFAULT_LAYERS = 3  # P: earlier layers intersected


def intersection_scores(per_layer: list[torch.Tensor], k: int) -> tuple[torch.Tensor, set[int]]:
    """per_layer: scores [N] nearest layer first. Returns scores ranking the intersection of
    the top-k sets first (ordered by the nearest layer), then the rest, and the intersection."""
    sets = [set(torch.topk(s, min(k, s.numel())).indices.tolist()) for s in per_layer]
    common = set.intersection(*sets)
    nearest = per_layer[0]
    # Shift the nearest layer's scores into [0, 1) and lift the intersection above everything else.
    base = (nearest - nearest.min()) / (nearest.max() - nearest.min()).clamp_min(1e-12) * 0.5
    boost = torch.zeros_like(base)
    if common:
        boost[list(common)] = 1.0
    return base + boost, common


class MolPredictor(BasePredictor):
    name = "mol"

    def __init__(self, routers: list[RouterChoice | torch.nn.Module], k: int = DEFAULT_CANDIDATES,
                 layers: int = DEFAULT_LAYERS) -> None:
        if k < 1 or layers < 1:
            raise ValueError("mol needs K >= 1 and P >= 1")
        self.routers = router_choices(routers)
        self.k = k
        self.p = layers
        self.last_intersection: set[int] = set()  # for tests and the curious

    def _per_layer(self, it: Iteration, layer: int, hidden: torch.Tensor | None) -> torch.Tensor:
        """[P', N]: the target router on the router inputs of this layer and the P − 1 before it."""
        target = (layer + 1) % len(self.routers)
        inputs = {layer: hidden if hidden is not None else it.hidden.get(layer)}
        for h in range(layer - 1, layer - self.p, -1):
            inputs[h] = it.hidden.get(h)
        router = self.routers[target]
        return torch.stack([router_scores(router, x).mean(dim=0) for x in inputs.values() if x is not None])

    def device_part(self, it: Iteration, layer: int, hidden: torch.Tensor) -> dict:
        return {("mol", layer): self._per_layer(it, layer, hidden)}

    def after_layer(self, it: Iteration, layer: int) -> list[Prediction]:
        target = (layer + 1) % len(self.routers)
        per_layer = list(it.host_part(("mol", layer), lambda: self._per_layer(it, layer, None)))
        scores, self.last_intersection = intersection_scores(per_layer, self.k)
        return [Prediction(target, scores, distance=1, count=len(self.last_intersection) or None)]
