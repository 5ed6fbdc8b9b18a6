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
from fmoe_cli.offload.link import host_now

def next_logits(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """One forward of `ids` [1, T] on the KV cache → the last position's logits [V].

    `logits_to_keep=1`: a prefill computes the LM head for its last token only, never the
    [1, T, V] logits (Qwen3's V = 151,936 at 1.8k tokens would fill the workspace)."""
    return model(input_ids=ids, **{cache_kwarg(model): cache}, use_cache=True, logits_to_keep=1).logits[0, -1]


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
    """A resident decode step replayed from one CUDA graph (issue 37 §1): attention, norms, routers, experts and the
    LM head of a token in one launch, where the eager step launches several hundred ops from Python one by one.

    Possible because nothing in such a step reads a value back on the host: the routing stays on the device
    (Engine._resident_device_decode) and the KV cache is transformers' StaticCache (a fixed [B, H, capacity, D] per
    layer, the next position a device tensor), so the same launches serve every token. A generation's prefill runs
    eagerly into that cache; the graph is captured on the first decode step (after two warm-up steps, as torch asks)
    and replayed for the others and for later generations of the same capacity. A replay runs no Python: the engine
    is told which layers' routing it copied to the host (`Engine.defer_replayed`), and their bookkeeping follows.

    Where capture fails, the step runs eagerly on the same StaticCache and one line says why. The graph is
    torch.cuda.CUDAGraph on a GPU (`CudaGraph`); tests give a stand-in that runs the step eagerly
    (tests/test_decode_graph.py). The tokens are transformers' with its StaticCache: attention over a static
    cache's masked positions sums in another order than over a dynamic one, so the logits may differ in the last
    bits from the eager path's (the GPU check compares the tokens with transformers' generate).

    A conversation continues on it (chat, serve): the cache keeps its positions between answers, `crop` takes it
    back to the prefix the next prompt shares (as a DynamicCache's, the StaticCache's own crop: the next writes
    overwrite the rest, which the causal mask hides until then) and `extend` pre-fills the new tokens after it. The
    graph is the plan's (the engine's buffers), the cache the conversation's: a new plan (`Engine.configure`)
    `release`s the graph and keeps the cache."""

    def __init__(self, model, engine: Engine, capacity: int, graph_factory, capture: bool = True) -> None:
        from transformers import StaticCache

        self.model, self.engine, self.capacity = model, engine, capacity
        device = next(model.parameters()).device
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)
        self.ids = torch.zeros(1, 1, dtype=torch.long, device=device)  # the step's token, written before each replay
        self.position = torch.zeros(1, 1, dtype=torch.long, device=device)  # … and its position
        self.length = 0  # positions in the cache
        self.graph_factory = graph_factory
        self.graph = None
        self.logits: torch.Tensor | None = None  # [V]: the graph's output, overwritten by each replay
        # the steps run eagerly (a plan that reads its routing on the host; a failed capture); None: not decided yet
        self.eager: bool | None = None if capture else True
        self.moe_layers: list[int] = []  # the MoE layers a replay runs (set at capture)

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
        """Forget the captured graph (it reads the engine's buffers, which a new plan frees); the cache stays. Whether
        the new plan's steps can be captured is asked again at the next step."""
        self.graph, self.logits, self.eager = None, None, None

    def _check_room(self, tokens: int) -> None:
        if self.length + tokens > self.capacity:
            raise FmoeError(f"the static KV cache holds {self.capacity} positions; the generation went past them")

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """One decode token ids [1, 1] at the next position: the graph's replay (captured on first use)."""
        self._check_room(1)
        self.ids.copy_(ids)
        self.position.fill_(self.length)
        if self.eager is None:
            self.eager = not capturable(self.engine)
        if self.graph is None and not self.eager:
            self._capture()
        self.length += 1
        if self.eager:
            return self._forward(self.ids, self.position)
        self.graph.replay()
        self.engine.defer_replayed(self.moe_layers)
        return self.logits

    def _capture(self) -> None:
        """Two warm-up steps on a side stream, then the capture, at the current position: each writes this position's
        keys and values (the replay writes them again) and moves the cache's length, which is put back after."""
        engine, cache = self.engine, self.cache
        self.moe_layers = list(range(len(engine.layers)))  # the layers whose routing a replay copies
        lengths = [layer.cumulative_length.clone() for layer in cache.layers]
        try:
            graph = self.graph_factory(self)
            side = torch.cuda.Stream() if self.ids.is_cuda else None
            if side is not None:
                side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                for _ in range(2):
                    engine.discard_deferred()
                    self._forward(self.ids, self.position)
                    for layer, length in zip(cache.layers, lengths):
                        layer.cumulative_length.copy_(length)
            if side is not None:
                torch.cuda.current_stream().wait_stream(side)
            engine.discard_deferred()
            with graph.capture():
                logits = self._forward(self.ids, self.position)
            self.graph, self.logits = graph, logits
        except Exception as exc:  # torch refuses what a capture cannot hold (a host read, a pageable copy)
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            warn(f"CUDA graphs: the decode step could not be captured ({first[:160]}); it runs eagerly")
            self.eager = True
        finally:
            engine.discard_deferred()
            for layer, length in zip(cache.layers, lengths):
                layer.cumulative_length.copy_(length)


class CudaGraph:
    """torch.cuda.CUDAGraph with a `capture()` context (DecodeGraph's graph on a GPU; made for the DecodeGraph it
    will replay, which a stand-in needs and this does not)."""

    def __init__(self, decode: DecodeGraph) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def capture(self):
        return torch.cuda.graph(self.graph)

    def replay(self) -> None:
        self.graph.replay()


GRAPH_CAPACITY_STEP = 256  # a DecodeGraph's KV capacity is a multiple of this many positions


def decode_graph(model, engine: Engine | None, capacity: int) -> DecodeGraph | None:
    """The DecodeGraph a generation of `capacity` positions decodes through on a CUDA device (or where the engine has
    a `graph_factory`: tests), every plan alike, or None (the CPU: transformers' DynamicCache, `new_cache`). Its steps
    are replayed from a CUDA graph where the plan's every layer decodes on the device without a host wait
    (Engine.decode_graphable) and FMOE_CUDA_GRAPHS is not 0; else they run eagerly on the same StaticCache. Every
    policy on a GPU thus attends over the same static cache, with the same kernels: a static cache's attention sums
    in another order than a dynamic one's, and on the first H200 run the graphed `resident` (static) left the other
    policies (dynamic) at token 30 of a bf16 a3b-shaped model. One per capacity (rounded up), kept by the engine until
    it is configured again (the graph reads its buffers)."""
    if engine is None:
        return None
    factory = engine.graph_factory or (CudaGraph if engine.device.type == "cuda" else None)
    if factory is None:
        return None
    capacity = -(-capacity // GRAPH_CAPACITY_STEP) * GRAPH_CAPACITY_STEP
    graph = engine.decode_graphs.get(capacity)
    if graph is None:
        graph = engine.decode_graphs[capacity] = DecodeGraph(model, engine, capacity, factory)
    return graph


def capturable(engine: Engine) -> bool:
    """Whether a DecodeGraph captures the steps of the engine's plan: every layer decodes on the device without a host
    wait (Engine.decode_graphable), and FMOE_CUDA_GRAPHS is not 0."""
    return engine.decode_graphable() and os.environ.get("FMOE_CUDA_GRAPHS", "1").strip() != "0"


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
    top_p: float = 1.0
    seed: int | None = None


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0; otherwise temperature + nucleus (top-p) sampling."""
    logits = logits.float()
    if params.temperature < TINY_TEMPERATURE:
        return int(torch.argmax(logits))
    # less the largest first: a tiny temperature sends the others to -inf, never inf - inf
    probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p
        keep[0] = True  # the top token always (a top_p below float32's smallest number keeps nothing else)
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
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
) -> Iterator[TokenEvent]:
    """Generate from `input_ids` ([1, T] or [T]); `past_key_values` continues a conversation
    (then `input_ids` holds only the new tokens): a DynamicCache, or a DecodeGraph (`conversation_cache`)."""
    sampling = sampling or SamplingParams()
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(sampling.seed)
    device = next(model.parameters()).device
    ids = input_ids.reshape(1, -1).to(device)
    if isinstance(past_key_values, DecodeGraph):  # a conversation on a GPU: its static cache, continued
        graph, cache, first = past_key_values, None, past_key_values.extend
    else:
        graph = decode_graph(model, engine, ids.shape[1] + max_new_tokens) if past_key_values is None else None
        cache = past_key_values if past_key_values is not None or graph is not None else new_cache(model)
        first = graph.prefill if graph is not None else None
    stops = eos_ids(model, tokenizer) if stop_on_eos else set()
    detok = _Detokenizer(tokenizer)

    for index in range(max_new_tokens):
        before = engine.counters() if engine is not None else None
        start = host_now()
        if graph is not None:  # a resident plan on a GPU: the decode steps replayed from one CUDA graph
            logits = first(ids) if index == 0 else graph.step(ids)
        else:
            logits = next_logits(model, ids, cache)
        token = sample_next(logits.cpu() if generator is not None else logits, sampling, generator)
        latency = host_now() - start
        counters = engine.counters() - before if engine is not None else None
        finish = "eos" if token in stops else "length" if index == max_new_tokens - 1 else None
        yield TokenEvent(index, token, detok.add(token) if finish != "eos" else "", latency, counters, finish)
        if finish is not None:
            return
        ids = torch.tensor([[token]], device=device)
