#!/usr/bin/env python3
"""A CPU decode token from transformers' DynamicCache (a torch.cat of the whole cache every step) against
generate.py's GrowingLayers (written in place), in one process.

One `resident` run of MODEL on the CPU (the same options as `fmoe bench`); the prompt (prompt64.txt repeated
`--repeat` times: a long context) is prefilled once, then each round decodes `--tokens` tokens from a copy of that
cache, once in each kind, in alternating order (A B, then B A: interleaved, so load from other work falls on both).
Both must give the same tokens (checked; tests/test_generate_cache.py: the same bits). Per token: the process's CPU
time (every thread), the main thread's, and wall time; medians and [min–max] over the rounds. With `--updates`,
instead: one layer's cache update alone (a3b's KV shape, 4 heads of 128), at several lengths, best of 5 × 200.

    python benchmarks/decode_cache.py ~/.cache/fmoe-peer/models/big --repeat 10 --rounds 6 --tokens 8
    python benchmarks/decode_cache.py --updates
"""

from __future__ import annotations

import fmoe_cli  # noqa: F401  (first, as the CLI: it sets torch's OpenMP wait policy before torch loads)

import argparse
import os
import statistics
import time

import torch

PROMPT = os.path.expanduser("~/.cache/fmoe-peer/prompt64.txt")


def updates() -> None:
    from transformers.cache_utils import DynamicLayer

    from fmoe_cli.generate import GrowingLayer

    heads, dim, n = 4, 128, 200
    print(f"one layer's cache update, [1, {heads}, L, {dim}] float32 keys and values, best of 5 × {n} updates "
          f"from L; {torch.get_num_threads()} threads")
    print("| L | DynamicLayer µs | GrowingLayer µs |\n|---:|---:|---:|")
    with torch.inference_mode():
        for length in (20, 100, 300, 1000, 3000):
            cells = []
            for make in (DynamicLayer, GrowingLayer):
                best = float("inf")
                for _ in range(5):
                    layer = make()
                    layer.update(torch.randn(1, heads, length, dim), torch.randn(1, heads, length, dim))
                    k, v = torch.randn(1, heads, 1, dim), torch.randn(1, heads, 1, dim)
                    start = time.perf_counter()
                    for _ in range(n):
                        layer.update(k, v)
                    best = min(best, (time.perf_counter() - start) / n)
                cells.append(f"{best * 1e6:.1f}")
            print(f"| {length} | " + " | ".join(cells) + " |")


def decode(args) -> None:
    from transformers import DynamicCache

    from fmoe_cli.bench.run import encode_prompt
    from fmoe_cli.cli import run_options
    from fmoe_cli.generate import new_cache, stream_generate
    from fmoe_cli.run import open_run

    dense = {} if args.dense is None else {"dense": args.dense}
    opts = run_options(args.model, ["resident"], dtype=args.dtype, experts=args.experts, device="cpu",
                       activations="float", **dense)
    with open_run(opts) as run:
        lm = run.lm
        ids = encode_prompt(lm, " ".join([open(args.prompt_file).read()] * args.repeat))
        prefilled = DynamicCache(config=lm.model.config)
        first = next(stream_generate(lm.model, ids, engine=run.engine, max_new_tokens=1, stop_on_eos=False,
                                     past_key_values=prefilled))

        def fresh(kind: str):
            cache = DynamicCache(config=lm.model.config) if kind == "DynamicCache" else new_cache(lm.model)
            for i, layer in enumerate(prefilled.layers):
                cache.update(layer.keys.clone(), layer.values.clone(), i)
            return cache

        spent: dict[str, list] = {"DynamicCache": [], "GrowingLayer": []}
        answers = set()
        for round_ in range(args.rounds):
            for kind in list(spent) if round_ % 2 == 0 else list(spent)[::-1]:
                steps = stream_generate(lm.model, torch.tensor([[first.token_id]]), engine=run.engine,
                                        max_new_tokens=args.tokens + 1, stop_on_eos=False, past_key_values=fresh(kind))
                next(steps)  # (the first token of a round is not counted)
                cpu, main_cpu, wall = time.process_time(), time.thread_time(), time.perf_counter()
                answers.add(tuple(event.token_id for event in steps))
                n = args.tokens
                spent[kind].append(((time.process_time() - cpu) / n * 1e3, (time.thread_time() - main_cpu) / n * 1e3,
                                    (time.perf_counter() - wall) / n * 1e3))
        if len(answers) != 1:
            raise SystemExit("the two caches gave different tokens")
    print(f"{args.model}: --dtype {args.dtype} --experts {args.experts} --dense {lm.dense}, {torch.get_num_threads()} "
          f"threads, a {ids.shape[-1]}-token context, {args.rounds} rounds of {args.tokens} tokens each; ms a token, "
          "median [min–max] over the rounds")
    print("| KV cache | CPU (every thread) | CPU (main thread) | wall |\n|---|---|---|---|")
    for kind, rows in spent.items():
        cells = [f"{statistics.median(c):.2f} [{min(c):.2f}–{max(c):.2f}]" for c in zip(*rows)]
        print(f"| {kind} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--experts", default="int4")
    parser.add_argument("--dense", default=None, help="as fmoe's --dense (default: fmoe's)")
    parser.add_argument("--prompt-file", default=PROMPT)
    parser.add_argument("--repeat", type=int, default=10, help="the prompt file this many times (the context)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=8, help="decode tokens a round (after one not counted)")
    parser.add_argument("--updates", action="store_true", help="one layer's cache update alone, no model")
    args = parser.parse_args()
    if args.updates:
        updates()
    elif args.model is None:
        parser.error("MODEL is needed (or --updates)")
    else:
        decode(args)


if __name__ == "__main__":
    main()
