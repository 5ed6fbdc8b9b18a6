"""The one generation loop: bench, chat and everything else consume `stream_generate`.

It yields one `TokenEvent` per generated token with its latency (TTFT for the
first: prefill + first token) and the engine's counters for that token.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from fmoe_cli.errors import FmoeError
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

    def reserve(self, new: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """For a writer that fills the next `new` positions itself (models/attention.py's decode step in C): the
        buffers [B, H, capacity, D], grown to hold them, and the first of them; then `commit(first + new)`. None
        before the first update (the prefill's: `update` sets the dtype and shapes)."""
        if not self.is_initialized or self.keys is None or not self.keys.numel():
            return None
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
    past_key_values: DynamicCache | None = None,
) -> Iterator[TokenEvent]:
    """Generate from `input_ids` ([1, T] or [T]); `past_key_values` continues a conversation
    (then `input_ids` holds only the new tokens)."""
    sampling = sampling or SamplingParams()
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(sampling.seed)
    device = next(model.parameters()).device
    ids = input_ids.reshape(1, -1).to(device)
    cache = past_key_values if past_key_values is not None else new_cache(model)
    stops = eos_ids(model, tokenizer) if stop_on_eos else set()
    detok = _Detokenizer(tokenizer)

    for index in range(max_new_tokens):
        before = engine.counters() if engine is not None else None
        start = host_now()
        logits = next_logits(model, ids, cache)
        token = sample_next(logits.cpu() if generator is not None else logits, sampling, generator)
        latency = host_now() - start
        counters = engine.counters() - before if engine is not None else None
        finish = "eos" if token in stops else "length" if index == max_new_tokens - 1 else None
        yield TokenEvent(index, token, detok.add(token) if finish != "eos" else "", latency, counters, finish)
        if finish is not None:
            return
        ids = torch.tensor([[token]], device=device)
