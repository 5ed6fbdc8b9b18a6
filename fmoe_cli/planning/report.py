"""`fmoe plan MODEL`: what the configurator would do with this model on a device, from
config.json alone (no weights are read or downloaded).

The model is built on PyTorch's "meta" device (shapes, no memory) to find its routed
experts and count its other weights exactly. The device memory V comes from --vram
(or the profile, or this machine's GPU); the memory that is not the experts' is

    U_n (non-expert weights) + U_b (staging pool) + KV (--context tokens) + workspace,

and the rest, V_e, is what the configurator spends (docs/architecture.md § Device memory and the link, § Statistics, configurator, re-planning). Timings: the
profile's model timings if it has them for this model; else a roofline estimate
(decode reads every weight once at the profile's device-memory bandwidth); else none,
and the plan assumes compute hides no loading.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from transformers import AutoConfig

from fmoe_cli.errors import FmoeError
from fmoe_cli.models.config import check_servable
from fmoe_cli.models.demo import demo_path
from fmoe_cli.models.dense import quantize_dense
from fmoe_cli.models.families import check_is_moe
from fmoe_cli.models.hub import download, local_config_path
from fmoe_cli.models.room import host_ram_free, host_ram_needed
from fmoe_cli.models.load import (
    build_skeleton,
    check_expert_format,
    expert_shape,
    pick_dtype,
    skeleton_non_expert_bytes,
)
from fmoe_cli.planning.autoplan import moepic_configuration, reused_configurations
from fmoe_cli.planning.configurator import (
    LLAMA_CPP, Configuration, DeviceBudget, Timings, cache_hit_rate, host_baselines, price_plan,
)
from fmoe_cli.planning.presets import PlanInputs, settings_for
from fmoe_cli.planning.simulate import predict_policies, tokens_of, trace_stats
from fmoe_cli.planning.plan import (NO_GPU_TO_PLAN, check_plan_options, kv_reserve, min_staging_slots, parse_size,
                                   resolve_context)
from fmoe_cli.types import DEFAULT_DENSE, DEFAULT_EXPERTS, EXPERT_FORMATS, EngineSettings, MiB, ExpertShape, resolve_dense
from fmoe_cli.planning.stats import RoutingStats, default_stats_path, load_or_empty
from fmoe_cli.profiling.files import HostProfile, model_identity
from fmoe_cli.profiling.host import host_format, host_line, host_timings, saved_host_profile
from fmoe_cli.profiling.layers import decoder_layers
from fmoe_cli.trace import Trace, read_trace

GiB = 1024**3
# Without a profile: PCIe 4.0 x16, 16 GT/s × 16 lanes × 128/130 / 8 bits (PCI-SIG), one direction.
ASSUMED_LINK = 16e9 * 16 * 128 / 130 / 8


@dataclass(frozen=True)
class ModelFacts:
    """What config.json tells about a model's memory."""

    name: str
    config_path: Path
    shape: ExpertShape
    non_expert_bytes: int  # U_n
    attention_bytes: int  # one MoE layer's weights without its routed experts (for the roofline)
    head_bytes: int  # LM head + final norm
    kv_bytes: Callable[[int], int]  # the KV cache reserved for a context of N tokens (plan.kv_reserve)
    context_tokens: int | None = None  # the model's own context (max_position_embeddings), if it says
    dense: str = DEFAULT_DENSE  # --dense: U_n, attention_bytes and head_bytes count its targets at their stored size
    dense_unquantised_bytes: int = 0  # U_n with every weight in the compute dtype (= non_expert_bytes when bf16)


def smaller_options(experts: str, dense: str, context: int | None, workspace: int = 0) -> str:
    """What the options could shrink where a model does not fit (DeviceBudget.check): the experts' format (the
    staging pool holds whole experts), the non-expert weights' and the KV cache's reservation, the workspace's."""
    options = []
    if experts in ("bf16", "int8"):
        options.append("--experts int4 or int2 (the staging pool)")
    if dense in ("bf16", "auto"):
        options.append("--dense int8 or int4 (the non-expert weights)")
    elif dense == "int8":
        options.append("--dense int4 (the non-expert weights)")
    options.append("a smaller --context (the KV cache)" if context else "--context (the KV cache)")
    if workspace > 64 * MiB:  # (its default, 512 MiB, is what the activations and the CUDA context take: think twice)
        options.append(f"a smaller --workspace (its {workspace / MiB:.0f} MiB)")
    return "smaller: " + ", ".join(options)


def config_path_of(model: str) -> Path:
    """A local config.json, a model directory holding one, `demo`, or config.json alone from the hub."""
    if model == "demo":
        return demo_path() / "config.json"
    local = local_config_path(model)
    if local is not None:
        return local
    path = download(model, ["config.json"], f"{model}'s config.json", progress=False) / "config.json"
    if not path.exists():
        raise FmoeError(f"{model} has no config.json on the hub")
    return path


def _nbytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def model_facts(model: str, dtype: str | None = None, experts: str = DEFAULT_EXPERTS,
                dense: str = DEFAULT_DENSE, device_type: str = "cuda") -> ModelFacts:
    """`device_type`: the device planned for (a GPU; the CPU for a CPU's profile), which resolves `--dense auto`."""
    path = config_path_of(model)
    check_servable(path, model)  # every field the plan needs, as written, before transformers reads it; a checkpoint
    # fmoe cannot serve (weights stored quantised but in block-scaled fp8, a dense model) is no plan either
    try:
        config = AutoConfig.from_pretrained(path.parent if path.name == "config.json" else path)
    except (ValueError, OSError, KeyError, json.JSONDecodeError) as exc:
        raise FmoeError(f"cannot read {path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    check_is_moe(config, model)
    if dtype in (None, "auto"):  # the run's own choice (load.pick_dtype), whatever the config's dtype: the CPU's
        # float32, a GPU's bfloat16 (float16 on a card without it: not known here, the same bytes)
        torch_dtype = torch.float32 if device_type == "cpu" else torch.bfloat16
    else:
        torch_dtype = pick_dtype(dtype, torch.device("cuda"))
    meta, layers = build_skeleton(config, torch_dtype, model)  # (a model transformers builds no causal LM of: a line)
    check_expert_format(experts)
    shape = expert_shape(layers, torch_dtype, experts)
    unquantised = skeleton_non_expert_bytes(meta, layers)
    dense = resolve_dense(dense, device_type, experts)  # a GPU: auto leaves the dense weights as stored
    quantize_dense(meta, dense)  # (meta: the stored shapes) every size below counts the dense weights as stored
    non_expert = skeleton_non_expert_bytes(meta, layers)
    decoders = decoder_layers(meta)
    first = decoders[layers[0].decoder_index]
    attention = _nbytes(first) - _nbytes(layers[0].experts)
    head = meta.get_output_embeddings()
    norm = getattr(getattr(meta, "model", None), "norm", None)
    head_bytes = _nbytes(head) + (_nbytes(norm) if norm is not None else 0)
    text = config.get_text_config()
    kv_bytes = functools.partial(kv_reserve, config, dtype_bytes=shape.dtype_bytes)
    context = getattr(text, "max_position_embeddings", None)
    return ModelFacts(model, path, shape, non_expert, attention, head_bytes, kv_bytes,
                      context if isinstance(context, int) and context > 0 else None, dense, unquantised)


def plan_timings(facts: ModelFacts, link_bandwidth: float, link_latency: float, profile) -> tuple[Timings, str]:
    """(Timings, where they come from)."""
    shape = facts.shape
    if profile is not None and profile.model is not None:
        profile.check_model(model_identity(facts.name, facts.config_path), source="the profile")
        timed = (profile.model.formats or "").split("-")[0]  # its experts' format (the plan's dtype and dense vary)
        if timed and timed != shape.experts:
            raise FmoeError(f"the profile times {facts.name}'s experts as {timed}, the plan is for --experts "
                            f"{shape.experts}: `fmoe profile --model {facts.name} --experts {shape.experts}` measures them")
        t = profile.model.timings(profile.device.link, shape.expert_bytes)
        host = (f", host work {t.t_host_load * 1e3:.3f} ms per loaded segment" if profile.model.t_host_load is not None
                else "; host work per load not in the profile (0)")
        return replace(t, t_load=link_latency + shape.expert_bytes / link_bandwidth), \
            f"measured per-layer times from the profile{host}"
    t_load = link_latency + shape.expert_bytes / link_bandwidth  # T_load = latency + S_e / bandwidth
    bandwidth = profile.device.memory_bandwidth if profile is not None else None
    if bandwidth:  # decode is memory bound: each weight is read once per token
        t_exp = shape.expert_bytes / bandwidth
        return Timings(facts.attention_bytes / bandwidth, shape.top_k * t_exp, facts.head_bytes / bandwidth, t_load,
                       shape.top_k, t_admit=2 * t_exp), \
            f"roofline estimate at {bandwidth / 1e9:.0f} GB/s device memory (an admission copy reads and writes: 2 × T_exp)"
    return Timings(0.0, 0.0, 0.0, t_load, shape.top_k), "none: assumes compute hides no loading (give --profile)"


def planned_device(profile) -> str:
    """The kind of device a plan is for: the profile's CPU where it is one, else a GPU."""
    return "cpu" if profile is not None and profile.device.device.kind == "cpu" else "cuda"


def plan_host(profile) -> tuple[HostProfile | None, str]:
    """The host lane's figures: the profile's own host part (its machine's), else this machine's saved host
    profile (`fmoe profile`), else none. A CPU's profile has none: the host is the device there, and the runs plan
    no host lane on it (run.py `find_timings`: a GPU only), so the plan must not predict one."""
    if planned_device(profile) == "cpu":
        return None, "none: the profile's device is the CPU (the host is the device: no host lane)"
    if profile is not None and profile.device.host is not None:
        return profile.device.host, f"{profile.device.host.kind}, from the profile"
    saved = saved_host_profile()
    if saved is not None:
        return saved, "measured on this machine (fmoe profile)"
    return None, "none: not profiled (run `fmoe profile`)"


def run_plan(model: str, *, vram: str | None, profile_path: str | None, context: int | None, dtype: str | None,
             as_json: bool, console: Console, workspace: str = "512MiB", experts: str = DEFAULT_EXPERTS,
             trace: str | None = None, dense: str = DEFAULT_DENSE, routing: Trace | None = None) -> dict:
    """routing: the trace already read (`fmoe plan` reads it before torch is imported), else read here."""
    profile = check_plan_options(model, vram=vram, profile_path=profile_path, context=context, dtype=dtype,
                                 workspace=workspace, experts=experts, trace=trace, dense=dense)
    if routing is None and trace is not None:  # a malformed trace is refused before the model is built
        routing = read_trace(trace)
    facts = model_facts(model, dtype, experts, dense, planned_device(profile))  # (a CPU's: --dense auto as runs there)
    shape = facts.shape
    if vram is not None:
        total = parse_size(vram, "--vram", "the device's memory")
        vram_source = "--vram"
    elif profile is not None:
        total, vram_source = profile.device.device.total_memory, "the profile's device"
    else:
        total, vram_source = _local_gpu_memory(), "this machine's GPU"
    if profile is not None:
        link = profile.device.link
        bandwidth, latency = link.bandwidth, link.latency or 0.0
        link_source = f"{link.kind} {bandwidth / 1e9:.1f} GB/s from the profile" + (f" ({link.note})" if link.note else "")
    else:
        bandwidth, latency = ASSUMED_LINK, 0.0
        link_source = f"assumed PCIe 4.0 x16, {bandwidth / 1e9:.1f} GB/s (no profile)"
    timings, timing_source = plan_timings(facts, bandwidth, latency, profile)
    host, host_source = plan_host(profile)
    timings = host_timings(timings, host, shape)  # the host lane's figures for this model's format, if profiled

    slots = min_staging_slots(shape)
    reserve = parse_size(workspace, "--workspace", "the device memory kept for activations")
    given_context = context
    context = resolve_context(context, facts.context_tokens, facts.kv_bytes,
                              total - facts.non_expert_bytes - reserve if total else None)
    device = DeviceBudget(total, facts.non_expert_bytes, slots * shape.expert_bytes, facts.kv_bytes(context), reserve)
    device.check(smaller_options(experts, facts.dense, given_context, reserve))
    sequences = None
    if routing is not None:  # the plan is made from the trace's statistics: the plan the simulation runs
        check_trace_fits(routing, shape)
        sequences = tokens_of(routing)
        stats = trace_stats(sequences, shape)
        stats_source = f"{routing.num_tokens} tokens of the trace {routing.path} (the simulation's statistics)"
    else:
        stats_path = default_stats_path(model, model_path=facts.config_path)
        stats = load_or_empty(model, shape.num_layers, shape.num_experts, shape.top_k, stats_path)
        stats_source = f"{stats.tokens} recorded tokens ({stats_path})"
    if stats.tokens == 0:
        stats = RoutingStats.assume_uniform(model, shape.num_layers, shape.num_experts, shape.top_k)
        stats_source = "uniform routing (none recorded)"
    budget = device.expert_budget + device.staging
    with reused_configurations():  # the report's configured plan is the TPOT table's moepic or hybrid: priced once
        # with the host's figures the per-layer plan is `hybrid`'s: each layer's misses and bottoms fetched or on the host
        config = moepic_configuration(shape, budget, timings, stats, model=model, host_lane=timings.has_host)

        report = plan_report(facts, device, config, timings, stats, context, host_free=host_ram_free(),
                             sources={"vram": vram_source, "link": link_source, "timings": timing_source,
                                      "statistics": stats_source})
        report["host_compute"] = {"source": host_source, "line": host_line(host, host_format(shape)),
                                  "profile": None if host is None else asdict(host)}
        report["host_lane"] = timings.has_host  # the per-layer plan chose each layer's path (hybrid's plan)
        report["configured_policy"] = "hybrid" if timings.has_host else "moepic"
        report["tpot"] = predicted_tpot(shape, budget, timings, bandwidth, latency, stats, routing, model, sequences)
    if as_json:
        print(json.dumps(report))
    else:
        render(report, console)
    return report


TPOT_POLICIES = ("moepic", "lru", "lfu", "uniform", "cache-only", "prefetch-only", "ondemand", "resident")
HOST_POLICIES = ("hybrid",)  # with the host's figures (the host lane), beside llama.cpp's pattern (LLAMA_CPP)


def check_trace_fits(routing, shape: ExpertShape) -> None:
    """A trace (fmoe_cli.trace.Trace) of the model's MoE layers and experts, else a one-line error."""
    if len(routing.layers) != shape.num_layers or routing.num_experts > shape.num_experts:
        raise FmoeError(f"--trace {routing.path}: {len(routing.layers)} layers × {routing.num_experts} experts, "
                        f"the model has {shape.num_layers} × {shape.num_experts}")


def predicted_tpot(shape: ExpertShape, budget: int, timings: Timings, bandwidth: float, latency: float,
                   stats: RoutingStats, routing, model: str, sequences=None) -> dict:
    """Predicted TPOT per policy at the same budget (the `tpot` part of the report).

    With a routing trace: the event simulation of the engine's decisions (planning/simulate.py)
    over its tokens (`sequences`: simulate.tokens_of(routing)), with the trace's rankings or, for a
    vLLM trace, the routing-only `eam` predictor, `moepic` planned from `stats` (the trace's own).
    Without one: the configurator's model (Eq. 5–11) priced for each policy's plan over the saved
    statistics (or uniform routing): compute plus predicted exposed load time.

    Per policy: `hit_rate` counts activated experts whose top segment was on the device (a top hit
    still loads its bottom), `whole_hit_rate` those whose whole expert was (nothing loaded)."""
    if routing is not None:  # fmoe_cli.trace.Trace
        trace = routing.path
        check_trace_fits(routing, shape)
        sequences = tokens_of(routing) if sequences is None else sequences
        policies = tpot_policies(timings)
        extra = {LLAMA_CPP_ROW: host_baselines(shape, budget)[LLAMA_CPP]} if timings.has_host else {}
        err = Console(stderr=True)
        with Progress(transient=True, console=err, disable=not err.is_terminal) as bar:  # off a terminal: no stray line
            task = bar.add_task("simulating", total=len(policies))

            def step(name: str) -> None:
                bar.update(task, description=f"simulating {name}", completed=policies.index(name))

            results = predict_policies(shape, budget, timings, bandwidth, latency, sequences=sequences,
                                       policies=policies, progress=step, plans=extra, stats=stats)
        ranked = any(t.predicted is not None for seq in sequences for t in seq)
        how = (f"simulated: the engine's decisions over {routing.num_tokens} tokens of {trace} "
               f"({'the trace’s prefetch rankings' if ranked else 'routing-only predictor eam'})")
        return {"how": how, "policies": {name: {
            "tpot_s": r.tpot_s, "hit_rate": r.hit_rate, "whole_hit_rate": r.whole_hit_rate,
            "exposed_s": r.exposed_s_per_token, "bytes_per_token": r.bytes_per_token, "host_s": r.host_s_per_token,
            "plan": r.plan}
            for name, r in results.items()}}
    compute = shape.num_layers * (timings.t_att + timings.t_moe) + timings.t_head
    out = {}
    plans = {name: settings_for(name, PlanInputs(shape, budget, timings, stats, model, min_predictions=0)) for name in tpot_policies(timings)}
    if timings.has_host:
        plans[LLAMA_CPP_ROW] = EngineSettings(LLAMA_CPP_ROW, host_baselines(shape, budget)[LLAMA_CPP], "lcp", False,
                                              0.0, 0.0)
    for name, settings in plans.items():
        if settings.plan.resident:  # every expert on the device: its compute, where the budget holds them all
            out[name] = {"tpot_s": compute, "hit_rate": 1.0, "whole_hit_rate": 1.0, "exposed_s": 0.0, "host_s": 0.0,
                         "plan": settings.plan.summary(), "fits": budget >= shape.all_experts_bytes}
            continue
        split = price_plan(settings.plan, stats, timings, shape, max_prefetch=shape.top_k if settings.prefetch else 0)
        hit = sum(c.hit_rate for c in split.layers) / len(split.layers)
        whole = sum(c.hit_rate for c in split.layers if c.split == 1.0) / len(split.layers)
        out[name] = {"tpot_s": compute + split.total_exposed, "hit_rate": hit, "whole_hit_rate": whole,
                     "exposed_s": sum(0.0 if c.host else c.exposed for c in split.layers),
                     "host_s": sum(c.host_s for c in split.layers), "plan": settings.plan.summary()}
    how = ("model: the configurator's Eq. 5–11 for each policy's plan over "
           + ("uniform routing (no statistics recorded; give --trace for a simulation)" if stats.uniform
              else f"{stats.tokens} recorded tokens of statistics"))
    return {"how": how, "policies": out}


LLAMA_CPP_ROW = "llama.cpp pattern"  # every routed expert on the host, the rest on the device (--cpu-moe)


def tpot_policies(timings: Timings) -> tuple[str, ...]:
    """The policies whose TPOT `fmoe plan` predicts: with the host's figures, `hybrid` too."""
    return TPOT_POLICIES[:1] + (HOST_POLICIES if timings.has_host else ()) + TPOT_POLICIES[1:]


def _local_gpu_memory() -> int:
    if not torch.cuda.is_available():
        raise FmoeError(NO_GPU_TO_PLAN)
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def host_ram_report(facts: ModelFacts, free: int) -> dict:
    """Host RAM a load of the model needs in each expert format (from config.json alone), and what is free.
    `needed` is the load's peak: with --dense int8/int4 each dense weight is read in the compute dtype, then
    quantised (`non_expert_loading`); the loaded model keeps `non_expert`."""

    formats = {}
    for name in EXPERT_FORMATS:
        shape = replace(facts.shape, experts=name)
        need = host_ram_needed(shape, facts.dense_unquantised_bytes)
        formats[name] = {"experts": shape.all_experts_bytes, "non_expert": facts.non_expert_bytes,
                         "non_expert_loading": facts.dense_unquantised_bytes, "needed": need, "fits": need <= free}
    return {"free": free, "chosen": facts.shape.experts, "formats": formats}


def plan_report(facts: ModelFacts, device: DeviceBudget, config: Configuration, timings: Timings,
                stats: RoutingStats, context: int, sources: dict, host_free: int) -> dict:
    shape = facts.shape
    # hit_rate: H_i, activated experts whose top segment is cached; whole_hit_rate: … whose whole expert is
    # (θ_i = 1); loads: experts' worth of bytes still to load per token, K·(1 − H_i·θ_i) (prefetched or not)
    layers = [{
        "layer": i, "vram_bytes": c.vram_bytes, "cache_size": c.cache_size, "split": c.split,
        "top_neurons": c.top_neurons, "hit_rate": c.hit_rate, "whole_hit_rate": c.hit_rate if c.split == 1.0 else 0.0,
        "loads": shape.top_k * (1.0 - c.hit_rate * c.split), "hidden": c.hidden, "prefetches": c.prefetches,
        "exposed_s": c.exposed, "misses_and_bottoms": "host" if c.host else "link", "host_s": c.host_s,
    } for i, c in enumerate(config.split.layers)]
    everything = facts.non_expert_bytes + shape.all_experts_bytes + device.kv_cache + device.workspace
    return {
        "model": facts.name,
        "shape": {"moe_layers": shape.num_layers, "experts": shape.num_experts, "top_k": shape.top_k,
                  "hidden": shape.hidden, "intermediate": shape.intermediate, "dtype_bytes": shape.dtype_bytes,
                  "expert_bytes": shape.expert_bytes, "expert_format": shape.experts, "dense_format": facts.dense},
        "dense": {"format": facts.dense, "non_expert_bytes": facts.non_expert_bytes,
                  "unquantised_bytes": facts.dense_unquantised_bytes},
        "host": host_ram_report(facts, host_free),
        "uniform_routing": stats.uniform,
        "sources": sources,
        "timings": {"t_att": timings.t_att, "t_moe": timings.t_moe, "t_exp": timings.t_exp, "t_head": timings.t_head,
                    "t_load": timings.t_load},
        "memory": {"device": device.total, "non_expert": device.non_expert, "staging": device.staging,
                   "staging_slots": config.plan.staging_slots, "kv_cache": device.kv_cache, "context_tokens": context,
                   "workspace": device.workspace, "expert_budget": device.expert_budget,
                   "cached": config.plan.cache_bytes, "all_experts": shape.all_experts_bytes,
                   "whole_model_fits": everything <= device.total},
        "layers": layers,
        "configurator": {"chosen": config.chosen, "plan": config.plan.summary(), "prefetch": config.plan.prefetch,
                         "candidates": {name: total for name, total in config.candidates},
                         "why": why_plan(config, timings, stats, shape)},
        "totals": {"cached_experts": sum(c.cache_size for c in config.split.layers),
                   "cached_fraction": config.plan.cache_bytes / shape.all_experts_bytes,
                   "mean_hit_rate": sum(config.hit_rates) / len(layers),
                   "exposed_s_per_token": config.total_exposed, "iterations": config.iterations},
    }


def why_plan(config: Configuration, timings: Timings, stats: RoutingStats, shape: ExpertShape) -> str:
    """Why the configured plan is what it is, in one sentence from the model's own figures: which priced
    candidate won, and, when it caches nothing, what a cache would cost against what it saves."""
    prices = dict(config.candidates)
    best = min(prices.values()) if prices else config.total_exposed
    text = f"{config.chosen}: the least predicted exposed load time of the {len(prices)} plans priced"
    if config.plan.cache_bytes > 0:
        return text
    cached = {name: total for name, total in prices.items() if "θ = 0" not in name and "no cache" not in name}
    runner = min(cached, key=cached.get) if cached else None
    if runner is not None:
        text += f"; it caches nothing: the best plan with a cache ({runner}) is {(cached[runner] - best) * 1e3:.1f} ms per token slower"
    hit = sum(float(cache_hit_rate(stats.curves(i).hit, np.array([1]), shape.top_k)[0])
              for i in range(shape.num_layers)) / shape.num_layers  # H_i(1) of a one-slot cache, mean
    k = shape.top_k
    # one slot admits at most one miss a token, none when it was hit: min(K, 1) − K·H (configurator.py: G_i)
    saved, admitted = k * hit * timings.t_load, max(0.0, 1 - k * hit) * timings.t_admit
    if admitted >= saved:
        text += (f"; one expert cached per layer would be hit {hit:.2f} of the time, saving K·H·T_load = "
                 f"{saved * 1e3:.2f} ms of loading per layer and token, while the misses' admissions into the cache "
                 f"cost (1 − K·H)·a_e = {admitted * 1e3:.2f} ms")
    return text


def _size(nbytes: int) -> str:
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= GiB else f"{nbytes / MiB:.1f} MiB"


def _dense_label(dense: dict) -> str:
    """'int4 (non-expert weights 1.2 GiB, 3.1 GiB unquantised)', or 'bf16 (unquantised, 3.1 GiB)'."""
    if dense["non_expert_bytes"] == dense["unquantised_bytes"]:
        return f"{dense['format']} (non-expert weights unquantised, {_size(dense['non_expert_bytes'])})"
    return (f"{dense['format']} (non-expert weights {_size(dense['non_expert_bytes'])}, "
            f"{_size(dense['unquantised_bytes'])} unquantised)")


HIT_LEGEND = ("top hit: activated experts whose top segment (θ_i of the expert) is on the device, its bottom still "
              "loaded; whole hit: the whole expert is, nothing loaded; loads/token: experts' worth of bytes to load, "
              "K·(1 − H_i·θ_i), hidden by prefetch or exposed")


def render(report: dict, console: Console) -> None:
    s, m, t = report["shape"], report["memory"], report["totals"]
    console.print(f"{report['model']}: {s['moe_layers']} MoE layers × {s['experts']} experts (top-{s['top_k']}), "
                  f"one expert {s['expert_bytes'] / MiB:.1f} MiB ({s['expert_format']}), all experts "
                  f"{_size(m['all_experts'])}", highlight=False)
    console.print(f"formats: experts {s['expert_format']} · dense {_dense_label(report['dense'])}", highlight=False)
    host = report["host"]
    needs = " · ".join(f"{name} {_size(f['needed'])}" + ("" if f["fits"] else " (does not fit)")
                       + (" ← --experts" if name == host["chosen"] else "") for name, f in host["formats"].items())
    console.print(f"host RAM to load (expert store + other weights): {needs}; free here {_size(host['free'])}",
                  highlight=False)
    for key, value in report["sources"].items():
        if key == "vram":
            value = f"{m['device'] / MiB:,.0f} MiB (from {value})"
        console.print(f"{key}: {value}", highlight=False)
    if report.get("host_compute"):
        console.print(report["host_compute"]["line"] + f" [{report['host_compute']['source']}]", highlight=False)
    if report["uniform_routing"]:
        console.print("assumes uniform routing: no statistics recorded for this model yet "
                      "(chat with it and plan again)", highlight=False)
    hybrid = bool(report.get("host_lane"))
    table = Table(title=f"per-layer plan of {report.get('configured_policy', 'moepic')} (predicted by the configurator's model)")
    columns = ("layer", "V_i MiB", "C_i", "θ_i", "top hit H_i", "whole hit", "loads/token", "exposed load ms") + (
        ("misses, bottoms", "host ms") if hybrid else ())
    for col in columns:
        table.add_column(col, justify="right")
    for layer in report["layers"]:
        host = layer["misses_and_bottoms"] == "host"
        row = [str(layer["layer"]), f"{layer['vram_bytes'] / MiB:.1f}", str(layer["cache_size"]),
               f"{layer['split']:.3f}", f"{layer['hit_rate']:.2f}", f"{layer['whole_hit_rate']:.2f}",
               f"{layer['loads']:.2f}", "–" if host else f"{layer['exposed_s'] * 1e3:.3f}"]
        if hybrid:
            row += ["host" if host else "link", f"{layer['host_s'] * 1e3:.3f}"]
        table.add_row(*row)
    console.print(table)
    console.print(HIT_LEGEND, highlight=False)
    console.print(
        f"device {m['device'] / MiB:.0f} MiB = non-expert weights {m['non_expert'] / MiB:.0f} + staging pool "
        f"{m['staging'] / MiB:.0f} ({m['staging'] // s['expert_bytes']} experts) + KV cache {m['kv_cache'] / MiB:.0f} "
        f"({m['context_tokens']} tokens) + workspace {m['workspace'] / MiB:.0f} + expert cache budget "
        f"{m['expert_budget'] / MiB:.0f} MiB"
        + (f" (the plan caches nothing: it uses the budget as {m['staging_slots']} staging slots)"
           if m["staging_slots"] * s["expert_bytes"] > m["staging"] else ""), highlight=False)
    tpot = report.get("tpot")
    if tpot:
        untimed = not report["timings"]["t_moe"]  # no profile: no compute timed, a token's time is its loads alone
        table = Table(title=f"predicted TPOT per policy at this budget ({tpot['how']})" + (
            "; no compute timed (give --profile): the loads a token waits for, not a TPOT" if untimed else ""))
        for col in ("policy", "load ms" if untimed else "TPOT ms", "top hit", "whole hit", "exposed load ms",
                    "host ms"):
            table.add_column(col, justify="left" if col == "policy" else "right")
        for name, r in tpot["policies"].items():
            if r.get("fits") is False:  # (resident: what it would take, were every expert on the device)
                name = f"{name} (does not fit)"
            table.add_row(name, f"{r['tpot_s'] * 1e3:.1f}", f"{r['hit_rate']:.2f}", f"{r.get('whole_hit_rate', 0.0):.2f}",
                          f"{r['exposed_s'] * 1e3:.1f}", f"{r.get('host_s', 0.0) * 1e3:.1f}")
        console.print(table)
    chooser = report["configurator"]
    console.print(f"moepic's plan: {chooser['why']}. Predicted exposed ms per token: "
                  + " · ".join(f"{name} {total * 1e3:.1f}" for name, total in chooser["candidates"].items()),
                  highlight=False)
    simulated = tpot["policies"].get("moepic") if tpot and tpot["how"].startswith("simulated") else None
    console.print(
        f"fits: {t['cached_experts']} expert tops cached, {m['cached'] / MiB:.0f} MiB = {100 * t['cached_fraction']:.1f}% "
        f"of all expert bytes; the configurator's model: mean top hit {t['mean_hit_rate']:.2f}, exposed load time "
        f"{t['exposed_s_per_token'] * 1e3:.2f} ms per token"
        + ("" if simulated is None else f"; simulated over the trace (the moepic row): top hit "
           f"{simulated['hit_rate']:.2f}, exposed load time {simulated['exposed_s'] * 1e3:.2f} ms per token")
        + ("; the whole model would fit: offloading is not needed" if m["whole_model_fits"] else ""),
        highlight=False)
