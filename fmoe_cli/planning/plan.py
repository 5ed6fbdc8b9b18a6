"""Plans: how the expert budget is spent on the device (MoEpic §3.4 notation).

For every MoE layer i: V_i (bytes of top segments cached), C_i (experts cached),
θ_i = k_i / I (the split ratio; k_i top neurons per cached expert). Plus the staging
pool U_b: full-expert slots for bottoms and missed experts.

    U_n + Σ_i V_i + U_b + KV + workspace ≤ V        (DESIGN §4)

The engine takes a Plan; `uniform_plan` makes the configurator-free one and the
configurator (planning/configurator.py) makes the tuned one.
"""

from __future__ import annotations

import re
from fmoe_cli.errors import FmoeError
from fmoe_cli.types import MiB, ExpertShape, LayerPlan, Plan



def layer_plan(shape: ExpertShape, cache_size: int, theta: float) -> LayerPlan:
    k = shape.top_neurons(theta)
    cache_size = cache_size if k > 0 else 0
    return LayerPlan(cache_size * k * shape.neuron_bytes, cache_size, k, k / shape.intermediate)


def min_staging_slots(shape: ExpertShape) -> int:
    """Current and next layer: K slots each (DESIGN §4)."""
    return min(2 * shape.top_k, 2 * shape.num_experts)


def check_budget(shape: ExpertShape, budget_bytes: int, staging_slots: int) -> None:
    need = staging_slots * shape.expert_bytes
    if budget_bytes < need:
        raise FmoeError(
            f"VRAM budget {budget_bytes / MiB:.1f} MiB is too small: the staging pool alone needs "
            f"{staging_slots} expert slots × {shape.expert_bytes / MiB:.2f} MiB = {need / MiB:.1f} MiB"
        )


def uniform_plan(shape: ExpertShape, budget_bytes: int, theta: float = 0.5, source: str = "uniform") -> Plan:
    """MoEpic without the configurator: V_i = V_e / L for every layer, one θ."""
    slots = min_staging_slots(shape)
    check_budget(shape, budget_bytes, slots)
    if theta == 0.0:  # no cache: the whole budget is staging (prefetch-only)
        slots = max(slots, budget_bytes // shape.expert_bytes)
        return Plan(tuple(layer_plan(shape, 0, 0.0) for _ in range(shape.num_layers)), slots, shape.expert_bytes, source)
    per_layer = (budget_bytes - slots * shape.expert_bytes) // shape.num_layers  # V_i = V_e / L
    k = shape.top_neurons(theta)
    cache_size = min(shape.num_experts, per_layer // (k * shape.neuron_bytes))
    return Plan(tuple(layer_plan(shape, cache_size, theta) for _ in range(shape.num_layers)), slots, shape.expert_bytes, source)


def resident_plan(shape: ExpertShape) -> Plan:
    """Every expert whole on the device (no budget: the reference point)."""
    full = layer_plan(shape, shape.num_experts, 1.0)
    return Plan(tuple(full for _ in range(shape.num_layers)), 0, shape.expert_bytes, "resident", resident=True)


DEFAULT_BUDGET = "25%"  # bench and chat: a quarter of all routed experts' bytes

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(%|b|kib|mib|gib|tib|kb|mb|gb|tb|k|m|g|t)?\s*$", re.IGNORECASE)
_UNITS = {
    None: 1, "b": 1,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
    "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
}


def parse_budget(text: str, all_experts_bytes: int) -> int:
    """'6GiB', '512MiB', '1.5G', '25%' (of all routed experts' bytes) or plain bytes."""
    m = _SIZE.match(text)
    if not m:
        raise FmoeError(f"cannot read the budget {text!r}: use a size such as 6GiB or 512MiB, or a share such as 25%")
    value, unit = float(m.group(1)), (m.group(2) or "").lower() or None
    if unit == "%":
        if not 0 < value <= 100:
            raise FmoeError(f"a budget share must be in (0, 100]%, got {text!r}")
        return int(all_experts_bytes * value / 100)
    return int(value * _UNITS[unit])
