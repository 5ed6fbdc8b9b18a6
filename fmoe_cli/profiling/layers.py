"""Per-layer model timings (docs/architecture.md § Profiles and timings): T_att, T_moe (T_exp = T_moe / K), T_head.

`time_layers` takes an already-loaded transformers model (the engine's, or a fully
resident one) and:

1. runs a prefill of the given prompt and a few decode steps with forward hooks that
   time every decoder layer, its MLP/MoE block and the head (final norm + LM head),
   and keep each MoE block's input;
2. re-runs each MoE block alone on its kept input, one layer at a time inside
   `resident(i)` — the caller's context that makes layer i's experts resident (and
   releases them afterwards) — so T_moe never includes expert loading and the model
   never needs to fit on the device as a whole;
3. given `loads` (the engine's running count of loaded segments and exposed seconds),
   runs each MoE block's decode input once more outside `resident(i)`, its experts
   loaded through the engine, for the host's work per loaded segment:
       h_load = (T_block,loaded − exposed − T_moe) / loaded segments        (Timings.t_host_load)
   the median over runs and layers. It is what a load costs the host beyond its link
   time (staging slot, copy submit, acquire, release), which the configurator charges
   every segment that is not a whole cached expert.

T_att of a layer is the layer's time in the pass minus its MLP's time in the pass
(attention, norms, residuals).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch
from torch import nn

from fmoe_cli.errors import FmoeError
from fmoe_cli.generate import cache_kwarg
from fmoe_cli.offload.link import host_now
from fmoe_cli.profiling.files import LayerTiming, ModelIdentity, ModelTimings, PhaseTimings


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, nn.ModuleList) and len(module) and hasattr(module[0], "mlp"):
            return module
    raise FmoeError(f"cannot find the decoder layers of {type(model).__name__}")


def moe_part(layer: nn.Module) -> tuple[nn.Module, bool] | None:
    """What computes a decoder layer's MoE, timed as T_moe: the routed experts' parent module, called on the hidden
    states alone (Mixtral's `mlp`, Granite's `block_sparse_moe`, Jamba's `feed_forward`: router, experts, and the shared
    experts where the block holds them; granitemoehybrid's `shared_mlp` hangs on the layer, in T_att), or, where the experts hang on the layer itself (Gemma 4: the router and the experts are steps of the
    layer's forward), the experts module, called with its routing (whole=True: every argument kept; its router then
    counts in T_att). None: a dense
    layer. The routed experts as models/families.py finds them."""
    for name, module in layer.named_modules():
        if name.rsplit(".", 1)[-1] == "experts" and hasattr(module, "down_proj"):
            parent = layer.get_submodule(name.rsplit(".", 1)[0]) if "." in name else layer
            return (module, True) if parent is layer else (parent, False)
    return None


def _sync_for(model: nn.Module) -> Callable[[], None]:
    device = next(model.parameters()).device
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


@contextlib.contextmanager
def _nothing(_: int) -> Iterator[None]:
    yield


@contextlib.contextmanager
def _as_planned(_: int) -> Iterator[bool]:
    yield True


class _PassTimer:
    """Forward hooks: wall time of every layer, its MLP, and the head, per pass."""

    def __init__(self, model: nn.Module, layers: nn.ModuleList, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.layer_times: dict[int, list[float]] = defaultdict(list)
        self.mlp_times: dict[int, list[float]] = defaultdict(list)
        self.head_times: list[float] = []
        self.moe_inputs: dict[int, tuple[tuple, dict]] = {}  # a MoE part's arguments in the pass (`moe_part`)
        self._start: dict[object, float] = {}
        self._handles = []
        for i, layer in enumerate(layers):
            self._time(layer, ("layer", i), self.layer_times[i])
            part = moe_part(layer)
            mlp = part[0] if part is not None else getattr(layer, "mlp", None)  # a dense layer without: all in t_att
            if mlp is not None:
                self._time(mlp, ("mlp", i), self.mlp_times[i], keep_input=i if part is not None else None,
                           whole=part is not None and part[1])
        inner = getattr(model, "model", None)
        norm = getattr(inner, "norm", None)
        head = model.get_output_embeddings()
        if head is None:
            raise FmoeError(f"cannot find the LM head of {type(model).__name__}")
        start_module = norm if isinstance(norm, nn.Module) else head
        self._handles.append(start_module.register_forward_pre_hook(lambda m, a: self._begin("head")))
        self._handles.append(head.register_forward_hook(lambda m, a, o: self.head_times.append(self._end("head"))))

    def _begin(self, key: object) -> None:
        self.sync()
        self._start[key] = host_now()

    def _end(self, key: object) -> float:
        self.sync()
        return host_now() - self._start.pop(key)

    def _time(self, module: nn.Module, key: object, sink: list[float], keep_input: int | None = None,
              whole: bool = False) -> None:
        def before(_module, args, kwargs):
            if keep_input is not None and whole:
                self.moe_inputs[keep_input] = (tuple(_kept(a) for a in args), {k: _kept(v) for k, v in kwargs.items()})
            elif keep_input is not None:
                hidden = args[0] if args else kwargs.get("hidden_states")
                self.moe_inputs[keep_input] = ((hidden.detach().clone(),), {})
            self._begin(key)

        self._handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        self._handles.append(module.register_forward_hook(lambda m, a, o: sink.append(self._end(key))))

    def reset(self) -> None:
        for times in (*self.layer_times.values(), *self.mlp_times.values(), self.head_times):
            times.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _kept(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _median(times: list[float]) -> float:
    return statistics.median(times) if times else 0.0


def time_layers(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    model_identity: ModelIdentity,
    top_k: int,
    decode_steps: int = 3,
    repeats: int = 3,
    resident: Callable[[int], AbstractContextManager] = _nothing,
    advance: Callable[[], None] = lambda: None,
    loads: Callable[[], tuple[int, float]] | None = None,
    loaded: Callable[[int], AbstractContextManager[bool]] = _as_planned,
) -> ModelTimings:
    """Time one prefill of `input_ids` ([1, T]) and `decode_steps` decode steps, layer by layer
    (and h_load, given `loads`: the engine's cumulative loaded segments and exposed seconds, on the
    layers i where `loaded(i)` — a context that serves layer i through the link — yields True).

    `advance` is called once per timed MoE layer and phase (for a progress bar).
    """
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise FmoeError("time_layers needs input_ids of shape [1, T]")
    layers = decoder_layers(model)
    sync = _sync_for(model)
    device = next(model.parameters()).device
    with torch.no_grad():  # warm-up: first calls allocate and initialise lazily; keep that out of the times
        model(input_ids=input_ids.to(device), use_cache=True, logits_to_keep=1)
    timer = _PassTimer(model, layers, sync)
    kept: dict[str, dict[int, torch.Tensor]] = {}
    passes: dict[str, tuple[dict[int, float], dict[int, float], float]] = {}
    try:
        with torch.no_grad():
            out = model(input_ids=input_ids.to(device), use_cache=True, logits_to_keep=1)
            passes["prefill"] = _collect(timer)
            kept["prefill"] = dict(timer.moe_inputs)
            timer.reset()
            for _ in range(max(1, decode_steps)):
                next_token = out.logits[:, -1:].argmax(-1)
                out = model(input_ids=next_token, **{cache_kwarg(model): out.past_key_values}, use_cache=True,
                            logits_to_keep=1)
            passes["decode"] = _collect(timer)
            kept["decode"] = dict(timer.moe_inputs)
    finally:
        timer.remove()

    phases = {}
    host: list[float] = []  # h_load per MoE layer (decode)
    for phase, tokens in (("prefill", int(input_ids.shape[1])), ("decode", 1)):
        layer_time, mlp_time, head = passes[phase]
        timings = []
        for i, layer in enumerate(layers):
            part = moe_part(layer)
            moe = part is not None
            t_att = max(0.0, layer_time[i] - mlp_time.get(i, 0.0))
            t_mlp = mlp_time.get(i, 0.0)
            if moe:  # again, alone, with its experts resident
                args, kwargs = kept[phase][i]
                block = functools.partial(part[0], *args, **kwargs)
                with resident(i), torch.no_grad():
                    block()  # warm-up
                    runs = []
                    for _ in range(repeats):
                        sync()
                        t0 = host_now()
                        block()
                        sync()
                        runs.append(host_now() - t0)
                    t_mlp = statistics.median(runs)
                if loads is not None and phase == "decode":
                    with torch.no_grad(), loaded(i) as through_link:
                        if through_link:
                            host += _host_per_load(block, t_mlp, loads, repeats, sync)
                advance()
            timings.append(LayerTiming(i, moe, t_att, t_mlp))
        phases[phase] = PhaseTimings(tokens, tuple(timings), head)
    t_host_load = max(0.0, statistics.median(host)) if host else None
    return ModelTimings(model_identity, top_k, phases["decode"], phases["prefill"], t_host_load)


def _host_per_load(block: Callable[[], object], t_resident: float, loads: Callable[[], tuple[int, float]],
                   repeats: int, sync: Callable[[], None], now: Callable[[], float] | None = None) -> list[float]:
    """Per run of `block` (a MoE part on its kept input) with its experts loaded on demand:
    (time − exposed − T_moe) / loaded segments."""
    block()  # warm-up
    out = []
    for _ in range(repeats):
        sync()
        segments, exposed = loads()
        t0 = (now or host_now)()
        block()
        sync()
        elapsed = (now or host_now)() - t0
        after, exposed_after = loads()
        if after > segments:
            out.append((elapsed - (exposed_after - exposed) - t_resident) / (after - segments))
    return out


def _collect(timer: _PassTimer) -> tuple[dict[int, float], dict[int, float], float]:
    layer_time = {i: _median(t) for i, t in timer.layer_times.items()}
    mlp_time = {i: _median(t) for i, t in timer.mlp_times.items()}
    return layer_time, mlp_time, _median(timer.head_times)
