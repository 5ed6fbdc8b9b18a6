"""The TPOT simulator (planning/simulate.py): the virtual link by hand, compute-only and
load-only decode steps by hand, and the engine's cache decisions (same hits as `fmoe replay`)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from fmoe_cli.bench.replay import policy_hits
from fmoe_cli.planning.presets import make_settings
from fmoe_cli.planning.configurator import Timings
from fmoe_cli.planning.simulate import RoutingPredictor, Token, next_ranking, predict_policies, simulate_policy
from fmoe_cli.types import ExpertShape

# 2 MoE layers, 4 experts, top-2, I = 4 neurons of 3 bytes (H = 1, 1 byte): S_e = 12 bytes.
SHAPE = ExpertShape(num_layers=2, num_experts=4, top_k=2, hidden=1, intermediate=4, dtype_bytes=1)
TIMES = Timings(t_att=1.0, t_moe=2.0, t_head=3.0, t_load=0.0, top_k=2)  # T_exp = 1


def _tokens(rows):
    return [Token(tuple(tuple(r) for r in row)) for row in rows]


def test_resident_is_compute_only():
    """Every expert whole on the device: TPOT = L·(T_att + K·T_exp) + T_head = 2·(1 + 2) + 3 = 9."""
    seq = _tokens([[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[0, 3], [1, 2]]])
    r = simulate_policy(SHAPE, make_settings("resident", SHAPE, 0), TIMES, [seq], bandwidth=1.0)
    assert r.tpot_s == pytest.approx(9.0) and r.hit_rate == 1.0 and r.exposed_s_per_token == 0.0


def test_ondemand_waits_for_every_load():
    """No cache, no prefetch, a 12-byte expert at 12 bytes/s = 1 s per load, K = 2 per layer:
    per layer T_att 1, then load 1 (1 s), compute it (1 s) while load 2 arrives, compute it (1 s):
    1 + 1 + 1 + 1 = 4; the token 2·4 + T_head 3 = 11, of which 1 s waited per layer."""
    seq = _tokens([[[0, 1], [2, 3]], [[1, 2], [0, 3]]])
    budget = 2 * SHAPE.top_k * SHAPE.expert_bytes
    r = simulate_policy(SHAPE, make_settings("ondemand", SHAPE, budget), TIMES, [seq], bandwidth=12.0)
    assert r.tpot_s == pytest.approx(11.0)
    assert r.exposed_s_per_token == pytest.approx(2.0)
    assert r.hit_rate == 0.0 and r.bytes_per_token == 4 * SHAPE.expert_bytes


def test_cache_hits_are_the_engines():
    """cache-only (whole experts, LCP, no prefetch) over random routing: the same hits as
    `fmoe replay`'s LayerCache over the same routes (C experts per layer)."""
    rng = random.Random(0)
    shape = ExpertShape(3, 8, 2, 1, 64, 1)
    seq = [Token(tuple(tuple(rng.sample(range(8), 2)) for _ in range(3))) for _ in range(200)]
    budget = (2 * 2 + 3 * 3) * shape.expert_bytes  # staging 2K slots + 3 whole experts per layer
    settings = make_settings("cache-only", shape, budget)
    assert {lp.cache_size for lp in settings.plan.layers} == {3}
    r = simulate_policy(shape, settings, Timings(0.0, 0.0, 0.0, 0.0, 2), [seq], bandwidth=1e9)
    hits = sum(policy_hits([t.experts[i] for t in seq], "lcp", 3, 8) for i in range(3))
    assert r.hit_rate == pytest.approx(hits / (200 * 3 * 2))


def test_a_right_prediction_hides_the_load():
    """prefetch-only with the trace's rankings: right predictions arrive during T_att + compute of
    the previous layer; wrong ones leave the load exposed."""
    rows = [[[0, 1], [2, 3]]] * 6
    right = [Token(tuple(tuple(r) for r in row), ((0, 1, 2, 3), (2, 3, 0, 1))) for row in rows]
    wrong = [Token(tuple(tuple(r) for r in row), ((2, 3, 0, 1), (0, 1, 2, 3))) for row in rows]
    budget = 2 * SHAPE.top_k * SHAPE.expert_bytes
    settings = make_settings("prefetch-only", SHAPE, budget)
    slow = Timings(t_att=2.0, t_moe=2.0, t_head=3.0, t_load=0.0, top_k=2)
    good = simulate_policy(SHAPE, settings, slow, [right], bandwidth=12.0)
    bad = simulate_policy(SHAPE, settings, slow, [wrong], bandwidth=12.0)
    assert good.prefetch_precision == 1.0 and bad.prefetch_precision == 0.0
    assert good.tpot_s < bad.tpot_s
    assert good.exposed_s_per_token < bad.exposed_s_per_token


def test_predict_policies_runs_every_policy_with_a_routing_only_predictor():
    rng = random.Random(1)
    shape = ExpertShape(4, 8, 2, 1, 64, 1)
    seq = [Token(tuple(tuple(rng.sample(range(4), 2)) for _ in range(4))) for _ in range(60)]
    times = Timings.from_link(t_att=1e-3, t_moe=2e-3, t_head=1e-3, top_k=2, expert_bytes=shape.expert_bytes,
                              bandwidth=shape.expert_bytes / 3e-3)
    out = predict_policies(shape, (4 + 8) * shape.expert_bytes, times, shape.expert_bytes / 3e-3, 0.0,
                           sequences=[seq], policies=["moepic", "lru", "resident"])
    assert set(out) == {"moepic", "lru", "resident"}
    assert out["resident"].tpot_s == pytest.approx(4 * 3e-3 + 1e-3)
    assert all(r.tpot_s >= out["resident"].tpot_s - 1e-12 for r in out.values())
    p = RoutingPredictor(4, 8, 2)
    p.start_sequence()
    p.begin([seq[0]])
    assert next_ranking(p.after_layer(0, seq[0].experts[0]), 0, 4) is None  # nothing seen of layer 1 yet
    for i in range(1, 4):
        p.after_layer(i, seq[0].experts[i])
    p.begin([seq[1]])
    ranking = next_ranking(p.after_layer(0, seq[1].experts[0]), 0, 4)  # the request's own EAM: token 0's layer 1
    assert set(ranking[:2]) == set(seq[0].experts[1])


def test_segment_overhead_is_paid_once_per_segment():
    """c per segment forward: a whole expert is one segment (T_exp in all), a top hit two (T_exp + c)."""
    seq = _tokens([[[0, 1], [2, 3]]] * 4)
    r0 = simulate_policy(SHAPE, make_settings("resident", SHAPE, 0), TIMES, [seq], bandwidth=1.0)
    r1 = simulate_policy(SHAPE, make_settings("resident", SHAPE, 0), replace(TIMES, t_segment=0.5), [seq], bandwidth=1.0)
    assert r0.tpot_s == r1.tpot_s == pytest.approx(9.0)
    budget = 2 * SHAPE.top_k * SHAPE.expert_bytes + SHAPE.all_experts_bytes  # every top cached
    split = make_settings("cache-only", SHAPE, budget, theta=0.5)
    assert {lp.top_neurons for lp in split.plan.layers} == {2}
    fast = dict(bandwidth=1e12)
    a = simulate_policy(SHAPE, split, TIMES, [seq], **fast)
    b = simulate_policy(SHAPE, split, replace(TIMES, t_segment=0.25), [seq], **fast)
    assert a.hit_rate == b.hit_rate == 0.75  # the first token misses, then every top is cached
    # the median token: 2 layers × 2 top hits, each two segments: 4 · c more
    assert b.tpot_s - a.tpot_s == pytest.approx(4 * 0.25, abs=1e-6)


def test_host_work_is_paid_per_loaded_segment_and_per_prefetching_layer():
    """h_load per loaded segment, h_pf per layer that prefetches: ondemand over a link with no
    latency pays 2 loads × 2 layers × h_load more per token and no h_pf; resident pays neither."""
    seq = _tokens([[[0, 1], [2, 3]], [[1, 2], [0, 3]]] * 2)
    budget = 2 * SHAPE.top_k * SHAPE.expert_bytes
    fast = dict(bandwidth=1e12)
    ondemand = make_settings("ondemand", SHAPE, budget)
    a = simulate_policy(SHAPE, ondemand, TIMES, [seq], **fast)
    b = simulate_policy(SHAPE, ondemand, replace(TIMES, t_host_load=0.5, t_host_prefetch=7.0), [seq], **fast)
    assert b.tpot_s - a.tpot_s == pytest.approx(4 * 0.5, abs=1e-6)
    resident = make_settings("resident", SHAPE, 0)
    assert simulate_policy(SHAPE, resident, replace(TIMES, t_host_load=0.5, t_host_prefetch=7.0), [seq], **fast).tpot_s == \
        pytest.approx(9.0)
    prefetching = make_settings("prefetch-only", SHAPE, budget)
    assert prefetching.prefetch
    c = simulate_policy(SHAPE, prefetching, TIMES, [seq], **fast)
    d = simulate_policy(SHAPE, prefetching, replace(TIMES, t_host_prefetch=0.25), [seq], **fast)
    assert d.tpot_s - c.tpot_s == pytest.approx(2 * 0.25, abs=1e-6)  # one prefetch issue per layer


def test_a_taken_over_prefetch_is_not_submitted_again():
    """h_pf (the engine's counter of the prefetch path) includes the prefetches' submissions; a layer takes a right
    prefetch over instead of submitting it, so its load costs h_load − h_sub more on the host, where a demand load
    costs h_sub as it is submitted and h_load − h_sub as it is served. prefetch-only with every prediction right,
    over a link with no latency (everything lands): 2 loads × 2 layers a token, each h_sub = 0.2 less than with
    h_sub = 0 (it was the same: every prefetched load paid its whole h_load = 0.5); ondemand pays h_load either way."""
    rows = [[[0, 1], [2, 3]]] * 6
    right = [Token(tuple(tuple(r) for r in row), ((0, 1, 2, 3), (2, 3, 0, 1))) for row in rows]
    budget = 2 * SHAPE.top_k * SHAPE.expert_bytes
    fast = dict(bandwidth=1e12)
    host = replace(TIMES, t_host_load=0.5)
    prefetching = make_settings("prefetch-only", SHAPE, budget)
    a = simulate_policy(SHAPE, prefetching, host, [right], **fast)
    b = simulate_policy(SHAPE, prefetching, replace(host, t_host_submit=0.2), [right], **fast)
    assert a.prefetch_precision == 1.0
    assert a.tpot_s - b.tpot_s == pytest.approx(4 * 0.2, abs=1e-6)
    ondemand = make_settings("ondemand", SHAPE, budget)
    c = simulate_policy(SHAPE, ondemand, host, [right], **fast)
    d = simulate_policy(SHAPE, ondemand, replace(host, t_host_submit=0.2), [right], **fast)
    assert c.tpot_s == pytest.approx(d.tpot_s, abs=1e-6)


def test_host_figures_come_from_the_timings_and_admissions_pay_their_copy():
    """The simulator's host work defaults to the timings' measured figures (h_load, h_pf), and a
    miss whose top is admitted into the cache pays a_e·k/I: cache-only with one whole expert (k = I)
    per layer over alternating routes: every activation misses; per layer the first miss replaces the
    cached expert, the second finds only a pinned (active) one and is not admitted: 2 copies per token."""
    from dataclasses import replace

    seq = _tokens([[[0, 1], [2, 3]], [[2, 3], [0, 1]]] * 3)
    fast = dict(bandwidth=1e12)
    ondemand = make_settings("ondemand", SHAPE, 2 * SHAPE.top_k * SHAPE.expert_bytes)
    plain = simulate_policy(SHAPE, ondemand, TIMES, [seq], **fast)
    assert simulate_policy(SHAPE, ondemand, replace(TIMES, t_host_load=0.5), [seq], **fast).tpot_s > plain.tpot_s
    budget = 2 * SHAPE.top_k * SHAPE.expert_bytes + 2 * SHAPE.expert_bytes  # one whole expert per layer
    cache = make_settings("cache-only", SHAPE, budget)
    assert {(lp.cache_size, lp.top_neurons) for lp in cache.plan.layers} == {(1, SHAPE.intermediate)}
    a = simulate_policy(SHAPE, cache, TIMES, [seq], **fast)
    b = simulate_policy(SHAPE, cache, replace(TIMES, t_admit=0.125), [seq], **fast)
    assert a.hit_rate == b.hit_rate == 0.0
    assert b.tpot_s - a.tpot_s == pytest.approx(2 * 0.125, abs=1e-6)


def test_the_routing_layout_overlaps_the_first_load():
    """h_route of T_att is spent after the layer's loads are submitted: resident (no loads) takes as
    long as before; ondemand waits h_route less per layer for its first load (T_load 1 s, route 0.25 s)."""
    from dataclasses import replace

    seq = _tokens([[[0, 1], [2, 3]], [[1, 2], [0, 3]]])
    budget = 2 * SHAPE.top_k * SHAPE.expert_bytes
    routed = replace(TIMES, t_host_route=0.25)
    resident = make_settings("resident", SHAPE, 0)
    assert simulate_policy(SHAPE, resident, routed, [seq], bandwidth=1.0).tpot_s == pytest.approx(9.0)
    ondemand = make_settings("ondemand", SHAPE, budget)
    plain = simulate_policy(SHAPE, ondemand, TIMES, [seq], bandwidth=12.0)
    early = simulate_policy(SHAPE, ondemand, routed, [seq], bandwidth=12.0)
    assert plain.tpot_s - early.tpot_s == pytest.approx(2 * 0.25)
    assert plain.exposed_s_per_token - early.exposed_s_per_token == pytest.approx(2 * 0.25)


def test_a_layer_whose_cache_holds_every_expert_is_filled_from_the_start():
    """A plan whose layer 0 caches every expert whole and whose layer 1 caches nothing: layer 0 is resident from the
    first token, as the engine fills it when configured (types.Plan.resident_layer), so every one of its activations
    hits and nothing is loaded for it: the hit rate is layer 0's share, 0.5, with layer 1 loading everything."""
    from fmoe_cli.planning.plan import layer_plan, uniform_plan

    seq = _tokens([[[0, 1], [0, 1]], [[2, 3], [2, 3]], [[0, 2], [1, 3]], [[1, 3], [0, 2]]])
    budget = 2 * SHAPE.top_k * SHAPE.expert_bytes
    loading = uniform_plan(SHAPE, budget, 0.0, source="test")
    plan = replace(loading, layers=(layer_plan(SHAPE, SHAPE.num_experts, 1.0), loading.layers[1]))
    r = simulate_policy(SHAPE, make_settings("cache-only", SHAPE, budget, plan=plan), TIMES, [seq], bandwidth=12.0)
    assert r.hit_rate == r.whole_hit_rate == 0.5
    assert r.bytes_per_token == pytest.approx(SHAPE.top_k * SHAPE.expert_bytes)  # layer 1's two loads a token
