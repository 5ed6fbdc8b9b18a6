#!/usr/bin/env python3
"""Host work per loaded segment (issue 12, task h1): what one load costs the host when the link costs nothing.

On the demo model, through an instant emulated link (no link time: every transfer is
done when it is polled; the host only runs the engine's bookkeeping), measured side by
side in interleaved rounds:

- `resident`: every expert whole on the device, nothing loaded (the floor);
- `ondemand`: no cache, no prefetch: every activated expert is one loaded segment;
- `split`: θ = 0.5 and every expert's top cached (no prefetch): every activation is a
  top hit plus a loaded bottom, two segment_forwards and an add.

Both loaded policies compute the same experts as `resident` (whole or in two halves),
so what they add is host work. Per loaded segment:

    host per segment = (TPOT_policy − TPOT_resident − exposed) / loaded segments per token

with loaded segments per token = (misses + top hits) / decode tokens, from the engine's
counters, and exposed = the time the compute waited on the link (0 on an instant link).
The ratio of each round's TPOTs is taken per round; tables give the median over rounds
and the spread (min–max of the per-round values).

    python benchmarks/host_work.py [--repeats 5 --tokens 32 --warmup 4 --gbps GB/s]
    python benchmarks/host_work.py --profile ondemand     # cProfile of one run, top functions
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from fmoe_cli.bench.run import encode_prompt
from fmoe_cli.generate import stream_generate
from fmoe_cli.models.demo import demo_path
from fmoe_cli.models.load import load_model
from fmoe_cli.offload.engine import Counters, Engine
from fmoe_cli.offload.link import EmulatedLink
from fmoe_cli.planning.plan import layer_plan, min_staging_slots
from fmoe_cli.planning.presets import make_settings
from fmoe_cli.profiling.model import expert_compute_s
from fmoe_cli.types import Plan

PROMPT = "Explain how a mixture of experts decides which experts to use for each token."
RUNS = ("resident", "ondemand", "split")


def split_settings(shape):
    """θ = 0.5, every expert's top cached in every layer, no prefetch (the `ondemand` preset's flags)."""
    layers = tuple(layer_plan(shape, shape.num_experts, 0.5) for _ in range(shape.num_layers))
    plan = Plan(layers, min_staging_slots(shape), shape.expert_bytes, "split θ=0.5, all tops cached")
    return make_settings("ondemand", shape, 0, plan=plan, eviction="lcp")


def settings(name: str, shape):
    if name == "split":
        return split_settings(shape)
    return make_settings(name, shape, shape.all_experts_bytes // 4)


@dataclass
class Run:
    tpot_ms: float  # median decode step
    exposed_ms: float  # compute waiting on the link, per decode token
    segments: float  # loaded segments (misses + top hits) per decode token
    token_ids: list[int]


def measure(lm, engine: Engine, settings, prompt_ids: torch.Tensor, tokens: int, warmup: int) -> Run:
    """Configure, warm up on the prompt, then generate `tokens` greedy tokens; decode steps only."""
    engine.configure(settings)
    for _ in stream_generate(lm.model, prompt_ids, engine=engine, max_new_tokens=warmup, stop_on_eos=False):
        pass
    events = list(stream_generate(lm.model, prompt_ids, engine=engine, max_new_tokens=tokens, stop_on_eos=False))
    decode = events[1:]
    steady = sum((e.counters for e in decode), Counters())
    n = len(decode)
    return Run(statistics.median(e.latency_s for e in decode) * 1e3, steady.exposed_s * 1e3 / n,
               (steady.misses + steady.hits_top) / n, [e.token_id for e in events])


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    """median [min–max] of per-round values."""
    return f"{fmt.format(statistics.median(values))} \\[{fmt.format(min(values))}–{fmt.format(max(values))}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the demo model")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds; medians and spread are reported")
    p.add_argument("--gbps", type=float, default=None, help="emulated link bandwidth (default: instant)")
    p.add_argument("--profile", choices=RUNS, help="cProfile one run of this policy instead of the table")
    args = p.parse_args()
    torch.set_num_threads(1)
    console = Console(width=130)
    console.print("command: python benchmarks/host_work.py " + " ".join(sys.argv[1:]), highlight=False)
    lm = load_model(str(args.model or demo_path()), device="cpu", dtype="float32", console=console)
    prompt_ids = encode_prompt(lm, PROMPT)
    shape = lm.shape
    link = EmulatedLink(args.gbps)
    engine = Engine(lm.layers, lm.store, shape, link, lm.device, lm.dtype)
    engine.install(lm.model)
    t_exp = expert_compute_s(lm)
    console.print(f"{lm.label}: {shape.num_layers} MoE layers × {shape.num_experts} experts, top-{shape.top_k}, "
                  f"T_exp = {t_exp * 1e3:.3f} ms; {link.label()}; {args.tokens} tokens after {args.warmup} warm-up",
                  highlight=False)

    if args.profile:
        measure(lm, engine, settings(args.profile, shape), prompt_ids, args.tokens, args.warmup)
        profiler = cProfile.Profile()
        profiler.enable()
        measure(lm, engine, settings(args.profile, shape), prompt_ids, args.tokens, args.warmup)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
        engine.close()
        return

    runs: dict[str, list[Run]] = {name: [] for name in RUNS}
    for r in range(args.repeats):
        for name in RUNS if r % 2 == 0 else RUNS[::-1]:
            with console.status(f"round {r + 1}/{args.repeats}: {name} …"):
                runs[name].append(measure(lm, engine, settings(name, shape), prompt_ids, args.tokens, args.warmup))
    engine.close()

    table = Table(title=f"host work per loaded segment, {lm.label}, {link.label()}: median \\[min–max] of "
                        f"{args.repeats} interleaved rounds")
    for col in ("run", "TPOT ms", "− resident ms", "exposed ms/tok", "segments/tok", "host ms/segment",
                "÷ T_exp"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for name in RUNS:
        rs = runs[name]
        extra = [x.tpot_ms - b.tpot_ms for x, b in zip(rs, runs["resident"])]
        exposed = [x.exposed_ms for x in rs]
        per_token = [x.segments for x in rs]
        per_segment = [(d - e) / s if s else 0.0 for d, e, s in zip(extra, exposed, per_token)]
        table.add_row(name, spread([x.tpot_ms for x in rs]), spread(extra), spread(exposed),
                      f"{statistics.median(per_token):.1f}", spread(per_segment),
                      spread([v / (t_exp * 1e3) for v in per_segment], "{:.2f}"))
    console.print(table)
    same = len({tuple(x.token_ids) for rs in runs.values() for x in rs}) == 1
    console.print("token ids identical across runs" if same else "[red]token ids DIFFER[/red]")


if __name__ == "__main__":
    main()
