"""The configurator's gain: TPOT of `moepic` (configured plan) vs `uniform` (V_e/L, θ = 0.5)
at equal budget, on a model whose layers differ, over an emulated link where loading
one expert takes about 3× computing it. Also MoEpic's predicted exposed load time per
layer (Eq. 6) next to the measured one.

The model: a random DeepSeek-V3-style checkpoint (sigmoid router with a selection
bias). Early MoE layers have no bias (routing spreads over all experts, as MoEpic
observes in early layers); later layers get an ever stronger bias towards a few
experts (peaked routing), so the same budget buys very different hit rates per layer.

Both policies run on one engine in one process, interleaved (uniform, moepic, uniform,
moepic, …) so that machine noise hits both alike; the ratio is of medians.

    python benchmarks/configurator.py [--tokens 48] [--rounds 3] [--budget 25%]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from fmoe_cli.generate import stream_generate
from fmoe_cli.models.demo import build_random_moe
from fmoe_cli.models.load import load_model
from fmoe_cli.offload.engine import Counters, Engine
from fmoe_cli.offload.link import EmulatedLink
from fmoe_cli.planning.presets import make_settings
from fmoe_cli.planning.autoplan import moepic_configuration
from fmoe_cli.run import link_fit_of, measure_timings
from fmoe_cli.planning.plan import parse_budget
from fmoe_cli.planning.stats import RoutingStats, StatsRecorder
from fmoe_cli.profiling.files import LinkFit

MiB = 1024**2
LOAD_OVER_COMPUTE = 3.0  # T_load ≈ 3 · T_exp


def build_layered_model(path: Path, moe_layers: int = 6, experts: int = 16) -> Path:
    """Random DeepSeek-V3-style MoE; MoE layer j of L gets selection bias b_e = s_j · 0.6^e, s_j = 0.3·(j/(L-1))²."""
    from transformers import AutoModelForCausalLM

    build_random_moe(path, family="deepseek_v3", seed=0, hidden_size=384, moe_intermediate_size=768,
                     intermediate_size=768, n_routed_experts=experts, num_experts_per_tok=2, n_group=1,
                     topk_group=1, num_hidden_layers=moe_layers + 1, first_k_dense_replace=1, n_shared_experts=1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gates = [m.gate for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    with torch.no_grad():
        for j, gate in enumerate(gates):
            gate.weight.normal_(0.0, 0.01)
            peak = 0.3 * (j / max(1, len(gates) - 1)) ** 2
            gate.e_score_correction_bias.copy_(peak * 0.6 ** torch.arange(experts, dtype=torch.float32))
    model.save_pretrained(path)
    return path


def run(engine: Engine, lm, settings, prompt: torch.Tensor, tokens: int, warmup: int):
    """Configure, warm up, generate `tokens`; per-layer counters over the decode steps only."""
    engine.configure(settings)
    for _ in stream_generate(lm.model, prompt, engine=engine, max_new_tokens=warmup, stop_on_eos=False):
        pass
    tpot, ids, start = [], [], None
    for event in stream_generate(lm.model, prompt, engine=engine, max_new_tokens=tokens, stop_on_eos=False):
        ids.append(event.token_id)
        if event.index == 0:
            start = [s.counters + Counters() for s in engine.layers]  # after the prefill + first token
        else:
            tpot.append(event.latency_s)
    per_layer = [s.counters - c for s, c in zip(engine.layers, start)]
    return tpot, per_layer, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--learn", type=int, default=96, help="tokens generated to learn the routing statistics")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", default="25%", help="expert budget (staging pool + caches), as for fmoe bench")
    args = parser.parse_args()
    torch.set_num_threads(1)
    console = Console(width=150)

    path = build_layered_model(Path(tempfile.mkdtemp()) / "layered-deepseek")
    lm = load_model(str(path), device="cpu", dtype="float32", console=Console(stderr=True, quiet=True))
    shape = lm.shape
    budget = parse_budget(args.budget, shape.all_experts_bytes)
    prompt = torch.tensor([list(range(5, 37))])

    # T_exp on this machine, then a link that makes T_load ≈ 3 · T_exp
    measured = measure_timings(lm)  # per-layer times, on a temporary engine of their own
    t_exp = measured.timings(LinkFit("emulated", 1e9, 0.0), shape.expert_bytes).t_exp  # mean over MoE layers
    gbps = shape.expert_bytes / (LOAD_OVER_COMPUTE * t_exp) / 1e9
    link = EmulatedLink(gbps, latency_s=0.0)
    engine = Engine(lm.layers, lm.store, shape, link, lm.device, lm.dtype)
    engine.install(lm.model)
    timings = measured.timings(link_fit_of(link, lm.device), shape.expert_bytes)

    # learn the routing (any policy: the recorder ranks by LCP priority), then configure
    recorder = StatsRecorder(RoutingStats.empty(str(path), shape.num_layers, shape.num_experts, shape.top_k))
    engine.observers.append(recorder)
    engine.configure(make_settings("uniform", shape, budget))
    learn_prompt = torch.tensor([list(range(40, 72))])
    for _ in stream_generate(lm.model, learn_prompt, engine=engine, max_new_tokens=args.learn, stop_on_eos=False):
        pass
    engine.observers.remove(recorder)
    config = moepic_configuration(shape, budget, timings, recorder.stats)
    settings = {
        "uniform": make_settings("uniform", shape, budget),
        "moepic": make_settings("moepic", shape, budget, plan=config.plan),
    }

    tpots: dict[str, list[float]] = {name: [] for name in settings}
    layers: dict[str, list[Counters]] = {name: [Counters() for _ in range(shape.num_layers)] for name in settings}
    steps = {name: 0 for name in settings}
    ids = {}
    for _ in range(args.rounds):
        for name, s in settings.items():
            tpot, per_layer, got = run(engine, lm, s, prompt, args.tokens, args.warmup)
            tpots[name] += tpot
            layers[name] = [a + b for a, b in zip(layers[name], per_layer)]
            steps[name] += len(tpot)
            ids.setdefault(name, got)
    engine.close()

    med = {name: statistics.median(t) * 1e3 for name, t in tpots.items()}
    console.print(f"model: random DeepSeek-V3-style, {shape.num_layers} MoE layers × {shape.num_experts} experts "
                  f"(top-{shape.top_k}), one expert {shape.expert_bytes / MiB:.2f} MiB; CPU, 1 thread", highlight=False)
    console.print(f"link: emulated {gbps:.3f} GB/s → T_load {timings.t_load * 1e3:.3f} ms ≈ "
                  f"{timings.t_load / timings.t_exp:.1f} × T_exp {timings.t_exp * 1e3:.3f} ms "
                  f"(T_att {timings.t_att * 1e3:.3f} ms, T_head {timings.t_head * 1e3:.3f} ms)", highlight=False)
    console.print(f"expert budget {budget / MiB:.1f} MiB ({args.budget} of all experts) for both; statistics from "
                  f"{recorder.tokens} tokens; {args.rounds} interleaved rounds × {args.tokens} tokens", highlight=False)
    console.print(f"uniform: {settings['uniform'].plan.summary()}", highlight=False)
    console.print(f"moepic:  {settings['moepic'].plan.summary()}", highlight=False)

    table = Table(title="per MoE layer: plan, hit rate, exposed load time per decode token")
    for col in ("layer", "uniform C/θ", "uniform hit", "uniform exposed ms", "moepic C/θ", "moepic hit",
                "moepic predicted hit", "moepic exposed ms", "moepic predicted ms"):
        table.add_column(col, justify="right")
    for i in range(shape.num_layers):
        u, m = settings["uniform"].plan.layers[i], settings["moepic"].plan.layers[i]
        cu, cm = layers["uniform"][i], layers["moepic"][i]
        choice = config.split.layers[i]
        table.add_row(
            str(i), f"{u.cache_size}/{u.split:.2f}", f"{cu.hit_rate:.2f}",
            f"{cu.exposed_s / steps['uniform'] * 1e3:.3f}",
            f"{m.cache_size}/{m.split:.2f}", f"{cm.hit_rate:.2f}", f"{choice.hit_rate:.2f}",
            f"{cm.exposed_s / steps['moepic'] * 1e3:.3f}", f"{choice.exposed * 1e3:.3f}",
        )
    total = {name: sum(c.exposed_s for c in layers[name]) / steps[name] * 1e3 for name in settings}
    table.add_row("all", "", "", f"{total['uniform']:.3f}", "", "", "", f"{total['moepic']:.3f}",
                  f"{config.total_exposed * 1e3:.3f}")
    console.print(table)
    console.print(f"TPOT median: uniform {med['uniform']:.2f} ms, moepic {med['moepic']:.2f} ms → "
                  f"uniform / moepic = {med['uniform'] / med['moepic']:.2f}×", highlight=False)
    console.print("token ids identical across policies" if ids["uniform"] == ids["moepic"]
                  else "token ids DIFFER across policies", highlight=False)


if __name__ == "__main__":
    main()
