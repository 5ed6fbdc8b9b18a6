"""`fmoe profile`: measure the device (and, with --model, the per-layer timings) and save a profile.

The model part works when the model does not fit on the device: the run's engine loads
experts on demand, and each MoE layer is timed alone with only its own experts made
resident (profiling/model.py).
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from fmoe_cli.errors import FmoeError, warn
from fmoe_cli.models.load import pick_device
from fmoe_cli.bench import check_profile_options
from fmoe_cli.planning.stats import scratch_recorder
from fmoe_cli.profiling.device import link_steps, profile_device
from fmoe_cli.profiling.files import LinkFit, Profile, default_profile_path, now_iso
from fmoe_cli.profiling.host import HOST_FORMATS, host_format, host_line, host_profile_path, measure_host
from fmoe_cli.profiling.model import model_timings
from fmoe_cli.run import RunOptions, context_length, open_run

MiB = 1024**2
GiB = 1024**3
# The engine's own costs in a model profile (docs/planning.md § `fmoe profile`): field, what it is.
ENGINE_COSTS = (
    ("t_expert", "T_exp per expert (one expert's forward alone, as a decode step meets it: the configurator's T_exp)"),
    ("t_host_load", "h_load (host work per loaded expert segment, beyond compute and link)"),
    ("t_host_prefetch", "h_pf (host work per MoE layer that prefetches)"),
    ("t_host_route", "h_route (host work from submitting a layer's loads to its first compute)"),
    ("t_host_submit", "h_sub (host work per demand load submitted, before the layer's first compute; part of h_load)"),
    ("t_segment", "c (a split top hit's extra: two segment forwards and their sum)"),
    ("t_admit", "a_e (one expert copied into the cache on the device)"),
    ("t_token", "a whole decode step, every expert resident"),
)


PER_LAYER_LEGEND = ("per layer: T_att (attention and norms) and T_moe (the layer's K experts with its router, routing "
                    "copy, dispatch and combine); T_moe/K: that per activated expert, more than one expert's forward "
                    "(T_exp below) by the router's and combine's share")



def quick_host_formats(shape) -> tuple[str, ...]:
    """The host formats `fmoe profile --quick` measures: f32 and bf16 always (on the first H200 run a quick profile
    had f32 alone and `hybrid` ran moepic's plan on a bf16 model: "host: no figures for bf16"), and the model's."""
    return tuple(dict.fromkeys(("f32", "bf16") + (() if shape is None else (host_format(shape),))))

def run_profile(opts: RunOptions | None, *, out: Path | None, emulate_link: float | None, prefill_len: int,
                quick: bool, as_json: bool, device: str, console: Console) -> Path | None:
    """`fmoe profile`: the device's link and memory; with a model (`opts`), its per-layer timings too."""
    check_profile_options(out=out, emulate_link=emulate_link, prefill_len=prefill_len, device=device)
    dev = pick_device(device)
    with ExitStack() as stack:
        # The model's layers are timed resident, on demand otherwise: no link emulation, no cache.
        run = None if opts is None else stack.enter_context(open_run(opts, console))
        if run is not None and (context := context_length(run.lm)) is not None and prefill_len > context:
            raise FmoeError(f"--prefill-len {prefill_len} is beyond the model's context of {context} tokens")
        # An emulated link's profile is kept apart: it never stands in for the real link.
        path = Path(out) if out is not None else default_profile_path(
            None if run is None else run.lm.timings_key, emulated=emulate_link or False)
        with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
            link_task = progress.add_task("host → device link", total=link_steps(dev, quick, emulate_link is not None))
            device_profile = profile_device(emulate_link, quick=quick, device=dev,
                                            advance=lambda: progress.advance(link_task))
            # the host's expert compute per format (--quick: f32, bf16 (a GPU's default dtype: without its figures
            # `hybrid` cannot plan a bf16 model there) and the model's format)
            formats = HOST_FORMATS if not quick else quick_host_formats(None if run is None else run.lm.shape)
            host_task = progress.add_task("host expert compute", total=len(formats))
            host = measure_host(formats, quick=quick, prefill_tokens=prefill_len,
                                advance=lambda: progress.advance(host_task))
            device_profile = replace(device_profile, host=host)
            timings = None
            if run is not None:
                layers = len(run.lm.layers)
                layer_task = progress.add_task(f"timing {layers} MoE layers (decode, prefill)", total=2 * layers)
                timings = model_timings(run.lm, run.engine, prefill_len, quick,
                                        advance=lambda: progress.advance(layer_task),
                                        observers=[scratch_recorder(run.lm.shape)])
        expert_bytes = None if run is None else run.lm.shape.expert_bytes
    profile = Profile(device_profile, timings, created=now_iso())
    saved: Path | None = path
    try:
        profile.save(path)
    except OSError as exc:  # the figures are printed all the same; saving is skipped with one warning
        saved, problem = None, f"cannot save the profile to {path} ({exc.strerror or exc}); the figures are not kept"
    try:  # this machine's host profile, where `fmoe bench` and `fmoe plan` find it
        Profile(replace(device_profile, link=replace(device_profile.link, samples=())), None,
                created=profile.created).save(host_profile_path())
    except OSError as exc:
        warn(f"cannot save the host profile to {host_profile_path()} ({exc.strerror or exc}); the host lane is not planned")
    if as_json:
        print(json.dumps({"path": None if saved is None else str(saved), "profile": profile.to_dict()}))
    else:
        render(profile, saved, expert_bytes, console)
    if saved is None:
        warn(problem)
    return saved


def device_line(profile: Profile) -> str:
    d = profile.device.device
    where = "no GPU: profiled the CPU" if d.kind == "cpu" else "GPU"
    return f"device: {d.kind} '{d.name}', {d.total_memory / GiB:.1f} GiB ({where})"


def link_line(link: LinkFit) -> str:
    latency = f", latency {link.latency * 1e6:.0f} µs" if link.latency is not None else ""
    return f"link ({link.kind}): {link.bandwidth / 1e9:.2f} GB/s{latency} — {link.note}"


def render(profile: Profile, path: Path | None, expert_bytes: int | None, console: Console) -> None:
    console.print(device_line(profile), highlight=False)
    console.print(link_line(profile.device.link), highlight=False)
    console.print(host_line(profile.device.host), highlight=False)
    if profile.device.free_memory is not None:
        console.print(f"free memory: {profile.device.free_memory / GiB:.1f} GiB", highlight=False)
    timings = profile.model
    if timings is not None:
        table = Table(title=f"{timings.model.name}: times per layer (decode: 1 token; prefill: {timings.prefill.tokens} tokens)")
        for col in ("layer", "MoE", "decode T_att ms", "decode T_moe ms", "decode T_moe/K ms", "prefill T_att ms",
                    "prefill T_moe ms"):
            table.add_column(col, justify="right")
        for dec, pre in zip(timings.decode.layers, timings.prefill.layers):
            t_exp = f"{dec.t_moe / timings.top_k * 1e3:.3f}" if dec.moe else "—"
            table.add_row(str(dec.index), "yes" if dec.moe else "dense", f"{dec.t_att * 1e3:.3f}",
                          f"{dec.t_moe * 1e3:.3f}", t_exp, f"{pre.t_att * 1e3:.3f}", f"{pre.t_moe * 1e3:.3f}")
        console.print(table)
        console.print(PER_LAYER_LEGEND, highlight=False)
        console.print(f"T_head (per token): decode {timings.decode.t_head * 1e3:.3f} ms, prefill "
                      f"{timings.prefill.t_head * 1e3:.3f} ms", highlight=False)
        for name, label in ENGINE_COSTS:  # measured with the layers; absent from older profiles
            value = getattr(timings, name)
            if value is not None:
                console.print(f"{label}: {value * 1e3:.3f} ms", highlight=False)
        if timings.link is not None:
            sizes = ", ".join(f"{b / MiB:.2f} MiB {t * 1e3:.3f} ms" for b, t in timings.link.samples)
            console.print(f"{link_line(timings.link)} ({sizes})", highlight=False)
        if expert_bytes is not None:
            link = timings.load_link(profile.device.link)
            t_load = link.transfer_time(expert_bytes)
            console.print(f"T_load (one expert, {expert_bytes / MiB:.2f} MiB): {t_load * 1e3:.3f} ms", highlight=False)
            used = timings.timings(link, expert_bytes)
            console.print(f"the configurator uses (means over the MoE layers): T_att {used.t_att * 1e3:.3f} ms per layer "
                          f"(the rest of T_moe and the whole step's other work included), T_exp {used.t_exp * 1e3:.3f} ms "
                          f"per expert, T_moe = K·T_exp {used.t_moe * 1e3:.3f} ms per layer, T_head "
                          f"{used.t_head * 1e3:.3f} ms per token", highlight=False)
    if path is not None:
        console.print(f"saved the profile to {path}", highlight=False)
