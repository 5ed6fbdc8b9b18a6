"""Eviction policies for the per-layer expert cache.

Pure Python, no tensors: the engine, `fmoe replay` and the routing statistics all
use these same classes. `step` is the layer's token counter (one step per token
that passed through the layer, prompt tokens included: a prefill of T tokens
advances it T times, token by token).

When an expert that is not cached has been loaded and the cache is full, the
policy names the cached expert that goes (`choose_victim`); the newcomer always
takes its slot (MoEpic §3.3: "Once the cache miss, MoEpic evicts the
lowest-priority expert from VRAM, and replaces it with the newly loaded expert").
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from fmoe_cli.errors import FmoeError


class EvictionPolicy:
    """Priority-based policy: the lowest-priority unpinned expert is the victim."""

    name = "base"
    uses_prediction = False  # True: the prefetcher feeds it the predicted scores of its layer

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.count = [0] * num_experts  # μ: activations so far
        self.last = [-1] * num_experts  # step of the last activation (-1: never)

    def touch(self, expert: int, step: int) -> None:
        """Record one activation of `expert` at `step`."""
        self.count[expert] += 1
        self.last[expert] = step

    def priority(self, expert: int, step: int) -> float:
        raise NotImplementedError

    def see_prediction(self, scores: Sequence[float]) -> None:
        """The latest predicted scores for this layer (only called when `uses_prediction`)."""

    def choose_victim(self, candidates: Sequence[int], step: int) -> int:
        # Ties go to the lowest expert id so that runs are deterministic.
        return min(candidates, key=lambda e: (self.priority(e, step), e))

    def ranking(self, step: int) -> list[int]:
        """All experts, highest priority first (what a cache of size C would hold: the first C)."""
        return sorted(range(self.num_experts), key=lambda e: (-self.priority(e, step), e))


# LCP's ω and ρ (MoEpic Eq. 4): the one place their defaults and their range are written.
LCP_OMEGA = 128.0  # ω: tokens over which an idle expert's priority decays by ρ
LCP_RHO = 0.25  # ρ: the decay per ω idle tokens


def check_lcp(omega: float, rho: float) -> None:
    """Refuse ω that is not finite and > 0, or ρ outside (0, 1] (ρ = 1: no decay), in one line."""
    if not 0 < omega < float("inf") or not 0 < rho <= 1:
        raise FmoeError(f"LCP needs a finite ω > 0 and 0 < ρ ≤ 1, got ω = {omega:g}, ρ = {rho:g}")


class LCP(EvictionPolicy):
    """Least Critical Priority (MoEpic Eq. 4): P = μ · ρ^(ν/ω).

    μ is the expert's activation count and ν the number of tokens since its last
    activation. A miss replaces the lowest-priority cached expert (no admission test:
    on the Mixtral HumanEval trace an admission rule, "replace only when the
    newcomer's P is higher", lost at every cache size, docs/traces.md).

    `priority` is log P = log μ + (ν/ω)·log ρ: the same order as P, but P itself
    underflows to 0 after ~69k idle tokens (ρ = 0.25, ω = 128), where every old
    expert would tie; log P keeps them apart. Never activated: −inf.
    """

    name = "lcp"

    def __init__(self, num_experts: int, omega: float = LCP_OMEGA, rho: float = LCP_RHO) -> None:
        super().__init__(num_experts)
        check_lcp(omega, rho)
        self.omega = omega
        self.rho = rho
        self.log_rho_per_token = math.log(rho) / omega  # log ρ / ω

    def priority(self, expert: int, step: int) -> float:
        mu = self.count[expert]
        if mu == 0:
            return -math.inf
        nu = step - self.last[expert]  # ν
        return math.log(mu) + nu * self.log_rho_per_token  # log(μ · ρ^(ν/ω))


class LRU(EvictionPolicy):
    name = "lru"

    def priority(self, expert: int, step: int) -> float:
        return float(self.last[expert])


class LFU(EvictionPolicy):
    """Least frequently used (activation counts, as MoE-Infinity's cache); ties by recency."""

    name = "lfu"

    def priority(self, expert: int, step: int) -> float:
        # Counts are integers; recency (< 1) only breaks ties between equal counts.
        return self.count[expert] + (self.last[expert] + 1) / (step + 2)


class RandomPolicy(EvictionPolicy):
    name = "random"

    def __init__(self, num_experts: int, seed: int = 0) -> None:
        super().__init__(num_experts)
        self._rng = random.Random(seed)

    def priority(self, expert: int, step: int) -> float:
        return 0.0

    def choose_victim(self, candidates: Sequence[int], step: int) -> int:
        return self._rng.choice(sorted(candidates))


class FinemoePolicy(EvictionPolicy):
    """fMoE's eviction: evict the expert with the highest 1 / (p · freq), i.e. keep the
    highest p · freq. p: the expert's probability in the layer's latest prediction
    (normalised to sum 1; uniform 1/N before any), freq: its activation count μ.

    Choices: freq is the count μ (for one layer at one time the same order as the
    frequency μ/step); a newcomer is always admitted (plain eviction, as the paper);
    negative scores (DeepSeek-V3's bias) count as 0.
    """

    name = "finemoe"
    uses_prediction = True

    def __init__(self, num_experts: int) -> None:
        super().__init__(num_experts)
        self.p = [1.0 / num_experts] * num_experts

    def see_prediction(self, scores: Sequence[float]) -> None:
        clipped = [max(0.0, s) for s in scores]
        total = sum(clipped)
        self.p = [s / total for s in clipped] if total > 0 else [1.0 / self.num_experts] * self.num_experts

    def priority(self, expert: int, step: int) -> float:
        return self.p[expert] * self.count[expert]


POLICIES = {"lcp": LCP, "lru": LRU, "lfu": LFU, "random": RandomPolicy, "finemoe": FinemoePolicy}


def make_policy(name: str, num_experts: int, *, omega: float = LCP_OMEGA, rho: float = LCP_RHO, seed: int = 0) -> EvictionPolicy:
    if name == "lcp":
        return LCP(num_experts, omega=omega, rho=rho)
    if name == "random":
        return RandomPolicy(num_experts, seed=seed)
    if name in POLICIES:
        return POLICIES[name](num_experts)
    raise ValueError(f"unknown eviction policy {name!r}; choose from {', '.join(POLICIES)}")
