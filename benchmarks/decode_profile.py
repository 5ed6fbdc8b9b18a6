#!/usr/bin/env python3
"""Where a CPU decode token's time goes (issue 21, "Done when": the gap to llama.cpp kernel by kernel).

One `resident` run of MODEL (every expert in RAM, nothing moved: what the peer table measures),
the same options as `fmoe bench`, then `--tokens` decode steps. Each part of the model is
timed around its forward (wall time, inclusive; the same spans are `record_function` labels
for torch.profiler, whose top ops `--ops N` prints):

    attention      the decoder layers' self-attention (q/k/v/o projections, RoPE, SDPA, KV cache)
      attention rows  inside attention: the kernel calls of its projections' rows (kernels.linear_forward)
    moe            the decoder layers' MoE blocks (router, engine, experts, combine)
      experts      inside moe: the expert segments' compute (the C kernels, or torch's matmuls)
    lm head        the last norm's output → logits
    other          the rest of a step: embedding, norms, residual adds, sampling, Python between

Wrapping the parts' forwards turns off the resident float32 token in one C call (models/token.py), so these are
the per-step path's parts (the one call against them: docs/bench.md § Retired studies, `decode_token.py`).

`other` is the step's wall time minus the labelled parts; `moe − experts` is the engine's own
work per layer (routing, bookkeeping, the combine). Shares are of the median step. The bytes a
part reads per token (weights) and its GB/s are shown beside its time, so a part far from the
memory's speed stands out. The prefill step (the prompt and its first token) is given the same way, in ms, with
the process's CPU time beside its wall time (steadier on a machine shared with other work). With `--ops` the run
is under torch.profiler (it adds a few µs per op).

    python benchmarks/decode_profile.py ~/.cache/fmoe-peer/models/a3b --dtype float32 --experts int4
    python benchmarks/decode_profile.py demo --experts int8 --tokens 16 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from contextlib import nullcontext

import fmoe_cli  # noqa: F401  (before torch, as the CLI: it sets torch's OpenMP wait policy)

PARTS = ("attention", "attention rows", "moe", "experts", "lm head")
SPENT: Counter = Counter()  # seconds per label since the last decode step
OPEN: Counter = Counter()  # labels being timed (a kernel call counts as "attention rows" only inside "attention")


def labelled(forward, label: str):
    """`forward` timed into SPENT[label], inside a record_function named `label` (for torch.profiler)."""
    import torch

    def wrapped(*args, **kwargs):
        start = time.perf_counter()
        OPEN[label] += 1
        try:
            with torch.profiler.record_function(label):
                out = forward(*args, **kwargs)
        finally:
            OPEN[label] -= 1
        SPENT[label] += time.perf_counter() - start
        return out

    return wrapped


def attention_rows(forward):
    """kernels.linear_forward, timed into SPENT["attention rows"] when called inside an attention forward."""
    plain = labelled(forward, "attention rows")
    return lambda *args, **kwargs: (plain if OPEN["attention"] else forward)(*args, **kwargs)


def label_model(model) -> None:
    """Wrap each decoder layer's attention and MoE block, the LM head, and the expert kernels' entry."""
    from fmoe_cli import kernels

    for layer in model.model.layers:
        layer.self_attn.forward = labelled(layer.self_attn.forward, "attention")
        layer.mlp.forward = labelled(layer.mlp.forward, "moe")
    model.lm_head.forward = labelled(model.lm_head.forward, "lm head")
    kernels.segment_forward = labelled(kernels.segment_forward, "experts")
    kernels.segments_forward = labelled(kernels.segments_forward, "experts")  # a decode layer's experts, one call
    kernels.experts_forward = labelled(kernels.experts_forward, "experts")  # a prefill layer's experts, one call
    kernels.linear_forward = attention_rows(kernels.linear_forward)  # the attention's projections (and fused q/k/v)


def weight_bytes(module) -> int:
    """Bytes of a module's parameters and buffers (what one token reads of it, once)."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def profile_decode(args) -> dict:
    import torch

    from fmoe_cli.bench.run import encode_prompt
    from fmoe_cli.cli import run_options
    from fmoe_cli.generate import stream_generate
    from fmoe_cli.run import open_run

    dense = {} if args.dense is None else {"dense": args.dense}  # left out: fmoe's default
    opts = run_options(args.model, ["resident"], dtype=args.dtype, experts=args.experts, device="cpu",
                       activations=args.activations, **dense)
    with open_run(opts) as run:
        lm, engine = run.lm, run.engine
        label_model(lm.model)
        prompt = open(args.prompt_file).read() if args.prompt_file else "Explain how a mixture-of-experts model works."
        ids = encode_prompt(lm, prompt)
        for _ in stream_generate(lm.model, ids, engine=engine, max_new_tokens=args.warmup, stop_on_eos=False):
            pass
        steps, parts = [], []
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.ops else nullcontext()
        with profiler:
            SPENT.clear()
            cpu = [time.process_time()]  # the process's CPU time (every thread) at each event: steadier under load
            for event in stream_generate(lm.model, ids, engine=engine, max_new_tokens=args.tokens + 1,
                                         stop_on_eos=False):
                steps.append(event.latency_s)
                parts.append(dict(SPENT))
                cpu.append(time.process_time())
                SPENT.clear()
        prefill_s, decode = steps[0], steps[1:]  # the first step is the prefill (and its token)
        per_token = {part: statistics.mean(p.get(part, 0.0) for p in parts[1:]) for part in PARTS}
        step = statistics.median(decode)
        per_token["other"] = max(0.0, statistics.mean(decode) - per_token["attention"] - per_token["moe"]
                                 - per_token["lm head"])
        layers = lm.model.model.layers
        attention_bytes = sum(weight_bytes(layer.self_attn) for layer in layers)
        expert_bytes = lm.shape.expert_bytes * lm.shape.top_k * lm.shape.num_layers  # K routed experts per MoE layer
        read = {"attention": attention_bytes, "attention rows": attention_bytes, "experts": expert_bytes,
                "lm head": weight_bytes(lm.model.lm_head)}
        return {"model": args.model, "dtype": str(lm.dtype).removeprefix("torch."), "experts": args.experts,
                "dense": lm.dense, "activations": lm.activations, "threads": torch.get_num_threads(),
                "tokens": len(decode), "tpot_ms": {"median": step * 1e3, "min": min(decode) * 1e3,
                                                    "max": max(decode) * 1e3},
                "tpot_cpu_ms": (cpu[-1] - cpu[1]) / len(decode) * 1e3,  # the decode steps' CPU time (every thread), mean
                "prefill_ms": prefill_s * 1e3, "prefill_cpu_ms": (cpu[1] - cpu[0]) * 1e3, "prompt_tokens": int(ids.shape[-1]),
                "per_token_ms": {k: v * 1e3 for k, v in per_token.items()},
                "prefill_parts_ms": prefill_parts(parts[0], prefill_s),
                "bytes_per_token": read,
                "top_ops": None if not args.ops else profiler.key_averages().table(sort_by="self_cpu_time_total",
                                                                                    row_limit=args.ops)}


def prefill_parts(spent: dict, total_s: float) -> dict:
    """The prefill step's parts in ms (the same labels as a decode token's; `other` the rest of the step)."""
    parts = {part: spent.get(part, 0.0) * 1e3 for part in PARTS}
    parts["other"] = max(0.0, total_s * 1e3 - parts["attention"] - parts["moe"] - parts["lm head"])
    return parts


def render(report: dict) -> str:
    t = report["tpot_ms"]
    lines = [f"{report['model']}: --dtype {report['dtype']} --experts {report['experts']} --dense {report['dense']} "
             f"--activations {report['activations']}, "
             f"{report['threads']} threads, {report['tokens']} decode tokens after a {report['prompt_tokens']}-token "
             f"prompt; TPOT median {t['median']:.2f} ms [{t['min']:.2f}, {t['max']:.2f}], CPU time "
             f"{report['tpot_cpu_ms']:.2f} ms a token (every thread, mean)", "",
             "| part | ms / token | share | weight MB / token | GB/s |", "|---|---:|---:|---:|---:|"]
    mean = sum(v for k, v in report["per_token_ms"].items() if k not in ("experts", "attention rows"))
    for part in ("attention", "attention rows", "moe", "experts", "lm head", "other"):
        ms = report["per_token_ms"][part]
        nbytes = report["bytes_per_token"].get(part)
        rate = f"{nbytes / (ms / 1e3) / 1e9:.1f}" if nbytes and ms > 0 else ""
        name = {"experts": "  of which experts", "attention rows": "  of which rows (kernel calls)"}.get(part, part)
        lines.append(f"| {name} | {ms:.2f} | {ms / mean:.0%} | {'' if nbytes is None else f'{nbytes / 1e6:.1f}'} | {rate} |")
    moe, experts = report["per_token_ms"]["moe"], report["per_token_ms"]["experts"]
    lines.append(f"| moe − experts (router, engine, combine) | {moe - experts:.2f} | {(moe - experts) / mean:.0%} | | |")
    p = report["prefill_parts_ms"]
    lines += ["", f"prefill: {report['prompt_tokens']} tokens in {report['prefill_ms']:.1f} ms "
              f"({report['prompt_tokens'] / report['prefill_ms'] * 1e3:.1f} tokens/s; CPU time "
              f"{report['prefill_cpu_ms']:.1f} ms), of which "
              + ", ".join(f"{part} {p[part]:.1f}" for part in ("attention", "moe", "experts", "lm head", "other"))
              + f", moe − experts {p['moe'] - p['experts']:.1f} ms"]
    if report["top_ops"]:
        lines += ["", f"torch.profiler, the whole run (prefill and {report['tokens']} decode steps), by self CPU time:",
                  report["top_ops"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--experts", default="bf16")
    parser.add_argument("--dense", default=None, help="as fmoe's --dense (default: fmoe's)")
    parser.add_argument("--activations", default="auto", help="as fmoe's --activations (float, int8; default: "
                                                               "fmoe's, int8 beside int8/int4 experts)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--prompt-file", default=None)
    parser.add_argument("--ops", type=int, default=0, metavar="N", help="also torch.profiler's top N ops")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = profile_decode(args)
    print(json.dumps(report) if args.json else render(report))


if __name__ == "__main__":
    sys.exit(main())
