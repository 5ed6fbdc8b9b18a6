"""`fmoe replay`: replay a routing trace through the engine's cache policies.

Every (sequence, layer) pair gets its own `LayerCache` (the engine's class, with
the engine's policy objects), starting empty; each token goes through
`replay_token` exactly as in the engine: the token's experts that are cached
count as hits, then the misses are offered to the cache in the order the trace
lists them (the token's experts are pinned meanwhile, so a token never evicts
one of its own experts).

    hit rate = hits / activated experts   (summed over sequences and layers)

`belady` is the offline optimum for the same model: after each token the cache
may keep any `capacity` experts out of (cached ∪ this token's experts); keeping
those used again soonest maximises hits (Belady's MIN, bypass allowed: a missed
expert that is needed later than everything cached is not admitted). Every
policy's caches are such subsets, so `belady` is never below any of them.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from fmoe_cli.trace import Trace, read_trace
from fmoe_cli.errors import FmoeError
from fmoe_cli.offload.cache import LayerCache, replay_token
from fmoe_cli.offload.policies import POLICIES, make_policy

BELADY = "belady"
DEFAULT_POLICIES = ("lru", "lfu", "lcp", "random")
Route = Sequence[int]


# --- the simulations -------------------------------------------------------


def policy_hits(routes: Sequence[Route], policy: str, capacity: int, num_experts: int, *, seed: int = 0) -> int:
    """Hits of one policy over one layer of one sequence, from an empty cache."""
    cache = LayerCache(capacity, make_policy(policy, num_experts, seed=seed))
    return sum(replay_token(cache, route) for route in routes)


def belady_hits(routes: Sequence[Route], capacity: int) -> int:
    """Hits of the offline optimum over one layer of one sequence, from an empty cache."""
    if capacity <= 0:
        return 0
    uses: dict[int, list[int]] = {}
    for t, route in enumerate(routes):
        for e in route:
            uses.setdefault(e, []).append(t)
    nxt = dict.fromkeys(uses, 0)  # index into uses[e] of e's first use at or after the current token
    never = math.inf
    cached: set[int] = set()
    hits = 0
    for route in routes:
        hits += sum(1 for e in route if e in cached)
        for e in route:
            nxt[e] += 1

        def next_use(e: int) -> float:
            u = uses[e]
            i = nxt[e]
            return u[i] if i < len(u) else never

        pool = cached.union(route)
        if len(pool) <= capacity:
            cached = pool
        else:
            # Ties on the next use: the lower id stays (any choice is optimal).
            cached = set(sorted(pool, key=lambda e: (next_use(e), e))[:capacity])
    return hits


def random_seed(seed: int, sequence: int, layer: int) -> int:
    """The random policy's seed for one (sequence, layer) cache: distinct streams, reproducible runs."""
    return seed + 1_000_003 * sequence + 7_919 * layer


# --- the replay ------------------------------------------------------------


@dataclass(frozen=True)
class ReplayResult:
    trace: str
    format: str
    sequences: int
    tokens: int
    layers: int
    experts: int
    skipped_tokens: int
    activations: int
    hit_rate: dict[str, dict[int, float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The `--json` object: {"trace", "sequences", "tokens", "layers", "experts", "hit_rate"}."""
        return {
            "trace": self.trace,
            "sequences": self.sequences,
            "tokens": self.tokens,
            "layers": self.layers,
            "experts": self.experts,
            "hit_rate": {p: dict(rates) for p, rates in self.hit_rate.items()},
        }


def replay(trace: Trace, cache_sizes: Sequence[int], policies: Sequence[str], *, seed: int = 0) -> ReplayResult:
    """Hit rate of every policy (and `belady`) for every cache size (experts cached per layer)."""
    names = [p for p in policies if p != BELADY] + [BELADY]
    for p in names:
        if p != BELADY and p not in POLICIES:
            raise FmoeError(f"unknown policy {p!r}; choose from {', '.join([*POLICIES, BELADY])}")
    sizes = sorted(set(cache_sizes))
    activations = trace.num_activations
    hit_rate: dict[str, dict[int, float]] = {}
    per_layer = [
        (si, lj, seq.routes(lj)) for si, seq in enumerate(trace.sequences) for lj in range(len(trace.layers))
    ]
    for name in names:
        rates: dict[int, float] = {}
        for size in sizes:
            if name == BELADY:
                hits = sum(belady_hits(routes, size) for _, _, routes in per_layer)
            else:
                hits = sum(
                    policy_hits(routes, name, size, trace.num_experts, seed=random_seed(seed, si, lj))
                    for si, lj, routes in per_layer
                )
            rates[size] = hits / activations if activations else 0.0
        hit_rate[name] = rates
    return ReplayResult(
        trace=trace.path,
        format=trace.format,
        sequences=len(trace.sequences),
        tokens=trace.num_tokens,
        layers=len(trace.layers),
        experts=trace.num_experts,
        skipped_tokens=trace.skipped_tokens,
        activations=activations,
        hit_rate=hit_rate,
    )


# --- command-line helpers ----------------------------------------------------


def parse_cache_sizes(text: str) -> list[int]:
    """'1-7' -> [1..7]; '2,4,6' -> [2, 4, 6]; '1-3,6' -> [1, 2, 3, 6]."""
    sizes: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise FmoeError(f"--cache-sizes: {part!r} is not a size or a range like 1-7") from None
        if a < 0 or b < a:
            raise FmoeError(f"--cache-sizes: {part!r} must be a size >= 0 or a range low-high with low <= high")
        if b - a > 100_000:
            raise FmoeError(f"--cache-sizes: range {part!r} is too long")
        sizes.update(range(a, b + 1))
    if not sizes:
        raise FmoeError("--cache-sizes: give at least one size, for example 1-7 or 2,4,6")
    return sorted(sizes)


def parse_policies(text: str) -> list[str]:
    """'lru,lfu,lcp,random' -> the names, in order, without repeats (belady is always added)."""
    names: list[str] = []
    for raw in text.split(","):
        name = raw.strip().lower()
        if not name:
            continue
        if name != BELADY and name not in POLICIES:
            raise FmoeError(f"--policies: unknown policy {name!r}; choose from {', '.join([*POLICIES, BELADY])}")
        if name not in names:
            names.append(name)
    if not names:
        raise FmoeError(f"--policies: give at least one of {', '.join(POLICIES)}")
    return names


def render_table(result: ReplayResult) -> Table:
    """Rows: policies; columns: experts cached per layer; the best online policy of each column in bold."""
    sizes = sorted({s for rates in result.hit_rate.values() for s in rates})
    skipped = f", {result.skipped_tokens} incomplete tokens skipped" if result.skipped_tokens else ""
    table = Table(
        title=f"Expert cache hit rate: {result.trace}",
        caption=(
            f"{result.format} trace: {result.sequences} sequences, {result.tokens} tokens{skipped}, "
            f"{result.layers} layers, {result.experts} experts. Hit rate = hits / activated experts; "
            f"per-layer caches, empty at each sequence start. belady = offline optimum."
        ),
    )
    table.add_column("policy")
    for s in sizes:
        table.add_column(f"C={s}", justify="right")
    online = [p for p in result.hit_rate if p != BELADY]
    best = {s: max((result.hit_rate[p][s] for p in online), default=None) for s in sizes}
    for p, rates in result.hit_rate.items():
        cells = []
        for s in sizes:
            text = f"{rates[s]:.3f}"
            cells.append(f"[bold]{text}[/bold]" if p != BELADY and rates[s] == best[s] else text)
        label = "belady (optimum)" if p == BELADY else p
        table.add_row(label, *cells, style="dim" if p == BELADY else None)
    return table


def run_replay(
    trace: str,
    cache_sizes: str = "1-7",
    policies: str = ",".join(DEFAULT_POLICIES),
    as_json: bool = False,
    *,
    seed: int = 0,
    console: Console | None = None,
) -> dict[str, Any]:
    """`fmoe replay TRACE --cache-sizes 1-7 --policies lru,lfu,lcp,random [--json]`.

    Prints the table (or the JSON object) and returns the JSON object. Bad input
    raises FmoeError (one-line message; the CLI exits with code 2)."""
    sizes = parse_cache_sizes(cache_sizes)
    names = parse_policies(policies)
    result = replay(read_trace(trace), sizes, names, seed=seed)
    obj = result.to_json()
    if as_json:
        out = console.file if console is not None else sys.stdout
        out.write(json.dumps(obj, indent=2) + "\n")
    else:
        (console or Console()).print(render_table(result))
    return obj
