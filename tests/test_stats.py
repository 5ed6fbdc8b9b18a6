"""Routing statistics against brute force (docs/architecture.md § Statistics, configurator, re-planning)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fmoe_cli.errors import FmoeError
from fmoe_cli.models.identity import model_key
from fmoe_cli.profiling.files import default_profile_path
from fmoe_cli.offload.policies import LCP
from fmoe_cli.planning.stats import (
    LayerStats,
    RoutingStats,
    StatsRecorder,
    default_stats_path,
    lcp_ranking,
    lcp_ranks,
    load_or_empty,
    uniform_curves,
)

OMEGA, RHO = 128.0, 0.25


# --- synthetic routing -------------------------------------------------------
def random_routing(rng: random.Random, n: int, k: int, q: int) -> list[list[int]]:
    return [rng.sample(range(n), k) for _ in range(q)]


def skewed_routing(rng: random.Random, n: int, k: int, q: int) -> list[list[int]]:
    """Zipf-like popularity that shifts halfway (so recency matters as well as counts)."""
    order = list(range(n))
    rng.shuffle(order)
    tokens = []
    for t in range(q):
        if t == q // 2:
            rng.shuffle(order)
        weights = [1.0 / (1 + order[e]) ** 1.5 for e in range(n)]
        chosen: list[int] = []
        while len(chosen) < k:
            e = rng.choices(range(n), weights)[0]
            if e not in chosen:
                chosen.append(e)
        tokens.append(chosen)
    return tokens


def noisy_prediction(rng: random.Random, n: int, activated: list[int], length: int) -> list[int]:
    """The activated experts usually near the front, the rest shuffled behind."""
    rest = [e for e in range(n) if e not in activated]
    rng.shuffle(rest)
    order = list(activated) + rest
    for i in range(len(order) - 1):  # a few adjacent swaps: an imperfect predictor
        if rng.random() < 0.3:
            order[i], order[i + 1] = order[i + 1], order[i]
    return order[:length]


# --- brute force: an independent top-C-by-priority cache ---------------------
def brute_force(tokens, predictions, n: int, k: int):
    """Simulate, for every C, a cache that holds exactly the C highest-LCP-priority experts.

    Priorities are recomputed from the raw history (μ = count, ν = tokens since the last
    activation, P = μ·ρ^(ν/ω)), independently of the policy class; ties by expert id.
    """
    count = [0] * n
    last = [None] * n
    hits = np.zeros(n + 1)  # hits[C]
    pred_hits = np.zeros(n)
    pred_cached = np.zeros((n, n + 1))
    predicted_tokens = 0
    for step, (activated, predicted) in enumerate(zip(tokens, predictions)):
        prio = [count[e] * RHO ** ((step - last[e]) / OMEGA) if count[e] else 0.0 for e in range(n)]
        order = sorted(range(n), key=lambda e: (-prio[e], e))
        for c in range(n + 1):
            cache = set(order[:c])
            hits[c] += sum(1 for e in activated if e in cache)
            if predicted is not None:
                for y, e in enumerate(predicted):
                    pred_cached[y, c] += e in cache
        if predicted is not None:
            predicted_tokens += 1
            for y, e in enumerate(predicted):
                pred_hits[y] += e in activated
        for e in activated:  # the policy sees the token after the statistics
            count[e] += 1
            last[e] = step
    q = len(tokens)
    return hits / (q * k), pred_hits / max(predicted_tokens, 1), pred_cached / max(predicted_tokens, 1)


def record(tokens, predictions, n: int, k: int, vectorised: bool = False) -> LayerStats:
    stats = LayerStats(n, k)
    policy = LCP(n, omega=OMEGA, rho=RHO)
    for step, (activated, predicted) in enumerate(zip(tokens, predictions)):
        ranking = lcp_ranking(policy, step) if vectorised else policy.ranking(step)
        stats.observe(activated, ranking, predicted)
        for e in activated:
            policy.touch(e, step)
    return stats


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(2, 12),
    k_frac=st.floats(0.0, 1.0),
    q=st.integers(1, 60),
    skewed=st.booleans(),
    vectorised=st.booleans(),
)
def test_stats_match_brute_force_cache(seed, n, k_frac, q, skewed, vectorised):
    rng = random.Random(seed)
    k = 1 + int(k_frac * (n - 1))
    tokens = (skewed_routing if skewed else random_routing)(rng, n, k, q)
    # a prediction on most tokens, of full or partial length
    predictions = [None if rng.random() < 0.2 else noisy_prediction(rng, n, a, rng.randint(1, n)) for a in tokens]
    stats = record(tokens, predictions, n, k, vectorised)
    hit, p, ph = brute_force(tokens, predictions, n, k)
    curves = stats.curves()
    for c in range(n + 1):  # every cache size, from one pass
        assert stats.hit_rate(c) == pytest.approx(hit[c], abs=1e-12)
    if any(pr is not None for pr in predictions):
        np.testing.assert_allclose(curves.predicted_hit, p, atol=1e-12)
        np.testing.assert_allclose(curves.predicted_cached, ph, atol=1e-12)
        assert stats.p(1) == pytest.approx(p[0])
        assert stats.ph(1, n) == pytest.approx(ph[0, n])


def test_long_skewed_run_hit_rate_matches_brute_force():
    """Hundreds of tokens so that ρ^(ν/ω) decay (ω = 128) really reorders the cache."""
    rng = random.Random(7)
    n, k, q = 16, 2, 400
    tokens = skewed_routing(rng, n, k, q)
    predictions = [noisy_prediction(rng, n, a, n) for a in tokens]
    stats = record(tokens, predictions, n, k)
    hit, _, ph = brute_force(tokens, predictions, n, k)
    np.testing.assert_allclose(stats.curves().hit, hit, atol=1e-12)
    np.testing.assert_allclose(stats.curves().predicted_cached, ph, atol=1e-12)
    assert stats.hit_rate(4) > 4 / n  # skew makes a small cache better than uniform


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 40), steps=st.integers(0, 700))
def test_vectorised_lcp_ranking_equals_policy(seed, n, steps):
    rng = random.Random(seed)
    policy = LCP(n)
    for step in range(steps):
        if rng.random() < 0.7:
            policy.touch(rng.randrange(n), step)
    assert lcp_ranking(policy, steps) == policy.ranking(steps)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 160), steps=st.integers(0, 3000), ties=st.booleans())
def test_numpy_lcp_ranks_equal_the_python_ranking(seed, n, steps, ties):
    """lcp_ranks (the recorder's decode steps) is lcp_ranking, expert for expert: the same floats and the same ties
    (`ties`: experts touched in pairs at the same steps, so equal priorities are common; counts past the log table's
    first sizes)."""
    rng = random.Random(seed)
    policy = LCP(n)
    for step in range(steps):
        if rng.random() < 0.7:
            e = rng.randrange(n)
            policy.touch(e, step)
            if ties:
                policy.touch((e + 1) % n, step)
                policy.count[(e + 1) % n] = policy.count[e]
    assert lcp_ranks(policy, steps).tolist() == lcp_ranking(policy, steps)


def test_uniform_curves():
    curves = uniform_curves(8, 2)
    assert curves.hit[4] == pytest.approx(0.5)
    assert curves.predicted_hit[0] == pytest.approx(0.25)
    assert curves.predicted_cached[3, 2] == pytest.approx(0.25)
    stats = RoutingStats.assume_uniform("m", 3, 8, 2)
    assert stats.uniform and stats.curves(1).hit[8] == pytest.approx(1.0)


def test_memory_is_quadratic_in_experts_per_layer():
    stats = RoutingStats.empty("m", 4, 64, 8)
    counters = sum(layer.rank_hist.size + layer.predicted_hist.size + layer.predicted_rank_hist.size for layer in stats.layers)
    assert counters == 4 * (64 + 64 + 64 * 64)


def test_save_load_round_trip(tmp_path):
    rng = random.Random(1)
    n, k = 6, 2
    stats = RoutingStats.empty("org/model", 2, n, k)
    for step in range(30):
        for layer in range(2):
            a = rng.sample(range(n), k)
            stats.observe(layer, a, rng.sample(range(n), n), noisy_prediction(rng, n, a, n))
    path = stats.save(default_stats_path("org/model", tmp_path))
    # next to the model's profile
    assert path.parent == default_profile_path(model_key("org/model"), tmp_path).parent
    assert path.name.startswith("org--model-") and path.name.endswith(".stats.json")  # name plus identity hash
    back = RoutingStats.load(path)
    for a, b in zip(stats.layers, back.layers):
        np.testing.assert_array_equal(a.predicted_rank_hist, b.predicted_rank_hist)
        np.testing.assert_array_equal(a.rank_hist, b.rank_hist)
        assert (a.tokens, a.predicted_tokens) == (b.tokens, b.predicted_tokens)
    assert load_or_empty("org/model", 2, n, k, path).tokens == 30
    assert load_or_empty("org/model", 2, n, k, tmp_path / "none.json").tokens == 0
    # statistics of another shape under this file name: set aside (kept), start afresh
    assert load_or_empty("org/model", 3, n, k, path).tokens == 0
    assert not path.exists() and len(list(path.parent.glob(path.name + ".corrupt-*"))) == 1


def test_malformed_stats_are_refused(tmp_path):
    path = tmp_path / "s.json"
    path.write_text("{not json")
    with pytest.raises(FmoeError, match="not valid JSON"):
        RoutingStats.load(path)
    good = RoutingStats.empty("m", 1, 4, 1).to_dict()
    for broken in ({**good, "schema_version": 99}, {**good, "layers": [{"tokens": 1}]}, [1, 2]):
        path.write_text(json.dumps(broken))
        with pytest.raises(FmoeError):
            RoutingStats.load(path)


def test_recorder_ranks_each_prefill_token_at_its_own_step() -> None:
    """A T-token prefill event gives the same statistics as its tokens fed one by one: the policy
    records a prefill token by token, so the ranking for token t includes tokens 0..t-1."""
    from types import SimpleNamespace

    import torch

    from fmoe_cli.offload.cache import LayerCache

    rng = random.Random(3)
    n, k = 6, 2
    prompt = [rng.sample(range(n), k) for _ in range(40)]
    whole = StatsRecorder(RoutingStats.empty("m", 1, n, k))
    cache = LayerCache(2, LCP(n))
    whole(SimpleNamespace(layer=0, top_k_index=torch.tensor(prompt), routed=[e for row in prompt for e in row],
                          cache=cache, predicted=None))
    one_by_one = StatsRecorder(RoutingStats.empty("m", 1, n, k))
    cache = LayerCache(2, LCP(n))
    for row in prompt:
        one_by_one(SimpleNamespace(layer=0, top_k_index=torch.tensor([row]), routed=row, cache=cache, predicted=None))
        cache.record([row])
        cache.advance()
    a, b = whole.stats.layers[0], one_by_one.stats.layers[0]
    assert a.tokens == b.tokens == 40 and whole.tokens == 40
    assert a.rank_hist.tolist() == b.rank_hist.tolist()
