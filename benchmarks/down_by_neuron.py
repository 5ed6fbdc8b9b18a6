#!/usr/bin/env python3
"""The down projection grouped along the neurons against the previous layout, a prefill and a decode token end to end
(issue 39 §2).

One process, one compiled library, the same checkpoint loaded twice: once from its converted store of version 3
(int8/int4 down rows grouped along the neurons: the integer down dots, experts.c § down by neuron) and once from its
version-2 store (down rows grouped along H: the float32 down, the code path before), each a `resident` engine; then
rounds of a prompt's prefill (`--prompt` tokens, random ids) and greedy decoding, the two loads alternating (order
reversed every other round). Printed: the prefill's and the median decode step's CPU time of the calling thread (one
thread: the kernels run on it; on a machine shared with other work the CPU time is what a token costs, the wall time
what share of the CPU it got), median [min–max] over the rounds, and the ratio round by round. The version-2 store must already be in the cache (an fmoe from before 28 Nov wrote it; this
script converts the version-3 one on its first load, as fmoe does).

    XDG_CACHE_HOME=… python benchmarks/down_by_neuron.py ~/.cache/fmoe-peer/models/big --experts int4 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fmoe_cli  # noqa: E402,F401  (before torch: the OpenMP policy)


def load(model: str, experts: str, activations: str, previous: bool):
    from fmoe_cli.models.load import load_model
    from fmoe_cli.offload import converted
    from fmoe_cli.offload.engine import Engine
    from fmoe_cli.offload.link import EmulatedLink
    from fmoe_cli.planning.presets import make_settings
    from fmoe_cli.types import ExpertShape

    saved = converted.FORMAT_VERSION, ExpertShape.down_by_neuron
    if previous:  # the version-2 store and the spec of its rows: down grouped along H
        converted.FORMAT_VERSION, ExpertShape.down_by_neuron = 2, property(lambda self: False)
    try:
        lm = load_model(model, device="cpu", dtype="float32", experts=experts, activations=activations)
    finally:
        converted.FORMAT_VERSION, ExpertShape.down_by_neuron = saved
    if not previous and not lm.shape.down_by_neuron:
        raise SystemExit(f"error: {model}'s {experts} experts are not grouped along the neurons (I or G not a multiple of 32)")
    engine = Engine(lm.layers, lm.store, lm.shape, EmulatedLink(None), lm.device, lm.dtype)
    engine.install(lm.model)
    engine.configure(make_settings("resident", lm.shape, 0))
    return lm, engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--experts", default="int4", choices=["int8", "int4"])
    p.add_argument("--activations", default="int8", choices=["int8", "float"])
    p.add_argument("--tokens", type=int, default=16, help="decode steps a round (after two unmeasured)")
    p.add_argument("--prompt", type=int, default=64, help="the prompt's tokens, prefilled at once (default 64)")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    if args.tokens < 1 or args.prompt < 1 or args.rounds < 1:
        print("error: --tokens, --prompt and --rounds from 1", file=sys.stderr)
        sys.exit(2)
    if args.model != "demo" and not (Path(args.model) / "config.json").is_file():  # before torch: a second, not ten
        print(f"error: no model directory with a config.json at {args.model}", file=sys.stderr)
        sys.exit(2)
    import torch

    from fmoe_cli.generate import stream_generate

    torch.set_num_threads(1)
    from fmoe_cli.errors import FmoeError

    try:
        models = {"along H (v2)": load(args.model, args.experts, args.activations, True),
                  "by neuron (v3)": load(args.model, args.experts, args.activations, False)}
    except FmoeError as exc:  # a checkpoint fmoe refuses: its one line
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    vocab = next(iter(models.values()))[0].model.config.vocab_size
    prompt = torch.randint(3, vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    cpu = {key: [] for key in models}
    prefill = {key: [] for key in models}
    for r in range(args.rounds):
        for key in (list(models) if r % 2 == 0 else list(models)[::-1]):
            lm, engine = models[key]
            steps, start = [], time.thread_time()
            for i, _ in enumerate(stream_generate(lm.model, prompt, engine=engine, max_new_tokens=args.tokens + 2,
                                                  stop_on_eos=False)):
                now = time.thread_time()
                if i == 0:
                    prefill[key].append((now - start) * 1e3)
                elif i >= 2:
                    steps.append((now - start) * 1e3)
                start = now
            cpu[key].append(statistics.median(steps))
    for lm, engine in models.values():
        engine.close()
    print(f"{args.experts} experts, {args.activations} activations, 1 thread, {args.rounds} interleaved rounds:")
    for what, times in ((f"a {args.prompt}-token prefill", prefill), (f"a decode token (median of {args.tokens})", cpu)):
        old, new = times["along H (v2)"], times["by neuron (v3)"]
        ratios = [b / a for a, b in zip(old, new)]
        print(f"  ms of CPU {what}: down along H {statistics.median(old):.2f} [{min(old):.2f}–{max(old):.2f}], by "
              f"neuron {statistics.median(new):.2f} [{min(new):.2f}–{max(new):.2f}]; by neuron ÷ along H "
              f"{statistics.median(ratios):.3f} [{min(ratios):.3f}–{max(ratios):.3f}]")


if __name__ == "__main__":
    main()
