"""The named policies of `fmoe bench --policy` and `fmoe chat --policy` (DESIGN §8).

All share one expert budget (bytes of device memory for cached experts plus the
staging pool), except `resident`, the everything-on-the-device reference.
"""

from __future__ import annotations

from fmoe_cli.errors import FmoeError
from fmoe_cli.offload.engine import EngineSettings
from fmoe_cli.planning.plan import resident_plan, uniform_plan
from fmoe_cli.types import ExpertShape, Plan

# name: (θ, eviction, prefetch, what it is)
PRESETS: dict[str, tuple[float, str, bool, str]] = {
    "moepic": (0.5, "lcp", True, "MoEpic: split experts, LCP, speculative prefetch, configured plan"),
    "uniform": (0.5, "lcp", True, "MoEpic without the configurator: V_e/L per layer, θ = 0.5"),
    "lru": (1.0, "lru", True, "whole experts, LRU, speculative prefetch (as Mixtral-offloading)"),
    "lfu": (1.0, "lfu", True, "whole experts, LFU (as MoE-Infinity's cache), speculative prefetch"),
    "cache-only": (1.0, "lcp", False, "whole experts, LCP, no prefetch (θ = 1)"),
    "prefetch-only": (0.0, "lcp", True, "no cache, speculative prefetch into the staging pool (θ = 0)"),
    "ondemand": (0.0, "lcp", False, "no cache, no prefetch: every expert loaded when routed"),
    "resident": (1.0, "lcp", False, "every expert on the device (reference; ignores the budget)"),
}


def make_settings(
    name: str,
    shape: ExpertShape,
    budget_bytes: int,
    *,
    theta: float | None = None,
    eviction: str | None = None,
    omega: float = 128.0,
    rho: float = 0.25,
    plan: Plan | None = None,
) -> EngineSettings:
    """Settings for a named policy. `plan` overrides the preset's plan (the configurator's, for moepic)."""
    if name not in PRESETS:
        raise FmoeError(f"unknown policy {name!r}; choose from {', '.join(PRESETS)}")
    if not omega > 0 or not 0 < rho < 1:
        raise FmoeError(f"LCP needs ω > 0 and 0 < ρ < 1, got ω = {omega:g}, ρ = {rho:g}")
    preset_theta, preset_eviction, prefetch, _ = PRESETS[name]
    if plan is None:
        if name == "resident":
            plan = resident_plan(shape)
        else:
            plan = uniform_plan(shape, budget_bytes, preset_theta if theta is None else theta, source=name)
    return EngineSettings(name, plan, eviction or preset_eviction, prefetch, omega, rho)
