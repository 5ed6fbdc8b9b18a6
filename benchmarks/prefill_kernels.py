#!/usr/bin/env python3
"""A prefill's CPU kernel calls through two builds of the kernels, side by side in one process (issue 39 §4).

What a 64-token prompt asks of experts.c in one layer of `a3b` (hidden 2048, 128 experts × 768, top-8) or `big`
(hidden 1024, 64 experts × 512, top-8), random weights and a random top-k routing:
- `experts`: the layer's activated experts, each with its own tokens (kernels.experts_forward, ~4 tokens an a3b
  expert, ~8 a big one), each expert's rows a copy of its own (from RAM, as a resident prefill reads them);
- `q rows`: the attention's widest projection as a `--dense` linear (a3b 4096 × 2048, big 1024 × 1024) over the
  prompt's tokens (kernels.linear_forward).
Each path runs in the work tree's build and in `--against REV`'s (experts.c, decode.c and bf16.h as committed there),
interleaved round by round (in turns first: on this project's shared machine the first of a pair ran ~2 % faster
whichever it was); the CPU time of the calling thread per call (one thread: on a machine shared with other
work the CPU time is what the call costs), median [min–max] over the rounds, and whether both builds give the same
bits (they must where a change claims to keep them).

    python benchmarks/prefill_kernels.py --against main
    python benchmarks/prefill_kernels.py --against main --models a3b big --formats int4 int8 --activations int8 float
    python benchmarks/prefill_kernels.py --against main --models big --down-by-neuron
    FMOE_KERNEL_ISA=avx2 python benchmarks/prefill_kernels.py --against main --by-neuron --activations int8 float

FMOE_KERNEL_ISA (kernels/build.py: native, avx2vnni, avx2, scalar) picks the paths both builds compile.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {"a3b": (2048, 768, 128, 8, 4096), "big": (1024, 512, 64, 8, 1024)}  # H, I, E, top-k, q rows
KERNEL_FILES = ("experts.c", "decode.c", "bf16.h")


def build(source_dir: Path, out: Path) -> ctypes.CDLL:
    """experts.c and decode.c of source_dir compiled as kernels/build.py compiles them, then configured by
    kernels.library (its argument types)."""
    from fmoe_cli import kernels
    from fmoe_cli.kernels import build as builder

    cc = builder.compiler()
    flags = builder.ISA_FLAGS[builder.isa()]
    subprocess.run([cc, *flags, "-o", str(out), str(source_dir / "experts.c"), str(source_dir / "decode.c"), "-lm"],
                   check=True, timeout=builder.COMPILE_TIMEOUT_S)
    original = builder.build
    builder.build = lambda: ctypes.CDLL(str(out))
    try:
        return kernels.library.__wrapped__()
    finally:
        builder.build = original


def cases(model: str, fmt_name: str, activations: str, tokens: int, by_neuron: bool = False):
    """{path: call(kernels module, down_by_neuron) -> result} for one model, expert format and --activations;
    by_neuron: the experts' rows are also quantised with their down rows grouped along the neurons (the converted
    store's version 3), which a call with down_by_neuron uses."""
    import torch

    from fmoe_cli import kernels
    from fmoe_cli.offload.quant import quantize
    from fmoe_cli.types import EXPERT_FORMATS, ExpertShape

    hidden, width, count, top_k, q_rows = MODELS[model]
    fmt = EXPERT_FORMATS[fmt_name]
    g = torch.Generator().manual_seed(0)
    route = torch.stack([torch.randperm(count, generator=g)[:top_k] for _ in range(tokens)])
    x = torch.randn(tokens, hidden, generator=g)
    experts = sorted(set(route.flatten().tolist()))
    weights = [torch.randn(width, 3, hidden, generator=g) * 0.02 for _ in range(2)]
    layouts = (False, True) if by_neuron else (False,)
    # a copy each: from RAM, as a prefill reads a layer's experts
    segments = {layout: [quantize(weights[e % 2], fmt, layout) for e in experts] for layout in layouts}
    xs = [x[(route == e).any(1)].contiguous() for e in experts]
    chunk = ExpertShape(1, 1, 1, hidden, width, 4).neuron_block
    specs = {layout: kernels.quant_spec(fmt, hidden, chunk, activations, layout) for layout in layouts}
    rows = quantize(torch.randn(q_rows, 1, hidden, generator=g) * 0.02, fmt)[:, 0].contiguous()
    dense = kernels.quant_spec(fmt, hidden, activations=activations)
    sizes = [t.shape[0] for t in xs]
    label = f"{len(experts)} experts, {statistics.mean(sizes):.1f} tokens each ({min(sizes)}–{max(sizes)})"
    return label, {"experts": lambda k, layout: torch.cat(k.experts_forward(xs, segments[layout], specs[layout])),
                   f"q rows {q_rows} × {hidden}": lambda k, layout: k.linear_forward(x, rows, dense)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", default="main", metavar="REV", help="the git revision to compare with (default main)")
    p.add_argument("--models", nargs="+", default=["a3b", "big"], choices=sorted(MODELS))
    p.add_argument("--formats", nargs="+", default=["int4", "int8"], choices=["int4", "int8"])
    p.add_argument("--activations", nargs="+", default=["int8"], choices=["int8", "float"])
    p.add_argument("--tokens", type=int, default=64, help="the prompt's tokens (default 64)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="calls per round and build")
    p.add_argument("--down-by-neuron", action="store_true",
                   help="the work tree's experts with their down rows grouped along the neurons (converted store "
                        "version 3), REV's grouped along H (version 2): the same weights, other codes, so other bits")
    p.add_argument("--by-neuron", action="store_true",
                   help="both builds' experts with their down rows grouped along the neurons (version 3): the same "
                        "codes, so the same bits where the change keeps them")
    args = p.parse_args()
    if args.tokens < 2 or args.rounds < 1 or args.repeats < 1:
        print("error: --tokens from 2, --rounds and --repeats from 1", file=sys.stderr)
        sys.exit(2)
    if args.by_neuron and args.down_by_neuron:
        print("error: --by-neuron (both builds) or --down-by-neuron (the work tree's alone), not both", file=sys.stderr)
        sys.exit(2)
    old_sources = {}
    for name in KERNEL_FILES:
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.against}:fmoe_cli/kernels/{name}"],
                              capture_output=True, text=True)
        if text.returncode != 0:
            print(f"error: --against {args.against}: no fmoe_cli/kernels/{name} there (git: "
                  f"{' '.join(text.stderr.strip().splitlines()[-1:])})", file=sys.stderr)
            sys.exit(2)
        old_sources[name] = text.stdout
    import torch

    from fmoe_cli import kernels

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="fmoe-prefill-kernels-") as tmp:
        old = Path(tmp) / "old"
        old.mkdir()
        for name, text in old_sources.items():
            (old / name).write_text(text)
        libs = {args.against: build(old, Path(tmp) / "old.so"),
                "work tree": build(ROOT / "fmoe_cli" / "kernels", Path(tmp) / "new.so")}
        configured = kernels.library

        def on(lib):
            kernels.library = lambda: lib
            return kernels

        print(f"{args.tokens} tokens, 1 thread, CPU ms a call: median [min–max] of {args.rounds} interleaved rounds "
              f"× {args.repeats} calls")
        try:
            for model in args.models:
                for fmt in args.formats:
                    for activations in args.activations:
                        label, calls = cases(model, fmt, activations, args.tokens,
                                             args.down_by_neuron or args.by_neuron)
                        print(f"{model} {fmt} experts, {activations} activations ({label}):")
                        for path, call in calls.items():
                            layout = {args.against: args.by_neuron, "work tree": args.down_by_neuron or args.by_neuron}
                            outs = {name: call(on(lib), layout[name]) for name, lib in libs.items()}
                            old_out, new_out = outs.values()
                            same = torch.equal(old_out, new_out)
                            times = {name: [] for name in libs}
                            for round_ in range(args.rounds):  # the order alternates: the first of a pair runs faster
                                for name, lib in list(libs.items())[::1 if round_ % 2 == 0 else -1]:
                                    start = time.thread_time()
                                    for _ in range(args.repeats):
                                        call(on(lib), layout[name])
                                    times[name].append((time.thread_time() - start) / args.repeats * 1e3)
                            cells = [f"{name} {statistics.median(t):.2f} [{min(t):.2f}–{max(t):.2f}]"
                                     for name, t in times.items()]
                            ratio = statistics.median(times[args.against]) / statistics.median(times["work tree"])
                            print(f"  {path}: {', '.join(cells)} ms; {args.against} ÷ work tree {ratio:.2f}; "
                                  + ("the same bits" if same else
                                     f"max difference {(old_out - new_out).abs().max().item():.3g}"))
        finally:
            kernels.library = configured


if __name__ == "__main__":
    main()
