#!/usr/bin/env python3
"""Engine benchmark (issue 2, issue 10): measured side by side in one run, printed as ratios.

1. `resident` through the engine vs plain transformers on the same checkpoint
   (TPOT ratio; target <= 1.10): the cost of the ExpertsInterface hook itself.
2. For each `--load-ratio` R (default 3, MoEpic's measured regime, and 18, a consumer
   card: PCIe 4.0 x8 against GDDR6), an emulated link whose bandwidth makes loading one
   expert take R times computing one expert for one token, at an expert budget of 25 %
   of all experts: TPOT of every policy as a ratio to `lru`, with hit rate, exposed load
   ms per token and MiB moved per token. The emulated link has CudaLink's host
   semantics and moves no bytes on the CPU (offload/link.py): the host only waits where
   a segment is read, so emulation costs no compute.
3. Chunked copies: how long a demand load waits behind a prefetch already on the link,
   per chunk size (emulated link on a virtual clock: modelled, deterministic).

Rounds are interleaved (round r runs every table's every policy before round r + 1);
tables give medians over rounds and the spread (min–max of the per-round values).
`policy_table` prints one table of runs; a further matrix adds a table the same way.

    python benchmarks/engine.py --model demo --repeats 3     # the issue-10 tables
    python benchmarks/engine.py --matrix [--ratios 1,3,10,30 --budgets 10%,25%,50% --repeats 3]

4. `--matrix` (issue 12), on the demo model by default: at every load ratio × budget,
   `moepic` TPOT against the best of `lru`, `lfu`, `uniform`, `cache-only` and
   `prefetch-only` (target ≤ 1.03 ×), `resident` as the floor: where the best baseline
   is within 5 % of it there is nothing for `moepic` to gain, and the table says so.
   Round r runs every regime's every policy (order alternating) before round r + 1.
   The configurator's timings are a full profile of the model on each link (as
   `fmoe profile --model` measures it); routing statistics are those recorded so far.
    python benchmarks/engine.py                # mid-size random Mixtral, built in /tmp/fmoe-bench-engine
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from fmoe_cli.bench.run import bench_policy, encode_prompt
from fmoe_cli.generate import stream_generate
from fmoe_cli.models.demo import build_random_moe
from fmoe_cli.models.load import load_model
from fmoe_cli.offload.engine import Engine
from fmoe_cli.offload.link import EmulatedLink
from fmoe_cli.planning.plan import parse_budget
from fmoe_cli.planning.presets import PlanInputs, make_settings, settings_for
from fmoe_cli.planning.replan import Replanner
from fmoe_cli.planning.stats import StatsRecorder, load_or_empty
from fmoe_cli.profiling.model import expert_compute_s
from fmoe_cli.run import find_timings

POLICIES = ["lru", "moepic", "uniform", "lfu", "cache-only", "prefetch-only", "ondemand", "resident"]
MIXTRAL_EXPERT_BYTES = 14336 * 3 * 4096 * 2  # one Mixtral-8x7B expert in bf16: 336 MiB
PROMPT = "Explain how a mixture of experts decides which experts to use for each token."


def mid_size_checkpoint(path: Path) -> Path:
    if not (path / "config.json").exists():
        build_random_moe(path, "mixtral", seed=0, hidden_size=1024, intermediate_size=512, num_hidden_layers=8,
                         num_local_experts=32, num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=2)
    return path


def decode_tpot_ms(model, prompt_ids: torch.Tensor, tokens: int, engine: Engine | None = None) -> float:
    """Median decode-step time of `model` (through `engine` if given), the loop every command uses."""
    events = list(stream_generate(model, prompt_ids, engine=engine, max_new_tokens=tokens, stop_on_eos=False))
    return statistics.median(e.latency_s for e in events[1:]) * 1000


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """median [min–max] of per-round values."""
    return f"{fmt.format(statistics.median(values))} \\[{fmt.format(min(values))}–{fmt.format(max(values))}]"


def policy_table(title: str, runs: dict[str, list], base: str = "lru") -> Table:
    """One table of interleaved runs: policy -> RunResult per round; ratios to `base` per round."""
    table = Table(title=title)
    for col in ("policy", "TPOT ms", f"÷ {base} \\[spread]", "hit", "exp ms/tok", "MiB/tok"):
        table.add_column(col, justify="right" if col != "policy" else "left")
    for name, rs in runs.items():
        ratios = [r.tpot_ms["median"] / b.tpot_ms["median"] for r, b in zip(rs, runs[base])]
        table.add_row(name, spread([r.tpot_ms["median"] for r in rs]), spread(ratios),
                      f"{statistics.median(r.hit_rate for r in rs):.2f}",
                      spread([r.exposed_load_ms_per_token for r in rs]),
                      f"{statistics.median(r.bytes_per_token for r in rs) / 2**20:.1f}")
    return table


def chunk_table(expert_bytes: int, gbps: float) -> Table:
    """A demand load of one expert arriving 10 % into a whole-expert prefetch: its wait per chunk size."""
    from fmoe_cli.offload.link import DEMAND, PREFETCH, VirtualClock

    table = Table(title=f"3. demand load behind a prefetch, emulated {gbps:g} GB/s, expert {expert_bytes / 2**20:.1f} MiB "
                        "(modelled on a virtual clock)")
    for col in ("chunk", "demand wait ms", "prefetch done ms"):
        table.add_column(col, justify="right")
    whole = torch.empty(expert_bytes, dtype=torch.uint8)  # never written: the model moves no bytes
    for chunk_mib in (4, 16, 32, 64, None):
        clock = VirtualClock()
        link = EmulatedLink(gbps, clock=clock, chunk_bytes=chunk_mib * 2**20 if chunk_mib else 1 << 62)
        prefetch = link.submit(whole, whole, PREFETCH)
        clock.advance(link.duration(expert_bytes) * 0.1)
        start = clock.now()
        demand = link.submit(whole, whole, DEMAND)
        link.acquire(demand)
        link.acquire(prefetch)
        table.add_row(f"{chunk_mib} MiB" if chunk_mib else "none", f"{(demand.done_at - start) * 1e3:.2f}",
                      f"{prefetch.done_at * 1e3:.2f}")
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a model id or directory instead of the mid-size random checkpoint")
    p.add_argument("--dir", default="/tmp/fmoe-bench-engine", help="where the random checkpoint is built")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--budget", default="25%")
    p.add_argument("--load-ratio", type=float, nargs="+", default=[3.0, 18.0],
                   help="expert load time / expert compute time (one table each)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians and spread are reported")
    args = p.parse_args()
    torch.set_num_threads(1)
    console = Console(width=130)
    console.print("command: python benchmarks/engine.py " + " ".join(sys.argv[1:]), highlight=False)

    path = str(mid_size_checkpoint(Path(args.dir))) if args.model is None else args.model
    lm = load_model(path, device="cpu", dtype="float32", console=console)
    prompt_ids = encode_prompt(lm, PROMPT)
    shape = lm.shape
    console.print(f"{lm.label}: {shape.num_layers} MoE layers × {shape.num_experts} experts, top-{shape.top_k}, "
                  f"hidden {shape.hidden}, expert {shape.expert_bytes / 2**20:.2f} MiB; prompt {prompt_ids.shape[-1]} "
                  f"tokens, {args.tokens} measured tokens after {args.warmup} warm-up")

    # 1. resident through the engine vs plain transformers, interleaved `repeats` times.
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(lm.path, dtype=torch.float32).eval()
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(None), lm.device, lm.dtype)
    engine.install(lm.model)
    engine.configure(make_settings("resident", shape, 0))
    hf, ours = [], []
    for _ in range(args.repeats):
        hf.append(decode_tpot_ms(plain, prompt_ids, args.tokens))
        ours.append(decode_tpot_ms(lm.model, prompt_ids, args.tokens, engine))
    engine.close()
    del plain
    t1 = Table(title=f"1. resident engine vs plain transformers (TPOT ms: median \\[min–max] of {args.repeats} "
                     "interleaved rounds)")
    for col in ("run", "TPOT ms", "ratio"):
        t1.add_column(col, justify="right" if col != "run" else "left")
    t1.add_row("transformers", spread(hf), "1.00")
    t1.add_row("fmoe resident", spread(ours), spread([o / h for o, h in zip(ours, hf)]))
    console.print(t1)

    # 2. every policy on an emulated link per load ratio; rounds interleave ratios and policies.
    t_exp = expert_compute_s(lm)
    budget = parse_budget(args.budget, shape.all_experts_bytes)
    links = {ratio: EmulatedLink(shape.expert_bytes / (ratio * t_exp) / 1e9) for ratio in args.load_ratio}
    # As `fmoe bench` does (fmoe_cli/run.py): the configurator's timings for the link in use, found
    # before the engine is installed (a measurement installs its own), routing statistics recorded
    # under every policy, `moepic` planned from the statistics so far when its turn comes.
    timings = {ratio: find_timings(lm, link) for ratio, link in links.items()}
    engine = Engine(lm.layers, lm.store, shape, links[args.load_ratio[0]], lm.device, lm.dtype)
    engine.install(lm.model)
    stats_path = Path(tempfile.mkdtemp(prefix="fmoe-bench-stats-")) / "routing.stats.json"  # not the user's
    stats = load_or_empty(lm.model_id, shape.num_layers, shape.num_experts, shape.top_k, stats_path)
    planner = Replanner(engine, PlanInputs(shape, budget, timings[args.load_ratio[0]], model=lm.model_id),
                        StatsRecorder(stats, stats_path))
    runs: dict[float, dict[str, list]] = {ratio: {name: [] for name in POLICIES} for ratio in args.load_ratio}
    for r in range(args.repeats):
        for ratio, link in links.items():
            engine.link = link
            for name in POLICIES:
                settings = settings_for(name, replace(planner.plan_inputs(), timings=timings[ratio]))
                with console.status(f"round {r + 1}/{args.repeats}: load ratio {ratio:g}, {name} …"):
                    runs[ratio][name].append(bench_policy(lm, engine, settings, prompt_ids, args.tokens, args.warmup))
    planner.close()
    engine.close()
    for ratio, link in links.items():
        console.print(policy_table(
            f"2. {link.label()} (expert load {ratio:g}× T_exp = {ratio * t_exp * 1e3:.3f} ms), budget {args.budget} = "
            f"{budget / 2**20:.0f} MiB: median \\[min–max] of {args.repeats} interleaved rounds", runs[ratio]))
        console.print(f"moepic plan: {runs[ratio]['moepic'][-1].plan}", highlight=False)
    same = len({tuple(r.token_ids) for rr in runs.values() for rs in rr.values() for r in rs}) == 1
    console.print("token ids identical across policies and links" if same else "[red]token ids DIFFER[/red]")
    console.print(chunk_table(MIXTRAL_EXPERT_BYTES, 16.0))


# --- 4. the requirement matrix (issue 12) -------------------------------------------------
MATRIX_BASELINES = ["lru", "lfu", "uniform", "cache-only", "prefetch-only"]
NOTHING_TO_GAIN = 1.05  # the best baseline within 5 % of resident: nothing left for moepic to hide


def firm_timings(lm, links: dict, prefill_len: int, console: Console) -> dict:
    """The configurator's timings per link, as after `fmoe profile --model` on that link (a full
    measurement, not the quick one a run without a profile makes): the model's times and the
    engine's own costs, measured on a temporary engine per link (the host's work per load and per
    prefetch grows with the copies in flight), each with the link's own T_load."""
    from fmoe_cli.run import link_fit_of, measure_timings

    shape = lm.shape
    out = {}
    for ratio, link in links.items():
        with console.status(f"profiling the model on the ratio-{ratio:g} link (as `fmoe profile --model`) …"):
            measured = measure_timings(lm, link=link, quick=False, prefill_len=prefill_len)
        t = out[ratio] = measured.timings(link_fit_of(link, lm.device), shape.expert_bytes)
        console.print(f"profile, ratio {ratio:g}: T_att {t.t_att * 1e3:.3f} ms, T_exp {t.t_exp * 1e3:.3f} ms, "
                      f"T_head {t.t_head * 1e3:.3f} ms; h_load {t.t_host_load * 1e3:.3f}, h_pf "
                      f"{t.t_host_prefetch * 1e3:.3f}, a_e {t.t_admit * 1e3:.3f}, c {t.t_segment * 1e3:.3f}, "
                      f"h_route {t.t_host_route * 1e3:.3f} ms", highlight=False)
    return out


def matrix(args, console: Console) -> None:
    """moepic vs the best baseline at every load ratio × budget (see the module doc)."""
    lm = load_model(args.model, device="cpu", dtype="float32", console=console)
    prompt_ids = encode_prompt(lm, PROMPT)
    shape = lm.shape
    t_exp = expert_compute_s(lm)
    ratios = [float(r) for r in args.ratios.split(",")]
    budgets = [b.strip() for b in args.budgets.split(",")]
    links = {ratio: EmulatedLink(shape.expert_bytes / (ratio * t_exp) / 1e9) for ratio in ratios}
    timings = firm_timings(lm, links, prompt_ids.shape[-1], console)
    engine = Engine(lm.layers, lm.store, shape, links[ratios[0]], lm.device, lm.dtype)
    engine.install(lm.model)
    stats_path = Path(tempfile.mkdtemp(prefix="fmoe-bench-stats-")) / "routing.stats.json"  # not the user's
    stats = load_or_empty(lm.model_id, shape.num_layers, shape.num_experts, shape.top_k, stats_path)
    first = parse_budget(budgets[0], shape.all_experts_bytes)
    planner = Replanner(engine, PlanInputs(shape, first, timings[ratios[0]], model=lm.model_id),
                        StatsRecorder(stats, stats_path))
    policies = ["moepic", *MATRIX_BASELINES, "resident"]
    regimes = [(ratio, b) for ratio in ratios for b in budgets]
    runs = {regime: {name: [] for name in policies} for regime in regimes}
    for r in range(args.repeats):
        for ratio, budget_text in regimes:
            engine.link = links[ratio]
            budget = parse_budget(budget_text, shape.all_experts_bytes)
            inputs = replace(planner.plan_inputs(), timings=timings[ratio], budget_bytes=budget)
            for name in policies if r % 2 == 0 else policies[::-1]:
                with console.status(f"round {r + 1}/{args.repeats}: ratio {ratio:g}, budget {budget_text}, {name} …"):
                    runs[(ratio, budget_text)][name].append(
                        bench_policy(lm, engine, settings_for(name, inputs), prompt_ids, args.tokens, args.warmup))
    planner.close()
    engine.close()
    table = Table(title=f"4. moepic vs the best baseline: {lm.label}, emulated link (load ratio = one expert's load / "
                        f"its compute, T_exp = {t_exp * 1e3:.3f} ms); TPOT ms, median [min–max] of {args.repeats} "
                        f"interleaved rounds, {args.tokens} tokens after {args.warmup} warm-up")
    for col in ("ratio", "budget", "moepic", "best baseline", "moepic ÷ best", "resident", "verdict"):
        table.add_column(col, justify="left" if col in ("best baseline", "verdict") else "right")
    for (ratio, budget_text), rr in runs.items():
        tpot = {name: [x.tpot_ms["median"] for x in rs] for name, rs in rr.items()}
        med = {name: statistics.median(v) for name, v in tpot.items()}
        best = min(MATRIX_BASELINES, key=lambda n: med[n])
        quotient = med["moepic"] / med[best]
        if med[best] <= NOTHING_TO_GAIN * med["resident"]:
            verdict = "nothing to gain (best ≈ resident)"
        else:
            verdict = "meets ≤ 1.03" if quotient <= 1.03 else "misses 1.03"
        table.add_row(f"{ratio:g}", budget_text, spread(tpot["moepic"]), f"{best} {spread(tpot[best])}",
                      f"{quotient:.2f}", spread(tpot["resident"]), verdict)
    console.print(table)
    for (ratio, budget_text), rr in runs.items():
        console.print(f"moepic plan, ratio {ratio:g}, budget {budget_text}: {rr['moepic'][-1].plan}", highlight=False)
    same = len({tuple(x.token_ids) for rr in runs.values() for rs in rr.values() for x in rs}) == 1
    console.print("token ids identical across policies and regimes" if same else "[red]token ids DIFFER[/red]")


if __name__ == "__main__":
    if "--matrix" in sys.argv:
        q = argparse.ArgumentParser(description="issue 12's requirement matrix")
        q.add_argument("--matrix", action="store_true")
        q.add_argument("--model", default="demo", help="default: the demo model (learned routing)")
        q.add_argument("--ratios", default="1,3,10,30", help="expert load time / expert compute time")
        q.add_argument("--budgets", default="10%,25%,50%")
        q.add_argument("--tokens", type=int, default=16)
        q.add_argument("--warmup", type=int, default=2)
        q.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians and spread are reported")
        torch.set_num_threads(1)
        console = Console(width=150)
        console.print("command: python benchmarks/engine.py " + " ".join(sys.argv[1:]), highlight=False)
        matrix(q.parse_args(), console)
    else:
        main()
