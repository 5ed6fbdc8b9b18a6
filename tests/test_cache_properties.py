"""Property tests of the engine's cache bookkeeping (LayerCache) and the LCP ranking."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from fmoe_cli.offload.cache import LayerCache
from fmoe_cli.offload.policies import LCP, make_policy

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("pin"), st.integers(0, 7)),
        st.tuples(st.just("unpin"), st.integers(0, 7)),
        st.tuples(st.just("record"), st.lists(st.lists(st.integers(0, 7), max_size=3), max_size=4)),
        st.tuples(st.just("admit"), st.integers(0, 7)),
        st.tuples(st.just("advance"), st.integers(1, 300)),
        st.tuples(st.just("insert"), st.integers(0, 7)),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["lcp", "lru", "lfu", "random"]), st.integers(1, 8), st.integers(0, 9), OPS)
def test_layer_cache_invariants(policy: str, num_experts: int, capacity: int, ops: list) -> None:
    cache = LayerCache(capacity, make_policy(policy, num_experts))
    pins: dict[int, int] = {}
    for op, arg in ops:
        if op in ("pin", "unpin", "admit", "insert"):
            arg %= num_experts
        before = cache.cached()
        if op == "pin":
            cache.pin(arg)
            pins[arg] = pins.get(arg, 0) + 1
        elif op == "unpin":
            if pins.get(arg, 0) == 0:
                try:
                    cache.unpin(arg)
                except RuntimeError:
                    pass
                else:
                    raise AssertionError("unpin of an unpinned expert must raise")
            else:
                cache.unpin(arg)
                pins[arg] -= 1
        elif op == "record":
            step = cache.step
            cache.record([[e % num_experts for e in token] for token in arg])
            assert cache.step == step + max(len(arg) - 1, 0)  # the clock stands at the forward's last token
        elif op == "advance":
            for _ in range(arg):
                cache.advance()
        elif op == "insert":
            if arg in before or len(before) < cache.capacity:
                cache.insert(arg)
            else:
                try:
                    cache.insert(arg)
                except RuntimeError:
                    pass
                else:
                    raise AssertionError("insert into a full cache must raise")
        else:
            adm = cache.admit(arg)
            if adm is not None:
                assert arg not in before
                assert cache.slot(arg) == adm.slot
                if adm.evicted is not None:
                    assert adm.evicted in before and adm.evicted not in cache
                    assert pins.get(adm.evicted, 0) == 0, "evicted a pinned expert"
                    assert before[adm.evicted] == adm.slot
            elif arg not in before and len(before) < cache.capacity:
                raise AssertionError("a free slot was not used")
        after = cache.cached()
        # never above capacity; one expert per slot; slots in range
        assert len(after) <= cache.capacity <= num_experts
        assert len(set(after.values())) == len(after)
        assert all(0 <= s < cache.capacity for s in after.values())
        # pinned experts that were cached stay cached, in the same slot
        for e, n in pins.items():
            if n > 0 and e in before:
                assert after.get(e) == before[e]
            assert cache.is_pinned(e) == (n > 0)
        # at most one change per operation
        assert len(set(before.items()) ^ set(after.items())) <= 2


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 12),
    st.floats(1.0, 500.0),
    st.floats(0.01, 1.0),
    st.lists(st.tuples(st.integers(0, 11), st.integers(0, 400)), max_size=60),
    st.integers(0, 400),
)
def test_lcp_ranking_is_the_formula(num_experts: int, omega: float, rho: float, touches: list, extra: int) -> None:
    policy = LCP(num_experts, omega=omega, rho=rho)
    mu = [0] * num_experts
    last = [0] * num_experts
    step = 0
    for expert, gap in touches:
        expert %= num_experts
        step += gap
        policy.touch(expert, step)
        mu[expert] += 1
        last[expert] = step
    now = step + extra

    def p(e: int) -> float:  # MoEpic Eq. 4: P = μ · ρ^(ν/ω), ν = tokens since the last activation
        return mu[e] * rho ** ((now - last[e]) / omega) if mu[e] else 0.0

    ranking = policy.ranking(now)
    assert sorted(ranking) == list(range(num_experts))
    for a, b in zip(ranking, ranking[1:]):  # P never rises down the ranking; equal P (same μ and ν): by id
        assert p(a) >= p(b) * (1 - 1e-9)
        if (mu[a], last[a]) == (mu[b], last[b]):
            assert a < b
    for e in range(num_experts):  # priority is log P
        if mu[e] and p(e) > 1e-300:
            assert math.isclose(math.exp(policy.priority(e, now)), p(e), rel_tol=1e-9)
        elif not mu[e]:
            assert policy.priority(e, now) == -math.inf


def test_lcp_formula_values() -> None:
    policy = LCP(3)  # ω = 128, ρ = 0.25
    for step in (0, 10, 20):
        policy.touch(0, step)
    policy.touch(1, 148)
    # expert 0: μ=3, ν=128 -> 3·0.25 = 0.75; expert 1: μ=1, ν=0 -> 1; expert 2: never used -> 0
    assert math.isclose(math.exp(policy.priority(0, 148)), 0.75)
    assert policy.priority(1, 148) == 0.0  # log 1
    assert policy.ranking(148) == [1, 0, 2]


def test_lcp_keeps_old_experts_apart() -> None:
    """ρ^(ν/ω) underflows to 0 after ~69k idle tokens (ρ = 0.25, ω = 128): in P every old expert
    would tie (ranked by id); log P still ranks the more used one first."""
    policy = LCP(3)
    policy.touch(0, 0)
    for step in range(5):
        policy.touch(1, step)
    now = 200_000
    assert 5 * 0.25 ** ((now - 4) / 128) == 0.0  # P itself has underflowed
    assert policy.ranking(now) == [1, 0, 2]
    assert policy.priority(1, now) > policy.priority(0, now) > policy.priority(2, now)


def test_lcp_miss_always_replaces_the_lowest_priority() -> None:
    """MoEpic §3.3: a miss evicts the lowest-priority cached expert and takes its slot, even when
    the newcomer's own priority is lower (the old admission rule kept it out)."""
    cache = LayerCache(2, LCP(4))
    for e in (0, 1):
        cache.record([[e, e]] * 3)  # μ = 6 each
        cache.advance()
        cache.admit(e)
    cache.record([[1]])  # 1 is now younger than 0
    cache.advance()
    cache.record([[2]])  # 2: μ = 1, far below both
    adm = cache.admit(2)
    assert adm is not None and adm.evicted == 0 and 2 in cache


def test_prefill_ages_experts_token_by_token() -> None:
    """A T-token forward touches token t at step + t: the last prompt tokens' experts are young."""
    cache = LayerCache(0, LCP(4))
    cache.record([[0], [0], [1], [2]])  # experts 0 (twice, first), 1, 2 (last token)
    assert cache.policy.last == [1, 2, 3, -1]
    assert cache.step == 3  # admissions of this forward are decided at its last token
    cache.advance()
    assert cache.step == 4
    # 2 used once at the last token beats 1 used once a token earlier
    assert cache.policy.ranking(cache.step).index(2) < cache.policy.ranking(cache.step).index(1)
