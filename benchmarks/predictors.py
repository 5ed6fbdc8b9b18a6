#!/usr/bin/env python3
"""Predictor benchmark (issue 5): every predictor side by side, in one run.

For each predictor (speculative, expert-map, eam, mol, auto), on the same model,
budget and emulated link:

1. history: generate `--warmup` tokens for each of the history prompts (the
   predictors that remember — expert maps, EAMs, auto's accuracy — learn here);
   then the engine is configured again (a re-plan: `auto` chooses per layer);
2. measured: generate `--tokens` tokens for each of the measured prompts.

Measured prompts are different from the history prompts by default ("unseen");
`--seen` measures on the history prompts again (the repeated-request case that
expert maps and EAMs are built for).

Printed: per-layer precision / recall of the predictions the prefetcher got
(decode steps; the predicted set is the prediction's `count` best experts, K
when it gives none — see fmoe_cli/prediction/score.py), and TPOT (median decode
step over all measured prompts) on the emulated link at equal budget, with the
engine's own prefetch precision / recall and hit rate, and TPOT ÷ speculative.
Every predictor runs `--repeats` times, round-robin; TPOT is the median over all
decode steps of its runs.

    python benchmarks/predictors.py                 # the demo model (trained if shipped, else random)
    python benchmarks/predictors.py --model /tmp/fmoe-bench-engine --seen
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from engine import expert_compute_s  # noqa: E402  (benchmarks/engine.py: T_exp)

from fmoe_cli.bench.run import encode_prompt  # noqa: E402
from fmoe_cli.generate import stream_generate  # noqa: E402
from fmoe_cli.models.load import load_model  # noqa: E402
from fmoe_cli.offload.engine import Counters, Engine  # noqa: E402
from fmoe_cli.offload.link import EmulatedLink  # noqa: E402
from fmoe_cli.planning.presets import PRESETS, make_settings  # noqa: E402
from fmoe_cli.run import find_timings  # noqa: E402
from fmoe_cli.planning.plan import parse_budget  # noqa: E402
from fmoe_cli.prediction import PREDICTORS  # noqa: E402
from fmoe_cli.prediction.base import BasePredictor  # noqa: E402
from fmoe_cli.prediction.make import make_predictor  # noqa: E402
from fmoe_cli.prediction.score import Scoreboard  # noqa: E402

HISTORY = [
    "Explain how a mixture of experts decides which experts to use for each token.",
    "Write a short story about a fox who learns to read.",
    "What is the capital of France, and why is it famous?",
    "List three ways to keep a cache small but useful.",
]
MEASURED = [
    "Explain in a few sentences why experts are offloaded to host memory.",
    "Write a short poem about a dog who waits for the train.",
    "What is the largest city of Italy, and what is it known for?",
    "Give two tips for making a program run faster.",
]


class Scored(BasePredictor):
    """Passes a predictor through and scores what it hands the prefetcher."""

    def __init__(self, inner, num_layers: int, top_k: int) -> None:
        self.inner = inner
        self.name = inner.name
        self.board = Scoreboard(num_layers, top_k)

    def begin(self, it):
        out = self.inner.begin(it)
        self.board.record(out)
        return out

    def after_layer(self, it, layer):
        self.board.score(it, layer)
        out = self.inner.after_layer(it, layer)
        self.board.record(out)
        return out

    def replan(self):
        self.inner.replan()

    def close(self):
        self.inner.close()


def run(lm, name: str, gbps: float, budget: int, history, measured, warmup: int, tokens: int, policy: str,
        timings=None):
    shape = lm.shape
    scored = Scored(make_predictor(name, lm.layers, shape.num_experts, shape.top_k), shape.num_layers, shape.top_k)
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(gbps), lm.device, lm.dtype, predictor=scored)
    engine.install(lm.model)
    settings = make_settings(policy, shape, budget, timings=timings)
    try:
        engine.configure(settings)
        for ids in history:
            for _ in stream_generate(lm.model, ids, engine=engine, max_new_tokens=warmup, stop_on_eos=False):
                pass
        engine.configure(settings)  # a re-plan: caches rebuilt empty, `auto` chooses per layer
        scored.board = Scoreboard(shape.num_layers, shape.top_k)  # score the measured part only
        tpot, steady, token_ids = [], Counters(), []
        for ids in measured:
            events = list(stream_generate(lm.model, ids, engine=engine, max_new_tokens=tokens, stop_on_eos=False))
            tpot += [e.latency_s * 1000 for e in events[1:]]
            steady = sum((e.counters for e in events[1:]), steady)
            token_ids.append([e.token_id for e in events])
        chosen = scored.inner.chosen() if name == "auto" else None
    finally:
        engine.close()
    return {"board": scored.board, "tpot": tpot, "counters": steady, "tokens": token_ids, "chosen": chosen}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="model id or directory (default: the demo model)")
    p.add_argument("--tokens", type=int, default=32, help="measured tokens per prompt")
    p.add_argument("--warmup", type=int, default=32, help="history tokens per prompt")
    p.add_argument("--budget", default="25%")
    p.add_argument("--policy", default="moepic", help="engine policy (same for every predictor)")
    p.add_argument("--load-ratio", type=float, default=3.0, help="expert load time / expert compute time")
    p.add_argument("--seen", action="store_true", help="measure on the history prompts again")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs per predictor, round-robin (TPOT: median over all their decode steps)")
    args = p.parse_args()
    torch.set_num_threads(1)
    console = Console()

    lm = load_model(args.model, device="cpu", dtype="float32", console=console)
    shape = lm.shape
    history = [encode_prompt(lm, text) for text in HISTORY]
    measured = history if args.seen else [encode_prompt(lm, text) for text in MEASURED]
    t_exp = expert_compute_s(lm)
    gbps = shape.expert_bytes / (args.load_ratio * t_exp) / 1e9
    budget = parse_budget(args.budget, shape.all_experts_bytes)
    # A configured policy (moepic) plans from timings found before any engine is configured, as `fmoe bench`.
    timings = find_timings(lm, EmulatedLink(gbps)) if PRESETS[args.policy].configured else None
    console.print(f"{lm.label}: {shape.num_layers} MoE layers × {shape.num_experts} experts, top-{shape.top_k}; "
                  f"policy {args.policy}, budget {args.budget} = {budget / 2**20:.2f} MiB; link: emulated "
                  f"{gbps:.3g} GB/s (expert load = {args.load_ratio:g} × T_exp, T_exp = {t_exp * 1e3:.3f} ms); "
                  f"{len(history)} history prompts × {args.warmup} tokens, then "
                  f"{len(measured)} {'seen' if args.seen else 'unseen'} prompts × {args.tokens} tokens")

    results: dict[str, dict] = {}
    for repeat in range(args.repeats):  # round-robin, so that drift in the machine's load hits every predictor
        for name in PREDICTORS:
            with console.status(f"{name} (run {repeat + 1} of {args.repeats}) …"):
                r = run(lm, name, gbps, budget, history, measured, args.warmup, args.tokens, args.policy, timings)
            if name not in results:
                results[name] = r  # precision / recall, counters, tokens: from the first run
            else:
                results[name]["tpot"] += r["tpot"]
                assert r["tokens"] == results[name]["tokens"]
    for r in results.values():
        r["tpot"] = statistics.median(r["tpot"])

    layers = Table(title="precision / recall of the predictions per MoE layer (decode steps)")
    layers.add_column("layer", justify="right")
    for name in results:
        layers.add_column(name, justify="right")
    boards = {name: (r["board"].precision(), r["board"].recall()) for name, r in results.items()}
    for i in range(shape.num_layers):
        layers.add_row(str(i), *[f"{prec[i]:.2f} / {rec[i]:.2f}" for prec, rec in boards.values()])
    layers.add_row("mean", *[f"{prec.mean():.2f} / {rec.mean():.2f}" for prec, rec in boards.values()])
    console.print(layers)

    base = results["speculative"]["tpot"]
    speed = Table(title=f"TPOT at equal budget ({args.policy}, link: emulated {gbps:.3g} GB/s)")
    for col in ("predictor", "TPOT ms", "÷ speculative", "hit", "prefetch P / R", "MiB/tok"):
        speed.add_column(col, justify="left" if col == "predictor" else "right")
    for name, r in results.items():
        c = r["counters"]
        n = max(1, sum(len(t) - 1 for t in r["tokens"]))
        speed.add_row(name, f"{r['tpot']:.2f}", f"{r['tpot'] / base:.2f}", f"{c.hit_rate:.2f}",
                      f"{c.prefetch_precision:.2f} / {c.prefetch_recall:.2f}", f"{c.bytes_moved / n / 2**20:.2f}")
    console.print(speed)
    if results["auto"]["chosen"]:
        console.print("auto chose per layer: " + ", ".join(results["auto"]["chosen"]))
    same = len({str(r["tokens"]) for r in results.values()}) == 1
    console.print("token ids identical across predictors" if same else "[red]token ids DIFFER across predictors[/red]")


if __name__ == "__main__":
    main()
