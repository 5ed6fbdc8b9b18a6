"""One way to set up a run: `open_run(RunOptions)` (docs/architecture.md).

`fmoe bench`, `fmoe chat` and `fmoe profile` (and any later command) get the loaded
model, the engine, the policies' settings, the idle re-planner and the trace writer
from here. The order is the point:

1. every option is checked before anything slow (`RunOptions.check`, fmoe_cli/options.py:
   the command line checks it before torch is even imported);
2. the model is loaded; once its sizes are known and before a weight is read, the
   budget and every fixed plan are checked against the device (planning/plan.py);
3. the routing statistics saved for this model are loaded, and — if a policy's plan
   needs them (`Preset.configured`, `moepic`) — the configurator's timings are found:
   the device profile, else a quick measurement on a temporary engine;
4. every policy's settings are made from these `PlanInputs`;
5. the engine is built and configured once, with the first policy's settings.

Closing the run saves the statistics and closes the engine and the trace writer.
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.text import Text

from fmoe_cli.disk import sweep
from fmoe_cli.options import RunOptions
from fmoe_cli.trace import TraceWriter
from fmoe_cli.errors import FmoeError, warn
from fmoe_cli.files import read_json, set_aside, write_atomic
from fmoe_cli.models.identity import model_key
from fmoe_cli.models.load import LoadedModel, load_model, pick_device
from fmoe_cli.offload.engine import Engine, EngineSettings, open_engine
from fmoe_cli.offload.link import make_link
from fmoe_cli.planning.plan import (
    check_budget_text,
    check_budget,
    check_plan_fits,
    device_room,
    kv_reserve,
    resolve_context,
    min_staging_slots,
    resolve_budget,
)
from fmoe_cli.planning.presets import PRESETS, PlanInputs, make_settings, settings_for
from fmoe_cli.planning.replan import Replanner
from fmoe_cli.planning.stats import default_stats_path, open_recorder, scratch_recorder
from fmoe_cli.profiling.device import device_identity, device_link
from fmoe_cli.profiling.host import host_timings, machine_digest, saved_host_profile
from fmoe_cli.profiling.files import (DeviceProfile, LinkFit, Profile, default_profile_path, load_or_set_aside,
                                     model_identity, now_iso)
from fmoe_cli.profiling.model import expert_compute_s, model_timings
from fmoe_cli.profiling.reference import CONSUMER_CARD
from fmoe_cli.prediction import DEFAULT_PREDICTOR, PREDICTORS
from fmoe_cli.types import AUTO_ACTIVATIONS, DEFAULT_DENSE, DEFAULT_EXPERTS, ExpertShape, Timings


@dataclass
class Run:
    options: RunOptions
    lm: LoadedModel
    engine: Engine  # configured with settings[0]
    budget_bytes: int
    inputs: PlanInputs  # what the plans were made from (statistics as loaded)
    settings: list[EngineSettings]  # one per policy, in the options' order
    replanner: Replanner | None = None  # the idle hook (None: statistics not recorded)
    writer: TraceWriter | None = None  # --trace-out
    profile: str | None = None
    timing_source: str | None = None  # the configurator's timings: "profile" or "quick estimate" (None: no plan needs them)
    context: int | None = None  # tokens the KV cache is reserved for (--context): chat keeps its window inside
    timing_note: str | None = None  # quick_estimate_note's, where a profile could change the plan

    def settings_for(self, index: int, *, replan: bool) -> EngineSettings:
        """Policy `index`'s settings, planned now from the statistics so far when its plan reads them and
        `replan` (bench: every run but the first, whose plan was made when the run opened; a later policy's
        configurator plan sees the earlier runs' routing, a later round's every run's)."""
        s = self.settings[index]
        if not replan or self.replanner is None or not PRESETS[s.policy].configured:
            return s
        return settings_for(s.policy, self.replanner.plan_inputs(), omega=s.omega, rho=s.rho)

    def idle(self) -> None:
        """The device is idle (between turns or runs): statistics saved, re-planned if due."""
        if self.replanner is not None:
            self.replanner.on_idle()


def quick_estimate_note(opts: RunOptions, shape, budget_bytes: int) -> str | None:
    """What a run whose configured plan rests on a quick timing estimate says, once: that the estimate varies and
    how to make it firm (the profile command with the run's formats: a profile is kept per format,
    `LoadedModel.timings_key`). None where no profile could change the plan: the budget holds every expert."""
    if budget_bytes >= shape.all_experts_bytes:
        return None
    given = {"--dtype": opts.dtype, "--experts": opts.experts if opts.experts != DEFAULT_EXPERTS else None,
             "--dense": opts.dense if opts.dense != DEFAULT_DENSE else None,
             "--activations": opts.activations if opts.activations != AUTO_ACTIVATIONS else None}
    formats = "".join(f" {flag} {value}" for flag, value in given.items() if value)
    return (f"the configured plan rests on a quick timing estimate, which varies from run to run on a busy machine; "
            f"`fmoe profile --model {opts.model}{formats}` measures this model once and makes it firm")


def context_length(lm: LoadedModel) -> int | None:
    """The model's context in tokens (its config's max_position_embeddings), None if it does not say."""
    return config_context(lm.model.config)


def config_context(config) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def check_device(opts: RunOptions) -> None:
    """What of the options depends on the device, after `opts.check()`: the device exists, the budget is
    not beyond its memory, the profile is of it (one line each, before the model loads)."""
    device = pick_device(opts.device)
    check_budget_text(opts.vram_budget, device)
    if opts.profile is not None:
        check_profile(opts.profile, device)


def check_profile(path: str, device) -> Profile:
    """A profile that reads and is of this device, else a one-line error."""
    profile = Profile.load(Path(path))
    profile.check_device(device_identity(device), source=f"profile {path}")
    return profile


def measure_timings(lm: LoadedModel, engine: Engine | None = None, *, link=None, quick: bool = True,
                    prefill_len: int = 8):
    """A measurement of `lm`'s per-layer times and the engine's costs (quick unless told), loading
    experts on demand through the smallest staging pool: on `engine` (left so configured) or on a
    temporary engine of its own on `link` (default: the device's own), closed after (the run's
    engine is then not configured for it)."""
    own = engine is None
    engine = open_engine(lm, link=link) if own else engine
    try:
        engine.configure(make_settings("ondemand", lm.shape, min_staging_slots(lm.shape) * lm.shape.expert_bytes))
        return model_timings(lm, engine, prefill_len=prefill_len, quick=quick, observers=[scratch_recorder(lm.shape)])
    finally:
        if own:
            engine.close()


def link_fit_of(link, device) -> LinkFit:
    """The engine's link: an emulated link's own figures, else the device's, measured once and reused
    (profiling/device.py: `device_link`)."""
    if getattr(link, "gbps", None):
        return LinkFit("emulated", link.gbps * 1e9, getattr(link, "latency_s", 0.0), (), link.label())
    return device_link(device)


def find_timings(lm: LoadedModel, link, profile_path: Path | None = None, engine: Engine | None = None,
                 on_quick: Callable[[str], object] = lambda how: None, note: Callable[[str], object] = warn) -> Timings:
    """The configurator's timings: the saved profile of this device and model, else the quick estimate an
    earlier run saved (`on_quick("saved")`), else a quick measurement (on `engine` if given — it is left
    configured for on-demand loading — else on a temporary one; `on_quick("measured")`), saved for the next
    run when no profile was named. T_load: the link the run really uses (an emulated one's own figures; else the
    engine's link timed at this model's copy sizes where the timings have it, `ModelTimings.link`, else the
    device's; a profile of a link more than 20 % away is said so through `note`, and the run's link is used)."""
    gbps = getattr(link, "gbps", None)
    emulated = bool(gbps)
    key = lm.timings_key
    # The layer timings do not depend on the link: an emulated run reads the profile of its own link first,
    # else another emulated one or the real one (its own link figures are used); a real run never reads an
    # emulated profile.
    candidates = [profile_path] if profile_path else (
        [*emulated_profiles(key, gbps), default_profile_path(key)] if emulated else [default_profile_path(key)])
    path = next((c for c in candidates if c.exists()), candidates[0])
    timings, link_fit, moved = None, None, False
    if path.exists():
        try:  # a profile of another device or model (or a damaged one) is not used: measure instead, and say so
            timings, link_fit = _saved_timings(path, lm, set_aside_damaged=profile_path is None)
        except FmoeError as exc:
            warn(f"not using the saved profile: {exc}; timing the layers quickly instead")
            timings = None
    if timings is not None and (emulated or lm.device.type != "cpu"):  # (the CPU's own "link" moves nothing)
        run_link = link_fit_of(link, lm.device)
        if link_apart(link_fit, run_link):
            profiled = f" --emulate-link {run_link.bandwidth / 1e9:g}" if emulated else ""
            note(f"the profile {path} was measured on a link of {link_fit.bandwidth / 1e9:.3g} GB/s, this run's is "
                 f"{run_link.bandwidth / 1e9:.3g} GB/s (more than {LINK_TOLERANCE:.0%} apart): the plan is made for "
                 f"this run's link (T_load), with the profile's compute and host costs; `fmoe profile --model "
                 f"{lm.model_id}{profiled}` profiles this link")
            link_fit, moved = run_link, True
    quick = default_profile_path(key, quick=True)
    if timings is None and profile_path is None and quick.exists():
        try:  # the quick estimate of an earlier run: no warning when it is not usable, it is measured again
            timings, link_fit = _saved_timings(quick, lm)
            on_quick("saved")
        except FmoeError:
            timings = None
    if timings is None:
        timings = measure_timings(lm, engine)
        link_fit = None
        on_quick("measured")
        if profile_path is None:  # kept for the next run; a cache: a failed save is not worth a warning
            try:
                Profile(DeviceProfile(device_identity(lm.device), link_fit_of(link, lm.device)), timings,
                        created=now_iso()).save(quick)
            except OSError:
                pass
    if emulated or link_fit is None or link_fit.kind == "emulated":  # the link the engine really uses
        link_fit = link_fit_of(link, lm.device)
    if not emulated and not moved:  # the engine's link timed at this model's copies, where the timings have it
        link_fit = timings.load_link(link_fit)
    times = timings.timings(link_fit, lm.shape.expert_bytes)
    # the host lane's figures (this machine's host profile), with a GPU only: without one the host is the device
    return host_timings(times, saved_host_profile(), lm.shape) if lm.device.type == "cuda" else times


def emulated_profiles(key: str, gbps: float) -> list[Path]:
    """The saved profiles of emulated links of the model `key`, the nearest bandwidth to `gbps` first (one of
    unknown bandwidth, saved before they were kept per link, last)."""
    own = default_profile_path(key, emulated=gbps)
    pattern = re.compile(re.escape(default_profile_path(key, emulated=True).stem) + r"-([0-9.e+]+)gbps\.json$")

    def distance(path: Path) -> float:
        match = pattern.match(path.name)
        try:
            return abs(math.log(float(match.group(1)) / gbps)) if match else math.inf
        except (ValueError, ZeroDivisionError):
            return math.inf

    saved = sorted(own.parent.glob(default_profile_path(key, emulated=True).stem + "*.json"), key=distance)
    return [own, *(path for path in saved if path != own)]


LINK_TOLERANCE = 0.2  # a profile's link this far from the run's (relative bandwidth) is another link


def link_apart(profiled: LinkFit, measured: LinkFit) -> bool:
    """Whether the run's link differs from the profile's by more than LINK_TOLERANCE of its bandwidth."""
    return abs(measured.bandwidth - profiled.bandwidth) > LINK_TOLERANCE * profiled.bandwidth


def shaped_link_gbps(lm: LoadedModel) -> float:
    """The emulated link of a run without a GPU: CONSUMER_CARD's in this model's units (one expert's load =
    load_over_compute × T_exp), the same for every expert format (from the unquantised expert's compute). T_exp is
    measured once a machine, model and compute dtype and kept (`<model key>.<dtype>.<machine>.shaped-link.json` beside
    the profiles), so that runs compare and a profile of this link stays this link's: measured afresh each run it read
    1.8–4.1 GB/s on the demo from one run to the next on this machine. The link is computed from the kept T_exp at each
    read (a corrected reference card applies). A file that does not read is set aside and measured again; one that
    cannot be written leaves the figure to this run."""
    dtype = str(lm.dtype).removeprefix("torch.")
    path = default_profile_path(f"{model_key(lm.model_id, lm.path)}.{dtype}.{machine_digest()}.shaped-link")
    expert_bytes = replace(lm.shape, experts="bf16").expert_bytes
    t_exp = None
    if path.exists():
        read = path.stat()
        try:
            kept = read_json(path, "shaped link")
            if not (isinstance(kept, dict) and kept.get("kind") == SHAPED_LINK_KIND
                    and type(kept.get("t_exp_s")) is float and 0 < kept["t_exp_s"] < 1e3):
                raise FmoeError(f"shaped link {path} is not fmoe's")
            t_exp = kept["t_exp_s"]
        except FmoeError as exc:
            try:
                aside = set_aside(path, read=read)
            except OSError:
                aside = None
            if aside is not None:
                warn(f"{exc}: moved to {aside.name}, measured again")
    if t_exp is None:
        t_exp = expert_compute_s(lm, unquantised=True)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps({"kind": SHAPED_LINK_KIND, "t_exp_s": float(t_exp),
                                           "expert_bytes": expert_bytes, "measured": now_iso()}))
        except OSError:
            pass  # (the config directory not writable: the figures' own warning says so where they are saved)
    return CONSUMER_CARD.link_gbps(expert_bytes, t_exp)


SHAPED_LINK_KIND = "fmoe-shaped-link"


def _saved_timings(path: Path, lm: LoadedModel, set_aside_damaged: bool = False):
    """(model timings, link) of a saved profile of this device and model, else FmoeError. `set_aside_damaged`: a file
    that does not read as a profile (fmoe's own, at its default path; never one the user named) is moved aside
    (`load_or_set_aside`), so the next run does not warn again."""
    profile = load_or_set_aside(path) if set_aside_damaged else Profile.load(path)
    profile.check_device(device_identity(lm.device))
    profile.check_model(model_identity(lm.model_id, lm.path / "config.json"))
    profile.model.check_formats(lm.formats)
    return profile.model, profile.device.link


@contextmanager
def open_run(opts: RunOptions, console: Console | None = None, *, say_timing_note: bool = True,
             check_model: Callable[[ExpertShape], None] | None = None) -> Iterator[Run]:
    """Set up a run (see the module's docstring); on exit save the statistics and close everything.
    say_timing_note: the quick estimate's note (Run.timing_note) is printed here, at the start; False: the caller
    says it where its figures are (bench: under its table).
    `check_model(shape)`: the caller's own check of the model, once its shape is known, before a weight is read
    (fmoe bench --replay-routing: the trace's shape)."""
    opts.check()
    check_device(opts)
    sweep()  # what interrupted work left behind (a killed conversion's temporary)
    console = console or Console(stderr=True)
    presets = [PRESETS[name] for name in opts.policies]
    plans: dict = {}

    def check_plans(shape, non_expert_bytes: int, config, device) -> None:
        """Once the sizes are known, before a weight is read: the budget and every fixed plan
        against the device's free memory (minus the non-expert weights still to load, the KV
        cache and the workspace; `resident` when the model does not fit), one line each."""
        nonlocal presets
        if check_model is not None:
            check_model(shape)
        beside = device_room(device, 0, non_expert_pending=non_expert_bytes)  # the room before the KV cache
        kv_bytes = functools.partial(kv_reserve, config, dtype_bytes=shape.dtype_bytes)  # of a context's tokens
        context = resolve_context(opts.context, config_context(config), kv_bytes, None if beside is None else beside.bytes)
        kv = kv_bytes(context)
        room = device_room(device, kv, non_expert_pending=non_expert_bytes)
        budget = resolve_budget(opts.vram_budget, shape, room)
        inputs = PlanInputs(shape, budget, model=opts.model)
        fixed = {p.name: settings_for(p.name, inputs, omega=opts.omega, rho=opts.rho)
                 for p in presets if not p.configured}
        for name, fixed_settings in list(fixed.items()):
            try:
                check_plan_fits(fixed_settings.plan, room)  # `resident` when the model does not fit
            except FmoeError as exc:
                if name not in opts.if_fits or len(presets) == 1:
                    raise
                console.print(f"{name} left out: {exc}", highlight=False)
                del fixed[name]
                presets = [p for p in presets if p.name != name]
        if any(p.configured for p in presets):
            check_budget(shape, budget, min_staging_slots(shape))
        plans.update(budget=budget, fixed=fixed, context=context)

    def step(what: str, since: float) -> None:
        """One step of the set-up and its time, on a terminal (what a first start spends its time on)."""
        if console.is_terminal:
            console.print(f"[dim]{what}: {time.perf_counter() - since:.1f} s[/dim]", highlight=False)

    started = time.perf_counter()
    with ExitStack() as stack:
        lm = load_model(opts.model, device=opts.device, dtype=opts.dtype, trust_remote_code=opts.trust_remote_code,
                        console=console, experts=opts.experts, before_read=check_plans, dense=opts.dense,
                        activations=opts.activations)
        stack.callback(lm.store.close)  # unregisters page-locked host memory (CUDA)
        shape = lm.shape
        budget, fixed = plans["budget"], plans["fixed"]
        configured = any(p.configured for p in presets)
        inputs = PlanInputs(shape, budget, model=lm.model_id)
        writer = TraceWriter.for_model(opts.trace_out, lm, opts.overwrite_trace) if opts.trace_out is not None else None
        if writer is not None:
            stack.callback(writer.close)
        recorder = None
        if opts.record_statistics:
            stats_path = opts.stats_path or default_stats_path(lm.model_id, model_path=lm.path)
            recorder = open_recorder(lm.model_id, shape.num_layers, shape.num_experts, shape.top_k, stats_path)
            inputs = PlanInputs(shape, budget, stats=recorder.stats, model=lm.model_id)
        gbps, note = opts.emulate_link, None
        if gbps is None and opts.shape_link and lm.device.type == "cpu":
            gbps, note = shaped_link_gbps(lm), CONSUMER_CARD.note()
        link = make_link(lm.device, gbps, note)
        step("loaded the model", started)
        timing_source, timing_note = None, None
        try:
            if configured:
                started = time.perf_counter()
                with console.status("timing the model for the configurator …"):
                    profile_path = None if opts.profile is None else Path(opts.profile)
                    quick: list[str] = []
                    timings = find_timings(lm, link, profile_path, on_quick=quick.append)
                    inputs = PlanInputs(shape, budget, timings, inputs.stats, lm.model_id)
                if quick:  # say how firm the plan is, and how to make it firm
                    timing_source = "quick estimate"
                    step("timed the model for the configurator (a quick estimate, kept for the next run)"
                         if quick[0] == "measured" else "read the quick estimate an earlier run kept", started)
                    timing_note = quick_estimate_note(opts, shape, budget)
                    if timing_note is not None and say_timing_note:
                        console.print(Text(f"note: {timing_note}", style="dim"), highlight=False, soft_wrap=True)
                else:
                    timing_source = "profile"
                    step("read the model's profile", started)
            started = time.perf_counter()
            settings = [fixed.get(p.name) or settings_for(p.name, inputs, omega=opts.omega, rho=opts.rho)
                        for p in presets]
            step("planned " + ", ".join(p.name for p in presets), started)
            # (`trace`, the replayed trace's rankings, is the bench's own: it sets it for every run)
            predictor = opts.predictor if opts.predictor in PREDICTORS else DEFAULT_PREDICTOR
            engine = open_engine(lm, predictor=predictor, link=link, host_threads=opts.host_threads)
        except BaseException:
            link.close()
            raise
        stack.callback(engine.close)
        replanner = Replanner(engine, inputs, recorder, opts.tau) if recorder is not None else None
        if replanner is not None:
            stack.callback(replanner.close)  # saves the statistics (runs before engine.close)
        engine.configure(settings[0])
        yield Run(opts, lm, engine, budget, inputs, settings, replanner, writer, opts.profile, timing_source,
                  context=plans["context"], timing_note=timing_note)
