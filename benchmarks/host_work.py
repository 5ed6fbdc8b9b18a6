#!/usr/bin/env python3
"""Host work per loaded segment (issue 12, task h1): what one load costs the host when the link costs nothing.

On the demo model, through an instant emulated link (no link time: every transfer is
done when it is polled; the host only runs the engine's bookkeeping), measured side by
side in interleaved rounds:

- `resident`: every expert whole on the device, nothing loaded (the floor);
- `ondemand`: no cache, no prefetch: every activated expert is one loaded segment;
- `split`: θ = 0.5 and every expert's top cached (no prefetch): every activation is a
  top hit plus a loaded bottom, two segment_forwards and an add;
- `prefetch-only`: `ondemand` plus speculative prefetch into the staging pool (the same
  loads, some of them issued one layer early): what it adds to `ondemand` is the host
  work of the prefetch path (the predictor's scores, issuing, taking over or dropping),
  per MoE layer: (TPOT_prefetch-only − TPOT_ondemand) / L.

Both loaded policies compute the same experts as `resident` (whole or in two halves),
so what they add is host work. Per loaded segment:

    host per segment = (TPOT_policy − TPOT_resident − exposed) / loaded segments per token

with loaded segments per token = (misses + top hits) / decode tokens, from the engine's
counters, and exposed = the time the compute waited on the link (0 on an instant link).
Differences are taken per round; tables give the median over rounds and the spread
(min–max of the per-round values). A decode step also runs attention, sampling and the
other layers, so each run also times the engine alone (profiling/model.py: `layer_forward_s`): one MoE
layer's experts forward for one token routed to K fixed experts, every layer in turn,
`--layer-reps` times; per segment = (µs − resident µs) / K. (`split` includes its second,
smaller segment_forward and the add: compute that a whole expert does not do.)

    python benchmarks/host_work.py [--repeats 5 --tokens 32 --warmup 4 --gbps GB/s]
    python benchmarks/host_work.py --profile ondemand     # cProfile of one run, top functions
    python benchmarks/host_work.py --versions OLD NEW --rounds 4   # two source trees (their fmoe_cli), one
        process per tree and round, alternating: host ms per segment of each, side by side
    python benchmarks/host_work.py --ops   # aten ops per decode step (profiling/ops.py), no timing
    python benchmarks/host_work.py --ops --loading   # the same for the policies that load, on a GPU's link
    python benchmarks/host_work.py --alternatives [--repeats 7]   # fewer ops, timed: what they cost on this CPU

`--ops` counts what the host dispatches instead of timing it (a count does not depend on
how busy the machine is): one decode step of tiny random checkpoints shaped like
Mixtral (8 experts, top-2), Qwen3-30B-A3B (128 experts, top-8) and DeepSeek-V3 (shared
expert, a dense first layer), under `resident`, `cache-only` (whole hits of a cache), `ondemand`
and `uniform` (θ = 0.5, every expert's top cached: split), on an instant link: with
FMOE_KERNELS=torch the device path's code (the store's grouping on), without it the CPU's
(a segment is one kernel call; a decode layer's whole experts one call for all): ops per whole
segment forward, per split expert, per MoE layer besides its segments, of the predictor, per
activated expert, and the engine's part of a layer (everything in its experts forward but the
predictor's).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from dataclasses import asdict, dataclass

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
from fmoe_cli.profiling.model import expert_compute_s, layer_forward_s
from fmoe_cli.types import Plan

PROMPT = "Explain how a mixture of experts decides which experts to use for each token."
RUNS = ("resident", "ondemand", "split", "prefetch-only")


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
    layer_us: float = 0.0  # one MoE layer's experts forward, one token, K fixed experts (profiling/model.py: `layer_forward_s`)


def measure(lm, engine: Engine, settings, prompt_ids: torch.Tensor, tokens: int, warmup: int,
            layer_reps: int = 0) -> Run:
    """Configure, warm up on the prompt, then generate `tokens` greedy tokens (decode steps only);
    then `layer_forward_us` with `layer_reps` repetitions."""
    engine.configure(settings)
    for _ in stream_generate(lm.model, prompt_ids, engine=engine, max_new_tokens=warmup, stop_on_eos=False):
        pass
    events = list(stream_generate(lm.model, prompt_ids, engine=engine, max_new_tokens=tokens, stop_on_eos=False))
    decode = events[1:]
    steady = sum((e.counters for e in decode), Counters())
    n = len(decode)
    return Run(statistics.median(e.latency_s for e in decode) * 1e3, steady.exposed_s * 1e3 / n,
               (steady.misses + steady.hits_top) / n, [e.token_id for e in events],
               layer_forward_s(lm, engine, layer_reps) * 1e6 if layer_reps else 0.0)


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    """median [min–max] of per-round values."""
    return f"{fmt.format(statistics.median(values))} \\[{fmt.format(min(values))}–{fmt.format(max(values))}]"


def per_segment(runs: dict[str, list[dict]], name: str) -> list[float]:
    """Host ms per loaded segment of `name`, per round: (TPOT − resident TPOT − exposed) / segments."""
    return [(x["tpot_ms"] - b["tpot_ms"] - x["exposed_ms"]) / x["segments"]
            for x, b in zip(runs[name], runs["resident"])]


def per_segment_layer(runs: dict[str, list[dict]], name: str, k: int) -> list[float]:
    """The same from the one-layer measurement, in µs: (layer µs − resident layer µs) / K segments."""
    return [(x["layer_us"] - b["layer_us"]) / k for x, b in zip(runs[name], runs["resident"])]


def compare(args) -> None:
    """Two source trees side by side: processes alternate (tree A, tree B, B, A, …), each a full run."""
    import os
    import subprocess

    console = Console(width=210)
    console.print("command: python benchmarks/host_work.py " + " ".join(sys.argv[1:]), highlight=False)
    own = [a for a in sys.argv[1:] if a not in args.versions and a not in ("--versions",)]
    own = [a for i, a in enumerate(own) if a != "--rounds" and (i == 0 or own[i - 1] != "--rounds")]
    runs: dict[str, dict[str, list[dict]]] = {tree: {name: [] for name in RUNS} for tree in args.versions}
    for r in range(args.rounds):
        for tree in args.versions if r % 2 == 0 else args.versions[::-1]:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
            with console.status(f"round {r + 1}/{args.rounds}: {tree} …"):
                out = subprocess.run([sys.executable, __file__, *own, "--json"], env=env, check=True,
                                     capture_output=True, text=True).stdout
            report = json.loads(out)
            for name, rs in report["runs"].items():
                runs[tree][name] += rs
            runs[tree]["k"], runs[tree]["layers"] = report["top_k"], report["layers"]
    table = Table(title=f"host ms per loaded segment: {args.rounds} processes per tree (alternating) × "
                        f"{args.repeats} interleaved rounds each; median \\[min–max] over all rounds")
    for col in ("tree", *(f"{n} TPOT ms" for n in RUNS), "ondemand ms/seg", "split ms/seg",
                "1 layer: ondemand µs/seg", "1 layer: split µs/seg", "prefetch path ms/layer",
                "1 layer: prefetch path µs"):
        table.add_column(col, justify="left" if col == "tree" else "right")
    k = runs[args.versions[0]]["k"]
    for tree, rr in runs.items():
        table.add_row(tree, *(spread([x["tpot_ms"] for x in rr[n]]) for n in RUNS),
                      spread(per_segment(rr, "ondemand")), spread(per_segment(rr, "split")),
                      spread(per_segment_layer(rr, "ondemand", k), "{:.1f}"),
                      spread(per_segment_layer(rr, "split", k), "{:.1f}"),
                      spread([(x["tpot_ms"] - o["tpot_ms"]) / runs[tree]["layers"]
                              for x, o in zip(rr["prefetch-only"], rr["ondemand"])]),
                      spread([x["layer_us"] - o["layer_us"] for x, o in zip(rr["prefetch-only"], rr["ondemand"])],
                             "{:.1f}"))
    console.print(table)
    table = Table(title="as measured: TPOT ms of a decode step, and µs of one MoE layer's experts forward alone "
                        "(one token, K fixed experts); median \\[min–max] over all rounds")
    table.add_column("tree")
    for n in RUNS:
        table.add_column(f"{n} TPOT ms", justify="right")
        table.add_column(f"{n} 1 layer µs", justify="right")
    for tree, rr in runs.items():
        table.add_row(tree, *(cell for n in RUNS for cell in (spread([x["tpot_ms"] for x in rr[n]]),
                                                                spread([x["layer_us"] for x in rr[n]], "{:.1f}"))))
    console.print(table)
    ids = {tuple(x["token_ids"]) for rr in runs.values() for n in RUNS for x in rr[n]}
    console.print("token ids identical across trees and runs" if len(ids) == 1 else "[red]token ids DIFFER[/red]")


OPS_POLICIES = ("resident", "cache-only", "ondemand", "uniform")  # cache-only: whole hits of a cache, decode's one call
OPS_SHAPES = {  # family, overrides of models/demo.py's tiny config
    "mixtral-shaped": ("mixtral", {}),
    "qwen3-30b-a3b-shaped": ("qwen3_moe", {"num_experts": 128, "num_experts_per_tok": 8}),
    "deepseek-v3-shaped": ("deepseek_v3", {}),
}


# --ops --loading: the policies that load, a quarter of the experts cached, K = 8
LOADING_OPS_POLICIES = ("ondemand", "lru", "moepic", "uniform")
LOADING_OPS_SHAPES = {name: OPS_SHAPES[name] for name in ("qwen3-30b-a3b-shaped",)}


def count_ops(console: Console, as_json: bool, loading: bool = False) -> None:
    """Aten ops per decode step (fmoe_cli/profiling/ops.py) for the OPS_SHAPES under three plans: the 11th decode
    step after a 48-token prompt (every expert routed before: each buffer's views are made once, before); the
    device path's code (with FMOE_KERNELS=torch: torch's segment forwards; the store's grouping on). `loading`: the
    policies that load (LOADING_OPS_POLICIES) at a quarter of the experts cached, behind a link that copies into the
    staging slots as a GPU's does (the CPU's instant link hands out the host store's rows instead), so that a layer's
    loads are computed as on a GPU (offload/engine.py `_loaded_decode`)."""
    import tempfile
    from pathlib import Path

    from fmoe_cli.models.demo import build_random_moe
    from fmoe_cli.profiling.ops import count_decode_ops
    from fmoe_cli.types import Timings

    rows = []
    prompt = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as root:
        for name, (family, overrides) in (LOADING_OPS_SHAPES if loading else OPS_SHAPES).items():
            path = build_random_moe(Path(root) / name, family=family, seed=1, **overrides)
            lm = load_model(str(path), device="cpu", dtype="float32", console=console)
            lm.store.grouping = True  # the device path's grouping (off by default on the CPU, where the loop is faster)
            shape = lm.shape
            timings = Timings(t_att=1e-4, t_moe=2e-4, t_head=1e-4, t_load=3e-4, top_k=shape.top_k)  # moepic's plan
            for policy in LOADING_OPS_POLICIES if loading else OPS_POLICIES:
                engine = Engine(lm.layers, lm.store, shape, EmulatedLink(None, copy=loading), lm.device, lm.dtype)
                engine.install(lm.model)
                budget = 2 * shape.top_k * shape.expert_bytes + shape.all_experts_bytes // (4 if loading else 1)
                engine.configure(make_settings(policy, shape, budget, timings=timings,
                                               theta=0.5 if policy == "uniform" else None))
                steps = stream_generate(lm.model, prompt, engine=engine, max_new_tokens=12, stop_on_eos=False)
                for _ in range(11):
                    next(steps)
                ops = count_decode_ops(lambda: next(steps))
                engine.close()
                activated = ops["layers"] * shape.top_k
                experts_forward = (ops["segments"] * ops["ops_per_segment"]
                                   + ops["split_experts"] * ops["ops_per_split_expert"]
                                   + (ops["ops_per_layer_besides_segments"] + ops["predictor_ops_per_layer"])
                                   * ops["layers"])
                rows.append({"shape": name, "policy": policy, "top_k": shape.top_k,
                             "segments_per_layer": ops["segments"] / ops["layers"],
                             "split_per_layer": ops["split_experts"] / ops["layers"],
                             "ops_per_segment": ops["ops_per_segment"],
                             "ops_per_split_expert": ops["ops_per_split_expert"],
                             "ops_per_layer_besides_segments": ops["ops_per_layer_besides_segments"],
                             "predictor_ops_per_layer": ops["predictor_ops_per_layer"],
                             "ops_per_activated_expert": experts_forward / activated,
                             "engine_ops_per_layer": (experts_forward - ops["predictor_ops_per_layer"] * ops["layers"])
                             / ops["layers"]})
    if as_json:
        print(json.dumps(rows))
        return
    table = Table(title="aten ops per decode step (TorchDispatchMode; no timing)")
    columns = ("shape", "policy", "K", "whole / layer", "split / layer", "ops / whole segment", "ops / split expert",
               "ops / layer besides", "predictor ops / layer", "ops / activated expert (all)",
               "engine ops / layer (all but the predictor)")
    for column in columns:
        table.add_column(column, justify="left" if column in ("shape", "policy") else "right")
    for r in rows:
        table.add_row(r["shape"], r["policy"], str(r["top_k"]), f"{r['segments_per_layer']:.1f}",
                      f"{r['split_per_layer']:.1f}", f"{r['ops_per_segment']:.1f}", f"{r['ops_per_split_expert']:.1f}",
                      f"{r['ops_per_layer_besides_segments']:.1f}", f"{r['predictor_ops_per_layer']:.1f}",
                      f"{r['ops_per_activated_expert']:.1f}", f"{r['engine_ops_per_layer']:.1f}")
    Console(width=200).print(table)


ALTERNATIVE_SHAPES = {  # name: (experts N, neurons I, hidden H); K = 8 activated
    "tiny (tests)": (128, 64, 64),
    "demo": (16, 192, 256),
    "a3b (Qwen3-30B-A3B)": (128, 768, 2048),
}


def time_alternatives(repeats: int) -> None:
    """torch's ways to dispatch fewer ops, each timed against another (interleaved rounds, median [min–max] µs
    per call, one thread) and its bits compared:
    - a whole segment: gate and up from one matmul over the [2, H, n] view of the neuron-major rows and the
      split into both (the engine's, 4 kernels) against two linears (before, 5 kernels); 5 ops each;
    - a split expert (θ = 0.5): the engine's 6 ops (layout.top_forward, bottom_forward) against two whole
      segment forwards and the add (11 ops, before);
    - a layer's K = 8 experts from one buffer: one segment_forward each (5·K ops) against torch's grouped matmul
      (layout.grouped_forward: 9 ops for the K experts)."""
    import torch.nn.functional as F

    from fmoe_cli.offload import layout

    torch.set_num_threads(1)
    console = Console(width=170)
    console.print("command: python benchmarks/host_work.py " + " ".join(sys.argv[1:]), highlight=False)
    table = Table(title=f"host µs per call, median \\[min–max] of {repeats} interleaved rounds (float32, 1 thread, "
                        "decode: one token)")
    for column in ("shape", "what", "A", "B", "same bits"):
        table.add_column(column, justify="left" if column in ("shape", "what") else "right")
    g = torch.Generator().manual_seed(0)
    act = F.silu
    for name, (n_experts, neurons, hidden) in ALTERNATIVE_SHAPES.items():
        layer = torch.randn(n_experts, neurons, 3, hidden, generator=g) * 0.05  # [N, I, 3, H]
        x = torch.randn(1, hidden, generator=g)
        active = list(range(0, n_experts, n_experts // 8))[:8]
        rows = [layout.split_rows(layer[e]) for e in active]
        linears = [layer[e].unbind(1) for e in active]  # (gate, up, down) [n, H] each

        def two_linears():
            return [(act(F.linear(x, gate)) * F.linear(x, up)) @ down for gate, up, down in linears]

        def one_matmul():
            return [layout.segment_forward(x, r, act) for r in rows]

        k = neurons // 2
        tops = [layout.split_rows(layer[e][:k]) for e in active]
        bottoms = [layout.split_rows(layer[e][k:]) for e in active]
        workspace = layout.SplitWorkspace.make(1, k, neurons, x.dtype, x.device)

        def split_before():
            return [layout.segment_forward(x, t, act) + layout.segment_forward(x, b, act)
                    for t, b in zip(tops, bottoms)]

        def split_now():
            return [layout.bottom_forward(x, b, act, layout.top_forward(x, t, workspace)) for t, b in zip(tops, bottoms)]

        stacked = [layout.stack_rows(layer)[e] for e in active]  # the slots of one buffer [N, I, 3, H]

        def grouped():  # the engine's grouped form (store.grouping)
            return layout.grouped_forward(x, stacked, act)

        for what, a, b in (("a whole segment: A two linears, B one matmul for gate and up", two_linears, one_matmul),
                           ("a split expert: A 11 ops (before), B 6 ops", split_before, split_now),
                           ("K = 8 experts of one buffer: A a loop, B grouped (layout.grouped_forward)", one_matmul, grouped)):
            same = all(torch.equal(p, q.view_as(p)) for p, q in zip(a(), b()))
            if not same:
                same = max((p - q.view_as(p)).abs().max().item() for p, q in zip(a(), b()))
            times: dict[str, list[float]] = {"A": [], "B": []}
            for r in range(repeats):
                for key, fn in (("A", a), ("B", b)) if r % 2 == 0 else (("B", b), ("A", a)):
                    reps = 20
                    start = time.perf_counter()
                    for _ in range(reps):
                        fn()
                    times[key].append((time.perf_counter() - start) / reps * 1e6 /
                                      (1 if what.startswith("K") else len(active)))
            unit = " (µs per layer)" if what.startswith("K") else " (µs per expert)"
            table.add_row(name, what + unit, spread(times["A"], "{:.1f}"), spread(times["B"], "{:.1f}"),
                          "yes" if same is True else f"no (max |Δ| {same:.1e})")
    console.print(table)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the demo model")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds; medians and spread are reported")
    p.add_argument("--gbps", type=float, default=None, help="emulated link bandwidth (default: instant)")
    p.add_argument("--profile", choices=RUNS, help="cProfile one run of this policy instead of the table")
    p.add_argument("--json", action="store_true", help="the per-round figures as JSON on stdout")
    p.add_argument("--versions", nargs=2, metavar="TREE", help="compare two source trees (directories holding "
                   "fmoe_cli): --rounds processes each, alternating, every one running --repeats rounds")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--layer-reps", type=int, default=200, help="repetitions of the one-layer measurement")
    p.add_argument("--ops", action="store_true", help="count aten ops per decode step instead of timing")
    p.add_argument("--loading", action="store_true", help="with --ops: the policies that load, a quarter cached, "
                   "behind a link that copies into the staging slots (a GPU's)")
    p.add_argument("--alternatives", action="store_true", help="time the ways to dispatch fewer ops on this CPU")
    args = p.parse_args()
    if args.ops:  # the GPU's code: torch's matmuls (no one-call C token, which has no layers to count), the device path
        os.environ["FMOE_KERNELS"], os.environ["FMOE_DEVICE_PATH"] = "torch", "1"
        return count_ops(Console(stderr=True), args.json, args.loading)
    if args.alternatives:
        return time_alternatives(args.repeats)
    if args.versions:
        return compare(args)
    torch.set_num_threads(1)
    console = Console(width=170, stderr=args.json)
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
                runs[name].append(measure(lm, engine, settings(name, shape), prompt_ids, args.tokens, args.warmup,
                                          args.layer_reps))
    engine.close()

    if args.json:
        print(json.dumps({"t_exp_ms": t_exp * 1e3, "link": link.label(), "tokens": args.tokens, "warmup": args.warmup,
                          "top_k": shape.top_k, "layers": shape.num_layers,
                          "runs": {name: [asdict(x) for x in rs] for name, rs in runs.items()}}))
        return
    table = Table(title=f"host work per loaded segment, {lm.label}, {link.label()}: median \\[min–max] of "
                        f"{args.repeats} interleaved rounds")
    for col in ("run", "TPOT ms", "− resident ms", "exposed ms/tok", "segments/tok", "host ms/segment",
                "÷ T_exp", "1 layer µs", "1 layer: µs/segment"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for name in RUNS:
        rs = runs[name]
        extra = [x.tpot_ms - b.tpot_ms for x, b in zip(rs, runs["resident"])]
        exposed = [x.exposed_ms for x in rs]
        per_token = [x.segments for x in rs]
        per_segment = [(d - e) / s if s else 0.0 for d, e, s in zip(extra, exposed, per_token)]
        layer = [(x.layer_us - b.layer_us) / shape.top_k for x, b in zip(rs, runs["resident"])]
        table.add_row(name, spread([x.tpot_ms for x in rs]), spread(extra), spread(exposed),
                      f"{statistics.median(per_token):.1f}", spread(per_segment),
                      spread([v / (t_exp * 1e3) for v in per_segment], "{:.2f}"),
                      spread([x.layer_us for x in rs], "{:.1f}"), spread(layer, "{:.1f}"))
    console.print(table)
    pf, od = runs["prefetch-only"], runs["ondemand"]
    console.print("prefetch path (prefetch-only − ondemand): "
                  f"{spread([(x.tpot_ms - o.tpot_ms) / shape.num_layers for x, o in zip(pf, od)])} ms per MoE layer "
                  f"in a decode step, {spread([x.layer_us - o.layer_us for x, o in zip(pf, od)], '{:.1f}')} µs per "
                  "layer forward alone (median \\[min–max] over rounds)", highlight=False)
    same = len({tuple(x.token_ids) for rs in runs.values() for x in rs}) == 1
    console.print("token ids identical across runs" if same else "[red]token ids DIFFER[/red]")


if __name__ == "__main__":
    main()
