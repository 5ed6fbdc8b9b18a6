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

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

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
    """A call that computes a split expert's top (partial) or continues it with the bottom (acc; accs: several)."""
    return bool(kwargs.get("partial")) or kwargs.get("acc") is not None or kwargs.get("accs") is not None


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


# --- host waits ----------------------------------------------------------------------------------------------------
# What makes the host wait for a GPU: reading a value computed there (the Tensor methods below on a device tensor).
HOST_READS = (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
              torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__)


class HostWaitCounter(TorchFunctionMode):
    """Counts the points where a GPU's host would wait for the device, on the CPU (issue 37 §2): every tensor that
    would live on the device — the model's parameters and buffers, the engine's cached tops, the step's input, and
    whatever an op computes from one of them — is marked, and a read of a marked tensor on the host (HOST_READS) is
    a wait. The engine's sanctioned reads are counted as what they are: `link.read_to_host` one wait (its result is
    on the host), `link.HostCopy.copy` none (a copy the host does not wait for; its buffer is on the host).
    `place` is set while the engine's experts forward runs (`moe`) or its deferred bookkeeping (`settle`)."""

    def __init__(self, device_tensors, host_tensors=()) -> None:
        super().__init__()
        self.marked = WeakIdKeyDictionary()
        for t in device_tensors:
            self.marked[t] = True
        self.host = WeakIdKeyDictionary({t: True for t in host_tensors})  # on the host whatever writes them
        self.waits: collections.Counter = collections.Counter()  # place -> waits
        self.where: collections.Counter = collections.Counter()  # (place, what) -> waits
        self.place = "other"
        self.sanctioned = 0  # inside read_to_host / HostCopy.copy: nothing is marked, nothing counted

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.sanctioned:
            return func(*args, **kwargs)
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        from_device = any(t in self.marked for t in inputs)
        if from_device and func in HOST_READS:
            self.note(func.__name__)
        out = func(*args, **kwargs)
        if from_device:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t not in self.host:
                    self.marked[t] = True
        return out

    def note(self, what: str) -> None:
        self.waits[self.place] += 1
        self.where[(self.place, what)] += 1

    @contextlib.contextmanager
    def reading(self, what: str | None):
        """A sanctioned read: one wait (`what`) or none; its result is not marked."""
        if what is not None:
            self.note(what)
        self.sanctioned += 1
        try:
            yield
        finally:
            self.sanctioned -= 1


def count_host_waits(step, engine: Engine, model, inputs=()) -> dict:
    """Run `step()` (decode steps through `engine`, installed in `model`, on the device's path:
    `engine.device_side`) under a HostWaitCounter: the host's waits for the device, by place (`moe`: inside the
    experts forward; `settle`: the deferred bookkeeping; `other`: attention, norms, head, sampling, the loop)."""
    from fmoe_cli.offload import engine as engine_module
    from fmoe_cli.offload import link

    device_tensors = [*model.parameters(), *model.buffers(), *inputs, *(s.tops for s in engine.layers)]
    # the routing's host copies (link.HostCopy): a replayed CUDA graph writes them by its own copy node, not `copy`
    host_copies = [copy.host for pair in engine._route_copies.values() for copy in pair]
    counter = HostWaitCounter(device_tensors, host_copies)
    calls = collections.Counter()
    real_read, real_copy = link.read_to_host, link.HostCopy.copy

    def read_to_host(t):
        with counter.reading("read_to_host"):
            host = real_read(t)
        counter.marked.pop(host, None)  # on the host now (on the CPU, `t` itself)
        return host

    def host_copy(self, t):
        with counter.reading(None):
            return real_copy(self, t)

    def placed(name, place):
        real = getattr(Engine, name)

        def wrapper(*args, **kwargs):
            previous, counter.place = counter.place, place
            calls[place] += 1
            try:
                return real(*args, **kwargs)
            finally:
                counter.place = previous
        return real, wrapper

    patches = [(engine_module, "read_to_host", read_to_host), (link.HostCopy, "copy", host_copy)]
    for name, place in (("experts_forward", "moe"), ("settle", "settle")):
        patches.append((Engine, name, placed(name, place)[1]))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        with counter:
            step()
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
    return {"moe_layers": calls["moe"], "waits": dict(counter.waits),
            "where": {f"{place}:{what}": n for (place, what), n in counter.where.most_common()}}
