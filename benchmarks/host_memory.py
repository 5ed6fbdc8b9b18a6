#!/usr/bin/env python3
"""Host memory of a `fmoe` command (issue 39 §6): its peak anonymous RSS above an idle import, ÷ the model.

Anonymous RSS is the process's own memory, without mapped files (a converted store, the libraries). Linux keeps
no peak of it, so this polls /proc/<pid>/status every 0.2 ms: the peak of `fmoe <args>` less that of a process
that only imports what it imports (torch, transformers, fmoe_cli's run and bench modules), ÷ the experts and
non-expert weights (`fmoe bench --json`'s `weights`, in the run's formats). A fresh config directory each run
(the quick estimate runs, as on a first start) unless --keep-config. The checkpoint is built once under --dir:
6 layers of hidden 1024, 16 experts of intermediate 1024 (Mixtral): 614 MiB in bf16.

    python benchmarks/host_memory.py                                # fmoe bench (moepic, lru, resident)
    python benchmarks/host_memory.py --rounds 3 -- --policy resident --experts int4
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

from fmoe_cli.profiling.memory import anon_rss  # noqa: E402

IDLE = "import torch, transformers, fmoe_cli.cli, fmoe_cli.bench.run, fmoe_cli.run, time; time.sleep(2)"
MiB = 1 << 20


def checkpoint(path: Path) -> Path:
    if not (path / "config.json").exists():
        from fmoe_cli.models.demo import build_random_moe

        build_random_moe(path, "mixtral", seed=0, hidden_size=1024, intermediate_size=1024, num_hidden_layers=6,
                         num_local_experts=16, num_experts_per_tok=2, num_attention_heads=8, num_key_value_heads=2)
    return path


def peak_anon(argv: list[str], env: dict) -> tuple[int, str]:
    """The peak anonymous RSS of a child running `argv`, polled, and its stdout (a failure: its stderr, exit)."""
    child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    while child.poll() is None:
        try:
            peak = max(peak, anon_rss(child.pid))
        except (OSError, RuntimeError, ValueError):  # gone between poll and read
            pass
        time.sleep(0.0002)
    out, err = child.communicate()
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}: exit {child.returncode}\n{err[-2000:]}")
    return peak, out


def rounds(args, command: list[str], env: dict, scratch: Path, ratios: list[float]) -> None:
    for r in range(args.rounds):
        env["XDG_CONFIG_HOME"] = str(scratch / ("config" if args.keep_config else f"config{r}"))
        idle, _ = peak_anon([sys.executable, "-c", IDLE], env)
        peak, out = peak_anon(command, env)
        weights = json.loads(out)["weights"]
        model = weights["experts_bytes"] + weights["non_expert_bytes"]
        ratios.append((peak - idle) / model)
        print(f"round {r + 1}: idle import {idle / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB: {(peak - idle) / MiB:.0f} "
              f"MiB above it = {ratios[-1]:.3f} × the model ({model / MiB:.0f} MiB: experts "
              f"{weights['experts_bytes'] / MiB:.0f} + non-expert {weights['non_expert_bytes'] / MiB:.1f})", flush=True)



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/fmoe-bench-host-memory", help="where the checkpoint is built once")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--keep-config", action="store_true", help="one config directory for every round (the quick "
                                                              "estimate of the first round is read by the later)")
    p.add_argument("fmoe_args", nargs="*", help="after --: more `fmoe bench` options (default: none)")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    path = checkpoint(Path(args.dir))
    scratch = Path(tempfile.mkdtemp(prefix="fmoe-host-memory-"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(scratch / "cache"), TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, "-m", "fmoe_cli.cli", "bench", str(path), "--dtype", "bfloat16", "--json",
               *args.fmoe_args]
    print("command: python benchmarks/host_memory.py " + " ".join(sys.argv[1:]), flush=True)
    ratios = []
    try:
        rounds(args, command, env, scratch, ratios)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"peak anonymous RSS above an idle import ÷ the model: median {statistics.median(ratios):.3f} "
          f"[{min(ratios):.3f}–{max(ratios):.3f}] over {len(ratios)} round(s)")


if __name__ == "__main__":
    main()
