"""A chat session: the conversation, its chat template, and one answer at a time through
`stream_generate` (the one generation loop).

- The prompt of every turn is the whole conversation rendered with the model's own chat
  template. The KV cache of the previous turn is reused for the longest common prefix
  of token ids (cropped there), so a turn usually pre-fills only the new message.
- Ctrl-C (KeyboardInterrupt) during an answer stops it: the partial answer, as far as
  it was shown, STAYS in the conversation as the assistant's message (what the user saw
  is what the model will see next turn), and the answer is marked `interrupted`. If it
  struck inside a forward, the KV cache is dropped (the forward stopped half-way) and
  the engine is rebuilt warm (its eviction history kept), so nothing in use or in flight
  stays pinned; between tokens, every forward has finished and the cache is kept.
- `generate` is the answer loop itself (KV reuse, counters, recovery) on prompt token
  ids: `fmoe serve` answers its requests through it too.
- Any other error during an answer removes this turn's user message again (so the
  conversation stays well-formed) and re-raises: the REPL gives the text back at the
  prompt, so nothing the user typed is lost.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from transformers import DynamicCache

from fmoe_cli.errors import FmoeError
from fmoe_cli.generate import DecodeGraph, SamplingParams, TokenEvent, conversation_cache, encode_messages, stream_generate
from fmoe_cli.models.load import LoadedModel
from fmoe_cli.offload.engine import Counters, Engine, EngineSettings
from fmoe_cli.offload.link import on_current_device
from fmoe_cli.run import context_length
from fmoe_cli.types import SEED_RANGE

IdleHook = Callable[[], object]  # work for the idle device (re-planning); never runs during an answer

@dataclass
class AnswerStats:
    tokens: int
    ttft_ms: float
    tpot_ms: float  # median of the decode steps (0 for a one-token answer)
    tokens_per_s: float  # decode speed: 1000 / mean TPOT (0 for a one-token answer)
    hit_rate: float  # over the whole answer (prefill and decode)
    prompt_tokens: int  # tokens pre-filled this turn (after KV-cache reuse)
    finish_reason: str  # "eos", "length" or "interrupted"
    dropped: int = 0  # oldest messages dropped from the prompt this turn to fit the model's context
    context_used: int = 0  # tokens of the conversation in the KV cache after this answer
    context: int | None = None  # the window it is kept inside (--context)
    dtype: str = ""  # what the device computes in (float16 on a card without native bfloat16)

    def footer(self) -> str:
        stopped = "stopped (Ctrl-C) · " if self.finish_reason == "interrupted" else ""
        window = f" · context {self.context_used}/{self.context}" if self.context else ""
        window += f" · {self.dtype}" if self.dtype else ""
        return (f"{stopped}{self.tokens} tokens · TTFT {self.ttft_ms:.0f} ms · TPOT {self.tpot_ms:.1f} ms · "
                f"{self.tokens_per_s:.1f} tok/s · hit rate {self.hit_rate:.2f}{window}")


def answer_stats(events: list, prompt_tokens: int, finish_reason: str) -> AnswerStats:
    if not events:
        return AnswerStats(0, 0.0, 0.0, 0.0, 0.0, prompt_tokens, finish_reason)
    decode = [e.latency_s * 1000 for e in events[1:]]
    counters = sum((e.counters for e in events if e.counters is not None), Counters())
    return AnswerStats(
        tokens=len(events),
        ttft_ms=events[0].latency_s * 1000,
        tpot_ms=statistics.median(decode) if decode else 0.0,
        tokens_per_s=1000 / statistics.mean(decode) if decode else 0.0,
        hit_rate=counters.hit_rate,
        prompt_tokens=prompt_tokens,
        finish_reason=finish_reason,
    )


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def turn_seed(seed: int, turn: int) -> int:
    """--seed's seed of answer `turn` (1, 2, …): seed, seed + 1, …, wrapping within what torch's generator takes
    (SEED_RANGE: the largest seed's next turn is the smallest, not an overflow)."""
    low, high = SEED_RANGE
    return low + (seed + turn - 1 - low) % (high - low + 1)


@dataclass
class ChatSession:
    lm: LoadedModel
    engine: Engine  # configured; its settings (plan) may change between turns (re-planning)
    system: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    sampling_source: str = ""  # where the sampling defaults came from (the header says it), "" for fmoe's own
    max_new_tokens: int = 512
    recorder: object | None = None  # a trace.RouteRecorder already in engine.observers, or None
    messages: list[dict] = field(default_factory=list)  # user/assistant turns (the system prompt is apart)
    turns: int = 0
    last_answer_ids: list[int] = field(default_factory=list)  # token ids of the latest answer (with any EOS)
    last_stats: AnswerStats | None = None
    layer_totals: list[Counters] = field(default_factory=list)  # per MoE layer, over the session
    window_start: int = 0  # messages before this one were dropped from the prompt to fit the context
    reused: int = 0  # prompt tokens of the latest answer taken from the previous answer's KV cache
    context: int | None = None  # the window (--context: what the KV cache is reserved for); None: the model's
    _kv: DynamicCache | DecodeGraph | None = None  # the conversation's KV cache (generate.conversation_cache)
    _kv_ids: list[int] = field(default_factory=list)  # the token ids the KV cache holds

    @property
    def settings(self) -> EngineSettings:
        return self.engine.settings

    def conversation(self, messages: list[dict] | None = None) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + (self.messages if messages is None else messages)

    def check_system(self, text: str | None) -> None:
        """Refuse, once, a system prompt that alone leaves no room for an answer in the context (--context,
        else the model's; else every message would be blamed in turn)."""
        limit = self.context_limit
        if limit is None or not text:
            return
        n = len(encode_messages(self.lm.tokenizer, [{"role": "system", "content": text}], self.lm.model_id))
        if n + min(self.max_new_tokens, limit // 2) > limit:
            raise FmoeError(f"the system prompt alone is {n} tokens: it leaves too little of the context "
                            f"of {limit} tokens for a message and an answer; give a shorter one")

    def encode(self, messages: list[dict]) -> list[int]:
        return encode_messages(self.lm.tokenizer, self.conversation(messages), self.lm.model_id)

    def _layer_counters(self) -> list[Counters]:
        return [state.counters for state in self.engine.layers]

    @property
    def context_limit(self) -> int | None:
        """Tokens the conversation is kept inside: --context (the KV cache reserved for it), else the model's."""
        return self.context if self.context is not None else context_length(self.lm)

    def _fit(self, new: list[dict]) -> tuple[list[int], int, int]:
        """The prompt ids of the conversation plus `new` within the model's context: the oldest turns (a
        user message and its answer at a time) are dropped until the answer has room for
        min(max_new_tokens, context / 2) tokens. Returns (ids, messages dropped now, longest answer:
        what is left of the context, at most max_new_tokens). FmoeError if the new message alone
        leaves no such room."""
        limit = self.context_limit
        dropped, start = 0, self.window_start
        while True:
            ids = self.encode(self.messages[self.window_start:] + new)
            if limit is None:
                return ids, dropped, self.max_new_tokens
            if len(ids) + min(self.max_new_tokens, limit // 2) <= limit:
                return ids, dropped, min(self.max_new_tokens, limit - len(ids))
            if self.window_start >= len(self.messages):
                self.window_start = start
                raise FmoeError(f"the message is {len(ids)} tokens: it leaves too little of the context of "
                                f"{limit} tokens for an answer; send a shorter one")
            step = min(2, len(self.messages) - self.window_start)  # a user message and its answer
            self.window_start += step
            dropped += step

    def ask(self, text: str, on_text: Callable[[str], None] = lambda _: None) -> AnswerStats:
        """Answer `text`, streaming new text to `on_text`. Raises FmoeError before anything changes
        when the conversation cannot be encoded."""
        ids, dropped, longest = self._fit([{"role": "user", "content": text}])
        self.messages.append({"role": "user", "content": text})
        self.turns += 1

        if self.recorder is not None:
            self.recorder.start_sequence(self.turns)
        sampling = self.sampling
        if sampling.seed is not None:  # reproducible, yet a different stream every turn
            sampling = replace(sampling, seed=turn_seed(sampling.seed, self.turns))
        self.last_answer_ids = []
        events, pieces, finish = [], [], "length"
        try:
            with contextlib.closing(self.generate(ids, longest, sampling)) as stream:
                for event in stream:
                    events.append(event)
                    if event.text:
                        pieces.append(event.text)
                        on_text(event.text)
                    finish = event.finish_reason or finish
        except KeyboardInterrupt:
            finish = "interrupted"
        except BaseException:
            self.messages.pop()  # the conversation as before this turn; the REPL gives the text back
            self.turns -= 1
            raise
        self.messages.append({"role": "assistant", "content": "".join(pieces)})
        self.last_stats = answer_stats(events, len(ids) - self.reused, finish)
        self.last_stats.dropped = dropped
        self.last_stats.context_used, self.last_stats.context = len(ids) + len(events), self.context_limit
        self.last_stats.dtype = str(self.lm.dtype).removeprefix("torch.")
        return self.last_stats

    def take_cache(self, ids: list[int]) -> tuple[DynamicCache | DecodeGraph, int]:
        """The KV cache to continue from for the prompt `ids`: the previous answer's, cropped to the
        longest common prefix of token ids (at least one token is left to feed), else a fresh one.
        Returns (cache, tokens reused); the session holds no cache until the answer ends (`generate`)."""
        reuse = common_prefix(self._kv_ids, ids) if self._kv is not None else 0
        reuse = min(reuse, len(ids) - 1)  # at least one token to feed
        cache = self._kv if reuse > 0 else None
        if cache is not None and reuse < cache.get_seq_length():
            try:
                cache.crop(reuse - cache.get_seq_length())  # transformers 5: a negative count removes tokens
            except Exception:  # a cache layout that cannot be cropped: start afresh
                cache, reuse = None, 0
        if cache is None:  # on a GPU the static cache of the context (replayed steps), on the CPU a growing one
            cache, reuse = conversation_cache(self.lm.model, self.engine, self.context), 0
        self._kv, self._kv_ids = None, []  # until the answer completes
        return cache, reuse

    def generate(self, ids: list[int], max_new_tokens: int, sampling: SamplingParams) -> Iterator[TokenEvent]:
        """Answer the prompt `ids` (token ids of the whole conversation) through `stream_generate`,
        continuing the KV cache of the previous answer (`take_cache`; `self.reused` tokens). The
        per-layer counters are added to the session's totals however it ends. Ended between tokens
        (the answer's end, or the consumer closing the generator: a stop string, a client gone),
        every forward has finished: the cache is kept for the next prompt. Ended by an exception
        inside a forward (Ctrl-C, a failure): the cache is dropped and the engine rebuilt (`recover`)."""
        cache, self.reused = self.take_cache(ids)
        before = [Counters() + c for c in self._layer_counters()]
        self.last_answer_ids = []
        clean = False
        try:
            for event in stream_generate(self.lm.model, torch.tensor([ids[self.reused:]]), tokenizer=self.lm.tokenizer,
                                         engine=self.engine, max_new_tokens=max_new_tokens, sampling=sampling,
                                         past_key_values=cache, history=ids[:self.reused]):
                self.last_answer_ids.append(event.token_id)
                try:
                    yield event
                except GeneratorExit:  # closed between tokens
                    clean = True
                    raise
            clean = True
        finally:
            self._add_layer_counters(before)
            if clean:
                self._kv, self._kv_ids = cache, ids + self.last_answer_ids[:-1]  # the last token was never fed
            else:
                self.recover()

    def _add_layer_counters(self, before: list[Counters]) -> None:
        now = self._layer_counters()
        if not self.layer_totals:
            self.layer_totals = [Counters() for _ in now]
        for i, (b, n) in enumerate(zip(before, now)):
            self.layer_totals[i] = self.layer_totals[i] + (n - b)

    def recover(self) -> None:
        """After an interrupted or failed answer: rebuild the engine's caches warm (eviction history
        kept, docs/architecture.md), so nothing stays pinned or staged from the forward that stopped half-way."""
        if self.engine.settings is not None:  # None: no plan fitted (the engine said so in one line)
            self.engine.configure(self.engine.settings, warm=True)

    def reset(self) -> None:
        self.messages.clear()
        self.window_start = 0
        self._kv, self._kv_ids = None, []

    def device_bytes(self) -> int:
        """What fmoe holds on the device: non-expert weights, expert caches, staging pool."""
        return self.lm.non_expert_bytes + self.engine.device_bytes()

    def to_json(self) -> dict:
        return {
            "fmoe_chat": 1,
            "model": self.lm.model_id,
            "policy": self.settings.policy,
            "system": self.system,
            "sampling": {"temperature": self.sampling.temperature, "top_p": self.sampling.top_p,
                         "top_k": self.sampling.top_k, "min_p": self.sampling.min_p,
                         "repetition_penalty": self.sampling.repetition_penalty,
                         "seed": self.sampling.seed, "max_new_tokens": self.max_new_tokens},
            "messages": self.conversation(),
        }

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        """The conversation as JSON; an existing file is replaced only when `overwrite` (`/save!`), a
        directory never."""
        path = Path(path).expanduser()
        if path.is_dir():  # "x" would call it existing, "w" fails: neither /save nor /save! can write there
            raise FmoeError(f"{path} is a directory: nothing saved")
        text = json.dumps(self.to_json(), indent=2, ensure_ascii=False) + "\n"
        try:
            with open(path, "w" if overwrite else "x", encoding="utf-8") as f:  # "x": never over the user's file
                f.write(text)
        except FileExistsError:
            raise FmoeError(f"{path} exists: nothing saved; `/save! {path}` replaces it") from None
        except OSError as exc:
            raise FmoeError(f"cannot write {path}: {exc.strerror or exc}") from None
        return path


class IdleWork:
    """Runs the idle hook (re-planning, cache rebuild) on a thread while the user types;
    `wait()` before the device is used again. An error in the hook is reported, not raised."""

    def __init__(self, hook: IdleHook | None) -> None:
        self.hook = hook
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        if self.hook is None:
            return
        self.wait()

        def run() -> None:
            try:
                self.hook()
            except BaseException as exc:  # reported by wait(); the chat goes on
                self._error = exc

        self._thread = threading.Thread(target=on_current_device(run), name="fmoe-idle", daemon=True)
        self._thread.start()

    def wait(self) -> str | None:
        """Join the idle work; a one-line message if it failed, saying what the next answers run on."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is None:
            return None
        first = str(error).splitlines()[0] if str(error) else ""
        if isinstance(error, FmoeError):  # the engine's own line: the plan it built instead (Engine.configure)
            return f"re-planning: {first}"
        return f"re-planning failed ({error.__class__.__name__}: {first}); the chat goes on with the plan it had"
