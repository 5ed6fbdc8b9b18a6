#!/usr/bin/env python3
"""Issue 38: how far any cache policy can go on a routing trace: the online policies' misses against the offline
optimum's, at MoEpic's budget (simulated, deterministic: counts on the trace, no engine, no clock).

Where the link bounds a token (the replayed run's load of 24.4 × one expert's compute: docs/bench.md § MoEpic's table
on the engine), a token costs about the bytes it moves ÷ the link, and a policy's TPOT ÷ lru's is about its misses ÷
lru's. This script counts, on the trace's first `--layers` layers and `--tokens` tokens of each sequence (default:
all), from empty caches at each sequence start:

- each online eviction policy's hits, `--per-layer` experts a layer (fmoe replay's simulation: the engine's
  LayerCache and policy objects);
- `belady`: the offline optimum with the same per-layer caches (Belady's MIN, bypass allowed);
- `belady, shared budget`: the offline optimum with the layers' budget pooled (no split of the budget over the
  layers, MoEpic's configurator's included, keeps more);
- `+ staging`: the same with the `--staging` slots of the staging pool added to the pool (a loose bound: the engine's
  staging slots hold a load for one layer, not across tokens);
- `lru, shared budget` (`+ staging`): their online counterparts, one LRU over (layer, expert) pairs holding the
  layers' budget pooled (and the staging slots kept as cache across tokens): whether pooling or the pool's slots
  would take an online policy towards the bounds.

Split experts do not move the bound: a cache that keeps a fraction y of an expert between two of its uses saves
y of the second use's bytes, and the fractions kept fit the budget at every moment; that is an interval-packing
linear program (each column, one reuse interval, covers consecutive moments), whose matrix is totally unimodular,
so its optimum is whole experts: Belady's. Prefetching moves the same bytes, at best earlier. So no policy (split,
prefetching, any eviction) moves fewer bytes than `belady, shared budget + staging` lets it.

    python benchmarks/cache_bound.py TRACE [--layers 4 --tokens 139] [--per-layer 5] [--staging 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ONLINE = ("lru", "lfu", "lcp", "finemoe")


def count(trace, layers: int, tokens: int | None, per_layer: int, staging: int, policies=ONLINE) -> dict:
    """Hits per policy and bound over the trace's first `layers` layers and `tokens` tokens a sequence."""
    from fmoe_cli.bench.replay import belady_hits, policy_hits, random_seed, shared_belady_hits

    hits = dict.fromkeys([*policies, "lru, shared budget", "lru, shared budget + staging", "belady",
                          "belady, shared budget", "belady, shared budget + staging"], 0)
    activations = 0
    for s, sequence in enumerate(trace.sequences):
        layer_routes = [sequence.routes(j)[:tokens] for j in range(layers)]
        if not layer_routes[0]:
            continue
        for j, routes in enumerate(layer_routes):
            activations += sum(len(route) for route in routes)
            for policy in policies:
                hits[policy] += policy_hits(routes, policy, per_layer, trace.num_experts,
                                            seed=random_seed(0, s, j))
            hits["belady"] += belady_hits(routes, per_layer)
        hits["lru, shared budget"] += shared_lru_hits(layer_routes, per_layer * layers)
        hits["lru, shared budget + staging"] += shared_lru_hits(layer_routes, per_layer * layers + staging)
        hits["belady, shared budget"] += shared_belady_hits(layer_routes, per_layer * layers)
        hits["belady, shared budget + staging"] += shared_belady_hits(layer_routes, per_layer * layers + staging)
    lru_misses = activations - hits["lru"]
    return {"layers": layers, "tokens_per_sequence": tokens, "per_layer": per_layer, "staging": staging,
            "activations": activations,
            "hit_rate": {name: h / activations for name, h in hits.items()},
            "misses_over_lru": {name: (activations - h) / lru_misses for name, h in hits.items()}}


def shared_lru_hits(layer_routes: list, capacity: int) -> int:
    """Online, from empty: one LRU over (layer, expert) pairs of `capacity` experts for all the layers, each token's
    routes visited in layer order as a forward visits them."""
    cache: OrderedDict = OrderedDict()
    hits = 0
    for t in range(min(len(routes) for routes in layer_routes)):
        for j, routes in enumerate(layer_routes):
            for e in routes[t]:
                key = (j, e)
                if key in cache:
                    hits += 1
                    cache.move_to_end(key)
                else:
                    cache[key] = None
                    if len(cache) > capacity:
                        cache.popitem(last=False)  # the least recently used (the new key itself at capacity 0)
    return hits


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--layers", type=int, default=None, help="the trace's first N layers (default: all)")
    parser.add_argument("--tokens", type=int, default=None, help="each sequence's first N tokens (default: all)")
    parser.add_argument("--per-layer", type=int, default=5, help="experts cached a layer (MoEpic: 160 of 32 layers)")
    parser.add_argument("--staging", type=int, default=4, help="staging slots (the replayed run's pool)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if (args.layers is not None and args.layers < 1) or (args.tokens is not None and args.tokens < 1) \
            or args.per_layer < 0 or args.staging < 0:
        parser.error("--layers and --tokens >= 1, --per-layer and --staging >= 0")
    if not Path(args.trace).is_file():
        parser.error(f"no trace at {args.trace}")
    from fmoe_cli.errors import FmoeError
    from fmoe_cli.trace import read_trace

    try:
        trace = read_trace(args.trace)
    except FmoeError as exc:
        parser.error(str(exc))
    layers = len(trace.layers) if args.layers is None else args.layers
    if layers > len(trace.layers):
        parser.error(f"--layers {layers}: the trace has {len(trace.layers)}")
    result = count(trace, layers, args.tokens, args.per_layer, args.staging)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{Path(args.trace).name}: {layers} layers, {args.tokens or 'all'} tokens a sequence, "
          f"{result['activations']} activations; {args.per_layer} experts a layer, {args.staging} staging slots "
          "(simulated: counts on the trace)")
    print(f"{'':34}{'hit rate':>9}{'misses ÷ lru':>14}")
    for name, rate in result["hit_rate"].items():
        print(f"{name:34}{rate:9.3f}{result['misses_over_lru'][name]:14.3f}")


if __name__ == "__main__":
    main()
