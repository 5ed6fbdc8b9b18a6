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
    pred_hit_cached = np.zeros((n, n + 1))  # activated and cached: the joint count
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
                    pred_hit_cached[y, c] += e in cache and e in activated
        if predicted is not None:
            predicted_tokens += 1
            for y, e in enumerate(predicted):
                pred_hits[y] += e in activated
        for e in activated:  # the policy sees the token after the statistics
            count[e] += 1
            last[e] = step
    q, p = len(tokens), max(predicted_tokens, 1)
    return hits / (q * k), pred_hits / p, pred_cached / p, pred_hit_cached / p


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
    hit, p, ph, pah = brute_force(tokens, predictions, n, k)
    curves = stats.curves()
    for c in range(n + 1):  # every cache size, from one pass
        assert stats.hit_rate(c) == pytest.approx(hit[c], abs=1e-12)
    if any(pr is not None for pr in predictions):
        np.testing.assert_allclose(curves.predicted_hit, p, atol=1e-12)
        np.testing.assert_allclose(curves.predicted_cached, ph, atol=1e-12)
        np.testing.assert_allclose(curves.predicted_hit_cached, pah, atol=1e-12)
        assert stats.p(1) == pytest.approx(p[0])
        assert stats.ph(1, n) == pytest.approx(ph[0, n])
        assert stats.pah(1, n) == pytest.approx(p[0])  # a cache of every expert holds each one activated


def test_long_skewed_run_hit_rate_matches_brute_force():
    """Hundreds of tokens so that ρ^(ν/ω) decay (ω = 128) really reorders the cache."""
    rng = random.Random(7)
    n, k, q = 16, 2, 400
    tokens = skewed_routing(rng, n, k, q)
    predictions = [noisy_prediction(rng, n, a, n) for a in tokens]
    stats = record(tokens, predictions, n, k)
    hit, _, ph, pah = brute_force(tokens, predictions, n, k)
    np.testing.assert_allclose(stats.curves().hit, hit, atol=1e-12)
    np.testing.assert_allclose(stats.curves().predicted_cached, ph, atol=1e-12)
    np.testing.assert_allclose(stats.curves().predicted_hit_cached, pah, atol=1e-12)
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
    assert curves.predicted_hit_cached[3, 2] == pytest.approx(0.25 * 0.25)  # activated independently of the cache
    stats = RoutingStats.assume_uniform("m", 3, 8, 2)
    assert stats.uniform and stats.curves(1).hit[8] == pytest.approx(1.0)


def test_memory_is_quadratic_in_experts_per_layer():
    stats = RoutingStats.empty("m", 4, 64, 8)
    counters = sum(layer.rank_hist.size + layer.predicted_hist.size + layer.predicted_rank_hist.size
                   + layer.predicted_active_rank_hist.size for layer in stats.layers)
    assert counters == 4 * (64 + 64 + 2 * 64 * 64)


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
        np.testing.assert_array_equal(a.predicted_active_rank_hist, b.predicted_active_rank_hist)
        assert a.predicted_active_rank_hist.sum() > 0
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
    without_joint = {**good, "layers": [{k: v for k, v in good["layers"][0].items() if k != "predicted_active_rank_hist"}]}
    for broken in ({**good, "schema_version": 99}, {**good, "layers": [{"tokens": 1}]}, [1, 2], without_joint):
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


@pytest.mark.parametrize("policy_name", ["lcp", "lru"])
def test_deferred_observations_give_the_statistics_of_each_moment(policy_name, monkeypatch) -> None:
    """Issue 39 §5: the recorder notes a token's experts and takes them in when the statistics are read. Over prefills,
    decode tokens with predicted rankings, a new policy mid-way (a new plan) and more tokens than MAX_PENDING, the
    histograms equal those of ranking every token at its own moment (`lcp_ranks` of the live policy, before its
    record, in the order a cache holds: `held_order`), and an event takes in nothing below MAX_PENDING tokens."""
    from types import SimpleNamespace

    import torch

    from fmoe_cli.offload.cache import LayerCache
    from fmoe_cli.offload.policies import make_policy
    from fmoe_cli.planning import stats as stats_module
    from fmoe_cli.planning.stats import LayerStats, held_order, lcp_ranks

    monkeypatch.setattr(stats_module, "MAX_PENDING", 37)
    rng = random.Random(11)
    layers, n, k = 2, 8, 2
    recorder = StatsRecorder(RoutingStats.empty("m", layers, n, k))
    want = RoutingStats.empty("m", layers, n, k)
    caches = [LayerCache(3, make_policy(policy_name, n)) for _ in range(layers)]
    observe, taken_in = LayerStats.observe, []

    def counted(self, *args):
        taken_in.append(1)
        return observe(self, *args)

    monkeypatch.setattr(LayerStats, "observe", counted)

    def feed(token: int, rows: list[list[int]]) -> None:
        for i, cache in enumerate(caches):
            predicted = rng.sample(range(n), n) if len(rows) == 1 and rng.random() < 0.7 else None
            before = len(taken_in)
            recorder(SimpleNamespace(layer=i, top_k_index=torch.tensor(rows), routed=[e for r in rows for e in r],
                                     cache=cache, predicted=predicted))
            # nothing, or a whole run: MAX_PENDING tokens' worth, or the old policy's (token 60)
            assert len(taken_in) == before or len(taken_in) - before >= 30 or token == 60
            for t, row in enumerate(rows):  # the reference: each token ranked at its own moment, then touched
                step = cache.step + t
                observe(want.layers[i], row, held_order(lcp_ranks(cache.policy, step), cache.policy.last, step),
                        predicted)
                for e in row:
                    cache.policy.touch(e, cache.step + t)
            cache.step += len(rows)

    for token in range(150):
        if token == 60:  # a new plan: new policies (warm: the old ones' μ and last steps), the clocks moved on
            for i, cache in enumerate(caches):
                policy = make_policy(policy_name, n)
                policy.count, policy.last = list(cache.policy.count), list(cache.policy.last)
                caches[i] = LayerCache(3, policy)
                caches[i].step = cache.step + 5
        feed(token, [rng.sample(range(n), k) for _ in range(rng.choice([1, 1, 1, 6]))])
    if recorder._pending[0] is None:  # the last token ended a run: one more, which the recorder keeps pending
        feed(150, [rng.sample(range(n), k)])
    assert 0 < len(taken_in) < sum(layer.tokens for layer in want.layers)  # the last runs are still pending
    got = recorder.stats
    for mine, theirs in zip(got.layers, want.layers):
        assert mine.tokens == theirs.tokens > 150
        assert mine.rank_hist.tolist() == theirs.rank_hist.tolist()
        assert mine.predicted_hist.tolist() == theirs.predicted_hist.tolist()
        assert mine.predicted_rank_hist.tolist() == theirs.predicted_rank_hist.tolist()
        assert mine.predicted_active_rank_hist.tolist() == theirs.predicted_active_rank_hist.tolist()
        assert mine.predicted_tokens == theirs.predicted_tokens > 50


def test_hit_curve_is_that_of_a_cache_that_admits_every_miss() -> None:
    """H_i(C) as recorded (RoutingStats.observe_policy: the previous token's experts first, `held_order`) is the hit
    rate of the engine's cache (LayerCache, LCP, every miss admitted: replay_token) for every C ≥ K, on routing whose
    experts recur from token to token but are rare overall (within 0.005; at C = 2 to 8 the engine hits 0.82 to 0.89);
    MoEpic's C highest priorities (`lcp_ranking` alone) say 0.26 to 0.76. Sticky routing: each of the previous token's 2 experts kept with probability 0.8, the rest uniform
    over 16."""
    from fmoe_cli.offload.cache import LayerCache, replay_token
    from fmoe_cli.planning.stats import held_order

    rng = random.Random(5)
    n, k, q = 16, 2, 600
    tokens, previous = [], rng.sample(range(n), k)
    for _ in range(q):
        kept = [e for e in previous if rng.random() < 0.8]
        previous = kept + rng.sample([e for e in range(n) if e not in kept], k - len(kept))
        tokens.append(previous)
    recorded = RoutingStats.empty("m", 1, n, k)
    by_priority = LayerStats(n, k)
    policy = LCP(n, omega=OMEGA, rho=RHO)
    caches = {c: LayerCache(c, LCP(n, omega=OMEGA, rho=RHO)) for c in (2, 3, 4, 6, 8)}
    hits = dict.fromkeys(caches, 0)
    for step, row in enumerate(tokens):
        recorded.observe_policy(0, row, policy, step)
        by_priority.observe(row, lcp_ranking(policy, step))
        for e in row:
            policy.touch(e, step)
        for c, cache in caches.items():
            hits[c] += replay_token(cache, row)
    assert held_order([3, 1, 0, 2], [5, 0, 5, -1], 6).tolist() == [0, 2, 3, 1]  # last step 5 first, in their order
    assert held_order([3, 1, 0, 2], [-1, -1, -1, -1], 0).tolist() == [3, 1, 0, 2]  # nothing before step 0
    engine_at_2 = hits[2] / (q * k)  # 0.82, and 0.26 by priority
    for c in caches:
        engine = hits[c] / (q * k)
        assert recorded.layers[0].hit_rate(c) == pytest.approx(engine, abs=0.03), c
        assert recorded.layers[0].hit_rate(c) == pytest.approx(engine, abs=0.005), c
        assert by_priority.hit_rate(c) < engine - 0.1, c
    assert by_priority.hit_rate(2) < engine_at_2 / 3


def test_a_recorder_that_observed_nothing_writes_no_file(tmp_path):
    """A run that failed before its first token (a model without a tokenizer, damaged weights) leaves no statistics
    file behind; one that observed a token writes it."""
    from fmoe_cli.planning.stats import open_recorder

    path = tmp_path / "m.stats.json"
    recorder = open_recorder("m", 2, 8, 2, path)
    assert recorder.save() is None and not path.exists()
    recorder.stats.layers[0].observe([1, 2], list(range(8)))
    assert recorder.save() == path and path.exists()


def test_a_statistics_file_deleted_during_a_session_is_not_written_back(tmp_path):
    """The user deletes the file (to reset what was learned) while a chat runs: its next save writes what the session
    observed since, not the counts it had read (a damaged file set aside alike)."""
    from fmoe_cli.planning.stats import open_recorder

    path = tmp_path / "m.stats.json"
    earlier = open_recorder("m", 1, 8, 2, path)
    for _ in range(5):
        earlier.stats.layers[0].observe([1, 2], list(range(8)))
    earlier.save()
    session = open_recorder("m", 1, 8, 2, path)
    assert session.stats.layers[0].tokens == 5
    session.stats.layers[0].observe([3, 4], list(range(8)))
    path.unlink()
    session.save()
    assert RoutingStats.load(path).layers[0].tokens == 1
    session.stats.layers[0].observe([3, 4], list(range(8)))
    session.save()  # and on from there, the file's counts and the session's added as always
    assert RoutingStats.load(path).layers[0].tokens == 2
