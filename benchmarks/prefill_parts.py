#!/usr/bin/env python3
"""A prompt's prefill on the CPU, part by part, and which thread does the work (issue 39 §4).

One `resident` run of MODEL with `fmoe bench --policy resident`'s options (the peer table's fmoe command:
benchmarks/peer_llamacpp.py), the prompt prefilled `--repeats` times after a warm-up (each a new generation: an empty
KV cache, as the peer run's time to first token). Each part is timed around its call, exclusive of the parts inside
it, three ways: wall time, the process's CPU time (every thread: the kernels' pool helper and torch's OpenMP team
too) and the calling thread's CPU time. On a 2-core machine shared with other work the wall time says little; the CPU
times say where the work is and whether the second thread takes part (process − calling thread):

    attention            the attention modules' own steps (transformers' forward, or the prompt's steps in C)
      attention rows     their kernel calls: q/k/v (fused) and o_proj (kernels.linear_forward)
    norms                the decoder layers' RMSNorm modules (input and post-attention)
    router               the MoE blocks' router modules
    moe glue             the rest of the MoE block: the engine's routing, bookkeeping, gather, combine
      experts            the expert kernels (kernels.experts_forward: one call a layer)
    layer glue           the decoder layers' residual adds and the rest of their forward
    other                the model's embedding, rotary embedding, final norm, LM head, generate's loop

Printed: the median prefill's parts, and a model of a quiet machine's wall time at 2 threads (labelled as such): the
CPU outside the kernel calls (which one thread does, or torch's team with its wakes) plus half the kernels' CPU (the
pool splits them), median [min–max] over the repeats.

    python benchmarks/prefill_parts.py ~/.cache/fmoe-peer/models/big --experts int4 --prompt-file PROMPT
    OMP_NUM_THREADS=1 python benchmarks/prefill_parts.py demo --experts int8 --repeats 3 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import fmoe_cli  # noqa: F401  (before torch, as the CLI: it sets torch's OpenMP wait policy)

PARTS = ("attention", "attention rows", "norms", "router", "moe glue", "experts", "layer glue", "other")
KERNEL_PARTS = ("attention rows", "experts")  # the kernels' pool splits these over the threads


class Clock:
    """Exclusive wall, process-CPU and thread-CPU seconds per label (a label's time inside another's is its own)."""

    def __init__(self) -> None:
        self.spent: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
        self.open: list[str] = []

    def wrap(self, forward, label: str):
        def timed(*args, **kwargs):
            if self.open and self.open[-1] == label:  # (a part calling itself: one span)
                return forward(*args, **kwargs)
            start = (time.perf_counter(), time.process_time(), time.thread_time())
            self.open.append(label)
            try:
                return forward(*args, **kwargs)
            finally:
                self.open.pop()
                took = [now - then for now, then in zip((time.perf_counter(), time.process_time(), time.thread_time()),
                                                        start)]
                for i, seconds in enumerate(took):
                    self.spent[label][i] += seconds
                    if self.open:
                        self.spent[self.open[-1]][i] -= seconds

        return timed


def label_model(model, clock: Clock) -> None:
    from fmoe_cli import kernels

    for layer in model.model.layers:
        layer.self_attn.forward = clock.wrap(layer.self_attn.forward, "attention")
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.forward = clock.wrap(norm.forward, "norms")
        router = getattr(layer.mlp, "gate", None)
        if router is not None:
            router.forward = clock.wrap(router.forward, "router")
        layer.mlp.forward = clock.wrap(layer.mlp.forward, "moe glue")
        layer.forward = clock.wrap(layer.forward, "layer glue")
    for name in ("experts_forward", "segments_forward", "segment_forward"):
        setattr(kernels, name, clock.wrap(getattr(kernels, name), "experts"))
    linear = clock.wrap(kernels.linear_forward, "attention rows")
    plain = kernels.linear_forward
    kernels.linear_forward = lambda *a, **k: (linear if "attention" in clock.open else plain)(*a, **k)


def prefill_parts(args) -> dict:
    import torch

    from fmoe_cli.bench import PROMPT_LIMIT
    from fmoe_cli.bench.run import encode_prompt
    from fmoe_cli.files import read_text
    from fmoe_cli.cli import run_options
    from fmoe_cli.generate import stream_generate
    from fmoe_cli.run import open_run

    dense = {} if args.dense is None else {"dense": args.dense}
    opts = run_options(args.model, ["resident"], dtype=args.dtype, experts=args.experts, device="cpu",
                       activations=args.activations, **dense)
    clock = Clock()
    with open_run(opts) as run:
        lm, engine = run.lm, run.engine
        label_model(lm.model, clock)
        prompt = (read_text(Path(args.prompt_file), "prompt file", PROMPT_LIMIT) if args.prompt_file
                  else "Explain how a mixture-of-experts model works.")
        ids = encode_prompt(lm, prompt)
        for _ in stream_generate(lm.model, ids, engine=engine, max_new_tokens=2, stop_on_eos=False):
            pass
        rounds = []
        for _ in range(args.repeats):
            clock.spent.clear()
            start = (time.perf_counter(), time.process_time(), time.thread_time())
            for _ in stream_generate(lm.model, ids, engine=engine, max_new_tokens=1, stop_on_eos=False):
                pass
            total = [(now - then) * 1e3 for now, then in zip((time.perf_counter(), time.process_time(),
                                                              time.thread_time()), start)]
            parts = {part: [s * 1e3 for s in clock.spent.get(part, (0.0, 0.0, 0.0))] for part in PARTS[:-1]}
            parts["other"] = [t - sum(p[i] for p in parts.values()) for i, t in enumerate(total)]
            kernels_cpu = sum(parts[p][1] for p in KERNEL_PARTS)
            rounds.append({"wall_ms": total[0], "cpu_ms": total[1], "thread_cpu_ms": total[2], "parts": parts,
                           "glue_cpu_ms": total[1] - kernels_cpu, "kernels_cpu_ms": kernels_cpu,
                           "quiet_model_ms": total[1] - kernels_cpu + kernels_cpu / 2})
        return {"model": args.model, "dtype": str(lm.dtype).removeprefix("torch."), "experts": args.experts,
                "dense": lm.dense, "activations": lm.activations, "threads": torch.get_num_threads(),
                "prompt_tokens": int(ids.shape[-1]), "rounds": rounds}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}–{max(values):.1f}]"


def render(report: dict) -> str:
    rounds = sorted(report["rounds"], key=lambda r: r["cpu_ms"])
    middle = rounds[len(rounds) // 2]
    lines = [f"{report['model']}: --dtype {report['dtype']} --experts {report['experts']} --dense {report['dense']} "
             f"--activations {report['activations']}, {report['threads']} threads, a {report['prompt_tokens']}-token "
             f"prompt, {len(rounds)} prefills", "",
             "| part (the median prefill by CPU) | wall ms | CPU ms, every thread | calling thread | other threads |",
             "|---|---:|---:|---:|---:|"]
    for part in PARTS:
        wall, cpu, own = middle["parts"][part]
        lines.append(f"| {part} | {wall:.1f} | {cpu:.1f} | {own:.1f} | {cpu - own:.1f} |")
    lines.append(f"| all | {middle['wall_ms']:.1f} | {middle['cpu_ms']:.1f} | {middle['thread_cpu_ms']:.1f} | "
                 f"{middle['cpu_ms'] - middle['thread_cpu_ms']:.1f} |")
    lines += ["", "median [min–max] over the prefills: wall " + spread([r["wall_ms"] for r in rounds]) + " ms; CPU outside "
              "the kernel calls " + spread([r["glue_cpu_ms"] for r in rounds]) + " ms, in them "
              + spread([r["kernels_cpu_ms"] for r in rounds]) + " ms; a quiet machine's wall at 2 threads, modelled "
              "(outside + in ÷ 2) " + spread([r["quiet_model_ms"] for r in rounds]) + " ms"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--experts", default="int4")
    parser.add_argument("--dense", default=None, help="as fmoe's --dense (default: fmoe's)")
    parser.add_argument("--activations", default="auto", help="as fmoe's --activations (default: fmoe's)")
    parser.add_argument("--prompt-file", default=None)
    parser.add_argument("--repeats", type=int, default=7, help="prefills measured (default 7)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.repeats < 1:
        print("error: --repeats from 1", file=sys.stderr)
        return 2
    if args.prompt_file and not Path(args.prompt_file).is_file():
        print(f"error: --prompt-file {args.prompt_file}: no such file", file=sys.stderr)
        return 2
    report = prefill_parts(args)
    print(json.dumps(report) if args.json else render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
