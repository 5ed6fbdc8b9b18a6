#!/usr/bin/env python3
"""Predicted TPOT (planning/simulate.py) against measurement, then in MoEpic's setting.

1. `validate`: on the demo model (or --model), every policy runs on the engine over an
   emulated link (one expert load = --load-ratio × one expert's compute) at --budget,
   policies interleaved over --rounds; each measured run's routing (with the
   prefetcher's rankings) is recorded, and the simulator replays exactly that run
   (same settings and plan, same link figures; compute times: the configurator's T_exp,
   with T_att and T_head scaled so that the simulated `resident` run, which loads
   nothing, takes the measured resident TPOT: the engine's host work is compute too). The
   offloading path's host work (h_load, h_pf, a_e, c) is the quick profile's own measurement
   (profiling/model.py), as `fmoe plan` uses it. Printed: measured vs simulated TPOT per policy
   (medians over rounds, and minima), target within ±15 %, both hit rates, and sim ÷ meas
   (1) with the profile's figures alone, (2) with compute fitted to resident, (3) with the host
   work fitted to ondemand and prefetch-only instead of measured, (4) without host work.

2. `mixtral`: Mixtral-8x7B's config.json (written here), the real HumanEval routing
   trace (not shipped: --trace or FMOE_MIXTRAL_TRACE, benchmarks/mixtral_trace.py; without it
   traces/demo.jsonl mapped onto Mixtral's shape; vLLM format: no rankings, so the routing-only `eam` predictor), the RTX A6000 /
   PCIe 4.0 x16 reference profile (compute from its memory bandwidth), an expert budget
   of 160 experts (MoEpic's): simulated TPOT of moepic, lru, lfu, prefetch-only (and the
   rest) beside the paper's 85 / 162 / 136 / 248 ms.

    python benchmarks/simulate.py validate [--rounds 3 --tokens 32 --load-ratio 3 --budget 25%]
    python benchmarks/simulate.py mixtral [--experts 160 --profile profiles/rtx-a6000.json --trace MIXTRAL]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

POLICIES = ["moepic", "lru", "lfu", "uniform", "cache-only", "prefetch-only", "resident"]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import mixtral_trace  # noqa: E402 (benchmarks/mixtral_trace.py: where the trace comes from, the fallback)
# MoEpic (Mixtral-8x7B, RTX A6000, 160 experts): TPOT of each system, ms; the fmoe policy standing in for it.
PAPER = {"moepic": ("MoEpic", 85), "lru": ("Mixtral-offloading", 162), "lfu": ("MoE-Infinity", 136),
         "prefetch-only": ("Pre-gated MoE", 248)}
MIXTRAL_CONFIG = {  # mistralai/Mixtral-8x7B-v0.1 config.json (the figures that matter here)
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "initializer_range": 0.02, "output_router_logits": False, "router_aux_loss_coef": 0.02, "use_cache": True,
    "attention_dropout": 0.0,
}


def validate(args, console: Console) -> None:
    from engine import PROMPT  # benchmarks/engine.py

    from fmoe_cli.profiling.model import expert_compute_s

    from fmoe_cli.bench.run import bench_policy, encode_prompt
    from fmoe_cli.trace import RouteRecorder, TraceWriter, read_trace
    from fmoe_cli.models.load import load_model
    from fmoe_cli.offload.engine import Engine
    from fmoe_cli.offload.link import EmulatedLink
    from fmoe_cli.planning.plan import parse_budget
    from fmoe_cli.planning.presets import PlanInputs, settings_for
    from fmoe_cli.planning.replan import Replanner
    from fmoe_cli.planning.simulate import tokens_of
    from fmoe_cli.planning.stats import StatsRecorder, load_or_empty
    from fmoe_cli.run import find_timings

    torch.set_num_threads(1)
    lm = load_model(args.model, device="cpu", dtype="float32", console=console, experts=args.experts, dense=args.dense)
    shape = lm.shape
    prompt_ids = encode_prompt(lm, PROMPT)
    t_exp = expert_compute_s(lm)
    if args.gbps is not None:  # a link of its own: the load ratio follows
        args.load_ratio = shape.expert_bytes / (args.gbps * 1e9) / t_exp
    gbps = args.gbps or shape.expert_bytes / (args.load_ratio * t_exp) / 1e9
    budget = parse_budget(args.budget, shape.all_experts_bytes)
    link = EmulatedLink(gbps)
    timings = find_timings(lm, link)  # the configurator's timings (as fmoe bench finds them)
    engine = Engine(lm.layers, lm.store, shape, link, lm.device, lm.dtype)
    engine.install(lm.model)
    stats_path = Path(tempfile.mkdtemp(prefix="fmoe-bench-stats-")) / "routing.stats.json"  # not the user's
    stats = load_or_empty(lm.model_id, shape.num_layers, shape.num_experts, shape.top_k, stats_path)
    planner = Replanner(engine, PlanInputs(shape, budget, timings, model=lm.model_id), StatsRecorder(stats, stats_path))
    trace_path = Path(tempfile.mkdtemp(prefix="fmoe-sim-")) / "runs.jsonl"
    writer = TraceWriter.for_model(trace_path, lm)
    recorder = RouteRecorder(writer)
    runs = [p for p in POLICIES + ["ondemand"] if p in args.policies]  # ondemand: calibrates the host work per load
    measured: dict[str, list[float]] = {p: [] for p in runs}
    measured_hit: dict[str, float] = {}
    measured_exposed: dict[str, list[float]] = {p: [] for p in runs}
    used: dict[str, list] = {p: [] for p in runs}
    for r in range(args.rounds):
        for name in runs:
            settings = settings_for(name, planner.plan_inputs())

            def start(seq=f"{name}#{r}"):
                recorder.start_sequence(seq)
                engine.observers.append(recorder)

            with console.status(f"round {r + 1}/{args.rounds}: {name} …"):
                run = bench_policy(lm, engine, settings, prompt_ids, args.tokens, args.warmup, before_measure=start)
            engine.observers.remove(recorder)
            measured[name].append(run.tpot_ms["median"])
            measured_hit[name] = run.hit_rate
            measured_exposed[name].append(run.exposed_load_ms_per_token)
            used[name].append(settings)
            planner()
    planner.close()
    engine.close()
    writer.close()
    trace = read_trace(trace_path)
    by_seq = dict(zip((s.id for s in trace.sequences), tokens_of(trace)))
    prompt_len = prompt_ids.shape[1]
    rows = {}
    # Measured times only grow with the other work on the machine: the minimum over rounds is printed
    # beside the median (both calibrated and compared the same way, over the same runs).
    for label, stat in (("median", statistics.median), ("min", min)):
        rows[label] = compare(console, args, lm, label, stat, timings, measured, measured_hit, measured_exposed, used,
                              by_seq, prompt_len, gbps, link.latency_s, t_exp, runs)
    if args.json:
        print(json.dumps(rows))


def compare(console, args, lm, label, stat, timings, measured, measured_hit, measured_exposed, used, by_seq,
            prompt_len, gbps, latency, t_exp, runs) -> dict:
    """Calibrate compute on `resident` and the host work on `ondemand` / `prefetch-only` (each run's
    `stat` over rounds), simulate every policy, print simulated ÷ measured."""
    from dataclasses import replace

    from fmoe_cli.models.load import precision_label
    from fmoe_cli.planning.simulate import simulate_policy

    shape = lm.shape
    profiled = timings  # the quick profile's figures, as `fmoe plan` uses them: nothing fitted to these runs
    # Compute calibrated on the measured resident run (no loads): the engine's per-layer host work
    # around the layer times the configurator measured goes into T_att; the other policies are predictions.
    timings, extra = fitted_to_resident(timings, shape, stat(measured["resident"]) / 1e3)
    bare_times = replace(timings, t_host_load=0.0, t_host_prefetch=0.0, t_admit=0.0, t_segment=0.0)
    table = Table(title=f"simulated vs measured TPOT: {lm.label} ({precision_label(str(lm.dtype).removeprefix('torch.'), shape.experts, lm.dense)}), link: emulated {gbps:.3g} GB/s "
                        f"(expert load {args.load_ratio:g} × T_exp), budget {args.budget}, "
                        f"{label} of {args.rounds} interleaved rounds; sim ÷ meas with the host work "
                        f"measured by the profile (1) alone, (2) with T_att, T_head fitted to resident, "
                        f"(3) also h_load, h_pf fitted to ondemand, prefetch-only, (4) (2) without host work")
    for col in ("policy", "measured ms", "spread", "hit", "sim hit", "exposed ms", "sim exposed ms",
                "simulated ms (2)", "(1) profile", "(2) + compute fit", "(3) + host fit", "(4) no host work"):
        table.add_column(col, justify="left" if col == "policy" else "right")

    def simulated(name, times):  # every measured round of `name` replayed; (`stat` TPOT ms, runs)
        sims = [simulate_policy(shape, s, times, [by_seq[f"{name}#{r}"]], bandwidth=gbps * 1e9,
                                latency=latency, prompt_tokens=prompt_len, warmup=args.warmup)
                for r, s in enumerate(used[name])]
        return stat([x.tpot_s * 1e3 for x in sims]), sims

    def calibrate(name, key, units, times):
        """The Timings field `key` (s) that makes simulated `name` = its measured figure: `units` of it per
        token, refined by fixed point (host time can hide link time, so the relation is not linear)."""
        h = 0.0
        for _ in range(6):
            sim, _runs = simulated(name, replace(times, **{key: h}))
            h = max(0.0, h + (stat(measured[name]) - sim) / 1e3 / units)
        return h

    # (3) Host work of the offloading path fitted to these runs: h_load per loaded segment, from ondemand
    # (every activation one whole-expert load, no prefetch); then h_pf per prefetching layer, from prefetch-only.
    _sim, od = simulated("ondemand", timings)
    loads_per_token = statistics.median(x.bytes_per_token for x in od) / shape.expert_bytes
    h_load = calibrate("ondemand", "t_host_load", loads_per_token, timings)
    h_pf = calibrate("prefetch-only", "t_host_prefetch", shape.num_layers, replace(timings, t_host_load=h_load))
    fitted_times = replace(timings, t_host_load=h_load, t_host_prefetch=h_pf)
    fitted = {"resident": "(fit: T_att)", "ondemand": "(fit: h_load)", "prefetch-only": "(fit: h_pf)"}
    rows = {}
    for name in runs:
        meas = stat(measured[name])
        alone, _ = simulated(name, profiled)
        sim, sims = simulated(name, timings)
        fit, _ = simulated(name, fitted_times)
        bare, _ = simulated(name, bare_times)
        rows[name] = {"measured_ms": measured[name], "simulated_ms": [x.tpot_s * 1e3 for x in sims],
                      "simulated_profile_only_ms": alone, "simulated_host_fitted_ms": fit,
                      "simulated_no_host_ms": bare}
        table.add_row(name, f"{meas:.2f}", f"{min(measured[name]):.2f}–{max(measured[name]):.2f}",
                      f"{measured_hit[name]:.2f}", f"{sims[-1].hit_rate:.2f}",
                      f"{statistics.median(measured_exposed[name]):.2f}", f"{sims[-1].exposed_s_per_token * 1e3:.2f}",
                      f"{sim:.2f}", f"{alone / meas:.2f}",
                      f"{sim / meas:.2f}{' (fit: T_att)' if name == 'resident' else ''}",
                      f"{fit / meas:.2f} {fitted.get(name, '')}", f"{bare / meas:.2f}")
    console.print(table)
    console.print(f"host work measured by the profile: h_load {profiled.t_host_load * 1e3:.3f} ms per loaded segment, "
                  f"h_pf {profiled.t_host_prefetch * 1e3:.3f} ms per prefetching layer, a_e {profiled.t_admit * 1e3:.3f} "
                  f"ms per expert admitted, c {profiled.t_segment * 1e3:.3f} ms per split top hit; fitted (3): h_load "
                  f"{h_load * 1e3:.3f} ms (ondemand: {loads_per_token:.1f} loads per token), h_pf {h_pf * 1e3:.3f} ms",
                  highlight=False)
    if args.matrix:
        simulated_matrix(console, lm, shape, timings, t_exp, by_seq[f"moepic#{args.rounds - 1}"],
                         prompt_len, args.warmup, latency)
    console.print(f"compute times: the configurator's T_exp; T_att and T_head scaled to the measured resident "
                  f"TPOT (T_att {extra * 1e3:+.3f} ms per layer): T_att {timings.t_att * 1e3:.3f} ms, "
                  f"T_exp {timings.t_exp * 1e3:.3f} ms, T_head {timings.t_head * 1e3:.3f} ms; "
                  f"moepic plan: {used['moepic'][-1].plan.summary()}", highlight=False)
    return rows


def fitted_to_resident(timings, shape, resident_s: float):
    """Compute calibrated on a measured resident TPOT (no loads): T_exp kept (the expert compute the loads race
    against), the rest of the token (attention, head and the engine's host work) shared between T_att and T_head in
    the profile's proportion. Returns (timings, the change of T_att per layer)."""
    from dataclasses import replace

    experts_s = shape.num_layers * timings.t_moe
    rest = max(0.0, resident_s - experts_s)
    share = timings.t_head / (timings.t_head + shape.num_layers * timings.t_att) if timings.t_head else 0.0
    extra = rest * (1 - share) / shape.num_layers - timings.t_att
    return replace(timings, t_att=rest * (1 - share) / shape.num_layers, t_head=rest * share), extra


def simulated_matrix(console, lm, shape, timings, t_exp, tokens, prompt_len, warmup, latency) -> None:
    """Issue 12's matrix, simulated: the measured moepic run's routing and rankings (the same for every
    policy: every policy is exact), every load ratio × budget, the calibrated compute times."""
    from dataclasses import replace

    from fmoe_cli.planning.plan import parse_budget
    from fmoe_cli.planning.presets import PlanInputs, settings_for
    from fmoe_cli.planning.simulate import simulate_policy, stats_from

    baselines = ["lru", "lfu", "uniform", "cache-only", "prefetch-only"]
    stats = stats_from([tokens], shape)
    table = Table(title=f"simulated matrix: {lm.label}, the measured moepic run's routing; load ratio = one expert's "
                        f"load / its compute (T_exp {t_exp * 1e3:.3f} ms); TPOT ms")
    for col in ("ratio", "budget", "moepic", "best baseline", "moepic ÷ best", "resident", "verdict"):
        table.add_column(col, justify="left" if col in ("best baseline", "verdict") else "right")
    for ratio in (1, 3, 10, 30):
        bandwidth = shape.expert_bytes / (ratio * t_exp)
        t = replace(timings, t_load=latency + shape.expert_bytes / bandwidth)
        for budget_text in ("10%", "25%", "50%"):
            budget = parse_budget(budget_text, shape.all_experts_bytes)
            tpot = {}
            for name in ["moepic", *baselines, "resident"]:
                settings = settings_for(name, PlanInputs(shape, budget, t, stats, lm.model_id))
                tpot[name] = simulate_policy(shape, settings, t, [tokens], bandwidth=bandwidth, latency=latency,
                                             prompt_tokens=prompt_len, warmup=warmup,
                                             ).tpot_s * 1e3
            best = min(baselines, key=lambda n: tpot[n])
            quotient = tpot["moepic"] / tpot[best]
            verdict = ("nothing to gain (best ≈ resident)" if tpot[best] <= 1.05 * tpot["resident"]
                       else "meets ≤ 1.03" if quotient <= 1.03 else "misses 1.03")
            table.add_row(f"{ratio:g}", budget_text, f"{tpot['moepic']:.2f}", f"{best} {tpot[best]:.2f}",
                          f"{quotient:.2f}", f"{tpot['resident']:.2f}", verdict)
    console.print(table)


def mixtral_routing(option: str | None, shape, console: Console):
    """Mixtral's routing for the simulator, and its name: the real trace (--trace, $FMOE_MIXTRAL_TRACE), else the
    demo trace mapped onto `shape` (one line says so)."""
    from fmoe_cli.planning.simulate import tokens_of
    from fmoe_cli.trace import read_trace

    path = mixtral_trace.find(option)
    if path is not None:
        return tokens_of(read_trace(path)), str(path)
    console.print(mixtral_trace.absent_line("replaying traces/demo.jsonl mapped onto Mixtral's shape instead, its one "
                                            "sequence cut in two as the real trace's two (the paper's figures do not "
                                            "apply)"), highlight=False, soft_wrap=True)
    (demo,) = mixtral_trace.read_routing(mixtral_trace.DEMO_TRACE, shape, 10**9)
    return [demo[:len(demo) // 2], demo[len(demo) // 2:]], "traces/demo.jsonl (mapped, cut in two)"


def mixtral(args, console: Console) -> None:
    from fmoe_cli.planning.report import plan_timings
    from fmoe_cli.planning.simulate import predict_policies, tokens_of
    from fmoe_cli.profiling.files import Profile

    facts = facts_of(MIXTRAL_CONFIG)
    shape = facts.shape
    profile = Profile.load(Path(args.profile))
    link = profile.device.link
    timings, source = plan_timings(facts, link.bandwidth, link.latency or 0.0, profile)
    if args.load_ratio is not None:  # compute slower than the roofline: one expert's load = load_ratio × T_exp
        from dataclasses import replace

        scale = timings.t_load / (args.load_ratio * timings.t_exp)
        timings = replace(timings, t_att=timings.t_att * scale, t_moe=timings.t_moe * scale,
                          t_head=timings.t_head * scale)
        source += f", every compute time × {scale:.1f} so that one expert's load = {args.load_ratio:g} × T_exp"
    budget = args.experts * shape.expert_bytes  # staging pool included, as every policy's budget
    sequences, routing_name = mixtral_routing(args.trace, shape, console)
    results = predict_policies(shape, budget, timings, link.bandwidth, link.latency or 0.0, sequences=sequences,
                               policies=POLICIES + ["ondemand"],
                               progress=lambda name: console.print(f"simulating {name} …", highlight=False))
    table = Table(title=f"simulated TPOT, Mixtral-8x7B (bf16 experts {shape.expert_bytes / 2**20:.0f} MiB), "
                        f"{profile.device.device.name}, link {link.bandwidth / 1e9:.1f} GB/s ({link.kind}), "
                        f"budget {args.experts} experts, {sum(map(len, sequences))} tokens of {routing_name}, predictor eam")
    for col in ("policy", "simulated ms", "hit", "exposed ms", "MiB/token", "paper system", "paper ms"):
        table.add_column(col, justify="left" if col in ("policy", "paper system") else "right")
    for name, r in results.items():
        paper = PAPER.get(name, ("", None))
        table.add_row(name, f"{r.tpot_s * 1e3:.1f}", f"{r.hit_rate:.2f}", f"{r.exposed_s_per_token * 1e3:.1f}",
                      f"{r.bytes_per_token / 2**20:.0f}", paper[0], "" if paper[1] is None else str(paper[1]))
    console.print(table)
    console.print(f"compute: {source}: T_att {timings.t_att * 1e3:.3f} ms, T_exp {timings.t_exp * 1e3:.3f} ms, "
                  f"T_head {timings.t_head * 1e3:.3f} ms; one expert load {timings.t_load * 1e3:.2f} ms; "
                  f"moepic plan: {results['moepic'].plan}", highlight=False)


# --- paper: MoEpic's own settings (issue 23 §4) -------------------------------------------------------------------
QWEN_CONFIG = {  # Qwen/Qwen1.5-MoE-A2.7B config.json (the figures that matter here)
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
    "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60,
    "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1, "vocab_size": 151936,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu",
    "initializer_range": 0.02, "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 21,
    "router_aux_loss_coef": 0.001, "output_router_logits": False, "use_cache": True, "attention_dropout": 0.0,
}
GPU_RICH_TPOT_S = 0.057  # MoEpic: Qwen1.5-MoE-A2.7B with the whole model on the A6000 (26.67 GB)
# MoEpic's Fig. 7: TTFT (s) of Qwen1.5-MoE at 480 experts, in the order the systems are listed (issue 23): MoEpic,
# Mixtral-offloading, AdapMoE, MoE-Infinity, Pre-gated MoE; keyed by the fmoe policy standing in for each.
PAPER_QWEN_TTFT_480 = {"moepic": ("MoEpic", 1.43), "lru": ("Mixtral-offloading", 2.58), "lfu": ("MoE-Infinity", 1.78),
                       "prefetch-only": ("Pre-gated MoE", 1.73)}
PAPER_NOT_RUN = "AdapMoE (144 ms; TTFT 1.77 s at 480) has no fmoe counterpart"
PAPER_POLICIES = ["moepic", "lru", "lfu", "prefetch-only", "uniform", "cache-only", "resident"]


def facts_of(config: dict, **formats):
    """model_facts of a model known by its config.json alone, written to a directory removed once read."""
    from fmoe_cli.planning.report import model_facts

    with tempfile.TemporaryDirectory(prefix="fmoe-config-") as directory:
        (Path(directory) / "config.json").write_text(json.dumps(config, indent=2))
        return model_facts(directory, "bfloat16", **formats)


def scaled(timings, factor: float):
    """Every compute time × `factor` (T_att, T_moe, T_head); the link's untouched, and so is the admission copy a_e:
    a device-to-device copy of a loaded top runs at the card's memory bandwidth, which the factor (the paper's
    implementation against the roofline) does not slow. (Scaled too until 28 Nov: 1.6 ms a copy, 83 GB/s on a
    768 GB/s card, 28 of lru's 125.5 ms a token, and moepic ÷ lru read 0.57 instead of 0.80: replay_routing.py --gap.)"""
    from dataclasses import replace

    return replace(timings, t_att=timings.t_att * factor, t_moe=timings.t_moe * factor,
                   t_head=timings.t_head * factor)


def resident_tpot(shape, timings) -> float:
    """What the simulator's `resident` gives: L · (T_att + T_moe) + T_head (no loads)."""
    return shape.num_layers * (timings.t_att + timings.t_moe) + timings.t_head


def routing_shape(sequences, num_experts: int) -> dict:
    """Per layer: the top expert's share of the activations, and |A_t ∩ A_t−1| / K; means over layers."""
    layers = len(sequences[0][0].experts)
    k = len(sequences[0][0].experts[0])
    shares, overlaps = [], []
    for i in range(layers):
        counts: dict[int, int] = {}
        same, pairs = 0, 0
        for seq in sequences:
            for n, token in enumerate(seq):
                for e in token.experts[i]:
                    counts[e] = counts.get(e, 0) + 1
                if n:
                    same += len(set(token.experts[i]) & set(seq[n - 1].experts[i]))
                    pairs += 1
        shares.append(max(counts.values()) / sum(counts.values()))
        overlaps.append(same / (pairs * k))
    return {"top_share": statistics.fmean(shares), "overlap": statistics.fmean(overlaps), "experts": num_experts,
            "top_k": k}


def synthetic_routing(num_layers: int, num_experts: int, top_k: int, sequences: int, tokens: int, *,
                      zipf: float, stick: float, seed: int = 0):
    """Routing with a real trace's shape: per layer a Zipf popularity over the experts (rank r weighs (r+1)^−zipf, in
    a random order per layer), and each of the previous token's experts kept with probability `stick`; the rest
    drawn by popularity without replacement."""
    from fmoe_cli.planning.simulate import Token

    g = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, num_experts + 1, dtype=torch.float64).pow(-zipf)
    popularity = [weights[torch.randperm(num_experts, generator=g)] for _ in range(num_layers)]
    out = []
    for _ in range(sequences):
        previous = None
        seq = []
        for _ in range(tokens):
            layers = []
            for i in range(num_layers):
                keep = [] if previous is None else [e for e in previous[i]
                                                    if torch.rand((), generator=g).item() < stick]
                p = popularity[i].clone()
                p[keep] = 0
                rest = torch.multinomial(p, top_k - len(keep), replacement=False, generator=g).tolist() \
                    if len(keep) < top_k else []
                layers.append(tuple(keep + rest))
            previous = layers
            seq.append(Token(tuple(layers)))
        out.append(seq)
    return out


def fit_synthetic(target: dict, num_experts: int, top_k: int) -> tuple[float, float]:
    """(zipf, stick) so that the synthetic routing's top-expert share and consecutive overlap, each relative to
    independent uniform routing (1/N and K/N), are the real trace's."""
    want_share = target["top_share"] * target["experts"]  # the top expert's share of the activations ÷ uniform's 1/N

    def measure(zipf: float, stick: float) -> dict:
        seqs = synthetic_routing(1, num_experts, top_k, 1, 3000, zipf=zipf, stick=stick, seed=1)
        counts = torch.zeros(num_experts)
        same = 0
        for n, token in enumerate(seqs[0]):
            counts[list(token.experts[0])] += 1
            if n:
                same += len(set(token.experts[0]) & set(seqs[0][n - 1].experts[0]))
        return {"share": (counts.max() / counts.sum()).item() * num_experts,
                "overlap": same / ((len(seqs[0]) - 1) * top_k)}

    lo, hi = 0.0, 3.0  # share grows with zipf
    for _ in range(12):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if measure(mid, 0.0)["share"] < want_share else (lo, mid)
    zipf = (lo + hi) / 2
    # the popularity alone raises the overlap above K/N: take the stickiness that gives the wanted excess on top
    base = measure(zipf, 0.0)["overlap"]
    stick = max(0.0, (target["overlap"] - base) / (1 - base))
    return zipf, stick


def prefill_estimate(sim, prompt, timings, bandwidth: float, latency: float) -> float:
    """TTFT estimate (s), analytic, from the simulator's cache state before the prompt: per MoE layer the prompt's
    activated experts A_i; what is not on the device (a whole expert, or the bottom I − k_i of a cached top) crosses
    the link while the layer computes, the compute counted as decode's with each activated expert once:

        TTFT ≈ Σ_i max(T_att + |A_i|·T_exp,  latency + bytes_i / bandwidth) + T_head"""
    shape = sim.shape
    total = timings.t_head
    for i, state in enumerate(sim.layers):
        active = {e for token in prompt for e in token.experts[i]}
        cached = set(state.cache.cached())
        k = shape.intermediate if sim.resident else state.top_neurons
        missing = sum(shape.intermediate - (k if e in cached else 0) for e in active)
        link = 0.0 if missing == 0 else latency + missing * shape.neuron_bytes / bandwidth
        total += max(timings.t_att + len(active) * timings.t_exp, link)
    return total


def paper_run(shape, budget_bytes: int, timings, bandwidth: float, latency: float, sequences, prompt_tokens: int,
              policies) -> dict:
    """Per policy: the simulated TPOT over every sequence's decode tokens (prefill = the first `prompt_tokens`), and
    the TTFT estimate of each sequence after the first (a warm cache), median; hit rate and plan."""
    from fmoe_cli.planning.presets import PlanInputs, settings_for
    from fmoe_cli.planning.simulate import RoutingPredictor, simulate_policy, stats_from

    has_rankings = any(t.predicted is not None for seq in sequences for t in seq)

    def predictor():
        return None if has_rankings else RoutingPredictor(shape.num_layers, shape.num_experts, shape.top_k)

    stats = stats_from(sequences, shape, predictor())
    out = {}
    for name in policies:
        settings = settings_for(name, PlanInputs(shape, budget_bytes, timings, stats))
        ttfts = []

        def ttft(sim, prompt, n):  # with the cache the previous sequence left (the first starts cold: not counted)
            if n:
                ttfts.append(prefill_estimate(sim, prompt, timings, bandwidth, latency))

        result = simulate_policy(shape, settings, timings, sequences, bandwidth=bandwidth, latency=latency,
                                 prompt_tokens=prompt_tokens, predictor_factory=predictor, before_prefill=ttft)
        out[name] = {"tpot_ms": result.tpot_s * 1e3, "ttft_ms": statistics.median(ttfts) * 1e3,
                     "hit_rate": result.hit_rate, "plan": result.plan}
    return out


@dataclass(frozen=True)
class PaperSetting:
    """MoEpic's hardware as `paper` models it: Qwen1.5-MoE bf16 and Mixtral-8x7B int2/int4 (ModelFacts) with their
    timings on the card, compute = the roofline × `factor`."""

    qwen: object
    qwen_times: object
    mixtral: object
    mixtral_times: object
    factor: float
    source: str


def paper_setting(profile) -> PaperSetting:
    """Compute, calibrated once: the roofline (every weight read once per token at the profile's memory bandwidth)
    of Qwen1.5-MoE bf16 with every expert on the device, scaled to the paper's GPU-rich 57 ms; Mixtral's roofline
    scaled by the same factor."""
    from fmoe_cli.planning.report import plan_timings

    link = profile.device.link
    bandwidth, latency = link.bandwidth, link.latency or 0.0
    qwen = facts_of(QWEN_CONFIG)
    qwen_roofline, source = plan_timings(qwen, bandwidth, latency, profile)
    factor = GPU_RICH_TPOT_S / resident_tpot(qwen.shape, qwen_roofline)
    mixtral = facts_of(MIXTRAL_CONFIG, experts="int2", dense="int4")
    mixtral_roofline, _ = plan_timings(mixtral, bandwidth, latency, profile)
    return PaperSetting(qwen, scaled(qwen_roofline, factor), mixtral, scaled(mixtral_roofline, factor), factor, source)


def paper(args, console: Console) -> None:
    from fmoe_cli.profiling.files import Profile

    profile = Profile.load(Path(args.profile))
    link = profile.device.link
    bandwidth, latency = link.bandwidth, link.latency or 0.0
    setting = paper_setting(profile)
    qwen, qwen_times, mixtral, mixtral_times = setting.qwen, setting.qwen_times, setting.mixtral, setting.mixtral_times
    factor, source = setting.factor, setting.source
    # 2. Routing: the real Mixtral trace; for Qwen1.5-MoE (no trace of it here) routing of the Mixtral trace's shape.
    traced, routing_name = mixtral_routing(args.trace, mixtral.shape, console)
    routing = [seq[:args.limit] for seq in traced] if args.limit else traced
    real = routing_shape(traced, mixtral.shape.num_experts)
    zipf, stick = fit_synthetic(real, qwen.shape.num_experts, qwen.shape.top_k)
    qwen_routing = synthetic_routing(qwen.shape.num_layers, qwen.shape.num_experts, qwen.shape.top_k, args.sequences,
                                     args.tokens, zipf=zipf, stick=stick, seed=args.seed)
    runs = {"mixtral-int2": (mixtral, mixtral_times, routing, args.mixtral_budgets),
            "qwen1.5-moe-bf16": (qwen, qwen_times, qwen_routing, args.qwen_budgets)}
    result: dict = {}
    for key, (facts, times, routing, budgets) in runs.items():
        shape = facts.shape
        result[key] = {}
        for experts in budgets:
            budget = (experts + shape.top_k) * shape.expert_bytes  # V_e experts and a buffer of K
            console.print(f"simulating {key} at {experts} experts …", highlight=False)
            result[key][str(experts)] = paper_run(shape, budget, times, bandwidth, latency, routing, args.prompt,
                                                  PAPER_POLICIES)
    if args.json:
        print(json.dumps({k: {b: {p: {"tpot_ms": r["tpot_ms"], "ttft_ms": r["ttft_ms"]} for p, r in runs_.items()}
                              for b, runs_ in v.items()} for k, v in result.items()}))
        return
    for key, (facts, times, routing, budgets) in runs.items():
        shape = facts.shape
        paper_cols = ("paper system", "paper TPOT ms at 160") if key == "mixtral-int2" else \
            ("paper system", "paper TTFT s at 480")
        table = Table(title=f"{key}: simulated TPOT, estimated TTFT (prompt {args.prompt} tokens); one expert "
                            f"{shape.expert_bytes / 2**20:.1f} MiB ({shape.experts}), dense {facts.dense}; budget = "
                            f"(V_e + K) experts")
        for col in ("policy", *[f"V_e={b}: TPOT ms" for b in budgets], *[f"{b}: TTFT ms" for b in budgets],
                    *[f"{b}: hit" for b in budgets], *paper_cols):
            table.add_column(col, justify="left" if col in ("policy", "paper system") else "right")
        for name in PAPER_POLICIES:
            rows = [result[key][str(b)][name] for b in budgets]
            if key == "mixtral-int2":
                system, figure = PAPER.get(name, ("", None))
            else:
                system, figure = PAPER_QWEN_TTFT_480.get(name, ("", None))
            table.add_row(name, *[f"{r['tpot_ms']:.1f}" for r in rows], *[f"{r['ttft_ms']:.0f}" for r in rows],
                          *[f"{r['hit_rate']:.2f}" for r in rows], system, "" if figure is None else f"{figure:g}")
        console.print(table)
        top = result[key][str(budgets[-1])]
        console.print(f"  at {budgets[-1]}: moepic ÷ lru {top['moepic']['tpot_ms'] / top['lru']['tpot_ms']:.2f}; "
                      f"moepic plan: {top['moepic']['plan']}", highlight=False)
        console.print(f"  compute: T_att {times.t_att * 1e3:.3f} ms, T_exp {times.t_exp * 1e3:.3f} ms, T_head "
                      f"{times.t_head * 1e3:.3f} ms, a_e {times.t_admit * 1e3:.3f} ms; one expert's load "
                      f"{(latency + shape.expert_bytes / bandwidth) * 1e3:.2f} ms "
                      f"(= {(latency + shape.expert_bytes / bandwidth) / times.t_exp:.1f} × T_exp)", highlight=False)
    console.print(f"paper (MoEpic Fig. 7, Mixtral-8x7B int2/int4 at 160 experts): MoEpic 85, Mixtral-offloading 162, "
                  f"MoE-Infinity 136, Pre-gated 248 ms (85 ÷ 162 = 0.52); Qwen1.5-MoE: GPU-rich 57 ms, MoEpic 60 ms in "
                  f"12.38 GB; {PAPER_NOT_RUN}", highlight=False)
    console.print(f"inputs: {profile.device.device.name}, link {bandwidth / 1e9:.1f} GB/s ({link.kind}), latency "
                  f"{latency * 1e6:.0f} µs; compute: {source}, × {factor:.2f} so that Qwen1.5-MoE bf16 resident = the "
                  f"paper's GPU-rich {GPU_RICH_TPOT_S * 1e3:.0f} ms (calibrated once, the same factor for Mixtral)",
                  highlight=False)
    console.print(f"routing: Mixtral: {routing_name} ({sum(map(len, routing))} tokens, {len(routing)} sequences; "
                  f"predictor eam, no rankings in a vLLM trace); Qwen1.5-MoE: synthetic (no trace of it exists here), "
                  f"{args.sequences} sequences × {args.tokens} tokens, seed {args.seed}, with the Mixtral trace's shape: "
                  f"top-expert share {real['top_share']:.3f} of the activations at N = {real['experts']} (× uniform "
                  f"{real['top_share'] * real['experts']:.2f}), consecutive overlap {real['overlap']:.3f} "
                  f"→ Zipf exponent {zipf:.2f}, stickiness {stick:.3f}", highlight=False)
    console.print(f"TTFT: analytic estimate (not simulated): the first {args.prompt} tokens of each sequence after the "
                  f"first are its prompt, with the cache the previous sequence left: Σ_i max(T_att + |A_i|·T_exp, "
                  f"latency + missing bytes_i / bandwidth) + T_head", highlight=False)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    v = sub.add_parser("validate")
    v.add_argument("--model", default="demo")
    v.add_argument("--tokens", type=int, default=32)
    v.add_argument("--warmup", type=int, default=4)
    v.add_argument("--rounds", type=int, default=3)
    v.add_argument("--budget", default="25%")
    v.add_argument("--load-ratio", type=float, default=3.0)
    v.add_argument("--gbps", type=float, default=None, help="the emulated link's GB/s instead of --load-ratio")
    v.add_argument("--json", action="store_true")
    v.add_argument("--matrix", action="store_true", help="also the requirement matrix, simulated over the moepic run")
    v.add_argument("--experts", default="bf16", help="the experts' format (--experts of fmoe bench)")
    v.add_argument("--dense", default="bf16", help="the attention's format (--dense of fmoe bench)")
    v.add_argument("--policies", default=",".join(POLICIES + ["ondemand"]),
                   help="comma-separated; resident, ondemand and prefetch-only are the fits' anchors (needed)")
    m = sub.add_parser("mixtral")
    m.add_argument("--trace", default=None, help=f"the Mixtral trace (default: ${mixtral_trace.ENV})")
    m.add_argument("--profile", default=str(HERE.parent / "profiles" / "rtx-a6000.json"))
    m.add_argument("--experts", type=int, default=160)
    m.add_argument("--load-ratio", type=float, default=None,
                   help="scale compute so that one expert's load takes this many times its compute (default: roofline)")
    q = sub.add_parser("paper", help="MoEpic's own settings: Mixtral int2/int4 at 96 and 160 experts, "
                                     "Qwen1.5-MoE bf16 at 240 and 480")
    q.add_argument("--trace", default=None, help=f"the Mixtral trace (default: ${mixtral_trace.ENV})")
    q.add_argument("--profile", default=str(HERE.parent / "profiles" / "rtx-a6000.json"))
    q.add_argument("--mixtral-budgets", type=int, nargs="+", default=[96, 160])
    q.add_argument("--qwen-budgets", type=int, nargs="+", default=[240, 480])
    q.add_argument("--prompt", type=int, default=32, help="tokens of each sequence taken as its prompt")
    q.add_argument("--sequences", type=int, default=4, help="synthetic Qwen1.5-MoE sequences")
    q.add_argument("--tokens", type=int, default=160, help="tokens per synthetic sequence")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--limit", type=int, default=0, help="at most this many tokens of each Mixtral sequence (0: all)")
    q.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.what == "validate":
        args.policies = [x.strip() for x in args.policies.split(",")]
    console = Console(width=150, stderr=getattr(args, "json", False))  # --json: stdout is the JSON alone
    console.print("command: python benchmarks/simulate.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  highlight=False)
    {"validate": validate, "mixtral": mixtral, "paper": paper}[args.what](args, console)


if __name__ == "__main__":
    main()
