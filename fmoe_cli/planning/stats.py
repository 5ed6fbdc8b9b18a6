"""Routing statistics for the configurator (MoEpic §3.4, docs/architecture.md § Statistics, configurator, re-planning).

Per MoE layer i, after q tokens:

- H_i(C): the fraction of activated experts that a cache of size C would hold.
  The engine's cache admits every miss, so it holds the previous token's experts and
  then those of highest priority (`held_order`; MoEpic: the C highest priorities): we
  keep a histogram of every activated expert's rank in that order (0 = first), taken
  *before* the policy sees the token:  H_i(C) = cumsum(hist)[C] / (q·K).
- P_i(y): how often the expert with the y-th highest predicted score was
  activated, divided by q.
- PH_i(y, C): how often the y-th predicted expert was in a cache of size C,
  divided by q (a 2-D histogram over (y, rank)).
- PAH_i(y, C) (ours): how often the y-th predicted expert was activated *and* in a
  cache of size C, divided by q (the same histogram, counted only when it was
  activated). P_i(y) − PAH_i(y, C) is the joint count a prefetch saves a whole load
  for: predicted, activated, not cached. MoEpic's Eq. 9 takes it as the product
  (1 − PH_i(y, C))·P_i(y), which credits prefetches of experts that recur (activated
  again while cached: docs/planning.md § Where the model deviates from the paper).

y is 1-based in the paper and in the `p`/`ph`/`pah` methods; the arrays are 0-based
(row y-1). Memory: N + N + 2·N² counters per layer, O(L·N²) in all.

For P and PH, q counts the tokens for which a prediction was made (equal to q
when every token had one: layer 1 of the very first token has none).

The engine feeds one `observe` per token and layer (a prefill: one call per
prompt token, each with the ranking from before the forward).
"""

from __future__ import annotations

import array
import base64
import json
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import platformdirs

from fmoe_cli.errors import FmoeError, warn
from fmoe_cli.files import locked, read_json, set_aside, writable_dir, write_atomic
from fmoe_cli.models.identity import model_key
from fmoe_cli.offload.policies import LCP, LCP_OMEGA, LCP_RHO, EvictionPolicy

STATS_SCHEMA_VERSION = 2  # 2: PAH_i's histogram (`predicted_active_rank_hist`); a version-1 file lacks it
STATS_LIMIT = 256 << 20  # bytes: statistics of a model with thousands of experts stay far below
_COUNT_DTYPE = np.int64
MAX_EXPERTS = 4096  # per layer; the N×N histogram of one layer is then 128 MiB


class StatsShapeError(FmoeError):
    """Saved statistics of another shape (layers, experts, top-k) than the model's."""


class StatsVersionError(FmoeError):
    """Saved statistics of an older schema version (`version`), which this fmoe does not read."""

    def __init__(self, message: str, version: int) -> None:
        super().__init__(message)
        self.version = version


def _encode(array: np.ndarray) -> str:
    """Counts as zlib-compressed little-endian int64, base64 (the N×N histogram can be large)."""
    raw = np.ascontiguousarray(array, dtype="<i8").tobytes()
    return base64.b64encode(zlib.compress(raw, 6)).decode("ascii")


def _decode(text: str, shape: tuple[int, ...]) -> np.ndarray:
    """The counts back, refusing anything but the expected shape of non-negative counts (a file cannot
    make this allocate more than the shape it declares: decompression stops at that size)."""
    expected = 8 * int(np.prod(shape))
    inflate = zlib.decompressobj()
    raw = inflate.decompress(base64.b64decode(text.encode("ascii"), validate=True), expected + 1)
    if len(raw) != expected or not inflate.eof:
        raise ValueError(f"counts of shape {shape} expected")
    array = np.frombuffer(raw, dtype="<i8").astype(_COUNT_DTYPE)
    if (array < 0).any():
        raise ValueError("a negative count")
    return array.reshape(shape)


@dataclass(frozen=True)
class LayerCurves:
    """The three functions of docs/architecture.md § Statistics, configurator, re-planning for one layer, tabulated (what the configurator reads)."""

    hit: np.ndarray  # [N+1]: H_i(C) for C = 0..N
    predicted_hit: np.ndarray  # [N]: P_i(y) at row y-1
    predicted_cached: np.ndarray  # [N, N+1]: PH_i(y, C) at [y-1, C]
    predicted_hit_cached: np.ndarray  # [N, N+1]: PAH_i(y, C) at [y-1, C] (activated and cached; ≤ P_i(y), PH_i(y, C))

    @property
    def num_experts(self) -> int:
        return self.hit.shape[0] - 1


def uniform_curves(num_experts: int, top_k: int) -> LayerCurves:
    """Uniform routing, no information in the prediction: H(C) = C/N, P(y) = K/N, PH(y, C) = C/N, and activation
    independent of the cache: PAH(y, C) = (K/N)·(C/N)."""
    n = num_experts
    c = np.arange(n + 1, dtype=np.float64) / n
    return LayerCurves(c.copy(), np.full(n, top_k / n), np.tile(c, (n, 1)), np.tile(c * (top_k / n), (n, 1)))


@dataclass(eq=False)
class LayerStats:
    num_experts: int  # N
    top_k: int  # K
    rank_hist: np.ndarray = field(default=None)  # [N] activated experts by priority rank
    predicted_hist: np.ndarray = field(default=None)  # [N] activations of the y-th predicted expert
    predicted_rank_hist: np.ndarray = field(default=None)  # [N, N] (y, priority rank of the y-th predicted)
    tokens: int = 0  # q
    predicted_tokens: int = 0  # tokens with a prediction
    predicted_active_rank_hist: np.ndarray = field(default=None)  # [N, N] (y, rank) when the y-th predicted was activated

    def __post_init__(self) -> None:
        n = self.num_experts
        if self.rank_hist is None:
            self.rank_hist = np.zeros(n, dtype=_COUNT_DTYPE)
        if self.predicted_hist is None:
            self.predicted_hist = np.zeros(n, dtype=_COUNT_DTYPE)
        if self.predicted_rank_hist is None:
            self.predicted_rank_hist = np.zeros((n, n), dtype=_COUNT_DTYPE)
        if self.predicted_active_rank_hist is None:
            self.predicted_active_rank_hist = np.zeros((n, n), dtype=_COUNT_DTYPE)
        self._rank_of = np.empty(n, dtype=np.intp)  # scratch: expert -> priority rank
        self._active = np.zeros(n, dtype=bool)  # scratch: expert -> activated this token
        self._arange = np.arange(n, dtype=np.intp)

    def observe(self, activated: Sequence[int], ranking: Sequence[int], predicted: Sequence[int] | None = None) -> None:
        """One token through this layer.

        activated: the distinct experts the router chose (A_i). ranking: every expert, highest cache
        priority first, as the policy stood before this token. predicted: experts by
        descending speculative score (any prefix of a full ranking), or None.
        """
        rank_of = self._rank_of
        rank_of[np.asarray(ranking, dtype=np.intp)] = self._arange
        active = np.asarray(activated, dtype=np.intp)
        self.rank_hist[rank_of[active]] += 1  # distinct experts: distinct ranks
        self.tokens += 1
        if predicted is not None:
            pred = np.asarray(predicted, dtype=np.intp)
            y = self._arange[: len(pred)]
            # P_i(y): was the y-th predicted expert activated?
            is_active = self._active
            is_active[active] = True
            right = is_active[pred]
            self.predicted_hist[y[right]] += 1
            is_active[active] = False
            # PH_i(y, ·): where the y-th predicted expert stood in the order the cache holds them
            ranks = rank_of[pred]
            self.predicted_rank_hist[y, ranks] += 1
            # PAH_i(y, ·): the same, when it was activated (the joint count: predicted, activated, cached)
            self.predicted_active_rank_hist[y[right], ranks[right]] += 1
            self.predicted_tokens += 1

    # --- the functions of docs/architecture.md § Statistics, configurator, re-planning -----------------------------------------
    def hit_rate(self, cache_size: int) -> float:
        """H_i(C) = cumsum(hist)[C] / (q·K)."""
        return float(self.curves().hit[cache_size])

    def p(self, y: int) -> float:
        """P_i(y), y = 1..N."""
        return float(self.curves().predicted_hit[y - 1])

    def ph(self, y: int, cache_size: int) -> float:
        """PH_i(y, C), y = 1..N, C = 0..N."""
        return float(self.curves().predicted_cached[y - 1, cache_size])

    def pah(self, y: int, cache_size: int) -> float:
        """PAH_i(y, C), y = 1..N, C = 0..N: the y-th predicted expert activated and in a cache of size C."""
        return float(self.curves().predicted_hit_cached[y - 1, cache_size])

    def curves(self) -> LayerCurves:
        """All four tabulated; uniform ones for what was never observed."""
        n = self.num_experts
        uniform = uniform_curves(n, self.top_k)
        activations = int(self.rank_hist.sum())  # q·K (top-K routing activates K per token)
        if activations:
            hit = np.concatenate(([0.0], np.cumsum(self.rank_hist) / activations))
        else:
            hit = uniform.hit
        if self.predicted_tokens:
            q = self.predicted_tokens
            predicted_hit = self.predicted_hist / q
            zero = np.zeros((n, 1))
            predicted_cached = np.concatenate((zero, np.cumsum(self.predicted_rank_hist, axis=1) / q), axis=1)
            predicted_hit_cached = np.concatenate((zero, np.cumsum(self.predicted_active_rank_hist, axis=1) / q), axis=1)
        else:
            predicted_hit, predicted_cached = uniform.predicted_hit, uniform.predicted_cached
            predicted_hit_cached = uniform.predicted_hit_cached
        return LayerCurves(hit, predicted_hit, predicted_cached, predicted_hit_cached)

    # --- persistence ---------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "predicted_tokens": self.predicted_tokens,
            "rank_hist": _encode(self.rank_hist),
            "predicted_hist": _encode(self.predicted_hist),
            "predicted_rank_hist": _encode(self.predicted_rank_hist),
            "predicted_active_rank_hist": _encode(self.predicted_active_rank_hist),
        }

    @classmethod
    def from_dict(cls, data: dict, num_experts: int, top_k: int) -> LayerStats:
        n = num_experts
        tokens, predicted = data["tokens"], data["predicted_tokens"]
        for name, value in (("tokens", tokens), ("predicted_tokens", predicted)):
            if type(value) is not int or value < 0:
                raise ValueError(f"'{name}' must be a count >= 0, got {value!r}")
        if predicted > tokens:
            raise ValueError(f"{predicted} predicted tokens of {tokens} tokens")
        predicted_hist = _decode(data["predicted_hist"], (n,))
        predicted_rank_hist = _decode(data["predicted_rank_hist"], (n, n))
        active = _decode(data["predicted_active_rank_hist"], (n, n))
        if (active > predicted_rank_hist).any() or (active.sum(axis=1) != predicted_hist).any():
            raise ValueError("the joint count of predicted, activated and cached experts does not add up")
        return cls(n, top_k, _decode(data["rank_hist"], (n,)), predicted_hist, predicted_rank_hist, tokens, predicted,
                   active)

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return self.rank_hist, self.predicted_hist, self.predicted_rank_hist, self.predicted_active_rank_hist

    def copy(self) -> LayerStats:
        return LayerStats(self.num_experts, self.top_k, self.rank_hist.copy(), self.predicted_hist.copy(),
                          self.predicted_rank_hist.copy(), self.tokens, self.predicted_tokens,
                          self.predicted_active_rank_hist.copy())

    def add(self, other: LayerStats, sign: int = 1) -> None:
        """Add (sign -1: subtract) another layer's counts, in place (merging sessions' statistics)."""
        for mine, theirs in zip(self._arrays(), other._arrays()):
            mine += sign * theirs
        self.tokens += sign * other.tokens
        self.predicted_tokens += sign * other.predicted_tokens

    def assign(self, other: LayerStats) -> None:
        """Take another layer's counts, in place."""
        for mine, theirs in zip(self._arrays(), other._arrays()):
            mine[...] = theirs
        self.tokens, self.predicted_tokens = other.tokens, other.predicted_tokens


def held_order(ranking: Sequence[int], last: Sequence[int], step: int) -> np.ndarray:
    """The order a cache that admits every miss holds the experts in, before the token at `step`: the previous
    token's experts (last step = step − 1) first, then the rest, each group in `ranking`'s order (the policy's
    priority). The engine's cache (offload/cache.py: admit) offers every loaded miss and evicts the lowest priority
    among the unpinned, so after a token it holds that token's experts whatever their priority, and its other
    slots the survivors of highest priority: a cache of C ≥ K slots holds the first C of this order, not the C of
    highest priority that MoEpic's H_i(C) assumes (docs/planning.md § Where the model deviates from the paper: on
    the synthetic Qwen1.5-MoE routing of `simulate.py paper`, C = 9 of 60, the cache hit 0.46, the C highest
    priorities 0.24, this order 0.46)."""
    order = np.asarray(ranking, dtype=np.intp)
    recent = np.asarray(last, dtype=np.int64)[order] == step - 1 if step > 0 else np.zeros(len(order), dtype=bool)
    return np.concatenate((order[recent], order[~recent]))


def lcp_ranking(policy: EvictionPolicy, step: int, omega: float | None = None, rho: float | None = None) -> list[int]:
    """`policy.ranking(step)` for LCP: P = μ · ρ^(ν/ω), highest first, ties by expert id.

    Every policy keeps μ (`count`) and the last step (`last`), so this also ranks by
    LCP priority while another policy runs the cache (ω, ρ: the policy's own if it is
    LCP, else the arguments, else MoEpic's defaults).
    """
    omega = getattr(policy, "omega", None) or omega or LCP_OMEGA
    rho = getattr(policy, "rho", None) or rho or LCP_RHO
    return _lcp_order(policy.count, policy.last, step, math.log(rho) / omega)


def lcp_ranks(policy: EvictionPolicy, step: int) -> np.ndarray:
    """`lcp_ranking(policy, step)` as an array, computed by numpy: the same priorities, float for float (log μ from a
    table of `math.log`'s values, ν·(log ρ / ω) and their sum as the same float64 operations; −inf for μ = 0), and
    the same order (a stable sort, ties by expert id). A decode step's statistics rank every expert of every layer:
    N logs and a sort of N in Python cost tens of µs a layer at N = 64–128."""
    return _lcp_argsort(np.asarray(policy.count, dtype=np.int64), np.asarray(policy.last, dtype=np.int64), step,
                        _log_rho_per_token(policy))


def _log_rho_per_token(policy: EvictionPolicy) -> float:
    """log ρ / ω of LCP's priority: the policy's own ω and ρ if it is LCP, else MoEpic's defaults."""
    omega = getattr(policy, "omega", None) or LCP_OMEGA
    rho = getattr(policy, "rho", None) or LCP_RHO
    return math.log(rho) / omega


def _lcp_argsort(count: np.ndarray, last: np.ndarray, step: int, log_rho_per_token: float) -> np.ndarray:
    """Every expert by LCP priority log μ + ν · (log ρ / ω) at `step`, highest first, ties by id (a stable sort)."""
    priority = _log_counts(count) + (step - last) * log_rho_per_token
    return np.argsort(-priority, kind="stable")


_LOGS = np.array([-math.inf])  # log μ for μ = 0, 1, 2, …: math.log's values (−inf for 0), grown as counts grow


def _log_counts(count: np.ndarray) -> np.ndarray:
    global _LOGS
    if len(count) and count.max() >= len(_LOGS):
        size = max(2 * len(_LOGS), int(count.max()) + 1)
        _LOGS = np.array([-math.inf] + [math.log(mu) for mu in range(1, size)])
    return _LOGS[count]


def _lcp_order(count: Sequence[int], last: Sequence[int], step: int, log_rho_per_token: float) -> list[int]:
    """The same expression as `LCP.priority` (log P, so the same floats), without a method call per expert."""
    log = math.log
    priority = [log(mu) + (step - t) * log_rho_per_token if mu else -math.inf for mu, t in zip(count, last)]
    return sorted(range(len(priority)), key=priority.__getitem__, reverse=True)  # stable, reversed too: ties by id


@dataclass
class RoutingStats:
    """Statistics of every MoE layer of one model."""

    model: str  # model id or directory, as the user named it
    num_experts: int  # N
    top_k: int  # K
    layers: list[LayerStats]
    uniform: bool = False  # made up (uniform routing), not recorded

    @classmethod
    def empty(cls, model: str, num_layers: int, num_experts: int, top_k: int) -> RoutingStats:
        return cls(model, num_experts, top_k, [LayerStats(num_experts, top_k) for _ in range(num_layers)])

    @classmethod
    def assume_uniform(cls, model: str, num_layers: int, num_experts: int, top_k: int) -> RoutingStats:
        """Nothing recorded: every layer reads as uniform routing (see `uniform_curves`)."""
        stats = cls.empty(model, num_layers, num_experts, top_k)
        stats.uniform = True
        return stats

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def tokens(self) -> int:
        return max((layer.tokens for layer in self.layers), default=0)

    @property
    def predicted_tokens(self) -> int:
        """Decode tokens with the prefetcher's ranking recorded, in the layer that has fewest (P_i, PH_i
        rest on them; a run without prefetch records none: its predictor does not run)."""
        return min((layer.predicted_tokens for layer in self.layers), default=0)

    def observe(self, layer: int, activated: Sequence[int], ranking: Sequence[int], predicted: Sequence[int] | None = None) -> None:
        self.layers[layer].observe(activated, ranking, predicted)

    def observe_policy(self, layer: int, activated: Sequence[int], policy: EvictionPolicy, step: int, predicted: Sequence[int] | None = None) -> None:
        """Convenience for the engine: rank by the layer's policy as it stands before the token."""
        ranking = lcp_ranking(policy, step) if type(policy) is LCP else policy.ranking(step)
        self.layers[layer].observe(activated, held_order(ranking, policy.last, step), predicted)

    def curves(self, layer: int) -> LayerCurves:
        return self.layers[layer].curves()

    # --- persistence ---------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "schema_version": STATS_SCHEMA_VERSION,
            "kind": "fmoe-routing-stats",
            "model": self.model,
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "layers": [layer.to_dict() for layer in self.layers],
        }

    @classmethod
    def from_dict(cls, data: dict, source: str = "routing statistics", expect: tuple[int, int, int] | None = None) -> RoutingStats:
        """`expect`: (num_layers, num_experts, top_k) the caller needs; another shape raises StatsShapeError
        before any counts are decoded."""
        if not isinstance(data, dict) or data.get("kind") != "fmoe-routing-stats":
            raise FmoeError(f"{source} is not an fmoe routing-statistics file")
        version = data.get("schema_version")
        if type(version) is int and 1 <= version < STATS_SCHEMA_VERSION:
            raise StatsVersionError(f"{source} was saved by an older fmoe (schema version {version}; this fmoe reads "
                                    f"version {STATS_SCHEMA_VERSION}, which counts the predicted experts activated "
                                    f"while cached)", version)
        if version != STATS_SCHEMA_VERSION:
            raise FmoeError(f"{source} has schema version {version!r}; this fmoe reads version {STATS_SCHEMA_VERSION}")
        try:
            shape = tuple(data[key] for key in ("num_layers", "num_experts", "top_k"))
            if any(type(v) is not int or v < 1 for v in shape):
                raise ValueError(f"num_layers, num_experts and top_k must be integers >= 1, got {list(shape)}")
            if expect is not None and shape != tuple(expect):
                raise StatsShapeError(f"{source} is for {shape[0]} layers of {shape[1]} experts (top-{shape[2]}), "
                                      f"not {expect[0]} layers of {expect[1]} (top-{expect[2]})")
            num_layers, n, k = shape
            if not isinstance(data["layers"], list) or len(data["layers"]) != num_layers:
                raise ValueError(f"{num_layers} layers declared, {len(data['layers'])} present")
            if n > MAX_EXPERTS:
                raise ValueError(f"{n} experts (at most {MAX_EXPERTS})")
            layers = [LayerStats.from_dict(d, n, k) for d in data["layers"]]
            return cls(str(data["model"]), n, k, layers)
        except (KeyError, TypeError, ValueError, zlib.error) as exc:
            raise FmoeError(f"{source} is malformed ({type(exc).__name__}: {exc})") from None

    def save(self, path: Path) -> Path:
        return write_atomic(Path(path), json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path: Path, expect: tuple[int, int, int] | None = None) -> RoutingStats:
        return cls.from_dict(read_json(path, "routing statistics", limit=STATS_LIMIT), source=f"routing statistics {path}", expect=expect)


MAX_PENDING = 512  # decode tokens a layer's observations wait at most before the recorder takes them in


@dataclass
class _Pending:
    """A layer's tokens observed since the recorder last took them in, and what their rankings are made from: the
    policy's μ and last steps and the layer's clock before the first of them (each later token's follow from these by
    the touches of the ones before: only `LayerCache.record` touches a policy)."""

    policy: EvictionPolicy  # whose state it is: another (a new plan) ends the run of tokens
    count: list[int]  # μ before the first token
    last: list[int]  # the last steps before it
    step: int  # the layer's clock at the first token
    log_rho_per_token: float  # log ρ / ω, LCP's (MoEpic's defaults for another policy)
    rows: list[list[int]] = field(default_factory=list)  # each token's activated experts
    predicted: list = field(default_factory=list)  # each token's predicted ranking (int16: array.array "h"), or None

    @property
    def next_step(self) -> int:
        """The layer's clock at the next token, if nothing but these tokens moved it."""
        return self.step + len(self.rows)


class StatsRecorder:
    """An engine observer (`engine.observers.append(recorder)`) that feeds RoutingStats.

    Each RouteEvent comes before the layer's policy sees the forward: every token of it
    is observed with the LCP priority ranking of its own moment, in the order a cache holds the experts
    (`held_order`: the previous token's first; the policy records a
    prefill token by token, so token t is ranked after the touches of tokens 0..t-1),
    and a decode token also with the prefetcher's ranking for the layer (P_i, PH_i).
    `tokens` counts the tokens that passed the first MoE layer (for τ).

    Out of the hot path (issue 39 §5): an event only notes its tokens (their experts, the prediction) and, at the
    first of a run, the policy's μ, last steps and clock; the rankings and histograms are made when the statistics
    are read (`stats`, `save`, `flush`: a re-plan, the idle device, the end of a run), by replaying the run's
    touches on those copies — the same floats as at each token (`lcp_ranks`). A run of tokens ends where the policy
    changed (a new plan) or the layer's clock moved otherwise, and after MAX_PENDING tokens.
    """

    def __init__(self, stats: RoutingStats, path: Path | None = None) -> None:
        self._stats = stats
        self.path = path
        self.tokens = 0
        self._saved = [layer.copy() for layer in stats.layers]  # the counts as last read or written
        self._pending: list[_Pending | None] = [None] * len(stats.layers)

    @property
    def stats(self) -> RoutingStats:
        """The statistics, every token observed so far taken in."""
        self.flush()
        return self._stats

    def __call__(self, event) -> None:  # event: offload.engine.RouteEvent
        cache = event.cache
        policy = cache.policy
        k = event.top_k_index.shape[-1]
        routed = event.routed  # top_k_index on the host, token-major (the engine's list: no op)
        rows = [list(routed)] if len(routed) == k else [routed[t:t + k] for t in range(0, len(routed), k)]
        pending = self._pending[event.layer]
        if pending is None or pending.policy is not policy or pending.next_step != cache.step:
            self._take_in(event.layer)
            pending = self._pending[event.layer] = _Pending(policy, list(policy.count), list(policy.last), cache.step,
                                                            _log_rho_per_token(policy))
        pending.rows.extend(rows)
        predicted = event.predicted if len(rows) == 1 else None
        if predicted is None:
            pending.predicted.extend([None] * len(rows))
        else:
            pending.predicted.append(array.array("h", predicted))  # int16 as numpy's, without numpy's call (µs a layer)
        if len(pending.rows) >= MAX_PENDING:
            self._take_in(event.layer)
        if event.layer == 0:
            self.tokens += len(rows)

    def flush(self) -> None:
        """Take in every layer's observed tokens (the statistics are then up to date)."""
        for layer in range(len(self._pending)):
            self._take_in(layer)

    def _take_in(self, layer: int) -> None:
        """Layer `layer`'s pending tokens into its statistics, each with the LCP ranking of its moment: `lcp_ranks`'s
        expression on the copies of μ and the last steps, touched token by token as `LayerCache.record` touches them."""
        pending, self._pending[layer] = self._pending[layer], None
        if pending is None:
            return
        stats = self._stats.layers[layer]
        count = np.array(pending.count, dtype=np.int64)
        last = np.array(pending.last, dtype=np.int64)
        step, per_token = pending.step, pending.log_rho_per_token
        for row, predicted in zip(pending.rows, pending.predicted):
            stats.observe(row, held_order(_lcp_argsort(count, last, step, per_token), last, step), predicted)
            for e in row:  # EvictionPolicy.touch
                count[e] += 1
                last[e] = step
            step += 1

    def save(self) -> Path | None:
        """Add this session's new counts to the file, under its lock: what other sessions saved since
        this one read it is kept (concurrent sessions add up), and this session's statistics become
        the sum. A save that cannot be written is skipped with one warning (and not tried again). The observed
        tokens are taken in first, saved or not (`flush`: the save is called when the device is idle)."""
        stats = self.stats
        if self.path is None:
            return None
        path = Path(self.path)
        if all(mine.tokens == saved.tokens for mine, saved in zip(stats.layers, self._saved)):
            return path if path.exists() else None  # nothing observed since (a run that failed to load): no file
        try:
            with locked(path):
                disk = _read_saved(path, (stats.num_layers, stats.num_experts, stats.top_k))
                if disk is not None:
                    for mine, saved, theirs in zip(stats.layers, self._saved, disk.layers):
                        delta = mine.copy()
                        delta.add(saved, -1)  # what this session observed since the last read or write
                        theirs.add(delta)
                        mine.assign(theirs)
                else:  # no file now (deleted meanwhile, or a damaged one set aside): nothing, plus what this session
                    for mine, saved in zip(stats.layers, self._saved):  # observed since (a user's reset is kept)
                        mine.add(saved, -1)
                stats.save(path)
        except OSError as exc:
            warn(f"cannot save routing statistics to {path} ({exc.strerror or exc}); "
                 "this session's statistics are not kept")
            self.path = None
            return None
        self._saved = [layer.copy() for layer in stats.layers]
        return path


def scratch_recorder(shape) -> StatsRecorder:
    """A recorder that records into statistics nobody keeps: a measurement pays what recording costs
    (every bench and chat run records) without its traffic entering the model's statistics."""
    return StatsRecorder(RoutingStats.empty("measurement", shape.num_layers, shape.num_experts, shape.top_k))


def default_stats_path(model: str, config_dir: Path | None = None, model_path: Path | None = None) -> Path:
    """Per model, next to its profile: <user config dir>/profiles/<model key>.stats.json (platformdirs).

    The model key (models.identity) names the model by where it comes from and a fingerprint of its
    config and weights: a local directory called `demo` is not the built-in demo. `model_path`: the
    model's resolved directory (or config.json) when known."""
    base = Path(config_dir) if config_dir is not None else Path(platformdirs.user_config_dir("fmoe"))
    return base / "profiles" / f"{model_key(model, model_path)}.stats.json"


def _read_saved(path: Path, expect: tuple[int, int, int]) -> RoutingStats | None:
    """The statistics saved at `path`, or None if there are none. A damaged file, or one of another
    shape, is set aside (`.corrupt-<time>`) with a one-line warning: it never blocks a session. A file of an
    older schema version (its counts would be misread) is set aside the same way as `.v<version>-<time>`."""
    path = Path(path)
    if not path.exists() or path.is_dir():  # a directory: left alone (load_or_empty says so)
        return None
    try:
        return RoutingStats.load(path, expect=expect)
    except FmoeError as exc:
        try:
            aside = set_aside(path, f"v{exc.version}" if isinstance(exc, StatsVersionError) else "corrupt")
        except OSError as err:
            warn(f"{exc}; cannot move it aside ({err.strerror or err}): starting with empty statistics")
            return None
        warn(f"{exc}; moved it to {aside.name} and started with empty statistics")
        return None


def load_or_empty(model: str, num_layers: int, num_experts: int, top_k: int, path: Path | None = None) -> RoutingStats:
    """What earlier sessions learned about this model, or empty statistics if nothing (usable) was saved."""
    path = Path(path or default_stats_path(model))
    if path.is_dir():
        warn(f"routing statistics {path} is a directory, not a file: move it away to keep statistics")
    with locked(path):
        stats = _read_saved(path, (num_layers, num_experts, top_k))
    if stats is None:
        return RoutingStats.empty(model, num_layers, num_experts, top_k)
    stats.model = model
    return stats


def open_recorder(model: str, num_layers: int, num_experts: int, top_k: int, path: Path) -> StatsRecorder:
    """A StatsRecorder that starts from the saved statistics and will add to them. Where they cannot
    be saved (a read-only config directory, a directory in place of the file) it says so once, now,
    and the session goes on without saving."""
    path = Path(path)
    stats = load_or_empty(model, num_layers, num_experts, top_k, path)
    save_to: Path | None = path
    if path.is_dir():
        save_to = None  # load_or_empty said so
    elif (why := writable_dir(path.parent)) is not None:
        warn(f"cannot save routing statistics in {path.parent} ({why}); this session's statistics are not kept")
        save_to = None
    return StatsRecorder(stats, save_to)
