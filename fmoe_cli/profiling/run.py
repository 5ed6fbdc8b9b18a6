"""`fmoe profile`: measure the device (and, with --model, the per-layer timings) and save a profile.

The model part works when the model does not fit on the device: the model is loaded
through the offloading engine (experts in the host store), and each MoE layer is
timed alone with only its own experts made resident (`resident_layer`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from fmoe_cli.errors import FmoeError, warn
from fmoe_cli.files import writable_dir
from fmoe_cli.offload.cache import LayerCache
from fmoe_cli.offload.engine import Engine, LayerState
from fmoe_cli.offload.policies import make_policy
from fmoe_cli.profiling.device import link_steps, profile_device
from fmoe_cli.profiling.files import ModelTimings, Profile, default_profile_path, model_identity, now_iso
from fmoe_cli.profiling.layers import time_layers

MiB = 1024**2
GiB = 1024**3


@contextlib.contextmanager
def resident_layer(engine: Engine, moe_index: int) -> Iterator[None]:
    """Make every expert of one MoE layer whole on the device, and put the layer's cache back after."""
    old = engine.layers[moe_index]
    n = engine.shape.num_experts
    cache = LayerCache(n, make_policy("lcp", n))
    for e in range(n):
        cache.insert(e)
    tops = engine.store.layers[moe_index].to(engine.device, engine.dtype)
    engine.layers[moe_index] = LayerState(cache, tops, engine.shape.intermediate)
    try:
        yield
    finally:
        engine.layers[moe_index] = old
        del tops


def prompt_ids(lm, length: int) -> torch.Tensor:
    """A real prompt (the bench's, repeated) cut to `length` tokens; token ids 0..V-1 without a tokenizer."""
    from fmoe_cli.bench.run import DEFAULT_PROMPT

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
    """Per-layer times of a loaded model whose experts the (installed) engine serves.

    The engine is left configured for on-demand loading with the smallest staging pool:
    configure it again afterwards. Its observers do not see the measurement."""
    from fmoe_cli.offload.presets import make_settings
    from fmoe_cli.planning.plan import min_staging_slots

    slots = min_staging_slots(lm.shape)
    engine.configure(make_settings("ondemand", lm.shape, slots * lm.shape.expert_bytes))
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
        )
    finally:
        engine.observers = observers


def run_profile(
    model: str | None,
    out: Path | None,
    emulate_link: float | None,
    prefill_len: int,
    quick: bool,
    as_json: bool,
    device: str,
    dtype: str | None,
    trust_remote_code: bool,
    console: Console,
) -> Path | None:
    from fmoe_cli.offload.engine import open_engine
    from fmoe_cli.models.load import load_model, pick_device

    dev = pick_device(device)
    if emulate_link is not None and emulate_link <= 0:
        raise FmoeError(f"--emulate-link needs a bandwidth > 0 GB/s, got {emulate_link}")
    if prefill_len < 1:
        raise FmoeError(f"--prefill-len must be at least 1, got {prefill_len}")
    if out is not None:  # the user asked for this file: refuse a place it cannot go before measuring
        if Path(out).is_dir():
            raise FmoeError(f"--out {out} is a directory; give a file name")
        if (why := writable_dir(Path(out).parent)) is not None:
            raise FmoeError(f"--out {out}: cannot write in {Path(out).parent} ({why})")
    lm = None
    if model is not None:
        lm = load_model(model, device=str(dev), dtype=dtype, trust_remote_code=trust_remote_code, console=console)
    path = Path(out) if out is not None else default_profile_path(
        model, model_path=None if lm is None else lm.path, emulated=emulate_link is not None)

    with Progress(console=console, transient=True) as progress:
        link_task = progress.add_task("host → device link", total=link_steps(dev, quick, emulate_link is not None))
        device_profile = profile_device(emulate_link, quick=quick, device=dev,
                                        advance=lambda: progress.advance(link_task))
        timings = None
        if lm is not None:
            layer_task = progress.add_task(f"timing {len(lm.layers)} MoE layers (decode, prefill)", total=2 * len(lm.layers))
            engine = open_engine(lm)  # layers are timed resident: no link emulation here
            try:
                timings = model_timings(lm, engine, prefill_len, quick, advance=lambda: progress.advance(layer_task))
            finally:
                engine.close()
    profile = Profile(device_profile, timings, created=now_iso())
    saved: Path | None = path
    try:
        profile.save(path)
    except OSError as exc:  # the figures are printed all the same; saving is skipped with one warning
        saved, problem = None, f"cannot save the profile to {path} ({exc.strerror or exc}); the figures are not kept"
    if as_json:
        print(json.dumps({"path": None if saved is None else str(saved), "profile": profile.to_dict()}))
    else:
        render(profile, saved, lm.shape.expert_bytes if lm is not None else None, console)
    if saved is None:
        warn(problem)
    return saved


def device_line(profile: Profile) -> str:
    d = profile.device.device
    where = "no GPU: profiled the CPU" if d.kind == "cpu" else "GPU"
    return f"device: {d.kind} '{d.name}', {d.total_memory / GiB:.1f} GiB ({where})"


def link_line(profile: Profile) -> str:
    link = profile.device.link
    latency = f", latency {link.latency * 1e6:.0f} µs" if link.latency is not None else ""
    return f"link ({link.kind}): {link.bandwidth / 1e9:.2f} GB/s{latency} — {link.note}"


def render(profile: Profile, path: Path | None, expert_bytes: int | None, console: Console) -> None:
    console.print(device_line(profile), highlight=False)
    console.print(link_line(profile), highlight=False)
    if profile.device.free_memory is not None:
        console.print(f"free memory: {profile.device.free_memory / GiB:.1f} GiB", highlight=False)
    timings = profile.model
    if timings is not None:
        table = Table(title=f"{timings.model.name}: per-layer times (decode: 1 token; prefill: {timings.prefill.tokens} tokens)")
        for col in ("layer", "MoE", "decode T_att ms", "decode T_moe ms", "decode T_exp ms", "prefill T_att ms", "prefill T_moe ms"):
            table.add_column(col, justify="right")
        for dec, pre in zip(timings.decode.layers, timings.prefill.layers):
            t_exp = f"{dec.t_moe / timings.top_k * 1e3:.3f}" if dec.moe else "—"
            table.add_row(str(dec.index), "yes" if dec.moe else "dense", f"{dec.t_att * 1e3:.3f}",
                          f"{dec.t_moe * 1e3:.3f}", t_exp, f"{pre.t_att * 1e3:.3f}", f"{pre.t_moe * 1e3:.3f}")
        console.print(table)
        console.print(f"T_head: decode {timings.decode.t_head * 1e3:.3f} ms, prefill {timings.prefill.t_head * 1e3:.3f} ms",
                      highlight=False)
        if expert_bytes is not None:
            t_load = profile.device.link.transfer_time(expert_bytes)
            console.print(f"T_load (one expert, {expert_bytes / MiB:.2f} MiB): {t_load * 1e3:.3f} ms", highlight=False)
    if path is not None:
        console.print(f"saved the profile to {path}", highlight=False)
