"""Find the routed experts of a transformers MoE model, and refuse what cannot be served exactly.

transformers 5 stores the routed experts of every MoE family as fused 3-D
parameters in a module decorated with `use_experts_implementation`; its parent
block exposes the router as `.gate`. Shared experts are ordinary modules and stay
resident.
"""

from __future__ import annotations

import re
import sys

import torch
from torch import nn
from transformers.integrations.moe import _default_apply_gate

from fmoe_cli.errors import FmoeError
from fmoe_cli.models.config import EXPERT_COUNT_KEYS
from fmoe_cli.types import MoeLayer


def routed_expert_count(config) -> int:
    text_config = getattr(config, "get_text_config", lambda: config)()
    for key in EXPERT_COUNT_KEYS:
        value = getattr(text_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def check_is_moe(config, model_id: str) -> None:
    if routed_expert_count(config) == 0:
        raise FmoeError(
            f"{model_id} is a dense model ({config.model_type}: no routed experts); fmoe serves Mixture-of-Experts models only"
        )


def check_experts(experts: nn.Module, name: str) -> None:
    """Refuse expert variants whose split would not be exact (docs/architecture.md § The split expert)."""
    kind = type(experts).__name__
    if not hasattr(experts, "has_gate") or not hasattr(experts, "down_proj"):
        raise FmoeError(f"unsupported expert layout in {name} ({kind}): not a transformers fused-experts module")
    if not experts.has_gate or not hasattr(experts, "gate_up_proj"):
        raise FmoeError(f"unsupported expert layout in {name} ({kind}): experts without a gate projection")
    if experts.has_bias:
        raise FmoeError(f"unsupported expert layout in {name} ({kind}): experts with biases are not served yet")
    if getattr(experts, "has_post_expert_norm", False):
        raise FmoeError(f"unsupported expert layout in {name} ({kind}): a norm after each expert does not split by neuron")
    if type(experts)._apply_gate is not _default_apply_gate:
        raise FmoeError(
            f"unsupported expert layout in {name} ({kind}): a custom gate (clamp or interleaved gate/up) is not served yet"
        )
    if experts.gate_up_proj.dim() != 3 or experts.down_proj.dim() != 3:
        raise FmoeError(f"unsupported expert layout in {name} ({kind}): expected 3-D fused expert weights")


def router_matrix(router: nn.Module | None, experts: int) -> nn.Module | None:
    """The module whose `weight` [N, H] scores the N experts (what the predictors rank with): the router itself, or
    its one linear layer to N outputs (Hunyuan's `wg`, AFMoE's `gate`, Gemma 4's `proj`); None for a router without
    one (ZAYA's router MLP)."""
    if router is None:
        return None
    if isinstance(getattr(router, "weight", None), torch.Tensor) and router.weight.dim() == 2:
        return router
    linear = [m for m in router.children() if isinstance(m, nn.Linear) and m.out_features == experts]
    return linear[0] if len(linear) == 1 else None


def check_own_cache(model: nn.Module, model_id: str) -> None:
    """A family whose modeling file defines a KV cache class of its own (MiniMax's MiniMaxCache: its lightning
    attention's states beside the KV) refuses the DynamicCache and static cache fmoe generates with: one line."""
    from transformers.cache_utils import Cache

    module = sys.modules.get(type(model).__module__)
    own = [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, Cache)
           and v.__module__ == module.__name__] if module is not None else []
    if own:
        raise FmoeError(f"{model_id} ({model.config.model_type}) keeps its state in a cache of its own "
                        f"({own[0].__name__}), which fmoe's generation does not drive")


def find_moe_layers(model: nn.Module, model_id: str = "model") -> list[MoeLayer]:
    """Every routed-experts module with its router, in forward order."""
    check_own_cache(model, model_id)
    modules = dict(model.named_modules())
    layers: list[MoeLayer] = []
    for name, module in modules.items():
        if not name.endswith(".experts") or not hasattr(module, "down_proj"):
            continue
        block = modules[name.rsplit(".", 1)[0]]
        check_experts(module, name)
        experts = module.gate_up_proj.shape[0]
        gate = getattr(block, "gate", None) or getattr(block, "router", None)
        router = router_matrix(gate, experts)
        if router is None:
            raise FmoeError(f"unsupported MoE block in {name}: no router with a weight matrix to its {experts} experts")
        rows = router.weight.shape[0]
        bias = getattr(router, "e_score_correction_bias", None)
        if rows != experts and not (rows > experts and bias is not None and bias.shape[0] == experts):
            raise FmoeError(f"unsupported MoE block in {name}: its router scores {rows} experts, not its {experts}")
        match = re.search(r"layers\.(\d+)\.", name)
        decoder_index = int(match.group(1)) if match else len(layers)
        layers.append(MoeLayer(len(layers), name, decoder_index, module, router, gate if gate is not router else None))
    if not layers:
        raise FmoeError(f"{model_id}: found no routed experts to offload (dense model or unsupported family)")
    return layers
