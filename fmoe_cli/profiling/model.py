"""Per-layer timings of a loaded model that need not fit on the device.

The model runs through the offloading engine (experts in the host store, loaded on
demand), and each MoE layer is timed alone with only its own experts made resident
(`resident_layer`). `fmoe profile --model` saves these timings; a run set-up measures
them quickly when no profile has them (fmoe_cli/run.py, `find_timings`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from fmoe_cli.errors import FmoeError
from fmoe_cli.generate import DEFAULT_PROMPT
from fmoe_cli.offload.cache import LayerCache
from fmoe_cli.offload.engine import Engine, LayerState
from fmoe_cli.offload.policies import make_policy
from fmoe_cli.profiling.files import ModelTimings, model_identity
from fmoe_cli.profiling.layers import time_layers


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
        return time_layers(
            lm.model, prompt_ids(lm, prefill_len),
            model_identity=model_identity(lm.model_id, lm.path / "config.json"),
            top_k=lm.shape.top_k,
            decode_steps=2 if quick else 4,
            repeats=3 if quick else 7,
            resident=lambda i: resident_layer(engine, moe_index[i]),
            advance=advance,
            loads=lambda: _loads(engine),
        )
    finally:
        engine.observers = observers


def _loads(engine: Engine) -> tuple[int, float]:
    """The engine's loaded segments and exposed seconds so far (profiling/layers.py: h_load)."""
    counters = engine.counters()
    return counters.needed_loads, counters.exposed_s


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
