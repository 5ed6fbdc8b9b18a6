#!/usr/bin/env python3
"""Issue 22 §5: does `moepic` follow the link? TPOT of every policy on the demo at several emulated links.

For each round r = 1..R and each link X (GB/s, emulated), one process runs

    fmoe bench demo --emulate-link X --vram-budget 25% --policy P1 --policy P2 … --json

with every policy (the order reversed on every other round, so no policy always runs first or last);
rounds are interleaved (round r runs every link before round r + 1). Each link has its own config
directory, kept across rounds as a user on that link would have it (its routing statistics grow, its
quick timing estimate is measured once and kept). Printed per link: each policy's median TPOT over the
rounds with the spread (min–max), and `moepic` ÷ the best other policy (`resident` excluded: it ignores
the budget); the issue's target is ≤ 1.05 at 1, 4 and 16 GB/s.

    python benchmarks/link_policies.py                       # 5 rounds, links 1,4,16
    python benchmarks/link_policies.py --rounds 3 --links 4 --tokens 32 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

POLICIES = ("moepic", "lru", "lfu", "uniform", "cache-only", "prefetch-only", "ondemand", "resident")


def bench(link: float, policies: list[str], config_dir: Path, tokens: int | None, model: str) -> dict:
    """One `fmoe bench` process; its --json object."""
    args = [sys.executable, "-m", "fmoe_cli.cli", "bench", model, "--emulate-link", f"{link:g}", "--vram-budget", "25%",
            "--json"]
    for policy in policies:
        args += ["--policy", policy]
    if tokens is not None:
        args += ["--tokens", str(tokens)]
    env = dict(os.environ, XDG_CONFIG_HOME=str(config_dir))
    done = subprocess.run(args, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"fmoe bench failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--links", default="1,4,16", help="GB/s, comma-separated")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--tokens", type=int, default=None, help="tokens per policy (default: fmoe bench's)")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    links = [float(x) for x in args.links.split(",")]
    policies = args.policies.split(",")
    tpot: dict[float, dict[str, list[float]]] = {x: {p: [] for p in policies} for x in links}
    plans: dict[float, list[str]] = {x: [] for x in links}
    with tempfile.TemporaryDirectory(prefix="fmoe-link-policies-") as tmp:
        for r in range(args.rounds):
            order = policies if r % 2 == 0 else list(reversed(policies))
            for x in links:
                report = bench(x, order, Path(tmp) / f"link-{x:g}", args.tokens, args.model)
                for run in report["runs"]:
                    tpot[x][run["policy"]].append(run["tpot_ms"]["median"])
                    if run["policy"] == "moepic":
                        plans[x].append(run.get("plan", ""))
                print(f"round {r + 1}/{args.rounds}, {x:g} GB/s: "
                      + ", ".join(f"{run['policy']} {run['tpot_ms']['median']:.1f}" for run in report["runs"]),
                      file=sys.stderr, flush=True)
    out = {"command": " ".join(sys.argv), "rounds": args.rounds, "links": {}}
    for x in links:
        medians = {p: statistics.median(v) for p, v in tpot[x].items() if v}
        others = {p: m for p, m in medians.items() if p not in ("moepic", "resident")}
        best = min(others, key=others.get) if others else None
        ratio = medians["moepic"] / others[best] if best and "moepic" in medians else None
        out["links"][f"{x:g}"] = {"tpot_ms": {p: {"median": medians[p], "min": min(v), "max": max(v), "rounds": v}
                                              for p, v in tpot[x].items() if v},
                                  "best_other": best, "moepic_over_best": ratio, "moepic_plans": plans[x]}
    if args.json:
        print(json.dumps(out))
        return
    print(f"emulated links (GB/s), the demo at --vram-budget 25%, {args.rounds} interleaved rounds; "
          f"TPOT ms: median (min–max)")
    for x, row in out["links"].items():
        cells = " · ".join(f"{p} {t['median']:.1f} ({t['min']:.1f}–{t['max']:.1f})" for p, t in row["tpot_ms"].items())
        ratio = row["moepic_over_best"]
        print(f"{x} GB/s: {cells}; moepic ÷ best other ({row['best_other']}) = "
              + (f"{ratio:.3f}" if ratio is not None else "—"))
        print(f"  moepic's plans: {sorted(set(row['moepic_plans']))}")


if __name__ == "__main__":
    main()
