#!/usr/bin/env python3
"""Quality and compute cost of quantised experts (issue 11).

1. Quality, on the shipped demo model (its held-out KJV chapters, as benchmarks/routing_report.py;
   needs Debian's bible-kjv-text: `apt-get install bible-kjv-text`): perplexity with bf16 (unquantised),
   int8 and int4 experts, and per MoE layer how often the top-K routing agrees with the unquantised
   model's (|A_q ∩ A| / K, and the share of tokens whose whole top-K set is the same). The quantised
   models are transformers' own model with its experts replaced by the dequantised weights — by the
   exactness contract (tests/test_quant.py), exactly what the engine computes.
1b. `--dense int8 / int4` on the demo model: perplexity, the largest logit error and top-1 agreement
   against the unquantised model on the same held-out tokens (the tolerance tests/test_dense.py checks).
3. `--dense`: one projection (4096 × 2048, Qwen3-30B-A3B's q_proj) for one token, float32 against QuantLinear.
2. Compute: one expert for one token (decode) from the stored rows — dequantise then the three matmuls
   (what fmoe does) against the unquantised matmuls and against torch's fused int8 kernel
   (`_weight_int8pack_mm`, per-output-channel scales: a lower bound, it does not fit the grouped,
   split layout). Median [min–max] of interleaved rounds, CPU, one thread.

    python benchmarks/quantization.py
    python benchmarks/quantization.py --tokens 20000 --rounds 5 --hidden 4096 --intermediate 1024
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

FORMATS = ["bf16", "int8", "int4"]


def spread(values, fmt="{:.3f}"):
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}–{fmt.format(max(values))}]"


@torch.no_grad()
def evaluate(model, ids: torch.Tensor, seq_len: int) -> tuple[float, list[torch.Tensor]]:
    """(perplexity, per MoE layer the top-K expert ids of every token)."""
    from fmoe_cli.models.families import find_moe_layers

    layers = find_moe_layers(model)
    k = model.config.num_experts_per_tok
    chosen: dict[int, list[torch.Tensor]] = {layer.index: [] for layer in layers}
    hooks = [layer.router.register_forward_hook(
        lambda mod, args, out, i=layer.index: chosen[i].append(
            torch.topk(args[0].reshape(-1, args[0].shape[-1]).float() @ mod.weight.float().T, k, dim=-1).indices))
        for layer in layers]
    nll, count = 0.0, 0
    for s in range(0, len(ids) - 1, seq_len):
        chunk = ids[s: s + seq_len + 1]
        if len(chunk) < 2:
            break
        logits = model(input_ids=chunk[None, :-1]).logits[0].float()
        nll += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
        count += len(chunk) - 1
    for h in hooks:
        h.remove()
    return math.exp(nll / count), [torch.cat(chosen[i]) for i in sorted(chosen)]


def quality(console, tokens: int, seq_len: int) -> None:
    import transformers
    from rich.table import Table

    from fmoe_cli.models.demo import SHIPPED
    from fmoe_cli.models.families import find_moe_layers
    from fmoe_cli.models.load import load_model
    from fmoe_cli.offload.layout import DOWN, GATE, UP
    from routing_report import held_out_text

    text, label = held_out_text(SHIPPED)
    tok = transformers.AutoTokenizer.from_pretrained(SHIPPED)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0][: tokens + 1]
    model = transformers.AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32).eval()
    original = {layer.index: (layer.experts.gate_up_proj.clone(), layer.experts.down_proj.clone())
                for layer in find_moe_layers(model)}
    results = {}
    for fmt in FORMATS:
        if fmt != "bf16":
            lm = load_model("demo", device="cpu", dtype="float32", experts=fmt, console=console)
            for layer in find_moe_layers(model):
                w = lm.store.dequantized(layer.index)
                layer.experts.gate_up_proj.data.copy_(torch.cat([w[:, :, GATE], w[:, :, UP]], dim=1))
                layer.experts.down_proj.data.copy_(w[:, :, DOWN].transpose(1, 2))
        else:
            for layer in find_moe_layers(model):
                layer.experts.gate_up_proj.data.copy_(original[layer.index][0])
                layer.experts.down_proj.data.copy_(original[layer.index][1])
        with console.status(f"evaluating {fmt} experts on {len(ids) - 1} tokens …"):
            results[fmt] = evaluate(model, ids, seq_len)
    k = model.config.num_experts_per_tok
    table = Table(title=f"1. demo model, {len(ids) - 1} tokens of {label} (seq {seq_len}; the demo's weights are "
                        "float32: 'bf16' = unquantised)")
    for col in ("experts", "perplexity", "Δ vs unquantised", "top-K overlap per layer (mean)", "same top-K set"):
        table.add_column(col, justify="right" if col != "experts" else "left")
    base_ppl, base_sets = results["bf16"]
    for fmt, (ppl, sets) in results.items():
        overlaps, same = [], []
        for a, b in zip(sets, base_sets):
            hit = (a[:, :, None] == b[:, None, :]).any(-1).sum(-1).float()
            overlaps.append((hit / k).mean().item())
            same.append((hit == k).float().mean().item())
        table.add_row(fmt, f"{ppl:.3f}", f"{100 * (ppl / base_ppl - 1):+.2f} %",
                      " ".join(f"{o:.3f}" for o in overlaps) + f" ({statistics.mean(overlaps):.3f})",
                      f"{statistics.mean(same):.3f}")
    console.print(table)


@torch.no_grad()
def dense_quality(console, tokens: int, seq_len: int) -> None:
    """--dense int8 / int4 on the demo model (experts unquantised, and int4 dense beside int2 experts): the
    reference model (transformers' own, with the dequantised weights: what the engine computes, tests/test_dense.py)
    against the unquantised one, on the same held-out tokens: perplexity, max |Δ logit|, top-1 agreement."""
    import transformers
    from rich.table import Table

    from fmoe_cli.models.demo import SHIPPED, write_untied_demo
    from fmoe_cli.models.dense import dense_reference
    from fmoe_cli.models.families import find_moe_layers
    from fmoe_cli.models.load import load_model
    from fmoe_cli.offload.layout import DOWN, GATE, UP
    from routing_report import held_out_text

    text, label = held_out_text(SHIPPED)
    tok = transformers.AutoTokenizer.from_pretrained(SHIPPED)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0][: tokens + 1]
    chunks = [ids[s: s + seq_len + 1] for s in range(0, len(ids) - 1, seq_len)]
    chunks = [c for c in chunks if len(c) >= 2]

    def logits_of(model):
        return [model(input_ids=c[None, :-1]).logits[0].float() for c in chunks]

    base_model = transformers.AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32).eval()
    base = logits_of(base_model)
    table = Table(title=f"1b. --dense on the demo model, {len(ids) - 1} tokens of {label} (seq {seq_len}; the demo's "
                        "head is tied to the embedding: attention only; `head int8`: the demo with its head untied, "
                        "a copy of the embedding, quantised too)")
    for col in ("dense", "experts", "perplexity", "Δ vs unquantised", "max |Δ logit|", "top-1 agreement"):
        table.add_column(col, justify="left" if col in ("dense", "experts") else "right")

    def perplexity(logits):
        nll = sum(torch.nn.functional.cross_entropy(lg, c[1:], reduction="sum").item() for lg, c in zip(logits, chunks))
        return math.exp(nll / sum(len(c) - 1 for c in chunks))

    base_ppl = perplexity(base)
    table.add_row("bf16", "bf16", f"{base_ppl:.3f}", "", "", "")
    untied = write_untied_demo(Path(tempfile.mkdtemp(prefix="fmoe-untied-demo-")))  # the same logits, its own head
    for dense, experts, head in (("int8", "bf16", "tied"), ("int4", "bf16", "tied"), ("int4", "int2", "tied"),
                                 ("int8", "bf16", "untied"), ("int4", "bf16", "untied")):
        path = SHIPPED if head == "tied" else untied
        lm = load_model(str(path), device="cpu", dtype="float32", experts=experts, dense=dense, console=console)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        dense_reference(model, lm.model)
        if experts != "bf16":
            for layer in find_moe_layers(model):
                w = lm.store.dequantized(layer.index)
                layer.experts.gate_up_proj.data.copy_(torch.cat([w[:, :, GATE], w[:, :, UP]], dim=1))
                layer.experts.down_proj.data.copy_(w[:, :, DOWN].transpose(1, 2))
        with console.status(f"evaluating dense {dense}, experts {experts} …"):
            got = logits_of(model)
        ppl = perplexity(got)
        err = max((a - b).abs().max().item() for a, b in zip(got, base))
        top1 = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(got, base)) / sum(len(b) for b in base)
        table.add_row(dense + (" (head int8)" if head == "untied" else ""), experts, f"{ppl:.3f}", f"{100 * (ppl / base_ppl - 1):+.2f} %", f"{err:.3f}", f"{top1:.4f}")
    console.print(table)


def interleaved_ms(cases: dict, rounds: int, repeats: int) -> dict[str, list[float]]:
    """ms per call of each case, one figure per round: each round runs every case (a warm-up call, then
    `repeats` timed calls) before the next round."""
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, run in cases.items():
            run()
            start = time.perf_counter()
            for _ in range(repeats):
                run()
            times[name].append((time.perf_counter() - start) / repeats * 1e3)
    return times


def ratio_table(title: str, times: dict[str, list[float]], base: str, ratio_label: str):
    """Each case's ms and its ratio to `base`'s in the same round, median [min–max]."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("computation", "ms", ratio_label):
        table.add_column(col, justify="right" if col != "computation" else "left")
    for name, ts in times.items():
        table.add_row(name, spread(ts), spread([t / b for t, b in zip(ts, times[base])], "{:.2f}"))
    return table


def compute_cost(console, hidden: int, intermediate: int, rounds: int, repeats: int) -> None:
    from fmoe_cli.offload.layout import segment_forward
    from fmoe_cli.offload.quant import dequantize, quantize
    from fmoe_cli.types import EXPERT_FORMATS

    torch.manual_seed(0)
    block = torch.randn(intermediate, 3, hidden) * 0.02
    act = torch.nn.functional.silu
    x32 = torch.randn(1, hidden)
    workspace = torch.empty(intermediate * 3 * hidden)
    stored = {f: quantize(block, EXPERT_FORMATS[f]) for f in ("int8", "int4")}
    w8 = torch.randint(-127, 127, (intermediate, hidden), dtype=torch.int8)
    w8_down = torch.randint(-127, 127, (hidden, intermediate), dtype=torch.int8)
    s8, s8_down = torch.rand(intermediate) * 1e-3, torch.ones(hidden)

    def fused_int8(x):  # gate and up: per-neuron scales; down: the neuron scale folded into the activation
        gate = torch._weight_int8pack_mm(x, w8, s8)
        up = torch._weight_int8pack_mm(x, w8, s8)
        return torch._weight_int8pack_mm(act(gate) * up * s8, w8_down, s8_down)

    cases = {
        "unquantised float32": lambda: segment_forward(x32, block, act),
        "int8: dequantise + matmuls (fmoe)": lambda: segment_forward(
            x32, dequantize(stored["int8"], EXPERT_FORMATS["int8"], hidden, torch.float32, workspace), act),
        "int4: dequantise + matmuls (fmoe)": lambda: segment_forward(
            x32, dequantize(stored["int4"], EXPERT_FORMATS["int4"], hidden, torch.float32, workspace), act),
        "int8: torch fused _weight_int8pack_mm (per-channel)": lambda: fused_int8(x32),
    }
    times = interleaved_ms(cases, rounds, repeats)
    console.print(ratio_table(f"2. one expert, one token, H={hidden}, I={intermediate}, CPU 1 thread: ms, median "
                              f"\\[min–max] of {rounds} interleaved rounds × {repeats}", times, "unquantised float32",
                              "÷ unquantised"))


def dense_cost(console, out_features: int, in_features: int, rounds: int, repeats: int) -> None:
    """--dense: one decode token through one projection [out, in], float32 against QuantLinear int8 / int4."""
    from fmoe_cli.models.dense import QuantLinear
    from fmoe_cli.types import DENSE_FORMATS

    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    cases = {"float32 matmul": linear, **{f"{name}: QuantLinear (the CPU kernels; torch without them)": QuantLinear(
        linear, DENSE_FORMATS[name].quant) for name in ("int8", "int4")}}
    x = torch.randn(1, in_features)
    with torch.inference_mode():
        times = interleaved_ms({name: (lambda module=module: module(x)) for name, module in cases.items()}, rounds,
                               repeats)
    console.print(ratio_table(f"3. --dense: one projection {out_features} × {in_features}, one token, CPU "
                              f"{torch.get_num_threads()} thread(s): ms, median \\[min–max] of {rounds} interleaved "
                              f"rounds × {repeats}", times, "float32 matmul", "÷ float32"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=20000, help="held-out tokens evaluated")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=1024, help="neurons of the timed expert (Mixtral: 14336)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--skip-quality", action="store_true")
    args = p.parse_args()
    import os

    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="fmoe-bench-quant-")  # converted stores: not the user's
    from rich.console import Console

    torch.set_num_threads(1)
    console = Console(width=150)
    console.print("command: python benchmarks/quantization.py " + " ".join(sys.argv[1:]), highlight=False)
    if not args.skip_quality:
        quality(console, args.tokens, args.seq_len)
        dense_quality(console, args.tokens, args.seq_len)
    compute_cost(console, args.hidden, args.intermediate, args.rounds, args.repeats)
    dense_cost(console, 4096, 2048, args.rounds, args.repeats)


if __name__ == "__main__":
    main()
