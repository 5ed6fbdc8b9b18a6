#!/usr/bin/env python3
"""Issue 22 §5: does `moepic` follow the link? TPOT of every policy on the demo at several emulated links.

For each link X (GB/s, emulated), one process runs

    fmoe bench demo --emulate-link X --vram-budget 25% --policy P1 --policy P2 … --rounds R --json

with every policy: R rounds inside the one process, each round running every policy once (the order reversed
every other round, so no policy always runs first or last), each run re-planned from the statistics so far and
its cache warmed afresh. `--processes` runs the older way instead: one `fmoe bench` process per link and round
(`--rounds 1`), rounds interleaved across links (round r runs every link before round r + 1). Separate
processes on this VM move a policy's TPOT by 30–50 % from one to the next even on a quiet machine (docs/bench.md
§ `moepic` across links), which no 5-round run resolves to 5 %; inside one process every policy shares the
process's placement and drift. Each link has its own config directory, kept across runs as a user on that
link would have it (its routing statistics grow, its quick timing estimate is measured once and kept;
`--profile` profiles each link once first instead, `fmoe profile --model demo --emulate-link X`). Printed per
link: each policy's median TPOT over the rounds with the spread (min–max), and `moepic` ÷ each other policy
paired within each round, median and min–max over the rounds; `moepic` ÷ the best other policy (`resident`
excluded: it ignores the budget; the best is the one of least median TPOT) is the issue's figure, target ≤ 1.05
at 1, 4 and 16 GB/s.

`--clock cpu` (the default) runs the emulated link on the process's CPU time (FMOE_EMULATED_CLOCK=cpu,
offload/link.py: CpuClock; one compute thread): a token's time is the CPU time the process spent on it
plus the link's modelled waits, so the other work of a shared machine does not enter it (it still
slows the process's caches a little). `--clock wall` is the wall clock, as `fmoe bench` measures
by default. Either way the figures are measured (emulated link), not simulated.

    python benchmarks/link_policies.py                       # 5 rounds in a process a link, links 1,4,16, CPU-time clock
    python benchmarks/link_policies.py --processes           # a process per link and round
    python benchmarks/link_policies.py --rounds 3 --links 4 --tokens 32 --json
    python benchmarks/link_policies.py --pool DIR [DIR …]    # the rounds of earlier --raw runs, pooled

`--pool` runs nothing: it reads the rounds several runs kept (`--raw DIR`: `roundR-linkX.json`, one round's report,
cut out of the link's whole report `linkX.json` when the rounds ran in one process), pools them per link
and prints, per link, `moepic` ÷ each policy paired within each round, median and quartiles over every pooled round
(and apart by whether `moepic`'s plan prefetched), and how often a run of `--rounds` rounds drawn from the pool (with
replacement) shows `moepic` ≤ 1.05 × the best other policy, on the paired median and on the ratio of medians: what
one run's verdict is worth at this noise (the best other is chosen by the run's own medians, so a tie reads above
1 more often than below).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

POLICIES = ("moepic", "lru", "lfu", "uniform", "cache-only", "prefetch-only", "ondemand", "resident")


def child_env(config_dir: Path, clock: str) -> dict:
    return dict(os.environ, XDG_CONFIG_HOME=str(config_dir), FMOE_EMULATED_CLOCK=clock)


def profile(link: float, config_dir: Path, model: str, clock: str) -> None:
    """`fmoe profile --model MODEL --emulate-link X` into the link's config directory (the runs plan with it)."""
    args = [sys.executable, "-m", "fmoe_cli.cli", "profile", "--model", model, "--emulate-link", f"{link:g}"]
    done = subprocess.run(args, capture_output=True, text=True, env=child_env(config_dir, clock))
    if done.returncode != 0:
        raise SystemExit(f"fmoe profile failed ({done.returncode}): {done.stderr.strip()[-2000:]}")


def bench(link: float, policies: list[str], config_dir: Path, tokens: int | None, model: str, clock: str,
          rounds: int = 1) -> dict:
    """One `fmoe bench` process (`--rounds`: its rounds inside it); its --json object."""
    args = [sys.executable, "-m", "fmoe_cli.cli", "bench", model, "--emulate-link", f"{link:g}", "--vram-budget", "25%",
            "--rounds", str(rounds), "--json"]
    for policy in policies:
        args += ["--policy", policy]
    if tokens is not None:
        args += ["--tokens", str(tokens)]
    done = subprocess.run(args, capture_output=True, text=True, env=child_env(config_dir, clock))
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
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="the emulated link's clock: the process's CPU time (default) or wall time")
    parser.add_argument("--profile", action="store_true",
                        help="profile each link first (fmoe profile --model, --emulate-link X) instead of the quick estimate")
    parser.add_argument("--processes", action="store_true",
                        help="one fmoe bench process per link and round (the default: a process per link, rounds inside)")
    parser.add_argument("--raw", default=None, help="a directory to keep every fmoe bench --json report in")
    parser.add_argument("--pool", nargs="+", default=None, metavar="DIR",
                        help="run nothing: pool the rounds of earlier runs' --raw directories")
    parser.add_argument("--aa", default=None, metavar="POLICY",
                        help="an A/A test instead: this one policy, --copies × --rounds runs a link in one process, "
                             "dealt out to copies as rounds interleave policies; each copy read as moepic")
    parser.add_argument("--copies", type=int, default=7, help="--aa: stand-in policies (7: moepic and six others)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.rounds < 1 or args.copies < 2:
        parser.error(f"--rounds must be at least 1 and --copies at least 2, got {args.rounds} and {args.copies}")
    if args.aa:
        run_aa(args)
        return
    if args.pool:
        pooled = {link: pool_summary(rounds, args.rounds) for link, rounds in sorted(
            read_rounds([Path(d) for d in args.pool]).items(), key=lambda item: float(item[0]))}
        print(json.dumps(pooled) if args.json else render_pool(pooled, args.pool))
        return
    links = [float(x) for x in args.links.split(",")]
    policies = args.policies.split(",")
    tpot: dict[float, dict[str, list[float]]] = {x: {p: [] for p in policies} for x in links}
    plans: dict[float, list[str]] = {x: [] for x in links}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="fmoe-link-policies-") as tmp:
        if args.profile:
            for x in links:
                profile(x, Path(tmp) / f"link-{x:g}", args.model, args.clock)
        def keep(name: str, report: dict) -> None:
            keep_raw(args.raw, name, report)

        def record(x: float, r: int, report: dict) -> None:
            """Round r's report at link x (one process's, or one round cut out of a process's rounds)."""
            keep(f"round{r + 1}-link{x:g}.json", report)
            for run in report["runs"]:
                tpot[x][run["policy"]].append(run["tpot_ms"]["median"])
                if run["policy"] == "moepic":
                    plans[x].append(run.get("plan", ""))
            print(f"round {r + 1}/{args.rounds}, {x:g} GB/s: "
                  + ", ".join(f"{run['policy']} {run['tpot_ms']['median']:.1f}" for run in report["runs"]),
                  file=sys.stderr, flush=True)

        if args.processes:
            for r in range(args.rounds):
                order = policies if r % 2 == 0 else list(reversed(policies))
                for x in links:
                    record(x, r, bench(x, order, Path(tmp) / f"link-{x:g}", args.tokens, args.model, args.clock))
                    loads.append(os.getloadavg()[0])
        else:
            for x in links:
                report = bench(x, policies, Path(tmp) / f"link-{x:g}", args.tokens, args.model, args.clock, args.rounds)
                loads.append(os.getloadavg()[0])
                keep(f"link{x:g}.json", report)
                for r in range(args.rounds):
                    record(x, r, one_round(report, r))
        inputs = {x: plan_inputs(Path(tmp) / f"link-{x:g}", Path(args.raw) / f"link{x:g}-config" if args.raw else None)
                  for x in links}
    out = {"command": " ".join(sys.argv), "rounds": args.rounds, "processes": args.processes, "clock": args.clock,
           "tokens": args.tokens,
           "load_average": {"min": min(loads), "max": max(loads)}, "links": {}}
    for x in links:
        rounds = [{p: v[r] for p, v in tpot[x].items() if v} for r in range(args.rounds)]
        out["links"][f"{x:g}"] = dict(summarise(tpot[x], plans[x]), plan_inputs=inputs[x],
                                      interval=interval(rounds) if "moepic" in tpot[x] and len(tpot[x]) > 2 else None)
    if args.json:
        print(json.dumps(out))
        return
    print(f"emulated links (GB/s), the demo at --vram-budget 25%, {args.rounds} interleaved rounds "
          f"({'a process each' if args.processes else 'in one process a link'}), "
          f"{args.clock} clock, load average {min(loads):.1f}–{max(loads):.1f}; TPOT ms: median (min–max); "
          f"moepic ÷ P: the per-round ratio's median (min–max)")
    for x, row in out["links"].items():
        cells = " · ".join(f"{p} {t['median']:.2f} ({t['min']:.2f}–{t['max']:.2f})" for p, t in row["tpot_ms"].items())
        print(f"{x} GB/s: {cells}")
        print("  moepic ÷ " + " · ".join(f"{p} {q['median']:.3f} ({q['min']:.3f}–{q['max']:.3f})"
                                         for p, q in row["moepic_over"].items()))
        ratio = row["moepic_over_best"]
        print(f"  moepic ÷ best other ({row['best_other']}): " + ("—" if ratio is None else
              f"{ratio['median']:.3f} ({ratio['min']:.3f}–{ratio['max']:.3f}) paired per round; "
              f"{row['moepic_over_best_medians']:.3f} as the ratio of medians"))
        if row["interval"]:
            band = row["interval"]
            print(f"  the run's rounds resampled ({band['level']:.0%} of resamples): paired "
                  f"{band['paired'][0]:.3f}–{band['paired'][1]:.3f}, ratio of medians "
                  f"{band['ratio_of_medians'][0]:.3f}–{band['ratio_of_medians'][1]:.3f}")
        print(f"  moepic's plans: {sorted(set(row['moepic_plans']))}")
        for name, figures in row["plan_inputs"].items():
            print(f"  moepic planned from {name}: " + ", ".join(f"{key} {value * 1e3:.4g} ms" for key, value in figures.items()))


def keep_raw(raw: str | None, name: str, report: dict) -> None:
    """With --raw DIR: one `fmoe bench --json` report kept as DIR/name."""
    if raw:
        Path(raw).mkdir(parents=True, exist_ok=True)
        (Path(raw) / name).write_text(json.dumps(report))


def run_aa(args) -> None:
    """`--aa POLICY`: per link, one `fmoe bench --policy POLICY --rounds copies·rounds` process; `aa_summary`."""
    out = {"command": " ".join(sys.argv), "policy": args.aa, "clock": args.clock, "tokens": args.tokens, "links": {}}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="fmoe-link-aa-") as tmp:
        for x in [float(v) for v in args.links.split(",")]:
            report = bench(x, [args.aa], Path(tmp) / f"link-{x:g}", args.tokens, args.model, args.clock,
                           args.copies * args.rounds)
            loads.append(os.getloadavg()[0])
            keep_raw(args.raw, f"aa-link{x:g}.json", report)
            values = [r["tpot_ms"]["median"] for r in report["runs"][0]["rounds"]]
            out["links"][f"{x:g}"] = aa_summary(values, args.copies)
    out["load_average"] = {"min": min(loads), "max": max(loads)}
    if args.json:
        print(json.dumps(out))
        return
    print(f"A/A: {args.aa} as {args.copies} copies × {args.rounds} interleaved rounds in one process a link, "
          f"{args.clock} clock, load average {min(loads):.1f}–{max(loads):.1f}; each copy read as moepic: its median "
          f"TPOT ÷ the least other copy's (the issue's figure, target ≤ {TARGET})")
    for x, row in out["links"].items():
        print(f"{x} GB/s: medians " + " ".join(f"{m:.2f}" for m in row["medians"]) + " ms; ÷ least other "
              + " ".join(f"{r:.3f}" for r in row["ratio_of_medians"])
              + f"; above {TARGET}: {row['above_target']} of {row['copies']}")


def one_round(report: dict, r: int) -> dict:
    """Round r of an `fmoe bench --rounds N` report, as a one-round report reads (each run's figures that round)."""
    if report.get("rounds", 1) == 1:
        return report
    return dict(report, rounds=1, runs=[dict(run, **run["rounds"][r]) for run in report["runs"]])


HOST_COSTS = ("t_host_load", "t_host_prefetch", "t_admit", "t_segment", "t_expert", "t_host_route", "t_host_submit")


def plan_inputs(config_dir: Path, keep: Path | None) -> dict[str, dict[str, float]]:
    """The engine's costs each timing file of a link's config directory gave the configurator (the quick
    estimate, `….quick.json`, or the profile): h_load, h_pf, a_e, c, T_exp, h_route, by file name; `keep`: a
    directory to copy the link's saved files into (the timings and the statistics as they stood at the end)."""
    found = {}
    for path in sorted(config_dir.rglob("*.json")):
        if keep is not None:
            (keep / path.relative_to(config_dir)).parent.mkdir(parents=True, exist_ok=True)
            (keep / path.relative_to(config_dir)).write_bytes(path.read_bytes())
        try:
            model = json.loads(path.read_text()).get("model")
        except (ValueError, AttributeError):
            continue
        if isinstance(model, dict) and any(key in model for key in HOST_COSTS):
            found[path.name] = {key: float(model[key]) for key in HOST_COSTS if key in model}
    return found


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def summarise(tpot: dict[str, list[float]], plans: list[str]) -> dict:
    """One link's rounds: each policy's TPOT (median, min–max), `moepic` ÷ each policy paired within each round
    (median, min–max over rounds), and the same against the best other policy (least median TPOT)."""
    medians = {p: statistics.median(v) for p, v in tpot.items() if v}
    others = {p: m for p, m in medians.items() if p not in ("moepic", "resident")}
    best = min(others, key=others.get) if others else None
    over = {p: spread([m / o for m, o in zip(tpot["moepic"], v)])
            for p, v in tpot.items() if p != "moepic" and v and tpot.get("moepic")}
    return {"tpot_ms": {p: spread(v) for p, v in tpot.items() if v}, "moepic_over": over,
            "best_other": best, "moepic_over_best": over.get(best),
            "moepic_over_best_medians": medians["moepic"] / others[best] if best and "moepic" in medians else None,
            "moepic_plans": plans}


TARGET = 1.05  # issue 22 §5: moepic ≤ 1.05 × the best other policy's TPOT


def read_rounds(dirs: list[Path]) -> dict[str, list[dict]]:
    """Every round the --raw directories kept, per link: {"4": [{"tpot": {policy: ms}, "prefetch": bool, "source":
    "DIR/roundR-link4.json"}, …]}; `prefetch`: whether `moepic`'s plan in that round prefetched."""
    found: dict[str, list[dict]] = {}
    for directory in dirs:
        for path in sorted(directory.glob("round*-link*.json")):
            link = path.stem.split("-link", 1)[1]
            runs = {run["policy"]: run for run in json.loads(path.read_text())["runs"]}
            if "moepic" not in runs:
                continue
            found.setdefault(link, []).append({
                "tpot": {p: run["tpot_ms"]["median"] for p, run in runs.items()},
                "prefetch": not runs["moepic"].get("plan", "").endswith("no prefetch"),
                "source": str(path)})
    return found


def run_verdict(rounds: list[dict[str, float]]) -> tuple[float, float]:
    """One run's figures from its rounds (each {policy: TPOT}), as `summarise` gives them: `moepic` ÷ the best other
    policy (least median TPOT, `resident` excluded), paired within each round (the median over the rounds), and
    the ratio of the medians."""
    medians = {p: statistics.median(r[p] for r in rounds) for p in rounds[0]}
    others = {p: m for p, m in medians.items() if p not in ("moepic", "resident")}
    best = min(others, key=others.get)
    return statistics.median(r["moepic"] / r[best] for r in rounds), medians["moepic"] / others[best]


def pass_rates(rounds: list[dict[str, float]], per_run: int, draws: int = 4000, seed: int = 0) -> dict[str, float]:
    """How often a run of `per_run` rounds drawn from `rounds` (with replacement) meets TARGET: on the paired median,
    on the ratio of medians, and on both."""
    rng = random.Random(seed)
    paired = medians = both = 0
    for _ in range(draws):
        p, m = run_verdict([rng.choice(rounds) for _ in range(per_run)])
        paired += p <= TARGET
        medians += m <= TARGET
        both += p <= TARGET and m <= TARGET
    return {"paired": paired / draws, "ratio_of_medians": medians / draws, "both": both / draws}


def interval(rounds: list[dict[str, float]], draws: int = 2000, seed: int = 0, level: float = 0.9) -> dict:
    """How far one run's figures could move with its own rounds drawn again: `draws` resamples of the run's rounds
    (with replacement, each round kept whole so the pairs stay paired), `run_verdict` of each; the central `level`
    share of each figure's resamples ({"paired": (low, high), "ratio_of_medians": (low, high)})."""
    rng = random.Random(seed)
    verdicts = [run_verdict([rng.choice(rounds) for _ in rounds]) for _ in range(draws)]
    cut = int(draws * (1 - level) / 2)

    def central(values: list[float]) -> tuple[float, float]:
        ordered = sorted(values)
        return ordered[cut], ordered[draws - 1 - cut]

    return {"paired": central([v[0] for v in verdicts]), "ratio_of_medians": central([v[1] for v in verdicts]),
            "level": level}


def aa_copies(values: list[float], copies: int) -> list[list[float]]:
    """One policy's runs of an A/A test (`--aa`), in the order they ran, dealt out to `copies` stand-in policies as
    `fmoe bench --rounds` interleaves policies: super-round r holds runs r·copies … r·copies + copies − 1, in copy
    order when r is even and reversed when odd (a run left over at the end is dropped)."""
    rounds = len(values) // copies
    return [[values[r * copies + (j if r % 2 == 0 else copies - 1 - j)] for r in range(rounds)] for j in range(copies)]


def aa_summary(values: list[float], copies: int) -> dict:
    """The issue's figure with nothing to find: each copy of one policy read as `moepic` against the other copies,
    its median TPOT ÷ the least of theirs (and paired within each round against that copy); how many copies read
    above TARGET. A machine on which a policy reads above TARGET against copies of itself cannot show ≤ TARGET
    with this many rounds."""
    groups = aa_copies(values, copies)
    medians = [statistics.median(g) for g in groups]
    over = []
    for j in range(copies):
        rounds = [{"moepic": groups[j][r], **{f"copy{i + 1}": groups[i][r] for i in range(copies) if i != j}}
                  for r in range(len(groups[j]))]
        over.append(run_verdict(rounds))
    return {"copies": copies, "rounds": len(groups[0]), "medians": medians,
            "ratio_of_medians": [o[1] for o in over], "paired": [o[0] for o in over],
            "above_target": sum(o[1] > TARGET for o in over)}


def quartiles(values: list[float]) -> dict:
    q1, q2, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return {"median": statistics.median(values), "q1": q1, "q3": q3, "rounds": len(values)}


def pool_summary(rounds: list[dict], per_run: int) -> dict:
    """One link's pooled rounds: `moepic` ÷ each policy paired within each round (median and quartiles over all
    rounds, and over the rounds whose `moepic` plan did and did not prefetch), and `pass_rates` of a run of
    `per_run` rounds."""
    tpots = [r["tpot"] for r in rounds if all(p in r["tpot"] for p in rounds[0]["tpot"])]
    policies = [p for p in rounds[0]["tpot"] if p != "moepic"]
    kinds = {"all": tpots, "prefetch": [r["tpot"] for r in rounds if r["prefetch"]],
             "no prefetch": [r["tpot"] for r in rounds if not r["prefetch"]]}
    return {"rounds": len(tpots), "per_run": per_run,
            "moepic_over": {kind: {p: quartiles([r["moepic"] / r[p] for r in chosen]) for p in policies}
                            for kind, chosen in kinds.items() if chosen and (kind == "all" or len(chosen) < len(tpots))},
            "pass_rates": pass_rates(tpots, per_run)}


def render_pool(pooled: dict, dirs: list[str]) -> str:
    lines = [f"pooled rounds of {', '.join(dirs)}; moepic ÷ P paired within each round: median (quartiles) over the rounds"]
    for link, row in pooled.items():
        lines.append(f"{link} GB/s, {row['rounds']} rounds:")
        for kind, over in row["moepic_over"].items():
            n = next(iter(over.values()))["rounds"]
            lines.append(f"  {kind} ({n}): " + " · ".join(f"{p} {q['median']:.3f} ({q['q1']:.3f}–{q['q3']:.3f})"
                                                         for p, q in over.items()))
        rates = row["pass_rates"]
        lines.append(f"  a run of {row['per_run']} rounds drawn from these meets ≤ {TARGET} × the best other: paired "
                     f"{rates['paired']:.2f}, ratio of medians {rates['ratio_of_medians']:.2f}, both {rates['both']:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
