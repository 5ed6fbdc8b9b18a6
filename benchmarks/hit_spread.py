#!/usr/bin/env python3
"""Issue 38: is a token's number of cache hits binomial? The configurator prices a layer per token
(planning/configurator.py: hidden_distribution) with a token's hits independent draws of H_i(C): Binomial(min(K, C),
K·H_i(C) / min(K, C)). This replays a trace's routing through the engine's own cache class (offload/cache.py:
LayerCache with LCP, admitting as the engine does: a token's hits pinned, each miss offered, every pin released at
the layer's end) and prints, per layer and cache size, the share of tokens with h = 0..K hits beside the binomial of
the same mean, and the total variation distance between the two (0: the same distribution, 1: disjoint).

    python benchmarks/hit_spread.py [--trace FILE] [--sizes 3,5] [--json]

The trace: traces/demo.jsonl by default; the Mixtral HumanEval trace with --trace FILE (not shipped:
benchmarks/mixtral_trace.py says where to get it). Measures nothing on a device: a replay of routing, deterministic.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from math import comb
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def hit_counts(sequences, layer: int, cache_size: int, num_experts: int, top_k: int) -> list[int]:
    """How many of the layer's tokens had h = 0..K of their experts cached, the cache run as the engine runs it."""
    from fmoe_cli.offload.cache import LayerCache
    from fmoe_cli.offload.policies import make_policy

    cache = LayerCache(cache_size, make_policy("lcp", num_experts))
    counts = [0] * (top_k + 1)
    for sequence in sequences:
        for token in sequence:
            experts = token.experts[layer]
            cache.record([experts])
            hits = [e for e in experts if e in cache]
            pinned = list(hits)
            for e in hits:
                cache.pin(e)
            for e in experts:
                if e not in hits and cache.admit(e) is not None:
                    cache.pin(e)
                    pinned.append(e)
            for e in pinned:
                cache.unpin(e)
            cache.advance()
            counts[len(hits)] += 1
    return counts


def binomial_of_mean(shares: list[float], cache_size: int) -> list[float]:
    """Binomial(min(K, C), mean / min(K, C)) over h = 0..K: the configurator's distribution of the same hit rate."""
    top_k = len(shares) - 1
    trials = min(top_k, cache_size)
    p = sum(h * s for h, s in enumerate(shares)) / trials if trials else 0.0
    return [comb(trials, h) * p ** h * (1 - p) ** (trials - h) if h <= trials else 0.0 for h in range(top_k + 1)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=None, help="a routing trace (default: traces/demo.jsonl)")
    p.add_argument("--sizes", default=None, help="cache sizes C, comma-separated (default: K + 1 and 2K + 1)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    trace_path = Path(args.trace) if args.trace else HERE.parent / "traces" / "demo.jsonl"
    if not trace_path.is_file():
        print(f"error: no trace at {trace_path}", file=sys.stderr)
        raise SystemExit(2)
    try:
        sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else None
    except ValueError:
        print(f"error: --sizes takes whole numbers separated by commas, not {args.sizes!r}", file=sys.stderr)
        raise SystemExit(2)
    if sizes is not None and any(s < 1 for s in sizes):
        print("error: --sizes must be at least 1", file=sys.stderr)
        raise SystemExit(2)

    from fmoe_cli.planning.simulate import tokens_of
    from fmoe_cli.trace import read_trace

    trace = read_trace(trace_path)
    sequences = tokens_of(trace)
    first = sequences[0][0]
    num_layers, top_k = len(first.experts), len(first.experts[0])
    num_experts = trace.num_experts
    sizes = sizes or [top_k + 1, 2 * top_k + 1]
    report = {"trace": trace_path.name, "top_k": top_k, "num_experts": num_experts, "sizes": {}}
    for size in sizes:
        rows = []
        for layer in range(num_layers):
            counts = hit_counts(sequences, layer, size, num_experts, top_k)
            shares = [c / sum(counts) for c in counts]
            binomial = binomial_of_mean(shares, size)
            distance = 0.5 * sum(abs(a - b) for a, b in zip(shares, binomial))
            rows.append({"layer": layer, "measured": shares, "binomial": binomial, "total_variation": distance})
        distances = [r["total_variation"] for r in rows]
        report["sizes"][size] = {"layers": rows, "median_total_variation": statistics.median(distances),
                                 "max_total_variation": max(distances)}
    if args.json:
        print(json.dumps(report))
        return
    print(f"{report['trace']}: K = {top_k} of N = {num_experts}, {num_layers} layers; share of tokens with h hits, "
          "the cache (LayerCache, LCP) against the binomial of the same mean")
    for size, by_size in report["sizes"].items():
        print(f"C = {size}: total variation median {by_size['median_total_variation']:.3f}, "
              f"max {by_size['max_total_variation']:.3f}")
        for row in by_size["layers"]:
            measured = " ".join(f"{s:.3f}" for s in row["measured"])
            binomial = " ".join(f"{s:.3f}" for s in row["binomial"])
            print(f"  layer {row['layer']:>2}: {measured}  |  {binomial}  ({row['total_variation']:.3f})")


if __name__ == "__main__":
    main()
