#!/usr/bin/env python3
"""The hybrid table (issue 24): predicted TPOT of `hybrid` and `moepic` against `lru` and llama.cpp's pattern.

Simulator only (planning/simulate.py, a virtual clock): the emulated link cannot measure the
host lane honestly on this machine, where both lanes share two CPU cores. Every input is printed.

- Models: Mixtral-8x7B and Qwen3-30B-A3B, their config.json written here (no weights), experts bf16
  and int4 (offload/quant.py's format: ≈ 4.5 bits a weight).
- Cards: 8, 12 and 24 GiB; every card has the RTX 3060's compute (decode at its 360 GB/s memory
  bandwidth: a roofline, a lower bound of the compute time) and a PCIe 4.0 x16 link of 25 GB/s,
  10 µs (profiles/desktop-ddr5-rtx-3060-12gb.json). The expert budget is what `fmoe plan` leaves:
  card − non-expert weights − KV cache of --context tokens − 512 MiB workspace.
- Hosts: this machine's measured host profile (`fmoe profile`: --host-profile, default the saved
  one), and the documented estimate of a desktop with dual-channel DDR5 (the profile's `host`).
  The host lane's round trip per layer: 30 µs (an estimate, profiling/host.py: HOST_ROUND_TRIP_S).
- Routing: the real Mixtral-8x7B trace (not shipped: --trace or FMOE_MIXTRAL_TRACE, benchmarks/mixtral_trace.py;
  vLLM, no rankings: the routing-only `eam` predictor) and the demo-recorded trace (traces/demo.jsonl, with the
  prefetcher's rankings dropped: they rank the demo's experts). A trace of another shape is mapped
  (mixtral_trace.map_routing): layer j plays the trace's layer j mod L; with fewer experts, expert e is e mod N (the
  first K distinct kept); with more, each traced expert stands for a block of N/N' experts of which
  K/K' are activated, chosen afresh every token (a hash of token, layer and expert): the block's
  share keeps the trace's skew and locality, the choice inside it has neither (pessimistic for every
  cache; llama.cpp's pattern, which caches nothing, does not depend on it).
- Policies: hybrid, moepic, lru (each its own plan at the budget) and llama.cpp's pattern (every
  routed expert on the host, the rest on the device: configurator.host_baselines).

    python benchmarks/hybrid.py [--tokens 200] [--context 4096] [--host-profile PATH] [--trace MIXTRAL] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import mixtral_trace  # noqa: E402 (benchmarks/mixtral_trace.py)
from mixtral_trace import DEMO_TRACE, read_routing  # noqa: E402
from simulate import MIXTRAL_CONFIG  # noqa: E402 (benchmarks/simulate.py)

QWEN3_30B_A3B_CONFIG = {  # Qwen/Qwen3-30B-A3B config.json (the figures that matter here)
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
    "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02, "output_router_logits": False,
    "router_aux_loss_coef": 0.001, "use_cache": True, "use_sliding_window": False, "sliding_window": None,
    "max_window_layers": 48,
}
MODELS = {"Mixtral-8x7B": MIXTRAL_CONFIG, "Qwen3-30B-A3B": QWEN3_30B_A3B_CONFIG}
FORMATS = ("bf16", "int4")
CARDS_GIB = (8, 12, 24)
DESKTOP = REPO / "profiles" / "desktop-ddr5-rtx-3060-12gb.json"
WORKSPACE = 512 << 20
TARGET = 0.8  # hybrid ≤ 0.8 × llama.cpp's pattern at 8 and 12 GB


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=200, help="decode tokens of each trace simulated")
    p.add_argument("--context", type=int, default=4096, help="KV cache reserved on the card, tokens")
    p.add_argument("--host-profile", default=None, help="this machine's host profile (default: `fmoe profile`'s)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--measured-llama-only", action="store_true",
                   help="with this machine's host profile simulate llama.cpp's pattern only (hybrid, moepic, lru: the "
                        "estimate's rows); for time on a busy machine")
    p.add_argument("--trace", default=None, help=f"the Mixtral trace (default: ${mixtral_trace.ENV})")
    p.add_argument("--json", default=None, help="also write every row to this file")
    args = p.parse_args()
    console = Console(width=200)
    mixtral = mixtral_trace.find(args.trace)
    if mixtral is None:
        console.print(mixtral_trace.absent_line("the demo trace alone"), highlight=False, soft_wrap=True)

    from fmoe_cli.planning.configurator import LLAMA_CPP, host_baselines
    from fmoe_cli.planning.report import model_facts, plan_timings
    from fmoe_cli.planning.simulate import predict_policies, stats_from  # noqa: F401
    from fmoe_cli.profiling.files import Profile
    from fmoe_cli.profiling.host import HOST_ROUND_TRIP_S, host_line, host_timings, saved_host_profile

    desktop = Profile.load(DESKTOP)
    link = desktop.device.link
    here = Profile.load(Path(args.host_profile)).device.host if args.host_profile else saved_host_profile()
    hosts = {"desktop DDR5 (estimate)": desktop.device.host}
    if here is not None:
        hosts = {"this machine (measured)": here, **hosts}
    else:
        console.print("no host profile of this machine: run `fmoe profile` first (only the estimate is used)")
    for name, host in hosts.items():
        console.print(f"{name}: {host_line(host)}", highlight=False)
    console.print(f"card: {desktop.device.device.name}: compute from {desktop.device.memory_bandwidth / 1e9:.0f} GB/s "
                  f"device memory (roofline), link {link.bandwidth / 1e9:.0f} GB/s + {(link.latency or 0) * 1e6:.0f} µs; "
                  f"VRAM {', '.join(f'{c} GiB' for c in CARDS_GIB)}; host lane round trip {HOST_ROUND_TRIP_S * 1e6:.0f} µs "
                  f"per layer; KV cache {args.context} tokens; workspace {WORKSPACE >> 20} MiB", highlight=False)
    rows = []
    shared = {}  # (model, format, card, trace), policy -> a result that does not depend on the host
    directory = Path(tempfile.mkdtemp(prefix="fmoe-hybrid-"))
    for model in args.models.split(","):
        (directory / model).mkdir(exist_ok=True)
        (directory / model / "config.json").write_text(json.dumps(MODELS[model], indent=2))
        for fmt in args.formats.split(","):
            facts = model_facts(str(directory / model), "bfloat16", fmt)
            shape = facts.shape
            base, source = plan_timings(facts, link.bandwidth, link.latency or 0.0, desktop)
            traces = {"Mixtral trace": read_routing(mixtral, shape, args.tokens)} if mixtral else {}
            traces["demo trace"] = read_routing(DEMO_TRACE, shape, args.tokens)
            console.print(f"{model} {fmt}: {shape.num_layers} layers × {shape.num_experts} experts top-{shape.top_k}, "
                          f"expert {shape.expert_bytes / 2**20:.1f} MiB, non-expert {facts.non_expert_bytes / 2**30:.2f} GiB, "
                          f"T_att {base.t_att * 1e3:.3f} ms, T_exp {base.t_exp * 1e3:.3f} ms, T_head {base.t_head * 1e3:.3f} ms, "
                          f"T_load {base.t_load * 1e3:.2f} ms ({source})", highlight=False)
            for card in CARDS_GIB:
                budget = (card << 30) - facts.non_expert_bytes - facts.kv_bytes(args.context) - WORKSPACE
                if budget < shape.min_staging_slots * shape.expert_bytes:
                    rows.append({"model": model, "format": fmt, "card_gib": card, "note": "does not fit"})
                    continue
                for host_name, host in hosts.items():
                    timings = host_timings(base, host, shape)
                    if not timings.has_host:
                        console.print(f"  {host_name}: no host figures for {fmt} (profile every format: `fmoe profile`)")
                        continue
                    for trace_name, sequences in traces.items():
                        # lru does not depend on the host; moepic only where the host lane may win (presets.py)
                        key = (model, fmt, card, trace_name)
                        names = ["hybrid"] + [p for p in ("moepic", "lru") if (key, p) not in shared
                                              or (p == "moepic" and timings.t_host_expert < timings.t_load)]
                        if args.measured_llama_only and host.kind == "measured":
                            names = []
                        results = predict_policies(shape, budget, timings, link.bandwidth, link.latency or 0.0,
                                                   sequences=sequences, policies=names,
                                                   plans={LLAMA_CPP: host_baselines(shape, budget)[LLAMA_CPP]})
                        for p in ("moepic", "lru"):
                            if p in results and not (p == "moepic" and timings.t_host_expert < timings.t_load):
                                shared[(key, p)] = results[p]
                            if shared.get((key, p)) is not None:
                                results.setdefault(p, shared[(key, p)])
                        r = {name: res for name, res in results.items()}
                        llama = r[LLAMA_CPP].tpot_s
                        if not names:
                            rows.append({"model": model, "format": fmt, "card_gib": card, "host": host_name,
                                         "trace": trace_name, "llama_cpp_ms": llama * 1e3,
                                         "t_host_expert_s": timings.t_host_expert, "t_load_s": timings.t_load,
                                         "note": "llama.cpp pattern only"})
                            console.print(f"  {card} GiB, {host_name}, {trace_name}: llama.cpp pattern "
                                          f"{llama * 1e3:.1f} ms", highlight=False)
                            continue
                        row = {"model": model, "format": fmt, "card_gib": card, "host": host_name, "trace": trace_name,
                               "budget_bytes": budget, "t_host_expert_s": timings.t_host_expert,
                               "t_load_s": timings.t_load, "t_exp_s": timings.t_exp,
                               **{f"{k}_ms": v.tpot_s * 1e3 for k, v in (("hybrid", r["hybrid"]), ("moepic", r["moepic"]),
                                                                       ("lru", r["lru"]), ("llama_cpp", r[LLAMA_CPP]))},
                               "hybrid_hit": r["hybrid"].hit_rate, "hybrid_host_ms": r["hybrid"].host_s_per_token * 1e3,
                               "hybrid_exposed_ms": r["hybrid"].exposed_s_per_token * 1e3,
                               "hybrid_plan": r["hybrid"].plan, "moepic_plan": r["moepic"].plan,
                               "hybrid_vs_llama": r["hybrid"].tpot_s / llama, "hybrid_vs_lru": r["hybrid"].tpot_s / r["lru"].tpot_s,
                               "lru_hit": r["lru"].hit_rate}
                        rows.append(row)
                        console.print(f"  {card} GiB, {host_name}, {trace_name}: hybrid {row['hybrid_ms']:.1f} ms, "
                                      f"moepic {row['moepic_ms']:.1f}, lru {row['lru_ms']:.1f}, llama.cpp pattern "
                                      f"{row['llama_cpp_ms']:.1f} (hybrid ÷ llama.cpp {row['hybrid_vs_llama']:.2f}); "
                                      f"{row['hybrid_plan']}", highlight=False)
    table = Table(title="simulated decode TPOT, ms (planning/simulate.py; inputs above)")
    for col in ("model", "experts", "card", "host", "trace", "hybrid", "moepic", "lru", "llama.cpp pattern",
                "hybrid ÷ llama.cpp", "hybrid hit", "hybrid host ms"):
        table.add_column(col, justify="left" if col in ("model", "experts", "host", "trace") else "right")
    for row in rows:
        if "note" in row:
            table.add_row(row["model"], row["format"], f"{row['card_gib']} GiB", row.get("host", ""), row.get("trace", ""),
                          row["note"], "", "", f"{row['llama_cpp_ms']:.1f}" if "llama_cpp_ms" in row else "", "", "", "")
            continue
        mark = "" if row["card_gib"] == 24 or row["hybrid_vs_llama"] <= TARGET else " ✗"
        table.add_row(row["model"], row["format"], f"{row['card_gib']} GiB", row["host"], row["trace"],
                      f"{row['hybrid_ms']:.1f}", f"{row['moepic_ms']:.1f}", f"{row['lru_ms']:.1f}",
                      f"{row['llama_cpp_ms']:.1f}", f"{row['hybrid_vs_llama']:.2f}{mark}", f"{row['hybrid_hit']:.2f}",
                      f"{row['hybrid_host_ms']:.1f}")
    console.print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
