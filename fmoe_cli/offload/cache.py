"""Which experts of one layer have their top segment cached on the device.

`LayerCache` is the bookkeeping only (expert -> slot, pins, the policy); the engine
owns the slot tensors. It is pure Python so that `fmoe replay`, the statistics and
the property tests exercise exactly the engine's logic.

Invariants (checked by the property tests):
- at most `capacity` experts are cached, each in its own slot;
- a pinned expert (in use or in flight) is never evicted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fmoe_cli.offload.policies import EvictionPolicy
from fmoe_cli.types import LayerPlan


@dataclass(frozen=True)
class Admission:
    slot: int
    evicted: int | None  # the expert that lost the slot, if any


class LayerCache:
    def __init__(self, capacity: int, policy: EvictionPolicy) -> None:
        if capacity < 0:
            raise ValueError("cache capacity must be >= 0")
        self.capacity = min(capacity, policy.num_experts)
        self.policy = policy
        self.step = 0  # tokens seen by this layer
        self._slot_of: dict[int, int] = {}
        # slot(expert): the slot, or None. The dict's own `get`, bound once: no Python frame, and the engine and the
        # prefetcher ask several times a layer (the dict is never replaced, only changed in place)
        self.slot = self._slot_of.get
        self._free = list(range(self.capacity - 1, -1, -1))  # pop() gives slot 0 first
        self._pins: dict[int, int] = {}  # expert -> pin count (> 0 only)

    # --- queries -----------------------------------------------------------
    def __contains__(self, expert: int) -> bool:
        return expert in self._slot_of

    def cached(self) -> dict[int, int]:
        return dict(self._slot_of)

    def is_pinned(self, expert: int) -> bool:
        return expert in self._pins

    # --- updates -----------------------------------------------------------
    def pin(self, expert: int) -> None:
        self._pins[expert] = self._pins.get(expert, 0) + 1

    def unpin(self, expert: int) -> None:
        n = self._pins.get(expert, 0)
        if n <= 0:
            raise RuntimeError(f"expert {expert} unpinned more often than pinned")
        if n == 1:
            del self._pins[expert]
        else:
            self._pins[expert] = n - 1

    def record(self, tokens: Sequence[Iterable[int]]) -> None:
        """Record one forward's activations token by token: token t of T at step + t
        (ν counts tokens, prompt tokens too), so a prefill's last tokens leave their
        experts young. The clock then stands at the forward's last token, where the
        forward's admissions are decided; `advance` moves past it."""
        if not tokens:
            return
        for t, experts in enumerate(tokens):
            for e in experts:
                self.policy.touch(e, self.step + t)
        self.step += len(tokens) - 1

    def advance(self) -> None:
        """Move the layer's clock past the current forward (its last token)."""
        self.step += 1

    def admit(self, expert: int) -> Admission | None:
        """Offer a loaded expert to the cache: a free slot, else the slot of the policy's
        victim among the unpinned cached experts. None: it stays out (no capacity, or
        every cached expert is pinned)."""
        if expert in self._slot_of or self.capacity == 0:
            return None
        if self._free:
            slot = self._free.pop()
            self._slot_of[expert] = slot
            return Admission(slot, None)
        candidates = [e for e in self._slot_of if not self.is_pinned(e)]
        if not candidates:
            return None
        victim = self.policy.choose_victim(candidates, self.step)
        slot = self._slot_of.pop(victim)
        self._slot_of[expert] = slot
        return Admission(slot, victim)

    def insert(self, expert: int) -> int:
        """Place an expert in a free slot (used to warm or rebuild the cache)."""
        if expert in self._slot_of:
            return self._slot_of[expert]
        if not self._free:
            raise RuntimeError("no free slot")
        slot = self._free.pop()
        self._slot_of[expert] = slot
        return slot

    def clear(self) -> None:
        if self._pins:
            raise RuntimeError("cannot clear a cache with pinned experts")
        self._slot_of.clear()
        self._free = list(range(self.capacity - 1, -1, -1))


def replay_token(cache: LayerCache, experts: Sequence[int]) -> int:
    """One token of one layer, as the engine does it: hits are counted before the
    policy sees the token, then misses are offered to the cache in the order given
    (the token's experts pinned meanwhile, so none of them is evicted).
    Returns the number of hits."""
    misses = [e for e in experts if e not in cache]
    cache.record([experts])
    if misses:  # pins only matter to admissions
        for e in experts:
            cache.pin(e)
        for e in misses:
            if e not in cache:
                cache.admit(e)
        for e in experts:
            cache.unpin(e)
    cache.advance()
    return len(experts) - len(misses)


def rebuild_order(ranking: Sequence[int], layer: LayerPlan) -> list[int]:
    """Which experts a rebuilt cache holds: the top C_i by priority (ranking: highest first), split at θ_i."""
    return list(ranking[: layer.cache_size])
