#!/usr/bin/env python3
"""Engine benchmark (issue 2): measured side by side in one run, printed as ratios.

1. `resident` through the engine vs plain transformers on the same checkpoint
   (TPOT ratio; target <= 1.10): the cost of the ExpertsInterface hook itself.
2. An emulated link whose bandwidth makes loading one expert take `--load-ratio`
   (default 3, MoEpic's measured ratio) times computing one expert for one token, at
   an expert budget of 25 % of all experts: TPOT of every policy as a ratio to `lru`.

The checkpoint is a mid-size random Mixtral (8 layers, 32 experts, top-4, hidden
1024, expert intermediate 512) built once into --dir. Random weights route with
little locality; the demo model (`--model demo`) has learned routing.

    python benchmarks/engine.py                # builds /tmp/fmoe-bench-engine on first run
    python benchmarks/engine.py --model demo --tokens 48
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from fmoe_cli.bench.run import bench_policy, encode_prompt
from fmoe_cli.generate import stream_generate
from fmoe_cli.models.demo import build_random_moe
from fmoe_cli.models.load import load_model
from fmoe_cli.offload.engine import Engine
from fmoe_cli.offload.layout import segment_forward
from fmoe_cli.offload.link import EmulatedLink
from fmoe_cli.planning.plan import parse_budget
from fmoe_cli.planning.presets import PlanInputs, make_settings, settings_for
from fmoe_cli.planning.replan import Replanner
from fmoe_cli.planning.stats import StatsRecorder, default_stats_path, load_or_empty
from fmoe_cli.run import find_timings

POLICIES = ["lru", "moepic", "uniform", "lfu", "cache-only", "prefetch-only", "ondemand", "resident"]
PROMPT = "Explain how a mixture of experts decides which experts to use for each token."


def mid_size_checkpoint(path: Path) -> Path:
    if not (path / "config.json").exists():
        build_random_moe(path, "mixtral", seed=0, hidden_size=1024, intermediate_size=512, num_hidden_layers=8,
                         num_local_experts=32, num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=2)
    return path


def decode_tpot_ms(model, prompt_ids: torch.Tensor, tokens: int, engine: Engine | None = None) -> float:
    """Median decode-step time of `model` (through `engine` if given), the loop every command uses."""
    events = list(stream_generate(model, prompt_ids, engine=engine, max_new_tokens=tokens, stop_on_eos=False))
    return statistics.median(e.latency_s for e in events[1:]) * 1000


def expert_compute_s(lm, repeats: int = 200) -> float:
    """T_exp: one expert's forward for one token (decode), from the engine's packed layout."""
    packed = lm.store.expert(0, 0).to(lm.device)
    x = torch.randn(1, lm.shape.hidden, dtype=lm.dtype, device=lm.device)
    act = torch.nn.functional.silu
    for _ in range(10):
        segment_forward(x, packed, act)
    start = time.perf_counter()
    for _ in range(repeats):
        segment_forward(x, packed, act)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a model id or directory instead of the mid-size random checkpoint")
    p.add_argument("--dir", default="/tmp/fmoe-bench-engine", help="where the random checkpoint is built")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--budget", default="25%")
    p.add_argument("--load-ratio", type=float, default=3.0, help="expert load time / expert compute time")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the median is reported")
    args = p.parse_args()
    torch.set_num_threads(1)
    console = Console()

    path = str(mid_size_checkpoint(Path(args.dir))) if args.model is None else args.model
    lm = load_model(path, device="cpu", dtype="float32", console=console)
    prompt_ids = encode_prompt(lm, PROMPT)
    shape = lm.shape
    console.print(f"{lm.label}: {shape.num_layers} MoE layers × {shape.num_experts} experts, top-{shape.top_k}, "
                  f"hidden {shape.hidden}, expert {shape.expert_bytes / 2**20:.2f} MiB")

    # 1. resident through the engine vs plain transformers, interleaved `repeats` times.
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(lm.path, dtype=torch.float32).eval()
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(None), lm.device, lm.dtype)
    engine.install(lm.model)
    engine.configure(make_settings("resident", shape, 0))
    hf, ours = [], []
    for _ in range(args.repeats):
        hf.append(decode_tpot_ms(plain, prompt_ids, args.tokens))
        ours.append(decode_tpot_ms(lm.model, prompt_ids, args.tokens, engine))
    engine.close()
    del plain
    hf_tpot, resident_tpot = statistics.median(hf), statistics.median(ours)
    t1 = Table(title=f"1. resident engine vs plain transformers (TPOT ms, median of {args.repeats} interleaved runs)")
    for col in ("run", "TPOT ms", "ratio"):
        t1.add_column(col, justify="right" if col != "run" else "left")
    t1.add_row("transformers", f"{hf_tpot:.2f}", "1.00")
    t1.add_row("fmoe resident", f"{resident_tpot:.2f}", f"{resident_tpot / hf_tpot:.2f}")
    console.print(t1)

    # 2. every policy on an emulated link at load/compute = load_ratio, policies interleaved.
    t_exp = expert_compute_s(lm)
    gbps = shape.expert_bytes / (args.load_ratio * t_exp) / 1e9
    budget = parse_budget(args.budget, shape.all_experts_bytes)
    link = EmulatedLink(gbps)
    # As `fmoe bench` does (fmoe_cli/run.py): the configurator's timings found before the engine is
    # configured, routing statistics recorded under every policy, `moepic` planned from them when its
    # turn comes and re-planned between runs, when the device is idle.
    timings = find_timings(lm, link)
    engine = Engine(lm.layers, lm.store, shape, link, lm.device, lm.dtype)
    engine.install(lm.model)
    stats_path = default_stats_path(lm.model_id)
    stats = load_or_empty(lm.model_id, shape.num_layers, shape.num_experts, shape.top_k, stats_path)
    planner = Replanner(engine, PlanInputs(shape, budget, timings, model=lm.model_id), StatsRecorder(stats, stats_path))
    runs: dict[str, list] = {name: [] for name in POLICIES}
    for r in range(args.repeats):
        for name in POLICIES:
            settings = settings_for(name, planner.plan_inputs())
            with console.status(f"round {r + 1}/{args.repeats}: {name} …"):
                runs[name].append(bench_policy(lm, engine, settings, prompt_ids, args.tokens, args.warmup))
            planner()
    planner.close()
    engine.close()
    console.print(f"moepic plan: {runs['moepic'][-1].plan}")

    def tpot(name: str) -> float:
        return statistics.median(r.tpot_ms["median"] for r in runs[name])

    base = tpot("lru")
    t2 = Table(title=f"2. {link.label()} (expert load {args.load_ratio:g}× T_exp = {args.load_ratio * t_exp * 1e3:.3f} ms), "
                     f"budget {args.budget} = {budget / 2**20:.0f} MiB, median of {args.repeats} rounds")
    for col in ("policy", "TPOT ms", "÷ lru", "hit", "exp ms/tok", "MiB/tok"):
        t2.add_column(col, justify="right" if col != "policy" else "left")
    for name, rs in runs.items():
        exposed = statistics.median(r.exposed_load_ms_per_token for r in rs)
        t2.add_row(name, f"{tpot(name):.2f}", f"{tpot(name) / base:.2f}", f"{rs[-1].hit_rate:.2f}",
                   f"{exposed:.2f}", f"{rs[-1].bytes_per_token / 2**20:.1f}")
    console.print(t2)
    same = len({tuple(r.token_ids) for rs in runs.values() for r in rs}) == 1
    console.print("token ids identical across policies" if same else "[red]token ids DIFFER[/red]")


if __name__ == "__main__":
    main()
