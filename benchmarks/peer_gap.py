#!/usr/bin/env python3
"""The gap to llama.cpp, part by part (issue 21, "Done when": where a target is not met, the remaining gap
explained kernel by kernel with a measured CPU profile).

For each model and format of a peer run (`benchmarks/peer_llamacpp.py`, its results directory), one
`benchmarks/decode_profile.py` run of the same fmoe command the peer script times (`fmoe bench --policy resident`'s
options: f32 = `--dtype float32 --experts bf16`, bf16 = `--dtype bfloat16 --experts bf16`, q8 = `--experts int8`,
q4 = `--experts int4`), each in its own process, under torch.profiler (`--ops`). Printed per cell: llama.cpp's
decode TPOT from the peer run, fmoe's from the profile, and fmoe's token split into its parts, each with the weight
bytes it reads, the time those bytes take at llama.cpp's own pace in the same cell (its token's bytes ÷ its TPOT:
what llama.cpp reads a second, its own host work included), and the time above that pace (the part's share of the
gap):

    attention rows   the attention's projections in the kernels (q/k/v fused, o)
    attention glue   the rest of the attention: norms, RoPE, the KV cache, SDPA, the ops around the rows
    experts          the expert kernels (one call a layer)
    moe glue         the MoE block outside the kernels: the router, the engine, the combine
    lm head          the head's rows
    other            embedding, the layers' norms and residual adds, sampling, the generate loop

The header gives the bandwidth floor too (the peer run's copy figure, which no read loop reaches on the 2-core VM:
docs/bench.md § CPU expert kernels, "bf16 rows"). Each cell's raw report (with torch.profiler's top ops) goes to `--raw DIR`.
The q8 and q4 cells run as `fmoe bench` does by default there: `--activations int8`, fmoe's tolerance mode (the tokens
quantised to 8 bits a block of 32 for the integer dots, as llama.cpp's Q8_0 × Q4_0 / Q8_0 dots do; not transformers'
answer: docs/quantization.md); `--activations float` the exact mode.

    python benchmarks/peer_gap.py ~/.cache/fmoe-peer/results/run-YYYYMMDD-HHMMSS --models a3b big --raw /tmp/gap
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

FMOE_ARGS = {"f32": ["--dtype", "float32", "--experts", "bf16"], "bf16": ["--dtype", "bfloat16", "--experts", "bf16"],
             "q8": ["--dtype", "float32", "--experts", "int8"], "q4": ["--dtype", "float32", "--experts", "int4"]}
PROFILE = Path(__file__).with_name("decode_profile.py")


def profile(model_dir: Path, fmt: str, args) -> dict:
    """decode_profile's JSON report of one cell (median TPOT over `args.rounds` processes; the parts of the run
    whose TPOT is the median)."""
    reports = []
    for _ in range(args.rounds):
        cmd = [sys.executable, str(PROFILE), str(model_dir), *FMOE_ARGS[fmt], "--tokens", str(args.tokens),
               "--ops", str(args.ops), "--json"]
        if fmt in ("q8", "q4"):
            cmd += ["--activations", args.activations]
        if args.prompt_file:
            cmd += ["--prompt-file", args.prompt_file]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        if out.returncode != 0:
            raise SystemExit(f"error: {' '.join(cmd)} failed: {out.stderr.strip().splitlines()[-1:]}")
        reports.append(json.loads(out.stdout.strip().splitlines()[-1]))
    reports.sort(key=lambda r: r["tpot_ms"]["median"])
    report = reports[len(reports) // 2]
    report["tpot_rounds_ms"] = [r["tpot_ms"]["median"] for r in reports]
    return report


def parts(report: dict) -> dict[str, tuple[float, int | None]]:
    """part -> (ms a token, weight bytes it reads)."""
    ms, read = report["per_token_ms"], report["bytes_per_token"]
    rows = ms.get("attention rows", 0.0)
    return {"attention rows": (rows, read["attention"]), "attention glue": (ms["attention"] - rows, None),
            "experts": (ms["experts"], read["experts"]), "moe glue": (ms["moe"] - ms["experts"], None),
            "lm head": (ms["lm head"], read["lm head"]), "other": (ms["other"], None)}


def render(cell: str, peer: dict, report: dict, gbps: float) -> str:
    llama_ms, llama_floor = peer["llama_tpot"], peer["llama_floor"]
    fmoe_ms = report["tpot_ms"]["median"]
    split = parts(report)
    total = sum(ms for ms, _ in split.values())
    pace = peer["llama_bytes"] / llama_ms / 1e6  # GB/s: llama.cpp's token bytes over its TPOT
    lines = [f"### {cell}: llama.cpp {llama_ms:.1f} ms ({peer['llama_bytes'] / 1e6:.0f} MB: {pace:.1f} GB/s; floor at "
             f"{gbps:.1f} GB/s {llama_floor:.1f} ms); fmoe {fmoe_ms:.1f} ms (rounds "
             f"{', '.join(f'{t:.1f}' for t in report['tpot_rounds_ms'])}), ÷ llama.cpp {fmoe_ms / llama_ms:.2f}",
             "", "| part | ms | share | MB | GB/s | at llama.cpp's pace, ms | above it, ms |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    above_total = 0.0
    for name, (ms, nbytes) in split.items():
        at_pace = nbytes / (pace * 1e9) * 1e3 if nbytes else 0.0
        above_total += ms - at_pace
        rate = f"{nbytes / ms / 1e6:.1f}" if nbytes and ms > 0 else ""
        lines.append(f"| {name} | {ms:.2f} | {ms / total:.0%} | {'' if not nbytes else f'{nbytes / 1e6:.1f}'} | {rate} "
                     f"| {at_pace:.2f} | {ms - at_pace:.2f} |")
    lines.append(f"| **sum** (parts' means; TPOT is the steps' median) | {total:.2f} | | | | | **{above_total:.2f}** |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a peer run's results directory (with summary.json)")
    parser.add_argument("--models", nargs="+", default=["a3b", "big"])
    parser.add_argument("--formats", nargs="+", default=list(FMOE_ARGS), choices=list(FMOE_ARGS))
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1, help="processes per cell (the median's parts are shown)")
    parser.add_argument("--ops", type=int, default=0,
                        help="torch.profiler's top N ops in each raw report (its few µs an op inflate the glue parts)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--activations", default="int8", choices=["float", "int8"],
                        help="fmoe's --activations for the q8 and q4 cells (int8, fmoe's default there on the CPU: "
                             "the tolerance mode; float: the exact one)")
    parser.add_argument("--models-dir", type=Path, default=None, help="default: RESULTS/../../models")
    parser.add_argument("--prompt-file", default=None, help="default: RESULTS/../../prompt64.txt")
    parser.add_argument("--raw", type=Path, default=None, help="keep each cell's decode_profile report here")
    args = parser.parse_args()
    summary_path = args.results / "summary.json"
    if not summary_path.is_file() or summary_path.stat().st_size > 16 << 20:
        raise SystemExit(f"error: {summary_path}: not a peer run's summary")
    summary = json.loads(summary_path.read_text())
    gbps = summary["bandwidth_GBps"]
    models_dir = args.models_dir or args.results.parent.parent / "models"
    args.prompt_file = args.prompt_file or str(args.results.parent.parent / "prompt64.txt")
    peers = {(r["model"], r["fmt"]): r for r in summary["rows"] if r.get("llama_tpot")}
    if args.raw:
        args.raw.mkdir(parents=True, exist_ok=True)
    print(f"peer run {args.results.name}: copy bandwidth {gbps:.1f} GB/s, {summary['threads']} threads; "
          f"fmoe's parts from decode_profile.py ({args.tokens} decode tokens, {args.rounds} process(es) a cell)\n")
    for model in args.models:
        for fmt in args.formats:
            peer = peers.get((model, fmt))
            if peer is None:
                continue
            report = profile(models_dir / model, fmt, args)
            mode = f" --activations {args.activations}" if fmt in ("q8", "q4") else ""
            if args.raw:
                (args.raw / f"{model}-{fmt}{mode.replace(' --activations ', '-act')}.json").write_text(json.dumps(report))
            print(render(f"{model} {fmt}{mode}", peer, report, gbps) + "\n", flush=True)


if __name__ == "__main__":
    sys.exit(main())
