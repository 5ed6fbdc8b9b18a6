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

The reader also accepts the external vLLM routing format, as in the public Mixtral-8x7B dump of
docs/traces.md § Real routing (`dataset`, `problem_id`, `layer`, `experts`, `gating_probs`, `token_idx`;
the sequence is (dataset, problem_id)). In both formats a token is kept only when
every layer of the trace is present (a recording cut short leaves partial tokens).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
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

    `close` flushes and is idempotent; `record` after `close` raises. A write that fails (a full
    disk) never stops the run it records: the writer stops writing, keeps the reason in `error`,
    and the command reports it after its results (nothing the user has is lost to it).
    """

    @classmethod
    def for_model(cls, path: str | os.PathLike[str], lm, overwrite: bool = False) -> TraceWriter:
        """A writer whose header describes a loaded model (models.load.LoadedModel)."""
        shape = lm.shape
        return cls(path, num_layers=shape.num_layers, num_experts=shape.num_experts, top_k=shape.top_k,
                   model=lm.model_id, overwrite=overwrite)

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        num_layers: int | None = None,
        num_experts: int | None = None,
        top_k: int | None = None,
        model: str | None = None,
        buffer_lines: int = 4096,
        overwrite: bool = False,
    ) -> None:
        self.path = Path(path)
        self._buffer: list[str] = []
        self._buffer_lines = max(1, buffer_lines)
        self.num_experts = num_experts
        self.error: str | None = None  # the first write failure, for the command to report after its results
        check_trace_out(self.path, overwrite)
        try:  # "x": a file that appeared since the check is not overwritten either
            self._file: IO[str] | None = open(self.path, "w" if overwrite else "x", encoding="utf-8")
        except FileExistsError:
            check_trace_out(self.path, overwrite)
            raise
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
            if self.error is not None:
                return  # writing failed: the run goes on without its trace
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
        try:
            self._file.write("\n".join(self._buffer) + "\n")
            self._file.flush()
        except OSError as exc:
            self._failed(exc)
        self._buffer.clear()

    def close(self) -> None:
        if self._file is None:
            return
        self.flush()
        if self._file is not None:
            try:
                self._file.close()
            except OSError as exc:
                self._failed(exc)
            self._file = None

    def _failed(self, exc: OSError) -> None:
        self.error = f"cannot write trace {self.path}: {exc.strerror or exc}"
        with contextlib.suppress(OSError):
            self._file.close()  # (what it still buffers is lost with the rest)
        self._file = None

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_trace_out(path: str | os.PathLike[str], overwrite: bool = False) -> None:
    """Refuse, before any slow work, a trace path that would overwrite the user's file (or is a directory)."""
    path = Path(path)
    if path.is_dir():
        raise FmoeError(f"--trace-out {path} is a directory; give a file name")
    if path.exists() and not overwrite:
        raise FmoeError(f"--trace-out {path} exists; give another name, or pass --force to overwrite it")
    if not path.parent.is_dir():
        raise FmoeError(f"cannot write trace {path}: no directory {path.parent}")


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


FMOE_FIELDS = ("seq", "token", "layer", "experts", "probs")  # every record has them ("predicted": optional)
VLLM_FIELDS = ("dataset", "problem_id", "token_idx", "layer", "experts", "gating_probs")


def _check_fields(obj: dict[str, Any], fields: tuple[str, ...]) -> None:
    """A record missing fields is named with all it misses (a cut-short record, a foreign file)."""
    missing = [k for k in fields if k not in obj]
    if missing:
        raise _LineError(f"missing field{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))} "
                         f"(a record has {', '.join(fields)})")


def _parse_fmoe(obj: dict[str, Any], num_experts: int | None) -> TraceRecord:
    _check_fields(obj, FMOE_FIELDS)
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
    _check_fields(obj, VLLM_FIELDS)
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


MAX_EXPERTS = 4096  # experts per layer fmoe replays (each policy keeps per-expert counters per layer)
Progress = Callable[[int], object]  # advance(characters read)


MAX_LINE = 1 << 20  # characters: a record with a ranking of MAX_EXPERTS experts is far shorter


def _bounded_lines(f: IO, path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, line) of `f`, every line read at most MAX_LINE long: a longer one (an endless
    `/dev/zero`, a binary file) is not a record, and stops the reading there with one line."""
    end = f.read(0)  # "" or b"": what readline returns at the end of the file
    for lineno, line in enumerate(iter(lambda: f.readline(MAX_LINE + 1), end), 1):
        if len(line) > MAX_LINE:
            raise FmoeError(f"{path}:{lineno}: not a trace record: a line longer than {MAX_LINE} "
                            f"{'characters' if isinstance(end, str) else 'bytes'} (is {path} a trace?)")
        yield lineno, line


def _lines(path: Path, advance: Progress | None = None) -> Iterator[tuple[int, str]]:
    with reading(path, "trace"), open(path, encoding="utf-8") as f:
        done = 0
        for lineno, line in _bounded_lines(f, path):
            if advance is not None:
                done += len(line)
                if done >= 1 << 20:  # report in steps of a MiB: cheap on traces of millions of lines
                    advance(done)
                    done = 0
            yield lineno, line
        if advance is not None and done:
            advance(done)


class _Parser:
    """Reads a trace line by line: the format and the header come from the first lines; every count
    a line declares is bounded by what the file can hold (a header cannot make fmoe allocate more)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fmt: Literal["fmoe", "vllm"] | None = None
        self.header: dict[str, Any] = {}
        self.num_experts: int | None = None
        self.records = 0

    def line(self, lineno: int, line: str) -> TraceRecord | None:
        """The record of one line, None for a blank line or the header; FmoeError naming the line."""
        if not line.strip():
            return None
        try:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                cut = "" if line.endswith("\n") else "; the file ends inside this record (cut short?)"
                raise _LineError(f"not valid JSON ({exc.msg}){cut}") from None
            if not isinstance(obj, dict):
                raise _LineError("expected a JSON object")
            if "fmoe_trace" in obj:
                self._read_header(obj)
                return None
            if self.fmt is None:
                self.fmt = "vllm" if "gating_probs" in obj or "problem_id" in obj else "fmoe"
            rec = _parse_vllm(obj) if self.fmt == "vllm" else _parse_fmoe(obj, self.num_experts)
            if self.num_experts is None and max(rec.experts + (rec.predicted or ())) >= MAX_EXPERTS:
                raise _LineError(f"expert {max(rec.experts + (rec.predicted or ()))}: fmoe replays at most "
                                 f"{MAX_EXPERTS} experts per layer")
            if self.header.get("num_layers") is not None and rec.layer >= self.header["num_layers"]:
                raise _LineError(f"layer {rec.layer} but the header says {self.header['num_layers']} layers")
        except _LineError as exc:
            raise FmoeError(f"{self.path}:{lineno}: bad trace line: {exc}") from None
        self.records += 1
        return rec

    def _read_header(self, obj: dict[str, Any]) -> None:
        if self.records or self.header:
            raise _LineError("a trace header may only appear on the first line")
        if type(obj["fmoe_trace"]) is not int or obj["fmoe_trace"] != FORMAT_VERSION:
            raise _LineError(f"unsupported fmoe trace version {_show(obj['fmoe_trace'])} (this fmoe reads {FORMAT_VERSION})")
        if "num_experts" in obj:
            n = _int(obj, "num_experts", minimum=1)
            if n > MAX_EXPERTS:
                raise _LineError(f"the header says {n} experts; fmoe replays at most {MAX_EXPERTS} per layer")
            self.num_experts = n
        if "num_layers" in obj:
            _int(obj, "num_layers", minimum=1)  # (what the file can hold: `finish`, once the records are read)
        self.header = obj
        self.fmt = "fmoe"

    def finish(self) -> None:
        """After the last line: the header's layer count must fit the records read (it is allocated
        for); checked last so that a bad record is named for what it is, not blamed on the header."""
        n = self.header.get("num_layers")
        if n is not None and n > max(1, self.records):
            raise FmoeError(f"trace {self.path} has no complete token: the header says {n} layers, and the "
                            f"trace holds only {self.records} record{'s' * (self.records != 1)}")


def read_records(path: str | os.PathLike[str]) -> tuple[Literal["fmoe", "vllm"], dict[str, Any], list[tuple[int, TraceRecord]]]:
    """Parse every line: (format, header, [(line number, record)]). Raises FmoeError naming the bad line."""
    parser = _Parser(Path(path))
    records = [(n, rec) for n, line in _lines(Path(path)) if (rec := parser.line(n, line)) is not None]
    parser.finish()
    return parser.fmt or "fmoe", parser.header, records


@dataclass(frozen=True)
class TraceIndex:
    """What a first pass over a trace learns, keeping no records: enough to stream it sequence by sequence."""

    path: Path
    format: Literal["fmoe", "vllm"]
    header: dict[str, Any]
    layers: tuple[int, ...]  # MoE layer indices present, ascending
    num_experts: int
    order: dict[SeqId, int]  # sequence -> its position in the trace (first appearance)
    last_line: dict[SeqId, int]  # sequence -> the line of its last record
    records: int
    size: int  # characters in the file (for progress)


@contextlib.contextmanager
def seekable(path: str | os.PathLike[str]) -> Iterator[Path]:
    """`path` itself if it is a regular file (or missing, or a directory: the reader says so); a pipe
    (`fmoe replay <(zcat t.jsonl.gz)`) is first copied to a temporary file, so that it can be read
    twice with memory bounded, and the copy removed afterwards."""
    p = Path(path)
    if p.is_file() or not p.exists() or p.is_dir():
        yield p
        return
    with tempfile.TemporaryDirectory(prefix="fmoe-trace-") as tmp, reading(p, "trace"):
        copy = Path(tmp) / p.name
        with open(p, "rb") as src, open(copy, "wb") as dst:
            for _, line in _bounded_lines(src, p):
                dst.write(line)
        yield copy


def scan_trace(path: str | os.PathLike[str], advance: Progress | None = None) -> TraceIndex:
    """First pass: check every line (FmoeError naming the first bad one) and index the sequences."""
    p = Path(path)
    parser = _Parser(p)
    order: dict[SeqId, int] = {}
    last_line: dict[SeqId, int] = {}
    layers: set[int] = set()
    max_expert, size = 0, 0
    for lineno, line in _lines(p, advance):
        size += len(line)
        rec = parser.line(lineno, line)
        if rec is None:
            continue
        order.setdefault(rec.seq, len(order))
        last_line[rec.seq] = lineno
        layers.add(rec.layer)
        max_expert = max(max_expert, max(rec.experts), *(rec.predicted or ()))
    if not parser.records:
        raise FmoeError(f"trace {p} holds no routing records")
    parser.finish()
    header = parser.header
    if "num_layers" in header:
        layers.update(range(header["num_layers"]))
    num_experts = header.get("num_experts") or max_expert + 1
    return TraceIndex(p, parser.fmt or "fmoe", header, tuple(sorted(layers)), num_experts, order, last_line,
                      parser.records, size)


def iter_sequences(index: TraceIndex, advance: Progress | None = None) -> Iterator[tuple[int, SequenceTrace | None, int]]:
    """Second pass: (position, sequence of its complete tokens or None, incomplete tokens skipped) for every
    sequence, as soon as its last line is read: only the sequences still open are held in memory."""
    parser = _Parser(index.path)
    layer_order = index.layers
    open_: dict[SeqId, dict[int, dict[int, tuple[int, TraceRecord]]]] = {}  # seq -> token -> layer -> (line, rec)
    for lineno, line in _lines(index.path, advance):
        r = parser.line(lineno, line)
        if r is None:
            continue
        layers = open_.setdefault(r.seq, {}).setdefault(r.token, {})
        if r.layer in layers:
            raise FmoeError(
                f"{index.path}:{lineno}: bad trace line: sequence {_show(r.seq)} token {r.token} layer {r.layer} "
                f"already recorded on line {layers[r.layer][0]}"
            )
        layers[r.layer] = (lineno, r)
        if lineno == index.last_line[r.seq]:
            tokens = open_.pop(r.seq)
            kept = [t for t in sorted(tokens) if len(tokens[t]) == len(layer_order)]
            seq = None
            if kept:
                recs = tuple(tuple(tokens[t][layer][1] for t in kept) for layer in layer_order)
                seq = SequenceTrace(r.seq, tuple(kept), recs)
            yield index.order[r.seq], seq, len(tokens) - len(kept)


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read an fmoe or vLLM trace, keeping complete tokens only (all of it in memory: `fmoe replay`
    streams with scan_trace and iter_sequences instead)."""
    found, skipped = [], 0
    with seekable(path) as p:
        index = scan_trace(p)
        for pos, seq, skip in iter_sequences(index):
            skipped += skip
            if seq is not None:
                found.append((pos, seq))
    found.sort(key=lambda x: x[0])
    if not found:
        raise FmoeError(f"trace {index.path} has no complete token (one with all {len(index.layers)} layers)")
    return Trace(str(path), index.format, index.layers, index.num_experts, tuple(seq for _, seq in found), skipped)
