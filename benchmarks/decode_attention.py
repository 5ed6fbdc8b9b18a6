#!/usr/bin/env python3
"""A decode token with transformers' forwards against fmoe's decode forwards, in one process: the attention's
(models/attention.py) or, with `--what layers`, the decoder layers', routers', final norm's and causal LM's
(models/decoder.py).

One `resident` run of MODEL on the CPU (the same options as `fmoe bench`); one generation whose decode tokens go
in blocks of `--per-block`, the two forwards alternated block by block (A B, then B A: interleaved,
so load from other work falls on both). Both give the same tokens (tests/test_attention.py, tests/test_decoder.py:
the same bits), so one generation serves both. Per token: the process's CPU time (every thread), the main thread's CPU time, and
wall time; medians and [min–max] over the blocks (the first token of a block is not counted: the switch).

    python benchmarks/decode_attention.py ~/.cache/fmoe-peer/models/big --dtype float32 --experts int4
    python benchmarks/decode_attention.py demo --experts int4 --threads 1
    python benchmarks/decode_attention.py ~/.cache/fmoe-peer/models/big --dtype float32 --experts int4 --what layers
"""

from __future__ import annotations

import fmoe_cli  # noqa: F401  (first, as the CLI: it sets torch's OpenMP wait policy before torch loads)

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--experts", default="int4")
    parser.add_argument("--dense", default=None, help="as fmoe's --dense (default: fmoe's)")
    parser.add_argument("--blocks", type=int, default=12, help="blocks of each forward")
    parser.add_argument("--per-block", type=int, default=4, help="decode tokens a block (the first not counted)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--what", choices=("attention", "layers"), default="attention",
                        help="whose decode forwards to alternate with transformers' own")
    args = parser.parse_args()

    from fmoe_cli.bench.run import encode_prompt
    from fmoe_cli.cli import run_options
    from fmoe_cli.generate import stream_generate
    from fmoe_cli.run import open_run

    if args.threads:
        torch.set_num_threads(args.threads)
    dense = {} if args.dense is None else {"dense": args.dense}
    opts = run_options(args.model, ["resident"], dtype=args.dtype, experts=args.experts, device="cpu",
                       activations="float", **dense)
    with open_run(opts) as run:
        lm = run.lm
        layers = lm.model.model.layers
        if args.what == "attention":
            modules = [layer.self_attn for layer in layers]
        else:  # the decoder layers, their routers, the final norm (models/decoder.py)
            modules = [*layers, *(getattr(layer.mlp, "gate", None) for layer in layers), lm.model.model.norm, lm.model]
        modules = [m for m in modules if m is not None]
        decode = [m.__dict__.get("forward") for m in modules]  # None: transformers' own (not a decode family)
        if not any(decode):
            raise SystemExit(f"{args.model}: no decode forward installed (models/attention.py, models/decoder.py)")

        def use(which: str) -> None:
            for module, forward in zip(modules, decode):
                if which == "decode" and forward is not None:
                    module.forward = forward
                else:
                    module.__dict__.pop("forward", None)

        ids = encode_prompt(lm, "Explain how a mixture-of-experts model works.")
        tokens = 4 + args.blocks * 2 * args.per_block + 1
        steps = stream_generate(lm.model, ids, engine=run.engine, max_new_tokens=tokens, stop_on_eos=False)
        for _ in range(5):  # the prefill and warm-up tokens
            next(steps)
        spent: dict[str, list] = {"transformers": [], "decode": []}
        for block in range(args.blocks):
            for which in ("transformers", "decode") if block % 2 == 0 else ("decode", "transformers"):
                use(which)
                next(steps)
                cpu, main_cpu, wall = time.process_time(), time.thread_time(), time.perf_counter()
                for _ in range(args.per_block - 1):
                    next(steps)
                n = args.per_block - 1
                spent[which].append(((time.process_time() - cpu) / n * 1e3, (time.thread_time() - main_cpu) / n * 1e3,
                                     (time.perf_counter() - wall) / n * 1e3))
        use("decode")
    print(f"{args.model}: --dtype {args.dtype} --experts {args.experts} --dense {lm.dense}, "
          f"{torch.get_num_threads()} threads, {args.blocks} blocks of {args.per_block - 1} tokens each; ms a token, "
          "median [min–max] over the blocks")
    print(f"| {args.what} forward | CPU (every thread) | CPU (main thread) | wall |\n|---|---|---|---|")
    for which, rows in spent.items():
        cells = [f"{statistics.median(c):.2f} [{min(c):.2f}–{max(c):.2f}]" for c in zip(*rows)]
        print(f"| {which} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
