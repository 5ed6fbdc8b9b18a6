"""Plans: how the expert budget is spent on the device (MoEpic §3.4 notation).

For every MoE layer i: V_i (bytes of top segments cached), C_i (experts cached),
θ_i = k_i / I (the split ratio; k_i top neurons per cached expert). Plus the staging
pool U_b: full-expert slots for bottoms and missed experts.

    U_n + Σ_i V_i + U_b + KV + workspace ≤ V        (docs/architecture.md § Device memory and the link)

The engine takes a Plan; `uniform_plan` makes the configurator-free one and the
configurator (planning/configurator.py) makes the tuned one.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from fmoe_cli.errors import FmoeError
from fmoe_cli.models.config import check_config_file
from fmoe_cli.models.hub import local_config_path
from fmoe_cli.profiling.files import Profile
from fmoe_cli.profiling.machine import surely_no_gpu
from fmoe_cli.types import DEFAULT_DENSE, MiB, ExpertShape, LayerPlan, Plan, check_dense_format, check_dtype, check_expert_format



def layer_plan(shape: ExpertShape, cache_size: int, theta: float) -> LayerPlan:
    k = shape.top_neurons(theta)
    cache_size = cache_size if k > 0 else 0
    return LayerPlan(cache_size * k * shape.neuron_bytes, cache_size, k, k / shape.intermediate)


def min_staging_slots(shape: ExpertShape) -> int:
    return shape.min_staging_slots


def check_budget(shape: ExpertShape, budget_bytes: int, staging_slots: int) -> None:
    need = staging_slots * shape.expert_bytes
    if budget_bytes < need:
        raise FmoeError(
            f"VRAM budget {budget_bytes / MiB:.1f} MiB is too small: the staging pool alone needs "
            f"{staging_slots} expert slots × {shape.expert_bytes / MiB:.2f} MiB = {need / MiB:.1f} MiB"
        )


def uniform_plan(shape: ExpertShape, budget_bytes: int, theta: float = 0.5, source: str = "uniform") -> Plan:
    """MoEpic without the configurator: V_i = V_e / L for every layer, one θ.

    V_e / L is rarely a whole number of cached segments: the C = V_e // segment segments that fit go ⌊C / L⌋ to
    every layer and the C mod L left one more each to layers spread evenly over depth (`spread`), so the budget is
    not left unused (Mixtral bf16, whole experts of 336 MiB: at 6 GiB 150 MiB a layer, one expert in 14 layers; at 24
    GiB 69 experts, where ⌊V_e / L⌋ a layer would place 64 and leave 1.6 GiB idle)."""
    slots = min_staging_slots(shape)
    check_budget(shape, budget_bytes, slots)
    if theta == 0.0:  # no cache: the whole budget is staging (prefetch-only)
        slots = max(slots, budget_bytes // shape.expert_bytes)
        return Plan(tuple(layer_plan(shape, 0, 0.0) for _ in range(shape.num_layers)), slots, shape.expert_bytes, source)
    expert_budget = budget_bytes - slots * shape.expert_bytes  # V_e
    segment = shape.top_neurons(theta) * shape.neuron_bytes
    segments = min(expert_budget // segment, shape.num_experts * shape.num_layers)  # C, at most every expert
    each, left = divmod(segments, shape.num_layers)
    sizes = [each + one for one in spread(left, shape.num_layers)]
    return Plan(tuple(layer_plan(shape, c, theta) for c in sizes), slots, shape.expert_bytes, source)


def spread(count: int, layers: int) -> list[int]:
    """`count` ≤ `layers` ones spread evenly over `layers` (layer i gets one when ⌊(i+1)·c/L⌋ > ⌊i·c/L⌋)."""
    return [(i + 1) * count // layers - i * count // layers for i in range(layers)]


def resident_plan(shape: ExpertShape) -> Plan:
    """Every expert whole on the device (no budget: the reference point)."""
    full = layer_plan(shape, shape.num_experts, 1.0)
    return Plan(tuple(full for _ in range(shape.num_layers)), 0, shape.expert_bytes, "resident", resident=True)


def resident_if_fits(plan: Plan, shape: ExpertShape, budget_bytes: int) -> Plan:
    """The resident plan where the budget holds every expert, else `plan` (for the policies whose table entry says so:
    planning/presets.py `Preset.resident_when_fits`). The resident plan needs no staging pool, so with the bytes for
    every expert a cache would only warm through the link until it held them all (or the configurator split every
    expert to leave room for a staging pool), read the routing on the host in every layer and predict prefetches
    that can never be issued. Resident instead: filled when the engine is configured, the resident fast paths (issue
    37 §1: one CUDA graph a step on a GPU, one kernel call a token on the CPU), its source saying whose plan it is."""
    if plan.resident or budget_bytes < shape.all_experts_bytes:
        return plan
    return replace(resident_plan(shape), source=f"{plan.source}, every expert resident", prefetch=False)


DEFAULT_BUDGET = "auto"  # bench and chat: what fits on this device (the CPU: AUTO_SHARE of all routed experts)
AUTO_SHARE = "25%"
WORKSPACE_BYTES = 512 * MiB  # activations, matmul workspace, a quantised store's dequantisation (offload/quant.py:
# DEQUANT_WORKSPACE_BYTES, 64 MiB) and allocator slack left free on the device
DEFAULT_CONTEXT = 8192  # tokens of KV cache reserved unless --context says (capped by the model's own context)
MIN_DEFAULT_CONTEXT = 2048  # … halved on a small device down to this (resolve_context)
KV_SHARE = 4  # the default context's KV cache takes at most 1/KV_SHARE of the device room beside the weights


def resolve_context(requested: int | None, model_context: int | None, kv_per_token: int,
                    room_bytes: int | None = None) -> int:
    """The context the KV cache is reserved for (`--context N`), and that chat keeps its window inside.

    Asked for: N, if the model's own context allows it (else one line). By default: DEFAULT_CONTEXT
    tokens, at most the model's context, halved (not below MIN_DEFAULT_CONTEXT) while its KV cache
    would take more than 1/KV_SHARE of `room_bytes` (the device memory beside the non-expert weights
    and the workspace; None on the CPU), so that a useful expert cache fits beside it: Mixtral's
    128 KiB per token makes 8k tokens 1 GiB."""
    if requested is not None:
        if requested < 0:
            raise FmoeError(f"--context must be ≥ 0 tokens, got {requested}")  # 0: no KV cache reserved (plan)
        if model_context is not None and requested > model_context:
            raise FmoeError(f"--context {requested} is longer than the model's context of {model_context} tokens")
        return requested
    tokens = DEFAULT_CONTEXT if model_context is None else min(DEFAULT_CONTEXT, model_context)
    if room_bytes is not None:
        while tokens > MIN_DEFAULT_CONTEXT and tokens * kv_per_token * KV_SHARE > room_bytes:
            tokens //= 2
    return tokens


def kv_cache_bytes(config, tokens: int, dtype_bytes: int) -> int:
    """KV cache of `tokens` tokens: layers · KV heads · (K dim + V dim) · dtype bytes per token. Multi-head latent
    attention (DeepSeek-V2/V3, GLM-MoE-DSA, dots3: a kv_lora_rank) caches its latent, one kv_lora_rank row and one
    qk_rope row a layer (transformers 5.24's `cache.update(kv_nope, k_rot)`; 5.23 cached them expanded per head, 71×
    more on DeepSeek-V3), and a sparse-attention indexer its keys, index_head_dim."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    per_layer = getattr(text, "per_layer_config", None)  # a heterogeneous config (dots3, Gemma 4): each layer's own
    layers = per_layer if per_layer is not None else [text] * text.num_hidden_layers
    kinds, window = getattr(text, "layer_types", None), getattr(text, "sliding_window", None)
    total = 0
    for i, layer in enumerate(layers):
        sliding = (isinstance(kinds, list) and i < len(kinds) and "sliding" in str(kinds[i])
                   and type(window) is int and window > 0)  # a sliding-window layer holds its window at most
        total += _kv_bytes(layer, 1, sliding) * (min(tokens, window) if sliding else tokens)
    return total * dtype_bytes


def _kv_bytes(text, layers: int, sliding: bool = False) -> int:
    """K and V elements of one token in `layers` layers shaped as `text` (`sliding`: its sliding-window layers' heads,
    where they have their own: Inkling's swa_num_key_value_heads)."""
    latent = getattr(text, "kv_lora_rank", None)
    if type(latent) is int and latent > 0:  # MLA: the latent and the rotary key, one "head"
        indexer = getattr(text, "index_head_dim", None) if getattr(text, "index_topk", None) else None
        return layers * (latent + (getattr(text, "qk_rope_head_dim", 0) or 0) + (indexer or 0))
    heads = (sliding and getattr(text, "swa_num_key_value_heads", None)) or getattr(text, "num_key_value_heads", None) \
        or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    k_dim = (getattr(text, "qk_nope_head_dim", 0) or 0) + (getattr(text, "qk_rope_head_dim", 0) or 0) or head_dim
    v_dim = getattr(text, "v_head_dim", None) or head_dim
    return layers * heads * (k_dim + v_dim)


def device_room(device, kv_bytes: int, workspace_bytes: int = WORKSPACE_BYTES, non_expert_pending: int = 0):
    """Bytes the experts may take on `device`: its free memory now (torch.cuda.mem_get_info) minus
    the KV cache, the workspace and any non-expert weights not loaded yet. None on the CPU (no limit
    to check: the experts are read from host memory)."""
    import torch  # here, not at the top: cli.py reads this module's defaults and must not import torch

    if getattr(device, "type", device) != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return Room(free, non_expert_pending, kv_bytes, workspace_bytes)


class Room:
    """U_e = free − U_n (still to load) − KV − workspace: what the expert budget may use."""

    def __init__(self, free: int, non_expert: int, kv: int, workspace: int) -> None:
        self.free, self.non_expert, self.kv, self.workspace = free, non_expert, kv, workspace

    @property
    def bytes(self) -> int:
        return self.free - self.non_expert - self.kv - self.workspace

    def why(self) -> str:
        pending = f" − non-expert weights {self.non_expert / MiB:.0f} MiB" if self.non_expert else ""
        return (f"{self.bytes / MiB:.0f} MiB (free {self.free / MiB:.0f} MiB{pending} − KV cache "
                f"{self.kv / MiB:.0f} MiB − workspace {self.workspace / MiB:.0f} MiB)")


def resolve_budget(text: str | None, shape: ExpertShape, room: Room | None) -> int:
    """The expert budget in bytes from --vram-budget: None = the staging pool alone; "auto" = what
    fits (the CPU: AUTO_SHARE of all routed experts); else parse_budget. Refused in one line with
    MiB when it does not fit in `room`."""
    slots_bytes = min_staging_slots(shape) * shape.expert_bytes
    if text is None:
        budget = slots_bytes
    elif _is_auto(text):
        if room is None:
            return parse_budget(AUTO_SHARE, shape.all_experts_bytes)
        budget = min(room.bytes, shape.all_experts_bytes + slots_bytes)
        if budget < slots_bytes:
            raise FmoeError(f"the experts do not fit on this device: the staging pool needs {slots_bytes / MiB:.0f} "
                            f"MiB, the device has {room.why()}")
        return budget
    else:
        budget = parse_budget(text, shape.all_experts_bytes)
    if room is not None and budget > room.bytes:
        raise FmoeError(f"--vram-budget {budget / MiB:.0f} MiB does not fit on this device: it has {room.why()}; "
                        f"use --vram-budget auto or less")
    return budget


def _is_auto(text: str) -> bool:
    return text.strip().lower() == "auto"


def check_budget_text(text: str | None, device=None) -> None:
    """Refuse a --vram-budget that does not read, or a size beyond all the memory of `device`
    (the CPU, or None: this machine's RAM, which holds every expert), before anything slow."""
    if text is None or _is_auto(text):
        return
    budget = parse_budget(text, 1)
    if not text.strip().endswith("%"):
        total, what = device_memory(device)
        if budget > total:
            raise FmoeError(f"--vram-budget {text.strip()} is more than {what} ({total / 1024**3:.1f} GiB)")


def device_memory(device) -> tuple[int, str]:
    """(bytes, what they are): a CUDA device's total memory, else this machine's RAM."""
    if getattr(device, "type", device) == "cuda":
        import torch

        return torch.cuda.get_device_properties(device).total_memory, f"all the memory of {device}"
    import psutil

    return psutil.virtual_memory().total, "this machine's memory"


def check_plan_fits(plan: Plan, room: Room | None) -> None:
    """A plan's caches and staging pool (`resident`: every expert) must fit: else one line with MiB."""
    if room is not None and plan.total_bytes > room.bytes:
        what = "every expert on the device" if plan.resident else "its caches and staging pool"
        raise FmoeError(f"{plan.source} needs {plan.total_bytes / MiB:.0f} MiB for {what}; this device has "
                        f"{room.why()}")

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(%|b|kib|mib|gib|tib|kb|mb|gb|tb|k|m|g|t)?\s*$", re.IGNORECASE)
_UNITS = {
    None: 1, "b": 1,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
    "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
}


def parse_budget(text: str, all_experts_bytes: int) -> int:
    """'6GiB', '512MiB', '1.5G', '25%' (of all routed experts' bytes) or bytes with their unit ('4096B').
    A bare number is refused: '25' would be 25 bytes, never what was meant."""
    m = _SIZE.match(text)
    if not m:
        raise FmoeError(f"cannot read the budget {text!r}: use a size such as 6GiB or 512MiB, a share such as 25%, "
                        "or auto")
    value, unit = float(m.group(1)), (m.group(2) or "").lower() or None
    if unit is None:
        raise FmoeError(f"the budget {text.strip()!r} has no unit: write a size such as {text.strip()}GiB or "
                        f"{text.strip()}MiB, or a share such as {text.strip()}% (plain bytes: {text.strip()}B)")
    if unit == "%":
        if not 0 < value <= 100:
            raise FmoeError(f"a budget share must be in (0, 100]%, got {text!r}")
        return int(all_experts_bytes * value / 100)
    return int(value * _UNITS[unit])


DEFAULT_TAU = 5000  # τ: tokens between re-plans (MoEpic; planning/configurator.py)
# A run's plan drops prefetch only once every layer has this many decode tokens with a recorded prediction
# (planning/configurator.py: a plan without prefetch records none; planning/replan.py plans again after them)
MIN_PREDICTIONS = 32


def check_plan_options(model: str, *, vram: str | None, profile_path: str | None, context: int | None, dtype: str | None,
                       workspace: str, experts: str, trace: str | None, dense: str = DEFAULT_DENSE) -> Profile | None:
    """`fmoe plan`'s options, without torch (the command line checks them before anything heavy is
    imported): one line for the first bad one. Returns the profile read (None without one)."""
    if context is not None:
        resolve_context(context, None, 0)  # a bad number: refused before anything is read
    if vram is not None:  # the device's memory: a size, never a share (that is --vram-budget's)
        if vram.strip().endswith("%"):
            raise FmoeError(f"--vram {vram.strip()}: give the device's memory as a size such as 12GiB "
                            "(a share of the experts is for --vram-budget of bench and chat)")
        parse_budget(vram, 1)
    parse_budget(workspace, 0)
    check_dtype(dtype)
    check_expert_format(experts)
    check_dense_format(dense)
    if trace is not None and not Path(trace).exists():  # (a pipe is read: fmoe_cli/trace.py `seekable`)
        raise FmoeError(f"--trace: no such file: {trace}")
    config = None if model == "demo" else local_config_path(model)
    if config is not None:
        check_config_file(config)
    if vram is None and profile_path is None and surely_no_gpu():  # (else the planning's `_local_gpu_memory` asks)
        raise FmoeError(NO_GPU_TO_PLAN)
    return Profile.load(Path(profile_path)) if profile_path is not None else None


NO_GPU_TO_PLAN = ("no GPU on this machine, so no GPU memory to plan for (`fmoe profile` here measures the CPU): give "
                  "--vram 12GiB, or a GPU's profile such as --profile profiles/rtx-3060-12gb.json")
