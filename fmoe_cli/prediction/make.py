"""`make_predictor`: a predictor of the table (fmoe_cli/prediction/__init__.py) by name."""

from __future__ import annotations

from fmoe_cli.prediction import PREDICTORS, check_predictor
from fmoe_cli.prediction.auto import AutoPredictor
from fmoe_cli.prediction.base import Predictor
from fmoe_cli.prediction.eam import EamPredictor
from fmoe_cli.prediction.expert_map import ExpertMapPredictor
from fmoe_cli.prediction.mol import MolPredictor
from fmoe_cli.prediction.speculative import SpeculativePredictor
from fmoe_cli.types import MoeLayer


def make_predictor(name: str, layers: list[MoeLayer], num_experts: int, top_k: int) -> Predictor:
    routers = [layer.choice for layer in layers]
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
