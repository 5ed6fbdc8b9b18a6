"""`auto`: per layer, the predictor with the best measured accuracy.

Every candidate predictor runs in the shadow (sees every pass and makes its
predictions); only the predictions of the candidate chosen for their target layer
reach the prefetcher. Accuracy of candidate c at layer l:

    acc_c(l) = Σ |top-K(prediction of c for l) ∩ A_l| / (K · q_l)

over the q_l decode steps in which layer l routed (A_l: the activated experts;
the prediction: the latest one c issued for l before l routed; none counts as 0
hits).

Choices left open (decided here):
- Only decode steps (one token) are scored: a prefill activates most experts and
  would make every prediction look right.
- The choice is made when the plan is (re)computed (`replan`, called by the
  engine's `configure`), per layer, among layers with at least `min_steps` scored
  steps; ties and unmeasured layers keep the first candidate (`speculative`).
- The measurements accumulate over the predictor's lifetime (they are not reset
  by a re-plan).
"""

from __future__ import annotations

import torch

from fmoe_cli.prediction.base import BasePredictor, Iteration, Prediction, Predictor
from fmoe_cli.prediction.score import Scoreboard

MIN_STEPS = 8


class AutoPredictor(BasePredictor):
    name = "auto"

    def __init__(self, candidates: list[Predictor], num_layers: int, top_k: int, min_steps: int = MIN_STEPS) -> None:
        if not candidates:
            raise ValueError("auto needs at least one candidate predictor")
        self.candidates = candidates
        self.top_k = top_k
        self.min_steps = min_steps
        self.boards = [Scoreboard(num_layers, top_k) for _ in candidates]
        self.choice = [0] * num_layers  # candidate index per layer

    def accuracy(self) -> torch.Tensor:
        """[candidates, L]: acc_c(l) (0 where nothing was scored)."""
        return torch.stack([b.accuracy() for b in self.boards])

    def chosen(self) -> list[str]:
        return [self.candidates[c].name for c in self.choice]

    def _route(self, per_candidate: list[list[Prediction]]) -> list[Prediction]:
        out = []
        for c, predictions in enumerate(per_candidate):
            self.boards[c].record(predictions)
            out += [p for p in predictions if self.choice[p.target] == c]
        return out

    def device_part(self, it: Iteration, layer: int, hidden: torch.Tensor) -> dict:
        parts: dict = {}
        for c in self.candidates:  # every candidate runs in the shadow: all their parts, one copy
            parts.update(c.device_part(it, layer, hidden))
        return parts

    def begin(self, it: Iteration) -> list[Prediction]:
        return self._route([c.begin(it) for c in self.candidates])

    def after_layer(self, it: Iteration, layer: int) -> list[Prediction]:
        for board in self.boards:
            board.score(it, layer)
        return self._route([c.after_layer(it, layer) for c in self.candidates])

    def replan(self) -> None:
        acc = self.accuracy()
        for layer in range(len(self.choice)):
            if self.boards[0].steps[layer] >= self.min_steps:
                self.choice[layer] = int(torch.argmax(acc[:, layer]))  # first maximum: the earlier candidate
        for c in self.candidates:
            c.replan()

    def close(self) -> None:
        for c in self.candidates:
            c.close()
