#!/usr/bin/env python3
"""Issue 38: MoEpic's table measured on the engine, routing replayed from a real trace, beside the simulator's.

One process:
1. loads MODEL (a checkpoint of tools/random_checkpoint.py: Mixtral-8x7B's layer shape, fewer layers) with
   `--experts` / `--dense` (the papers' int2 experts and int4 attention by default) and finds the configurator's
   timings as `fmoe bench` does (the quick estimate, measured once and kept in the config directory);
2. shapes the emulated link like `--card` (a reference profile, default profiles/rtx-a6000.json): one expert loads
   in (memory ÷ link bandwidth of the card) × T_exp of this machine, T_exp the configurator's (the card's ratio for
   a memory-bound expert, in this model's own bytes);
3. runs `fmoe bench MODEL --replay-routing TRACE` in this process (bench/run.py: run_bench) with every policy,
   `--rounds` interleaved, MoEpic's budget scaled to the layers (`--per-layer` experts a layer, 5 = 160 of 32, plus
   the staging pool), predictor eam (the routing-only one: a vLLM trace has no rankings);
4. simulates the same (planning/simulate.py: simulate_policy): the same replayed tokens (the prompt's prefill, the
   warm-up, the measured decode tokens, the trace's sequences one after another), the same statistics (the trace's),
   budget, link and timings: (1) the profile's timings as they are, (2) compute fitted to the measured resident
   run (benchmarks/simulate.py: fitted_to_resident).

`--clock cpu` (the default) runs the emulated link and every timing on the process's CPU time
(FMOE_EMULATED_CLOCK=cpu, offload/link.py: CpuClock; one compute thread): the link's waits are modelled, not slept, so
a token costs its compute in wall time and the other work of a shared machine does not enter the figures. The
figures are measured on the engine (emulated link), not simulated, except the simulator's columns.

    python benchmarks/replay_routing.py MODEL TRACE [--rounds 3 --tokens 32 --warmup 4 --per-layer 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

POLICIES = ("moepic", "lru", "lfu", "prefetch-only", "ondemand", "resident")
PROMPT = "def fib(n):"  # tokens are meaningless with replayed routing: a short prompt leaves the trace to decode


def card_ratio(path: Path) -> tuple[str, float]:
    """(the card's name, memory ÷ link bandwidth): one memory-bound expert's load ÷ its compute on it."""
    from fmoe_cli.profiling.files import Profile

    device = Profile.load(path).device
    return device.device.name, device.memory_bandwidth / device.link.bandwidth


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("trace")
    p.add_argument("--experts", default="int2")
    p.add_argument("--dense", default="int4")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--per-layer", type=int, default=5, help="experts a layer in the budget (MoEpic: 160 of 32 = 5)")
    p.add_argument("--card", type=Path, default=HERE.parent / "profiles" / "rtx-a6000.json")
    p.add_argument("--load-ratio", type=float, default=None,
                   help="one expert's load ÷ T_exp instead of the card's memory ÷ link bandwidth (2.6: the A6000 as "
                        "benchmarks/simulate.py paper calibrates its compute)")
    p.add_argument("--deeper", type=int, default=None, metavar="N",
                   help="also simulate (no measurement) the trace's first N layers with the run's per-layer timings")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--json", action="store_true")
    p.add_argument("--from-json", type=Path, default=None, metavar="FILE",
                   help="measure nothing: the report a --json run printed, simulated again (with --deeper) and shown")
    args = p.parse_args(argv)
    os.environ["FMOE_EMULATED_CLOCK"] = args.clock  # before any fmoe clock is read

    from rich.console import Console

    from fmoe_cli.bench.run import run_bench
    from fmoe_cli.models.load import load_model
    from fmoe_cli.offload.link import EmulatedLink
    from fmoe_cli.options import RunOptions
    from fmoe_cli.run import find_timings
    from fmoe_cli.trace import read_trace

    console = Console(stderr=True)
    trace = read_trace(args.trace)
    lm = load_model(args.model, device="cpu", experts=args.experts, dense=args.dense, console=console)
    shape = lm.shape
    budget = (args.per_layer * shape.num_layers + shape.min_staging_slots) * shape.expert_bytes
    name, ratio = card_ratio(args.card)
    if args.load_ratio is not None:
        name, ratio = f"{name}, load ÷ compute set to {args.load_ratio:g}", args.load_ratio
    t_exp = find_timings(lm, EmulatedLink(1.0)).t_exp  # the quick estimate, measured once and kept
    gbps = shape.expert_bytes / (ratio * t_exp) / 1e9
    policies = tuple(args.policies.split(","))
    command = (f"fmoe bench {args.model} --replay-routing {args.trace} --experts {args.experts} --dense {args.dense} "
               f"--predictor eam --vram-budget {budget}B --emulate-link {gbps:.4g} --compare {','.join(policies)} "
               f"--rounds {args.rounds} --tokens {args.tokens} --warmup {args.warmup} --prompt '{args.prompt}' "
               f"--device cpu (FMOE_EMULATED_CLOCK={args.clock})")
    if args.from_json is not None:  # the measured run as it was (its link and tokens), simulated again
        report = json.loads(args.from_json.read_text())
        measured = report["replay_routing"]
        name, ratio, t_exp, gbps = measured["card"], measured["load_over_compute"], measured["t_exp_s"], measured["gbps"]
        args.tokens, args.warmup, command = report["tokens"], report["warmup"], measured["command"]
    console.print(f"link shaped like {name}: load ÷ compute {ratio:.1f}, T_exp {t_exp * 1e3:.1f} ms → "
                  f"{gbps:.4g} GB/s; budget {budget / shape.expert_bytes:.0f} experts", highlight=False)
    console.print(command, highlight=False, soft_wrap=True)
    if args.from_json is None:
        opts = RunOptions(model=args.model, policies=policies, vram_budget=f"{budget}B", predictor="eam",
                          emulate_link=gbps, device="cpu", experts=args.experts, dense=args.dense, shape_link=True)
        report = run_bench(opts, tokens=args.tokens, warmup=args.warmup, prompt=args.prompt, console=console,
                           rounds=args.rounds, replay=trace)
    sims = simulate(lm, trace, report, budget, gbps, args)
    report["replay_routing"] = {"command": command, "card": name, "load_over_compute": ratio, "t_exp_s": t_exp,
                                "gbps": gbps, "budget_experts": budget / shape.expert_bytes, "simulated": sims}
    if args.deeper:
        report["replay_routing"]["simulated_deeper"] = deeper(lm, trace, report, gbps, args)
    if args.json:
        print(json.dumps(report))
    else:
        table(report, Console(width=max(Console().width, 150)))


def simulated(policy: str, shape, budget: int, timings, stats, window, link, prompt_tokens: int, warmup: int):
    """planning/simulate.py's prediction of one policy's run: its plan made from these timings and statistics,
    the bench's warm-up and measured decode tokens over `window`, on `link`'s bandwidth and latency."""
    from fmoe_cli.planning.presets import PlanInputs, settings_for
    from fmoe_cli.planning.simulate import predictor_for, simulate_policy

    settings = settings_for(policy, PlanInputs(shape, budget, timings, stats))
    return simulate_policy(shape, settings, timings, window, bandwidth=link.gbps * 1e9, latency=link.latency_s,
                           prompt_tokens=prompt_tokens, warmup=warmup, predictor_factory=predictor_for(window, shape))


def simulate(lm, trace, report: dict, budget: int, gbps: float, args) -> dict:
    """Per policy: simulated TPOT (ms) of the measured runs' replayed tokens, (1) with the run's timings, (2) with
    compute fitted to the measured resident TPOT; the simulated hit rate and plan."""
    from simulate import fitted_to_resident  # benchmarks/simulate.py

    from fmoe_cli.bench.routing import ReplayedRouting
    from fmoe_cli.offload.link import EmulatedLink
    from fmoe_cli.run import find_timings

    shape = lm.shape
    link = EmulatedLink(gbps)
    timings = find_timings(lm, link)  # what the bench's configurator planned with
    replay = ReplayedRouting(trace, shape)
    stats = replay.statistics(shape, lm.model_id)
    routed = report["prompt_tokens"] + args.tokens - 1
    window = [[token for seq in replay.tokens(limit=routed) for token in seq]]  # the sequences one after another
    runs = {r["policy"]: r for r in report["runs"]}
    fits = {"profile": timings}
    if "resident" in runs:
        fits["resident fit"] = fitted_to_resident(timings, shape, runs["resident"]["tpot_ms"]["median"] / 1e3)[0]
    out: dict = {}
    for name in runs:
        out[name] = {}
        for label, times in fits.items():
            result = simulated(name, shape, budget, times, stats, window, link, report["prompt_tokens"], args.warmup)
            out[name][label] = {"tpot_ms": result.tpot_s * 1e3, "mean_tpot_ms": result.mean_tpot_s * 1e3,
                                "hit_rate": result.hit_rate, "plan": result.plan}
    return out


def deeper(lm, trace, report: dict, gbps: float, args) -> dict:
    """Simulated only: the trace's first `args.deeper` layers, each with the run's per-layer timings, MoEpic's budget
    scaled to them: per policy TPOT median and mean (ms) and hit rate."""
    from dataclasses import replace

    from fmoe_cli.bench.routing import ReplayedRouting
    from fmoe_cli.offload.link import EmulatedLink
    from fmoe_cli.run import find_timings

    link = EmulatedLink(gbps)
    timings = find_timings(lm, link)
    shape = replace(lm.shape, num_layers=args.deeper)
    replay = ReplayedRouting(trace, shape)
    stats = replay.statistics(shape, lm.model_id)
    window = [[token for seq in replay.tokens(limit=report["prompt_tokens"] + args.tokens - 1) for token in seq]]
    budget = (args.per_layer * shape.num_layers + shape.min_staging_slots) * shape.expert_bytes
    out = {}
    for run in report["runs"]:
        result = simulated(run["policy"], shape, budget, timings, stats, window, link, report["prompt_tokens"],
                           args.warmup)
        out[run["policy"]] = {"layers": shape.num_layers, "tpot_ms": result.tpot_s * 1e3,
                              "mean_tpot_ms": result.mean_tpot_s * 1e3, "hit_rate": result.hit_rate,
                              "plan": result.plan}
    return out


def table(report: dict, console) -> None:
    from rich.table import Table

    from simulate import PAPER  # benchmarks/simulate.py: MoEpic's figures

    sims = report["replay_routing"]["simulated"]

    runs = {r["policy"]: r for r in report["runs"]}
    labels = list(next(iter(sims.values())))
    t = Table(title=f"{report['label']} ({report['experts']} experts, {report['dense']} dense), {report['link']['label']}, "
                    f"budget {report['vram_budget_bytes'] / 2**20:.0f} MiB; {report['rounds']} rounds, "
                    f"{report['tokens']} tokens after {report['warmup']} warm-up; TPOT ms, median of the rounds")
    for col in ("policy", "measured", "min–max", "mean", "÷ lru", "hit", *[f"sim {label}" for label in labels],
                *[f"sim ÷ meas ({label})" for label in labels], "sim mean ÷ mean", "sim hit", "paper"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    lru = runs.get("lru")
    for name, r in runs.items():
        per_round = [x["tpot_ms"]["median"] for x in r.get("rounds") or [r]]
        meas = r["tpot_ms"]["median"]
        paired = ""
        if lru is not None and r.get("rounds") and lru.get("rounds"):
            quotients = [a["tpot_ms"]["median"] / b["tpot_ms"]["median"] for a, b in zip(r["rounds"], lru["rounds"])]
            paired = f"{statistics.median(quotients):.2f}"
        elif lru is not None:
            paired = f"{meas / lru['tpot_ms']['median']:.2f}"
        paper = PAPER.get(name)
        mean = 1e3 / r["tokens_per_s"]
        t.add_row(name, f"{meas:.0f}", f"{min(per_round):.0f}–{max(per_round):.0f}", f"{mean:.0f}", paired,
                  f"{r['hit_rate']:.2f}", *[f"{sims[name][label]['tpot_ms']:.0f}" for label in labels],
                  *[f"{sims[name][label]['tpot_ms'] / meas:.2f}" for label in labels],
                  " / ".join(f"{sims[name][label]['mean_tpot_ms'] / mean:.2f}" for label in labels),
                  f"{sims[name][labels[0]]['hit_rate']:.2f}", "" if paper is None else f"{paper[0]} {paper[1]}")
    console.print(t)
    for name, r in runs.items():
        console.print(f"  {name}: measured plan {r['plan']}; simulated {sims[name][labels[0]]['plan']}",
                      highlight=False)
    for name, sim in report["replay_routing"].get("simulated_deeper", {}).items():
        console.print(f"  simulated only, the trace's first {sim['layers']} layers: {name} TPOT {sim['tpot_ms']:.0f} "
                      f"ms (mean {sim['mean_tpot_ms']:.0f}), hit {sim['hit_rate']:.2f}", highlight=False)


if __name__ == "__main__":
    main()
