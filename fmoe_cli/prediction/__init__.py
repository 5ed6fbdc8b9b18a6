"""Expert predictors for the prefetcher (DESIGN §8): `speculative` (MoEpic, the default),
`expert-map` (fMoE), `eam` (MoE-Infinity), `mol` (FIRM-MoE) and `auto` (per layer, the
most accurate of them). `make_predictor` builds one by name."""

from __future__ import annotations

from fmoe_cli.errors import FmoeError
from fmoe_cli.models.families import MoeLayer
from fmoe_cli.prediction.auto import AutoPredictor
from fmoe_cli.prediction.base import BasePredictor, Iteration, Prediction, Predictor
from fmoe_cli.prediction.eam import EamPredictor
from fmoe_cli.prediction.expert_map import ExpertMapPredictor
from fmoe_cli.prediction.mol import MolPredictor
from fmoe_cli.prediction.speculative import SpeculativePredictor

DEFAULT_PREDICTOR = "speculative"
PREDICTORS = {
    "speculative": "MoEpic/AdapMoE: the next layer's router on this layer's hidden state (default)",
    "expert-map": "fMoE: iteration expert maps, semantic + trajectory matching, distance d = 3",
    "eam": "MoE-Infinity: request-level expert activation matrices, multi-layer prefetch",
    "mol": "FIRM-MoE: intersection of the top-3 that 3 earlier layers give through the target router",
    "auto": "per layer, the predictor with the best measured accuracy (re-chosen when re-planning)",
}


def check_predictor(name: str) -> None:
    """Refuse an unknown predictor name (before a long model load)."""
    if name not in PREDICTORS:
        raise FmoeError(f"unknown predictor {name!r}; choose from {', '.join(PREDICTORS)}")


def make_predictor(name: str, layers: list[MoeLayer], num_experts: int, top_k: int) -> Predictor:
    routers = [layer.router for layer in layers]
    num_layers = len(layers)
    if name == "speculative":
        return SpeculativePredictor(routers)
    if name == "expert-map":
        return ExpertMapPredictor(num_layers, num_experts, top_k)
    if name == "eam":
        return EamPredictor(num_layers, num_experts, top_k)
    if name == "mol":
        return MolPredictor(routers)
    if name == "auto":
        candidates = [make_predictor(n, layers, num_experts, top_k) for n in PREDICTORS if n != "auto"]
        return AutoPredictor(candidates, num_layers, top_k)
    check_predictor(name)
    raise AssertionError(name)  # every name in PREDICTORS is handled above


__all__ = ["DEFAULT_PREDICTOR", "PREDICTORS", "AutoPredictor", "BasePredictor", "EamPredictor", "ExpertMapPredictor", "Iteration",
           "MolPredictor", "Prediction", "Predictor", "SpeculativePredictor", "check_predictor",
           "make_predictor"]
