"""`fmoe replay`: hit rates against a plain brute-force simulation, Belady's optimality, the CLI helpers."""

from __future__ import annotations

import io
import itertools
import json
import math
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from fmoe_cli.bench.replay import (
    belady_hits,
    parse_cache_sizes,
    parse_evictions,
    policy_hits,
    random_seed,
    replay,
    run_replay,
    shared_belady_hits,
)
from fmoe_cli.trace import TraceWriter, read_trace
from fmoe_cli.errors import FmoeError

POLICIES = ("lru", "lfu", "lcp", "random")


# --- an independent, deliberately plain simulation ---------------------------------


def brute_force(routes: list[list[int]], policy: str, capacity: int, num_experts: int, seed: int = 0) -> int:
    """The rules spelled out: a token's cached experts are hits; then every activated
    expert is counted (μ) and stamped (last use); then each missed expert, in trace
    order, takes a free slot or replaces a cached expert that this token does not use:
      lru: the least recently used (lowest id on ties);
      lfu: the least often used, then least recently used, then lowest id;
      lcp: the lowest P = μ·ρ^(ν/ω) (ω=128, ρ=0.25; compared as log P, lowest id on ties),
           always replaced (MoEpic §3.3: no admission test);
      random: a uniformly random one (random.Random(seed).choice over the sorted ids)."""
    capacity = min(capacity, num_experts)
    rng = random.Random(seed)
    count = [0] * num_experts
    last = [-1] * num_experts
    cache: set[int] = set()
    hits = 0

    def lcp(e: int, now: int) -> float:  # log P = log μ + ν · log ρ / ω
        return -math.inf if count[e] == 0 else math.log(count[e]) + (now - last[e]) * (math.log(0.25) / 128)

    for now, route in enumerate(routes):
        hits += len([e for e in route if e in cache])
        for e in route:
            count[e] += 1
            last[e] = now
        for e in route:
            if e in cache:
                continue
            if len(cache) < capacity:
                cache.add(e)
                continue
            others = sorted(c for c in cache if c not in route)
            if not others:
                continue
            if policy == "lru":
                victim = min(others, key=lambda c: (last[c], c))
            elif policy == "lfu":
                victim = min(others, key=lambda c: (count[c], last[c], c))
            elif policy == "lcp":
                victim = min(others, key=lambda c: (lcp(c, now), c))
            else:
                victim = rng.choice(others)
            cache.remove(victim)
            cache.add(e)
    return hits


def exhaustive_optimum(routes: list[list[int]], capacity: int) -> int:
    """Best hits over every possible cache content after every token (subsets of cached ∪ token)."""
    best = {frozenset(): 0}
    for route in routes:
        nxt: dict[frozenset, int] = {}
        for cached, h in best.items():
            h += len(cached.intersection(route))
            pool = sorted(cached.union(route))
            for k in range(min(capacity, len(pool)) + 1):
                for keep in itertools.combinations(pool, k):
                    key = frozenset(keep)
                    if nxt.get(key, -1) < h:
                        nxt[key] = h
        best = nxt
    return max(best.values())


def routes_strategy(max_experts: int = 8, max_tokens: int = 40):
    @st.composite
    def build(draw):
        e = draw(st.integers(1, max_experts))
        k = draw(st.integers(1, min(3, e)))
        skew = draw(st.sampled_from([None, 0.5, 2.0]))  # uniform, mild or strong locality
        n = draw(st.integers(0, max_tokens))
        rng = random.Random(draw(st.integers(0, 2**32)))
        weights = None if skew is None else [1 / (i + 1) ** skew for i in range(e)]
        routes = []
        for _ in range(n):
            route: list[int] = []
            while len(route) < k:
                x = rng.choices(range(e), weights)[0]
                if x not in route:
                    route.append(x)
            routes.append(route)
        return e, routes

    return build()


def _write_trace(path: Path, num_experts: int, seqs: list[list[list[list[int]]]]) -> Path:
    """seqs[s][layer][token] -> route."""
    with TraceWriter(path, num_layers=len(seqs[0]), num_experts=num_experts) as w:
        for s, layers in enumerate(seqs):
            for layer, routes in enumerate(layers):
                for t, route in enumerate(routes):
                    w.record(f"s{s}", t, layer, route, [1 / len(route)] * len(route))
    return path


# --- hit rates equal the brute force ----------------------------------------------


@settings(max_examples=60, deadline=None)
@given(routes_strategy(), st.integers(0, 9), st.sampled_from(POLICIES), st.integers(0, 5))
def test_policy_hits_equal_brute_force(case, capacity: int, policy: str, seed: int) -> None:
    e, routes = case
    assert policy_hits(routes, policy, capacity, e, seed=seed) == brute_force(routes, policy, capacity, e, seed)


def test_lcp_brute_force_over_long_gaps() -> None:
    # Long enough for ν/ω to matter: an expert used often long ago against a recent one.
    routes = [[0, 1]] * 300 + [[2, 3]] * 200 + [[4, 0]] * 50 + [[1, 5]] * 400 + [[2, 0]] * 30
    rng = random.Random(1)
    routes += [rng.sample(range(6), 2) for _ in range(500)]
    for capacity in range(1, 6):
        for policy in POLICIES:
            assert policy_hits(routes, policy, capacity, 6) == brute_force(routes, policy, capacity, 6), (policy, capacity)


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_replay_equals_brute_force_on_synthetic_traces(tmp_path_factory, data) -> None:
    e, _ = data.draw(routes_strategy(max_tokens=0))
    e = max(e, 2)
    n_seq, n_layers = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    seqs = []
    for _ in range(n_seq):
        n_tok = data.draw(st.integers(1, 25))
        seqs.append([
            [data.draw(st.lists(st.integers(0, e - 1), min_size=1, max_size=min(2, e), unique=True)) for _ in range(n_tok)]
            for _ in range(n_layers)
        ])
    path = _write_trace(tmp_path_factory.mktemp("r") / "t.jsonl", e, seqs)
    trace = read_trace(path)
    sizes = [0, 1, 2, 3, e + 2]
    result = replay(trace, sizes, list(POLICIES), seed=3)
    total = sum(len(r) for layers in seqs for routes in layers for r in routes)
    assert result.activations == total
    assert result.tokens == sum(len(layers[0]) for layers in seqs)
    for policy in POLICIES:
        for size in sizes:
            hits = sum(
                brute_force(routes, policy, size, e, random_seed(3, s, j))
                for s, layers in enumerate(seqs)
                for j, routes in enumerate(layers)
            )
            assert result.hit_rate[policy][size] == hits / total
    for size in sizes:
        hits = sum(exhaustive_optimum(routes, size) for layers in seqs for routes in layers) if size <= 3 else None
        if hits is not None:
            assert result.hit_rate["belady"][size] == hits / total


def test_each_sequence_starts_empty(tmp_path: Path) -> None:
    # Same route twice as two sequences: the second one starts cold again.
    seqs = [[[[0], [1], [0], [1]]], [[[0], [1], [0], [1]]]]
    result = replay(read_trace(_write_trace(tmp_path / "t.jsonl", 2, seqs)), [2], ["lru"])
    assert result.hit_rate["lru"][2] == 4 / 8


# --- Belady --------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(routes_strategy(max_experts=5, max_tokens=10), st.integers(0, 5))
def test_belady_is_the_optimum(case, capacity: int) -> None:
    _, routes = case
    assert belady_hits(routes, capacity) == exhaustive_optimum(routes, capacity)


@settings(max_examples=80, deadline=None)
@given(routes_strategy(), st.integers(0, 9), st.integers(0, 3))
def test_belady_never_below_any_policy(case, capacity: int, seed: int) -> None:
    e, routes = case
    best = belady_hits(routes, capacity)
    for policy in POLICIES:
        assert best >= policy_hits(routes, policy, capacity, e, seed=seed), policy


@settings(max_examples=60, deadline=None)
@given(st.lists(routes_strategy(max_experts=5, max_tokens=12), min_size=1, max_size=3), st.integers(0, 3))
def test_a_shared_budget_s_optimum_is_at_least_every_split_of_it(layers, per_layer: int) -> None:
    """One budget for all layers can keep what any split of it keeps: never fewer hits than the per-layer optima
    with `per_layer` each (nor than any uneven split tried), never more than every repeat use."""
    tokens = min(len(routes) for _, routes in layers)
    layer_routes = [routes[:tokens] for _, routes in layers]
    capacity = per_layer * len(layer_routes)
    shared = shared_belady_hits(layer_routes, capacity) if tokens else 0
    assert shared >= sum(belady_hits(routes, per_layer) for routes in layer_routes)
    for split in itertools.product(range(capacity + 1), repeat=len(layer_routes)):
        if sum(split) == capacity:
            assert shared >= sum(belady_hits(routes, c) for routes, c in zip(layer_routes, split))
    assert shared <= sum(len(route) for routes in layer_routes for route in routes)


def test_a_shared_budget_goes_where_the_reuse_is() -> None:
    # Layer 0 alternates two experts, layer 1 never repeats one. One slot a layer: layer 0 keeps one expert (2 hits),
    # layer 1's slot is wasted; two slots shared: both of layer 0's (4 hits).
    layer_routes = [[[0], [1], [0], [1], [0], [1]], [[0], [1], [2], [3], [4], [5]]]
    assert sum(belady_hits(routes, 1) for routes in layer_routes) == 2
    assert shared_belady_hits(layer_routes, 2) == 4


def test_belady_bypasses() -> None:
    # Capacity 1: keeping 0 (used again) beats admitting 1 (never used again).
    assert belady_hits([[0], [1], [0]], 1) == 1
    assert belady_hits([[0], [1], [0]], 0) == 0


# --- CLI helpers -------------------------------------------------------------------


def test_parse_cache_sizes() -> None:
    assert parse_cache_sizes("1-7") == [1, 2, 3, 4, 5, 6, 7]
    assert parse_cache_sizes("2,4,6") == [2, 4, 6]
    assert parse_cache_sizes(" 6, 1-3 ,2") == [1, 2, 3, 6]
    assert parse_cache_sizes("0") == [0]
    for bad in ("", ",", "a", "3-1", "-2", "1-x", "1.5"):
        with pytest.raises(FmoeError, match="--cache-sizes"):
            parse_cache_sizes(bad)


def test_parse_evictions() -> None:
    assert parse_evictions("lru,lfu,lcp,random") == ["lru", "lfu", "lcp", "random"]
    assert parse_evictions(" LRU, lru ,belady") == ["lru", "belady"]
    with pytest.raises(FmoeError, match="unknown policy 'fifo'"):
        parse_evictions("lru,fifo")
    with pytest.raises(FmoeError, match="--policies"):
        parse_evictions(",")


def test_run_replay_json_and_table(tmp_path: Path) -> None:
    seqs = [[[[0, 1], [1, 2], [0, 1], [3, 0]], [[2, 3], [2, 3], [1, 0], [2, 3]]]]
    path = _write_trace(tmp_path / "t.jsonl", 4, seqs)
    buf = io.StringIO()
    obj = run_replay(str(path), "1-2", "lru,lcp", True, console=Console(file=buf))
    printed = json.loads(buf.getvalue())
    assert list(printed) == ["trace", "sequences", "tokens", "layers", "experts", "hit_rate"]
    assert printed["trace"] == str(path)
    assert (printed["sequences"], printed["tokens"], printed["layers"], printed["experts"]) == (1, 4, 2, 4)
    assert list(printed["hit_rate"]) == ["lru", "lcp", "belady"]
    assert list(printed["hit_rate"]["lru"]) == ["1", "2"]
    assert obj["hit_rate"]["belady"][2] == printed["hit_rate"]["belady"]["2"]
    buf = io.StringIO()
    run_replay(str(path), "1-2", "lru,lcp", False, console=Console(file=buf, width=120))
    text = buf.getvalue()
    assert "belady" in text and "C=2" in text and "lcp" in text


def test_run_replay_errors(tmp_path: Path) -> None:
    with pytest.raises(FmoeError, match="does not exist"):
        run_replay(str(tmp_path / "missing.jsonl"), "1-3", "lru", False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"seq": 0, "token": 0, "layer": 0, "experts": [1], "probs": [1]}\n{oops\n')
    with pytest.raises(FmoeError, match=r"bad\.jsonl:2: bad trace line"):
        run_replay(str(bad), "1-3", "lru", True)


def test_shared_trace_replay(mixtral_trace: Path) -> None:
    obj = run_replay(str(mixtral_trace), "2,4,6", "lru,lcp", True, console=Console(file=io.StringIO()))
    assert (obj["sequences"], obj["tokens"], obj["layers"], obj["experts"]) == (2, 333, 32, 8)
    lru, lcp, opt = obj["hit_rate"]["lru"], obj["hit_rate"]["lcp"], obj["hit_rate"]["belady"]
    # The values in docs/traces.md.
    assert [round(lru[c], 3) for c in (2, 4, 6)] == [0.395, 0.620, 0.813]
    assert [round(lcp[c], 3) for c in (2, 4, 6)] == [0.395, 0.638, 0.829]
    assert [round(opt[c], 3) for c in (2, 4, 6)] == [0.565, 0.782, 0.907]


def _many_sequences(path: Path, sequences: int, tokens: int, layers: int, experts: int = 8) -> Path:
    rng = random.Random(0)
    with TraceWriter(path, num_layers=layers, num_experts=experts) as w:
        for s in range(sequences):
            for t in range(tokens):
                for layer in range(layers):
                    w.record(s, t, layer, rng.sample(range(experts), 2), [0.5, 0.5])
    return path


def test_replay_streams_big_traces_with_bounded_memory_and_progress(tmp_path: Path) -> None:
    """A trace is replayed sequence by sequence: the peak memory is a small part of what holding the
    whole trace takes, the result is the same, and the progress reaches both passes' end."""
    import tracemalloc

    from fmoe_cli.bench.replay import replay_file

    path = _many_sequences(tmp_path / "big.jsonl", sequences=300, tokens=12, layers=4)  # ~1.3 MB
    tracemalloc.start()
    whole = read_trace(path)
    _, held = tracemalloc.get_traced_memory()
    del whole
    tracemalloc.reset_peak()
    calls: list[tuple[int, int]] = []
    obj = run_replay(str(path), "2", "lru", True, console=Console(file=io.StringIO()))
    _, streamed = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert streamed < held / 5, (streamed, held)
    assert obj["hit_rate"] == replay(read_trace(path), [2], ["lru"]).to_json()["hit_rate"]
    replay_file(str(path), [2], ["lru"], progress=lambda done, total: calls.append((done, total)))
    size = path.stat().st_size
    assert calls[-1] == (2 * size, 2 * size) and len(calls) >= 3  # a MiB at a time, then the rest


def test_replay_footer_is_not_squeezed_into_the_table(tmp_path: Path) -> None:
    path = _write_trace(tmp_path / "t.jsonl", 4, [[[[0, 1], [1, 2]]]])
    buf = io.StringIO()
    run_replay(str(path), "1", "lru", False, console=Console(file=buf, width=100))
    lines = buf.getvalue().splitlines()
    assert any(line.startswith("fmoe trace: 1 sequences, 2 tokens, 1 layers, 4 experts. Hit rate") for line in lines)


def test_replay_reads_a_pipe(tmp_path: Path) -> None:
    """`fmoe replay <(zcat t.jsonl.gz)`: a pipe is read once (copied aside), then replayed like a file."""
    import os
    import threading

    path = _many_sequences(tmp_path / "t.jsonl", sequences=3, tokens=5, layers=2)
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(path.read_bytes()))
    writer.start()
    piped = run_replay(str(fifo), "1-2", "lru,lcp", True, console=Console(file=io.StringIO()))
    writer.join()
    plain = run_replay(str(path), "1-2", "lru,lcp", True, console=Console(file=io.StringIO()))
    assert piped["hit_rate"] == plain["hit_rate"] and piped["tokens"] == plain["tokens"] == 15
