"""MoEpic's configurator: hand-computed cases and invariants (docs/architecture.md § Statistics, configurator, re-planning)."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fmoe_cli.errors import FmoeError
from fmoe_cli.offload.cache import rebuild_order
from fmoe_cli.offload.policies import LCP, LCP_OMEGA, LCP_RHO
from fmoe_cli.planning.configurator import (
    ALGORITHM_1,
    DeviceBudget,
    Timings,
    expert_split,
    replan_due,
    vram_allocation,
)
from fmoe_cli.types import ExpertShape
from fmoe_cli.planning.stats import LayerStats, RoutingStats, lcp_ranking

# N = 2 experts, K = 1, I = 4 neurons, H = 1, 1 byte per weight: a neuron is 3 bytes,
# an expert S_e = 12 bytes, neuron blocks of 1 (I is too small for 16/64).
TINY = ExpertShape(num_layers=1, num_experts=2, top_k=1, hidden=1, intermediate=4, dtype_bytes=1)


def layer(rank_hist, predicted_hist=None, predicted_rank_hist=None, predicted_tokens=0,
          predicted_active_rank_hist=None) -> LayerStats:
    """Hand-made statistics of top-1 routing. Without the joint count (`predicted_active_rank_hist`, PAH_i) the y-th
    predicted expert's activation is independent of where it stood: PAH_i(y, C) = P_i(y)·PH_i(y, C), MoEpic's Eq. 9
    (the hand cases below were computed with it); every count is then scaled by the least integer that makes that
    product whole (the curves are ratios: the same)."""
    n = len(rank_hist)
    pred = np.array(predicted_hist if predicted_hist is not None else [0] * n, dtype=np.int64)
    ranks = np.array(predicted_rank_hist if predicted_rank_hist is not None else [[0] * n] * n, dtype=np.int64)
    rank = np.array(rank_hist, dtype=np.int64)
    tokens, scale = int(sum(rank_hist)), 1
    if predicted_active_rank_hist is not None:
        active = np.array(predicted_active_rank_hist, dtype=np.int64)
    elif predicted_tokens:
        scale = math.lcm(*(Fraction(int(p) * int(r), predicted_tokens).denominator for p, row in zip(pred, ranks)
                           for r in row))
        active = pred[:, None] * ranks * scale // predicted_tokens
    else:
        active = np.zeros((n, n), dtype=np.int64)
    return LayerStats(n, 1, rank * scale, pred * scale, ranks * scale, tokens=tokens * scale,
                      predicted_tokens=predicted_tokens * scale, predicted_active_rank_hist=active)


def stats_of(*layers: LayerStats) -> RoutingStats:
    return RoutingStats("tiny", 2, 1, list(layers))


# q = 4 tokens: H(1) = 3/4, H(2) = 1; P(1) = 3/4, P(2) = 1/4; PH(y, 1) = 1/2, PH(y, 2) = 1.
PREDICTABLE = dict(rank_hist=[3, 1], predicted_hist=[3, 1], predicted_rank_hist=[[2, 2], [2, 2]], predicted_tokens=4)


def test_expert_split_one_layer_by_hand():
    """V_1 = 6 bytes, T_att = 1, T_moe = 1 (T_exp = 1), T_head = 2, T_load = 4.

    T_wind^1 = T_head + T_att = 3.
    C=0: θ=0, prefetch costs 4 > 3 → Y=0, m=0.
    C=1: k = 6//3 = 2, θ = 1/2. K·H(1)·θ = 3/4·1/2 = 0.375. Each prefetch loads
         1 − PH(y,1)·θ = 3/4 of an expert: 3 s ≤ 3 → Y=1; m = 0.375 + 3/4·P(1) = 0.375 + 0.5625 = 0.9375.
    C=2: k = 6//6 = 1, θ = 1/4. K·H(2)·θ = 0.25; share 1 − 1·1/4 = 3/4 → Y=1; m = 0.25 + 0.5625 = 0.8125.
    → C=1, θ=1/2, V used 1·2·3 = 6. m = 0.9375 is the mean over tokens (hidden_distribution): the landed
      prefetch's gain, 0.5625, splits into misses, (1 − PH(1,1))·P(1) = 0.375, more than the 1 − H(1) = 0.25 misses
      there are (products of marginals), so every miss is covered (q_miss = 1), and the rest, 0.3125, into bottoms:
      of the K·H(1)·(1 − θ) = 0.375 units of them, q_bottom = 5/6. Per token (T_exp = 1):
        a hit whose bottom was prefetched (3/4·5/6): m = 1, nothing to load: S ≤ 0
        a hit whose bottom was not (3/4·1/6): m = 1/2, S = 1/2·4 − 1/2·1 = 1.5
        a miss (1/4), prefetched: m = 1: S ≤ 0
      T^1 = 3/4·1/6·1.5 = 0.1875 (the closed form at the mean: max(0, 0.0625·4 − 0.9375·1) = 0);
      B_1 = (1 − 0.9375)·4 = 0.25 (linear in m: its mean), T_wind^2 = T_moe + T^1 − B_1 + T_att = 1 + 0.1875 − 0.25 + 1
      = 1.9375.
    """
    timings = Timings(t_att=1.0, t_moe=1.0, t_head=2.0, t_load=4.0, top_k=1)
    split = expert_split([6], stats_of(layer(**PREDICTABLE)), timings, TINY)
    (c,) = split.layers
    assert (c.cache_size, c.top_neurons, c.split, c.vram_bytes, c.prefetches) == (1, 2, 0.5, 6, 1)
    assert c.hidden == pytest.approx(0.9375)
    assert c.exposed == pytest.approx(3 / 4 * 1 / 6 * 1.5)
    assert c.window == pytest.approx(3.0)
    assert c.hit_rate == pytest.approx(0.75)


def test_expert_split_window_recursion_by_hand():
    """Two such layers, 6 bytes each: layer 2 sees T_wind^2 = 1.9375 (above).

    C=1: a prefetch costs 3 > 1.9375 → Y=0, m = 0.375.   C=2: m = 0.25.   C=0: m = 0.
    → C=1: a hit (3/4) has m = 1/2, S = 1/2·4 − 1/2·1 = 1.5; a miss (1/4) m = 0, S = 4: every token stalls, S is
      linear in m, and T^2 = 3/4·1.5 + 1/4·4 = 2.125, the closed form at the mean: (1 − 0.375)·4 − 0.375·1.
      Total exposed 0.1875 + 2.125.
    """
    shape = ExpertShape(2, 2, 1, 1, 4, 1)
    timings = Timings(t_att=1.0, t_moe=1.0, t_head=2.0, t_load=4.0, top_k=1)
    split = expert_split([6, 6], stats_of(layer(**PREDICTABLE), layer(**PREDICTABLE)), timings, shape)
    first, second = split.layers
    assert second.window == pytest.approx(1 + 0.1875 - 0.25 + 1)
    assert (second.cache_size, second.prefetches) == (1, 0)
    assert second.hidden == pytest.approx(0.375)
    assert second.exposed == pytest.approx(3 / 4 * 1.5 + 1 / 4 * 4)
    assert split.total_exposed == pytest.approx(0.1875 + 2.125)
    plan = split.to_plan(shape, staging_slots=2)
    assert plan.source == "configurator" and plan.cache_bytes == 12


def test_vram_allocation_by_hand():
    """Layer A routes uniformly (H(1) = 1/2), layer B always picks one expert (H(1) = 1).

    No predictions recorded → uniform P, PH. T_att = T_head = 0, T_moe = 1, T_load = 10:
    the windows (≤ 1 s) never fit a useful prefetch, so m_i = K·H_i(C)·θ_i and
    T^i = max(0, 10 − 11·m_i).  V_e = 36, ζ = 1/6 → moves of 6 bytes.

    Start uniform, 18 each:
      A: C=1 → k=4, θ=1, m=0.5;  C=2 → k=3, θ=3/4, m=0.75 → C=2, T=1.75
      B: C=1 → θ=1, m=1 → T=0.                                   total 1.75
    Iteration 1: losses: A at 12 → m=0.5, T=4.5 (+2.75); B at 12 → still θ=1, m=1 (+0) → donor B.
      gains: A at 24 → C=2, θ=1, m=1, T=0 (−1.75) → recipient A.
      [24, 12] → total 0 < 1.75: accept.
    Iteration 2: gains are all 0; donor A (+1.75 vs B's +4.5), recipient B → [18, 18] gives
      1.75 ≥ 0: roll back, stop.  Result A: C=2, θ=1 (24 bytes), B: C=1, θ=1 (12 bytes).
    """
    shape = ExpertShape(2, 2, 1, 1, 4, 1)
    timings = Timings(t_att=0.0, t_moe=1.0, t_head=0.0, t_load=10.0, top_k=1)
    stats = stats_of(layer([1, 1]), layer([10, 0]))
    config = vram_allocation(36, stats, timings, shape, zeta=1 / 6)
    assert config.history == pytest.approx((1.75, 0.0))
    assert config.iterations == 1
    a, b = config.plan.layers
    assert (a.cache_size, a.top_neurons, a.vram_bytes) == (2, 4, 24)
    assert (b.cache_size, b.top_neurons, b.vram_bytes) == (1, 4, 12)
    assert config.hit_rates == pytest.approx((1.0, 1.0))
    assert config.total_exposed == 0.0
    assert [c.budget for c in config.split.layers] == [24, 12]


def test_uniform_stats_keep_uniform_budgets():
    """Identical statistics: the layers that see alike windows keep alike budgets. Layer 1's window, T_head + T_att,
    is the widest (more of its prefetches land), so it may give budget to the others, never take it."""
    shape = ExpertShape(4, 8, 2, 64, 256, 2)
    timings = Timings.from_link(t_att=1e-4, t_moe=2e-4, t_head=3e-4, top_k=2, expert_bytes=shape.expert_bytes, bandwidth=1e9)
    stats = RoutingStats.assume_uniform("m", 4, 8, 2)
    budget = 3 * shape.expert_bytes * 4
    config = vram_allocation(budget, stats, timings, shape)
    assert config.uniform_routing
    first, *rest = (c.budget for c in config.split.layers)
    assert len(set(rest)) == 1 and first <= rest[0]


def test_timings_from_link():
    t = Timings.from_link(t_att=1.0, t_moe=4.0, t_head=2.0, top_k=2, expert_bytes=10**9, bandwidth=25e9, latency=1e-5)
    assert t.t_exp == 2.0
    assert t.t_load == pytest.approx(0.04001)
    with pytest.raises(FmoeError):
        Timings(-1.0, 1.0, 1.0, 1.0, 1)


def test_device_budget_refuses_with_numbers():
    mib = 1024**2
    ok = DeviceBudget(total=1000 * mib, non_expert=500 * mib, staging=100 * mib, kv_cache=100 * mib, workspace=100 * mib)
    assert ok.expert_budget == 200 * mib
    bad = DeviceBudget(total=500 * mib, non_expert=500 * mib, staging=100 * mib, kv_cache=0, workspace=0)
    with pytest.raises(FmoeError, match="short by 100 MiB"):
        bad.check()


def test_replan_and_rebuild_helpers():
    assert not replan_due(4999, True) and replan_due(5000, True) and not replan_due(10**6, False)
    policy = LCP(4)
    for step, e in enumerate([2, 2, 1, 3, 2]):
        policy.touch(e, step)
    plan_layer = vram_allocation(10**6, RoutingStats.assume_uniform("m", 1, 4, 1), Timings(0, 1, 0, 1, 1), ExpertShape(1, 4, 1, 1, 4, 1)).plan.layers[0]
    assert rebuild_order(lcp_ranking(policy, 5), plan_layer) == [2, 3, 1, 0][: plan_layer.cache_size]


# --- invariants ------------------------------------------------------------------
def synthetic_stats(seed: int, layers: int, n: int, k: int, tokens: int = 40) -> RoutingStats:
    """Recorded from simulated routing: per layer a different skew, an imperfect predictor."""
    rng = random.Random(seed)
    stats = RoutingStats.empty("synthetic", layers, n, k)
    for i in range(layers):
        skew = rng.uniform(0.0, 3.0)
        weights = [1.0 / (1 + e) ** skew for e in range(n)]
        rng.shuffle(weights)
        policy = LCP(n)
        for step in range(tokens):
            active: list[int] = []
            while len(active) < k:
                e = rng.choices(range(n), weights)[0]
                if e not in active:
                    active.append(e)
            predicted = sorted(range(n), key=lambda e: -(weights[e] * rng.uniform(0.5, 1.5) + (e in active) * rng.random()))
            stats.observe(i, active, lcp_ranking(policy, step), predicted)  # MoEpic's H_i(C): the C highest priorities
            for e in active:
                policy.touch(e, step)
    return stats


cases = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31),
    "layers": st.integers(1, 5),
    "n": st.integers(2, 8),
    "k_frac": st.floats(0, 1),
    "intermediate": st.sampled_from([4, 16, 128, 1024]),
    "budget_experts": st.floats(0.0, 1.5),  # V_e as a share of all experts' bytes
    "zeta": st.sampled_from([0.01, 0.05, 0.2]),
    "t_load": st.floats(0.1, 10.0),
    "t_moe": st.floats(0.05, 4.0),
    "t_att": st.floats(0.0, 3.0),
    "t_head": st.floats(0.0, 3.0),
})


def build(case):
    k = 1 + int(case["k_frac"] * (case["n"] - 1))
    shape = ExpertShape(case["layers"], case["n"], k, 2, case["intermediate"], 1)
    timings = Timings(case["t_att"], case["t_moe"], case["t_head"], case["t_load"], k)
    stats = synthetic_stats(case["seed"], case["layers"], case["n"], k)
    budget = int(case["budget_experts"] * shape.all_experts_bytes)
    return shape, timings, stats, budget


@settings(max_examples=40, deadline=None)
@given(case=cases)
def test_allocation_invariants(case):
    shape, timings, stats, budget = build(case)
    config = vram_allocation(budget, stats, timings, shape, zeta=case["zeta"])
    assert sum(c.budget for c in config.split.layers) <= budget  # Σ V_i ≤ V_e
    assert config.plan.cache_bytes <= budget
    for c, p in zip(config.split.layers, config.plan.layers):
        assert c.vram_bytes <= c.budget
        assert 0 <= p.cache_size <= shape.num_experts  # C_i ≤ N
        if p.cache_size:
            assert 0 < p.split <= 1  # θ_i ∈ (0, 1]
            assert p.top_neurons % shape.neuron_block == 0  # whole neuron blocks
            assert shape.top_neurons(p.split) == p.top_neurons
            assert p.vram_bytes == p.cache_size * p.top_neurons * shape.neuron_bytes
        else:
            assert p.vram_bytes == 0
        assert 0 <= c.hidden <= shape.top_k and c.exposed >= 0
    history = config.history
    assert all(b < a for a, b in zip(history, history[1:]))  # never rises (strictly falls while it runs)
    assert config.iterations == len(history) - 1 < 100_000  # terminated by the rule, not the cap
    if config.chosen == ALGORITHM_1:
        assert config.total_exposed == pytest.approx(history[-1])
    else:  # a baseline (uniform_plan spreads whole experts over layers) priced strictly lower
        assert config.total_exposed < history[-1]


@settings(max_examples=40, deadline=None)
@given(case=cases, more=st.floats(0.0, 1.0))
def test_more_budget_never_predicts_more_exposed_latency(case, more):
    """One MoE layer: more V_e → a superset of (C, θ) candidates (every k ≤ k_max per C, while
    I / block ≤ MAX_COLUMNS / (N + 1)) → never more exposed latency.

    With several layers the paper's model does not promise this (see the next test), so
    the property is stated where it holds; 400 random multi-layer cases showed no violation.
    """
    case = {**case, "layers": 1}
    shape, timings, stats, budget = build(case)
    larger = budget + int(more * shape.all_experts_bytes)
    small = vram_allocation(budget, stats, timings, shape, zeta=case["zeta"])
    large = vram_allocation(larger, stats, timings, shape, zeta=case["zeta"])
    assert large.total_exposed <= small.total_exposed + 1e-9


def test_more_budget_never_forces_a_larger_split():
    """Found by hypothesis when the layer search priced only the largest k_i that fits V_i / C:
    with the wrong-prefetch charge R_i a larger θ_i can lower m_i, and one layer at 292 bytes
    (C = 2, k = 16) was priced 0.0425 s against 0.0161 s at 172 bytes (C = 2, k = 14). Every
    k ≤ k_max is a candidate now. Priced per token (K = 1, T_load = 3, T_wind = 1.5; the statistics: H(2) = H(3) =
    0.875, P = (0.775, 0.2), PH(·, 2) = (1, 0.825), and the joint count PAH(·, 2) = (0.775, 0.1): the first predicted
    expert, when activated, was always cached): θ = 14/16, both prefetches land ((1 − θ)·3 + (1 − 0.825·θ)·3 = 1.209
    ≤ 1.5), m = 0.765625 + (0.775 − 0.775·θ) + (0.2 − 0.1·θ) = 0.975. The gain covers 0.775·(1 − θ) + 0.1·(1 − θ) =
    0.109375 of bottoms, every one the hits have, and 0.2 − 0.1 = 0.1 of the 0.125 misses, q_miss = 0.8. Hits wait for
    nothing; a miss not covered waits its load: T = 0.125·(1 − 0.8)·3 = 0.075. Whole tops (θ = 1) hide as much: m =
    0.875 + 0 + 0.1, and the larger budget caches them, C = 3 (a tie: the most bytes cached). (With Eq. 9's product,
    (1 − PH·θ)·P, θ = 14/16 was priced 0.245625 and kept at the larger budget: the product credited the first
    predicted expert's bottom at 0.94 where the hits have 0.875.)"""
    case = {"seed": 350, "layers": 1, "n": 5, "k_frac": 0.0, "intermediate": 16, "budget_experts": 0.359375,
            "zeta": 0.01, "t_load": 3.0, "t_moe": 0.25, "t_att": 0.0, "t_head": 1.5}
    shape, timings, stats, budget = build(case)
    small = vram_allocation(budget, stats, timings, shape, zeta=0.01)
    large = vram_allocation(budget + int(0.25 * shape.all_experts_bytes), stats, timings, shape, zeta=0.01)
    assert small.total_exposed == pytest.approx(0.125 * (1 - 0.8) * 3)
    assert large.total_exposed == pytest.approx(0.125 * (1 - 0.8) * 3)
    (layer,) = small.split.layers
    assert (layer.top_neurons, layer.cache_size) == (14, 2)
    (layer,) = large.split.layers
    assert (layer.top_neurons, layer.cache_size) == (16, 3)


def test_more_budget_can_predict_more_with_several_layers():
    """A limitation of ExpertSplit + Algorithm 1 from the uniform start (found by hypothesis), pinned here,
    and what the search from the per-layer optimum makes of it.

    Layer 1 with more budget maximises its own m_1 (Eq. 11) and so shrinks T_wind^2 (Eq. 7):
    layer 2 loses its one prefetch. And Algorithm 1's 1-byte moves (ζ·V_e) cannot cross a
    neuron (6 bytes), so the search stays at the uniform start.
    K = 1, T_exp = 2, T_load = 4, T_wind^1 = 1.5; the statistics (seed 8): layer 1 H(1) = 0.65, layer 2 H(1) = 0.6,
    P(1) = 0.875 in both, PH(1, 1) = 0.775 and 0.725, PAH(1, 1) = 0.65 and 0.6 (the first predicted expert is cached
    whenever a token hits). Neither layer's window lands a prefetch in layer 1
    (C = 1: (1 − 0.775·θ)·4 ≥ 2.45 > 1.5), so every token stalls there, a hit at θ: S = (1 − θ)·4 − θ·2, a miss 4.
    30 bytes: [15, 15] (C = 1, θ = 1/2 each; C = 2 holds θ = 1/4 only, m 0.25 < 0.325):
      layer 1: 0.65·(2 − 1) + 0.35·4 = 2.05; B_1 = (1 − 0.325)·4 = 2.7, T_wind^2 = 2 + 2.05 − 2.7 + 1 = 2.35;
      layer 2: a prefetch costs (1 − 0.725·0.5)·4 = 2.55 > 2.35: 0.6·(2 − 1) + 0.4·4 = 2.2.   Σ 4.25.
    24 bytes: [12, 12] is the same 4.25; moved to [11, 13]:
      layer 1, θ = 1/4: 0.65·(3 − 0.5) + 0.35·4 = 3.025; B_1 = (1 − 0.1625)·4 = 3.35, T_wind^2 = 2 + 3.025 − 3.35 + 1
      = 2.675 ≥ 2.55: layer 2's prefetch lands. m_2 = 0.6·0.5 + 0.875 − 0.6·0.5 = 0.875 (Eq. 9 from the joint count);
      its gain, 0.575, splits into 0.6·0.5 = 0.3 of bottoms, all there are, and 0.875 − 0.6 = 0.275 of the 0.4
      misses, q_miss = 0.6875. A hit's bottom is always prefetched (S ≤ 0); a miss not prefetched waits its load:
      0.4·(1 − 0.6875)·4 = 0.5.   Σ 3.525. (Eq. 9's product, 0.875·(1 − 0.725·0.5), credited 0.3171875 of bottoms,
      more than there are, and priced Σ 3.59375.)
    """
    case = {"seed": 8, "layers": 2, "n": 2, "k_frac": 0.0, "intermediate": 4, "budget_experts": 0.25,
            "zeta": 0.05, "t_load": 4.0, "t_moe": 2.0, "t_att": 1.0, "t_head": 0.5}
    shape, timings, stats, budget = build(case)
    small = vram_allocation(budget, stats, timings, shape, zeta=0.05, baselines=False)
    large = vram_allocation(budget + 6, stats, timings, shape, zeta=0.05, baselines=False)
    assert [c.budget for c in small.split.layers] == [11, 13]
    assert [c.budget for c in large.split.layers] == [15, 15]
    assert small.total_exposed == pytest.approx(0.65 * 2.5 + 0.35 * 4 + 0.4 * (1 - 0.275 / 0.4) * 4)
    assert large.total_exposed == pytest.approx(0.65 * 1 + 0.35 * 4 + 0.6 * 1 + 0.4 * 4)
    assert large.split.layers[1].window < small.split.layers[1].window  # the shrunken window
    searched = vram_allocation(budget + 6, stats, timings, shape, zeta=0.05)
    assert searched.total_exposed <= large.total_exposed  # the full search is never worse than Algorithm 1's


# --- the link is charged for every issued prefetch; the search contains its baselines ----------
from fmoe_cli.planning.configurator import (ALGORITHM_1, BASELINES, FROM_OPTIMUM, FROM_OPTIMUM_SILENT,  # noqa: E402
                                                 price_plan)
from fmoe_cli.planning.plan import uniform_plan  # noqa: E402


def test_host_work_per_loaded_segment_is_charged_and_can_favour_whole_experts():
    """V_i = 12 bytes (one whole expert, or two halves), no window (T_head = T_att = 0), T_load = 4,
    T_moe = 1. Ranks [1, 3]: H(1) = 1/4, H(2) = 1.

    C=1: θ = 1, m = 1/4; every activation but the whole hits is loaded: 3/4 segments.
    C=2: θ = 1/2, m = 1/2; a top hit still loads its bottom: 1 segment.
    h_load = 0 (Eq. 11, argmax m): C=2, T = (1 − 1/2)·4 − 1/2 = 1.5.
    h_load = 1: score m·T_load − loaded·h: C=1 1 − 0.75 = 0.25, C=2 2 − 1 = 1 → C=2, T = 1.5 + 1 = 2.5.
    h_load = 8: C=1 1 − 6 = −5, C=2 2 − 8 = −6 → C=1: a hit (1/4) has nothing to load (S ≤ 0), a miss (3/4) waits
      its load, S = 4: T = 3/4·4 + 0.75·8 = 9 (C=2 would be 9.5; the closed form at the mean m = 1/4 said
      0.75·4 − 0.25 + 6 = 8.75: a hit's compute does not hide another token's load);
      T_wind^2 = T_moe + T^1 − B_1 + T_att = 1 + 9 − 0.75·4 + 0 = 7.
    """
    stats = stats_of(layer([1, 3]), layer([1, 3]))
    shape = ExpertShape(2, 2, 1, 1, 4, 1)
    picked = {}
    for h in (0.0, 1.0, 8.0):
        timings = Timings(t_att=0.0, t_moe=1.0, t_head=0.0, t_load=4.0, top_k=1, t_host_load=h)
        first, second = expert_split([12, 12], stats, timings, shape).layers
        picked[h] = (first.cache_size, first.split, first.exposed)
        if h == 8.0:
            assert second.window == pytest.approx(7.0)
    assert picked[0.0] == (2, 0.5, pytest.approx(1.5))
    assert picked[1.0] == (2, 0.5, pytest.approx(2.5))
    assert picked[8.0] == (1, 1.0, pytest.approx(3 / 4 * 4 + 0.75 * 8))
    # c = 3 per split top hit (two segment forwards): C=2's top hits are every activation (H(2) = 1):
    # scores C=1 1, C=2 2 − 3 = −1 → C=1, T = 3/4·4 (the misses' loads; a hit waits for nothing)
    timings = Timings(t_att=0.0, t_moe=1.0, t_head=0.0, t_load=4.0, top_k=1, t_segment=3.0)
    first, _ = expert_split([12, 12], stats, timings, shape).layers
    assert (first.cache_size, first.split, first.exposed) == (1, 1.0, pytest.approx(3 / 4 * 4))


def test_admission_copies_are_charged_and_can_favour_a_split_or_no_cache():
    """V_i = 12 bytes, no window, T_load = 4, T_moe = 1. Ranks [3, 1]: H(1) = 3/4, H(2) = 1.

    C=1 (θ = 1): m = 3/4, loads 1/4, admits 1/4 whole tops per token.
    C=2 (θ = 1/2): m = 1/2, loads 1 (every bottom), admits nothing (H(2) = 1: no miss).
    C=0: m = 0, loads 1.
    a_e = 0, h_load = 0: C=1: a hit (3/4) loads nothing, a miss (1/4) waits its load: T = 1/4·4 = 1
      (the closed form at the mean m = 3/4: 1/4·4 − 3/4 = 0.25).
    a_e = 20: scores C=1 3 − 5 = −2, C=2 2, C=0 0 → C=2: every token hits its top (H(2) = 1) and loads its bottom:
      T = 1/2·4 − 1/2 = 1.5.
    a_e = 20, h_load = 10: C=1 3 − 2.5 − 5 = −4.5, C=2 2 − 10 = −8, C=0 −10 → C=1, T = 1 + 2.5 + 5 = 8.5.
    """
    stats = stats_of(layer([3, 1]))
    picked = {}
    for a_e, h in ((0.0, 0.0), (20.0, 0.0), (20.0, 10.0)):
        timings = Timings(t_att=0.0, t_moe=1.0, t_head=0.0, t_load=4.0, top_k=1, t_host_load=h, t_admit=a_e)
        (c,) = expert_split([12], stats, timings, TINY).layers
        picked[(a_e, h)] = (c.cache_size, c.split, c.exposed)
    assert picked[(0.0, 0.0)] == (1, 1.0, pytest.approx(1 / 4 * 4))
    assert picked[(20.0, 0.0)] == (2, 0.5, pytest.approx(1.5))
    assert picked[(20.0, 10.0)] == (1, 1.0, pytest.approx(1 / 4 * 4 + 1 / 4 * 10 + 1 / 4 * 20))



def test_a_cache_smaller_than_k_admits_only_into_its_unpinned_slots():
    """N = 4, K = 2, C = 1 whole expert (θ = 1), ranks [2, 2, 2, 2] over q = 4 tokens: H(1) = 2/8 = 1/4.
    A token's hits and each admitted miss stay pinned until the layer ends (offload/cache.py: admit), so a token
    admits min(K, C) − h of its K − h misses: 1 − 2·H(1) = 0.5 per token, not K·(1 − H) = 1.5.
    T_load = 4, T_exp = 1, no prefetch: m = K·H·θ = 0.5, n = 1.5 loads, S = max(4, 1.5·4 − 0.5·1) − 0.5·1 = 5;
    a_e = 10: G = 10·0.5 = 5 (was 15), T = 10 (was 20). The engine's cache admits as the model prices it."""
    from fmoe_cli.offload.cache import LayerCache
    from fmoe_cli.offload.policies import make_policy
    from fmoe_cli.planning.configurator import price_plan
    from fmoe_cli.types import LayerPlan, Plan

    shape = ExpertShape(1, 4, 2, 1, 4, 1)
    stats = RoutingStats("tiny", 4, 2, [LayerStats(4, 2, np.array([2, 2, 2, 2]), tokens=4)])
    timings = Timings(t_att=0.0, t_moe=2.0, t_head=0.0, t_load=4.0, top_k=2, t_admit=10.0)
    plan = Plan((LayerPlan(12, 1, 4, 1.0),), 4, 12, "test", prefetch=False)
    (c,) = price_plan(plan, stats, timings, shape, max_prefetch=0).layers
    assert c.hit_rate == pytest.approx(0.25) and c.exposed == pytest.approx(10.0)
    cache = LayerCache(1, make_policy("lcp", 4))  # the engine's admissions over a token of two misses
    cache.insert(0)
    for e in (1, 2):
        cache.pin(e)
    admitted = [cache.admit(e) is not None for e in (1, 2)]
    assert admitted == [True, False]  # the second miss finds only pinned experts: min(K, C) − h = 1


@settings(max_examples=200, deadline=None)
@given(top_k=st.integers(1, 8), cache_size=st.integers(0, 12), hit_share=st.floats(0, 1),
       theta=st.floats(0.01, 1), covered_misses=st.floats(0, 8), right_cached=st.floats(0, 8))
def test_a_tokens_hidden_units_average_to_the_closed_forms(top_k, cache_size, hit_share, theta, covered_misses,
                                                          right_cached):
    """The per-token distribution of hidden units (hits' tops, covered misses, covered bottoms) is a distribution
    over [0, K] whose mean is Eq. 9's m_i capped at K, whatever the statistics credit to misses and to bottoms (they
    may credit more than there are: the overflow moves to the other side), so B_i and a stall linear in m keep the
    closed form's price."""
    from fmoe_cli.planning.configurator import hidden_distribution

    hit = hit_share * min(top_k, cache_size) / top_k  # cache_hit_rate: K·H_i(C) ≤ min(K, C)
    hidden = min(top_k * hit * theta + covered_misses + right_cached * (1 - theta), top_k)  # Eq. 9, capped
    values, weights = hidden_distribution(top_k, cache_size, hit, theta, hidden, right_cached)
    assert weights.sum() == pytest.approx(1.0) and (weights >= -1e-15).all()
    assert values.min() >= 0 and values.max() <= top_k + 1e-12
    assert float(np.dot(values, weights)) == pytest.approx(hidden, abs=1e-9)
    # nothing random (no hit is in doubt, and no prefetch credit beyond rounding): one value, m_i. (A credit of 1e-9
    # is random: a bottom covered with probability 2e-9 puts that weight one bottom away, found by hypothesis once.)
    if hit in (0.0, 1.0) and abs(hidden - top_k * hit * theta) < 1e-12:
        assert float(weights[np.abs(values - hidden) < 1e-9].sum()) == pytest.approx(1.0)


def test_per_token_pricing_is_the_closed_form_where_the_stall_is_linear_or_nothing_stalls():
    """The closed form prices a layer at the mean m_i; per token the price differs only where S is not linear over the
    tokens' m (a token's S clipped at 0, a token with nothing to load, the first load against the next). N = 4, K = 2,
    T_exp = 1, T_load = 4, whole experts (θ = 1), no prefetch, uniform routing: H(C) = C/4.
      C = 1 (H = 1/4): a token hits at most one, so every token loads one or two; S = max(4, 8 − 1·1) − m = 7 − m is
        linear for n ≥ 1: per token h ~ Binomial(1, 1/2): 1/2·(4 − 1) + 1/2·7 = 5, the closed form at m = 1/2:
        max(4, 1.5·4 − 0.5·1) − 0.5 = 5.
      C = 4 (H = 1, everything cached): one value, m = 2: T = 0 either way.
      C = 2 (H = 1/2), T_load = 0.5, h_route = 3: the lead covers every token's loads (the worst, two misses: S =
        max(0.5, 1 − 1·1) − 3 < 0): nothing stalls, T = G = h_load·K·(1 − H) = 0.25·1, as the closed form.
      C = 2, T_load = 4, h_route = 0: the closed form at m = 1 says max(4, 4) − 1 = 3; per token (h ~ Binomial(2, 1/2))
        two hits stall 0, one 4 − 1 = 3, none max(4, 8 − 1) = 7: 1/2·3 + 1/4·7 = 3.25 (the hits' compute does not
        hide another token's load)."""
    from fmoe_cli.planning.configurator import price_plan
    from fmoe_cli.types import LayerPlan, Plan

    shape = ExpertShape(1, 4, 2, 1, 4, 1)
    stats = RoutingStats.assume_uniform("m", 1, 4, 2)

    def exposed(cache_size, t_load, **host):
        timings = Timings(t_att=0.0, t_moe=2.0, t_head=0.0, t_load=t_load, top_k=2, **host)
        plan = Plan((LayerPlan(12 * cache_size, cache_size, 4, 1.0),), 4, 12, "test", prefetch=False)
        return price_plan(plan, stats, timings, shape, max_prefetch=0).layers[0].exposed

    assert exposed(1, 4.0) == pytest.approx(1 / 2 * (4 - 1) + 1 / 2 * 7)
    assert exposed(1, 4.0) == pytest.approx(max(4, 1.5 * 4 - 0.5 * 1) - 0.5)
    assert exposed(4, 4.0) == 0.0
    assert exposed(2, 0.5, t_host_route=3.0, t_host_load=0.25) == pytest.approx(0.25 * 2 * (1 - 1 / 2))
    assert exposed(2, 4.0) == pytest.approx(1 / 2 * 3 + 1 / 4 * 7)


def test_a_cache_smaller_than_k_hits_c_of_k_of_what_the_tokens_experts_would():
    """K = 4: a cache of C < K slots holds C of the last token's experts (LCP always replaces; hits and admitted
    misses stay pinned), not the C of highest priority: H(C) = min(H(C), (C/K)·H(K)). H = 0.3, 0.5, 0.6, 0.7 for
    C = 1..4: C = 1 → min(0.3, 0.175), C = 2 → 0.35, C = 3 → 0.525; C ≥ K as recorded; uniform routing (C/N)
    unchanged."""
    from fmoe_cli.planning.configurator import cache_hit_rate

    hit = np.array([0.0, 0.3, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 1.0])
    assert cache_hit_rate(hit, np.arange(9), 4) == pytest.approx([0.0, 0.175, 0.35, 0.525, 0.7, 0.75, 0.8, 0.85, 1.0])
    uniform = np.arange(9) / 8
    assert cache_hit_rate(uniform, np.arange(9), 4) == pytest.approx(uniform)

def test_prefetch_host_work_is_charged_per_prefetching_layer():
    """No cache, T_wind^1 = 5, T_load = 4, PREDICTABLE: one prefetch lands, m = 0.75 (above): right for 3/4 of the
    tokens (nothing to load), wrong for 1/4 (one load after routing).
    h_pf is paid by a layer that prefetches, not by the same layer without prefetch (width 0:
    T = 4 − 0 = 4); the engine runs it while the layer's demand load is on the link, so it hides part of
    that load, for the tokens that have one: h_pf = 2 gives T = 1/4·(4 − 2) + 2 = 2.5, h_pf = 0.1 gives
    1/4·(4 − 0.1) + 0.1 = 1.075."""
    stats = stats_of(layer(**PREDICTABLE))
    for h_pf, exposed in ((2.0, 1 / 4 * (4 - 2) + 2), (0.1, 1 / 4 * (4 - 0.1) + 0.1)):
        timings = Timings(t_att=1.0, t_moe=1.0, t_head=4.0, t_load=4.0, top_k=1, t_host_prefetch=h_pf)
        (on,) = expert_split([0], stats, timings, TINY, max_prefetch=1).layers
        (off,) = expert_split([0], stats, timings, TINY, max_prefetch=0).layers
        assert (on.prefetches, on.exposed) == (1, pytest.approx(exposed))
        assert (off.prefetches, off.exposed) == (0, pytest.approx(4.0))


def test_loads_after_routing_are_pipelined_with_their_compute():
    """No cache, no prefetch, K = 2 (n = 2 loads), T_moe = 2 (T_exp = 1), T_att = 0.5.

    T_load = 4: the link is the bottleneck: S = max(4, 8 − 1·1) = 7 (the paper's Eq. 6: 8): the
    second load's transfer overlaps the first one's compute; T_wind^2 = 2 + 7 − 8 + 0.5 = 1.5.
    T_load = 0.5: the compute is: only the first load waits, S = max(0.5, 1 − 1) = 0.5 (Eq. 6: 1)."""
    shape = ExpertShape(2, 4, 2, 1, 4, 1)
    stats = RoutingStats.assume_uniform("m", 2, 4, 2)
    for t_load, exposed, window in ((4.0, 7.0, 1.5), (0.5, 0.5, 2.0 + 0.5 - 1.0 + 0.5)):
        timings = Timings(t_att=0.5, t_moe=2.0, t_head=0.0, t_load=t_load, top_k=2)
        first, second = expert_split([0, 0], stats, timings, shape, max_prefetch=0).layers
        assert (first.prefetches, first.hidden) == (0, 0.0)
        assert first.exposed == pytest.approx(exposed)
        assert second.window == pytest.approx(window)
    # the host's work per load (h_load 0.5) stretches the compute between loads, and the routing layout
    # before the first compute (h_route 0.3) overlaps the first load: S = max(4, 8 − 1·1.5) − 0.3 = 6.2,
    # T = S + G = 6.2 + 2·0.5
    timings = Timings(t_att=0.5, t_moe=2.0, t_head=0.0, t_load=4.0, top_k=2, t_host_load=0.5, t_host_route=0.3)
    first, _ = expert_split([0, 0], stats, timings, shape, max_prefetch=0).layers
    assert first.exposed == pytest.approx(7.2)


def test_submitting_a_layers_loads_hides_its_first_load():
    """No cache, no prefetch, K = 2 (n = 2 loads), T_moe = 2 (T_exp = 1), T_att = 0.5, h_load = 0.5 of which h_sub =
    0.4 is spent submitting a load: the engine submits both loads before it computes anything (offload/engine.py:
    _submit), so the first load is on the link while they are submitted.

    T_load = 0.5 (the compute is the bottleneck): the lead, 2·0.4, covers the first load: S = max(0.5, 1 − 1·1.1)
    − 0.8 < 0, T = 0 + G = 2·0.5 = 1.0 (submitted for free, as before: S = 0.5, T = 1.5).
    T_load = 4 (the link is): S = max(4, 8 − 1·(1 + 0.5 − 0.4)) − 0.8 = 6.1, T = 6.1 + 1.0 (before: 6.5 + 1.0);
    h_sub counts once per load: in the lead, not again in the compute between loads.
    h_sub above h_load (a noisy estimate) counts as h_load."""
    shape = ExpertShape(2, 4, 2, 1, 4, 1)
    stats = RoutingStats.assume_uniform("m", 2, 4, 2)
    for t_load, exposed, before in ((0.5, 1.0, 1.5), (4.0, 7.1, 7.5)):
        for h_sub, want in ((0.4, exposed), (0.0, before)):
            timings = Timings(t_att=0.5, t_moe=2.0, t_head=0.0, t_load=t_load, top_k=2, t_host_load=0.5,
                              t_host_submit=h_sub)
            first, _ = expert_split([0, 0], stats, timings, shape, max_prefetch=0).layers
            assert first.exposed == pytest.approx(want), (t_load, h_sub)
    capped = Timings(t_att=0.5, t_moe=2.0, t_head=0.0, t_load=4.0, top_k=2, t_host_load=0.5, t_host_submit=0.9)
    assert expert_split([0, 0], stats, capped, shape, max_prefetch=0).layers[0].exposed == pytest.approx(
        max(4.0, 8.0 - 1.0) - 2 * 0.5 + 2 * 0.5)


def test_a_right_prefetch_is_not_charged_its_submission_again():
    """h_pf (the engine's counter of the prefetch path) includes the prefetches' submissions; a right prefetch is then
    taken over by its layer, not submitted again (offload/engine.py: _submit), so its load costs h_load − h_sub
    more, not h_load. No cache, T_wind^1 = 5, T_load = 4, PREDICTABLE, h_load = 0.5 of which h_sub = 0.2, h_pf = 0.1.

    Width 1: the prefetch lands and is right with P(1) = 0.75: m = 0.75. A token it was right for loads nothing
    (S ≤ 0); one it was wrong for (1/4) submits its load: S = 4 − (0·1 + 1·0.2 + 0.1) = 3.7; G = 1·0.5 + 0.1 −
    0.75·0.2 = 0.45 (it was 0.6: the right prefetch's h_sub twice), T = 1/4·3.7 + 0.45.
    Width 2 (N = 2): the second is on the link when the layer routes, right with P(2) = 0.25 and taken over: a token
    with a load submits 1 − 0.25 of one (the take-over an expectation), so the lead loses 0.25·0.2, and G loses
    1.0·0.2 in all. R = (8 − 5)·(1 − 0.25) = 2.25, charged to the tokens with a load (1/4): S = max(2.25 + 4,
    2.25 + 4) − (0.75·0.2 + 0.1) = 6.0; G = 0.5 + 0.1 − 0.2; T = 1/4·6.0 + 0.4."""
    stats = stats_of(layer(**PREDICTABLE))
    timings = Timings(t_att=1.0, t_moe=1.0, t_head=4.0, t_load=4.0, top_k=1, t_host_load=0.5, t_host_submit=0.2,
                      t_host_prefetch=0.1)
    (one,) = expert_split([0], stats, timings, TINY, max_prefetch=1).layers
    assert (one.prefetches, one.hidden, one.exposed) == (1, pytest.approx(0.75), pytest.approx(1 / 4 * 3.7 + 0.45))
    (two,) = expert_split([0], stats, timings, TINY, max_prefetch=2).layers
    assert (two.prefetches, two.exposed) == (2, pytest.approx(1 / 4 * 6.0 + 0.4))
    # without prefetch nothing is taken over: every load submitted, h_load each (S = 4 − 0.2, G = 0.5)
    (off,) = expert_split([0], stats, timings, TINY, max_prefetch=0).layers
    assert off.exposed == pytest.approx(3.8 + 0.5)


def test_a_wrong_prefetch_on_the_link_is_charged():
    """No cache (V = 0), T_wind^1 = T_head + T_att = 5, T_load = 4, PREDICTABLE statistics.

    Eq. 10 alone (no width): one prefetch fits (4 ≤ 5): m = P(1) = 0.75; the tokens it was right for (3/4) load
    nothing, the others wait a load: T = 1/4·4 = 1 (the closed form at the mean: 0.25·4 − 0.75 = 0.25).
    The engine's width Y = 2: both are issued. The first lands in the window (m = 0.75); the second
    is on the link when the layer routes, 8 − 5 = 3 s from its end, and wrong with 1 − P(2) = 0.75:
    R = 2.25 s the demand loads wait behind: T = 1/4·(2.25 + 4) = 1.5625 (a token with nothing to load does not
    wait for the link); B_1 = R + 0.25·4 = 3.25 (the link's, whoever waits), T_wind^2 = T_moe + T^1 − B_1 + T_att =
    1 + 1.5625 − 3.25 + 1 = 0.3125. (A queued prefetch is cancelled for free.)
    """
    timings = Timings(t_att=1.0, t_moe=1.0, t_head=4.0, t_load=4.0, top_k=1)
    stats = stats_of(layer(**PREDICTABLE))
    (free,) = expert_split([0], stats, timings, TINY).layers
    assert (free.prefetches, free.hidden, free.exposed) == (1, pytest.approx(0.75), pytest.approx(1 / 4 * 4))
    shape = ExpertShape(2, 2, 1, 1, 4, 1)
    first, second = expert_split([0, 0], stats_of(layer(**PREDICTABLE), layer(**PREDICTABLE)), timings, shape,
                                 max_prefetch=2).layers
    assert (first.prefetches, first.hidden, first.exposed) == (2, pytest.approx(0.75), pytest.approx(1 / 4 * 6.25))
    assert second.window == pytest.approx(1 + 1.5625 - 3.25 + 1)


def _stats2(*layers):
    return RoutingStats("tiny", 2, 1, [layer(r, p, ph, predicted_tokens=sum(r)) for r, p, ph in layers])


SHAPE2 = ExpertShape(2, 2, 1, 1, 4, 1)  # two layers of TINY


def _is_baseline_plan(config, theta):
    base = uniform_plan(SHAPE2, config.expert_budget + config.plan.staging_slots * SHAPE2.expert_bytes, theta)
    return config.plan.layers == base.layers


def test_whole_experts_win_where_they_should():
    """Found by search: Algorithm 1's greedy moves end at Σ T = 5.5; whole experts at V_e/L per
    layer with prefetch price at 4.0 (cache only 5.5), so the configurator returns the θ = 1 plan (lru's)."""
    stats = _stats2(([1, 1], [2, 0], [[1, 1], [0, 2]]), ([1, 1], [2, 0], [[1, 1], [1, 1]]))
    timings = Timings(t_att=1.0, t_moe=1.0, t_head=1.0, t_load=4.0, top_k=1)
    config = vram_allocation(12, stats, timings, SHAPE2, zeta=0.25, max_prefetch=1)
    prices = dict(config.candidates)
    assert config.chosen == "whole experts (θ = 1)" and _is_baseline_plan(config, 1.0)
    assert config.plan.prefetch
    assert config.total_exposed == pytest.approx(4.0)
    assert config.total_exposed < min(prices[ALGORITHM_1], prices["cache only (θ = 1, no prefetch)"]) - 1
    assert all(layer.split == 1.0 for layer in config.plan.layers)


def test_a_plan_without_prefetch_wins_where_prefetch_only_costs():
    """The predictor's first choice is never activated (P(1) = 0): with Y = 1 every prefetch is link
    time wasted before the layer's own loads. The plan says prefetch=False and `moepic` then runs without it.
    K = 1, T_exp = 1, T_load = 4, V_e = 12 bytes (one whole expert); H(1) = 1/2 in layer 1, 2/3 in layer 2.
    Without prefetch every token of a layer with a top of θ stalls: a hit (1 − θ)·4 − θ·1, a miss 4.
      cache only (θ = 1, `uniform_plan` gives the one expert to layer 2): layer 1 4; layer 2, a hit loads
        nothing, a miss (1/3) waits its load: 4/3. Σ 16/3 (the closed form at the mean m said 4 + 2/3).
      the per-layer optimum without prefetch, [3, 9] bytes (θ = 1/4 and 3/4):
        layer 1: 1/2·(3 − 1/4) + 1/2·4 = 3.375; layer 2: 2/3·(1 − 3/4) + 1/3·4 = 1.5. Σ 4.875: split tops win,
        because a hit's compute hides its own bottom's load, never another token's."""
    stats = _stats2(([1, 1], [0, 2], [[0, 2], [0, 2]]), ([2, 1], [0, 3], [[0, 3], [0, 3]]))
    timings = Timings(t_att=0.0, t_moe=1.0, t_head=0.0, t_load=4.0, top_k=1)
    config = vram_allocation(12, stats, timings, SHAPE2, zeta=0.25, max_prefetch=1)
    prices = dict(config.candidates)
    assert config.chosen == FROM_OPTIMUM_SILENT and [c.budget for c in config.split.layers] == [3, 9]
    assert not config.plan.prefetch
    assert config.total_exposed == pytest.approx(1 / 2 * (3 - 1 / 4) + 1 / 2 * 4 + 2 / 3 * (1 - 3 / 4) + 1 / 3 * 4)
    assert prices["cache only (θ = 1, no prefetch)"] == pytest.approx(4 + 1 / 3 * 4)
    assert config.total_exposed < prices[ALGORITHM_1] - 5


def test_uniform_wins_where_it_should():
    """Found by search: θ = 0.5 at V_e/L per layer (`uniform`'s plan) prices at 5.0 against Algorithm 1's 7.25.
    K = 1, T_exp = 2, T_load = 4; `uniform_plan` puts the one half top (6 bytes) in layer 2.
      layer 1 (no cache): its prefetch, always right (P(1) = 1), does not land in T_wind^1 = 0.5 and is taken over:
        every token waits its load, T = 4 (a right prefetch charged its whole transfer); B_1 = 4,
        T_wind^2 = 2 + 4 − 4 + 0.5 = 2.5.
      layer 2 (C = 1, θ = 1/2, H(1) = 1/2): the prefetch, (1 − PH(1,1)·θ)·4 = 2 ≤ 2.5, lands; m = 0.25 + 0.5.
        The statistics make its 0.5 of gain all bottoms (PH(1, 1) = 1), 0.25 more than the hits have: every hit's
        bottom is covered and 0.25 of the 0.5 misses, q_miss = 1/2. A miss not covered waits its load: T = 0.5·0.5·4.
      Σ 5 (the closed form at the mean m said 4 + max(0, 0.25·4 − 0.75·2) = 4)."""
    stats = _stats2(([0, 2], [2, 0], [[1, 1], [1, 1]]), ([1, 1], [2, 0], [[2, 0], [0, 2]]))
    timings = Timings(t_att=0.5, t_moe=2.0, t_head=0.0, t_load=4.0, top_k=1)
    config = vram_allocation(6, stats, timings, SHAPE2, zeta=0.25, max_prefetch=1)
    assert config.chosen == "uniform (θ = 0.5)" and _is_baseline_plan(config, 0.5)
    assert config.total_exposed == pytest.approx(4 + 0.5 * 0.5 * 4)
    assert config.total_exposed < dict(config.candidates)[ALGORITHM_1] - 2


def test_prefetch_only_is_in_the_search():
    """A budget that holds no neuron block of any expert per layer: every candidate is C_i = 0 (the
    prefetch-only plan), priced alike; with consistent statistics the model never prices a cache
    above no cache (a cached top is a hit the prefetch need not load), so θ = 0 wins only here."""
    stats = _stats2(([2, 2], [3, 1], [[2, 2], [2, 2]]), ([3, 1], [3, 1], [[2, 2], [2, 2]]))
    timings = Timings(t_att=1.0, t_moe=1.0, t_head=1.0, t_load=4.0, top_k=1)
    config = vram_allocation(2, stats, timings, SHAPE2, max_prefetch=1)
    prices = dict(config.candidates)
    assert set(prices) == {ALGORITHM_1, *BASELINES, FROM_OPTIMUM, FROM_OPTIMUM_SILENT}
    assert all(layer.cache_size == 0 for layer in config.plan.layers)
    assert config.total_exposed == pytest.approx(min(prices.values()))
    assert prices["prefetch only (θ = 0)"] >= config.total_exposed


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_configurator_never_predicts_worse_than_a_baseline(data):
    """Whatever the statistics, the returned plan's predicted Σ T^i is the least of Algorithm 1's
    and every baseline's, each baseline priced as the preset's own plan would run."""
    n, k = 4, data.draw(st.integers(1, 2))
    shape = ExpertShape(3, n, k, 1, 64, 1)
    layers = []
    for _ in range(3):
        q = data.draw(st.integers(1, 8))
        rank = data.draw(st.lists(st.integers(0, q), min_size=n, max_size=n))
        pred = data.draw(st.lists(st.integers(0, q), min_size=n, max_size=n))
        ph = [data.draw(st.lists(st.integers(0, q // n + 1), min_size=n, max_size=n)) for _ in range(n)]
        joint = [[data.draw(st.integers(0, count)) for count in row] for row in ph]  # PAH_i ≤ PH_i
        layers.append(LayerStats(n, k, np.array(rank), np.array(pred), np.array(ph), tokens=q, predicted_tokens=q,
                                 predicted_active_rank_hist=np.array(joint)))
    stats = RoutingStats("m", n, k, layers)
    timings = Timings(t_att=data.draw(st.floats(0, 2)), t_moe=data.draw(st.floats(0.1, 2)), t_head=data.draw(st.floats(0, 2)),
                      t_load=data.draw(st.floats(0.1, 8)), top_k=k, t_host_load=data.draw(st.sampled_from([0.0, 0.5, 4.0])))
    budget = data.draw(st.integers(0, 3 * n * shape.expert_bytes))
    config = vram_allocation(budget, stats, timings, shape, zeta=0.1, max_prefetch=k)
    prices = dict(config.candidates)
    assert config.total_exposed <= min(prices.values()) + 1e-9
    for name, (theta, prefetch) in BASELINES.items():
        base = uniform_plan(shape, budget + 2 * k * shape.expert_bytes, theta)
        priced = price_plan(base, stats, timings, shape, max_prefetch=k if prefetch else 0)
        assert prices[name] == pytest.approx(priced.total_exposed)


def test_moepic_runs_without_prefetch_when_its_plan_says_so():
    from fmoe_cli.planning.presets import PlanInputs, settings_for

    from fmoe_cli.planning.plan import MIN_PREDICTIONS

    # test_a_plan_without_prefetch_wins_where_prefetch_only_costs' statistics, every count × 16: the same curves,
    # recorded over 32 and 48 decode tokens with a prediction (MIN_PREDICTIONS: the predictor is judged)
    stats = _stats2(([16, 16], [0, 32], [[0, 32], [0, 32]]), ([32, 16], [0, 48], [[0, 48], [0, 48]]))
    assert stats.predicted_tokens == MIN_PREDICTIONS == 32
    timings = Timings(t_att=0.0, t_moe=1.0, t_head=0.0, t_load=4.0, top_k=1)
    budget = 12 + 2 * SHAPE2.expert_bytes  # V_e = 12 bytes beside the 2-slot staging pool
    settings = settings_for("moepic", PlanInputs(SHAPE2, budget, timings, stats))
    assert not settings.plan.prefetch and not settings.prefetch
    assert settings_for("lru", PlanInputs(SHAPE2, budget, timings, stats)).prefetch  # lru's own plan prefetches
    # The same curves from 2 and 3 predictions: too few to judge the predictor by; prefetch stays on (the
    # predictor must run for its statistics to grow)
    few = _stats2(([1, 1], [0, 2], [[0, 2], [0, 2]]), ([2, 1], [0, 3], [[0, 3], [0, 3]]))
    assert settings_for("moepic", PlanInputs(SHAPE2, budget, timings, few)).prefetch


# --- the demo across links (issue 22 §5) ----------------------------------------------------------------------------
DEMO = ExpertShape(6, 16, 4, 256, 192, 4)  # the built-in demo: 6 MoE layers, 16 experts, top-4, I = 192, float32


def _demo_timings(gbps: float) -> Timings:
    """A quick estimate of the demo on this project's CPU, on the CPU-time clock (FMOE_EMULATED_CLOCK=cpu,
    2026-11-26), on an emulated link of `gbps` GB/s (latency 10 µs)."""
    return Timings.from_link(t_att=0.656e-3, t_moe=0.2926e-3, t_head=0.497e-3, top_k=4, expert_bytes=DEMO.expert_bytes,
                             bandwidth=gbps * 1e9, latency=1e-5, t_host_load=0.0598e-3, t_host_prefetch=0.194e-3,
                             t_admit=0.066e-3, t_segment=0.0096e-3, t_host_route=0.0026e-3)


def _demo_routing():
    from pathlib import Path

    from fmoe_cli.planning.simulate import tokens_of
    from fmoe_cli.trace import read_trace

    return tokens_of(read_trace(Path(__file__).resolve().parents[1] / "traces" / "demo.jsonl"))


def test_on_the_demo_the_plan_follows_the_link_and_prices_at_most_every_baseline():
    """The demo's routing (traces/demo.jsonl, with the prefetcher's rankings) at 25 % on links of 1, 4 and 16 GB/s:
    a run's plan (MIN_PREDICTIONS met by the trace's 159 predicted tokens) is priced by the configurator's own model
    at most as high as each baseline's plan, `uniform`'s included, and the plans differ with the link: prefetch at
    1 GB/s (a load is 7 × T_exp of 0.6 ms), none at 16 (a load costs less than the predictor's work)."""
    from fmoe_cli.planning.autoplan import moepic_configuration
    from fmoe_cli.planning.plan import MIN_PREDICTIONS
    from fmoe_cli.planning.simulate import trace_stats

    stats = trace_stats(_demo_routing(), DEMO)
    assert stats.predicted_tokens >= MIN_PREDICTIONS
    plans = {}
    for gbps in (1, 4, 16):
        config = moepic_configuration(DEMO, DEMO.all_experts_bytes // 4, _demo_timings(gbps), stats,
                                      min_predictions=MIN_PREDICTIONS)
        prices = dict(config.candidates)
        assert config.total_exposed <= min(prices.values()) + 1e-12
        assert config.total_exposed <= prices["uniform (θ = 0.5)"]
        plans[gbps] = config.plan
    assert plans[1].prefetch and not plans[16].prefetch
    assert len({(p.layers, p.prefetch) for p in plans.values()}) == 3  # a plan per link


DEMO_POLICIES = ("lru", "uniform", "cache-only", "prefetch-only", "ondemand")


def test_on_the_demo_submitting_a_layers_loads_hides_its_first_one():
    """`ondemand` on the demo's routing: the engine submits a layer's 4 loads before it computes (measured on the
    demo, CPU-time clock, 3 × 64 tokens, load 2–3: 0.055–0.10 ms for the 4, h_sub ≈ 0.017 ms a load), so the first
    is on the link meanwhile: it measured 0.000 ms a token exposed at 16 GB/s (a load is 0.047 ms). Submitted for
    free, the simulator and the closed form gave 0.27 (the closed form then priced `ondemand` 0.27 ms a token too
    high at 16 GB/s, against every cache plan); with h_sub both give 0. At 4 GB/s, where the link is slower than the
    compute between loads, the submissions hide only the first load's own: 6·h_sub a token less. The closed form
    and the simulator agree within 1 % either way."""
    from fmoe_cli.planning.configurator import price_plan
    from fmoe_cli.planning.presets import PlanInputs, settings_for
    from fmoe_cli.planning.simulate import simulate_policy, trace_stats

    routing = _demo_routing()
    stats = trace_stats(routing, DEMO)
    exposed = {}
    for gbps in (4, 16):
        for h_sub in (0.0, 0.017e-3):
            timings = replace(_demo_timings(gbps), t_host_submit=h_sub)
            settings = settings_for("ondemand", PlanInputs(DEMO, DEMO.all_experts_bytes // 4, timings, stats))
            sim = simulate_policy(DEMO, settings, timings, routing, bandwidth=gbps * 1e9, latency=1e-5)
            priced = price_plan(settings.plan, stats, timings, DEMO, max_prefetch=0)
            compute = DEMO.num_layers * (timings.t_att + timings.t_moe) + timings.t_head
            assert (compute + priced.total_exposed) / sim.mean_tpot_s == pytest.approx(1.0, abs=0.01)
            exposed[(gbps, h_sub)] = sim.exposed_s_per_token
    assert exposed[(16, 0.0)] > 0.2e-3 and exposed[(16, 0.017e-3)] < 1e-6  # submitted for free; as measured
    assert exposed[(4, 0.0)] - exposed[(4, 0.017e-3)] == pytest.approx(DEMO.num_layers * 0.017e-3, rel=0.02)


def test_on_the_demo_the_closed_form_prices_each_plan_near_the_simulator():
    """Each policy's plan on the demo's routing at 1, 4 and 16 GB/s, priced by the configurator's closed form
    (compute + Σ T^i, price_plan) and simulated (the engine's classes on a virtual clock; the mean step, as the
    closed form prices an expectation): within 8 %. Before the fixes below the closed form was 11–12 % above
    the simulator for the prefetching plans with loads left at 1 GB/s (`uniform` 13.85 against 12.38 ms,
    `prefetch-only` 18.22 against 16.25: h_pf charged on top of the layer's stall, which it overlaps: the engine
    runs the predictor once its demand loads are queued) and 6–7 % above for whole experts in caches smaller
    than K (`lru`, `cache-only` at 4 and 16 GB/s: every miss charged an admission, where a cache of C < K slots
    admits only min(K, C) − h a token), and H_i(C) of those small caches was LCP's top C (such a cache holds C of
    the last token's experts: `cache-only` 0.96 × at 16 GB/s, simulated hit 0.24 against 0.32 priced). What is
    left is at 1 GB/s: `uniform` 1.08, `lru` 1.07 and `prefetch-only` 1.06 × (the prefetch on the link when the layer
    routes, whose transfer a right prediction takes over, is charged whole), and at 4 GB/s `cache-only` 1.04: since
    H_i(C) is recorded in the order the engine's cache holds the experts (planning/stats.py: held_order; MoEpic's
    C highest priorities said 0.24 where the cache hit 0.46, `simulate.py paper`'s Qwen1.5-MoE routing at C = 9),
    (C/K)·H_i(K) of C < K slots is (C/K) of the previous token's experts' share, 0.23 where the demo's two slots hit
    0.24 (the slots keep a token's hits, which recur more than its misses); with the priority order these read
    within 1.065, and 1.025 at 4 and 16 GB/s. Priced per token (hidden_distribution, issue 38) they barely move, so
    the bounds stay: 1 GB/s `uniform` 1.079 → 1.073, `lru` 1.069 → 1.073, `prefetch-only` 1.059; 4 GB/s `cache-only`
    1.040 unchanged; 16 GB/s `cache-only` 0.995 → 1.005: these gaps are not the per-token distribution."""
    from fmoe_cli.planning.configurator import price_plan
    from fmoe_cli.planning.presets import PlanInputs, settings_for
    from fmoe_cli.planning.simulate import predictor_for, simulate_policy, trace_stats

    routing = _demo_routing()
    stats = trace_stats(routing, DEMO)
    budget = DEMO.all_experts_bytes // 4
    off = {}
    for gbps in (1, 4, 16):
        timings = _demo_timings(gbps)
        compute = DEMO.num_layers * (timings.t_att + timings.t_moe) + timings.t_head
        for name in DEMO_POLICIES:
            settings = settings_for(name, PlanInputs(DEMO, budget, timings, stats, min_predictions=0))
            priced = price_plan(settings.plan, stats, timings, DEMO, max_prefetch=DEMO.top_k if settings.prefetch else 0)
            sim = simulate_policy(DEMO, settings, timings, routing, bandwidth=gbps * 1e9, latency=1e-5,
                                  predictor_factory=predictor_for(routing, DEMO))
            off[(gbps, name)] = (compute + priced.total_exposed) / sim.mean_tpot_s
    assert all(0.935 <= ratio <= 1.08 for ratio in off.values()), off
    # at 4 and 16 GB/s within 2.5 % (caches of C < K experts priced with the hit rate they have: cache_hit_rate),
    # but `cache-only` at 4 GB/s: 1.04 (its two whole experts per layer hit 0.24, priced 0.23)
    assert all(0.975 <= ratio <= 1.025 for (gbps, name), ratio in off.items() if gbps > 1 and
               (gbps, name) != (4, "cache-only")), off
    assert off[(4, "cache-only")] <= 1.045, off


def test_on_the_demo_moepic_is_simulated_within_3_percent_of_every_other_policy_at_each_link():
    """The configurator's plan (a run's: MIN_PREDICTIONS met) on the demo's routing, simulated (mean step), is within
    3 % of every other policy's at 1, 4 and 16 GB/s, whatever h_pf the estimate read (0.013 ms in a profile, 0.194
    in a quick estimate by differences, 0.10 about what the engine's counter of the path reads): moepic ÷ the best
    other at 0.013, 0.10 and 0.194 ms: 1.006 / 0.955 / 0.955, 1.016 / 0.970 / 0.956, 1.025 / 0.995 / 0.956 (issue 22
    §5's target is ≤ 1.05 × the best; measured figures: docs/bench.md § `moepic` across links). Since the uniform
    plans place every segment their budget holds (plan.py `uniform_plan`; until 28 Nov ⌊V_e / L⌋ a layer), uniform at
    1 GB/s is 12.15–12.20 ms (was 12.33–12.38) and moepic's margin there 1.006–1.025 (was 0.992–1.010); moepic's own
    plan and TPOT did not move."""
    from fmoe_cli.planning.simulate import predict_policies

    routing = _demo_routing()
    for h_pf in (0.013e-3, 0.10e-3, 0.194e-3):
        for gbps in (1, 4, 16):
            timings = replace(_demo_timings(gbps), t_host_prefetch=h_pf)
            sims = predict_policies(DEMO, DEMO.all_experts_bytes // 4, timings, gbps * 1e9, 1e-5, sequences=routing,
                                    policies=("moepic",) + DEMO_POLICIES)
            tpot = {name: result.mean_tpot_s for name, result in sims.items()}
            assert tpot["moepic"] <= 1.03 * min(v for name, v in tpot.items() if name != "moepic"), (h_pf, gbps, tpot)


def test_the_prefetch_credit_counts_predicted_activated_and_not_cached_experts():
    """Eq. 9's credit from the joint count (issue 38): a right prefetch saves a whole load only when its expert is not
    cached. Four tokens of one layer (N = 4, K = 1), each observed with the order the cache holds the experts and the
    prefetcher's ranking, written by hand: tokens 1 and 2 route to expert 0, which the cache holds first and the
    prefetcher predicts first (it recurs); tokens 3 and 4 route to experts 2 and 3, predicted second, while the first
    prediction, expert 1, is held second, then third, and not activated.
        H(1) = 2/4 (tokens 1, 2)      P(1) = 2/4, P(2) = 2/4      PH(1, 1) = 2/4, PH(2, 1) = 0
        PAH(1, 1) = 2/4: the first prediction, whenever it is activated, is cached; PAH(2, 1) = 0
    One whole expert cached (C = 1, θ = 1), one prefetch (W = 1) landing in the window ((1 − PH(1, 1))·T_load = 2 ≤
    T_wind^1 = T_head + T_att = 2): m = K·H(1)·θ + P(1) − PAH(1, 1)·θ = 0.5 + 0 = 0.5, what the four tokens hide (two
    hits; the prefetch of expert 1 is never right). A miss waits its load, T = 0.5·4 = 2. MoEpic's product,
    (1 − PH(1, 1)·θ)·P(1) = 0.25, credits a prefetch of the recurring expert 0 that loads nothing (it is cached):
    m = 0.75, and half the misses covered, T = 0.5·0.5·4 = 1."""
    from fmoe_cli.planning.configurator import price_plan
    from fmoe_cli.types import LayerPlan, Plan

    stats = LayerStats(4, 1)
    for activated, held, predicted in (([0], [0, 1, 2, 3], [0, 1, 2, 3]),
                                       ([0], [0, 1, 2, 3], [0, 1, 2, 3]),
                                       ([2], [0, 1, 2, 3], [1, 2, 0, 3]),
                                       ([3], [2, 0, 1, 3], [1, 3, 0, 2])):
        stats.observe(activated, held, predicted)
    curves = stats.curves()
    assert (curves.hit[1], *curves.predicted_hit[:2]) == (0.5, 0.5, 0.5)
    assert (curves.predicted_cached[0, 1], curves.predicted_cached[1, 1]) == (0.5, 0.0)
    assert (curves.predicted_hit_cached[0, 1], curves.predicted_hit_cached[1, 1]) == (0.5, 0.0)
    assert curves.predicted_hit_cached[0, 1] > curves.predicted_hit[0] * curves.predicted_cached[0, 1]  # it recurs
    shape = ExpertShape(1, 4, 1, 1, 4, 1)
    timings = Timings(t_att=1.0, t_moe=1.0, t_head=1.0, t_load=4.0, top_k=1)
    plan = Plan((LayerPlan(12, 1, 4, 1.0),), 2, 12, "test")
    (c,) = price_plan(plan, RoutingStats("tiny", 4, 1, [stats]), timings, shape, max_prefetch=1).layers
    assert (c.cache_size, c.split, c.prefetches) == (1, 1.0, 1)
    assert c.hidden == pytest.approx(0.5)
    assert c.exposed == pytest.approx(0.5 * 4.0)
    product = 1 * curves.hit[1] * 1.0 + (1 - curves.predicted_cached[0, 1] * 1.0) * curves.predicted_hit[0]
    assert product == pytest.approx(0.75)  # Eq. 9's product: the over-credit the joint count removes


def test_recurring_experts_are_priced_as_the_cache_holds_them():
    """Issue 38: where a token's experts recur in the next (each kept with probability 0.85, the rest uniform over
    16; K = 2, 3 whole experts' budget per layer, a load 2.65 × T_exp), the engine's cache, which admits every miss,
    holds the last token's experts and hits 0.87; MoEpic's H_i(C), the C highest LCP priorities, says 0.41.
    Planned from statistics recorded as the engine records them (`trace_stats`: planning/stats.py held_order),
    the plan keeps whole (or nearly whole) tops, simulated faster than the plan made from the priority order (split
    tops of 4–5 experts at θ ≤ 0.75, with prefetch; 15.46 against 16.29 ms), and than `lru`, `uniform`,
    `prefetch-only` and `ondemand`. Priced per token (hidden_distribution), `cache-only`'s plan is priced 1.99 ms a
    token exposed, simulated 1.96 (the closed form at the mean m said 0.2); the plan chosen, 3 whole experts a layer
    with prefetch, is priced 1.93 and simulated 2.46. With Eq. 9's product (1 − PH_i·θ_i)·P_i(y) instead of the joint
    count (P_i(y) − PAH_i(y, C)·θ_i) it was priced 1.14: the `eam` predictor's prefetches there are right 2.4 % of the
    time, and its right predictions are the cached experts (layer 1: P(1) = 0.254, PH(1, 3) = 0.876, PAH(1, 3) =
    0.247, the product's 0.222). That plan still wins the search, 3.4 % slower than `cache-only` in simulation
    (priced 1.93 against 1.99): the rest is Eq. 7's window (open: docs/planning.md § Where the model deviates from
    the paper), which starts at the layer's routing, while the simulator (like the engine on a CPU) issues the
    prefetch after the layer's cached experts are computed: a layer that loads nothing (76 % of them here) leaves
    only T_att for a whole expert's 2.65 ms. Priced at the mean, that plan (no prefetch) was within 1.5 %."""
    from fmoe_cli.planning import simulate as simulate_module
    from fmoe_cli.planning.autoplan import moepic_configuration
    from fmoe_cli.planning.configurator import price_plan
    from fmoe_cli.planning.plan import min_staging_slots
    from fmoe_cli.planning.presets import PlanInputs, settings_for
    from fmoe_cli.planning.simulate import Token, predictor_for, simulate_policy, trace_stats
    from fmoe_cli.types import EngineSettings

    rng = random.Random(0)
    shape = ExpertShape(4, 16, 2, 1, 64, 1)
    previous, tokens = [rng.sample(range(16), 2) for _ in range(4)], []
    for _ in range(300):
        rows = []
        for row in previous:
            kept = [e for e in row if rng.random() < 0.85]
            rows.append(kept + rng.sample([e for e in range(16) if e not in kept], 2 - len(kept)))
        previous = rows
        tokens.append(Token(tuple(tuple(r) for r in rows)))
    routing = [tokens]
    bandwidth = shape.expert_bytes / 2.65e-3
    timings = Timings.from_link(t_att=1e-3, t_moe=2e-3, t_head=1e-3, top_k=2, expert_bytes=shape.expert_bytes,
                                bandwidth=bandwidth, t_admit=0.2e-3)
    budget = (min_staging_slots(shape) + 4 * 3) * shape.expert_bytes
    predictor = predictor_for(routing, shape)

    def tpot(settings):
        return simulate_policy(shape, settings, timings, routing, bandwidth=bandwidth,
                               predictor_factory=predictor).mean_tpot_s

    def planned(stats):
        plan = moepic_configuration(shape, budget, timings, stats).plan
        return plan, tpot(EngineSettings("moepic", plan, "lcp", plan.prefetch, LCP_OMEGA, LCP_RHO))

    stats = trace_stats(routing, shape)
    held = stats.layers[0].hit_rate(3)
    plan, moepic = planned(stats)
    by_priority = simulate_module.held_order
    try:
        simulate_module.held_order = lambda ranking, last, step: ranking  # MoEpic's order: the C highest priorities
        old_stats = trace_stats(routing, shape)
    finally:
        simulate_module.held_order = by_priority
    old_plan, old = planned(old_stats)
    assert held > 0.85 and old_stats.layers[0].hit_rate(3) < 0.45
    assert min(layer.split for layer in plan.layers) >= 0.85
    assert old_plan.prefetch and max(layer.split for layer in old_plan.layers) < 1.0
    assert sum(layer.split for layer in old_plan.layers) / 4 <= 0.8
    assert moepic < 0.95 * old
    others = {name: tpot(settings_for(name, PlanInputs(shape, budget, timings, stats)))
              for name in ("lru", "cache-only", "uniform", "prefetch-only", "ondemand")}
    assert all(moepic < others[name] for name in others if name != "cache-only"), (moepic, others)
    assert moepic <= 1.035 * others["cache-only"], (moepic, others)  # Eq. 7's window (the docstring)
    # the chosen plan's price against its simulation: 0.79 with the joint count, 0.46 with Eq. 9's product
    compute = shape.num_layers * (timings.t_att + timings.t_moe) + timings.t_head
    priced = price_plan(plan, stats, timings, shape, max_prefetch=shape.top_k if plan.prefetch else 0).total_exposed
    assert priced >= 0.75 * (moepic - compute), (priced, moepic - compute)


def test_a_layers_priced_candidates_are_kept_within_a_byte_budget(monkeypatch):
    """The priced candidates of a layer are kept per budget (Algorithm 1 returns to budgets), within
    TABLE_CACHE_BYTES, the oldest dropped first: counted in budgets alone, a 128-expert layer's tables (megabytes
    each) took `fmoe plan` to 11 GiB of RAM on Qwen3-30B-A3B's config and past 16 GiB on DeepSeek-V3's."""
    from fmoe_cli.planning import configurator

    monkeypatch.setattr(configurator, "TABLE_CACHE_BYTES", 4 * 2**20)
    shape = ExpertShape(1, 128, 8, 64, 768, 2)
    (model,) = configurator._layer_models(RoutingStats.assume_uniform("m", 1, 128, 8),
                                          Timings(1e-4, 2e-4, 1e-4, 3e-4, 8), shape, None)
    budgets = [shape.expert_bytes * c // 4 for c in range(4, 200)]
    for budget in budgets:
        model.choose(budget, 1e-4)
        kept = sum(a.nbytes for tables in model._by_budget.values() for a in tables if isinstance(a, np.ndarray))
        assert kept <= configurator.TABLE_CACHE_BYTES
    assert budgets[-1] in model._by_budget and budgets[0] not in model._by_budget  # the newest kept
    first = model.choose(budgets[0], 1e-4)  # priced again, the same
    assert model.choose(budgets[0], 1e-4) == first


def _layers_with_a_repeat(seed: int, n: int, k: int) -> RoutingStats:
    """Recorded statistics of 4 layers: the third a copy of the first, the fourth the second's H_i and P_i with its
    own PH_i and PAH_i (the second's predictions ranked one place further down the cache order)."""
    stats = synthetic_stats(seed, 4, n, k)
    stats.layers[2] = stats.layers[0].copy()
    stats.layers[3] = stats.layers[1].copy()
    for hist in (stats.layers[3].predicted_rank_hist, stats.layers[3].predicted_active_rank_hist):
        hist[:] = np.roll(hist, 1, axis=1)
    return stats


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("seed", [3, 11])
def test_layers_of_equal_curves_share_their_tables_and_price_as_each_layer_alone(monkeypatch, seed, host):
    """The layers whose curves are equal share their priced candidates (`_Tables`: with uniform routing every layer,
    so a 48-layer model prices each budget once) and the answers of `choose` by their inputs; the plans without
    prefetch share them too. Configurations, plans and prices are those of every layer priced alone, every answer
    made afresh: with recorded statistics (distinct layers, one repeated) and uniform routing, with the host lane."""
    from fmoe_cli.planning import configurator
    from fmoe_cli.planning.plan import uniform_plan

    shape = ExpertShape(4, 8, 2, 4, 128, 1)
    timings = Timings(1e-4, 4e-4, 2e-4, 6e-4, 2, t_host_load=2e-5, t_host_prefetch=1e-5, t_admit=5e-5,
                      t_segment=1e-5, t_host_route=1e-5, t_host_submit=1e-5,
                      **({"t_host_expert": 7e-4, "t_host_call": 5e-5, "t_host_sync": 3e-5} if host else {}))
    recorded = _layers_with_a_repeat(seed, shape.num_experts, shape.top_k)
    uniform = RoutingStats.assume_uniform("u", shape.num_layers, shape.num_experts, shape.top_k)
    models = configurator._layer_models(recorded, timings, shape, None)
    assert models[0]._shared is models[2]._shared
    assert len({id(m._shared) for m in models}) == 3  # the fourth's H_i and P_i are the second's, not its PH_i
    assert len({id(m._shared) for m in configurator._layer_models(uniform, timings, shape, None)}) == 1
    budgets = [int(share * shape.all_experts_bytes) for share in (0.1, 0.3, 0.6, 1.0)]

    def priced():
        out = []
        for stats in (recorded, uniform):
            for budget in budgets:
                out.append(vram_allocation(budget, stats, timings, shape, host_lane=host))
                for theta in (0.5, 1.0):
                    plan = uniform_plan(shape, budget + shape.min_staging_slots * shape.expert_bytes, theta)
                    out.append(configurator.price_plan(plan, stats, timings, shape, max_prefetch=shape.top_k))
        return out

    shared = priced()
    fresh = iter(range(10**6))
    monkeypatch.setattr(configurator, "_digest", lambda curves: next(fresh).to_bytes(4, "little"))  # nothing shared
    monkeypatch.setattr(configurator._LayerModel, "choose", lambda self, budget, window, cache_size=None,
                        host_path=False: self._choose(budget, window, cache_size, host_path))  # nothing kept
    assert shared == priced()


def test_a_layers_tables_are_the_sums_written_out():
    """A layer's tables (made in place) and `_right_prefetches` (the right prefetches taken over and those of cached
    tops, for one candidate) are bit for bit the [Y, candidates] sums written out, as the tables once held them all."""
    from fmoe_cli.planning import configurator

    shape = ExpertShape(4, 8, 2, 4, 128, 1)
    stats = _layers_with_a_repeat(5, shape.num_experts, shape.top_k)
    timings = Timings(1e-4, 4e-4, 2e-4, 6e-4, 2)
    for model in configurator._layer_models(stats, timings, shape, None):
        curves = model.curves
        for budget in (shape.expert_bytes // 3, shape.expert_bytes * 3, shape.all_experts_bytes // 4):
            sizes, k, theta, cost, gain = model._tables(budget)[:5]
            assert cost.tobytes() == np.cumsum((1.0 - curves.predicted_cached[:, sizes] * theta[None, :]) * timings.t_load,
                                               axis=0).tobytes()
            right_cached = curves.predicted_hit_cached[:, sizes]
            assert gain.tobytes() == np.cumsum(curves.predicted_hit[:, None] - right_cached * theta[None, :],
                                               axis=0).tobytes()
            whole = (k == shape.intermediate).astype(float)
            taken = np.cumsum(curves.predicted_hit[:, None] - right_cached * whole[None, :], axis=0)
            bottoms = np.cumsum(right_cached, axis=0)
            for c in range(len(sizes)):
                one_taken, one_bottoms = model._right_prefetches(int(sizes[c]), int(k[c]))
                assert one_taken.tobytes() == taken[:, c].tobytes()
                assert one_bottoms.tobytes() == bottoms[:, c].tobytes()
