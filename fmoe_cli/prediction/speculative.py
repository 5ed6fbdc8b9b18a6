"""`speculative` (MoEpic, after AdapMoE): the next layer's own router on this layer's router input."""

from __future__ import annotations

import torch

from fmoe_cli.prediction.base import BasePredictor, Iteration, Prediction, router_choices, router_scores
from fmoe_cli.types import RouterChoice


class SpeculativePredictor(BasePredictor):
    """MoEpic Eq. 3: softmax(R_{i+1}(h_i)). Over several tokens (prefill) the per-token
    probabilities are averaged. The last layer predicts layer 0 of the next token (AdapMoE)."""

    name = "speculative"

    def __init__(self, routers: list[RouterChoice | torch.nn.Module]) -> None:
        self.routers = router_choices(routers)

    def _scores(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        target = (layer + 1) % len(self.routers)
        scores = router_scores(self.routers[target], hidden)  # [T, N]
        return scores[0] if scores.shape[0] == 1 else scores.mean(dim=0)  # [N] (a decode step: its one row)

    def device_part(self, it: Iteration, layer: int, hidden: torch.Tensor) -> dict:
        return {("speculative", layer): self._scores(layer, hidden)}

    def after_layer(self, it: Iteration, layer: int) -> list[Prediction]:
        target = (layer + 1) % len(self.routers)
        scores = it.host_part(("speculative", layer), lambda: self._scores(layer, it.hidden[layer]))
        return [Prediction(target, scores, distance=1)]
