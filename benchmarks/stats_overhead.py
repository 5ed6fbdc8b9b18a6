"""Per-token cost of recording routing statistics (StatsRecorder as an engine observer).

Measures, in one run: (1) the recorder's own time per decode token on a tiny random
Mixtral through the engine, next to that token's TPOT; (2) the recorder's time per
layer and token on synthetic routing events for larger expert counts N.

    python benchmarks/stats_overhead.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from fmoe_cli.generate import stream_generate
from fmoe_cli.models.demo import build_random_moe
from fmoe_cli.models.load import load_model
from fmoe_cli.offload.cache import LayerCache
from fmoe_cli.offload.engine import Engine
from fmoe_cli.offload.link import EmulatedLink
from fmoe_cli.offload.policies import make_policy
from fmoe_cli.planning.presets import make_settings
from fmoe_cli.planning.stats import RoutingStats, StatsRecorder


class Timed:
    def __init__(self, recorder: StatsRecorder) -> None:
        self.recorder, self.seconds = recorder, 0.0

    def __call__(self, event) -> None:
        t0 = time.perf_counter()
        self.recorder(event)
        self.seconds += time.perf_counter() - t0


def engine_run(tokens: int = 64) -> None:
    path = build_random_moe(Path(tempfile.mkdtemp()) / "mixtral", family="mixtral", seed=0)
    lm = load_model(str(path), device="cpu", dtype="float32")
    shape = lm.shape
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(gbps=16), lm.device, lm.dtype)
    engine.install(lm.model)
    engine.configure(make_settings("uniform", shape, 2 * shape.top_k * shape.expert_bytes + shape.all_experts_bytes // 4))
    prompt = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])
    timed = Timed(StatsRecorder(RoutingStats.empty("m", shape.num_layers, shape.num_experts, shape.top_k)))
    engine.observers.append(timed)
    per_token, tpot = [], []
    for event in stream_generate(lm.model, prompt, engine=engine, max_new_tokens=tokens, stop_on_eos=False):
        if event.index > 0:
            per_token.append(timed.seconds)
            tpot.append(event.latency_s)
        timed.seconds = 0.0
    engine.close()
    cost, step = statistics.median(per_token), statistics.median(tpot)
    print(f"tiny Mixtral (L={shape.num_layers}, N={shape.num_experts}, K={shape.top_k}), {tokens} tokens, CPU, "
          f"emulated link 16 GB/s: recorder {cost * 1e6:.0f} µs per token (median) = "
          f"{100 * cost / step:.1f}% of TPOT {step * 1e3:.2f} ms")


def synthetic(num_experts: int, top_k: int, tokens: int = 2000) -> float:
    rng = torch.Generator().manual_seed(0)
    recorder = StatsRecorder(RoutingStats.empty("m", 1, num_experts, top_k))
    cache = LayerCache(num_experts // 4, make_policy("lcp", num_experts))
    spent = 0.0
    for _ in range(tokens):
        chosen = torch.randperm(num_experts, generator=rng)[:top_k]
        predicted = torch.randperm(num_experts, generator=rng).tolist()
        event = SimpleNamespace(layer=0, top_k_index=chosen[None], cache=cache, predicted=predicted)
        t0 = time.perf_counter()
        recorder(event)
        spent += time.perf_counter() - t0
        cache.record([chosen.tolist()])
        cache.advance()
    return spent / tokens


if __name__ == "__main__":
    torch.set_num_threads(1)
    engine_run()
    for n, k in ((8, 2), (64, 8), (128, 8), (256, 8)):
        print(f"synthetic N={n:3d} K={k}: {synthetic(n, k) * 1e6:6.1f} µs per layer per decode token")
