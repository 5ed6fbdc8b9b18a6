"""The `moepic` policy's plan: the configurator (Algorithm 1) fed with timings and statistics.

`moepic_plan` is pure (numbers in, Plan out). The run set-up (fmoe_cli/run.py,
`find_timings`) finds the numbers for a loaded model before its engine is configured.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import replace

from fmoe_cli.planning.configurator import DEFAULT_ZETA, Configuration, Timings, vram_allocation
from fmoe_cli.planning.plan import check_budget, min_staging_slots, resident_if_fits
from fmoe_cli.types import ExpertShape, Plan
from fmoe_cli.planning.stats import RoutingStats


_REUSED: ContextVar[dict | None] = ContextVar("fmoe_reused_configurations", default=None)


@contextlib.contextmanager
def reused_configurations():
    """Within it, `moepic_configuration` runs once per distinct inputs (`fmoe plan` prices the configured plan for its
    report and again for its TPOT table: 0.25 s each on DeepSeek-V3's shape,
    27 s before its layers shared their tables; planning/configurator.py `_Tables`). The statistics are told apart by
    identity: they must not change inside (a command's one planning pass, not a chat that records routing)."""
    token = _REUSED.set({})
    try:
        yield
    finally:
        _REUSED.reset(token)


def moepic_configuration(
    shape: ExpertShape, budget_bytes: int, timings: Timings, stats: RoutingStats | None = None,
    *, zeta: float = DEFAULT_ZETA, model: str = "", host_lane: bool = False, min_predictions: int = 0,
) -> Configuration:
    """Spend `budget_bytes` (the policies' shared expert budget: staging pool U_b + caches V_e).

    stats None (or nothing recorded): uniform routing. The configurator's Y is capped at
    K, the engine's prefetch candidates per prediction (offload/prefetch.py). `host_lane`: the host path
    (misses and bottoms computed on the host) is a candidate in every layer, when the timings have the host's figures.
    `min_predictions`: a run's plan passes MIN_PREDICTIONS (planning/plan.py: plans without prefetch only once
    the predictor was seen, planning/configurator.py); `fmoe plan` prices every candidate (0).
    """
    reused = _REUSED.get()
    key = (shape, budget_bytes, timings, id(stats), zeta, model, host_lane, min_predictions)
    if reused is not None and key in reused:
        return reused[key]
    slots = min_staging_slots(shape)
    check_budget(shape, budget_bytes, slots)
    if stats is None or stats.tokens == 0:
        stats = RoutingStats.assume_uniform(model, shape.num_layers, shape.num_experts, shape.top_k)
    expert_budget = budget_bytes - slots * shape.expert_bytes  # V_e = budget − U_b
    config = vram_allocation(expert_budget, stats, timings, shape, zeta, staging_slots=slots,
                             max_prefetch=shape.top_k, host_lane=host_lane, min_predictions=min_predictions)
    config = replace(config, plan=resident_if_fits(config.plan, shape, budget_bytes))  # as settings_for runs it
    if reused is not None:
        reused[key] = config
    return config


def moepic_plan(shape: ExpertShape, budget_bytes: int, timings: Timings, stats: RoutingStats | None = None,
                **kwargs) -> Plan:
    """The configured plan (source "configurator": the bench and chat summaries show it)."""
    return moepic_configuration(shape, budget_bytes, timings, stats, **kwargs).plan
