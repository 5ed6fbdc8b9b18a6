"""The host lane in the planner (issue 24): the configurator's host path, the simulator's host-lane layers on a
virtual clock, llama.cpp's pattern, the `hybrid` preset, and the lane's pure decisions (offload/host.py)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from fmoe_cli.errors import FmoeError
from fmoe_cli.offload.cache import LayerCache
from fmoe_cli.offload.hits import classify
from fmoe_cli.offload.host import Fills, split_work
from fmoe_cli.offload.link import EmulatedLink, VirtualClock
from fmoe_cli.offload.policies import make_policy
from fmoe_cli.planning.configurator import LLAMA_CPP, host_baselines, price_plan, vram_allocation
from fmoe_cli.planning.plan import min_staging_slots
from fmoe_cli.planning.presets import PlanInputs, settings_for
from fmoe_cli.planning.simulate import Token, predict_policies, simulate_policy, stats_from
from fmoe_cli.planning.stats import RoutingStats
from fmoe_cli.types import EngineSettings, ExpertShape, LayerPlan, Plan, Timings

SHAPE = ExpertShape(6, 8, 2, 512, 1024, 2)
S_E = SHAPE.expert_bytes
LINK = 25e9


def timings(host_expert: float = 0.0, sync: float = 20e-6, call: float = 10e-6) -> Timings:
    t = Timings.from_link(t_att=2e-4, t_moe=4e-4, t_head=1e-3, top_k=2, expert_bytes=S_E, bandwidth=LINK)
    return replace(t, t_host_expert=host_expert, t_host_call=call if host_expert else 0.0,
                   t_host_sync=sync if host_expert else 0.0)


def routing(tokens: int = 150, seed: int = 0) -> list[list[Token]]:
    rng = random.Random(seed)
    weights = [8, 4, 2, 1, 1, 1, 1, 1]
    experts = range(SHAPE.num_experts)

    def two() -> tuple[int, ...]:
        first = rng.choices(experts, weights=weights)[0]
        second = rng.choices([e for e in experts if e != first], weights=[w for e, w in zip(experts, weights) if e != first])[0]
        return tuple(sorted((first, second)))

    return [[Token(tuple(two() for _ in range(SHAPE.num_layers))) for _ in range(tokens)]]


def test_no_host_figures_no_host_lane_and_a_plan_that_asks_for_it_is_refused():
    t = timings()
    stats = RoutingStats.assume_uniform("m", SHAPE.num_layers, SHAPE.num_experts, SHAPE.top_k)
    config = vram_allocation(8 * S_E, stats, t, SHAPE, host_lane=True)
    assert not any(c.host for c in config.split.layers)
    assert config.plan == vram_allocation(8 * S_E, stats, t, SHAPE).plan  # hybrid = moepic without host figures
    with pytest.raises(FmoeError, match="host"):
        price_plan(host_baselines(SHAPE, 12 * S_E)[LLAMA_CPP], stats, t, SHAPE)


def test_a_fast_host_takes_misses_and_bottoms_a_slow_one_does_not():
    stats = RoutingStats.assume_uniform("m", SHAPE.num_layers, SHAPE.num_experts, SHAPE.top_k)
    fast = vram_allocation(4 * S_E, stats, timings(host_expert=0.1 * timings().t_load), SHAPE, host_lane=True)
    assert all(c.host for c in fast.split.layers)
    slow = vram_allocation(4 * S_E, stats, timings(host_expert=50 * timings().t_load), SHAPE, host_lane=True)
    assert not any(c.host for c in slow.split.layers)
    # the plan carries each layer's path
    assert all(layer.host for layer in fast.plan.layers) and fast.plan.host_lane


def test_llama_cpp_pattern_priced_and_simulated_exactly():
    """Every routed expert on the host: each layer takes K·t_host(I) + s_host (no cache, nothing on the link)."""
    t = timings(host_expert=3e-4)
    plan = host_baselines(SHAPE, 12 * S_E)[LLAMA_CPP]
    stats = RoutingStats.assume_uniform("m", SHAPE.num_layers, SHAPE.num_experts, SHAPE.top_k)
    split = price_plan(plan, stats, t, SHAPE)
    lane = SHAPE.top_k * t.t_host_expert + t.t_host_sync
    assert [c.exposed for c in split.layers] == pytest.approx([lane - t.t_moe] * SHAPE.num_layers)
    settings = EngineSettings("llama.cpp", plan, "lcp", False, 128.0, 0.25)
    result = simulate_policy(SHAPE, settings, t, routing(20), bandwidth=LINK)
    assert result.tpot_s == pytest.approx(SHAPE.num_layers * (t.t_att + lane) + t.t_head)
    assert result.host_s_per_token == pytest.approx(SHAPE.num_layers * lane)
    assert result.bytes_per_token == 0 and result.hit_rate == 0


def test_a_host_layer_runs_device_and_host_at_once_and_fills_its_cache_off_the_critical_path():
    t = timings(host_expert=3e-4)
    k = SHAPE.intermediate  # whole experts cached
    layers = tuple(LayerPlan(2 * k * SHAPE.neuron_bytes, 2, k, 1.0, True) for _ in range(SHAPE.num_layers))
    plan = Plan(layers, min_staging_slots(SHAPE), S_E, "test")
    settings = EngineSettings("whole+host", plan, "lcp", False, 128.0, 0.25)
    same = [[Token(tuple((0, 1) for _ in range(SHAPE.num_layers)))] * 40]
    result = simulate_policy(SHAPE, settings, t, same, bandwidth=LINK)
    # after the first misses' tops landed, both experts are cached whole: device only, T_moe per layer
    assert result.hit_rate > 0.9
    assert result.tpot_s == pytest.approx(SHAPE.num_layers * (t.t_att + t.t_moe) + t.t_head)
    half = tuple(LayerPlan(layer.vram_bytes // 2, 2, k // 2, 0.5, True) for layer in layers)
    split = simulate_policy(SHAPE, replace(settings, plan=replace(plan, layers=half)), t, same, bandwidth=LINK)
    # top on the device, bottom on the host at the same time: the layer takes the longer, plus the round trip
    bottom = t.t_host(k // 2, k)
    device = 2 * (min(t.t_segment, t.t_exp) + (t.t_exp - min(t.t_segment, t.t_exp)) * 0.5)
    lane = max(device, 2 * bottom + t.t_host_sync)
    assert split.tpot_s == pytest.approx(SHAPE.num_layers * (t.t_att + lane) + t.t_head)


def test_hybrid_beats_lru_and_llama_cpp_when_the_host_is_as_fast_as_the_link():
    t = timings(host_expert=timings().t_load)
    seqs = routing()
    results = predict_policies(SHAPE, 10 * S_E, t, LINK, 0.0, sequences=seqs, policies=["hybrid", "moepic", "lru"],
                               plans={LLAMA_CPP: host_baselines(SHAPE, 10 * S_E)[LLAMA_CPP]})
    assert results["hybrid"].tpot_s < results["lru"].tpot_s
    assert results["hybrid"].tpot_s < results[LLAMA_CPP].tpot_s
    assert results["hybrid"].host_s_per_token > 0 and results["lru"].host_s_per_token == 0


def test_moepic_uses_the_host_only_where_it_computes_an_expert_faster_than_the_link_loads_it():
    stats = stats_from(routing(), SHAPE)
    slow_host = timings(host_expert=2 * timings().t_load)
    assert not settings_for("moepic", PlanInputs(SHAPE, 4 * S_E, slow_host, stats)).plan.host_lane
    fast_host = timings(host_expert=0.1 * timings().t_load)
    assert settings_for("moepic", PlanInputs(SHAPE, 4 * S_E, fast_host, stats)).plan.host_lane
    assert settings_for("hybrid", PlanInputs(SHAPE, 4 * S_E, fast_host, stats)).plan.host_lane


def test_split_work_and_one_fill_in_flight_per_layer():
    hits = classify([1, 2, 3, 5], {1: 0, 2: 1}, 64, 128, {})  # 1, 2 top hits; 3, 5 misses
    assert split_work(hits, None).split == (1, 2) and split_work(hits, None).host_whole == (3, 5)
    assert split_work(hits, 2).split == (1,) and split_work(hits, 2).host_whole == (2, 3, 5)  # its fill in flight
    whole = classify([1, 4], {1: 0}, 128, 128, {})
    assert split_work(whole, None).device_whole == (1,) and split_work(whole, None).host_whole == (4,)
    import torch

    clock = VirtualClock()
    link = EmulatedLink(1.0, 0.0, clock=clock)  # 1 GB/s
    cache = LayerCache(1, make_policy("lcp", 8))
    fills = Fills(2)
    rows = torch.empty(64, 3, 128, device="meta")
    assert fills.offer(0, 3, cache, link, lambda slot: rows, rows) == rows.nbytes
    assert fills.in_flight(0) == 3 and 3 in cache.cached()
    assert fills.offer(0, 5, cache, link, lambda slot: rows, rows) == 0  # one at a time
    assert fills.landed(0) is None
    clock.advance(1.0)
    assert fills.landed(0).expert == 3 and fills.in_flight(0) is None
