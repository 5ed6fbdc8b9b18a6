#!/usr/bin/env python3
"""A resident CPU decode token in one C call against the per-step path, in one process (models/token.py).

One `resident` run of MODEL with `fmoe bench`'s options; then ROUNDS rounds, each generating TOKENS decode tokens
after the prompt with the token in C (A) and with the per-step path (B), in alternating order (ABBA...). Each side's
TPOT of a round is the median of its decode steps; the report gives each side's median over the rounds, their
spread (min–max), the ratio B/A per round, and the load average before and after. Both sides' tokens are compared
(they must be equal: the same bits).

    python benchmarks/decode_token.py ~/.cache/fmoe-peer/models/demo --dtype float32 --experts int4 --tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import fmoe_cli  # noqa: F401  (before torch, as the CLI: it sets torch's OpenMP wait policy)


def run(args) -> dict:
    import torch

    from fmoe_cli.bench.run import encode_prompt
    from fmoe_cli.cli import run_options
    from fmoe_cli.generate import stream_generate
    from fmoe_cli.run import open_run

    dense = {} if args.dense is None else {"dense": args.dense}
    opts = run_options(args.model, ["resident"], dtype=args.dtype, experts=args.experts, device="cpu", **dense)
    with open_run(opts) as r:
        lm, engine = r.lm, r.engine
        token = lm.model.decode_token
        prompt = open(args.prompt_file).read() if args.prompt_file else "Explain how a mixture-of-experts model works."
        ids = encode_prompt(lm, prompt)

        def side(in_c: bool):
            token.enabled = in_c
            runs = token.runs
            steps, out = [], []
            for event in stream_generate(lm.model, ids, engine=engine, max_new_tokens=args.tokens + 1,
                                         stop_on_eos=False):
                steps.append(event.latency_s)
                out.append(event.token_id)
            assert (token.runs - runs == args.tokens) == in_c, "the token in C did not run for every decode token"
            return statistics.median(steps[1:]) * 1e3, out

        side(True), side(False)  # warm-up
        load = [os.getloadavg()]
        a, b = [], []
        same = True
        for r_ in range(args.rounds):
            order = (True, False) if r_ % 2 == 0 else (False, True)
            got = {}
            for in_c in order:
                got[in_c] = side(in_c)
            a.append(got[True][0])
            b.append(got[False][0])
            same &= got[True][1] == got[False][1]
        load.append(os.getloadavg())
        token.enabled = True
        return {"model": args.model, "dtype": args.dtype, "experts": args.experts, "dense": lm.dense,
                "threads": torch.get_num_threads(), "tokens": args.tokens, "rounds": args.rounds,
                "in_c_ms": {"median": statistics.median(a), "min": min(a), "max": max(a)},
                "per_step_ms": {"median": statistics.median(b), "min": min(b), "max": max(b)},
                "ratio": {"median": statistics.median(y / x for x, y in zip(a, b)),
                          "min": min(y / x for x, y in zip(a, b)), "max": max(y / x for x, y in zip(a, b))},
                "same_tokens": same, "load": load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--experts", default="int4")
    parser.add_argument("--dense", default=None)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompt-file", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = run(args)
    if args.json:
        print(json.dumps(report))
        return
    a, b, ratio = report["in_c_ms"], report["per_step_ms"], report["ratio"]
    print(f"{report['model']} --dtype {report['dtype']} --experts {report['experts']} --dense {report['dense']}, "
          f"{report['threads']} threads, {report['rounds']} rounds of {report['tokens']} tokens; load "
          f"{report['load'][0][0]:.2f} → {report['load'][1][0]:.2f}")
    print(f"  token in C  TPOT {a['median']:.3f} ms [{a['min']:.3f}, {a['max']:.3f}]")
    print(f"  per step    TPOT {b['median']:.3f} ms [{b['min']:.3f}, {b['max']:.3f}]")
    print(f"  per step ÷ in C {ratio['median']:.2f} [{ratio['min']:.2f}, {ratio['max']:.2f}]; same tokens: "
          f"{report['same_tokens']}")


if __name__ == "__main__":
    sys.exit(main())
