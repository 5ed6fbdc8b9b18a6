"""The host profile (issue 21 §2; docs/planning.md § The host profile): the CPU's expert throughput per format.

The host lane (docs/architecture.md § The host lane) computes experts on the CPU straight
from the host store. What that costs is measured here, per storage format, on one expert
shape (by default Qwen3-30B-A3B's: H = 2048, I = 768, top-8), through the same function
the engine calls (`store.segment_forward`), from a pool of experts larger than the CPU's
caches (each call reads its weights from RAM, as a decode step does):

- decode GEMV of one segment of n neurons, for three n (an eighth, half and all of I):
  the least-squares fit  t_host(n) = latency + n · neuron_bytes / bandwidth  (the link's
  fit, profiling/device.py: fit_link), which the planner scales to any model's experts;
- decode of one layer's top-K experts, one after another (what the host lane runs per layer);
- a prefill chunk: one expert over T tokens.

Medians of repeats after a warm-up. The clock and the forward are parameters, so a test
can drive the whole measurement on a scripted clock.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from dataclasses import replace
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F

from fmoe_cli.errors import FmoeError, warn
from fmoe_cli.offload.quant import make_store
from fmoe_cli.offload.store import HostStore
from fmoe_cli.profiling.device import _cpu_name, fit_link
from fmoe_cli.profiling.files import HostFit, HostProfile, Profile, default_profile_path, load_or_set_aside
from fmoe_cli.types import MiB, ExpertShape, Timings

# The formats the host lane computes in: unquantised rows of float32 or bfloat16, or quantised rows
# (offload/quant.py) computed with float32 activations.
HOST_FORMATS = ("f32", "bf16", "int8", "int4")
_STORAGE = {"f32": ("bf16", torch.float32), "bf16": ("bf16", torch.bfloat16),
            "int8": ("int8", torch.float32), "int4": ("int4", torch.float32)}
# The measured expert: Qwen3-30B-A3B's layer shape (the `a3b` model of issue 21's peer script).
HOST_HIDDEN, HOST_INTERMEDIATE, HOST_TOP_K = 2048, 768, 8
POOL_BYTES = 256 * MiB  # experts cycled through: more than any CPU's last-level cache
QUICK_POOL_BYTES = 64 * MiB

Forward = Callable[[HostStore, torch.Tensor, object], torch.Tensor]


def host_format(shape: ExpertShape) -> str:
    """The host profile's format for a model's experts: unquantised rows by their dtype, else the quantised format."""
    if shape.experts == "bf16":
        return "f32" if shape.dtype_bytes == 4 else "bf16"
    return shape.experts


def _forward(store: HostStore, x: torch.Tensor, rows) -> torch.Tensor:
    return store.segment_forward(x, rows, F.silu)


def _store(fmt: str, hidden: int, intermediate: int, top_k: int, pool_bytes: int) -> HostStore:
    """A one-layer host store of `fmt` holding enough experts to fill `pool_bytes` (at least 2K), every one a copy
    of one random expert (quantised once)."""
    experts, dtype = _STORAGE[fmt]
    probe = ExpertShape(1, 1, top_k, hidden, intermediate, dtype.itemsize, experts)
    count = max(2 * top_k, -(-pool_bytes // probe.expert_bytes))
    shape = ExpertShape(1, count, top_k, hidden, intermediate, dtype.itemsize, experts)
    store = make_store(shape, dtype, pin=False)
    store.allocate()
    generator = torch.Generator().manual_seed(0)
    block = store.block(0, 0)
    block.copy_(torch.randn(block.shape, generator=generator) * 0.02)
    store.put(0, 0, block)
    store.layers[0][1:].copy_(store.layers[0][0].expand_as(store.layers[0][1:]))
    return store


def _median_time(timer: Callable[[], float], call: Callable[[int], object], repeats: int, warmup: int,
                 start: int = 0) -> tuple[float, int]:
    """Median seconds of `call(n)` over `repeats` after `warmup` untimed calls; n counts on from `start`
    (the caller turns it into which experts to read). Returns (median, next n)."""
    n = start
    for _ in range(warmup):
        call(n)
        n += 1
    times = []
    for _ in range(repeats):
        t0 = timer()
        call(n)
        times.append(timer() - t0)
        n += 1
    return statistics.median(times), n


def measure_format(fmt: str, *, hidden: int = HOST_HIDDEN, intermediate: int = HOST_INTERMEDIATE,
                   top_k: int = HOST_TOP_K, prefill_tokens: int = 64, repeats: int = 15, warmup: int = 2,
                   pool_bytes: int = POOL_BYTES, timer: Callable[[], float] = time.perf_counter,
                   forward: Forward = _forward) -> HostFit:
    """One format's HostFit (see the module docstring)."""
    store = _store(fmt, hidden, intermediate, top_k, pool_bytes)
    count = store.shape.num_experts
    neuron_bytes = store.shape.neuron_bytes
    _, dtype = _STORAGE[fmt]
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    chunk = torch.randn(prefill_tokens, hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
    block = store.shape.neuron_block
    sizes = sorted({max(block, intermediate // 8 // block * block), max(block, intermediate // 2 // block * block),
                    intermediate})
    position = 0
    samples = []
    with torch.inference_mode():
        for n in sizes:  # decode: one segment of n neurons, a different expert each call
            t, position = _median_time(
                timer, lambda j, n=n: forward(store, x, store.rows(store.expert(0, j % count)[:n])), repeats, warmup,
                position)
            samples.append((n * neuron_bytes, t))

        def layer(j: int) -> None:  # decode: K distinct experts one after another (the host lane's layer)
            for e in range(top_k):
                forward(store, x, store.rows(store.expert(0, (j * top_k + e) % count)))

        t_layer, _ = _median_time(timer, layer, max(1, repeats // 3), 1)
        t_prefill, _ = _median_time(timer, lambda j: forward(store, chunk, store.rows(store.expert(0, j % count))),
                                    max(1, repeats // 3), 1)
    store.close()
    latency, bandwidth = fit_link(samples)
    return HostFit(fmt, bandwidth, latency, store.shape.expert_bytes, samples[-1][1], t_layer, t_prefill,
                   tuple(samples))


def measure_host(formats: Sequence[str] = HOST_FORMATS, *, quick: bool = False, prefill_tokens: int = 64,
                 timer: Callable[[], float] = time.perf_counter, forward: Forward = _forward,
                 hidden: int = HOST_HIDDEN, intermediate: int = HOST_INTERMEDIATE, top_k: int = HOST_TOP_K,
                 advance: Callable[[], None] = lambda: None) -> HostProfile:
    """The host profile of this machine: every format in `formats` (`advance` after each)."""
    fits = []
    for fmt in formats:
        if fmt not in _STORAGE:
            raise FmoeError(f"unknown host format {fmt!r}; use {', '.join(HOST_FORMATS)}")
        fits.append(measure_format(fmt, hidden=hidden, intermediate=intermediate, top_k=top_k,
                                   prefill_tokens=prefill_tokens, repeats=3 if quick else 15, warmup=1 if quick else 2,
                                   pool_bytes=QUICK_POOL_BYTES if quick else POOL_BYTES, timer=timer,
                                   forward=forward))
        advance()
    return HostProfile("measured", _cpu_name(), int(psutil.virtual_memory().total), torch.get_num_threads(),
                       torch.backends.cpu.get_cpu_capability(), hidden, intermediate, top_k, prefill_tokens,
                       tuple(fits), note="store.segment_forward from RAM (fmoe profile)")


def host_profile_path(config_dir: Path | None = None) -> Path:
    """Where `fmoe profile` keeps this machine's host profile (per CPU and RAM size: two machines differ)."""
    return default_profile_path(f"host-{machine_digest()}", config_dir)


def machine_digest() -> str:
    """16 hex digits naming this machine (its CPU and RAM size) in the files kept per machine."""
    return hashlib.sha256(f"{_cpu_name()}\0{psutil.virtual_memory().total}".encode()).hexdigest()[:16]


def is_this_host(host: HostProfile) -> bool:
    return host.kind == "measured" and (host.cpu, host.total_memory) == (_cpu_name(), psutil.virtual_memory().total)


def saved_host_profile(config_dir: Path | None = None) -> HostProfile | None:
    """This machine's host profile as `fmoe profile` saved it, or None (not profiled, another machine's, damaged)."""
    path = host_profile_path(config_dir)
    if not path.exists():
        return None
    try:
        host = load_or_set_aside(path).device.host
    except FmoeError as exc:
        warn(f"{exc}; the host profile is not used")
        return None
    return host if host is not None and is_this_host(host) else None


def host_line(host: HostProfile | None, fmt: str | None = None) -> str:
    """One line: the host's expert throughput per format (or for `fmoe` format `fmt` only)."""
    if host is None:
        return "host: not profiled (run `fmoe profile`): the host lane is not planned"
    fits = [f for f in host.formats if fmt is None or f.format == fmt]
    where = f"{host.kind}, {host.threads} threads, {host.capability}"
    if not fits:
        return f"host ({where}): no figures for {fmt}"
    parts = [f"{f.format} {f.bandwidth / 1e9:.1f} GB/s + {f.latency * 1e6:.0f} µs/call (one expert "
             f"{f.t_expert * 1e3:.2f} ms, top-{host.top_k} {f.t_layer * 1e3:.2f} ms, prefill {host.prefill_tokens} "
             f"tokens {f.t_prefill * 1e3:.2f} ms)" for f in fits]
    return (f"host expert compute ({where}; expert {host.hidden}×{host.intermediate}): " + " · ".join(parts))


# s_host: the host lane's round trip per layer (the hidden rows to the host, the partial sums back, the threads'
# hand-over): an estimate, not measured: two small PCIe copies at ~10 µs latency each and one synchronisation.
HOST_ROUND_TRIP_S = 30e-6


def host_timings(timings: Timings, host: HostProfile | None, shape: ExpertShape,
                 round_trip: float = HOST_ROUND_TRIP_S) -> Timings:
    """`timings` with the host lane's figures for the model's format (Timings.t_host_*), from the host profile:
    t_host(I) = latency + S_e / bandwidth (the fit, scaled to this model's expert), per call the fit's latency.
    Unchanged without a host profile or without figures for the format (then there is no host lane)."""
    fit = None if host is None else host.fit(host_format(shape))
    if fit is None:
        return timings
    return replace(timings, t_host_expert=fit.segment_time(shape.expert_bytes), t_host_call=fit.latency,
                   t_host_sync=round_trip)
