"""The `moepic` policy's plan: the configurator (Algorithm 1) fed with timings and statistics.

`moepic_plan` is pure (numbers in, Plan out). `engine_timings` finds the numbers for a
loaded model: the saved profile of this device and model if there is one, else a quick
measurement (a short prefill and two decode steps, each MoE layer timed alone with its
experts resident); T_load from the engine's link (an emulated link's own figures, else
a profile's fit or a few timed copies of expert-sized blocks).
"""

from __future__ import annotations

from fmoe_cli.planning.configurator import DEFAULT_ZETA, Configuration, Timings, vram_allocation
from fmoe_cli.planning.plan import check_budget, min_staging_slots
from fmoe_cli.types import ExpertShape, Plan
from fmoe_cli.planning.stats import RoutingStats


def moepic_configuration(
    shape: ExpertShape, budget_bytes: int, timings: Timings, stats: RoutingStats | None = None,
    *, zeta: float = DEFAULT_ZETA, prefetch_width: int | None = None, model: str = "",
) -> Configuration:
    """Spend `budget_bytes` (the policies' shared expert budget: staging pool U_b + caches V_e).

    stats None (or nothing recorded): uniform routing. The configurator's Y is capped at
    the engine's prefetch width (EngineSettings.prefetch_width, K by default).
    """
    slots = min_staging_slots(shape)
    check_budget(shape, budget_bytes, slots)
    if stats is None or stats.tokens == 0:
        stats = RoutingStats.assume_uniform(model, shape.num_layers, shape.num_experts, shape.top_k)
    expert_budget = budget_bytes - slots * shape.expert_bytes  # V_e = budget − U_b
    return vram_allocation(expert_budget, stats, timings, shape, zeta, staging_slots=slots,
                           max_prefetch=prefetch_width or shape.top_k)


def moepic_plan(shape: ExpertShape, budget_bytes: int, timings: Timings, stats: RoutingStats | None = None,
                **kwargs) -> Plan:
    """The configured plan (source "configurator": the bench and chat summaries show it)."""
    return moepic_configuration(shape, budget_bytes, timings, stats, **kwargs).plan


def link_fit_of(link, device, expert_bytes: int):
    """(LinkFit, what it is) for the engine's link: an emulated link's own figures, else a quick measurement."""
    from fmoe_cli.profiling.device import LinkPlan, fit_link, measure_link
    from fmoe_cli.profiling.files import LinkFit

    if getattr(link, "gbps", None):
        return LinkFit("emulated", link.gbps * 1e9, getattr(link, "latency_s", 0.0), (), link.label())
    sizes = (expert_bytes, 4 * expert_bytes, 16 * expert_bytes)
    samples = measure_link(device, LinkPlan(sizes, repeats=5, warmup=1))
    latency, bandwidth = fit_link(samples)
    return LinkFit("measured", bandwidth, latency, tuple(samples), f"quick measurement of {link.label()}")


def engine_timings(lm, engine, profile_path=None) -> Timings:
    """Timings for the configurator: the saved profile of this device and model, else a quick measurement.

    A quick measurement leaves the engine configured for on-demand loading: configure it afterwards.
    """
    from fmoe_cli.errors import FmoeError, warn
    from fmoe_cli.profiling.device import device_identity
    from fmoe_cli.profiling.files import Profile, default_profile_path, model_identity
    from fmoe_cli.profiling.run import model_timings

    emulated = bool(getattr(engine.link, "gbps", None))
    path = profile_path or default_profile_path(lm.model_id, model_path=lm.path, emulated=emulated)
    timings, link = None, None
    if path.exists():
        try:  # a profile of another device or model (or a damaged one) is not used: measure instead, and say so
            profile = Profile.load(path)
            profile.check_device(device_identity(lm.device))
            profile.check_model(model_identity(lm.model_id, lm.path / "config.json"))
            timings, link = profile.model, profile.device.link
        except FmoeError as exc:
            warn(f"not using the saved profile: {exc}; timing the layers quickly instead")
            timings = None
    if timings is None:
        timings = model_timings(lm, engine, prefill_len=8, quick=True)
    if emulated or link is None or link.kind == "emulated":  # the link the engine really uses
        link = link_fit_of(engine.link, lm.device, lm.shape.expert_bytes)
    return timings.timings(link, lm.shape.expert_bytes)
