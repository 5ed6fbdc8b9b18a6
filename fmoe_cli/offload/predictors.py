"""Predictors: which experts a layer is about to use, for the prefetcher.

A predictor returns, for a target MoE layer, one score per expert (higher = more
likely). The engine prefetches in descending score.
"""

from __future__ import annotations

from typing import Protocol

import torch

from fmoe_cli.models.families import MoeLayer, router_scores


class Predictor(Protocol):
    name: str

    def scores(self, target: int, hidden: torch.Tensor) -> torch.Tensor:
        """Scores [N] for MoE layer `target`, given the current layer's router input [T, H]."""
        ...


class SpeculativePredictor:
    """MoEpic Eq. 3 (after AdapMoE): softmax(R_{i+1}(h_i)) — the next layer's own
    router applied to this layer's router input. Over several tokens (prefill) the
    per-token probabilities are averaged."""

    name = "speculative"

    def __init__(self, layers: list[MoeLayer]) -> None:
        self.routers = [layer.router for layer in layers]

    def scores(self, target: int, hidden: torch.Tensor) -> torch.Tensor:
        return router_scores(self.routers[target], hidden).mean(dim=0)
