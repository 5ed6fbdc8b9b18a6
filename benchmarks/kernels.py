#!/usr/bin/env python3
"""One expert through the CPU expert kernels (fmoe_cli/kernels) against torch, every format (issue 21 §1).

One `a3b` expert by default (Qwen3-30B-A3B's layer: H 2048, I 768), random weights, for T tokens:
- `kernel`: fmoe_cli.kernels.segment_forward on the stored rows (one pass, no dequantised weight);
- `torch`: what the stores computed with before (and still do without the kernels): three matmuls on
  the rows (f32, bf16), or the rows dequantised in blocks then the three matmuls (int8, int4, int2);
- `kernel, int8 activations` (int8, int4): the kernels with x quantised per block of 32 (--activations int8).
With --dense OUT IN: one projection instead (f32: F.linear; int8/int4: QuantLinear through the kernels, with
int8 activations, and its torch path).
Time per call in µs (and the CPU time it took, every thread: on a machine shared with other work the
wall time measures the share of the CPU the call got, the CPU time what the call costs) and GB/s of the
segment's stored bytes (what the call must read from RAM: the calls rotate through `--pool-mb` of
copies of the expert, beyond the last-level cache), median [min–max] of interleaved rounds.
Threads: torch.get_num_threads() unless --threads.

With --tolerance N: the engine's logits with int8 / int4 experts (float32 and bf16 compute; float and int8
activations, --activations) against
the reference — transformers' model with its experts replaced by the dequantised weights — over N
tokens of the shipped demo's held-out text (needs Debian's bible-kjv-text, as benchmarks/routing_report.py):
max abs logit error and top-1 agreement (docs/quantization.md § Exactness contract).

    python benchmarks/kernels.py
    python benchmarks/kernels.py --tokens 1 4 16 64 --rounds 7 --threads 2
    python benchmarks/kernels.py --dense 4096 2048 --formats f32 int8 int4
    python benchmarks/kernels.py --layer 8 --formats int4 --threads 2
    python benchmarks/kernels.py --layer 8 --formats int4 int8 --threads 1 --down-along-h --rounds 11
    python benchmarks/kernels.py --tolerance 2048
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FORMATS = ["f32", "bf16", "int8", "int4", "int2"]


def spread(values, fmt="{:.0f}"):
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}–{fmt.format(max(values))}]"


def make_cases(name: str, hidden: int, intermediate: int, pool_mb: float, tokens: int, layer: int = 1,
               along_h: bool = False):
    """(stored bytes of one expert, {path: call}) for format `name`; each call takes the next copy. layer > 1: the
    bytes of `layer` experts, and the kernels' two ways of computing them (one call each, one call for all).
    along_h (int8, int4): the same weights with their down rows grouped along H too (the store's layout before
    version 3: docs/quantization.md § Layout), the kernel paths of both in one process ("…, down along H")."""
    from fmoe_cli import kernels
    from fmoe_cli.offload import layout
    from fmoe_cli.offload.quant import QuantStore, quantize
    from fmoe_cli.types import EXPERT_FORMATS, ExpertShape

    torch.manual_seed(0)
    shape = ExpertShape(1, 1, 1, hidden, intermediate, 4, name if name in EXPERT_FORMATS else "bf16")
    chunk = shape.neuron_block  # the engine's split granularity
    by_neuron = shape.down_by_neuron  # the stores' layout: int8/int4 down rows grouped along the neurons
    dtype = torch.bfloat16 if name == "bf16" else torch.float32
    x = torch.randn(tokens, hidden).to(dtype)
    fmt = EXPERT_FORMATS.get(name)
    nbytes = intermediate * 3 * (fmt.projection_bytes(hidden) if fmt else hidden * dtype.itemsize)
    copies = max(2, math.ceil(pool_mb * 1e6 / nbytes))
    blocks = [torch.randn(intermediate, 3, hidden) * 0.02 for _ in range(2)]  # two experts, copied
    if fmt is None:
        stored = [blocks[i % 2].to(dtype) for i in range(copies)]
        spec = kernels.spec_of("bf16", dtype, hidden, chunk)

        def torch_path(seg):
            return layout.segment_forward(x, seg, F.silu)
    else:
        packed = [quantize(b, fmt, by_neuron) for b in blocks]
        packed_blocks = blocks
        stored = [packed[i % 2].clone() for i in range(copies)]
        spec = kernels.spec_of(name, dtype, hidden, chunk, down_by_neuron=by_neuron)
        store = QuantStore(ExpertShape(1, copies, 1, hidden, intermediate, 4, name), dtype, pin=False)

        def torch_path(seg):
            return QuantStore.segment_forward(store, x, seg, F.silu, kernel=False)
    assert stored[0].numel() * stored[0].element_size() == nbytes
    turn = [0]

    def rotate(call):
        def run():
            turn[0] = (turn[0] + 1) % copies
            return call(stored[turn[0]])
        return run

    calls = {"kernel": rotate(lambda seg: kernels.segment_forward(x, seg, spec)), "torch": rotate(torch_path)}
    layouts = {"": (stored, spec)}
    if along_h and by_neuron:  # the previous layout of the same weights, its own copies
        packed_h = [quantize(b, fmt) for b in packed_blocks]
        layouts[", down along H"] = ([packed_h[i % 2].clone() for i in range(copies)],
                                     kernels.spec_of(name, dtype, hidden, chunk))
    if layer > 1:  # a decode step's K activated experts: K calls, or one (kernels.segments_forward)
        def experts(rows, call):
            def run():
                segs = []
                for _ in range(layer):
                    turn[0] = (turn[0] + 1) % copies
                    segs.append(rows[turn[0]])
                return call(segs)
            return run

        cases = {}
        for label, (rows, layout_spec) in layouts.items():
            specs = {"": layout_spec}
            if name in ("int8", "int4"):
                specs[", int8 activations"] = replace(layout_spec, int8_activations=True)
            for mode, sp in specs.items():
                if not label and not mode:
                    cases[f"kernel, {layer} calls"] = experts(rows, lambda segs, sp=sp: [kernels.segment_forward(x, s, sp)
                                                                                         for s in segs])
                cases[f"kernel, {layer} in one call{label}{mode}"] = experts(
                    rows, lambda segs, sp=sp: kernels.segments_forward(x, segs, sp))
        return nbytes * layer, cases
    for label, (rows, layout_spec) in layouts.items():
        def rotate_in(call, rows=rows):
            def run():
                turn[0] = (turn[0] + 1) % copies
                return call(rows[turn[0]])
            return run

        if label:
            calls[f"kernel{label}"] = rotate_in(lambda seg, sp=layout_spec: kernels.segment_forward(x, seg, sp))
        if name in ("int8", "int4"):  # --activations int8: x quantised per block of 32, integer dots
            q8 = replace(layout_spec, int8_activations=True)
            calls[f"kernel{label}, int8 activations"] = rotate_in(lambda seg, q8=q8: kernels.segment_forward(x, seg, q8))
    return nbytes, calls


def make_dense_cases(name: str, outputs: int, inputs: int, pool_mb: float, tokens: int):
    """(stored bytes of one projection W [outputs, inputs], {path: call}) for `--dense`: f32 is F.linear on the
    float weight (what runs without --dense); int8/int4 are models/dense.py's QuantLinear through the kernels
    (its forward), with int8 activations, and its torch path (dequantised blocks, then F.linear)."""
    from fmoe_cli import kernels
    from fmoe_cli.models.dense import QuantLinear
    from fmoe_cli.types import EXPERT_FORMATS

    torch.manual_seed(0)
    x = torch.randn(tokens, inputs)
    linear = torch.nn.Linear(inputs, outputs, bias=False)
    fmt = EXPERT_FORMATS.get(name)
    nbytes = outputs * (fmt.projection_bytes(inputs) if fmt else inputs * 4)
    copies = max(2, math.ceil(pool_mb * 1e6 / nbytes))
    if fmt is None:
        weights = [linear.weight.detach().clone() for _ in range(copies)]
        calls = {"F.linear": lambda k: F.linear(x, weights[k])}
    else:
        first = QuantLinear(linear, fmt)
        layers = [first] + [copy.deepcopy(first) for _ in range(copies - 1)]  # copies of the packed rows
        q8 = replace(first.kernel, int8_activations=True)
        calls = {"kernel": lambda k: layers[k](x),
                 "kernel, int8 activations": lambda k: kernels.linear_forward(x, layers[k].packed, q8),
                 "torch": lambda k: layers[k].torch_forward(x)}
    turn = [0]

    def rotate(call):
        def run():
            turn[0] = (turn[0] + 1) % copies
            return call(turn[0])
        return run

    return nbytes, {path: rotate(call) for path, call in calls.items()}


@torch.no_grad()
def tolerance(console, tokens: int, seq_len: int = 32) -> None:
    """seq_len: tokens a forward (32, as the published tolerance was measured; below kernels.MAX_TOKENS, so every
    expert computes in the kernels)."""
    import transformers

    from fmoe_cli.models.demo import SHIPPED
    from fmoe_cli.models.families import find_moe_layers
    from fmoe_cli.models.load import load_model
    from fmoe_cli.offload.engine import Engine
    from fmoe_cli.offload.layout import DOWN, GATE, UP
    from fmoe_cli.offload.link import EmulatedLink
    from fmoe_cli.planning.presets import make_settings

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from routing_report import held_out_text

    text, label = held_out_text(SHIPPED)
    ids = transformers.AutoTokenizer.from_pretrained(SHIPPED)(text, add_special_tokens=False,
                                                             return_tensors="pt")["input_ids"][0][:tokens]
    for dtype, fmt, activations in [(d, f, a) for a in ("float", "int8") for d in ("float32", "bfloat16")
                                    for f in ("int8", "int4")]:
        lm = load_model("demo", device="cpu", dtype=dtype, experts=fmt, dense="bf16", activations=activations)
        reference = transformers.AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=getattr(torch, dtype)).eval()
        for layer in find_moe_layers(reference):
            w = lm.store.dequantized(layer.index)
            layer.experts.gate_up_proj.data.copy_(torch.cat([w[:, :, GATE], w[:, :, UP]], dim=1))
            layer.experts.down_proj.data.copy_(w[:, :, DOWN].transpose(1, 2))
        engine = Engine(lm.layers, lm.store, lm.shape, EmulatedLink(None), lm.device, lm.dtype)
        engine.install(lm.model)
        engine.configure(make_settings("resident", lm.shape, 0))
        error, agree = 0.0, 0
        for start in range(0, len(ids), seq_len):
            chunk = ids[start:start + seq_len][None]
            got, want = lm.model(chunk).logits.float(), reference(chunk).logits.float()
            error = max(error, (got - want).abs().max().item())
            agree += (got.argmax(-1) == want.argmax(-1)).sum().item()
        engine.close()
        console.print(f"{dtype} compute, {fmt} experts, {activations} activations, {len(ids)} tokens of {label}: "
                      f"max abs logit error "
                      f"{error:.3g}, top-1 agreement {100 * agree / len(ids):.2f} %", highlight=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS)
    p.add_argument("--tokens", type=int, nargs="+", default=[1])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20, help="calls per round and case")
    p.add_argument("--pool-mb", type=float, default=256, help="experts rotated through: this many MB of them "
                   "(more than the last-level cache holds)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--layer", type=int, default=1, metavar="K",
                   help="instead: K experts a call (a decode step's top-K), one kernel call each against one for all")
    p.add_argument("--down-along-h", action="store_true",
                   help="int8/int4: also the same weights with their down rows grouped along H (the previous store "
                        "layout), both layouts in this one process")
    p.add_argument("--paths", nargs="+", default=None, metavar="PATH",
                   help="only these paths (kernel, torch, 'kernel, int8 activations', F.linear), e.g. --paths kernel "
                        "under valgrind --tool=callgrind --toggle-collect=fmoe_segment_forward (instructions per weight)")
    p.add_argument("--dense", type=int, nargs=2, metavar=("OUT", "IN"), default=None,
                   help="instead: one dense projection W [OUT, IN] (models/dense.py), e.g. 4096 2048 (a3b's q_proj) "
                        "or 151936 2048 (its LM head)")
    p.add_argument("--tolerance", type=int, default=0, metavar="N",
                   help="instead: logits against the dequantised reference over N held-out tokens of the demo")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from rich.console import Console
    from rich.table import Table

    from fmoe_cli import kernels

    console = Console(width=200)
    console.print("command: python benchmarks/kernels.py " + " ".join(sys.argv[1:]), highlight=False)
    if args.tolerance:
        tolerance(console, args.tolerance)
        return
    if kernels.library() is None:
        console.print("the kernels are not available here: nothing to compare")
        return
    cases, sizes = {}, {}
    for name in args.formats:
        for tokens in args.tokens:
            if args.dense:
                nbytes, calls = make_dense_cases(name, *args.dense, args.pool_mb, tokens)
            else:
                nbytes, calls = make_cases(name, args.hidden, args.intermediate, args.pool_mb, tokens, args.layer,
                                           args.down_along_h)
            sizes[name] = nbytes
            for path, call in calls.items():
                if args.paths is None or path in args.paths:
                    cases[(name, tokens, path)] = call
    times = {key: [] for key in cases}
    cpu = {key: [] for key in cases}  # CPU time of the process (every thread): what the call costs the CPU
    with torch.inference_mode():
        for _ in range(args.rounds):  # interleaved: every case once per round
            for key, run in cases.items():
                run()
                start, start_cpu = time.perf_counter(), time.process_time()
                for _ in range(args.repeats):
                    run()
                times[key].append((time.perf_counter() - start) / args.repeats * 1e6)
                cpu[key].append((time.process_time() - start_cpu) / args.repeats * 1e6)
    what = (f"one projection W [{args.dense[0]}, {args.dense[1]}] (--dense)" if args.dense
            else f"{args.layer} experts" if args.layer > 1 else "one expert") + (
        "" if args.dense else f" (H={args.hidden}, I={args.intermediate})")
    base = "f32" if args.dense and "f32" in args.formats else None  # --dense: every row against f32's F.linear
    table = Table(title=f"{what}, {torch.get_num_threads()} threads: median \\[min–max] of {args.rounds} interleaved "
                        f"rounds × {args.repeats} calls")
    for col in ("format", "T", "path", "MB", "µs", "GB/s", "CPU µs", f"{'f32' if base else 'torch'} ÷ this"):
        table.add_column(col, justify="left" if col in ("format", "path") else "right")
    for (name, tokens, path), us in times.items():
        gbps = [sizes[name] / (t * 1e3) for t in us]
        reference = times.get((base, tokens, "F.linear")) if base else times.get((name, tokens, "torch"))
        ratio = spread([b / a for a, b in zip(us, reference)], "{:.2f}") if reference else ""
        table.add_row(name, str(tokens), path, f"{sizes[name] / 1e6:.2f}", spread(us), spread(gbps, "{:.1f}"),
                      spread(cpu[(name, tokens, path)]), ratio)
    console.print(table)

if __name__ == "__main__":
    main()
