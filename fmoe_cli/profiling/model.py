"""Per-layer timings of a loaded model that need not fit on the device.

The model runs through the offloading engine (experts in the host store, loaded on
demand), and each MoE layer is timed alone with only its own experts made resident
(`resident_layer`). `fmoe profile --model` saves these timings; a run set-up measures
them quickly when no profile has them (fmoe_cli/run.py, `find_timings`).
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from fmoe_cli.errors import FmoeError
from fmoe_cli.generate import DEFAULT_PROMPT, stream_generate
from fmoe_cli.offload.cache import LayerCache
from fmoe_cli.offload.engine import Engine, LayerState
from fmoe_cli.offload.policies import make_policy
from fmoe_cli.profiling.files import ModelTimings, model_identity
from fmoe_cli.profiling.layers import time_layers
from fmoe_cli.types import LayerPlan


@contextlib.contextmanager
def resident_layer(engine: Engine, moe_index: int) -> Iterator[None]:
    """Make every expert of one MoE layer whole on the device, and put the layer's cache back after."""
    old = engine.layers[moe_index]
    n = engine.shape.num_experts
    cache = LayerCache(n, make_policy("lcp", n))
    for e in range(n):
        cache.insert(e)
    tops = engine.store.layers[moe_index].to(engine.device, engine.store.dtype)
    engine.layers[moe_index] = LayerState(cache, tops, engine.shape.intermediate)
    try:
        yield
    finally:
        engine.layers[moe_index] = old
        del tops


def prompt_ids(lm, length: int) -> torch.Tensor:
    """A real prompt (the bench's, repeated) cut to `length` tokens; token ids 0..V-1 without a tokenizer."""
    if length < 1:
        raise FmoeError(f"--prefill-len must be at least 1, got {length}")
    if lm.tokenizer is not None:
        ids = lm.tokenizer(DEFAULT_PROMPT)["input_ids"] or [0]
    else:
        ids = list(range(min(64, lm.model.config.get_text_config().vocab_size)))
    ids = (ids * (length // len(ids) + 1))[:length]
    return torch.tensor([ids])


def model_timings(lm, engine: Engine, prefill_len: int = 16, quick: bool = True,
                  advance: Callable[[], None] = lambda: None) -> ModelTimings:
    """Per-layer times of a loaded model whose experts the installed, configured engine serves
    (on-demand loading is enough: every MoE layer is timed with its experts resident).
    Its observers do not see the measurement."""
    moe_index = {layer.decoder_index: layer.index for layer in lm.layers}
    observers, engine.observers = engine.observers, []  # a measurement is not traffic: no trace, no statistics
    try:
        timings = time_layers(
            lm.model, prompt_ids(lm, prefill_len),
            model_identity=model_identity(lm.model_id, lm.path / "config.json"),
            top_k=lm.shape.top_k,
            decode_steps=2 if quick else 4,
            repeats=3 if quick else 7,
            resident=lambda i: resident_layer(engine, moe_index[i]),
            advance=advance,
            loads=lambda: _loads(engine),
        )
        h_pf = prefetch_host_s(lm, engine, prompt_ids(lm, prefill_len), timings.t_host_load or 0.0,
                               rounds=5 if quick else 9, tokens=8 if quick else 16)
        return replace(timings, t_host_prefetch=h_pf, t_admit=admission_copy_s(lm, repeats=20 if quick else 100))
    finally:
        engine.observers = observers


def prefetch_host_s(lm, engine: Engine, input_ids: torch.Tensor, h_load: float, rounds: int = 3,
                    tokens: int = 6) -> float:
    """h_pf: the host's work per MoE layer that prefetches (the predictor's scores and ranking, the
    prefetcher's submits and cancels), from decode tokens on the engine's link with no cache, with and
    without prefetch, in interleaved rounds. Per token, the time the host spent beyond its loads:
        net = TPOT − exposed − loaded segments · h_load
        h_pf = median over rounds of (median net with prefetch − median net without) / L
    (paired rounds: a machine whose load drifts shifts both sides of a pair alike).
    The engine is put back as it was."""
    settings = engine.settings
    plan = settings.plan
    no_cache = replace(plan, layers=tuple(LayerPlan(0, 0, 0, 0.0) for _ in plan.layers), resident=False,
                       prefetch=True, source="measurement")
    differences = []
    try:
        for r in range(rounds):
            net = {}
            for prefetch in ((False, True) if r % 2 == 0 else (True, False)):
                engine.configure(replace(settings, plan=no_cache, prefetch=prefetch))
                events = list(stream_generate(lm.model, input_ids, engine=engine, max_new_tokens=tokens + 1,
                                              stop_on_eos=False))[1:]
                net[prefetch] = statistics.median(
                    e.latency_s - e.counters.exposed_s - e.counters.needed_loads * h_load for e in events)
            differences.append(net[True] - net[False])
    finally:
        engine.configure(settings)
    return max(0.0, statistics.median(differences) / len(plan.layers))


def _loads(engine: Engine) -> tuple[int, float]:
    """The engine's loaded segments and exposed seconds so far (profiling/layers.py: h_load)."""
    counters = engine.counters()
    return counters.needed_loads, counters.exposed_s


def admission_copy_s(lm, repeats: int = 20) -> float:
    """a_e: one whole expert copied into a cache slot on the device, as the engine admits a loaded expert
    (offload/engine.py: _offer; device to device on a GPU, a memcpy on the CPU): the median over `repeats`
    copies from a staging-sized buffer, each from another expert's bytes (not one kept warm in a CPU cache)."""
    import time

    shape, store = lm.shape, lm.store
    sources = [store.expert(j % shape.num_layers, j % shape.num_experts).to(lm.device) for j in range(8)]
    slot = torch.empty_like(sources[0])
    sync = (lambda: torch.cuda.synchronize(lm.device)) if lm.device.type == "cuda" else (lambda: None)
    slot.copy_(sources[0])  # warm-up
    times = []
    for r in range(repeats):
        sync()
        start = time.perf_counter()
        slot.copy_(sources[r % len(sources)])
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def expert_compute_s(lm, repeats: int = 200, unquantised: bool = False) -> float:
    """T_exp: one expert's forward for one token (decode) on this device, through the store's
    own segment_forward (the engine's compute): the mean over `repeats` after a warm-up.
    `unquantised`: of the expert's unquantised weights instead (int8/int4 stores)."""
    import time

    from fmoe_cli.offload.layout import segment_forward

    packed = lm.store.expert(0, 0).to(lm.device)
    forward = lm.store.segment_forward
    if unquantised and hasattr(lm.store, "dequantized"):
        packed, forward = lm.store.dequantized(0)[0].to(lm.device), segment_forward
    x = torch.randn(1, lm.shape.hidden, dtype=lm.dtype, device=lm.device)
    act = torch.nn.functional.silu
    for _ in range(10):
        forward(x, packed, act)
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)
    start = time.perf_counter()
    for _ in range(repeats):
        forward(x, packed, act)
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)
    return (time.perf_counter() - start) / repeats
