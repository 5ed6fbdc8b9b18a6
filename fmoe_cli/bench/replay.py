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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table

from fmoe_cli.trace import SequenceTrace, Trace, iter_sequences, scan_trace, seekable
from fmoe_cli.errors import FmoeError
from fmoe_cli.offload.cache import LayerCache, replay_token
from fmoe_cli.offload.policies import POLICIES, make_policy

BELADY = "belady"
DEFAULT_EVICTIONS = ("lru", "lfu", "lcp", "random")  # fmoe replay --policies
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


def shared_belady_hits(layer_routes: Sequence[Sequence[Route]], capacity: int) -> int:
    """Hits of the offline optimum over every layer of one sequence with one budget of `capacity` experts shared by
    the layers (MoEpic's configurator may give each layer its own share; a shared pool is the most any split of the
    budget can do): Belady's MIN over the items (layer, expert) in the order a decode step meets them, token by token
    and layer by layer within a token. `layer_routes[j][t]`: layer j's experts of token t."""
    steps = [[(j, e) for e in routes[t]] for t in range(len(layer_routes[0])) for j, routes in enumerate(layer_routes)]
    return belady_hits(steps, capacity)


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


def _check_policies(policies: Sequence[str]) -> list[str]:
    names = [p for p in policies if p != BELADY] + [BELADY]
    for p in names:
        if p != BELADY and p not in POLICIES:
            raise FmoeError(f"unknown policy {p!r}; choose from {', '.join([*POLICIES, BELADY])}")
    return names


class _Hits:
    """Hits per policy and cache size, summed sequence by sequence (a sequence is replayed once read)."""

    def __init__(self, names: list[str], sizes: list[int], num_experts: int, seed: int) -> None:
        self.names, self.sizes, self.num_experts, self.seed = names, sizes, num_experts, seed
        self.hits = {name: dict.fromkeys(sizes, 0) for name in names}
        self.sequences = self.tokens = self.activations = 0

    def add(self, position: int, seq: SequenceTrace) -> None:
        """`position`: the sequence's place in the trace (the random policy's seed stream)."""
        self.sequences += 1
        self.tokens += len(seq.tokens)
        for lj in range(len(seq.records)):
            routes = seq.routes(lj)
            self.activations += sum(len(r) for r in routes)
            for name in self.names:
                for size in self.sizes:
                    self.hits[name][size] += (
                        belady_hits(routes, size) if name == BELADY else
                        policy_hits(routes, name, size, self.num_experts, seed=random_seed(self.seed, position, lj)))

    def result(self, path: str, fmt: str, layers: int, skipped: int) -> ReplayResult:
        a = self.activations
        return ReplayResult(
            trace=path, format=fmt, sequences=self.sequences, tokens=self.tokens, layers=layers,
            experts=self.num_experts, skipped_tokens=skipped, activations=a,
            hit_rate={name: {size: h / a if a else 0.0 for size, h in rates.items()} for name, rates in self.hits.items()},
        )


def replay(trace: Trace, cache_sizes: Sequence[int], policies: Sequence[str], *, seed: int = 0) -> ReplayResult:
    """Hit rate of every policy (and `belady`) for every cache size (experts cached per layer)."""
    hits = _Hits(_check_policies(policies), sorted(set(cache_sizes)), trace.num_experts, seed)
    for position, seq in enumerate(trace.sequences):
        hits.add(position, seq)
    return hits.result(trace.path, trace.format, len(trace.layers), trace.skipped_tokens)


def replay_file(path: str, cache_sizes: Sequence[int], policies: Sequence[str], *, seed: int = 0,
                progress: Callable[[int, int], object] | None = None) -> ReplayResult:
    """`replay` of a trace file, streamed: two passes (check and index, then replay each sequence as soon
    as it is complete), so memory holds the open sequences only, never the whole trace.
    `progress(done, total)`: characters read over both passes."""
    names, sizes = _check_policies(policies), sorted(set(cache_sizes))
    done, size = 0, 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, 2 * size)

    with seekable(path) as p:
        size = p.stat().st_size if p.is_file() else 0
        index = scan_trace(p, advance)
        hits = _Hits(names, sizes, index.num_experts, seed)
        skipped = 0
        for position, seq, skip in iter_sequences(index, advance):
            skipped += skip
            if seq is not None:
                hits.add(position, seq)
    if not hits.sequences:
        raise FmoeError(f"trace {path} has no complete token (one with all {len(index.layers)} layers)")
    return hits.result(str(path), index.format, len(index.layers), skipped)


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


def parse_evictions(text: str) -> list[str]:
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
    table = Table(title=f"Expert cache hit rate: {result.trace}")
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


def footer(result: ReplayResult) -> str:
    """What the table counts, printed under it at the terminal's width (a table caption would wrap
    into the table's narrow column)."""
    skipped = f", {result.skipped_tokens} incomplete tokens skipped" if result.skipped_tokens else ""
    return (f"{result.format} trace: {result.sequences} sequences, {result.tokens} tokens{skipped}, "
            f"{result.layers} layers, {result.experts} experts. Hit rate = hits / activated experts; "
            f"per-layer caches, empty at each sequence start. belady = offline optimum.")


def run_replay(
    trace: str,
    cache_sizes: str = "1-7",
    policies: str = ",".join(DEFAULT_EVICTIONS),
    as_json: bool = False,
    *,
    seed: int = 0,
    console: Console | None = None,
) -> dict[str, Any]:
    """`fmoe replay TRACE --cache-sizes 1-7 --policies lru,lfu,lcp,random [--json]`.

    Prints the table (or the JSON object) and returns the JSON object. Bad input
    raises FmoeError (one-line message; the CLI exits with code 2)."""
    sizes = parse_cache_sizes(cache_sizes)
    names = parse_evictions(policies)
    err = Console(stderr=True)  # the bar only on a terminal (a transient bar leaves a blank line elsewhere)
    with Progress(TextColumn("replaying {task.description}"), BarColumn(), TaskProgressColumn(),
                  TimeRemainingColumn(), console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task(Path(trace).name, total=None)
        result = replay_file(trace, sizes, names, seed=seed,
                             progress=lambda done, total: bar.update(task, completed=done, total=total))
    obj = result.to_json()
    if as_json:
        out = console.file if console is not None else sys.stdout
        out.write(json.dumps(obj, indent=2) + "\n")
    else:
        console = console or Console()
        console.print(render_table(result))
        console.print(footer(result), style="dim", highlight=False)
    return obj
