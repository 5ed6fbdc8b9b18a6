#!/usr/bin/env python3
"""Loading and expert-format benchmark (issue 11), on a ~2 GB random Mixtral built once under --dir.

1. Loading, each in a fresh process, rounds interleaved: bf16 (unquantised), int8 and int4
   first loads (quantising while reading; the converted store is written after) and int8 /
   int4 loads from the converted store (memory-mapped). Per load: wall time, peak RSS
   growth ÷ (expert store + non-expert weights) — the issue's bound is 1.15 — and RSS right
   after the load.
2. Decoding on the emulated link (CudaLink's host semantics, moves no bytes on the CPU) at an
   equal expert budget in bytes (--budget of the bf16 experts) for every format: TPOT and its
   ratio to bf16 per round, hit rate, link bytes per token (= bytes read from the host store
   per token: every load is a copy out of the store), and the host store's size. The link's
   bandwidth is fixed for all formats: one bf16 expert takes --load-ratio × T_exp(bf16).

Medians and [min–max] over interleaved rounds. The machine may be shared: say so with the figures.

    python benchmarks/loading.py                    # builds /tmp/fmoe-bench-loading once (~2 GB)
    python benchmarks/loading.py --rounds 3 --tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FORMATS = ["bf16", "int8", "int4"]
PROMPT = "Explain how a mixture of experts decides which experts to use for each token."

CHILD = """
import json, sys, time, torch, transformers
from rich.console import Console
from fmoe_cli.models.load import build_skeleton, load_model
from fmoe_cli.profiling.memory import peak_rss, reset_peak_rss, rss
torch.set_num_threads(1)
path, experts = sys.argv[1], sys.argv[2]
# imports (modeling code, tokenizer) first: their memory and time are not the load's
build_skeleton(transformers.AutoConfig.from_pretrained(path), torch.bfloat16, "warm-up")
transformers.AutoTokenizer.from_pretrained(path)
base = reset_peak_rss()
start = time.perf_counter()
lm = load_model(path, device="cpu", dtype="bfloat16", experts=experts, console=Console(file=open("/dev/null", "w")))
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "peak": peak_rss() - base, "after": rss() - base,
                  "store": lm.store.nbytes, "non_expert": lm.non_expert_bytes}))
"""


def checkpoint(path: Path) -> Path:
    """~2 GB in float32 on disk: 5 MoE layers × 32 experts of 3 × 1024 × 1024."""
    if not (path / "config.json").exists():
        from fmoe_cli.models.demo import build_random_moe

        build_random_moe(path, "mixtral", seed=0, hidden_size=1024, intermediate_size=1024, num_hidden_layers=5,
                         num_local_experts=32, num_experts_per_tok=2, num_attention_heads=8, num_key_value_heads=2)
    return path


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}–{fmt.format(max(values))}]"


def load_once(path: Path, experts: str, cache: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(cache), TOKENIZERS_PARALLELISM="false")
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), experts], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def loading_table(path: Path, rounds: int, cache: Path, console):
    from rich.table import Table

    cases = [("bf16", "first"), ("int8", "first"), ("int8", "converted"), ("int4", "first"), ("int4", "converted")]
    runs: dict[tuple, list[dict]] = {c: [] for c in cases}
    try:
        for r in range(rounds):
            for experts, kind in cases:
                if kind == "first":
                    shutil.rmtree(cache / "fmoe" / "converted", ignore_errors=True)
                with console.status(f"round {r + 1}/{rounds}: {experts} {kind} load …"):
                    runs[(experts, kind)].append(load_once(path, experts, cache))
    finally:
        shutil.rmtree(cache / "fmoe" / "converted", ignore_errors=True)
    table = Table(title=f"1. loading {path} (a fresh process each; median \\[min–max] of {rounds} interleaved rounds)")
    for col in ("experts", "load", "seconds", "peak RSS ÷ (store + rest)", "RSS after ÷ (store + rest)", "store GiB",
                "rest MiB"):
        table.add_column(col, justify="right" if col not in ("experts", "load") else "left")
    for (experts, kind), rs in runs.items():
        need = [x["store"] + x["non_expert"] for x in rs]
        table.add_row(experts, kind, spread([x["seconds"] for x in rs]),
                      spread([x["peak"] / n for x, n in zip(rs, need)], "{:.3f}"),
                      spread([x["after"] / n for x, n in zip(rs, need)], "{:.3f}"),
                      f"{rs[0]['store'] / 2**30:.3f}", f"{rs[0]['non_expert'] / 2**20:.1f}")
    return table


def decoding_table(path: Path, rounds: int, tokens: int, warmup: int, budget_share: float, load_ratio: float,
                   policies: list[str], console):
    import torch
    from rich.table import Table

    from fmoe_cli.bench.run import bench_policy, encode_prompt
    from fmoe_cli.models.load import load_model
    from fmoe_cli.offload.engine import Engine
    from fmoe_cli.offload.link import EmulatedLink
    from fmoe_cli.planning.presets import make_settings

    models = {f: load_model(str(path), device="cpu", dtype="bfloat16", experts=f, console=console) for f in FORMATS}
    bf16 = models["bf16"]
    budget = int(bf16.shape.all_experts_bytes * budget_share)  # equal bytes for every format
    prompt_ids = encode_prompt(bf16, PROMPT)
    # T_exp: one bf16 expert for one token; the link moves a bf16 expert in load_ratio × T_exp
    packed = bf16.store.expert(0, 0)
    x = torch.randn(1, bf16.shape.hidden, dtype=torch.bfloat16)
    for _ in range(5):
        bf16.store.segment_forward(x, packed, torch.nn.functional.silu)
    start = time.perf_counter()
    for _ in range(50):
        bf16.store.segment_forward(x, packed, torch.nn.functional.silu)
    t_exp = (time.perf_counter() - start) / 50
    gbps = bf16.shape.expert_bytes / (load_ratio * t_exp) / 1e9
    engines = {}
    for f, lm in models.items():
        engines[f] = Engine(lm.layers, lm.store, lm.shape, EmulatedLink(gbps), lm.device, lm.dtype)
        engines[f].install(lm.model)
    runs = {(f, p): [] for p in policies for f in FORMATS}
    for r in range(rounds):
        for p in policies:
            for f in FORMATS:
                lm = models[f]
                with console.status(f"round {r + 1}/{rounds}: {p}, {f} experts …"):
                    settings = make_settings(p, lm.shape, budget)
                    runs[(f, p)].append(bench_policy(lm, engines[f], settings, prompt_ids, tokens, warmup))
    for e in engines.values():
        e.close()
    table = Table(title=f"2. decoding, emulated link {gbps:.2f} GB/s (a bf16 expert = {load_ratio:g} × T_exp = "
                        f"{load_ratio * t_exp * 1e3:.2f} ms), expert budget {budget / 2**20:.0f} MiB for every format; "
                        f"{tokens} tokens, median \\[min–max] of {rounds} interleaved rounds")
    for col in ("policy", "experts", "TPOT ms", "÷ bf16", "hit", "link MiB/tok", "host store GiB", "plan"):
        table.add_column(col, justify="left" if col in ("policy", "experts", "plan") else "right")
    for (f, p), rs in runs.items():
        base = runs[("bf16", p)]
        table.add_row(p, f, spread([x.tpot_ms["median"] for x in rs]),
                      spread([x.tpot_ms["median"] / b.tpot_ms["median"] for x, b in zip(rs, base)]),
                      f"{statistics.median(x.hit_rate for x in rs):.2f}",
                      spread([x.bytes_per_token / 2**20 for x in rs], "{:.1f}"),
                      f"{models[f].store.nbytes / 2**30:.3f}", rs[-1].plan)
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/fmoe-bench-loading", help="where the random checkpoint is built once")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--budget", type=float, default=0.25, help="expert budget: this share of the bf16 experts' bytes")
    p.add_argument("--load-ratio", type=float, default=18.0, help="bf16 expert load time ÷ its compute time")
    p.add_argument("--policies", default="lru,uniform")
    p.add_argument("--skip-loading", action="store_true")
    p.add_argument("--skip-decoding", action="store_true")
    args = p.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="fmoe-bench-loading-cache-"))  # converted stores: not the user's cache
    os.environ["XDG_CACHE_HOME"] = str(cache)
    import torch
    from rich.console import Console

    torch.set_num_threads(1)
    console = Console(width=160)
    console.print("command: python benchmarks/loading.py " + " ".join(sys.argv[1:]), highlight=False)
    path = checkpoint(Path(args.dir))
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    console.print(f"checkpoint {path}: {size / 2**30:.2f} GiB of safetensors (float32); loaded as bfloat16",
                  highlight=False)
    try:
        if not args.skip_loading:
            console.print(loading_table(path, args.rounds, cache, console))
        if not args.skip_decoding:
            console.print(decoding_table(path, args.rounds, args.tokens, args.warmup, args.budget, args.load_ratio,
                                         args.policies.split(","), console))
    finally:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
