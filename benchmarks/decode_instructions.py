#!/usr/bin/env python3
"""Instructions a CPU decode token executes, host and kernels apart, counted by valgrind (issue 21: the host's work).

On a machine shared with other work a decode token's time moves by ±20 % from run to run, more than most changes to
the host's steps around the kernels. The instructions it executes do not move: this runs one `resident` generation of
MODEL under callgrind, counts only `--tokens` decode steps (instrumentation on around them, after the prefill and two
warm-up tokens) and splits the count by shared object — the expert kernels (experts-*.so) against the rest (the host:
Python, torch's dispatch and small ops, libc…). `--versions A B` counts two source trees (each as PYTHONPATH) one after
the other and checks that they generated the same tokens. Slow: valgrind runs the process about 50 times slower (the
demo model, 8 tokens: about 2 minutes, most of it importing torch); an instruction is not a nanosecond, so read it
beside timed A/B rounds (benchmarks/decode_profile.py), not instead of them.

    python benchmarks/decode_instructions.py demo --experts int4 --tokens 8
    python benchmarks/decode_instructions.py demo --versions /tmp/before /tmp/after
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()


def inside(args) -> None:
    """Under valgrind: load, prefill, warm up, then `args.tokens` decode steps with callgrind's instrumentation on."""
    import fmoe_cli  # noqa: F401  (before torch, as the CLI)
    from fmoe_cli.bench.run import encode_prompt
    from fmoe_cli.cli import run_options
    from fmoe_cli.generate import stream_generate
    from fmoe_cli.run import open_run

    opts = run_options(args.model, ["resident"], dtype=args.dtype, experts=args.experts, device="cpu",
                       activations="float")
    with open_run(opts) as run:
        ids = encode_prompt(run.lm, "Explain how a mixture-of-experts model works, in a few words.")
        steps = stream_generate(run.lm.model, ids, engine=run.engine, max_new_tokens=args.tokens + 3, stop_on_eos=False)
        for _ in range(3):  # the prefill and two decode steps: buffers made, every branch taken once
            next(steps)
        control = ["callgrind_control", "-i"]
        subprocess.run([*control, "on", str(os.getpid())], capture_output=True, check=True)
        tokens = [event.token_id for event in steps]
        subprocess.run([*control, "off", str(os.getpid())], capture_output=True, check=True)
    print(json.dumps({"tokens": tokens}))


def count(tree: str | None, args) -> dict:
    """One run under callgrind: instructions per decode token by shared object, and the tokens."""
    with tempfile.TemporaryDirectory(prefix="fmoe-callgrind-") as tmp:
        out = Path(tmp) / "callgrind.out"
        env = dict(os.environ)
        if tree:
            env["PYTHONPATH"] = tree
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
                   sys.executable, str(HERE), "--inside", args.model, "--experts", args.experts, "--dtype", args.dtype,
                   "--tokens", str(args.tokens)]
        run = subprocess.run(command, env=env, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"valgrind failed ({run.returncode}): {run.stderr.strip().splitlines()[-1:]}")
        tokens = json.loads(run.stdout.strip().splitlines()[-1])["tokens"]
        table = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", str(out)],
                               capture_output=True, text=True, check=True).stdout
    by_object: collections.Counter = collections.Counter()
    for line in table.splitlines():
        match = re.match(r"\s*([\d,]+) \([ \d.]+%\)\s+(.*)", line)
        if not match or "PROGRAM TOTALS" in line:
            continue
        found = re.search(r"\[([^\]]+)\]\s*$", match.group(2))
        name = found.group(1).rsplit("/", 1)[-1] if found else "(no object)"
        by_object["kernels" if name.startswith("experts-") else name] += int(match.group(1).replace(",", ""))
    per_token = {name: n / args.tokens for name, n in by_object.items()}
    total = sum(per_token.values())
    return {"tree": tree or "(this)", "tokens": tokens, "total": total, "kernels": per_token.get("kernels", 0.0),
            "host": total - per_token.get("kernels", 0.0), "by_object": per_token}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--experts", default="int4")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--versions", nargs=2, metavar=("A", "B"), help="two source trees, counted one after the other")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        return inside(args)
    reports = [count(tree, args) for tree in (args.versions or [None])]
    if args.json:
        print(json.dumps(reports))
        return
    for r in reports:
        top = sorted(r["by_object"].items(), key=lambda kv: -kv[1])[:6]
        print(f"{r['tree']}: {r['total'] / 1e6:.3f} M instructions a decode token: kernels {r['kernels'] / 1e6:.3f} M, "
              f"host {r['host'] / 1e6:.3f} M (" + ", ".join(f"{k} {v / 1e6:.3f}" for k, v in top if k != "kernels") + ")")
    if len(reports) == 2:
        a, b = reports
        print(f"host {a['host'] / 1e6:.3f} -> {b['host'] / 1e6:.3f} M a token ({b['host'] / a['host'] - 1:+.1%}); "
              f"same tokens: {a['tokens'] == b['tokens']}")


if __name__ == "__main__":
    sys.exit(main())
