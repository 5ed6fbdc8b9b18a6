"""How good a predictor's predictions were, per target layer (used by `auto` and the benchmark).

For each routing of layer l in a decode step (one token; a prefill activates most
experts and is not scored), the latest prediction issued for l before it routed is
compared with the activated set A_l:

- hits: |top-K(prediction) ∩ A_l|, so accuracy(l) = Σ hits / (K · q_l);
- the predicted set S = the prediction's `count` best experts (K when it gives no
  count): precision(l) = Σ |S ∩ A_l| / Σ |S|, recall(l) = Σ |S ∩ A_l| / Σ |A_l|.

A layer routed without any prediction counts as 0 hits and adds |A_l| to recall's
denominator.
"""

from __future__ import annotations

import torch

from fmoe_cli.prediction.base import Iteration, Prediction


class Scoreboard:
    def __init__(self, num_layers: int, top_k: int) -> None:
        self.top_k = top_k
        self.steps = torch.zeros(num_layers, dtype=torch.long)  # q_l
        self.hits = torch.zeros(num_layers, dtype=torch.long)
        self.predicted = torch.zeros(num_layers, dtype=torch.long)  # Σ |S|
        self.correct = torch.zeros(num_layers, dtype=torch.long)  # Σ |S ∩ A|
        self.activated = torch.zeros(num_layers, dtype=torch.long)  # Σ |A|
        self._latest: dict[int, Prediction] = {}

    def record(self, predictions: list[Prediction]) -> None:
        for p in predictions:
            self._latest[p.target] = p

    def score(self, it: Iteration, layer: int) -> None:
        """Layer `layer` has routed: score (and forget) the prediction made for it."""
        prediction = self._latest.pop(layer, None)
        if it.tokens != 1:
            return
        active = it.activated(layer)
        self.steps[layer] += 1
        self.activated[layer] += len(active)
        if prediction is None:
            return
        ranking = prediction.ranking()
        self.hits[layer] += len(set(ranking[: self.top_k]) & active)
        chosen = set(ranking[: prediction.count or self.top_k])
        self.predicted[layer] += len(chosen)
        self.correct[layer] += len(chosen & active)

    def accuracy(self) -> torch.Tensor:
        return self.hits.float() / (self.top_k * self.steps.clamp_min(1)).float()

    def precision(self) -> torch.Tensor:
        return self.correct.float() / self.predicted.clamp_min(1).float()

    def recall(self) -> torch.Tensor:
        return self.correct.float() / self.activated.clamp_min(1).float()
