"""`RunOptions`: everything a run is set up from, and their checks (docs/architecture.md).

This module imports no torch, transformers or hub client: a command line is checked here in a
fraction of a second, before anything heavy is imported (`fmoe bench demo --policy bogus` answers
at once). `RunOptions.check` checks what needs no device (names, numbers, paths, files); what
depends on the device (a budget beyond a GPU's memory, a profile of another device) is checked by
`open_run` (run.py) before the model loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from fmoe_cli.errors import FmoeError, no_gpu, unknown_device
from fmoe_cli.models.config import check_config_file, check_servable, model_context
from fmoe_cli.models.hub import SHIPPED_DEMO, local_model_dir
from fmoe_cli.models.room import check_host_ram_early, compute_dtype_bytes
from fmoe_cli.offload import check_bandwidth
from fmoe_cli.offload.policies import LCP_OMEGA, LCP_RHO, check_lcp
from fmoe_cli.planning.plan import DEFAULT_BUDGET, DEFAULT_TAU, check_budget_text, resolve_context
from fmoe_cli.planning.presets import DEFAULT_POLICY, preset
from fmoe_cli.prediction import DEFAULT_PREDICTOR, check_predictor
from fmoe_cli.profiling.files import Profile
from fmoe_cli.profiling.machine import surely_no_gpu
from fmoe_cli.trace import check_trace_out
from fmoe_cli.types import (AUTO_ACTIVATIONS, DEFAULT_DENSE, DEFAULT_EXPERTS, check_activations, check_dense_format,
                            check_dtype, check_expert_format)

DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device_text(device: str) -> None:
    """auto, cpu or cuda[:N]; cuda where this machine surely has no GPU is refused here (whether the device exists is
    otherwise torch's to say, later: models/load.py `pick_device`, with the same line)."""
    if not DEVICE.fullmatch(device):
        raise unknown_device(device)
    if device.startswith("cuda") and surely_no_gpu():
        raise no_gpu(device)


def local_model_config(model: str) -> Path | None:
    """The config.json of `demo` or of a local model directory (checked to exist), None for a hub id (its config.json
    comes with the download: models/hub.py `fetch_model_early`)."""
    if model == "demo":
        return SHIPPED_DEMO / "config.json" if (SHIPPED_DEMO / "config.json").exists() else None  # (else a random demo)
    local = local_model_dir(model)
    return local / "config.json" if local is not None else None


MAX_HOST_THREADS = 256


@dataclass(frozen=True)
class RunOptions:
    """Everything a run is set up from; the command line builds one (the defaults live here)."""

    model: str = "demo"
    policies: tuple[str, ...] = (DEFAULT_POLICY,)  # the engine starts with the first
    vram_budget: str | None = DEFAULT_BUDGET  # None: the staging pool alone (no cache)
    predictor: str = DEFAULT_PREDICTOR
    omega: float = LCP_OMEGA  # LCP ω
    rho: float = LCP_RHO  # LCP ρ
    emulate_link: float | None = None  # GB/s of an emulated host→device link
    device: str = "auto"
    dtype: str | None = None  # None: auto
    experts: str = DEFAULT_EXPERTS  # storage of the routed experts: bf16 (unquantised, in dtype), int8, int4, int2
    dense: str = DEFAULT_DENSE  # storage of the attention projections (and LM head): bf16 (unquantised), int8, int4
    activations: str = AUTO_ACTIVATIONS  # what the CPU kernels multiply int8/int4 rows with: float, int8 (Q8) or auto
    trust_remote_code: bool = False
    trace_out: str | None = None  # JSONL routing trace
    overwrite_trace: bool = False  # --force: trace_out may replace an existing file
    profile: str | None = None  # a device profile (the configurator's timings), instead of the default one
    stats_path: Path | None = None  # where the routing statistics are kept (default: per model)
    tau: int = DEFAULT_TAU  # τ: tokens between re-plans
    record_statistics: bool = True  # observe routing, keep the statistics, re-plan while idle
    # Without a GPU and without emulate_link: an emulated link shaped like a consumer card
    # (profiling/reference.py) instead of none. fmoe bench sets it.
    shape_link: bool = False
    if_fits: tuple[str, ...] = ()  # policies left out (with a note) when their plan does not fit the device
    context: int | None = None  # tokens of KV cache reserved (--context); None: planning.plan.resolve_context's default
    host_threads: int = 1  # CPU threads of the engine's host lane (hybrid plans: misses and bottoms on the host)
    replay_routing: str | None = None  # fmoe bench: a routing trace every router's top-k is taken from (bench/routing.py)

    def check(self) -> None:
        """Refuse bad options in one line without importing torch: names, numbers, paths and files
        (what depends on the device is run.py's `check_device`, once torch is imported)."""
        if not self.policies:
            raise FmoeError("no policy to run")
        for name in self.policies:
            preset(name)
        check_predictor(self.predictor, replay=self.replay_routing is not None)
        check_dtype(self.dtype)
        check_expert_format(self.experts)
        check_dense_format(self.dense)
        check_activations(self.activations)
        check_lcp(self.omega, self.rho)
        if self.emulate_link is not None:
            check_bandwidth(self.emulate_link)
        if self.context is not None:
            resolve_context(self.context, None, None)
        if not 1 <= self.host_threads <= MAX_HOST_THREADS:
            raise FmoeError(f"--host-threads must be between 1 and {MAX_HOST_THREADS}, got {self.host_threads}")
        check_device_text(self.device)
        check_budget_text(self.vram_budget)  # (and not beyond this machine's memory)
        if self.trace_out is not None:
            check_trace_out(self.trace_out, self.overwrite_trace)
        if self.profile is not None:
            Profile.load(Path(self.profile))
        config = local_model_config(self.model)
        if config is not None:  # (a hub id's: once downloaded, before its weights: cli.py `_fetch_model`)
            self.check_model_config(config)

    def check_model_config(self, config: Path) -> int | None:
        """What the model's config.json says against this run, before torch and before a hub model's weights are
        downloaded: a checkpoint fmoe cannot serve (models/config.py `check_servable`), --context beyond the model's
        own, experts that do not fit in host RAM in the asked format (models/room.py). Returns the model's context
        where its config says."""
        fields = check_servable(config, self.model, self.trust_remote_code)
        context = model_context(fields)
        if self.context is not None:  # beyond the model's own context: now, not in 6 s
            resolve_context(self.context, context, None)
        on_cpu = self.device == "cpu" or (self.device == "auto" and surely_no_gpu())
        check_host_ram_early(self.model, fields, compute_dtype_bytes(self.dtype, on_cpu), self.experts)
        return context

    def context_limit(self) -> int | None:
        """The most positions a run can hold, known without torch: --context, else the model's own context where its
        config is at hand (a local directory, the demo); None otherwise. A bound, not the run's context (that is
        resolved once the model is read): a prompt needs one of them too."""
        if self.context is not None:
            return self.context
        config = local_model_config(self.model)
        return check_config_file(config) if config is not None else None
