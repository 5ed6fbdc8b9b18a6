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
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from fmoe_cli.errors import FmoeError
from fmoe_cli.models.config import check_config_file
from fmoe_cli.models.hub import local_config_path
from fmoe_cli.profiling.files import Profile
from fmoe_cli.profiling.machine import surely_no_gpu
from fmoe_cli.types import (DEFAULT_DENSE, MiB, ExpertShape, LayerPlan, Plan, check_dense_format, check_dtype,
                            check_expert_format, static_cache_capacity)



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


def resolve_context(requested: int | None, model_context: int | None, kv_bytes: Callable[[int], int] | None,
                    room_bytes: int | None = None) -> int:
    """The context the KV cache is reserved for (`--context N`), and that chat keeps its window inside.

    Asked for: N, if the model's own context allows it (else one line). By default: DEFAULT_CONTEXT
    tokens, at most the model's context, halved (not below MIN_DEFAULT_CONTEXT) while its KV cache
    (`kv_bytes(tokens)`: kv_cache_bytes, not a multiple of one token's where a window or a fixed state holds it)
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
        while tokens > MIN_DEFAULT_CONTEXT and kv_bytes(tokens) * KV_SHARE > room_bytes:
            tokens //= 2
    return tokens


def kv_reserve(config, context: int, dtype_bytes: int) -> int:
    """The device memory reserved for the KV cache of a `context`-token conversation: its StaticCache's bytes
    (`kv_cache_bytes` of `static_cache_capacity`: --context 1000 holds 1024 positions)."""
    return kv_cache_bytes(config, static_cache_capacity(context), dtype_bytes)


def kv_cache_bytes(config, tokens: int, dtype_bytes: int) -> int:
    """The bytes transformers' StaticCache (the GPU's decode cache, generate.py DecodeGraph) holds for `tokens`
    positions, layer by layer as it builds them (`cache_layers`, `CACHE_LAYER_KINDS`): the keys and values of every
    position, of a sliding window's last positions at most, or of none, and a linear-attention or state-space layer's
    fixed-size state (`MIXER_STATES`), the same at any length. A token's keys and values: KV heads · (K dim + V dim)
    (`_kv_elements`); multi-head latent attention (DeepSeek-V2/V3, GLM-MoE-DSA, dots3: a kv_lora_rank) caches its
    latent, one kv_lora_rank row and one qk_rope row a layer (transformers 5.24's `cache.update(kv_nope, k_rot)`; 5.23
    cached them expanded per head, 71× more on DeepSeek-V3), and a sparse-attention indexer its keys (`INDEXER_KEYS`).
    Equal to the StaticCache's bytes for every family the survey serves exactly (tests/test_families.py)."""
    total = 0
    for layer, kind, window in cache_layers(config):
        keeps = CACHE_LAYER_KINDS.get(kind, CacheLayerKind("all"))
        sliding = keeps.positions == "window" and window is not None
        state = fixed_state_bytes(layer, sliding, dtype_bytes) if keeps.fixed_state else 0
        if state is None:  # a mixer MIXER_STATES does not know: counted as full attention, as before it had a table
            keeps, state = CacheLayerKind("all"), 0
        if keeps.positions is not None:
            per_token = _kv_elements(layer, sliding) * dtype_bytes + (indexer_key_bytes(layer, dtype_bytes)
                                                                      if keeps.indexer_keys else 0)
            total += per_token * (min(tokens, window) if sliding else tokens)
        total += state
    return total


class CacheLayerKind(NamedTuple):
    """What a layer of transformers' StaticCache keeps."""

    positions: str | None  # keys and values of every position ("all"), of its window's last ones at most ("window")
    indexer_keys: bool = False  # a sparse-attention indexer's keys beside them, a position each (`INDEXER_KEYS`)
    fixed_state: bool = False  # a linear-attention or state-space mixer's fixed-size state (`MIXER_STATES`)


# The kinds of layer in transformers' StaticCache (5.24's cache_utils.STATIC_LAYER_TYPE_MAPPING). A kind not here is
# counted as full attention.
CACHE_LAYER_KINDS: dict[str, CacheLayerKind] = {
    "full_attention": CacheLayerKind("all"),
    "indexed_attention": CacheLayerKind("all", indexer_keys=True),
    "sliding_attention": CacheLayerKind("window"),
    "chunked_attention": CacheLayerKind("window"),  # its attention_chunk_size positions
    "linear_attention": CacheLayerKind(None, fixed_state=True),  # Qwen3-Next's gated delta rule, Jamba's mamba …
    "conv": CacheLayerKind(None, fixed_state=True),  # LFM2's short convolution
    "hybrid": CacheLayerKind("all", fixed_state=True),  # Inkling: short convolutions around its attention
    "hybrid_sliding": CacheLayerKind("window", fixed_state=True),
    "dummy": CacheLayerKind(None),  # a layer that reads another's keys and values (Gemma 4's shared KV), or no attention
}
# The field of an indexer's key width: its static cache keeps one key of that width a position (StaticIndexedLayer),
# in the model's dtype …
INDEXER_KEYS = ("index_head_dim",  # DeepSeek-V3.2, GLM-MoE-DSA, dots3
                "indexer_head_dim")  # Qwen4-exp
# … or in float32: dots3 ropes its indexed layers in float32 (modeling_dots3_note: `inputs_embeds.float()` for them)
FLOAT32_INDEXER_KEYS = frozenset({"dots3_note_text"})


def indexer_key_bytes(layer, dtype_bytes: int) -> int:
    """One position's indexer key in a layer shaped as `layer`."""
    width = next((getattr(layer, field) for field in INDEXER_KEYS if getattr(layer, field, None)), 0)
    return width * (FLOAT32 if getattr(layer, "model_type", None) in FLOAT32_INDEXER_KEYS else dtype_bytes)


def cache_layers(config) -> list[tuple[object, str, int | None]]:
    """(the layer's config, its kind in CACHE_LAYER_KINDS, its window or None) for each layer of the StaticCache that
    transformers builds for `config`: its own reading of layer_types (5.24's cache_utils.get_layer_types_and_kwargs:
    the kinds inferred where a config has none, shared-KV layers as "dummy"), each layer's config its own in a
    heterogeneous config (dots3, Gemma 4: per_layer_config). A config that is not transformers' (the tests'
    stand-ins): full attention in every layer."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if not hasattr(text, "per_layer_config"):
        return [(text, "full_attention", None)] * text.num_hidden_layers
    from transformers.cache_utils import get_layer_types_and_kwargs

    kinds, kwargs = get_layer_types_and_kwargs(text)
    return [(layer, kind, each.get("sliding_window")) for layer, kind, each in zip(text.per_layer_config, kinds, kwargs)]


def _kv_elements(layer, sliding: bool = False) -> int:
    """K and V elements of one token in one layer shaped as `layer` (`sliding`: a sliding-window layer, with its own
    heads where its family gives it some: `SLIDING_HEADS`)."""
    latent = getattr(layer, "kv_lora_rank", None)
    if type(latent) is int and latent > 0:  # MLA: the latent and the rotary key, one "head"
        return latent + (getattr(layer, "qk_rope_head_dim", 0) or 0)
    heads, head_dim = attention_heads(layer, sliding)
    k_dim = (getattr(layer, "qk_nope_head_dim", 0) or 0) + (getattr(layer, "qk_rope_head_dim", 0) or 0) or head_dim
    v_dim = getattr(layer, "v_head_dim", None) or head_dim
    return heads * (k_dim + v_dim)


# A sliding-window layer's KV heads where its family gives them their own: (config field of its KV heads, of its head
# dim; or a factor on the full layers' KV heads that its modeling file applies).
SLIDING_HEADS: dict[str, tuple[str, str] | int] = {
    "inkling_text": ("swa_num_key_value_heads", "swa_head_dim"),
    "mimo_v2_flash": 2,  # "SWA layers double the kv heads vs full-attention" (modeling_mimo_v2_flash.py)
}


def attention_heads(layer, sliding: bool = False) -> tuple[int, int]:
    """(KV heads, head dim) of one attention layer shaped as `layer`."""
    heads = getattr(layer, "num_key_value_heads", None) or layer.num_attention_heads
    head_dim = getattr(layer, "head_dim", None) or layer.hidden_size // layer.num_attention_heads
    own = SLIDING_HEADS.get(getattr(layer, "model_type", None)) if sliding else None
    if isinstance(own, int):
        heads *= own
    elif own is not None:
        heads, head_dim = getattr(layer, own[0], None) or heads, getattr(layer, own[1], None) or head_dim
    return heads, head_dim


FLOAT32 = 4  # bytes: a scan's recurrent state is float32 whatever the model's dtype (transformers 5.24's torch
# paths of the gated delta rule and of mamba's scans, measured in bf16; a GPU kernel that kept it in the model's dtype
# would hold half of it: the reserve over by that, never under)


@dataclass(frozen=True)
class MixerState:
    """The fixed-size state a linear-attention or state-space mixer keeps in its cache layer (transformers 5.24's
    LinearAttentionLayer), whatever the tokens: conv states [channels, kernel] (the last `kernel` inputs of the causal
    convolution, in the model's dtype) and a recurrent state (float32). Sizes are products of config fields (a number
    stands for itself): channels a sum of such products, the recurrent state one."""

    known_by: str  # the config field that says a model has this mixer
    conv_channels: tuple[tuple[str | int, ...], ...]
    conv_kernel: str
    recurrent: tuple[str | int, ...] = ()
    conv_float32: bool = False  # the conv states float32 whatever the model's dtype
    conv_keys_values: bool = False  # the layer's keys and values each through a conv of their own (Inkling)


# Each mixer's state, by the first field a config has (the tiny survey configs hold them to a StaticCache's bytes,
# tests/test_families.py).
MIXER_STATES = (
    # Qwen3-Next, Qwen3.5-MoE, Qwen4-exp (GatedDeltaNet): q, k and v through the conv; one key dim × value dim matrix
    # a value head
    MixerState("linear_num_value_heads",
               conv_channels=((2, "linear_num_key_heads", "linear_key_head_dim"),
                              ("linear_num_value_heads", "linear_value_head_dim")),
               conv_kernel="linear_conv_kernel_dim",
               recurrent=("linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")),
    # GraniteMoeHybrid (mamba2): x (expand · hidden) and the groups' B and C through the conv; d_head × d_state a head
    MixerState("mamba_d_head",
               conv_channels=(("mamba_expand", "hidden_size"), (2, "mamba_n_groups", "mamba_d_state")),
               conv_kernel="mamba_d_conv", recurrent=("mamba_n_heads", "mamba_d_head", "mamba_d_state")),
    # Jamba (mamba): x (expand · hidden) through the conv; d_state a channel
    MixerState("mamba_dt_rank", conv_channels=(("mamba_expand", "hidden_size"),), conv_kernel="mamba_d_conv",
               recurrent=("mamba_expand", "hidden_size", "mamba_d_state")),
    # LFM2-MoE: a short convolution of the hidden state, no recurrence
    MixerState("conv_L_cache", conv_channels=(("hidden_size",),), conv_kernel="conv_L_cache"),
    # Inkling: short convolutions, float32, of the attention's and the MLP's inputs (hidden) and of its keys and values
    MixerState("sconv_kernel_size", conv_channels=((2, "hidden_size"),), conv_kernel="sconv_kernel_size",
               conv_float32=True, conv_keys_values=True),
)


def fixed_state_bytes(layer, sliding: bool, dtype_bytes: int) -> int | None:
    """The state a linear-attention, state-space or short-convolution layer shaped as `layer` keeps, whatever the
    tokens (`MIXER_STATES`); None for a mixer not in the table."""
    mixer = next((m for m in MIXER_STATES if hasattr(layer, m.known_by)), None)
    if mixer is None:
        return None
    channels = sum(_product(layer, fields) for fields in mixer.conv_channels)
    if mixer.conv_keys_values:
        heads, head_dim = attention_heads(layer, sliding)
        channels += 2 * heads * head_dim
    conv = channels * getattr(layer, mixer.conv_kernel) * (FLOAT32 if mixer.conv_float32 else dtype_bytes)
    return conv + (_product(layer, mixer.recurrent) * FLOAT32 if mixer.recurrent else 0)


def _product(layer, fields: tuple[str | int, ...]) -> int:
    """Π of config fields (a number stands for itself)."""
    value = 1
    for field in fields:
        value *= field if isinstance(field, int) else getattr(layer, field)
    return int(value)


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


def parse_size(text: str, option: str, what: str, note: str = "") -> int:
    """A size an option gives (`fmoe plan`'s --vram, --workspace): '12GiB', '512MiB', bytes with their unit; neither a
    share nor auto (`what`: what the size is of, for the line that refuses them)."""
    m = _SIZE.match(text)
    if m is None or not m.group(2) or m.group(2) == "%":  # (a share, auto, a bare number: not a size)
        raise FmoeError(f"{option} {text.strip()!r}: give {what} as a size such as 12GiB or 512MiB{note}")
    return parse_budget(text, 0)


DEFAULT_TAU = 5000  # τ: tokens between re-plans (MoEpic; planning/configurator.py)
# A run's plan drops prefetch only once every layer has this many decode tokens with a recorded prediction
# (planning/configurator.py: a plan without prefetch records none; planning/replan.py plans again after them)
MIN_PREDICTIONS = 32


def check_plan_options(model: str, *, vram: str | None, profile_path: str | None, context: int | None, dtype: str | None,
                       workspace: str, experts: str, trace: str | None, dense: str = DEFAULT_DENSE) -> Profile | None:
    """`fmoe plan`'s options, without torch (the command line checks them before anything heavy is
    imported): one line for the first bad one. Returns the profile read (None without one)."""
    if context is not None:
        resolve_context(context, None, None)  # a bad number: refused before anything is read
    if vram is not None:  # the device's memory: a size, never a share (that is --vram-budget's)
        parse_size(vram, "--vram", "the device's memory", " (a share of the experts is bench's and chat's "
                                                          "--vram-budget)")
    parse_size(workspace, "--workspace", "the device memory kept for activations, the allocator and the CUDA "
                                         "context")
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
