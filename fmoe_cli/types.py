"""Small shared types at the bottom of the import graph (docs/architecture.md).

`MoeLayer` is one routed-experts module of a loaded model, `ExpertShape` describes a
model's routed experts, `Plan` / `LayerPlan` how the expert
budget is spent on the device (MoEpic §3.4 notation: V_i, C_i, θ_i = k_i / I, U_b),
`EngineSettings` what the engine is configured with, `Timings` the configurator's
T_att, T_moe, T_head, T_load. Models, the engine, profiling and the planner all use
them; this module imports nothing of fmoe except errors.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from fmoe_cli.errors import FmoeError

if TYPE_CHECKING:  # annotations only: this module stays free of torch
    from torch import nn

MiB = 1024**2
SEED_RANGE = (-2**63, 2**64 - 1)  # the sampling seeds torch.Generator.manual_seed takes (chat's --seed, serve's seed)
# the repetition penalties sampling takes (transformers' GenerationConfig's range): a logit divided by less than this
# overflows float32 to inf, and the draw's inf − inf is NaN (chat's --repetition-penalty, serve's, generation_config.json)
REPETITION_PENALTY_RANGE = (1e-3, 1e3)
GRAPH_CAPACITY_STEP = 256  # a GPU's decode cache holds a multiple of this many positions


def static_cache_capacity(tokens: int) -> int:
    """The positions of the StaticCache a GPU's generation of up to `tokens` positions decodes in (generate.py
    decode_graph: rounded up to GRAPH_CAPACITY_STEP), and what the plan reserves (planning/plan.py kv_reserve)."""
    return -(-tokens // GRAPH_CAPACITY_STEP) * GRAPH_CAPACITY_STEP


@dataclass
class MoeLayer:
    """One routed-experts module of a loaded model and its router (models/families.py finds them)."""

    index: int  # position among the MoE layers (0 … L-1)
    name: str  # module path of the experts module
    decoder_index: int  # position among all decoder layers
    experts: nn.Module
    router: nn.Module  # the module whose weight [N, H] scores the experts (what the predictors rank with)
    gate: nn.Module | None = None  # the block's routing module, where it is not `router` itself (Hunyuan's gate,
    # whose `wg` is the matrix): what returns the top-k (fmoe bench --replay-routing hooks it)
    choice: RouterChoice | None = None  # how its router picks the top-k (models/families.py router_choice): what the
    # predictors rank the experts with


@dataclass(frozen=True, eq=False, slots=True)
class RouterChoice:
    """How a MoE layer's router picks its top-k experts from its input h [T, H]: what prediction/base.py router_scores
    ranks them by. models/families.py `router_choice` resolves it once per layer, from where the family keeps each
    part (`ROUTER_FORMS`). A tensor is named by its owner module and attribute and read at each call: a module's
    `.to()` replaces its buffers. Steps, in order:

        x = h · (mean(h²) + input_eps)^-½ · s · input_root   (input_scale = s; Gemma 4's router norms and scales h)
        z = W·x, its first `experts` columns where W has more rows (Inkling: its shared experts' gates after)
        z = c · tanh(z / c)                                   (softcap = c; Laguna)
        scores = softmax(z) or sigmoid(z), + b                (bias = b: for choosing only)
                 sigmoid(z + b) where bias_on_logits          (Kolibri1: the top-k of z + b, in (0, 1))
        experts of the `chosen_groups` best of `groups` groups first (a group's score: its two best summed, or
        its best where group_by_best: DeepSeek-V2); the others' scores below all of theirs, or 0 where
        masked_to_zero (AXK2: a chosen expert's sigmoid(z) + b < 0 ranks after them)
    """

    matrix: nn.Module  # its `weight` [R, H] (R >= N)
    experts: int = 0  # N where R > N, else 0 (all of z)
    sigmoid: bool = False
    bias: tuple[nn.Module, str] | None = None  # b [N] or [1, N]
    bias_on_logits: bool = False
    softcap: float = 0.0
    groups: int = 0  # 0: not group-limited
    chosen_groups: int = 0
    group_by_best: bool = False
    masked_to_zero: bool = False
    input_scale: tuple[nn.Module, str] | None = None  # s [H]
    input_eps: float = 0.0
    input_root: float = 1.0


@dataclass(frozen=True)
class QuantFormat:
    """Weight-only, group-wise along the hidden dimension H (offload/quant.py). Each neuron row holds its
    gate row, up row and down column quantised, then their per-group metadata (float16 scale, and offset for
    int4; for the HQQ scheme (offload/hqq.py) 8-bit scale and zero codes, and their float16 (σ, z))."""

    bits: int
    group: int  # G: weights per scale (fewer when H is not a multiple)
    meta_bytes: int  # per group: scale (int8: symmetric), scale + offset (int4: min/max), 8-bit scale + zero (hqq)
    scheme: str = "minmax"  # how a group is quantised: "symmetric", "minmax" or "hqq" (offload/quant.py's table)
    meta_group: int = 0  # hqq: group scales per 8-bit scale group (its float16 σ, z); 0: scales not quantised

    def group_size(self, hidden: int) -> int:
        """G, halved until it divides H (int4: H/2, int2: H/4, as a row's codes are packed in halves / quarters)."""
        span = hidden * self.bits // 8
        g = self.group
        while span % g:
            g //= 2
        return max(g, 1)

    def meta_group_size(self, groups: int) -> int:
        """M: scales per 8-bit scale group, halved until it divides the row's H/G groups."""
        m = self.meta_group
        while groups % m:
            m //= 2
        return max(m, 1)

    def down_by_neuron(self, hidden: int, intermediate: int) -> bool:
        """Whether the down projection is quantised in groups along the neurons (DOWN_GROUP of them × G/DOWN_GROUP
        hidden values a group, offload/quant.py), so that its sum over the neurons is an integer dot with int8
        activations: int8 and int4 where I and G are multiples of DOWN_GROUP; else (int2, odd shapes) along H."""
        return self.scheme != "hqq" and intermediate % DOWN_GROUP == 0 and self.group_size(hidden) % DOWN_GROUP == 0

    def projection_bytes(self, hidden: int) -> int:
        """One projection's row: H codes of `bits`, then H/G groups of metadata (hqq: and the float16
        (σ, z) of each 8-bit scale group and of the row's zeros)."""
        groups = hidden // self.group_size(hidden)
        second_level = 4 * (groups // self.meta_group_size(groups) + 1) if self.meta_group else 0
        return hidden * self.bits // 8 + groups * self.meta_bytes + second_level


DOWN_GROUP = 32  # neurons a down-projection group spans (QuantFormat.down_by_neuron): llama.cpp's Q8_0 block

# --experts: "bf16" is unquantised (stored in the compute dtype, --dtype); int8 ≈ 8.1 bits, int4 ≈ 4.5 bits,
# int2 ≈ 3.0 bits a weight (HQQ's 2-bit setting for Mixtral's experts: G = 16, 8-bit scales in groups of 128, 8-bit zeros).
EXPERT_FORMATS: dict[str, QuantFormat | None] = {
    "bf16": None,
    "int8": QuantFormat(bits=8, group=128, meta_bytes=2, scheme="symmetric"),
    "int4": QuantFormat(bits=4, group=64, meta_bytes=4),
    "int2": QuantFormat(bits=2, group=16, meta_bytes=2, scheme="hqq", meta_group=128),
}
DEFAULT_EXPERTS = "bf16"  # --experts


@dataclass(frozen=True)
class DenseFormat:
    """--dense: the non-expert linears stored quantised (models/dense.py), in the experts' formats (rows of
    codes grouped along the input dimension, then their metadata). The embedding is a lookup and stays as
    stored; norms, routers, shared experts and dense MLP layers stay in the compute dtype."""

    quant: QuantFormat  # the attention's linears
    head: QuantFormat | None  # the LM head's (unless it is tied to the embedding); None: left as stored


# --dense: "bf16" leaves the non-expert weights unquantised (in the compute dtype, --dtype, as --experts bf16);
# int8: attention projections and LM head weight-only int8, G = 128 (what llama.cpp's Q8_0 reads);
# int4: attention projections at 4 bits, G = 64 (MoEpic's and Mixtral-offloading's attention), and the LM head at 8
# bits (llama.cpp's Q4_0 files keep the output at ~6 bits, Q6_K; docs/quantization.md says why int8 here).
DENSE_FORMATS: dict[str, DenseFormat | None] = {
    "bf16": None,
    "int8": DenseFormat(EXPERT_FORMATS["int8"], head=EXPERT_FORMATS["int8"]),
    "int4": DenseFormat(EXPERT_FORMATS["int4"], head=EXPERT_FORMATS["int8"]),
}
DEFAULT_DENSE = "auto"  # --dense left out: resolve_dense picks per device and expert format
# --dense left out on the CPU, per expert format: llama.cpp's Q8_0 / Q4_0 runs read their attention (and output)
# quantised too (issue 21 §1 "Non-expert weights"): int8 beside int8 experts, int4 (its head int8) beside int4 ones,
# measured faster a token on a3b and big (docs/bench.md § The default dense format beside int4 experts).
CPU_DENSE_BESIDE = {"int8": "int8", "int4": "int4"}


def resolve_dense(dense: str, device_type: str, experts: str) -> str:
    """--dense as the model is loaded: "auto" is, on the CPU, int8 beside int8 experts and int4 beside int4 experts
    (there decode reads every weight from RAM once per token, and the f32 LM head alone would outweigh the experts),
    else bf16 (the compute dtype, as stored). An explicit format stays."""
    if dense != DEFAULT_DENSE:
        return dense
    return CPU_DENSE_BESIDE.get(experts, "bf16") if device_type == "cpu" else "bf16"


# --activations: what the CPU kernels' int8/int4 rows are multiplied with. "float": x in the compute dtype (the
# dequantised weights' result to float rounding: the exactness contract); "int8": x quantised per block of 32
# (llama.cpp's Q8_0) and integer dot products, within a stated tolerance (docs/quantization.md).
ACTIVATIONS = ("float", "int8")
DEFAULT_ACTIVATIONS = "float"  # a store, kernel or load_model not told otherwise: the exact path
AUTO_ACTIVATIONS = "auto"  # --activations left out: resolve_activations picks per device and expert format
# --activations left out on the CPU: int8 beside these expert formats, as every llama.cpp Q8_0 / Q4_0 run multiplies
# (issue 39 §1); int2 (HQQ) has no integer dots (experts.c q8_shape), bf16 rows none to make.
CPU_INT8_ACTIVATIONS_BESIDE = ("int8", "int4")


def resolve_activations(activations: str, device_type: str, experts: str, int8_dots: bool = True) -> str:
    """--activations as the model computes: "auto" is int8 on the CPU beside int8/int4 experts where the kernels
    have their integer dots (`int8_dots`: AVX2), else float. An explicit mode stays."""
    if activations != AUTO_ACTIVATIONS:
        return activations
    return "int8" if device_type == "cpu" and experts in CPU_INT8_ACTIVATIONS_BESIDE and int8_dots else "float"


def check_activations(activations: str) -> None:
    if activations != AUTO_ACTIVATIONS and activations not in ACTIVATIONS:
        raise FmoeError(f"unknown activations {activations!r} (--activations); use {', '.join(ACTIVATIONS)} "
                        f"or {AUTO_ACTIVATIONS}")


# --dtype: the names fmoe accepts, each to torch's name (auto: chosen per device, models/load.py)
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def check_dtype(dtype: str | None) -> None:
    if dtype not in (None, "auto") and dtype not in DTYPES:
        raise FmoeError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")


def check_expert_format(experts: str) -> None:
    if experts not in EXPERT_FORMATS:
        raise FmoeError(f"unknown expert format {experts!r}; use {', '.join(EXPERT_FORMATS)}")


def check_dense_format(dense: str) -> None:
    if dense != DEFAULT_DENSE and dense not in DENSE_FORMATS:
        raise FmoeError(f"unknown dense format {dense!r} (--dense); use {', '.join(DENSE_FORMATS)} or {DEFAULT_DENSE}")


@dataclass(frozen=True)
class ExpertShape:
    """What a plan needs to know about a model's routed experts."""

    num_layers: int  # L: MoE layers
    num_experts: int  # N: routed experts per layer
    top_k: int  # K
    hidden: int  # H
    intermediate: int  # I: neurons per expert
    dtype_bytes: int  # the compute dtype's
    experts: str = DEFAULT_EXPERTS  # storage format of the routed experts (EXPERT_FORMATS)

    @property
    def expert_bytes(self) -> int:
        """S_e: one packed expert, [I, 3, H] (quantised: I rows of neuron_bytes)."""
        return self.intermediate * self.neuron_bytes

    @property
    def neuron_bytes(self) -> int:
        """One neuron's row: gate row, up row and down column (with their scales when quantised)."""
        fmt = EXPERT_FORMATS[self.experts]
        if fmt is None:
            return 3 * self.hidden * self.dtype_bytes
        return 3 * fmt.projection_bytes(self.hidden)

    @property
    def min_staging_slots(self) -> int:
        """Current and next layer: K slots each (docs/architecture.md § Device memory and the link)."""
        return min(2 * self.top_k, 2 * self.num_experts)

    @property
    def all_experts_bytes(self) -> int:
        return self.num_layers * self.num_experts * self.expert_bytes

    @property
    def down_by_neuron(self) -> bool:
        """Whether the quantised down projections are grouped along the neurons (QuantFormat.down_by_neuron)."""
        fmt = EXPERT_FORMATS[self.experts]
        return fmt is not None and fmt.down_by_neuron(self.hidden, self.intermediate)

    @property
    def neuron_block(self) -> int:
        """Granularity of k: whole blocks keep the matmuls efficient (docs/architecture.md § The split expert); a
        multiple of DOWN_GROUP where the down projections are grouped along the neurons (a split never cuts a group)."""
        block = next((b for b in (64, 16) if self.intermediate % b == 0 and self.intermediate >= 8 * b), 1)
        if self.down_by_neuron and block % DOWN_GROUP:
            return DOWN_GROUP
        return block

    def top_neurons(self, theta: float) -> int:
        """k = θ·I rounded to whole blocks; never 0 < k < block, never 0 for θ > 0."""
        if not 0.0 <= theta <= 1.0:
            raise FmoeError(f"split ratio θ must be in [0, 1], got {theta}")
        if theta == 0.0:
            return 0
        block = self.neuron_block
        k = round(theta * self.intermediate / block) * block
        return min(self.intermediate, max(block, k))


@dataclass(frozen=True)
class LayerPlan:
    vram_bytes: int  # V_i = C_i · k_i · neuron_bytes
    cache_size: int  # C_i
    top_neurons: int  # k_i
    split: float  # θ_i = k_i / I
    # The host lane (docs/architecture.md § The host lane): in decode, this layer's misses and the bottoms of its
    # top hits are computed on the host from RAM instead of fetched (False: fetched over the link).
    host: bool = False

    def holds_every_expert(self, shape: ExpertShape) -> bool:
        """The layer caches every expert whole (C_i ≥ N, k_i = I): resident from the start, whatever the plan."""
        return self.cache_size >= shape.num_experts and self.top_neurons >= shape.intermediate


@dataclass(frozen=True)
class Plan:
    layers: tuple[LayerPlan, ...]
    staging_slots: int  # full-expert slots in the staging pool (U_b = slots · S_e)
    expert_bytes: int  # S_e
    source: str  # what made it, for labels: "uniform", "configurator", "resident", …
    # Every expert whole on the device from the start, never loaded or evicted (the
    # reference): the engine fills the caches from the store when it is configured.
    resident: bool = False
    # False: the plan is made to run without speculative prefetch (the configurator's cache-only
    # candidate won); a preset that prefetches does not when its plan says so.
    prefetch: bool = True

    @property
    def cache_bytes(self) -> int:
        return sum(layer.vram_bytes for layer in self.layers)

    @property
    def staging_bytes(self) -> int:
        return self.staging_slots * self.expert_bytes

    @property
    def total_bytes(self) -> int:
        return self.cache_bytes + self.staging_bytes

    def summary(self) -> str:
        cached = sum(layer.cache_size for layer in self.layers)
        thetas = sorted({round(layer.split, 3) for layer in self.layers})
        theta = f"θ={thetas[0]}" if len(thetas) == 1 else f"θ={thetas[0]}…{thetas[-1]}"
        host = sum(layer.host for layer in self.layers)
        return (
            f"{self.source}: {cached} expert tops cached over {len(self.layers)} layers ({theta}), "
            f"{self.staging_slots} staging slots, {self.total_bytes / MiB:.1f} MiB"
            + ("" if self.prefetch or self.resident else ", no prefetch")
            + (f", host lane in {host} layers" if host and not self.resident else "")
        )

    def resident_layer(self, i: int, shape: ExpertShape) -> bool:
        """Layer i holds every expert whole from the start (a resident plan, or a layer whose cache holds them all in
        a plan whose other layers load): it is filled when the engine is configured and decodes as a resident layer."""
        return self.resident or self.layers[i].holds_every_expert(shape)

    @property
    def host_lane(self) -> bool:
        """Some layer computes misses and bottoms on the host (never a resident plan)."""
        return not self.resident and any(layer.host for layer in self.layers)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class EngineSettings:
    """What the engine is configured with (offload/engine.py): a preset's plan and policies
    (planning/presets.py makes them)."""

    policy: str  # the preset's name, for labels and the preset table
    plan: Plan
    eviction: str  # offload.policies.POLICIES
    prefetch: bool  # speculative prefetch into the staging pool
    omega: float  # LCP ω
    rho: float  # LCP ρ


@dataclass(frozen=True)
class Timings:
    """Seconds for one decode token (MoEpic's T_*)."""

    t_att: float  # T_att: one layer's attention (and norms)
    t_moe: float  # T_moe: one layer's K activated experts, all resident
    t_head: float  # T_head: LM head (+ final norm, + any dense layers before the first MoE layer)
    t_load: float  # T_load: one whole expert (S_e bytes) host → device
    top_k: int  # K
    # h_load: the host's own work per loaded segment (staging slot, copy submit, acquire, release, the
    # extra segment forward of a split expert), beyond its compute and its link time; 0 unless measured
    # (profiling/layers.py: time_layers).
    t_host_load: float = 0.0
    # h_pf: the host's work per MoE layer that prefetches (the predictor's scores and ranking, the
    # prefetcher's submits and cancels); 0 unless measured (profiling/model.py: host_work_s).
    t_host_prefetch: float = 0.0
    # a_e: the compute stream's copy of one whole expert into the cache (device to device; on the CPU a
    # memcpy), which admitting a loaded expert's top segment of k_i neurons costs k_i/I of; 0 unless measured
    # (profiling/model.py: admission_copy_s) or estimated from the device's memory bandwidth.
    t_admit: float = 0.0
    # c: what a split expert's top hit costs beyond a whole expert's forward (two segment forwards, top
    # and bottom, and their sum; the simulator: one segment's fixed cost); 0 unless measured.
    t_segment: float = 0.0
    # h_route: the host's work between submitting a layer's loads and its first compute (routing layout,
    # token gather), part of the layer's time, during which the first load is already on the link; 0
    # unless measured.
    t_host_route: float = 0.0
    # The host lane (docs/architecture.md § The host lane), from the host profile (profiling/host.py) for the
    # model's format: t_host(n) = t_host_call + (t_host_expert − t_host_call) · n / I for a segment of n neurons, one
    # decode token; t_host_sync per layer that uses the lane (hidden rows to the host, partial sums back, the
    # threads' hand-over). t_host_expert = 0: no host profile, no host lane.
    t_host_expert: float = 0.0
    t_host_call: float = 0.0
    t_host_sync: float = 0.0
    # h_sub: the part of h_load spent submitting a demand load (staging slot, copy submit), before the layer's
    # first compute: a layer submits all its demand loads, then computes, so while it submits the others the
    # first is already on the link; 0 unless measured (profiling/model.py: host_work_s, the engine's counter).
    t_host_submit: float = 0.0

    @property
    def submit_share(self) -> float:
        """h_sub as the closed form and the simulator spend it: at most h_load, of which it is a part."""
        return min(self.t_host_submit, self.t_host_load)

    def __post_init__(self) -> None:
        for name in ("t_att", "t_moe", "t_head", "t_load", "t_host_load", "t_host_prefetch", "t_admit", "t_segment",
                     "t_host_route", "t_host_expert", "t_host_call", "t_host_sync", "t_host_submit"):
            value = getattr(self, name)
            if not value >= 0 or not math.isfinite(value):
                raise FmoeError(f"timing {name} must be a finite number of seconds ≥ 0, got {value}")
        if self.top_k < 1:
            raise FmoeError(f"top_k must be ≥ 1, got {self.top_k}")

    @property
    def t_exp(self) -> float:
        """T_exp = T_moe / K: one expert's compute."""
        return self.t_moe / self.top_k

    @property
    def has_host(self) -> bool:
        return self.t_host_expert > 0

    def t_host(self, neurons: float, intermediate: int) -> float:
        """t_host(n): n neurons of one expert computed on the host for one decode token (0 for n = 0)."""
        if neurons <= 0:
            return 0.0
        call = min(self.t_host_call, self.t_host_expert)
        return call + (self.t_host_expert - call) * neurons / intermediate

    @classmethod
    def from_link(
        cls, *, t_att: float, t_moe: float, t_head: float, top_k: int,
        expert_bytes: int, bandwidth: float, latency: float = 0.0, t_host_load: float = 0.0,
        t_host_prefetch: float = 0.0, t_admit: float = 0.0, t_segment: float = 0.0, t_host_route: float = 0.0,
        t_host_submit: float = 0.0,
    ) -> Timings:
        """T_load = latency + S_e / bandwidth (bandwidth in bytes/s, from the device profile's fit)."""
        if bandwidth <= 0:
            raise FmoeError(f"link bandwidth must be > 0 bytes/s, got {bandwidth}")
        return cls(t_att, t_moe, t_head, latency + expert_bytes / bandwidth, top_k, t_host_load, t_host_prefetch, t_admit, t_segment,
                   t_host_route, t_host_submit=t_host_submit)
