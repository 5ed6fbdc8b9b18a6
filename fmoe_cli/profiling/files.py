"""Profile files (docs/architecture.md § Profiles and timings): what `fmoe profile` measured, as versioned JSON.

A profile holds the device part (identity, memory, the host→device link fit) and
optionally the per-layer model timings. It is refused, with a one-line FmoeError,
when it is malformed, of another schema version, for another device or for another
model. The JSON schema is `profiles/schema.json` in the repository.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import platformdirs

from fmoe_cli.errors import FmoeError
from fmoe_cli.types import Timings
from fmoe_cli.files import read_json, set_aside, write_atomic

PROFILE_SCHEMA_VERSION = 1
GiB = 1024**3


@dataclass(frozen=True)
class DeviceIdentity:
    kind: str  # "cuda", "cpu", or "reference" (a spec sheet, not this machine)
    name: str
    total_memory: int  # bytes

    def describe(self) -> str:
        return f"{self.kind} '{self.name}' ({self.total_memory / GiB:.1f} GiB)"


@dataclass(frozen=True)
class LinkFit:
    """Host → device transfer time ≈ latency + bytes / bandwidth."""

    kind: str  # "measured", "emulated" or "spec"
    bandwidth: float  # bytes/s
    latency: float | None  # s (None: not known, e.g. a spec sheet)
    samples: tuple[tuple[int, float], ...] = ()  # (bytes, median seconds) behind a measured fit
    note: str = ""  # what was measured: "pinned host → cuda:0", "CPU memcpy (no GPU)", "link: emulated 16 GB/s"

    def transfer_time(self, nbytes: int) -> float:
        return (self.latency or 0.0) + nbytes / self.bandwidth


@dataclass(frozen=True)
class HostFit:
    """The host's (CPU's) expert compute for one storage format, from RAM (issue 21 §2; profiling/host.py):
    a segment of n neurons takes  t_host(n) ≈ latency + n · neuron_bytes / bandwidth  for one decode token."""

    format: str  # "f32", "bf16" (unquantised rows of that dtype), "int8", "int4" (offload/quant.py)
    bandwidth: float  # bytes/s of the format's weight bytes read by a decode GEMV (the fit's slope⁻¹)
    latency: float  # s per segment call (the fit's intercept)
    expert_bytes: int  # one expert of the measured shape, in this format
    t_expert: float  # decode: one expert, one token (median, s)
    t_layer: float  # decode: one layer's top-K experts one after another, one token (median, s)
    t_prefill: float  # prefill: one expert over a chunk of `HostProfile.prefill_tokens` tokens (median, s)
    samples: tuple[tuple[int, float], ...] = ()  # (segment bytes, median s) behind the fit

    def segment_time(self, nbytes: float) -> float:
        """t_host for a segment of `nbytes` weight bytes in this format (one decode token)."""
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class HostProfile:
    """The host's expert throughput per format (`fmoe profile`), per machine: what the host lane costs."""

    kind: str  # "measured" or "estimate" (a documented estimate of another machine, profiles/*.json)
    cpu: str  # the CPU's name (profiling/device.py: device_identity of the CPU)
    total_memory: int  # host RAM, bytes (with the name: which machine)
    threads: int  # torch's intra-op threads the figures were measured with
    capability: str  # torch.backends.cpu.get_cpu_capability(): "AVX2", "AVX512", …
    hidden: int  # H of the measured expert (default: Qwen3-30B-A3B's, 2048)
    intermediate: int  # I of the measured expert (768)
    top_k: int  # K of the measured layer (8)
    prefill_tokens: int  # T of the prefill chunk
    formats: tuple[HostFit, ...]
    note: str = ""

    def fit(self, fmt: str) -> HostFit | None:
        return next((f for f in self.formats if f.format == fmt), None)


@dataclass(frozen=True)
class DeviceProfile:
    device: DeviceIdentity
    link: LinkFit
    free_memory: int | None = None  # bytes free when profiled
    memory_bandwidth: float | None = None  # device memory, bytes/s (roofline estimate of compute)
    torch_version: str | None = None
    cuda_version: str | None = None
    sources: dict[str, str] = field(default_factory=dict)  # figure -> where it comes from (reference profiles)
    host: HostProfile | None = None  # the host's expert compute per format (None: not profiled)


@dataclass(frozen=True)
class ModelIdentity:
    name: str  # model id or directory as the user named it
    config_sha256: str  # of config.json's canonical JSON: a different model (or revision) differs

    def describe(self) -> str:
        return f"{self.name} (config {self.config_sha256[:12]})"


@dataclass(frozen=True)
class LayerTiming:
    index: int  # decoder layer
    moe: bool  # routed experts here (else a dense MLP)
    t_att: float  # T_att: everything of the layer but its MLP/MoE block (s)
    t_moe: float  # T_moe: the MoE block (router + K experts per token, all resident), or the dense MLP (s)


@dataclass(frozen=True)
class PhaseTimings:
    tokens: int  # 1 for a decode step, the prompt length for a prefill
    layers: tuple[LayerTiming, ...]
    t_head: float  # T_head: final norm + LM head (s)


@dataclass(frozen=True)
class ModelTimings:
    model: ModelIdentity
    top_k: int  # K
    decode: PhaseTimings
    prefill: PhaseTimings | None = None
    # h_load (Timings.t_host_load): host work per loaded segment in decode, from MoE layers run again with
    # their experts loaded on demand (profiling/layers.py); None in profiles from before it was measured
    t_host_load: float | None = None
    # h_pf (Timings.t_host_prefetch): host work per MoE layer that prefetches, from decode tokens with
    # and without prefetch (profiling/model.py); None when not measured
    t_host_prefetch: float | None = None
    # a_e (Timings.t_admit): one whole expert copied into the cache on the device; None when not measured
    t_admit: float | None = None
    # c (Timings.t_segment): a split top hit's extra over a whole expert's forward; None when not measured
    t_segment: float | None = None
    # a whole decode step with every expert resident (the engine's and the model's work outside the timed
    # layers included: embedding, hooks, sampling); where measured, T_att and T_head are scaled to it
    t_token: float | None = None
    # one expert's forward for one token alone (profiling/model.py: expert_compute_s); where measured,
    # T_exp is it and the rest of T_moe (router, routing copy, dispatch, combine: work the layer's loads
    # cannot overlap) counts with T_att
    t_expert: float | None = None
    # h_route (Timings.t_host_route): host work from submitting a layer's loads to its first compute
    t_host_route: float | None = None
    # h_sub (Timings.t_host_submit): host work per demand load submitted, before the layer's first compute (part of
    # h_load); None in profiles from before it was measured
    t_host_submit: float | None = None
    # the engine's own link to this device, timed at the copies it issues for this model (one expert, its bottoms at
    # θ 0.5 and 0.75, in the model's expert format; profiling/model.py `engine_link`); None where it was not measured:
    # on the CPU (its link moves nothing), over an emulated link (its figures are its own), in older profiles
    link: LinkFit | None = None
    # the formats the model ran in when timed, `<experts>-<dense>-<dtype>-<activations>` (models/load.py
    # LoadedModel.formats: an int8 expert's forward is not a bf16 one's); None in profiles from before 29 Nov
    formats: str | None = None

    def check_formats(self, formats: str, source: str = "the profile") -> None:
        """One line where these timings are of other formats than `formats` (a profile of the bf16 model given to an
        int8 run would plan it with bf16's compute)."""
        if self.formats is not None and self.formats != formats:
            raise FmoeError(f"{source} times {self.model.name} as {self.formats} (experts-dense-dtype-activations), "
                            f"this run is {formats}: `fmoe profile --model` with this run's formats measures it")

    def load_link(self, device_link: LinkFit) -> LinkFit:
        """The link that prices this model's loads (T_load): the engine's, timed at its own copy sizes, where measured
        (issue 37 §5: on the first H200 the device's quick fit read 39.7 GB/s where an expert's copies ran at 53.5),
        else the device's."""
        return self.link if self.link is not None else device_link

    def timings(self, link: LinkFit, expert_bytes: int, phase: str = "decode") -> Timings:
        """The configurator's Timings: means over the MoE layers; dense layers (DeepSeek's first
        k) run before the first MoE layer's window closes, so they count with T_head."""
        timing = self.decode if phase == "decode" else self.prefill
        if timing is None:
            raise FmoeError(f"the profile has no {phase} timings")
        moe = [layer for layer in timing.layers if layer.moe]
        if not moe:
            raise FmoeError(f"the profile of {self.model.name} times no MoE layer")
        dense = sum(layer.t_att + layer.t_moe for layer in timing.layers if not layer.moe)
        t_att = sum(layer.t_att for layer in moe) / len(moe)
        t_moe = sum(layer.t_moe for layer in moe) / len(moe)
        t_head = timing.t_head + dense
        if phase == "decode" and self.t_expert and self.t_expert * self.top_k < t_moe:
            t_att, t_moe = t_att + t_moe - self.t_expert * self.top_k, self.t_expert * self.top_k
        timed = len(moe) * t_att + t_head
        if phase == "decode" and self.t_token and timed > 0:
            # what a whole step takes beyond the experts is attention, head and the work around them
            scale = max(0.0, self.t_token - len(moe) * t_moe) / timed
            t_att, t_head = t_att * scale, t_head * scale
        return Timings.from_link(
            t_att=t_att,
            t_moe=t_moe,
            t_head=t_head,
            top_k=self.top_k,
            expert_bytes=expert_bytes,
            bandwidth=link.bandwidth,
            latency=link.latency or 0.0,
            t_host_load=self.t_host_load or 0.0,
            t_host_prefetch=self.t_host_prefetch or 0.0,
            t_admit=self.t_admit or 0.0,
            t_segment=self.t_segment or 0.0,
            t_host_route=self.t_host_route or 0.0,
            t_host_submit=self.t_host_submit or 0.0,
        )


@dataclass(frozen=True)
class Profile:
    device: DeviceProfile
    model: ModelTimings | None = None
    created: str = ""
    schema_version: int = PROFILE_SCHEMA_VERSION

    # --- checks --------------------------------------------------------------
    def check_device(self, current: DeviceIdentity, source: str = "the profile") -> None:
        mine = self.device.device
        if mine.kind == "reference":
            raise FmoeError(f"{source} is a reference profile of {mine.name}, not a profile of this device; run `fmoe profile`")
        if (mine.kind, mine.name, mine.total_memory) != (current.kind, current.name, current.total_memory):
            raise FmoeError(f"{source} is for {mine.describe()}, this device is {current.describe()}; run `fmoe profile` again")

    def check_model(self, model: ModelIdentity, source: str = "the profile") -> None:
        if self.model is None:
            raise FmoeError(f"{source} has no model timings; run `fmoe profile --model {model.name}`")
        if self.model.model.config_sha256 != model.config_sha256:
            raise FmoeError(f"{source} times {self.model.model.describe()}, not {model.describe()}; run `fmoe profile --model {model.name}`")

    # --- JSON ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["kind"] = "fmoe-profile"
        data["device"]["link"]["samples"] = [list(s) for s in self.device.link.samples]
        if self.model is not None and self.model.link is not None:
            data["model"]["link"]["samples"] = [list(s) for s in self.model.link.samples]
        if self.device.host is not None:
            host = data["device"]["host"]
            host["formats"] = [{**fit, "samples": [list(s) for s in fit["samples"]]} for fit in host["formats"]]
        if self.model is not None:  # T_exp = T_moe / K, for the reader (recomputed on load)
            for phase in ("decode", "prefill"):
                if data["model"][phase] is not None:
                    for layer in data["model"][phase]["layers"]:
                        layer["t_exp"] = layer["t_moe"] / self.model.top_k if layer["moe"] else None
        return data

    @classmethod
    def from_dict(cls, data: Any, source: str = "profile") -> Profile:
        reader = _Reader(source)
        if not isinstance(data, dict) or data.get("kind") != "fmoe-profile":
            raise FmoeError(f"{source} is not an fmoe profile")
        version = data.get("schema_version")
        if version != PROFILE_SCHEMA_VERSION:
            raise FmoeError(f"{source} has schema version {version!r}; this fmoe reads version {PROFILE_SCHEMA_VERSION}")
        return cls(
            device=reader.device(reader.obj(data, "device")),
            model=None if data.get("model") is None else reader.model(reader.obj(data, "model")),
            created=reader.get(data, "created", str),
            schema_version=version,
        )

    def save(self, path: Path) -> Path:
        return write_atomic(Path(path), json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> Profile:
        return cls.from_dict(read_json(path, "profile", "; run `fmoe profile`"), source=f"profile {path}")


def load_or_set_aside(path: Path) -> Profile:
    """Profile.load of a file fmoe saved itself; one that does not read (truncated, garbage, too large, not a profile,
    an older schema) is moved to `<name>.corrupt-<time>` (`<name>.v<N>-<time>`) (files.set_aside: kept for the user,
    out of the way, and only if it is still the file read) and the FmoeError says where. A newer fmoe's profile (a
    newer schema) is left where it is: that fmoe reads it."""
    source = f"profile {path}"
    try:
        read = os.stat(path)
    except OSError as exc:
        raise FmoeError(f"{source}: {exc.strerror or exc}") from None
    version = None
    try:
        data = read_json(path, "profile", "; run `fmoe profile`")
        version = data.get("schema_version") if isinstance(data, dict) else None
        if not (type(version) is int and version > PROFILE_SCHEMA_VERSION):
            return Profile.from_dict(data, source=source)
    except FmoeError as exc:
        older = type(version) is int and version < PROFILE_SCHEMA_VERSION
        try:
            aside = set_aside(path, f"v{version}" if older else "corrupt", read=read)
        except OSError:
            aside = None
        if aside is None:  # (another process saved a new one meanwhile, or the directory is read-only)
            raise
        raise FmoeError(f"{exc} (moved to {aside.name})") from None
    raise FmoeError(f"{source} has schema version {version}, a newer fmoe's; this fmoe reads version "
                    f"{PROFILE_SCHEMA_VERSION} (left in place)")


def model_identity(name: str, config_path: Path) -> ModelIdentity:
    """A model's identity: its name and the SHA-256 of its config.json as canonical JSON
    (key order and whitespace do not matter; any changed figure does)."""
    config = read_json(config_path, "model config")
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return ModelIdentity(name, hashlib.sha256(canonical.encode()).hexdigest())


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def default_profile_path(key: str | None = None, config_dir: Path | None = None, *, emulated: bool | float = False,
                         quick: bool = False) -> Path:
    """The user's config directory: profiles/device.json, or profiles/<key>.json with a model's timings, where
    `key` is its timings key (models.load.LoadedModel.timings_key: the model's key, where it comes from and its
    fingerprint, so a directory named `demo` is not the demo, then the formats it runs in:
    `demo-6860a8e3d24f.bf16-bf16-float32-float`). A profile of an emulated link is kept apart, one per link
    (`emulated` = its GB/s: `*.emulated-<GB/s>gbps.json`; True: `*.emulated.json`, as saved before): it never
    stands in for the real link. `quick`: the quick estimate a run measured without a profile
    (`*.quick.json`), kept for the next run (fmoe_cli/run.py: find_timings)."""
    base = Path(config_dir) if config_dir is not None else Path(platformdirs.user_config_dir("fmoe"))
    stem = key or "device"
    if quick:
        suffix = ".quick"
    elif emulated is True:
        suffix = ".emulated"
    elif emulated:
        suffix = f".emulated-{float(emulated):g}gbps"
    else:
        suffix = ""
    return base / "profiles" / f"{stem}{suffix}.json"


class _Reader:
    """Typed field access with one-line errors naming the bad field."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, what: str) -> FmoeError:
        return FmoeError(f"{self.source} is malformed: {where} {what}")

    def get(self, data: dict, key: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
        if key not in data or data[key] is None:
            if optional:
                return None
            raise self.fail(f"'{key}'", "is missing")
        value = data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
            raise self.fail(f"'{key}'", f"should be {' or '.join(k.__name__ for k in kinds)}, got {type(value).__name__}")
        if isinstance(value, float) and value < 0:
            raise self.fail(f"'{key}'", "is negative")
        return value

    def obj(self, data: dict, key: str) -> dict:
        return self.get(data, key, dict)

    def link(self, link: dict) -> LinkFit:
        samples = self.get(link, "samples", list)
        if not all(isinstance(s, list) and len(s) == 2 and all(isinstance(x, (int, float)) for x in s) for s in samples):
            raise self.fail("'samples'", "should be [bytes, seconds] pairs")
        bandwidth = self.get(link, "bandwidth", float)
        if bandwidth <= 0:
            raise self.fail("'bandwidth'", "must be > 0")
        return LinkFit(
            kind=self.get(link, "kind", str),
            bandwidth=bandwidth,
            latency=self.get(link, "latency", float, optional=True),
            samples=tuple((int(b), float(t)) for b, t in samples),
            note=self.get(link, "note", str, optional=True) or "",
        )

    def device(self, d: dict) -> DeviceProfile:
        ident = self.obj(d, "device")
        sources = self.get(d, "sources", dict, optional=True) or {}
        return DeviceProfile(
            device=DeviceIdentity(self.get(ident, "kind", str), self.get(ident, "name", str), self.get(ident, "total_memory", int)),
            link=self.link(self.obj(d, "link")),
            free_memory=self.get(d, "free_memory", int, optional=True),
            memory_bandwidth=self.get(d, "memory_bandwidth", float, optional=True),
            torch_version=self.get(d, "torch_version", str, optional=True),
            cuda_version=self.get(d, "cuda_version", str, optional=True),
            sources={str(k): str(v) for k, v in sources.items()},
            host=None if d.get("host") is None else self.host(self.obj(d, "host")),
        )

    def host(self, d: dict) -> HostProfile:
        fits = []
        for f in self.get(d, "formats", list):
            if not isinstance(f, dict):
                raise self.fail("'host.formats'", "should hold objects")
            samples = self.get(f, "samples", list, optional=True) or []
            if not all(isinstance(s, list) and len(s) == 2 and all(isinstance(x, (int, float)) for x in s) for s in samples):
                raise self.fail("'host.formats.samples'", "should be [bytes, seconds] pairs")
            bandwidth = self.get(f, "bandwidth", float)
            if bandwidth <= 0:
                raise self.fail("'host.formats.bandwidth'", "must be > 0")
            fits.append(HostFit(
                self.get(f, "format", str), bandwidth, self.get(f, "latency", float), self.get(f, "expert_bytes", int),
                self.get(f, "t_expert", float), self.get(f, "t_layer", float), self.get(f, "t_prefill", float),
                tuple((int(b), float(t)) for b, t in samples),
            ))
        return HostProfile(
            kind=self.get(d, "kind", str), cpu=self.get(d, "cpu", str), total_memory=self.get(d, "total_memory", int),
            threads=self.get(d, "threads", int), capability=self.get(d, "capability", str),
            hidden=self.get(d, "hidden", int), intermediate=self.get(d, "intermediate", int),
            top_k=self.get(d, "top_k", int), prefill_tokens=self.get(d, "prefill_tokens", int),
            formats=tuple(fits), note=self.get(d, "note", str, optional=True) or "",
        )

    def phase(self, d: dict) -> PhaseTimings:
        layers = []
        for layer in self.get(d, "layers", list):
            if not isinstance(layer, dict):
                raise self.fail("'layers'", "should hold objects")
            layers.append(LayerTiming(
                self.get(layer, "index", int), self.get(layer, "moe", bool),
                self.get(layer, "t_att", float), self.get(layer, "t_moe", float),
            ))
        return PhaseTimings(self.get(d, "tokens", int), tuple(layers), self.get(d, "t_head", float))

    def model(self, d: dict) -> ModelTimings:
        ident = self.obj(d, "model")
        prefill = d.get("prefill")
        return ModelTimings(
            model=ModelIdentity(self.get(ident, "name", str), self.get(ident, "config_sha256", str)),
            top_k=self.get(d, "top_k", int),
            decode=self.phase(self.obj(d, "decode")),
            prefill=None if prefill is None else self.phase(self.obj(d, "prefill")),
            t_host_load=self.get(d, "t_host_load", float, optional=True),
            t_host_prefetch=self.get(d, "t_host_prefetch", float, optional=True),
            t_admit=self.get(d, "t_admit", float, optional=True),
            t_segment=self.get(d, "t_segment", float, optional=True),
            t_token=self.get(d, "t_token", float, optional=True),
            t_expert=self.get(d, "t_expert", float, optional=True),
            t_host_route=self.get(d, "t_host_route", float, optional=True),
            t_host_submit=self.get(d, "t_host_submit", float, optional=True),
            link=None if d.get("link") is None else self.link(self.obj(d, "link")),
            formats=self.get(d, "formats", str, optional=True),
        )
