"""Profile the local device (docs/architecture.md § Profiles and timings): the host → device link, memory, identity.

On a GPU: copies from pinned host memory to the device at 1 MiB … 512 MiB, the
median of repeats after a warm-up, and a least-squares fit of
    t(bytes) = latency + bytes / bandwidth.
Without a GPU the "device" is the CPU: the same fit over a plain memcpy (sizes and
repeats capped so that it takes seconds), and every output says so. With an emulated
link the link figures are the emulated ones, labelled as such.
"""

from __future__ import annotations

import hashlib
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import torch

from fmoe_cli.errors import FmoeError, warn
from fmoe_cli.offload.link import check_bandwidth
from fmoe_cli.offload.store import HostBuffer
from fmoe_cli.profiling.files import DeviceIdentity, DeviceProfile, LinkFit, Profile, default_profile_path, now_iso

MiB = 1024**2
GPU_SIZES = tuple(MiB << i for i in range(10))  # 1 MiB … 512 MiB
CPU_SIZES = tuple(MiB << i for i in range(8))  # 1 MiB … 128 MiB: a CPU run stays short


@dataclass(frozen=True)
class LinkPlan:
    sizes: tuple[int, ...]
    repeats: int
    warmup: int


def link_plan(device: torch.device, quick: bool = False) -> LinkPlan:
    if device.type == "cuda":
        return LinkPlan(GPU_SIZES[:6] if quick else GPU_SIZES, 3 if quick else 7, 2)
    return LinkPlan(CPU_SIZES[:4] if quick else CPU_SIZES, 3 if quick else 5, 1)


def local_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_identity(device: torch.device | None = None) -> DeviceIdentity:
    device = device or local_device()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return DeviceIdentity("cuda", props.name, int(props.total_memory))
    return DeviceIdentity("cpu", _cpu_name(), int(psutil.virtual_memory().total))


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def fit_link(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least squares t = latency + bytes / bandwidth, on relative error (every size counts).

    Returns (latency s ≥ 0, bandwidth bytes/s)."""
    if len(samples) < 2:
        raise FmoeError("need transfers of at least two sizes to fit latency and bandwidth")
    size = np.array([s for s, _ in samples], dtype=np.float64)
    seconds = np.array([t for _, t in samples], dtype=np.float64)
    slope, intercept = np.polyfit(size, seconds, 1, w=1.0 / np.maximum(seconds, 1e-12))
    if slope <= 0:  # noise swamped the sizes: fall back to the largest transfer
        return 0.0, float(size[-1] / seconds[-1])
    return max(0.0, float(intercept)), float(1.0 / slope)


def _timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    if device.type == "cuda":
        def run(copy: Callable[[], None]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            copy()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
    else:
        def run(copy: Callable[[], None]) -> float:
            t0 = time.perf_counter()
            copy()
            return time.perf_counter() - t0
    return run


def measure_link(device: torch.device, plan: LinkPlan, advance: Callable[[], None] = lambda: None) -> list[tuple[int, float]]:
    """(bytes, median seconds) per size; `advance` is called after every timed copy."""
    timed = _timer(device)
    samples = []
    for size in plan.sizes:
        # page-locked in place like the host store (not torch's caching pinned allocator, which keeps
        # the memory after the profile): unregistered and freed before the next size
        host = HostBuffer(size, pin=device.type == "cuda")
        src = host.tensor
        src.fill_(1)
        dst = torch.empty(size, dtype=torch.uint8, device=device)
        copy = lambda: dst.copy_(src, non_blocking=True)  # noqa: E731
        for _ in range(plan.warmup):
            timed(copy)
        times = []
        for _ in range(plan.repeats):
            times.append(timed(copy))
            advance()
        samples.append((size, statistics.median(times)))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        host.close()
        del host, src, dst
    return samples


def measure_memory_bandwidth(device: torch.device, size: int = 64 * MiB, repeats: int = 3) -> float:
    """Device-memory traffic of an on-device copy (read + write), bytes/s: a roofline for compute."""
    timed = _timer(device)
    a = torch.ones(size, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    copy = lambda: b.copy_(a)  # noqa: E731
    timed(copy)
    return 2 * size / statistics.median(timed(copy) for _ in range(repeats))


def profile_device(
    emulate_gbps: float | None = None,
    emulate_latency: float = 0.0,
    quick: bool = False,
    advance: Callable[[], None] = lambda: None,
    device: torch.device | None = None,
) -> DeviceProfile:
    """Measure (or, with emulate_gbps, emulate) the link and read the device's memory."""
    device = device or local_device()
    identity = device_identity(device)
    free, _ = device_memory(device)
    on_cpu = device.type == "cpu"
    if emulate_gbps is not None:
        check_bandwidth(emulate_gbps)
        link = LinkFit("emulated", emulate_gbps * 1e9, emulate_latency, (), f"link: emulated {emulate_gbps:g} GB/s")
    else:
        samples = measure_link(device, link_plan(device, quick), advance)
        latency, bandwidth = fit_link(samples)
        note = "CPU memcpy (no GPU: the CPU is the device)" if on_cpu else f"pinned host → {device} ({identity.name})"
        link = LinkFit("measured", bandwidth, latency, tuple(samples), note)
    return DeviceProfile(
        device=identity,
        link=link,
        free_memory=free,
        memory_bandwidth=measure_memory_bandwidth(device, 16 * MiB if on_cpu or quick else 256 * MiB),
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
    )


def link_steps(device: torch.device | None = None, quick: bool = False, emulated: bool = False) -> int:
    """How many timed copies `profile_device` makes (for a progress bar)."""
    if emulated:
        return 0
    plan = link_plan(device or local_device(), quick)
    return len(plan.sizes) * plan.repeats


def link_profile_path(identity: DeviceIdentity, config_dir: Path | None = None) -> Path:
    """Where a run keeps the link it measured, per device (kind, name and memory: two cards differ)."""
    digest = hashlib.sha256(f"{identity.kind}\0{identity.name}\0{identity.total_memory}".encode()).hexdigest()[:16]
    return default_profile_path(f"link-{identity.kind}-{digest}", config_dir)


def device_link(device: torch.device, config_dir: Path | None = None) -> LinkFit:
    """This device's host→device link, measured once and reused: `fmoe profile`'s (profiles/device.json)
    if it is of this device, else the one an earlier run saved for it (`link_profile_path`), else a quick
    measurement now (`link_plan(quick=True)`: copies of 1–32 MiB on a GPU, never more pinned at once),
    saved for the next run (a failed save is a warning). A profile of another device, an emulated or a
    damaged one is not used."""
    identity = device_identity(device)
    for path in (default_profile_path(None, config_dir), link_profile_path(identity, config_dir)):
        if not path.exists():
            continue
        try:
            profile = Profile.load(path)
            profile.check_device(identity)
        except FmoeError:
            continue
        if profile.device.link.kind == "measured":
            return profile.device.link
    if identity in _UNSAVED_LINKS:
        return _UNSAVED_LINKS[identity]
    samples = measure_link(device, link_plan(device, quick=True))
    latency, bandwidth = fit_link(samples)
    where = "CPU memcpy (no GPU: the CPU is the device)" if device.type == "cpu" else f"pinned host → {device} ({identity.name})"
    link = LinkFit("measured", bandwidth, latency, tuple(samples), f"quick measurement: {where}")
    path = link_profile_path(identity, config_dir)
    try:
        Profile(DeviceProfile(identity, link, torch_version=torch.__version__, cuda_version=torch.version.cuda),
                created=now_iso()).save(path)
    except OSError as exc:
        warn(f"cannot save the link's measurement to {path} ({exc.strerror or exc}); the next run measures it again")
        _UNSAVED_LINKS[identity] = link  # this process measures it once all the same (and says so once)
    return link


_UNSAVED_LINKS: dict = {}  # device identity -> the link this process measured and could not save
