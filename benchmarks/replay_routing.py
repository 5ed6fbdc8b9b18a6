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

`--device cuda` measures on a GPU instead (issue 38 §3: "on a GPU whenever one is lent"): the model on the device,
its own link (the copy stream, measured once: `fmoe profile`'s link fit) for the run and for the simulation, the
timings the bench plans with on that device, the wall clock; the budget as here (`--per-layer` experts a layer plus
the staging pool: MoEpic's 160 of 32 layers on its 48 GB card, scaled to the layers). `--card`, `--load-ratio` and
`--clock cpu` shape an emulated link and do not apply there; `--gap` and `--from-json` measure nothing and run here
on the report it printed. Not yet run on a GPU (benchmarks/gpu_check.py part D runs it).

`--clock cpu` (the default on the CPU) runs the emulated link and every timing on the process's CPU time
(FMOE_EMULATED_CLOCK=cpu, offload/link.py: CpuClock; one compute thread): the link's waits are modelled, not slept, so
a token costs its compute in wall time and the other work of a shared machine does not enter the figures. The
figures are measured on the engine (emulated link), not simulated, except the simulator's columns.

    python benchmarks/replay_routing.py MODEL TRACE [--rounds 3 --tokens 32 --warmup 4 --per-layer 5] [--json]

`--gap` (with `--from-json RUN`, the report of such a run) measures nothing: the simulator walked from MoEpic's setting
as `benchmarks/simulate.py paper` modelled it until 28 Nov to the run's, one change at a time (the admission copy at the
card's bandwidth, as `simulate.py paper` has it now, this machine's timings, the run's tokens, layers and link), and the run's setting at other load ratios
(`--gap-ratios`); per row moepic ÷ lru, the best of LCP's fixed splits ÷ lru (a diagnostic, not a policy) and
resident ÷ lru.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

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
    p.add_argument("--gap", action="store_true",
                   help="measure nothing: walk the simulator from MoEpic's setting (benchmarks/simulate.py paper) to this "
                        "run's, one change at a time, and sweep the load ratio (the § in docs/bench.md)")
    p.add_argument("--gap-ratios", default="1,2.65,5,10,24.4", metavar="R,R,…",
                   help="--gap: the load ÷ compute ratios swept in this run's setting")
    p.add_argument("--clock", choices=("cpu", "wall"), default=None, help="default: cpu (wall with --device cuda)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: measure on the GPU over its own link (module doc)")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--json", action="store_true")
    p.add_argument("--from-json", type=Path, default=None, metavar="FILE",
                   help="measure nothing: the report a --json run printed, simulated again (with --deeper) and shown")
    args = p.parse_args(argv)
    on_gpu = args.device == "cuda"
    if on_gpu and (args.clock == "cpu" or args.load_ratio is not None or args.gap or args.from_json is not None):
        p.error("--device cuda measures on the GPU's own link and the wall clock: --clock cpu, --load-ratio, --gap "
                "and --from-json are for the CPU (the last two: on the report it prints)")
    args.clock = args.clock or ("wall" if on_gpu else "cpu")
    os.environ["FMOE_EMULATED_CLOCK"] = args.clock  # before any fmoe clock is read

    from rich.console import Console

    from fmoe_cli.bench.run import run_bench
    from fmoe_cli.models.load import load_model
    from fmoe_cli.offload.link import EmulatedLink
    from fmoe_cli.options import RunOptions
    from fmoe_cli.trace import read_trace

    console = Console(stderr=True)
    trace = read_trace(args.trace)
    if on_gpu:
        check_gpu()
    lm = load_model(args.model, device=args.device, experts=args.experts, dense=args.dense, console=console)
    shape = lm.shape
    budget = (args.per_layer * shape.num_layers + shape.min_staging_slots) * shape.expert_bytes
    name, ratio, t_exp, gbps, latency = run_link(lm, args)
    policies = tuple(args.policies.split(","))
    command = (f"fmoe bench {args.model} --replay-routing {args.trace} --experts {args.experts} --dense {args.dense} "
               f"--predictor eam --vram-budget {budget}B" + ("" if on_gpu else f" --emulate-link {gbps:.4g}")
               + f" --compare {','.join(policies)} --rounds {args.rounds} --tokens {args.tokens} --warmup "
               f"{args.warmup} --prompt '{args.prompt}' --device {args.device}"
               + ("" if on_gpu else f" (FMOE_EMULATED_CLOCK={args.clock})"))
    if args.from_json is not None:  # the measured run as it was (its link and tokens), simulated again
        report = json.loads(args.from_json.read_text())
        measured = report["replay_routing"]
        name, ratio, t_exp, gbps = measured["card"], measured["load_over_compute"], measured["t_exp_s"], measured["gbps"]
        args.tokens, args.warmup, command = report["tokens"], report["warmup"], measured["command"]
    if args.gap:
        from fmoe_cli.bench.run import encode_prompt

        prompt_tokens = report["prompt_tokens"] if args.from_json else encode_prompt(lm, args.prompt).shape[1]
        rows = gap(lm, trace, args, ratio, gbps, prompt_tokens, console)
        if args.json:
            print(json.dumps({"gap": rows, "command": command, "load_over_compute": ratio}))
        else:
            gap_table(rows, Console(width=max(Console().width, 150)))
        return
    console.print(f"link {'of' if on_gpu else 'shaped like'} {name}: load ÷ compute {ratio:.1f}, T_exp "
                  f"{t_exp * 1e3:.1f} ms → {gbps:.4g} GB/s; budget {budget / shape.expert_bytes:.0f} experts",
                  highlight=False)
    console.print(command, highlight=False, soft_wrap=True)
    if args.from_json is None:
        opts = RunOptions(model=args.model, policies=policies, vram_budget=f"{budget}B", predictor="eam",
                          emulate_link=None if on_gpu else gbps, device=args.device, experts=args.experts,
                          dense=args.dense, shape_link=not on_gpu)
        report = run_bench(opts, tokens=args.tokens, warmup=args.warmup, prompt=args.prompt, console=console,
                           rounds=args.rounds, replay=trace)
    else:
        latency = EmulatedLink(gbps).latency_s  # (a CPU run's report)
    link = LinkFigures(gbps, latency)
    sims = simulate(lm, trace, report, budget, link, args)
    report["replay_routing"] = {"command": command, "card": name, "load_over_compute": ratio, "t_exp_s": t_exp,
                                "gbps": gbps, "budget_experts": budget / shape.expert_bytes, "simulated": sims}
    if args.deeper:
        report["replay_routing"]["simulated_deeper"] = deeper(lm, trace, report, link, args)
    if args.json:
        print(json.dumps(report))
    else:
        table(report, Console(width=max(Console().width, 150)))


def check_gpu() -> None:
    """--device cuda where torch sees no GPU: one line, exit 2, before the model is read."""
    import torch

    if not torch.cuda.is_available():
        print("error: --device cuda: torch sees no CUDA GPU here", file=sys.stderr)
        sys.exit(2)


def run_link(lm, args):
    """The run's link -> (its name, one expert's load ÷ T_exp, T_exp, GB/s, latency s). On the CPU an emulated link
    shaped like `--card` (or `--load-ratio`): one expert loads in the card's memory ÷ link bandwidth × this machine's
    T_exp (the quick estimate, measured once and kept); on a GPU its own copy stream, fitted once (run.link_fit_of),
    and T_exp from the timings the bench plans with on it."""
    from fmoe_cli.offload.link import EmulatedLink
    from fmoe_cli.run import find_timings, link_fit_of

    shape = lm.shape
    if lm.device.type == "cuda":
        import torch

        fit = link_fit_of(None, lm.device)
        t_exp = planned_timings(lm, fit.bandwidth / 1e9).t_exp
        latency = fit.latency or 0.0  # (a fit may have none)
        load = latency + shape.expert_bytes / fit.bandwidth
        return torch.cuda.get_device_name(lm.device), load / t_exp, t_exp, fit.bandwidth / 1e9, latency
    name, ratio = card_ratio(args.card)
    if args.load_ratio is not None:
        name, ratio = f"{name}, load ÷ compute set to {args.load_ratio:g}", args.load_ratio
    t_exp = find_timings(lm, EmulatedLink(1.0)).t_exp  # the quick estimate, measured once and kept
    gbps = shape.expert_bytes / (ratio * t_exp) / 1e9
    return name, ratio, t_exp, gbps, EmulatedLink(gbps).latency_s


def planned_timings(lm, gbps: float):
    """The timings the bench's configurator planned with: find_timings on the run's link (on the CPU an emulated link
    of `gbps`, on a GPU its copy stream)."""
    from fmoe_cli.offload.link import EmulatedLink, make_link
    from fmoe_cli.run import find_timings

    link = make_link(lm.device, None) if lm.device.type == "cuda" else EmulatedLink(gbps)
    try:
        return find_timings(lm, link)
    finally:
        link.close()


class LinkFigures(NamedTuple):
    """What the simulator is told of the run's link."""

    gbps: float
    latency_s: float


def simulated(policy: str, shape, budget: int, timings, stats, window, link, prompt_tokens: int, warmup: int):
    """planning/simulate.py's prediction of one policy's run: its plan made from these timings and statistics,
    the bench's warm-up and measured decode tokens over `window`, on `link`'s bandwidth and latency."""
    from fmoe_cli.planning.presets import PlanInputs, settings_for
    from fmoe_cli.planning.simulate import predictor_for, simulate_policy

    settings = settings_for(policy, PlanInputs(shape, budget, timings, stats))
    return simulate_policy(shape, settings, timings, window, bandwidth=link.gbps * 1e9, latency=link.latency_s,
                           prompt_tokens=prompt_tokens, warmup=warmup, predictor_factory=predictor_for(window, shape))


def simulate(lm, trace, report: dict, budget: int, link: LinkFigures, args) -> dict:
    """Per policy: simulated TPOT (ms) of the measured runs' replayed tokens, (1) with the run's timings, (2) with
    compute fitted to the measured resident TPOT; the simulated hit rate and plan."""
    from simulate import fitted_to_resident  # benchmarks/simulate.py

    from fmoe_cli.bench.routing import ReplayedRouting

    shape = lm.shape
    timings = planned_timings(lm, link.gbps)
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


def deeper(lm, trace, report: dict, link: LinkFigures, args) -> dict:
    """Simulated only: the trace's first `args.deeper` layers, each with the run's per-layer timings, MoEpic's budget
    scaled to them: per policy TPOT median and mean (ms) and hit rate."""
    from dataclasses import replace

    from fmoe_cli.bench.routing import ReplayedRouting

    timings = planned_timings(lm, link.gbps)
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


GAP_THETAS = (0.6, 0.7, 0.8, 1.0)  # the fixed splits --gap also prices: a diagnostic, not a policy


def gap_setting(label: str, timings, load_ratio: float, layers: int, tokens: str) -> dict:
    """One row of the walk: timings (whose T_exp the link is shaped on), one expert's load ÷ T_exp, the trace's first
    `layers` MoE layers, and which tokens: "paper" (every sequence, the first 32 tokens of each its prompt, a budget of
    V_e + K experts, the card's link latency, as `simulate.py paper`) or "run" (the bench run's: its prompt, warm-up
    and measured tokens, the sequences one after another, V_e plus the staging pool, the emulated link's latency)."""
    return {"label": label, "timings": timings, "load_ratio": load_ratio, "layers": layers, "tokens": tokens}


def gap_row(setting: dict, lm, trace, args, prompt_tokens: int, latencies: dict) -> dict:
    """Simulated TPOT (median, mean) of moepic, lru, resident and of LCP at fixed splits GAP_THETAS with and
    without prefetch, in one setting; ratios to lru."""
    from dataclasses import replace

    from fmoe_cli.bench.routing import ReplayedRouting
    from fmoe_cli.planning.configurator import price_plan
    from fmoe_cli.planning.presets import PlanInputs, settings_for
    from fmoe_cli.planning.simulate import predictor_for, simulate_policy

    shape = replace(lm.shape, num_layers=setting["layers"])
    t = setting["timings"]
    latency = latencies[setting["tokens"]]  # the card's link latency in the paper setting, the emulated link's else
    bandwidth = shape.expert_bytes / (setting["load_ratio"] * t.t_exp)
    t = replace(t, t_load=latency + shape.expert_bytes / bandwidth)
    replay = ReplayedRouting(trace, shape)
    stats = replay.statistics(shape, lm.model_id)
    if setting["tokens"] == "paper":
        sequences, prompt, warmup = replay.tokens(), PAPER_PROMPT, 0
        if all(len(seq) <= prompt for seq in sequences):
            raise SystemExit(f"error: --gap: no sequence of the trace is longer than the paper setting's "
                             f"{PAPER_PROMPT}-token prompt: nothing to decode")
        budget = (args.per_layer * shape.num_layers + shape.top_k) * shape.expert_bytes
    else:
        routed = prompt_tokens + args.tokens - 1
        sequences = [[token for seq in replay.tokens(limit=routed) for token in seq]]
        prompt, warmup = prompt_tokens, args.warmup
        budget = (args.per_layer * shape.num_layers + shape.min_staging_slots) * shape.expert_bytes
    runs = {"moepic": ("moepic", None), "lru": ("lru", None), "resident": ("resident", None)}
    runs.update({f"LCP θ {theta:g}": ("uniform", theta) for theta in GAP_THETAS})
    runs.update({f"LCP θ {theta:g}, no prefetch": ("cache-only", theta) for theta in GAP_THETAS})
    out = {}
    for name, (preset, theta) in runs.items():
        settings = settings_for(preset, PlanInputs(shape, budget, t, stats, lm.model_id, theta=theta))
        result = simulate_policy(shape, settings, t, sequences, bandwidth=bandwidth, latency=latency,
                                 prompt_tokens=prompt, warmup=warmup, predictor_factory=predictor_for(sequences, shape))
        # the configurator's closed form on the same plan (Σ T^i, its exposed loads; H_i averaged): how it ranks
        # the plans it chooses among, against the simulator's TPOT
        priced = price_plan(settings.plan, stats, t, shape, max_prefetch=None if settings.prefetch else 0)
        out[name] = {"tpot_ms": result.tpot_s * 1e3, "mean_tpot_ms": result.mean_tpot_s * 1e3,
                     "hit_rate": result.hit_rate, "plan": result.plan,
                     "priced_exposed_ms": priced.total_exposed * 1e3,
                     "priced_hit_rate": sum(c.hit_rate for c in priced.layers) / len(priced.layers)}
    lru = out["lru"]["tpot_ms"]
    fixed = [n for n in out if n.startswith("LCP")]
    best = min(fixed, key=lambda n: out[n]["tpot_ms"])
    t_exp = t.t_exp
    return {"label": setting["label"], "layers": shape.num_layers, "tokens": setting["tokens"],
            "load_over_compute": setting["load_ratio"], "t_att_over_t_exp": t.t_att / t_exp,
            "t_head_over_t_exp": t.t_head / t_exp, "a_e_over_t_exp": t.t_admit / t_exp,
            "host_work_over_t_exp": (t.t_host_load + t.t_segment) / t_exp,
            "moepic_over_lru": out["moepic"]["tpot_ms"] / lru, "best_fixed": best,
            "best_fixed_over_lru": out[best]["tpot_ms"] / lru, "resident_over_lru": out["resident"]["tpot_ms"] / lru,
            "moepic_mean_over_lru": out["moepic"]["mean_tpot_ms"] / out["lru"]["mean_tpot_ms"], "policies": out}


PAPER_PROMPT = 32  # benchmarks/simulate.py paper: the first 32 tokens of each sequence are its prompt


def gap(lm, trace, args, ratio: float, gbps: float, prompt_tokens: int, console) -> list[dict]:
    """The simulator walked from MoEpic's setting (`simulate.py paper`: the card's roofline × its calibration factor,
    the trace's 32 layers) to this run's (this machine's timings, its layers, link and tokens), one change at a time,
    then the load ratio swept in this run's setting. Simulated only."""
    from dataclasses import replace

    from simulate import paper_setting  # benchmarks/simulate.py

    from fmoe_cli.offload.link import EmulatedLink
    from fmoe_cli.profiling.files import Profile
    from fmoe_cli.run import find_timings

    card = Profile.load(args.card)
    paper = paper_setting(card)
    if paper.mixtral.shape.expert_bytes != lm.shape.expert_bytes:
        console.print(f"note: one expert is {lm.shape.expert_bytes} bytes here, {paper.mixtral.shape.expert_bytes} in "
                      f"the paper's setting (other formats)", highlight=False)
    paper_t = paper.mixtral_times
    paper_ratio = paper_t.t_load / paper_t.t_exp
    ours = find_timings(lm, EmulatedLink(gbps))
    deep = min(len(trace.layers), paper.mixtral.shape.num_layers)
    layers = lm.shape.num_layers
    copy_as_compute = replace(paper_t, t_admit=paper_t.t_admit * paper.factor)  # simulate.py paper until 28 Nov
    walk = [
        gap_setting(f"MoEpic's setting as simulate.py paper had it until 28 Nov: roofline × {paper.factor:.2f}, a_e × "
                    f"{paper.factor:.2f}", copy_as_compute, paper_ratio, deep, "paper"),
        gap_setting("+ a_e at the card's memory bandwidth (not × the compute factor): simulate.py paper now", paper_t,
                    paper_ratio, deep, "paper"),
        gap_setting(f"+ this machine's timings (load kept {paper_ratio:.2f} × T_exp)", ours, paper_ratio, deep, "paper"),
        gap_setting("+ the run's tokens, budget, staging pool and link latency", ours, paper_ratio, deep, "run"),
        gap_setting(f"+ the run's {layers} layers", ours, paper_ratio, layers, "run"),
        gap_setting(f"+ the run's link ({ratio:.3g} × T_exp): the run's own setting", ours, ratio, layers, "run"),
    ]
    sweep = [gap_setting(f"the run's setting, load {r:g} × T_exp", ours, r, layers, "run")
             for r in (float(x) for x in args.gap_ratios.split(","))]
    latencies = {"paper": card.device.link.latency or 0.0, "run": EmulatedLink(gbps).latency_s}
    rows = []
    for n, setting in enumerate(walk + sweep):
        console.print(f"simulating {n + 1}/{len(walk) + len(sweep)}: {setting['label']} …", highlight=False)
        row = gap_row(setting, lm, trace, args, prompt_tokens, latencies)
        row["part"] = "walk" if n < len(walk) else "sweep"
        rows.append(row)
    return rows


def gap_table(rows: list[dict], console) -> None:
    from rich.table import Table

    for part, title in (("walk", "simulated: from MoEpic's setting to this run's, one change at a time"),
                        ("sweep", "simulated: this run's setting at other load ratios")):
        t = Table(title=f"{title}; TPOT medians ÷ lru's")
        for col in ("setting", "layers", "load ÷ T_exp", "T_att", "a_e", "moepic ÷ lru", "(means)", "moepic hit",
                    "lru hit", "best fixed split ÷ lru", "resident ÷ lru", "moepic plan"):
            t.add_column(col, justify="left" if col in ("setting", "moepic plan") else "right")
        for r in (r for r in rows if r["part"] == part):
            p = r["policies"]
            t.add_row(r["label"], str(r["layers"]), f"{r['load_over_compute']:.3g}", f"{r['t_att_over_t_exp']:.2f}",
                      f"{r['a_e_over_t_exp']:.2f}", f"{r['moepic_over_lru']:.3f}", f"{r['moepic_mean_over_lru']:.3f}",
                      f"{p['moepic']['hit_rate']:.2f}", f"{p['lru']['hit_rate']:.2f}",
                      f"{r['best_fixed_over_lru']:.3f} ({r['best_fixed']})", f"{r['resident_over_lru']:.3f}",
                      str(p["moepic"]["plan"]))
        console.print(t)
    console.print("T_att and a_e as multiples of T_exp; best fixed split: the least TPOT of LCP at θ "
                  f"{', '.join(f'{x:g}' for x in GAP_THETAS)} with and without prefetch (what simple plans reach, a "
                  "diagnostic, not a policy); resident ÷ lru: the floor no plan goes under", highlight=False)


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
