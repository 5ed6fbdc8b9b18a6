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

from fmoe_cli.errors import FmoeError
from fmoe_cli.offload.engine import Counters, Engine
from fmoe_cli.offload.link import host_now

def next_logits(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """One forward of `ids` [1, T] on the KV cache → the last position's logits [V].

    `logits_to_keep=1`: a prefill computes the LM head for its last token only, never the
    [1, T, V] logits (Qwen3's V = 151,936 at 1.8k tokens would fill the workspace)."""
    return model(input_ids=ids, **{cache_kwarg(model): cache}, use_cache=True, logits_to_keep=1).logits[0, -1]


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


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0; otherwise temperature + nucleus (top-p) sampling."""
    logits = logits.float()
    if params.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p  # always keeps the top token
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
    cache = past_key_values if past_key_values is not None else DynamicCache(config=model.config)
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
