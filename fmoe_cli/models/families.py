"""Find the routed experts of a transformers MoE model, and refuse what cannot be served exactly.

transformers 5 stores the routed experts of every MoE family as fused 3-D
parameters in a module decorated with `use_experts_implementation`; its parent
block exposes the router as `.gate`. Shared experts are ordinary modules and stay
resident.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, replace

import torch
from torch import nn
from transformers.integrations.moe import _default_apply_gate

from fmoe_cli.errors import FmoeError
from fmoe_cli.models.config import EXPERT_COUNT_KEYS
from fmoe_cli.prediction.base import group_limits, plain_router_choice
from fmoe_cli.types import MoeLayer, RouterChoice


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


@dataclass(frozen=True)
class RouterForm:
    """Where a family keeps what its router chooses its top-k with beyond its matrix (prediction/base.py RouterChoice's
    steps): attribute paths from the MoE block (the module holding `.experts`: Gemma 4's is the decoder layer)."""

    sigmoid: bool = False  # the top-k of sigmoid(z) (+ b), not of softmax(z)
    bias: str | None = None  # b, added for choosing only (absent on this checkpoint: none)
    bias_on_logits: bool = False  # the top-k of z + b
    softcap: str | None = None  # c: z = c · tanh(z / c) first (0: none)
    groups: str | None = None  # the router's num_group / topk_group limits, a group scored by its "best" expert or its
    # "two best" summed (None: as `plain_router_choice` reads them)
    grouped_if: tuple[str, str] | None = None  # (path, value): the group limits apply only when it holds
    masked_to_zero: bool = False  # the other groups' experts score 0, not below every chosen one
    input_scale: str | None = None  # s: the router norms and scales its input, x = h · (mean(h²) + ε)^-½ · s · root
    input_eps: str | None = None  # ε
    input_root: str | None = None  # root


# transformers 5.24's routers whose choice the router module alone does not show, by class (each modeling file's
# forward, read 29 Nov 2026). Every other MoE family fmoe serves chooses by softmax(z), or by a monotone function
# of z (sigmoid, z itself: Flint, Cohere2-MoE, Granite, Aria, Phi-3.5-MoE's sparsemixer), or has DeepSeek-V3's form on
# the router itself (sigmoid + its e_score_correction_bias, its group limits: DeepSeek-V3/V3.2, GLM-4.5, dots, EXAONE,
# Solar Open, MiMo-V2, AXK, Inkling), which `plain_router_choice` reads.
ROUTER_FORMS: dict[str, RouterForm] = {
    "AfmoeTokenChoiceRouter": RouterForm(sigmoid=True, bias="expert_bias"),  # the bias on the block
    "AXK2TopkRouter": RouterForm(sigmoid=True, bias="gate.e_score_correction_bias", groups="two best",
                                 masked_to_zero=True),
    "DeepseekV2TopkRouter": RouterForm(groups="best", grouped_if=("gate.topk_method", "group_limited_greedy")),
    "Ernie4_5_MoeTopKRouter": RouterForm(bias="gate.moe_statics.e_score_correction_bias"),  # softmax + b
    "Gemma4TextRouter": RouterForm(input_scale="router.scale", input_eps="router.norm.eps",  # its per_expert_scale:
                                   input_root="router.scalar_root_size"),  # the weights only
    "HYV3TopKRouter": RouterForm(sigmoid=True, bias="e_score_correction_bias"),  # the bias on the block
    "Kolibri1TopKRouter": RouterForm(bias="gate.e_score_correction_bias", bias_on_logits=True),  # sigmoid(z + b)
    "LagunaTopKRouter": RouterForm(sigmoid=True, bias="gate.e_score_correction_bias",
                                   softcap="gate.router_logit_softcapping"),
    "Lfm2MoeTopKRouter": RouterForm(sigmoid=True, bias="expert_bias"),  # on the block, where use_expert_bias
    "MiniMaxM2TopKRouter": RouterForm(sigmoid=True, bias="e_score_correction_bias"),  # the bias on the block
}


def router_choice(block: nn.Module, gate: nn.Module, matrix: nn.Module, experts: int) -> RouterChoice:
    """How a MoE block's router picks its top-k of `experts`: its `ROUTER_FORMS` entry (by the class of `gate`, the
    block's routing module) resolved on this block, else what the matrix's module shows (`plain_router_choice`).
    Called once per layer when the model is set up."""
    plain = plain_router_choice(matrix, experts)
    form = ROUTER_FORMS.get(type(gate).__name__)
    if form is None:
        return plain
    bias = attribute_path(block, form.bias)
    limited = form.groups is not None and (form.grouped_if is None
                                           or value_at(block, form.grouped_if[0]) == form.grouped_if[1])
    groups, chosen = group_limits(gate, experts) if limited else (0, 0)
    return replace(plain, sigmoid=form.sigmoid, bias=bias, bias_on_logits=form.bias_on_logits,
                   softcap=float(value_at(block, form.softcap) or 0.0), groups=groups, chosen_groups=chosen,
                   group_by_best=form.groups == "best", masked_to_zero=form.masked_to_zero,
                   input_scale=attribute_path(block, form.input_scale),
                   input_eps=float(value_at(block, form.input_eps) or 0.0),
                   input_root=float(value_at(block, form.input_root) or 1.0))


def attribute_path(root: nn.Module, path: str | None) -> tuple[nn.Module, str] | None:
    """'gate.moe_statics.e_score_correction_bias' -> (root.gate.moe_statics, 'e_score_correction_bias'), where it is
    a tensor; else None."""
    if path is None:
        return None
    owner_path, _, name = path.rpartition(".")
    owner = value_at(root, owner_path) if owner_path else root
    return (owner, name) if isinstance(getattr(owner, name, None), torch.Tensor) else None


def value_at(root, path: str | None):
    """root.a.b.c for path 'a.b.c' (None where a step is missing, or for no path)."""
    if path is None:
        return None
    value = root
    for step in path.split("."):
        value = getattr(value, step, None)
    return value


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
        layers.append(MoeLayer(len(layers), name, decoder_index, module, router, gate if gate is not router else None,
                               router_choice(block, gate, router, experts)))
    if not layers:
        raise FmoeError(f"{model_id}: found no routed experts to offload (dense model or unsupported family)")
    return layers
