"""Routing traces: which experts every token activated in every MoE layer.

The fmoe trace format is JSON Lines. The first line is a header, every other
line one (token, layer) record:

    {"fmoe_trace": 1, "num_layers": 32, "num_experts": 8, "top_k": 2, "model": "..."}
    {"seq": 0, "token": 0, "layer": 0, "experts": [6, 5], "probs": [0.70, 0.30],
     "predicted": [6, 5, 3, 0, 1, 2, 4, 7]}

- `seq`: sequence id (int or string); `token`: token index within the sequence;
  `layer`: MoE layer index.
- `experts`: the activated (top-k) expert ids in the router's order; `probs`:
  their routing weights, same length.
- `predicted` (optional): the speculative prediction ranking of this layer's
  experts made before the layer ran, highest score first.

Header fields other than `fmoe_trace` are optional; without them the number of
layers and experts is taken from the records. The header itself is optional too.

The reader also accepts the external vLLM routing format of `shared/traces/`
(`dataset`, `problem_id`, `layer`, `experts`, `gating_probs`, `token_idx`; the
sequence is (dataset, problem_id)). In both formats a token is kept only when
every layer of the trace is present (a recording cut short leaves partial tokens).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from fmoe_cli.errors import FmoeError, reading

FORMAT_VERSION = 1
SeqId = int | str


@dataclass(frozen=True)
class TraceRecord:
    """One token of one layer."""

    seq: SeqId
    token: int
    layer: int
    experts: tuple[int, ...]
    probs: tuple[float, ...]
    predicted: tuple[int, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "seq": self.seq,
            "token": self.token,
            "layer": self.layer,
            "experts": list(self.experts),
            "probs": list(self.probs),
        }
        if self.predicted is not None:
            obj["predicted"] = list(self.predicted)
        return obj


@dataclass(frozen=True)
class SequenceTrace:
    """The complete tokens of one sequence, in token order.

    `routes[j][i]` is the expert list of token `tokens[i]` in the trace's j-th
    layer (`Trace.layers[j]`)."""

    id: SeqId
    tokens: tuple[int, ...]
    records: tuple[tuple[TraceRecord, ...], ...]  # [layer position][token position]

    def routes(self, layer_pos: int) -> list[tuple[int, ...]]:
        return [r.experts for r in self.records[layer_pos]]


@dataclass(frozen=True)
class Trace:
    path: str
    format: Literal["fmoe", "vllm"]
    layers: tuple[int, ...]  # MoE layer indices present, ascending
    num_experts: int
    sequences: tuple[SequenceTrace, ...]
    skipped_tokens: int  # incomplete tokens left out

    @property
    def num_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.sequences)

    @property
    def num_activations(self) -> int:
        return sum(len(r.experts) for s in self.sequences for layer in s.records for r in layer)


# --- writing ---------------------------------------------------------------


class TraceWriter:
    """Buffered writer of fmoe traces.

    Usage (the engine calls `record` once per token and MoE layer)::

        with TraceWriter(path, num_layers=32, num_experts=8, top_k=2, model=name) as w:
            w.record(seq, token, layer, experts, probs, predicted=None)

    `close` flushes and is idempotent; `record` after `close` raises.
    """

    @classmethod
    def for_model(cls, path: str | os.PathLike[str], lm) -> TraceWriter:
        """A writer whose header describes a loaded model (models.load.LoadedModel)."""
        shape = lm.shape
        return cls(path, num_layers=shape.num_layers, num_experts=shape.num_experts, top_k=shape.top_k,
                   model=lm.model_id)

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        num_layers: int | None = None,
        num_experts: int | None = None,
        top_k: int | None = None,
        model: str | None = None,
        buffer_lines: int = 4096,
    ) -> None:
        self.path = Path(path)
        self._buffer: list[str] = []
        self._buffer_lines = max(1, buffer_lines)
        self.num_experts = num_experts
        try:
            self._file: IO[str] | None = open(self.path, "w", encoding="utf-8")
        except OSError as exc:
            raise FmoeError(f"cannot write trace {self.path}: {exc.strerror or exc}") from exc
        header: dict[str, Any] = {"fmoe_trace": FORMAT_VERSION}
        for key, value in (("num_layers", num_layers), ("num_experts", num_experts), ("top_k", top_k), ("model", model)):
            if value is not None:
                header[key] = value
        self._buffer.append(json.dumps(header))

    @property
    def closed(self) -> bool:
        return self._file is None

    def record(
        self,
        seq: SeqId,
        token: int,
        layer: int,
        experts: Sequence[int],
        probs: Sequence[float],
        predicted: Sequence[int] | None = None,
    ) -> None:
        if self._file is None:
            raise RuntimeError("trace writer is closed")
        ids = tuple(int(e) for e in experts)
        weights = tuple(float(p) for p in probs)
        ranking = None if predicted is None else tuple(int(e) for e in predicted)
        # Refuse here what the reader would refuse later (a trace must always read back).
        if len(ids) != len(weights):
            raise ValueError(f"{len(ids)} experts but {len(weights)} probabilities")
        for name, group in (("experts", ids), ("predicted", ranking or (0,))):
            if not group or min(group) < 0 or len(set(group)) != len(group):
                raise ValueError(f"{name} must be distinct expert ids >= 0, got {list(group)}")
        if not all(math.isfinite(p) for p in weights):
            raise ValueError(f"probabilities must be finite, got {list(weights)}")
        if int(token) < 0 or int(layer) < 0:
            raise ValueError("token and layer must be >= 0")
        seq_id: SeqId = seq if isinstance(seq, str) else int(seq)
        rec = TraceRecord(seq_id, int(token), int(layer), ids, weights, ranking)
        self._buffer.append(json.dumps(rec.to_json(), allow_nan=False))
        if len(self._buffer) >= self._buffer_lines:
            self.flush()

    def flush(self) -> None:
        if self._file is None or not self._buffer:
            return
        self._file.write("\n".join(self._buffer) + "\n")
        self._buffer.clear()
        self._file.flush()

    def close(self) -> None:
        if self._file is None:
            return
        try:
            self.flush()
        finally:
            self._file.close()
            self._file = None

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RouteRecorder:
    """An engine observer (`engine.observers.append(recorder)`) that writes every routed
    token to a TraceWriter: one record per token and MoE layer, with the prefetcher's
    ranking for that layer when one was made (for a multi-token forward, a prefill,
    the one ranking made for the whole forward is recorded with each of its tokens).

    `start_sequence(seq)` begins a new sequence (a bench run, a chat turn); token
    indices count the tokens the model processed in it, prompt tokens first."""

    def __init__(self, writer: TraceWriter) -> None:
        self.writer = writer
        self.seq: SeqId = 0
        self._next_token: dict[int, int] = {}

    def start_sequence(self, seq: SeqId) -> None:
        self.seq = seq
        self._next_token = {}

    def __call__(self, event: Any) -> None:  # event: fmoe_cli.offload.engine.RouteEvent
        experts = event.top_k_index.tolist()
        probs = event.top_k_weights.float().tolist()
        first = self._next_token.get(event.layer, 0)
        for t, (ids, weights) in enumerate(zip(experts, probs)):
            self.writer.record(self.seq, first + t, event.layer, ids, weights, event.predicted)
        self._next_token[event.layer] = first + len(experts)


def write_trace(path: str | os.PathLike[str], records: Sequence[TraceRecord], **header: Any) -> None:
    with TraceWriter(path, **header) as w:
        for r in records:
            w.record(r.seq, r.token, r.layer, r.experts, r.probs, r.predicted)


# --- reading ---------------------------------------------------------------


class _LineError(Exception):
    pass


def _show(v: object, limit: int = 60) -> str:
    """A value for a one-line message: repr, shortened."""
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _int(obj: dict[str, Any], key: str, *, minimum: int = 0) -> int:
    if key not in obj:
        raise _LineError(f"missing field {key!r}")
    v = obj[key]
    if type(v) is not int or v < minimum:
        raise _LineError(f"field {key!r} must be an integer >= {minimum}, got {_show(v)}")
    return v


def _int_list(obj: dict[str, Any], key: str, num_experts: int | None) -> tuple[int, ...]:
    v = obj.get(key)
    if not isinstance(v, list) or not v:
        raise _LineError(f"field {key!r} must be a non-empty list of expert ids")
    if any(type(e) is not int or e < 0 for e in v):
        raise _LineError(f"field {key!r} must hold expert ids (integers >= 0), got {_show(v)}")
    if len(set(v)) != len(v):
        raise _LineError(f"field {key!r} repeats an expert: {_show(v)}")
    if num_experts is not None and max(v) >= num_experts:
        raise _LineError(f"field {key!r} has expert {max(v)} but the header says {num_experts} experts")
    return tuple(v)


def _prob_list(obj: dict[str, Any], key: str, n: int) -> tuple[float, ...]:
    v = obj.get(key)
    if not isinstance(v, list) or any(type(p) not in (int, float) or not math.isfinite(p) for p in v):
        raise _LineError(f"field {key!r} must be a list of numbers")
    if len(v) != n:
        raise _LineError(f"field {key!r} has {len(v)} values for {n} experts")
    return tuple(float(p) for p in v)


def _parse_fmoe(obj: dict[str, Any], num_experts: int | None) -> TraceRecord:
    if "seq" not in obj:
        raise _LineError("missing field 'seq'")
    seq = obj["seq"]
    if type(seq) not in (int, str):
        raise _LineError(f"field 'seq' must be an integer or a string, got {_show(seq)}")
    experts = _int_list(obj, "experts", num_experts)
    predicted = None
    if obj.get("predicted") is not None:
        predicted = _int_list(obj, "predicted", num_experts)
    return TraceRecord(
        seq, _int(obj, "token"), _int(obj, "layer"), experts, _prob_list(obj, "probs", len(experts)), predicted
    )


def _parse_vllm(obj: dict[str, Any]) -> TraceRecord:
    dataset, problem = obj.get("dataset"), obj.get("problem_id")
    if type(dataset) is not str:
        raise _LineError(f"field 'dataset' must be a string, got {_show(dataset)}")
    if type(problem) not in (int, str):
        raise _LineError(f"field 'problem_id' must be an integer or a string, got {_show(problem)}")
    experts = _int_list(obj, "experts", None)
    return TraceRecord(
        f"{dataset}/{problem}",
        _int(obj, "token_idx"),
        _int(obj, "layer"),
        experts,
        _prob_list(obj, "gating_probs", len(experts)),
    )


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with reading(path, "trace"), open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            yield lineno, line


def read_records(path: str | os.PathLike[str]) -> tuple[Literal["fmoe", "vllm"], dict[str, Any], list[tuple[int, TraceRecord]]]:
    """Parse every line: (format, header, [(line number, record)]). Raises FmoeError naming the bad line."""
    p = Path(path)
    fmt: Literal["fmoe", "vllm"] | None = None
    header: dict[str, Any] = {}
    records: list[tuple[int, TraceRecord]] = []
    num_experts: int | None = None
    for lineno, line in _lines(p):
        if not line.strip():
            continue
        try:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise _LineError(f"not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise _LineError("expected a JSON object")
            if "fmoe_trace" in obj:
                if records or header:
                    raise _LineError("a trace header may only appear on the first line")
                if type(obj["fmoe_trace"]) is not int or obj["fmoe_trace"] != FORMAT_VERSION:
                    raise _LineError(f"unsupported fmoe trace version {_show(obj['fmoe_trace'])} (this fmoe reads {FORMAT_VERSION})")
                header = obj
                fmt = "fmoe"
                if "num_experts" in obj:
                    num_experts = _int(obj, "num_experts", minimum=1)
                if "num_layers" in obj:
                    _int(obj, "num_layers", minimum=1)
                continue
            if fmt is None:
                fmt = "vllm" if "gating_probs" in obj or "problem_id" in obj else "fmoe"
            rec = _parse_vllm(obj) if fmt == "vllm" else _parse_fmoe(obj, num_experts)
            if header.get("num_layers") is not None and rec.layer >= header["num_layers"]:
                raise _LineError(f"layer {rec.layer} but the header says {header['num_layers']} layers")
        except _LineError as exc:
            raise FmoeError(f"{p}:{lineno}: bad trace line: {exc}") from None
        records.append((lineno, rec))
    return fmt or "fmoe", header, records


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read an fmoe or vLLM trace, keeping complete tokens only."""
    fmt, header, records = read_records(path)
    p = Path(path)
    if not records:
        raise FmoeError(f"trace {p} holds no routing records")
    seen: dict[tuple[SeqId, int, int], int] = {}
    by_token: dict[SeqId, dict[int, dict[int, TraceRecord]]] = {}
    layers: set[int] = set(range(header["num_layers"])) if "num_layers" in header else set()
    max_expert = 0
    for lineno, r in records:
        key = (r.seq, r.token, r.layer)
        if key in seen:
            raise FmoeError(
                f"{p}:{lineno}: bad trace line: sequence {_show(r.seq)} token {r.token} layer {r.layer} "
                f"already recorded on line {seen[key]}"
            )
        seen[key] = lineno
        by_token.setdefault(r.seq, {}).setdefault(r.token, {})[r.layer] = r
        layers.add(r.layer)
        max_expert = max(max_expert, max(r.experts), *(r.predicted or ()))
    num_experts = header.get("num_experts") or max_expert + 1
    layer_order = tuple(sorted(layers))
    sequences: list[SequenceTrace] = []
    skipped = 0
    for seq, tokens in by_token.items():
        kept = [t for t in sorted(tokens) if len(tokens[t]) == len(layer_order)]
        skipped += len(tokens) - len(kept)
        if kept:
            recs = tuple(tuple(tokens[t][layer] for t in kept) for layer in layer_order)
            sequences.append(SequenceTrace(seq, tuple(kept), recs))
    if not sequences:
        raise FmoeError(f"trace {p} has no complete token (one with all {len(layer_order)} layers)")
    return Trace(str(path), fmt, layer_order, num_experts, tuple(sequences), skipped)
