"""MoEpic's configurator (§3.4, Algorithm 1; docs/architecture.md § Statistics, configurator, re-planning): numbers in, Plan out.

Symbols (paper → code):
    L, N, K, I          shape.num_layers, num_experts, top_k, intermediate
    S_e                 shape.expert_bytes
    V_e                 expert_budget: bytes for the top-segment caches, Σ_i V_i ≤ V_e
    V_i, C_i, θ_i       budgets[i], cache_size, split (θ_i = k_i / I, k_i whole neuron blocks)
    H_i, P_i, PH_i      LayerCurves.hit, .predicted_hit, .predicted_cached (planning/stats.py)
    PAH_i               LayerCurves.predicted_hit_cached: the y-th predicted expert activated and cached (ours)
    T_att, T_moe, T_exp, T_head, T_load     Timings
    T_wind^i            the prefetch window before layer i
    m_i                 expected number of activated experts (in whole-expert units) whose
                        loading is hidden: cached top segments plus what prefetch covers
    T^i                 exposed (un-hidden) load time of layer i, plus the host's work of its loads
    h_load, h_pf, a_e, c    Timings.t_host_load, t_host_prefetch, t_admit, t_segment: the host's work per
                        loaded segment and per prefetching layer, one expert's copy into the cache,
                        one segment forward's fixed cost (ours)

ExpertSplit({V_i}) (Eq. 5–11, as docs/architecture.md § Statistics, configurator, re-planning states them,
with the link charged for the issued prefetch that still holds it when the layer routes):
    T_wind^1 = T_head + T_att                                                   (5)
    for i = 1..L: choose C_i ≤ N (θ_i = V_i / (C_i·S_e) ≤ 1, rounded down to whole blocks)
        m_i = K·H_i(C_i)·θ_i + Σ_{y≤Y} [P_i(y) − PAH_i(y,C_i)·θ_i]            (9)
              (MoEpic: [1 − PH_i(y,C_i)·θ_i]·P_i(y); ours: the joint count, below)
        Y   = the largest count with Σ_{y≤Y} [1 − PH_i(y,C_i)·θ_i]·T_load ≤ T_wind^i  (10)
              (the prefetches that land by routing time), at most the engine's width W
              (`max_prefetch`, K by default), which it issues whether they fit or not
        n_i = K − m_i   the experts loaded after routing, one after another on the link
        R_i = when W > Y, prefetch Y+1 is on the link as layer i routes:
              (1 − P_i(Y+1)) · (Σ_{y≤Y+1} [1 − PH_i(y,C_i)·θ_i]·T_load − T_wind^i),
              the rest of its link time, lost when it is wrong (a copy is not pre-empted;
              prefetches queued behind it are cancelled for free, right ones are taken
              over as demand loads)
        G_i = h_load · (K − K·H_i(C_i)·[k_i = I]) + a_e · (min(K, C_i) − K·H_i(C_i))·θ_i
              + c · K·H_i(C_i)·[0 < k_i < I] + h_pf · [Y_i > 0]
              the work loads cost besides the link: per loaded segment (Timings.t_host_load;
              every activated expert but a whole cached one is loaded, a top hit's bottom
              included), per admission (t_admit: a miss's top θ_i copied into the cache, LCP
              always replaces, but only an unpinned expert makes room: a token's h hits and
              its admitted misses stay pinned, so it admits min(K, C_i) − h of its K − h misses),
              per split top hit (t_segment: two segment forwards, not one) and per prefetching
              layer (t_host_prefetch)
        C_i = argmax m_i·T_load − G_i (without the h_pf term, the same for every C)   (11)
        B_i = R_i + n_i·T_load                       the link's work once layer i has routed
        S_i = max(R_i + min(n_i, 1)·T_load, B_i − max(0, n_i − 1)·(T_exp + h_load − h_sub))
              − m_i·T_exp − [n_i > 0]·(n_i·h_sub + h_route + h_pf·[Y_i > 0])
              (the compute side's lead on the first load: n_i·h_sub, submitting the layer's loads, the
              first on the link meanwhile; h_route, the host's work between submitting the loads and the
              first compute; and h_pf, which the engine spends as soon as the demand loads are queued,
              while they are on the link)
        T^i = E[max(0, S_i)] + G_i                                                 (6)
              S_i per token, over its m (`hidden_distribution`: its hits, and the misses and bottoms a landed
              prefetch covers, binomial, of mean m_i); a token with nothing to load (n = 0) waits for nothing
        T_wind^{i+1} = T_moe + T^i − B_i + T_att                                   (7)

With R_i = 0 (W = Y), G_i = 0, n_i ≤ 1, S_i priced at the mean m_i and PAH_i = PH_i·P_i these are the paper's equations
(S_i = B_i − m_i·T_exp, T_wind^{i+1} = T_moe − min(m_i·T_exp, B_i) + T_att). Where we deviate, and why (measured:
docs/planning.md § Where the model deviates from the paper):
- S_i per token: the paper prices the expected m_i; S_i is not linear in m (max(0, ·): a token's hits' compute
  does not hide another token's loads; the first load waits whole, the next only as far as the link is slower than
  the compute), so the expectation priced `cache-only` at 0.2 ms a token where the simulator found 2.0 (K = 2,
  H = 0.87, load 2.65 × T_exp: tests/test_configurator.py, recurring experts). A token's hits are taken as
  independent draws of H_i(C) (the statistics hold marginals only); B_i, linear in m, keeps its mean.
- the prefetch credit from a joint count (Eq. 9, PAH_i): a right prefetch saves a whole load when its expert is not
  cached and the bottom's (1 − θ_i) when its top is; the paper's product [1 − PH_i(y, C)·θ_i]·P_i(y) takes "activated"
  and "cached" as independent. Where experts recur from token to token they are not: the predicted experts that are
  activated are mostly the cached ones, and the product credited prefetches that load nothing (K = 2, 3 whole experts
  a layer, experts kept with probability 0.85: the plan chosen with prefetch, simulated 2.46 ms a token exposed, was
  priced 1.14, and is priced 1.93 from the joint count; tests/test_configurator.py, recurring experts). The
  statistics count PAH_i(y, C) (planning/stats.py), and the credit is P_i(y) − PAH_i(y, C)·θ_i: the misses it
  covers, P_i − PAH_i, and the cached tops' bottoms, (1 − θ_i)·PAH_i. The link cost of a prefetch (Eq. 10) keeps
  PH_i: a cached top's bottom is all it loads whether the expert is activated or not.
- pipelined loads (S_i): the paper charges every un-hidden load in full; the engine computes
  each load as it lands (offload/engine.py), so the compute of one (and its host work)
  overlaps the transfer of the next, and the routing layout before the first compute
  overlaps the first. At cheap loads `ondemand` exposed 0.00 ms per token where Eq. 6
  predicted 0.06 ms per layer, and the configurator chose prefetch where it lost.
- the work of a load besides the link (G_i): where a load costs the host about as much as
  the link, a split top hit saves link time but still pays a load's host work and a second
  segment forward, an admission copies the top into the cache, and a prefetch costs the
  predictor's and prefetcher's work; without G_i the configurator chose split or prefetching
  plans that lost to `cache-only` and `prefetch-only` at cheap loads.
- R_i (above): the link time of a wrong prefetch still on the link.
- h_pf in the lead (S_i): the predictor and prefetcher run while the layer's demand loads are on the link
  (offload/engine.py: experts_forward, step 4), so they hide part of the wait, as h_route does; charged on
  top of the stall, the closed form priced the demo's prefetching plans with loads left 11–12 % above the
  simulator at 1 GB/s (`uniform` 13.85 against 12.38 ms), and preferred whole tops to `uniform`'s half tops.
- admissions of a cache smaller than K (G_i): a hit or an admitted miss stays pinned to the layer's end, so
  C_i < K slots take only min(K, C_i) − h of a token's misses; charging every miss priced the demo's
  `lru` and `cache-only` plans (two whole experts per layer, K = 4) 6–7 % above the simulator.
- H_i(C) in the order the engine's cache holds the experts (planning/stats.py: held_order): the previous token's
  first, as a cache that admits every miss keeps them, then by priority; MoEpic's C highest priorities priced whole
  experts at 1.8 × the simulator's exposed load where experts recur from token to token (Qwen1.5-MoE at 240 experts
  in `simulate.py paper`: `cache-only` 28.8 ms a token against 16.1, hit 0.24 priced, 0.46 simulated), and the
  configured plan lost to every cache baseline there.
- the hit rate of a cache smaller than K (`cache_hit_rate`): such a cache holds C_i of the last token's experts,
  not the C_i of highest priority: H_i(C) = min(H_i(C), (C/K)·H_i(K)) for C < K; with H_i(C) as recorded, those
  plans were priced 2–4 % below the simulator at 4 and 16 GB/s (hit 0.32 priced, 0.24 simulated).
- the submission of a layer's loads in the lead (n_i·h_sub, h_sub ≤ h_load the part of a load's host work spent
  submitting it, Timings.t_host_submit): the engine submits every demand load of a layer before it computes
  (offload/engine.py: _submit), so the first is on the link while the others are submitted. On the demo (CPU-time
  clock) submitting 4 loads took 0.055–0.10 ms, more than one load at 16 GB/s (0.047 ms): `ondemand` measured
  0.000 ms a token exposed where the closed form (and the simulator, which submitted for free) priced 0.249;
  at 4 GB/s, with that run's quick estimate (compute between loads longer than a load), 0.46–0.64 against 0.91
  (0.50 with h_sub).
Two guards the formulas leave implicit: m_i is capped at K (no layer hides more than its K experts; with the joint
count Eq. 9 stays within K when H_i and PAH_i count the same tokens, but the first token of a run has no prediction,
and hand-made statistics are anything), and Y is capped at the prefetch width. C_i = 0 (no cache, θ_i undefined,
reported as 0) is a candidate, and the only one when V_i cannot hold one neuron block
of one expert.

A run's plan (`min_predictions`, planning/plan.py: MIN_PREDICTIONS; `fmoe plan`, which runs nothing,
prices every candidate): where too few predictions were recorded (fewer than `min_predictions` decode
tokens with the prefetcher's ranking in some layer: a model's first plan, or statistics recorded only by
runs without prefetch),
P_i and PH_i are the uniform prior, a predictor no better than chance (P(y) = K/N), and every plan
without prefetch would win wherever a wrong prefetch costs link time. Then the plans without prefetch
are not candidates (ours, not MoEpic's, whose statistics come from a profiling run with the predictor):
a plan without prefetch never runs the predictor, so its statistics would never learn how good it is
(the demo at 1 GB/s: `moepic` planned no prefetch from its first, uniform statistics, kept it after the
warm-up's re-plan, and ran 17.9 ms against `uniform`'s 12.8; with prefetch 13.1 against 13.1).

The search contains its baselines: after Algorithm 1, the same model prices the
plans of the special cases it competes with at the same budget — whole experts
(θ = 1, V_e/L per layer: `lru`, `lfu`), the same without prefetch (Y = 0:
`cache-only`; the plan then says `prefetch=False` and moepic runs without it),
uniform (θ = 0.5, V_e/L: `uniform`), prefetch only (θ = 0: `prefetch-only`) and neither
(`ondemand`) — then Algorithm 1 again, with and without prefetch, from the per-layer optimum
(`per_layer_optimum`: the budgets that minimise Σ T^i with the windows held, a knapsack solved by
dynamic programming), and the plan with the least predicted Σ T^i wins (the earlier on ties).
Algorithm 1's ζ-moves from the uniform start only see a marginal gain; where a cache pays only from
several experts of a layer on (every miss's admission costing more than the loads a small cache
saves), every move gains nothing and the search stops at no cache although caching a few layers whole
would pay.

VramAllocation (Algorithm 1): start uniform (V_i = V_e / L); repeat: move ζ·V_e from
the layer whose loss of budget costs least to the layer whose gain is largest; stop,
rolling back the last move, when the total exposed latency Σ_i T^i no longer falls.
(Algorithm 1 starts at θ = 0.5; ExpertSplit then chooses θ_i from V_i and C_i, so the
starting θ does not change the result and is not represented here.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from fmoe_cli.errors import FmoeError
from fmoe_cli.planning.plan import DEFAULT_TAU, min_staging_slots, uniform_plan
from fmoe_cli.types import MiB, ExpertShape, LayerPlan, Plan, Timings
from fmoe_cli.planning.stats import LayerCurves, RoutingStats

DEFAULT_ZETA = 0.01  # ζ: share of V_e moved per iteration (MoEpic)
_TIE = 1e-12  # m_i within this of the best count as ties


@dataclass(frozen=True)
class LayerChoice:
    budget: int  # V_i allotted (bytes)
    cache_size: int  # C_i
    top_neurons: int  # k_i
    split: float  # θ_i = k_i / I (0 when C_i = 0)
    vram_bytes: int  # C_i · k_i · neuron bytes ≤ V_i
    hit_rate: float  # H_i(C_i): share of activated experts whose top segment is cached
    hidden: float  # m_i
    prefetches: int  # Y
    window: float  # T_wind^i (s)
    exposed: float  # T^i (s); a host-lane layer: its experts' time beyond T_moe (may be < 0)
    host: bool = False  # the host lane: misses and bottoms computed on the host (LayerPlan.host)
    host_s: float = 0.0  # T_host^i: the host lane's work per token in this layer (s)


@dataclass(frozen=True)
class Split:
    layers: tuple[LayerChoice, ...]

    @property
    def total_exposed(self) -> float:
        return float(sum(layer.exposed for layer in self.layers))

    def to_plan(self, shape: ExpertShape, staging_slots: int, source: str = "configurator") -> Plan:
        layers = tuple(LayerPlan(c.vram_bytes, c.cache_size, c.top_neurons, c.split, c.host) for c in self.layers)
        return Plan(layers, staging_slots, shape.expert_bytes, source)


# The special cases the configurator competes with, as plans of the same budget: name -> (θ of a
# uniform plan, whether it prefetches) (planning/plan.py: uniform_plan; the presets lru/lfu, cache-only,
# uniform, prefetch-only).
BASELINES: dict[str, tuple[float, bool]] = {
    "whole experts (θ = 1)": (1.0, True),
    "cache only (θ = 1, no prefetch)": (1.0, False),
    "uniform (θ = 0.5)": (0.5, True),
    "prefetch only (θ = 0)": (0.0, True),
    "on demand (no cache, no prefetch)": (0.0, False),
}
ALGORITHM_1 = "algorithm 1"
FROM_OPTIMUM = "algorithm 1 from the per-layer optimum"
FROM_OPTIMUM_SILENT = "algorithm 1 from the per-layer optimum, no prefetch"
LLAMA_CPP = "llama.cpp pattern (every routed expert on the host)"


def host_baselines(shape: ExpertShape, budget_bytes: int) -> dict[str, Plan]:
    """The host lane's special cases at the same budget (staging pool + caches): every routed expert computed on
    the host (llama.cpp's --cpu-moe: nothing cached), and whole experts cached V_e/L per layer with every miss on
    the host (θ = 1). Neither prefetches."""
    nothing = Plan(tuple(LayerPlan(0, 0, 0, 0.0, True) for _ in range(shape.num_layers)), min_staging_slots(shape),
                   shape.expert_bytes, "configurator", prefetch=False)
    whole = uniform_plan(shape, budget_bytes, 1.0, source="configurator")
    whole = replace(whole, layers=tuple(replace(layer, host=True) for layer in whole.layers), prefetch=False)
    return {LLAMA_CPP: nothing, "whole experts cached, misses on the host (θ = 1)": whole}


@dataclass(frozen=True)
class Configuration:
    """What vram_allocation returns: the plan and what the model predicts for it."""

    plan: Plan
    split: Split
    expert_budget: int  # V_e
    iterations: int  # accepted moves
    history: tuple[float, ...]  # Σ T^i of Algorithm 1 at the start and after every accepted move (strictly falling)
    uniform_routing: bool  # the statistics were assumed, not recorded
    chosen: str = ALGORITHM_1  # which candidate won: ALGORITHM_1 or a BASELINES name
    candidates: tuple[tuple[str, float], ...] = ()  # (candidate, predicted Σ T^i), in the order priced

    @property
    def total_exposed(self) -> float:
        return self.split.total_exposed

    @property
    def hit_rates(self) -> tuple[float, ...]:
        return tuple(c.hit_rate for c in self.split.layers)

    @property
    def exposed(self) -> tuple[float, ...]:
        return tuple(c.exposed for c in self.split.layers)


TABLE_CACHE_BYTES = 8 * MiB  # a layer's priced candidates kept across budgets (`_LayerModel._tables`)
CHOICES_KEPT = 1024  # `_LayerModel.choose`'s answers kept per `_Tables` (all dropped at once past it: about 1 MB)
MAX_COLUMNS = 1024  # (C, k) candidates per layer and budget: ≤ this many k per C over all C


def cache_hit_rate(hit: np.ndarray, sizes: np.ndarray, top_k: int) -> np.ndarray:
    """H_i(C) per cache size C: the share of activated experts a cache of C experts holds. The statistics' H_i(C)
    (cumsum of the priority-rank histogram) is that of the C highest-priority experts. A cache of C < K slots does
    not hold those: LCP always replaces, and a token's hits and admitted misses stay pinned, so after each token
    it holds C of that token's K experts (its hits, then misses as they were loaded). Taken as any C of them, it
    hits C/K of what the K would, the K highest-priority experts standing in for the token's K:
        H_i(C) = min(H_i(C), (C/K)·H_i(K))   for C < K
    (ours: MoEpic's caches hold more than K experts). On the demo (K = 4), two whole experts per layer were
    simulated to hit 0.24 where H_i(2) said 0.32; (2/4)·H_i(4) says 0.27. Uniform routing is unchanged (C/N)."""
    hit_k = hit[min(top_k, len(hit) - 1)]
    sizes = np.asarray(sizes)
    return np.where(sizes < top_k, np.minimum(hit[sizes], sizes / top_k * hit_k), hit[sizes])


def binomial(trials: int, p: float) -> np.ndarray:
    """P(s successes) for s = 0..trials of `trials` independent tries of probability p."""
    s = np.arange(trials + 1)
    p = min(max(p, 0.0), 1.0)
    return np.array([math.comb(trials, int(i)) for i in s], dtype=float) * p ** s * (1.0 - p) ** (trials - s)


@lru_cache(maxsize=16384)  # the search prices a layer's same candidate under many windows; arrays read-only
def hidden_distribution(top_k: int, cache_size: int, hit: float, theta: float, hidden: float,
                        right_cached: float) -> tuple[np.ndarray, np.ndarray]:
    """A token's hidden load units in one layer, m = h·θ + g + b·(1 − θ), as (values, probabilities), whose mean is
    the closed form's m_i (`hidden`, Eq. 9 capped at K) (ours; the paper prices the expected m_i; docs/planning.md §
    Where the model deviates from the paper):
        h  the token's top hits, binomial over the min(K, C_i) experts a cache of C_i slots can hold of its K, each a
           hit with probability K·H_i(C_i) / min(K, C_i): mean K·H_i(C_i)
        g  its misses a landed prefetch covers whole, binomial over its K − h misses, each covered with q_miss
        b  its top hits whose bottom a landed prefetch covers, binomial over its h hits, each with q_bottom
    The hits of one token are taken as independent (H_i(C) is a marginal: the statistics hold no joint count of a
    token's hits). Eq. 9's landed gain, m_i − K·H_i·θ_i, splits into misses, Σ_{y≤Y} P_i(y) − PAH_i(y, C) of
    them, and bottoms, (1 − θ_i)·Σ_{y≤Y} PAH_i(y, C) (`right_cached`: the sum); what overflows one side (a cache
    of C < K is priced with fewer hits than the statistics count, `cache_hit_rate`, and the first token of a run has
    no prediction: the covered misses can exceed the misses priced) goes to the other, so that the mean stays m_i.
    The stall is not linear in m (per token max(0, S): a token's hits' compute hides its own loads, never another
    token's; the first load waits whole, each next one only as far as the link is slower than the compute): the
    mean prices a layer low where it hides most of its loads on average."""
    trials = min(top_k, cache_size)
    hits = top_k * hit
    misses = top_k - hits
    bottoms = hits * (1.0 - theta)  # load units of the hits' bottoms, all a prefetch can hide besides misses
    covered = max(0.0, hidden - hits * theta)  # Eq. 9's landed gain (≤ misses + bottoms: m_i ≤ K)
    miss_units = min(max(covered - right_cached * (1.0 - theta), covered - bottoms), misses)
    q_miss = miss_units / misses if misses > 0 else 0.0
    q_bottom = min(1.0, (covered - miss_units) / bottoms) if bottoms > 0 else 0.0
    values, weights = [], []
    for h, p_h in enumerate(binomial(trials, hits / trials if trials else 0.0)):
        g = np.arange(top_k - h + 1)
        b = np.arange(h + 1)
        values.append((h * theta + g[:, None] + b[None, :] * (1.0 - theta)).ravel())
        weights.append((p_h * binomial(top_k - h, q_miss)[:, None] * binomial(h, q_bottom)[None, :]).ravel())
    values, weights = np.minimum(np.concatenate(values), float(top_k)), np.concatenate(weights)
    values.flags.writeable = weights.flags.writeable = False
    return values, weights


class _LayerModel:
    """Eq. (9)–(11) for one layer, vectorised over the candidates (C, k): every cache size
    C = 0..N, each with the largest k_i that fits V_i / C and smaller ones (whole blocks, up to
    MAX_COLUMNS / (N + 1) per C, evenly spread): a smaller θ can hide more (a prefetch of the
    bottom costs less link time), so more budget never forces a larger θ on a cache size.

    Everything that depends on V_i only (the candidates, θ, the cumulated prefetch costs and
    gains, the work per token) is computed once per budget and kept (`_Tables`: shared by the layers whose
    curves are equal, and by the same layer's model without prefetch); a window then costs one comparison.
    """

    def __init__(self, curves: LayerCurves, shape: ExpertShape, timings: Timings, max_prefetch: int | None,
                 host_lane: bool = False, tables: _Tables | None = None) -> None:
        if curves.num_experts != shape.num_experts:
            raise FmoeError(f"statistics have {curves.num_experts} experts per layer, the model {shape.num_experts}")
        self.curves = curves
        self.shape = shape
        self.timings = timings
        self.max_prefetch = max_prefetch
        self.host_lane = host_lane and timings.has_host  # the host path is a candidate (needs the host's figures)
        self.per_size = max(1, MAX_COLUMNS // (shape.num_experts + 1))  # k candidates per C at most
        self._shared = _Tables() if tables is None else tables

    @property
    def _by_budget(self) -> dict[int, tuple]:
        return self._shared.by_budget

    def with_prefetch(self, max_prefetch: int | None, host_lane: bool = False) -> _LayerModel:
        """The same layer with another prefetch width (0: none) and host lane, sharing its tables (they depend on
        the curves, the shape and the timings alone)."""
        return _LayerModel(self.curves, self.shape, self.timings, max_prefetch, host_lane, self._shared)

    def _columns(self, budget: int) -> tuple[np.ndarray, np.ndarray]:
        """The candidates (C, k) for V_i = budget (`budget_candidates`: the same for every layer of the shape)."""
        return budget_candidates(self.shape, self.per_size, int(budget))

    def _tables(self, budget: int) -> tuple:
        tables = self._by_budget.get(budget)
        if tables is not None:
            return tables
        shape, curves, t = self.shape, self.curves, self.timings
        sizes, k = self._columns(budget)  # per candidate: C_i, k_i
        theta = k / shape.intermediate  # θ_i
        hit = cache_hit_rate(curves.hit, sizes, shape.top_k)  # H_i(C)
        # (each [y, col] table made in one array, in place: the same operations as written out, fewer allocations)
        cost = curves.predicted_cached[:, sizes]  # [y, col]: PH_i(y, C)
        np.multiply(cost, theta[None, :], out=cost)
        np.subtract(1.0, cost, out=cost)  # 1 − PH_i(y,C)·θ_i
        np.multiply(cost, t.t_load, out=cost)
        np.cumsum(cost, axis=0, out=cost)  # Σ_{y'≤y} (1 − PH·θ)·T_load: what the prefetches load
        # Eq. 9's credit from the joint count: Σ_{y'≤y} P(y') − PAH(y', C)·θ (a right prefetch of a cached top
        # hides its bottom only; MoEpic's (1 − PH·θ)·P takes "activated" and "cached" as independent)
        gain = curves.predicted_hit_cached[:, sizes]  # [y, col]: PAH_i(y, C), right and its top cached
        np.multiply(gain, theta[None, :], out=gain)
        np.subtract(curves.predicted_hit[:, None], gain, out=gain)  # P_i(y) − PAH_i(y, C)·θ_i
        np.cumsum(gain, axis=0, out=gain)
        # (the right prefetches taken over and those of cached tops: `_right_prefetches`, for the chosen column alone)
        cached = shape.top_k * hit * theta  # K·H_i(C)·θ_i
        # segments loaded per token: every activated expert but the whole cached ones, K − K·H_i(C)·[k_i = I]
        loaded = shape.top_k - np.where(k == shape.intermediate, shape.top_k * hit, 0.0)
        # tops admitted per token: every miss is loaded whole and offered to the cache (LCP always replaces),
        # but only an unpinned cached expert can make room: the layer's h hits and each admitted miss stay
        # pinned until the layer ends (offload/cache.py: admit), so a token admits min(K, C_i) − h of its
        # K − h misses, in expectation min(K, C_i) − K·H_i(C_i); each a copy of θ_i of an expert
        admitted = np.where(sizes > 0, np.maximum(0.0, np.minimum(sizes, shape.top_k) - shape.top_k * hit) * theta,
                            0.0)
        # top hits of a split (0 < k_i < I) run two segment forwards: c more each
        split_hits = np.where((k > 0) & (k < shape.intermediate), shape.top_k * hit, 0.0)
        host = loaded * t.t_host_load + admitted * t.t_admit + split_hits * t.t_segment
        tables = (sizes, k, theta, cost, gain, cached, host, self._host_lane(sizes, k, theta, hit))
        # kept per budget (Algorithm 1 returns to a budget often), within TABLE_CACHE_BYTES a layer (the layers that
        # share them: `_Tables`), the oldest out first: a table is [Y, candidates] floats twice over, 1.4 MB for
        # Qwen3-30B-A3B's 128 experts at a quarter of them (3.7 MB when it held four such), and a count of budgets
        # alone let `fmoe plan` reach 11 GiB of RAM on that model (16 GiB and more on DeepSeek-V3)
        nbytes = sum(a.nbytes for a in tables if isinstance(a, np.ndarray))
        kept = self._by_budget
        while kept and (len(kept) + 1) * nbytes > TABLE_CACHE_BYTES * self._shared.layers_counted:
            del kept[next(iter(kept))]
        kept[budget] = tables
        return tables

    def _right_prefetches(self, size: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """For one candidate (C, k), per prefetch count y: the right prefetches issued (segments a layer then takes
        over instead of submitting them), Σ_{y'≤y} P(y') − PAH(y', C)·[k = I] (a whole cached expert is not
        prefetched; each a submission h_pf already paid), and the right prefetches of cached tops, Σ_{y'≤y} PAH(y', C).
        Made for the chosen candidate alone (a table of every candidate's was [Y, candidates] floats twice more per
        budget); the same sums, in the same order, as every candidate's cumulated at once."""
        curves = self.curves
        right_cached = curves.predicted_hit_cached[:, size]
        whole = float(k == self.shape.intermediate)
        return np.cumsum(curves.predicted_hit - right_cached * whole), np.cumsum(right_cached)

    def _host_lane(self, sizes: np.ndarray, k: np.ndarray, theta: np.ndarray, hit: np.ndarray) -> tuple:
        """Per candidate (C, k), a host-lane layer (docs/architecture.md § The host lane): its experts' time
        max(D_i, T_host^i) and T_host^i, where, per decode token,
            D_i      = K·H_i(C)·(c + (T_exp − c)·θ_i)                       the device: whole or top hits
            T_host^i = K·H_i(C)·[0 < k_i < I]·t_host(I − k_i)               the host: the top hits' bottoms
                       + K·(1 − H_i(C))·t_host(I) + s_host                  and the misses, from RAM
        (t_host(n) = a + (t_host(I) − a)·n/I from the host profile; s_host the lane's round trip per layer;
        c the segment's fixed cost, as the simulator charges it). Nothing crosses the link in decode (the
        cache's fills after a miss go at prefetch priority, off the critical path: not charged)."""
        shape, t = self.shape, self.timings
        if not t.has_host:
            zero = np.zeros(len(sizes))
            return zero, zero
        top_k, width = shape.top_k, shape.intermediate
        call = min(t.t_segment, t.t_exp)
        device = top_k * hit * np.where(k > 0, call + (t.t_exp - call) * theta, 0.0)
        host_call = min(t.t_host_call, t.t_host_expert)
        per_neuron = (t.t_host_expert - host_call) / width
        bottoms = top_k * hit * np.where((k > 0) & (k < width), host_call + per_neuron * (width - k), 0.0)
        misses = top_k * (1.0 - hit) * t.t_host_expert
        lane = bottoms + misses
        lane = lane + np.where(lane > 0, t.t_host_sync, 0.0)
        return np.maximum(device, lane), lane

    def _host_choice(self, budget: int, window: float, sizes, k, theta, lane_time, lane_host,
                     cache_size: int | None) -> tuple[LayerChoice, float]:
        """The host-lane candidate of least time (ties: the most bytes cached), or the given cache size's;
        T^i = max(D_i, T_host^i) − T_moe, T_wind^{i+1} = max(D_i, T_host^i) + T_att (the link idle in this layer)."""
        t = self.timings
        if cache_size is None:
            best = lane_time <= lane_time.min() + _TIE * max(t.t_host_expert, 1e-300)
            c = int(np.argmax(np.where(best, sizes * k, -1)))
        else:
            fixed = np.flatnonzero(sizes == cache_size)
            c = int(fixed[-1]) if len(fixed) else 0
        size = int(sizes[c])
        hit = float(cache_hit_rate(self.curves.hit, np.array([size]), t.top_k)[0])
        choice = LayerChoice(
            budget=int(budget), cache_size=size, top_neurons=int(k[c]), split=float(theta[c]),
            vram_bytes=int(size * k[c] * self.shape.neuron_bytes), hit_rate=hit,
            hidden=float(t.top_k * hit * theta[c]), prefetches=0, window=float(window),
            exposed=float(lane_time[c] - t.t_moe), host=True, host_s=float(lane_host[c]))
        return choice, float(lane_time[c] + t.t_att)

    def _stall(self, m: np.ndarray, behind: float, submit: float, taken_over: float,
               prefetching: bool) -> tuple[np.ndarray, np.ndarray]:
        """S_i and B_i of tokens with m experts' worth hidden (per token: `hidden_distribution`; the module's doc):
        the compute waits for the first load, then for each next one only as far as the link is slower than the
        compute of the one before it."""
        t = self.timings
        loads = t.top_k - m  # n_i: the experts still to load, one after another on the link
        busy = behind + loads * t.t_load  # B_i: the link's work once layer i has routed
        submitted = np.maximum(0.0, loads - taken_over)  # demand loads the layer submits once it has routed
        serve = t.t_exp + t.t_host_load - submit  # the compute side's time per loaded segment once it lands
        # the compute side's lead on the first load once the layer has routed: the submission of its loads
        # (n_i·h_sub), the cached segments' compute, the routing layout (h_route) and, when it prefetches, the
        # predictor and prefetcher (h_pf: the engine runs them as soon as its demand loads are queued,
        # offload/engine.py, while they are on the link)
        lead = m * t.t_exp + np.where(
            loads > 1e-9, submitted * submit + t.t_host_route + (t.t_host_prefetch if prefetching else 0.0), 0.0)
        # a token with nothing to load does not wait for the link, R_i included (it still holds the link: B_i)
        wait = np.maximum(behind + np.minimum(loads, 1.0) * t.t_load, busy - np.maximum(0.0, loads - 1.0) * serve)
        return np.where(loads > 1e-9, wait, 0.0) - lead, busy

    def choose(self, budget: int, window: float, cache_size: int | None = None,
               host_path: bool = False) -> tuple[LayerChoice, float]:
        """The best (C_i, k_i) for V_i = budget in window T_wind^i (or the given `cache_size` with the
        largest k that fits: pricing a fixed plan); returns it and T_wind^{i+1}. With the host lane
        (`host_lane`), the host path is a candidate too and the layer takes the path of the least T^i;
        `host_path` prices the host path alone.

        Kept per inputs (`_Tables.chosen`, shared as the tables are): the search asks a layer the same budget in
        the same window again and again, and the layers of equal curves ask each other's."""
        key = (int(budget), float(window).hex(), cache_size, host_path, self.max_prefetch, self.host_lane)
        chosen = self._shared.chosen
        found = chosen.get(key)
        if found is None:
            found = self._choose(budget, window, cache_size, host_path)
            if len(chosen) >= CHOICES_KEPT:
                chosen.clear()
            chosen[key] = found
        return found

    def _choose(self, budget: int, window: float, cache_size: int | None,
                host_path: bool) -> tuple[LayerChoice, float]:
        sizes, k, theta, cost, gain, cached, host, (lane_time, lane_host) = self._tables(budget)
        t = self.timings
        if host_path and not t.has_host:
            raise FmoeError("a plan with the host lane needs the host's timings (`fmoe profile` measures them)")
        if self.host_lane and cache_size is None or host_path:
            lane, lane_next = self._host_choice(budget, window, sizes, k, theta, lane_time, lane_host, cache_size)
            if host_path:
                return lane, lane_next
        top_k = t.top_k
        columns = np.arange(len(sizes))
        landed = (cost <= window * (1 + 1e-12)).sum(axis=0)  # prefetches done by routing time (Eq. 10's Y)
        if self.max_prefetch is None:
            prefetches = landed
        else:  # the engine issues its prefetch width, whether the window fits them or not
            prefetches = np.full(columns.shape, min(self.max_prefetch, len(cost)))
            landed = np.minimum(landed, prefetches)
        last = np.maximum(landed - 1, 0)
        prefetched = np.where(landed > 0, gain[last, columns], 0.0)
        # The prefetch on the link when the layer routes (the first not landed) keeps the link until it
        # ends; when it is wrong that time is lost to the layer's demand loads (R_i). Prefetches still
        # queued behind it are cancelled for free (offload/pool.py), right ones become demand loads.
        straddler = np.minimum(landed, len(cost) - 1)
        on_link = (landed < prefetches)
        remaining = np.where(on_link, cost[straddler, columns] - window, 0.0)
        wrong = 1.0 - self.curves.predicted_hit[straddler]
        link = np.maximum(0.0, remaining) * wrong  # R_i per candidate
        hidden = np.minimum(cached + prefetched, top_k)  # m_i (Eq. 9), capped at K
        if cache_size is None:
            # Eq. 11, with the work the loads cost besides the link: the load time hidden less that work,
            # argmax m_i·T_load − G_i (= argmax m_i when G_i = 0). Among (near-)ties keep the most bytes
            # cached (never worse in practice), then the smallest C, then the smallest k.
            score = hidden * t.t_load - host
            best = score >= score.max() - _TIE * max(t.t_load, t.t_host_load, t.t_admit, t.t_segment, 1e-300)
            c = int(np.argmax(np.where(best, sizes * k, -1)))
        else:
            fixed = np.flatnonzero(sizes == cache_size)
            c = int(fixed[-1]) if len(fixed) else 0  # its largest k (the plan's); C = 0 when nothing fits
        m = float(hidden[c])
        behind = float(link[c])  # R_i: a wrong prefetch's link time the window did not cover
        work = float(host[c])  # h_load per loaded segment (whole cached experts load nothing), a_e·θ per admission
        # h_sub: the part of h_load spent submitting a demand load; the engine submits all of a layer's loads
        # before it computes anything (offload/engine.py: _submit), so it is spent with the first on the link
        submit = t.submit_share
        taken_over = 0.0  # right prefetches still on the link, which the layer takes over instead of submitting
        taken, bottoms = self._right_prefetches(int(sizes[c]), int(k[c]))
        if prefetches[c] > 0:
            # h_pf: the predictor and prefetcher's work when the layer prefetches, its prefetches' submissions
            # included; a right one is taken over by its layer, not submitted again: h_sub less per right prefetch
            # (those landed and those still on the link when the layer routes)
            right = float(taken[prefetches[c] - 1])
            landed_right = float(taken[last[c]]) if landed[c] > 0 else 0.0
            work += t.t_host_prefetch - right * submit
            taken_over = right - landed_right
        # T^i (Eq. 6, pipelined, + G_i) over the tokens' hidden units m (ours: the paper prices the expected m_i;
        # the stall is not linear in m: `hidden_distribution`); B_i, linear in m, keeps its closed form's mean
        size = int(sizes[c])
        hit_c = float(cache_hit_rate(self.curves.hit, np.array([size]), top_k)[0])
        right_cached = float(bottoms[last[c]]) if landed[c] > 0 and size > 0 else 0.0  # Σ_{y≤Y} PAH_i(y, C)
        values, weights = hidden_distribution(top_k, size, hit_c, float(theta[c]), m, right_cached)
        stall, busy = self._stall(values, behind, submit, taken_over, prefetches[c] > 0)
        stalls = float(np.dot(weights, np.maximum(0.0, stall)))
        busy = float(np.dot(weights, busy))
        exposed = stalls + work
        next_window = t.t_moe + exposed - busy + t.t_att  # T_wind^{i+1} (Eq. 7, + G_i)
        choice = LayerChoice(
            budget=int(budget),
            cache_size=size,
            top_neurons=int(k[c]),
            split=float(theta[c]),
            vram_bytes=int(size * k[c] * self.shape.neuron_bytes),
            hit_rate=hit_c,
            hidden=m,
            prefetches=int(prefetches[c]),
            window=float(window),
            exposed=float(exposed),
        )
        if self.host_lane and cache_size is None and lane.exposed < choice.exposed:
            return lane, lane_next
        return choice, float(next_window)


def _layer_models(stats: RoutingStats, timings: Timings, shape: ExpertShape, max_prefetch: int | None,
                  host_lane: bool = False) -> list[_LayerModel]:
    if stats.num_layers != shape.num_layers:
        raise FmoeError(f"statistics cover {stats.num_layers} MoE layers, the model has {shape.num_layers}")
    if timings.top_k != shape.top_k:
        raise FmoeError(f"timings are for top-{timings.top_k} routing, the model routes to {shape.top_k}")
    groups: dict[bytes, list[tuple[LayerCurves, _Tables]]] = {}
    models = []
    for i in range(shape.num_layers):
        curves = stats.curves(i)
        same = groups.setdefault(_digest(curves), [])
        found = next(((kept, tables) for kept, tables in same if _equal(kept, curves)), None)
        if found is None:
            found = (curves, _Tables())
            same.append(found)
        found[1].layers += 1
        models.append(_LayerModel(found[0], shape, timings, max_prefetch, host_lane, found[1]))
    return models


class _Tables:
    """The priced candidates per budget (`_LayerModel._tables`) of the layers whose curves are equal: with uniform
    routing (config.json alone) every layer's, so that a 48-layer model prices each budget once, not 48 times (and
    not again for the plans without prefetch: `_LayerModel.with_prefetch`). Kept within TABLE_CACHE_BYTES per
    layer sharing them, the oldest dropped first."""

    def __init__(self) -> None:
        self.by_budget: dict[int, tuple] = {}
        self.chosen: dict[tuple, tuple[LayerChoice, float]] = {}  # `_LayerModel.choose`'s answers by their inputs
        self.layers = 0  # layers sharing them (at least 1 counted for the byte budget)

    @property
    def layers_counted(self) -> int:
        return max(1, self.layers)


def _digest(curves: LayerCurves) -> bytes:
    """The bytes of a layer's H_i and P_i (N + 1 and N floats), to find the layers whose curves may be equal
    (`_equal` then compares all four)."""
    return b"".join(np.ascontiguousarray(a, dtype=np.float64).tobytes() for a in (curves.hit, curves.predicted_hit))


def _equal(a: LayerCurves, b: LayerCurves) -> bool:
    """Equal curves, checked element by element behind the digest (NaN never equal: such layers share nothing)."""
    return all(np.array_equal(x, y) for x, y in ((a.hit, b.hit), (a.predicted_hit, b.predicted_hit),
                                                  (a.predicted_cached, b.predicted_cached),
                                                  (a.predicted_hit_cached, b.predicted_hit_cached)))


@lru_cache(maxsize=65536)
def _spread_blocks(blocks: int, most: int) -> tuple[int, ...]:
    """1..`blocks` whole neuron blocks, at most `most` of them evenly spread, ascending (the k candidates of one cache
    size): made once per (blocks, most), where a plan's search asked numpy for them hundreds of thousands of times."""
    return tuple(int(b) for b in np.unique(np.round(np.linspace(1, blocks, min(blocks, most))).astype(np.int64)))


@lru_cache(maxsize=1024)  # a few KB each; every layer of a shape asks for the same budgets
def budget_candidates(shape: ExpertShape, per_size: int, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """The candidates (C, k) for V_i = budget, ordered by C then k: C = 0 with k = 0, then for each
    C whose k_max = V_i / C (whole blocks, ≤ I) holds a block, k_max and smaller whole blocks (at most `per_size`
    of them, `_spread_blocks`). Read-only arrays, made once per (shape, budget) for all the layers."""
    block = shape.neuron_block
    sizes, ks = [0], [0]
    for c in range(1, shape.num_experts + 1):
        k_max = min(budget // c // shape.neuron_bytes // block * block, shape.intermediate)
        if k_max < block:
            break  # larger C hold less
        picks = _spread_blocks(k_max // block, per_size)
        sizes += [c] * len(picks)
        ks += [p * block for p in picks]
    sizes, ks = np.array(sizes, dtype=np.int64), np.array(ks, dtype=np.int64)
    sizes.flags.writeable = ks.flags.writeable = False
    return sizes, ks


def _run(models: Sequence[_LayerModel], budgets: Sequence[int], start: int, window: float) -> list[LayerChoice]:
    choices = []
    for i in range(start, len(models)):
        choice, window = models[i].choose(budgets[i], window)
        choices.append(choice)
    return choices


def first_window(timings: Timings) -> float:
    """T_wind^1 = T_head + T_att: layer 1 is predicted from the previous token's last layer."""
    return timings.t_head + timings.t_att


def expert_split(
    budgets: Sequence[int], stats: RoutingStats, timings: Timings, shape: ExpertShape, max_prefetch: int | None = None,
) -> Split:
    """ExpertSplit({V_i}): C_i and θ_i for every layer, in order, with the window recursion."""
    if len(budgets) != shape.num_layers:
        raise FmoeError(f"{len(budgets)} layer budgets for {shape.num_layers} MoE layers")
    if any(b < 0 for b in budgets):
        raise FmoeError("layer budgets must be ≥ 0 bytes")
    models = _layer_models(stats, timings, shape, max_prefetch)
    return Split(tuple(_run(models, [int(b) for b in budgets], 0, first_window(timings))))


class _Search:
    """Total exposed latency after changing one layer's budget, recomputing only from that layer on."""

    def __init__(self, models: Sequence[_LayerModel], budgets: list[int], timings: Timings) -> None:
        self.models = models
        self.budgets = budgets
        self.choices = _run(models, budgets, 0, first_window(timings))
        exposed = [c.exposed for c in self.choices]
        self.total = float(sum(exposed))
        self.prefix = np.concatenate(([0.0], np.cumsum(exposed)))  # Σ_{i<j} T^i
        self.windows = [c.window for c in self.choices]

    def total_with(self, layer: int, budget: int) -> float:
        models = self.models
        total = self.prefix[layer]
        window = self.windows[layer]
        for i in range(layer, len(models)):
            if i > layer and window == self.windows[i]:  # same window from here on: same choices
                return float(total + self.prefix[-1] - self.prefix[i])
            choice, window = models[i].choose(budget if i == layer else self.budgets[i], window)
            total += choice.exposed
        return float(total)


def price_plan(plan: Plan, stats: RoutingStats, timings: Timings, shape: ExpertShape,
               max_prefetch: int | None = None) -> Split:
    """The model's prediction for a fixed plan (its C_i and k_i; nothing chosen)."""
    models = _layer_models(stats, timings, shape, max_prefetch)
    return _price(models, plan, timings)


def _price(models: Sequence[_LayerModel], plan: Plan, timings: Timings) -> Split:
    window = first_window(timings)
    choices = []
    for model, layer in zip(models, plan.layers):
        size = layer.cache_size if layer.top_neurons > 0 else 0
        choice, window = model.choose(size * layer.top_neurons * model.shape.neuron_bytes, window, cache_size=size,
                                      host_path=layer.host)
        choices.append(choice)
    return Split(tuple(choices))


def _fixed_point(models: Sequence[_LayerModel], budgets: list[int], step: int, timings: Timings,
                 max_iterations: int) -> tuple[_Search, list[float], int]:
    """Algorithm 1's loop from `budgets`: move ζ·V_e (`step`) from the layer that loses least to the one
    that gains most while Σ T^i falls; returns the search at the fixed point, Σ T^i after each accepted
    move (the start first) and the number of moves."""
    layers = len(models)
    search = _Search(models, budgets, timings)
    history = [search.total]
    iterations = 0
    while step > 0 and iterations < max_iterations and layers > 1:
        # The layer that loses least by giving ζ·V_e away, and the one that gains most by taking it.
        losses = [(search.total_with(j, budgets[j] - step) - search.total, j) for j in range(layers) if budgets[j] >= step]
        gains = [(search.total - search.total_with(j, budgets[j] + step), j) for j in range(layers)]
        if not losses:
            break
        loss, donor = min(losses)
        gain, recipient = max((g, -j) for g, j in gains if j != donor)
        recipient = -recipient
        trial = list(budgets)
        trial[donor] -= step
        trial[recipient] += step
        candidate = _Search(models, trial, timings)
        if not candidate.total < search.total - abs(search.total) * 1e-12:  # no longer falls: roll back, stop
            # (|·|: a host-lane layer's T^i can be < 0, and so can the total)
            break
        budgets, search = trial, candidate
        history.append(search.total)
        iterations += 1
    return search, history, iterations


OPTIMUM_UNITS = 32  # the per-layer optimum spends V_e in this many equal units


def unit_prices(model_sets: Sequence[Sequence[_LayerModel]], expert_budget: int,
                windows: Sequence[float]) -> list[np.ndarray]:
    """For each set of layer models, T^i with V_i = u units of V_e / OPTIMUM_UNITS, u = 0..OPTIMUM_UNITS, as
    [i, u], with every layer's window held at `windows`. One sweep, budget by budget and layer by layer, for all
    the sets: the sets of one configuration (with and without prefetch) and the layers of equal curves share their
    tables (`_Tables`), each priced once per budget while it is kept."""
    unit = expert_budget // OPTIMUM_UNITS
    prices = [np.empty((len(models), OPTIMUM_UNITS + 1)) for models in model_sets]
    for u in range(OPTIMUM_UNITS + 1):
        for i, window in enumerate(windows):
            for models, exposed in zip(model_sets, prices):
                exposed[i, u] = models[i].choose(u * unit, window)[0].exposed
    return prices


def per_layer_optimum(models: Sequence[_LayerModel], expert_budget: int, windows: Sequence[float],
                      exposed: np.ndarray | None = None) -> list[int]:
    """The budgets {V_i} (whole units of V_e / OPTIMUM_UNITS, Σ V_i ≤ V_e) that minimise Σ_i T^i(V_i) with every
    layer's window T_wind^i held at `windows` (those of a plan already priced) and each layer's (C_i, k_i) chosen
    as ExpertSplit chooses it: a knapsack over the layers, solved exactly by dynamic programming. Without
    prefetch T^i does not depend on the window; with prefetch the windows move with the plan, and Algorithm 1
    goes on from here. `exposed`: these models' `unit_prices`, when already made."""
    units = OPTIMUM_UNITS
    unit = expert_budget // units
    if unit <= 0:
        return [expert_budget // len(models)] * len(models)
    if exposed is None:
        (exposed,) = unit_prices([models], expert_budget, windows)  # [i, u]: T^i with V_i = u units
    best = exposed[0].copy()  # best[t]: least Σ T^i over the layers so far with t units spent
    picks = []  # per later layer: [t] -> its units in that optimum
    used = np.arange(units + 1)
    for row in exposed[1:]:
        # total[t, u] = best[t − u] + T^i(u) for u ≤ t
        total = np.where(used[None, :] <= used[:, None], best[np.maximum(used[:, None] - used[None, :], 0)] + row[None, :],
                         np.inf)
        choice = np.argmin(total, axis=1)
        picks.append(choice)
        best = total[used, choice]
    t = int(np.argmin(best))
    budgets = []
    for choice in reversed(picks):
        u = int(choice[t])
        budgets.append(u * unit)
        t -= u
    budgets.append(t * unit)
    return list(reversed(budgets))


def vram_allocation(
    expert_budget: int,
    stats: RoutingStats,
    timings: Timings,
    shape: ExpertShape,
    zeta: float = DEFAULT_ZETA,
    *,
    staging_slots: int | None = None,
    max_prefetch: int | None = None,
    max_iterations: int = 100_000,
    baselines: bool = True,
    host_lane: bool = False,
    min_predictions: int = 0,
) -> Configuration:
    """Algorithm 1: how to spend V_e (bytes for the caches, Σ_i V_i ≤ V_e) over the layers,
    then (`baselines`) the same model prices the BASELINES' uniform plans at the same total
    budget (V_e + U_b) and the least predicted exposed time wins.

    The staging pool (U_b = staging_slots · S_e) is outside V_e; by default K slots
    for each of the current and the next layer. Plans without prefetch are candidates only when every
    layer has `min_predictions` decode tokens with a recorded prediction (the module's doc; 0: always).
    """
    if not 0 < zeta <= 1:
        raise FmoeError(f"ζ must be in (0, 1], got {zeta}")
    if expert_budget < 0:
        raise FmoeError(f"the expert budget V_e must be ≥ 0 bytes, got {expert_budget}")
    slots = min_staging_slots(shape) if staging_slots is None else staging_slots
    host_lane = host_lane and timings.has_host
    models = _layer_models(stats, timings, shape, max_prefetch, host_lane)
    layers = shape.num_layers
    budgets = [int(expert_budget) // layers] * layers  # uniform start: V_i = V_e / L
    step = int(zeta * expert_budget)  # ζ·V_e
    search, history, iterations = _fixed_point(models, budgets, step, timings, max_iterations)
    split = Split(tuple(search.choices))
    plan = split.to_plan(shape, slots)
    chosen, candidates = ALGORITHM_1, [(ALGORITHM_1, split.total_exposed)]
    if baselines:
        best = split.total_exposed
        silent = [model.with_prefetch(0) for model in models]  # no prefetch: Y = 0 (the same tables)
        judged = stats.predicted_tokens >= min_predictions  # the predictor's accuracy is known (0: always)
        for name, (theta, prefetch) in BASELINES.items():
            if not prefetch and not judged:
                continue
            base = uniform_plan(shape, int(expert_budget) + slots * shape.expert_bytes, theta, source="configurator")
            base = base if prefetch else replace(base, prefetch=False)
            priced = _price(models if prefetch else silent, base, timings)
            candidates.append((name, priced.total_exposed))
            if priced.total_exposed < best - abs(best) * 1e-9 - 1e-15:  # strictly better: Algorithm 1 keeps ties
                chosen, best, split, plan = name, priced.total_exposed, priced, base
        for name, base in (host_baselines(shape, int(expert_budget) + slots * shape.expert_bytes) if host_lane
                           else {}).items():
            priced = _price(models, base, timings)
            candidates.append((name, priced.total_exposed))
            if priced.total_exposed < best - abs(best) * 1e-9 - 1e-15:
                chosen, best, split, plan = name, priced.total_exposed, priced, base
        # Algorithm 1 again from the per-layer optimum (with and without prefetch): where a cache pays only
        # from several experts per layer on (an admission per miss costs more than the loads a small cache
        # saves), every ζ-move from the uniform start changes nothing, and the search stops at no cache
        # (Mixtral-8x7B bf16 at 12 GiB on an RTX 3060's figures, tests/test_plan_command.py).
        starts = ((FROM_OPTIMUM, models), (FROM_OPTIMUM_SILENT, silent))[:2 if judged else 1]
        prices = (unit_prices([layer_models for _, layer_models in starts], int(expert_budget), search.windows)
                  if expert_budget >= OPTIMUM_UNITS else [None] * len(starts))  # (else no unit to spend)
        for (name, layer_models), exposed in zip(starts, prices):
            start = per_layer_optimum(layer_models, int(expert_budget), search.windows, exposed)
            found, _, _ = _fixed_point(layer_models, start, step, timings, max_iterations)
            total = found.total
            candidates.append((name, total))
            if total < best - abs(best) * 1e-9 - 1e-15:  # strictly better: the earlier candidates keep ties
                chosen, best, split = name, total, Split(tuple(found.choices))
                plan = split.to_plan(shape, slots)
                plan = plan if layer_models is models else replace(plan, prefetch=False)
    return Configuration(plan, split, int(expert_budget), iterations, tuple(history), stats.uniform, chosen,
                         tuple(candidates))


# --- the device budget (docs/architecture.md § Device memory and the link) ------------------------------------------------
@dataclass(frozen=True)
class DeviceBudget:
    """U_n + Σ_i V_i + U_b + KV + workspace ≤ V."""

    total: int  # V
    non_expert: int  # U_n
    staging: int  # U_b
    kv_cache: int  # KV
    workspace: int

    @property
    def expert_budget(self) -> int:
        """V_e: what is left for the top-segment caches."""
        return self.total - self.non_expert - self.staging - self.kv_cache - self.workspace

    def check(self, smaller: str = "") -> None:
        """One line where nothing is left for the experts; `smaller`: what would shrink the parts (the options)."""
        if self.expert_budget < 0:
            parts = (
                f"non-expert weights {self.non_expert / MiB:.0f} MiB + staging pool {self.staging / MiB:.0f} MiB + "
                f"KV cache {self.kv_cache / MiB:.0f} MiB + workspace {self.workspace / MiB:.0f} MiB"
            )
            need = self.total - self.expert_budget
            raise FmoeError(
                f"does not fit in {self.total / MiB:.0f} MiB of device memory: needs at least {need / MiB:.0f} MiB "
                f"({parts}; short by {-self.expert_budget / MiB:.0f} MiB){'; ' + smaller if smaller else ''}"
            )


def replan_due(tokens_since_plan: int, device_idle: bool, tau: int = DEFAULT_TAU) -> bool:
    """Re-plan every τ tokens, but only while the device is idle (between chat turns, after a bench run)."""
    return device_idle and tokens_since_plan >= tau
