"""The one generation loop: bench, chat and everything else consume `stream_generate`.

It yields one `TokenEvent` per generated token with its latency (TTFT for the
first: prefill + first token) and the engine's counters for that token.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from fmoe_cli.errors import FmoeError, warn
from fmoe_cli.offload.engine import Counters, Engine
from fmoe_cli.offload.layout import called
from fmoe_cli.offload.link import host_now
from fmoe_cli.prediction.base import as_float32
from fmoe_cli.types import static_cache_capacity

def next_logits(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """One forward of `ids` [1, T] on the KV cache → the last position's logits [V].

    `logits_to_keep=1`: a prefill computes the LM head for its last token only, never the
    [1, T, V] logits (Qwen3's V = 151,936 at 1.8k tokens would fill the workspace). The model's forward is called
    without nn.Module's per-call steps where no hook would run (offload/layout.py `called`: a few µs a token)."""
    return called(model)(input_ids=ids, **{cache_kwarg(model): cache}, use_cache=True, logits_to_keep=1).logits[0, -1]


MIN_CAPACITY = 256  # positions a GrowingLayer's buffers hold at least


class GrowingLayer(DynamicLayer):
    """transformers' DynamicLayer (one attention layer's keys and values, [B, H, L, D] each), written in place into
    buffers [B, H, capacity, D] grown geometrically, instead of a torch.cat of the whole cache every step (O(L)
    bytes a token, and on torch's OpenMP team once L·H·D passes its grain). `keys` and `values` are views of the
    buffers' first L positions: the same values DynamicLayer's cat gives, with the buffers' strides (SDPA gives
    them the same bits: tests/test_generate_cache.py). Whatever else assigns `keys` or `values` (DynamicLayer's
    batch and reorder methods, offloading) is adopted into new buffers at the next update."""

    _buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # [B, H, capacity, D] keys and values
    _views: tuple = (None, None)  # the keys and values views last handed out

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._buffers = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        keys, values, start = self._reserve(new, key_states, value_states)
        keys.narrow(-2, start, new).copy_(key_states)
        values.narrow(-2, start, new).copy_(value_states)
        self._set_length(start + new)
        return self.keys, self.values

    def reserve(self, new: int, like: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """For a writer that fills the next `new` positions itself (models/attention.py's decode step and prefill in
        C): the buffers [B, H, capacity, D], grown to hold them, and the first of them; then `commit(first + new)`.
        Before the first update (an empty cache) the buffers take their batch, heads, head dim, dtype and device from
        `like` ([B, H, L, D] keys or values: a prefill's), and without it: None (the prefill's `update` sets them)."""
        if not self.is_initialized or self.keys is None or not self.keys.numel():
            if like is None:
                return None
            if not self.is_initialized:
                self.lazy_initialization(like, like)
            return self._reserve(new, like, like)
        return self._reserve(new, self.keys, self.values)

    def commit(self, length: int) -> None:
        """The first `length` positions of the buffers are the cache (after `reserve`)."""
        self._set_length(length)

    def _reserve(self, new: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """The buffers, grown to hold `new` positions after the cache's (shapes and dtype of key_states and
        value_states), and where those begin."""
        if self.keys is not self._views[0] or self.values is not self._views[1]:
            self._adopt()  # first update, or keys/values assigned from outside
        start = self.keys.shape[-2] if self.keys.numel() else 0
        end = start + new
        if self._buffers is None or end > self._buffers[0].shape[-2]:
            self._grow(end, key_states, value_states, start)
        keys, values = self._buffers
        return keys, values, start

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)  # its checks; keys and values become shorter views of the buffers
        if self._buffers is not None:
            self._views = (self.keys, self.values)

    def _set_length(self, length: int) -> None:
        keys, values = self._buffers
        self.keys, self.values = keys.narrow(-2, 0, length), values.narrow(-2, 0, length)
        self._views = (self.keys, self.values)

    def _adopt(self) -> None:
        """Buffers from `keys` and `values` as they are (none while they are empty)."""
        self._buffers = None
        if self.keys is not None and self.keys.numel():
            self._grow(self.keys.shape[-2], self.keys, self.values, self.keys.shape[-2], old=(self.keys, self.values))

    def _grow(self, needed: int, key_states, value_states, length: int, old=None) -> None:
        """Buffers of max(1.5 · needed, MIN_CAPACITY) positions, the first `length` copied from the old ones."""
        capacity = max(needed + needed // 2, MIN_CAPACITY)
        old = old if old is not None else self._buffers
        grown = []
        for states, previous in zip((key_states, value_states), old or (None, None)):
            buffer = states.new_empty(*states.shape[:-2], capacity, states.shape[-1])
            if length:
                buffer.narrow(-2, 0, length).copy_(previous.narrow(-2, 0, length))
            grown.append(buffer)
        self._buffers = tuple(grown)
        self._set_length(length)


def new_cache(model) -> DynamicCache:
    """The KV cache a generation starts from: transformers' DynamicCache for the model's config; on the CPU its
    full-attention layers are GrowingLayers (written in place; DynamicLayer's values, fewer bytes moved)."""
    cache = DynamicCache(config=model.config)
    if next(model.parameters()).device.type == "cpu":
        cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
        if cache.layer_class_to_replicate is DynamicLayer:  # a config without layer types: layers made on first use
            cache.layer_class_to_replicate = GrowingLayer
    return cache


def cache_kwarg(model) -> str:
    """transformers ≥ 5.24 names the KV cache argument `cache` (`past_key_values` is deprecated)."""
    return _cache_kwarg(type(model))


@functools.cache
def _cache_kwarg(model_class) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


class DecodeGraph:
    """A decode step replayed from CUDA graphs (issue 37 §1): attention, norms, routers, the experts the device holds
    without a host wait, and the LM head, launched from graphs where the eager step launches several hundred ops
    from Python one by one.

    A graph holds no host wait: where a layer's experts need the host (the routing read of a policy that loads
    experts: its hits, loads and bookkeeping are decided there), the step is cut. The step is then a sequence of
    segments, captured one after another into one memory pool (`CudaGraphs`): segment 0 from the embedding to the
    router of the first such layer, each next one from that layer's experts' output to the next such router, the last
    to the logits. At each cut (`GraphBreak`) a replay runs the engine's experts forward eagerly on the static tensors
    the segment before wrote (its routing read, its loads, its compute) and copies its result into the static output
    the segment after reads. A layer that decodes on the device without a host wait (a resident layer on the
    device's path, `Engine.graphed_layer`) stays inside its segment; a resident plan's step is one segment. A replay
    runs no Python besides the cuts: the engine is told which layers' routing each segment copied to the host
    (`Engine.defer_replayed`), and their bookkeeping follows; the embedding's hook (a pass's predictions) runs after
    segment 0 (`Engine.replayed_pass`).

    Possible because the KV cache is transformers' StaticCache (a fixed [B, H, capacity, D] per layer, the next
    position a device tensor), so the same launches serve every token. A generation's prefill runs eagerly into that
    cache; the segments are captured on the first decode step (after two warm-up steps, as torch asks, in which the
    cuts compute nothing) and replayed for the others and for later generations of the same capacity.

    Where capture fails, the step runs eagerly on the same StaticCache and one line says why; FMOE_CUDA_GRAPHS=0 and
    `Engine.graph_veto` keep it eager. The graphs are torch.cuda.CUDAGraph on a GPU (`CudaGraphs`); the tests give a
    stand-in that records the captured ops and replays them, no kinder than CUDA (tests/fake_graphs.py). The tokens
    are transformers' with its StaticCache: attention over a static cache's masked positions sums in another order
    than over a dynamic one, so the logits may differ in the last bits from the eager path's (the GPU check compares
    the tokens with transformers' generate).

    A conversation continues on it (chat, serve): the cache keeps its positions between answers, `crop` takes it
    back to the prefix the next prompt shares (as a DynamicCache's, the StaticCache's own crop: the next writes
    overwrite the rest, which the causal mask hides until then) and `extend` pre-fills the new tokens after it. The
    graphs are the plan's (the engine's buffers), the cache the conversation's: a new plan (`Engine.configure`)
    `release`s the graphs and keeps the cache."""

    def __init__(self, model, engine: Engine, capacity: int, graph_factory, capture: bool = True) -> None:
        from transformers import StaticCache

        self.model, self.engine, self.capacity = model, engine, capacity
        device = next(model.parameters()).device
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)
        self.ids = torch.zeros(1, 1, dtype=torch.long, device=device)  # the step's token, written before each replay
        self.position = torch.zeros(1, 1, dtype=torch.long, device=device)  # … and its position
        self.length = 0  # positions in the cache
        self.graph_factory = graph_factory
        self.graph = None  # the captured segments (the factory's: CudaGraphs on a GPU)
        self.captured: StepCapture | None = None  # … their cuts, and the layers graphed in each
        self.logits: torch.Tensor | None = None  # [V]: the last segment's output, overwritten by each replay
        # the steps run eagerly (FMOE_CUDA_GRAPHS=0, a veto, a failed capture); None: not decided yet
        self.eager: bool | None = None if capture else True
        self.said_why = False  # the line on a cache whose positions a replay cannot advance (`_position_on_host`)

    @property
    def segments(self) -> int:
        """Graph segments a replayed step runs (0: none captured)."""
        return len(self.captured.breaks) + 1 if self.graph is not None else 0

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, position_ids=positions, **{cache_kwarg(self.model): self.cache},
                          use_cache=True, logits_to_keep=1).logits[0, -1]

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """A new generation from ids [1, T]: the cache emptied, the prompt's keys and values written eagerly."""
        self.clear()
        return self.extend(ids)

    def clear(self) -> None:
        """No position in the cache."""
        self.cache.reset()
        self.length = 0

    def extend(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [1, T] pre-filled eagerly after the cache's positions (a conversation's next prompt) -> the last one's
        logits [V]."""
        tokens = ids.shape[1]
        self._check_room(tokens)
        start, self.length = self.length, self.length + tokens
        return self._forward(ids, torch.arange(start, start + tokens, device=ids.device).view(1, -1))

    def get_seq_length(self) -> int:
        """Positions in the cache (a DynamicCache's question, for the conversation that continues on it)."""
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the cache's last -tokens_to_remove positions (negative, as transformers' StaticLayer.crop takes it)."""
        if tokens_to_remove:
            self.cache.crop(tokens_to_remove)
            self.length += tokens_to_remove

    def release(self) -> None:
        """Forget the captured graphs (they read the engine's buffers, which a new plan frees); the cache stays.
        Whether the new plan's steps can be captured is asked again at the next step."""
        self.graph, self.captured, self.logits, self.eager = None, None, None, None

    def _check_room(self, tokens: int) -> None:
        if self.length + tokens > self.capacity:
            raise FmoeError(f"the static KV cache holds {self.capacity} positions; the generation went past them")

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """One decode token ids [1, 1] at the next position: the segments' replay (captured on first use)."""
        self._check_room(1)
        self.ids.copy_(ids)
        self.position.fill_(self.length)
        if self.eager is None:
            self.eager = not capturable(self.engine) or self._position_on_host()
        if self.graph is None and not self.eager:
            self._capture()
        self.length += 1
        if self.eager:
            return self._forward(self.ids, self.position)
        return self._replay()

    def _position_on_host(self) -> bool:
        """Whether a layer of the static cache is not a plain StaticLayer, whose position a replay advances: a
        sliding-window layer counts in a Python int (every replayed step would write and attend as the captured one
        did), an indexed layer an indexer's count that the capture does not restore (DeepSeek-V3.2, GLM-MoE-DSA),
        and any other kind is not known to replay; then the steps run eagerly, and one line says why (once a
        cache)."""
        from transformers.cache_utils import StaticLayer

        on_host = any(type(layer) is not StaticLayer for layer in self.cache.layers)
        if on_host and not self.said_why:
            kinds = sorted({type(layer).__name__ for layer in self.cache.layers if type(layer) is not StaticLayer})
            warn(f"CUDA graphs: this model's KV cache has layers that count their positions on the host or beside "
                 f"the keys ({', '.join(kinds)}), which a graph's replay does not advance; its decode steps run "
                 f"eagerly")
            self.said_why = True
        return on_host

    def _replay(self) -> torch.Tensor:
        """Segment 0; then at each cut the layer's experts forward on its static inputs, eagerly (its one routing
        read, its loads, its compute), its result into the static output, and the next segment; the logits."""
        graph, captured, engine = self.graph, self.captured, self.engine
        engine.settle()  # the last step's routing copies are read before the replay writes them again
        graph.replay(0)
        if captured.pass_output is not None:  # the embedding's hook: the pass's predictions (a prefetch of layer 0)
            engine.replayed_pass(captured.pass_output)
        engine.defer_replayed(captured.graphed[0])
        for segment, cut in enumerate(captured.breaks, start=1):
            cut.out.copy_(engine.experts_forward(cut.experts, cut.hidden_states, cut.top_k_index, cut.top_k_weights))
            graph.replay(segment)
            engine.defer_replayed(captured.graphed[segment])
        return self.logits

    def _capture(self) -> None:
        """Two warm-up steps, then the capture, at the current position, on the graphs' side stream: each writes this
        position's keys and values (the replay writes them again) and moves the cache's length, which is put back
        after. The engine's experts forward sees `Engine.capturing` meanwhile: it cuts the step where a layer needs
        the host (a warm-up's cut computes nothing: no token is decoded) and its embedding hook only notes the pass."""
        engine, cache = self.engine, self.cache
        lengths = [layer.cumulative_length.clone() for layer in cache.layers]
        graph = None
        try:
            graph = self.graph_factory(self)
            captured = engine.capturing = StepCapture(graph)
            with graph.capturing():
                for _ in range(2):
                    engine.discard_deferred()
                    self._forward(self.ids, self.position)
                    for layer, length in zip(cache.layers, lengths):
                        layer.cumulative_length.copy_(length)
                engine.discard_deferred()
                captured.recording = True
                graph.begin()
                logits = self._forward(self.ids, self.position)
                graph.end()
            self.graph, self.captured, self.logits = graph, captured, logits
        except Exception as exc:  # torch refuses what a capture cannot hold (a host read, a pageable copy)
            if graph is not None:
                graph.abort()
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            warn(f"CUDA graphs: the decode step could not be captured ({first[:160]}); it runs eagerly")
            self.eager = True
        finally:
            engine.capturing = None
            engine.discard_deferred()
            for layer, length in zip(cache.layers, lengths):
                layer.cumulative_length.copy_(length)


@dataclass
class GraphBreak:
    """Where a captured decode step leaves its graphs: an MoE layer whose experts need the host. The static tensors
    the segment before writes and the segment after reads."""

    layer: int
    experts: torch.nn.Module  # the layer's experts module (its act_fn, its engine's layer index)
    hidden_states: torch.Tensor  # [T, H] the experts' input
    top_k_index: torch.Tensor  # [T, K] the router's experts
    top_k_weights: torch.Tensor  # [T, K] … and their weights
    out: torch.Tensor  # [T, H] the experts' output, copied in at each replay


class StepCapture:
    """What the engine calls while a DecodeGraph captures a step (`Engine.capturing`): a layer computed inside the
    graph is noted (`graphed_layer`: its routing is copied to the host by the replay), a layer that needs the host
    cuts the step (`graph_break`), and the embedding's hook gives the pass's output (`pass_began`). In the warm-up
    steps before the capture (`recording` False) a cut returns zeros: the step's values are not used."""

    def __init__(self, graph) -> None:
        self.graph = graph
        self.recording = False
        self.breaks: list[GraphBreak] = []
        self.graphed: list[list[int]] = [[]]  # per segment, the MoE layers computed inside it
        self.pass_output: torch.Tensor | None = None  # the embedding's output [1, 1, H], written by segment 0

    def graphed_layer(self, i: int) -> None:
        if self.recording:
            self.graphed[-1].append(i)

    def graph_break(self, i: int, experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
        """Layer i's experts need the host: the segment ends with its router; the next one begins reading the static
        output returned (written by the replay's eager experts forward)."""
        if not self.recording:
            return torch.zeros_like(hidden_states)
        self.graph.end()
        out = torch.empty_like(hidden_states)
        self.breaks.append(GraphBreak(i, experts, hidden_states, top_k_index, top_k_weights, out))
        self.graphed.append([])
        self.graph.begin()
        return out

    def pass_began(self, output: torch.Tensor) -> None:
        if self.recording:
            self.pass_output = output


class CudaGraphs:
    """A decode step's segments as torch.cuda.CUDAGraphs (DecodeGraph's graphs on a GPU; made for the DecodeGraph it
    will replay, which a stand-in needs and this does not): captured one after another on one side stream into one
    memory pool, and replayed in the order captured, as torch's docs allow for graphs that share a pool (a tensor
    one segment frees may back one the next allocates). What torch.cuda.graph does around one capture, around them
    all: the warm-up and the captures on the side stream, the device synchronised and the cache emptied before the
    first. Capture errors are thread-local, as torch's own cudagraph trees take them: the link's pump thread may go
    on copying and polling its events meanwhile."""

    def __init__(self, decode: DecodeGraph) -> None:
        self.device = decode.engine.device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = capture_stream(self.device, getattr(decode.engine.link, "stream", None))
        self.graphs: list = []
        self.open = False  # a segment's capture is under way

    @contextlib.contextmanager
    def capturing(self):
        """The warm-up and the captures on the side stream. A capture that raises is ended there, on the stream it
        began on (torch's capture_end refuses any other, and a capture never ended leaves the thread unable to
        read the host: the eager fallback's first routing read would be refused); the current stream waits for the
        side stream's work whatever happened."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                try:
                    yield
                except BaseException:
                    self.abort()
                    raise
        finally:
            current.wait_stream(self.stream)

    def begin(self) -> None:
        if not self.graphs:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        self.graphs.append(graph)
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        self.open = True

    def end(self) -> None:
        self.open = False
        self.graphs[-1].capture_end()

    def abort(self) -> None:
        """A capture that failed: the side stream out of capture mode (its error is the one reported). capture_end
        runs on the stream the capture began on; where CUDA refuses to end an invalidated capture, torch skips ending
        the pool's allocation to the capture, which is ended here."""
        if self.open:
            self.open = False
            try:
                with torch.cuda.stream(self.stream):
                    self.graphs[-1].capture_end()
            except Exception:
                with contextlib.suppress(Exception):
                    torch._C._cuda_endAllocateToPool(self.device.index if self.device.index is not None
                                                     else torch.cuda.current_device(), self.pool)
        self.graphs = []

    def replay(self, segment: int) -> None:
        self.graphs[segment].replay()


_CAPTURE_STREAMS: dict = {}  # device -> the side stream every CudaGraphs on it captures on


def capture_stream(device: torch.device, avoid=None):
    """The side stream the decode steps on `device` are captured on: one a process, not one a capture, and never
    `avoid` (the link's copy stream). torch.cuda.Stream() does not create a stream: it hands out the next of 32
    pooled streams a priority, round robin, so a stream drawn per capture would be the link's own on the 32nd
    draw or so after it (a re-plan, a bench configuration, a new capacity), and the copies the link issues while a
    step is captured would be captured with it."""
    stream = _CAPTURE_STREAMS.get(device)
    for _ in range(64):
        if stream is not None and stream != avoid:
            break
        stream = torch.cuda.Stream(device)
    else:
        raise RuntimeError("no CUDA stream apart from the link's")
    _CAPTURE_STREAMS[device] = stream
    return stream


def decode_graph(model, engine: Engine | None, capacity: int) -> DecodeGraph | None:
    """The DecodeGraph a generation of `capacity` positions decodes through on a CUDA device (or where the engine has
    a `graph_factory`: tests), every plan alike, or None (the CPU: transformers' DynamicCache, `new_cache`). Its steps
    are replayed from CUDA graphs (`capturable`): one a step where the plan's every layer decodes on the device
    without a host wait (Engine.decode_graphable), else segments between the routing reads; where capture is refused
    they run eagerly on the same StaticCache. Every
    policy on a GPU thus attends over the same static cache, with the same kernels: a static cache's attention sums
    in another order than a dynamic one's, and on the first H200 run the graphed `resident` (static) left the other
    policies (dynamic) at token 30 of a bf16 a3b-shaped model. One per capacity (rounded up), kept by the engine until
    it is configured again (the graphs read its buffers)."""
    if engine is None:
        return None
    factory = engine.graph_factory or (CudaGraphs if engine.device.type == "cuda" else None)
    if factory is None:
        return None
    capacity = static_cache_capacity(capacity)  # (what the plan reserved: planning/plan.py kv_reserve)
    graph = engine.decode_graphs.get(capacity)
    if graph is None:
        graph = engine.decode_graphs[capacity] = DecodeGraph(model, engine, capacity, factory)
    return graph


def capturable(engine: Engine) -> bool:
    """Whether a DecodeGraph captures the steps of the engine's plan in graphs: a plan is built, no veto
    (`Engine.graph_veto`), FMOE_CUDA_GRAPHS is not 0. A plan whose every layer decodes on the device without a host
    wait (Engine.decode_graphable) is one graph a step; the others are segments between their routing reads."""
    return bool(engine.layers) and engine.graph_veto is None and os.environ.get("FMOE_CUDA_GRAPHS", "1").strip() != "0"


def conversation_cache(model, engine: Engine | None, capacity: int | None):
    """An empty KV cache for a conversation of up to `capacity` positions (chat, serve), continued answer after answer:
    on a GPU the engine's DecodeGraph of that capacity (the static cache every plan there decodes through, replayed
    from a CUDA graph where the plan allows), else — on the CPU, or with no capacity known — `new_cache`."""
    graph = decode_graph(model, engine, capacity) if capacity else None
    if graph is None:
        return new_cache(model)
    graph.clear()
    return graph


# What `fmoe bench` and `fmoe profile` generate from when no prompt is given.
DEFAULT_PROMPT = "Explain in a few sentences how a mixture-of-experts model decides which experts to use."


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")


def no_tokenizer(model_id: str) -> FmoeError:
    """A model loaded without any tokenizer file (models/load.py): name the files it lacks."""
    return FmoeError(f"{model_id} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} is in its directory "
                     f"(an incomplete download?); fmoe needs one to encode the prompt")


def encode_messages(tokenizer, messages: list[dict], model_id: str, *, plain: bool = False) -> list[int]:
    """Token ids of a conversation ({"role", "content"} dicts) ready for the assistant's answer:
    the model's chat template; without one, "role: text" lines and "assistant:" (chat), or
    with `plain` a lone message's text as it is (bench: a base model continues it). One-line errors."""
    if tokenizer is None:
        raise no_tokenizer(model_id)
    try:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        elif plain and len(messages) == 1:
            return encode_text(tokenizer, messages[0]["content"], model_id)
        else:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            ids = tokenizer(text + "assistant:")["input_ids"]
    except FmoeError:
        raise
    except Exception as exc:  # a template may refuse a conversation (say, a system role it lacks)
        first = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        raise FmoeError(f"the chat template of {model_id} refused the conversation: {first}") from None
    if not ids:
        raise FmoeError("the prompt encodes to no tokens")
    return list(ids)


def encode_text(tokenizer, text: str, model_id: str) -> list[int]:
    """Token ids of a text as it is (a completion's prompt: no chat template), with the special
    tokens the tokenizer adds (a BOS). One-line errors."""
    if tokenizer is None:
        raise no_tokenizer(model_id)
    ids = tokenizer(text)["input_ids"]
    if not ids:
        raise FmoeError("the prompt encodes to no tokens")
    return list(ids)


@dataclass
class TokenEvent:
    index: int  # 0 for the first generated token
    token_id: int
    text: str  # the new text this token completes (may be empty mid-character)
    latency_s: float  # TTFT for index 0, else the time of this decode step
    counters: Counters | None  # engine counters for this step (None without an engine)
    finish_reason: str | None  # "eos" or "length" on the last event, else None


TINY_TEMPERATURE = torch.finfo(torch.float32).tiny  # below it (0 included) float32 cannot divide by it: greedy,
# which is what sampling at such a temperature is (but among exactly tied logits)


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 1: off
    seed: int | None = None
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor: the logit of every token already in the sequence (`seen`,
    prompt and answer) divided by `penalty` where positive, multiplied where negative."""
    scores = logits.gather(0, seen)
    return logits.scatter(0, seen, torch.where(scores < 0, scores * penalty, scores / penalty))


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                seen: torch.Tensor | None = None) -> int:
    """Greedy at temperature 0; otherwise transformers' sampling steps in transformers' order (its logits
    processors): temperature, top-k (the k most likely, ties at the k-th kept), top-p (nucleus), min-p (tokens at
    least min_p × the most likely's probability), then a draw. A repetition penalty (`seen`: the sequence's tokens)
    comes first, greedy or not, as in transformers."""
    logits = as_float32(logits)  # (float32 logits as they are: no op)
    if seen is not None and params.repetition_penalty != 1.0:
        logits = penalize_repeats(logits, seen.to(logits.device), params.repetition_penalty)
    if params.temperature < TINY_TEMPERATURE:
        return int(torch.argmax(logits))
    # less the largest first: a tiny temperature sends the others to -inf, never inf - inf
    scores = (logits - logits.max()) / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        scores = scores.masked_fill(scores < torch.topk(scores, params.top_k).values[-1], -float("inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p
        keep[0] = True  # the top token always (a top_p below float32's smallest number keeps nothing else)
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))


class _Detokenizer:
    """Incremental text: decode the tail and emit only completed characters."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def add(self, token_id: int) -> str:
        if self.tokenizer is None:
            return ""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more tokens
            return ""
        new, self.emitted = text[len(self.emitted):], text
        return new


def eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids


@torch.inference_mode()
def stream_generate(
    model,
    input_ids: torch.Tensor,
    *,
    tokenizer=None,
    engine: Engine | None = None,
    max_new_tokens: int = 64,
    sampling: SamplingParams | None = None,
    stop_on_eos: bool = True,
    past_key_values: DynamicCache | DecodeGraph | None = None,
    history: list[int] | None = None,
    capacity: int | None = None,
) -> Iterator[TokenEvent]:
    """Generate from `input_ids` ([1, T] or [T]); `past_key_values` continues a conversation
    (then `input_ids` holds only the new tokens, and `history` the tokens before them, which a repetition penalty
    counts too): a DynamicCache, or a DecodeGraph (`conversation_cache`). `capacity`: the positions a GPU's decode
    cache is made for (default T + max_new_tokens; bench gives its warm-up the measured run's, so that one cache, the
    one the plan reserved, serves both)."""
    sampling = sampling or SamplingParams()
    penalized = sampling.repetition_penalty != 1.0  # (then the sequence's tokens are kept, on the host)
    seen = [*(history or []), *input_ids.reshape(-1).tolist()] if penalized else []
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(sampling.seed)
    device = next(model.parameters()).device
    ids = input_ids.reshape(1, -1).to(device)
    if isinstance(past_key_values, DecodeGraph):  # a conversation on a GPU: its static cache, continued
        graph, cache, first = past_key_values, None, past_key_values.extend
    else:
        graph = decode_graph(model, engine, max(capacity or 0, ids.shape[1] + max_new_tokens)) \
            if past_key_values is None else None
        cache = past_key_values if past_key_values is not None or graph is not None else new_cache(model)
        first = graph.prefill if graph is not None else None
    stops = eos_ids(model, tokenizer) if stop_on_eos else set()
    detok = _Detokenizer(tokenizer)

    for index in range(max_new_tokens):
        before = engine.counters() if engine is not None else None
        start = host_now()
        if graph is not None:  # on a GPU: the decode steps replayed from CUDA graphs (or eager on its cache)
            logits = first(ids) if index == 0 else graph.step(ids)
        else:
            logits = next_logits(model, ids, cache)
        if index == 0 and bool(torch.isnan(logits).any()):  # (once a generation: the prompt's last token)
            raise FmoeError("the model's output is NaN (not a number) at the prompt's last token: a damaged weight "
                            "file, or values beyond what the dtype holds (float16?); nothing to generate from")
        token = sample_next(logits.cpu() if generator is not None else logits, sampling, generator,
                            torch.tensor(seen) if penalized else None)
        if penalized:
            seen.append(token)
        latency = host_now() - start
        counters = engine.counters() - before if engine is not None else None
        finish = "eos" if token in stops else "length" if index == max_new_tokens - 1 else None
        yield TokenEvent(index, token, detok.add(token) if finish != "eos" else "", latency, counters, finish)
        if finish is not None:
            return
        # the next step's [1, 1] int64 ids: on the CPU by torch.full (a third of torch.tensor's time from a nested
        # list); on a GPU as before (a copy from the host, not a fill kernel)
        ids = torch.full((1, 1), token) if device.type == "cpu" else torch.tensor([[token]], device=device)
