"""Host work counted in aten ops: what one decode step dispatches through the engine.

On a GPU every op the host dispatches costs it microseconds (a kernel launch, or at least
the dispatcher for a view), so a token of Qwen3-30B-A3B (48 layers × 8 experts) that
dispatches thousands of them spends more time on the host than on the GPU. Counting ops
on the CPU with a `TorchDispatchMode` gives the same count as on CUDA (the engine's code
path is the same) and, unlike a time, does not depend on how busy the machine is.

`count_decode_ops` runs one decode step and attributes each op to where it was
dispatched from:
- `segment`: inside the store's `segment_forward` (one whole expert), `segments_forward` or
  `stacked_forward` (several of them, counted one by one);
- `split`: the same for a split expert's top (`partial`) and bottom (`acc`), counted once;
- `layer`: the rest of the engine's experts forward (routing to the host, the gather,
  slots, polls, the weighted sum);
- `predictor`: inside it, the predictor's scores on the device, its ranking and the prefetches it
  queues (a plan that prefetches);
- `attention`: inside a decoder layer's attention (with `model`: models/attention.py's decode forward, or
  transformers' own);
- `other`: the rest: attention without `model`, norms, the LM head, sampling.
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


def _split(args, kwargs) -> bool:
    """A call that computes a split expert's top (partial) or continues it with the bottom (acc)."""
    return bool(kwargs.get("partial")) or kwargs.get("acc") is not None


@contextlib.contextmanager
def _attributed(counter: OpCounter, owner, name: str, place, calls: list, count=lambda args, kwargs: 1):
    """While it runs, ops dispatched from `owner.name` count under `place(args, kwargs)`; `calls` gets
    `count(args, kwargs)` entries of that place per call (the segments or split experts it computes), none for
    a call made inside that place already (a grouped call's own segment_forwards)."""
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        where = place(args, kwargs)
        if counter.place == where:
            return real(*args, **kwargs)
        previous, counter.place = counter.place, where
        calls.extend([where] * count(args, kwargs))
        try:
            return real(*args, **kwargs)
        finally:
            counter.place = previous

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, real)


@contextlib.contextmanager
def _instance_attributed(counter: OpCounter, module, calls: list):
    """`_attributed` for one module's forward (place `attention`), the instance's own forward put back after."""
    had = "forward" in module.__dict__
    with _attributed(counter, module, "forward", lambda a, kw: "attention", calls):
        yield
    if not had:
        del module.forward


def count_decode_ops(step, model=None) -> dict:
    """Run `step()` (one decode step through an installed Engine) under an OpCounter. Returns ops per whole
    segment forward, per split expert (its top's and its bottom's, counted once per bottom), per MoE layer
    besides its segments, the totals and the op names by place."""
    counter, calls = OpCounter(), []
    stores = [HostStore, *HostStore.__subclasses__()]  # their segment_forward (QuantStore's own)
    with contextlib.ExitStack() as stack:
        for cls in stores:
            if "segment_forward" in cls.__dict__:  # a split expert counts once, at its bottom (acc)
                stack.enter_context(_attributed(
                    counter, cls, "segment_forward", lambda a, kw: "split" if _split(a, kw) else "segment", calls,
                    count=lambda a, kw: 0 if kw.get("partial") else 1))
            for name in ("segments_forward", "stacked_forward"):  # (self, xs or x, segments, act): one per entry
                if name in cls.__dict__:
                    stack.enter_context(_attributed(
                        counter, cls, name, lambda a, kw: "split" if _split(a, kw) else "segment", calls,
                        count=lambda a, kw: 0 if kw.get("partial") else len(a[2])))
        stack.enter_context(_attributed(counter, Engine, "experts_forward", lambda a, kw: "layer", calls))
        for name in ("_device_part", "_prefetch"):  # the predictor's scores, ranking and prefetches
            stack.enter_context(_attributed(counter, Engine, name, lambda a, kw: "predictor", calls,
                                            count=lambda a, kw: 0))
        for attn in [] if model is None else [layer.self_attn for layer in model.model.layers]:
            stack.enter_context(_instance_attributed(counter, attn, calls))
        with counter:
            step()
    segments, splits, layers = calls.count("segment"), calls.count("split"), calls.count("layer")
    return {
        "segments": segments,
        "split_experts": splits,
        "layers": layers,
        "ops_per_segment": counter.total("segment") / max(segments, 1),
        "ops_per_split_expert": counter.total("split") / max(splits, 1),
        "ops_per_layer_besides_segments": counter.total("layer") / max(layers, 1),
        "predictor_ops_per_layer": counter.total("predictor") / max(layers, 1),
        "attention_calls": calls.count("attention"),
        "ops_per_attention": counter.total("attention") / max(calls.count("attention"), 1),
        "ops_outside_experts": counter.total("other"),
        "by_op": {f"{place}:{name}": n for (place, name), n in counter.ops.most_common()},
    }
