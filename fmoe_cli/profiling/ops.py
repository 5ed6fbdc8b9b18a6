"""Host work counted in aten ops: what one decode step dispatches through the engine.

On a GPU every op the host dispatches costs it microseconds (a kernel launch, or at least
the dispatcher for a view), so a token of Qwen3-30B-A3B (48 layers × 8 experts) that
dispatches thousands of them spends more time on the host than on the GPU. Counting ops
on the CPU with a `TorchDispatchMode` gives the same count as on CUDA (the engine's code
path is the same) and, unlike a time, does not depend on how busy the machine is.

`count_decode_ops` runs one decode step and attributes each op to where it was
dispatched from:
- `segment`: inside the store's `segment_forward` (one whole expert, or one of a split
  expert's two segments) or `segments_forward` (several of them, counted one by one);
- `layer`: the rest of the engine's experts forward (routing to the host, the gather,
  slots, polls, the weighted sum);
- `other`: attention, norms, the LM head, sampling.
"""

from __future__ import annotations

import collections
import contextlib

from torch.utils._python_dispatch import TorchDispatchMode

from fmoe_cli.offload.engine import Engine
from fmoe_cli.offload.store import HostStore


class OpCounter(TorchDispatchMode):
    """Counts dispatched aten ops by (place, op name); `place` is set by `attributed`."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.place = "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[(self.place, func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    def total(self, place: str) -> int:
        return sum(n for (where, _), n in self.ops.items() if where == place)


@contextlib.contextmanager
def _attributed(counter: OpCounter, owner, name: str, place: str, calls: list, count=lambda args: 1):
    """While it runs, ops dispatched from `owner.name` count under `place`; `calls` gets `count(args)` entries
    per call (the segments it computes), none for a call made inside `place` already (a grouped call's own
    segment_forwards)."""
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if counter.place == place:
            return real(*args, **kwargs)
        previous, counter.place = counter.place, place
        calls.extend([place] * count(args))
        try:
            return real(*args, **kwargs)
        finally:
            counter.place = previous

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, real)


def count_decode_ops(step) -> dict:
    """Run `step()` (one decode step through an installed Engine) under an OpCounter. Returns ops per
    segment_forward, per MoE layer besides its segments, the totals and the op names by place."""
    counter, calls = OpCounter(), []
    stores = [HostStore, *HostStore.__subclasses__()]  # their segment_forward (QuantStore's own)
    with contextlib.ExitStack() as stack:
        for cls in stores:
            if "segment_forward" in cls.__dict__:
                stack.enter_context(_attributed(counter, cls, "segment_forward", "segment", calls))
            if "segments_forward" in cls.__dict__:  # (self, xs, segments, act): one segment per entry
                stack.enter_context(_attributed(counter, cls, "segments_forward", "segment", calls,
                                                count=lambda args: len(args[2])))
        stack.enter_context(_attributed(counter, Engine, "experts_forward", "layer", calls))
        with counter:
            step()
    segments, layers = calls.count("segment"), calls.count("layer")
    return {
        "segments": segments,
        "layers": layers,
        "ops_per_segment": counter.total("segment") / max(segments, 1),
        "ops_per_layer_besides_segments": counter.total("layer") / max(layers, 1),
        "ops_outside_experts": counter.total("other"),
        "by_op": {f"{place}:{name}": n for (place, name), n in counter.ops.most_common()},
    }
