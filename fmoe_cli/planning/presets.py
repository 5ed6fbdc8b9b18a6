"""The named policies of `fmoe bench --policy` and `fmoe chat --policy`, as data.

A `Preset` is everything a policy is: its eviction policy, whether it prefetches, and
the function that makes its plan from one `PlanInputs` (the experts' shape, the
expert budget, the configurator's timings, the routing statistics). Nothing outside
this table looks at a policy's name to decide what to do.

All share one expert budget (bytes of device memory for cached experts plus the
staging pool), except `resident`, the everything-on-the-device reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from fmoe_cli.errors import FmoeError
from fmoe_cli.offload.policies import LCP_OMEGA, LCP_RHO
from fmoe_cli.planning.plan import MIN_PREDICTIONS, resident_if_fits, resident_plan, uniform_plan
from fmoe_cli.types import EngineSettings, ExpertShape, Plan, Timings

if TYPE_CHECKING:
    from fmoe_cli.planning.stats import RoutingStats


@dataclass(frozen=True)
class PlanInputs:
    """What a preset's plan is made from."""

    shape: ExpertShape
    budget_bytes: int  # the expert budget: staging pool U_b + caches V_e
    timings: Timings | None = None  # T_att, T_moe, T_head, T_load (a device profile, or measured)
    stats: RoutingStats | None = None  # routing statistics so far (None: uniform routing)
    model: str = ""  # the model id, for statistics made up when there are none
    theta: float | None = None  # θ of the fixed-split presets instead of their own (tests, benchmarks)
    # a run's plan drops prefetch only after this many decode tokens with a recorded prediction in every layer;
    # `fmoe plan`'s predictions, which run nothing, price every plan (0)
    min_predictions: int = MIN_PREDICTIONS


@dataclass(frozen=True)
class Preset:
    name: str
    eviction: str  # offload.policies.POLICIES
    prefetch: bool  # speculative prefetch into the staging pool
    description: str
    make_plan: Callable[[PlanInputs], Plan]
    # The plan reads timings and statistics: they are loaded or measured before the engine
    # is first configured, and the plan is made again from new statistics when the device
    # is idle (planning/replan.py).
    configured: bool = False
    # Where the budget holds every expert, run the resident plan instead (planning/plan.py `resident_if_fits`): the
    # caching policies; not those that study a fixed split or loading itself.
    resident_when_fits: bool = True


def _uniform(source: str, theta: float) -> Callable[[PlanInputs], Plan]:
    """V_e / L per layer at one θ (the preset's, unless the inputs give one)."""
    def make(inputs: PlanInputs) -> Plan:
        split = theta if inputs.theta is None else inputs.theta
        return uniform_plan(inputs.shape, inputs.budget_bytes, split, source=source)

    return make


def _configurator(inputs: PlanInputs) -> Plan:
    """MoEpic's configurator (Algorithm 1) on the timings and statistics."""
    if inputs.timings is None:
        raise ValueError("the configurator needs timings: PlanInputs.timings (run.find_timings finds them)")
    # The configurator (numpy) is imported when a plan is made, not with the table: the command line
    # reads the table for its help and checks, and answers a bad option before numpy is loaded.
    from fmoe_cli.planning.autoplan import moepic_plan

    t = inputs.timings
    # moepic may use the host lane where the host computes a whole expert faster than the link loads it
    return moepic_plan(inputs.shape, inputs.budget_bytes, t, inputs.stats, model=inputs.model,
                       host_lane=t.has_host and t.t_host_expert < t.t_load, min_predictions=inputs.min_predictions)


def _hybrid(inputs: PlanInputs) -> Plan:
    """The configurator with the host lane a candidate in every layer (docs/architecture.md § The host lane)."""
    if inputs.timings is None:
        raise ValueError("the configurator needs timings: PlanInputs.timings (run.find_timings finds them)")
    from fmoe_cli.planning.autoplan import moepic_plan  # numpy: when a plan is made (see _configurator)

    return moepic_plan(inputs.shape, inputs.budget_bytes, inputs.timings, inputs.stats, model=inputs.model,
                       host_lane=True)


def _resident(inputs: PlanInputs) -> Plan:
    return resident_plan(inputs.shape)


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("moepic", "lcp", True, "MoEpic: split experts, LCP, speculative prefetch, configured plan",
           _configurator, configured=True),
    Preset("hybrid", "lcp", True, "per layer, misses and bottoms fetched or computed on the host from RAM, "
           "whichever the configurator predicts faster (needs `fmoe profile`'s host figures)", _hybrid, configured=True),
    Preset("uniform", "lcp", True, "MoEpic without the configurator: V_e/L per layer, θ = 0.5",
           _uniform("uniform", 0.5), resident_when_fits=False),
    Preset("lru", "lru", True, "whole experts, LRU, speculative prefetch (as Mixtral-offloading)",
           _uniform("lru", 1.0)),
    Preset("lfu", "lfu", True, "whole experts, LFU (as MoE-Infinity's cache), speculative prefetch",
           _uniform("lfu", 1.0)),
    Preset("cache-only", "lcp", False, "whole experts, LCP, no prefetch (θ = 1)", _uniform("cache-only", 1.0)),
    Preset("prefetch-only", "lcp", True, "no cache, speculative prefetch into the staging pool (θ = 0)",
           _uniform("prefetch-only", 0.0), resident_when_fits=False),
    Preset("ondemand", "lcp", False, "no cache, no prefetch: every expert loaded when routed",
           _uniform("ondemand", 0.0), resident_when_fits=False),
    Preset("resident", "lcp", False, "every expert on the device (reference; ignores the budget)", _resident),
)}
DEFAULT_POLICY = "moepic"  # fmoe chat
# fmoe bench: the first is the base of the ratios; resident (the floor) only when it fits (RunOptions.if_fits)
DEFAULT_POLICIES = ("moepic", "lru", "resident")


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise FmoeError(f"unknown policy {name!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[name]


def parse_policies(policy: list[str] | tuple[str, ...] | None, compare: str | None = None) -> list[str]:
    """--policy P (repeatable) then --compare P1,P2 (or 'all'), in order, without repeats; each checked."""
    names: list[str] = list(policy or [])
    if compare is not None:
        parts = [p.strip() for p in compare.split(",") if p.strip()]
        if not parts:
            raise FmoeError("--compare takes policy names separated by commas, or 'all'")
        names += list(PRESETS) if parts == ["all"] else parts
    unique = list(dict.fromkeys(names)) or list(DEFAULT_POLICIES)
    for name in unique:
        preset(name)
    return unique


def settings_for(name: str, inputs: PlanInputs, *, omega: float = LCP_OMEGA, rho: float = LCP_RHO) -> EngineSettings:
    """The engine settings of a named policy: its plan made from `inputs` by the preset's function."""
    p = preset(name)
    plan = p.make_plan(inputs)
    if p.resident_when_fits and inputs.theta is None:  # (a θ asked for is a split to study, kept)
        plan = resident_if_fits(plan, inputs.shape, inputs.budget_bytes)
    return EngineSettings(name, plan, p.eviction, p.prefetch and plan.prefetch, omega, rho)


def make_settings(
    name: str,
    shape: ExpertShape,
    budget_bytes: int,
    *,
    timings: Timings | None = None,
    stats: RoutingStats | None = None,
    theta: float | None = None,
    eviction: str | None = None,
    omega: float = LCP_OMEGA,
    rho: float = LCP_RHO,
    plan: Plan | None = None,
) -> EngineSettings:
    """`settings_for` from loose inputs (tests, benchmarks); `plan` and `eviction` replace the preset's."""
    settings = settings_for(name, PlanInputs(shape, budget_bytes, timings, stats, theta=theta), omega=omega,
                            rho=rho) if plan is None else EngineSettings(name, plan, "", False, omega, rho)
    p = preset(name)
    return replace(settings, eviction=eviction or p.eviction, prefetch=p.prefetch and settings.plan.prefetch)
