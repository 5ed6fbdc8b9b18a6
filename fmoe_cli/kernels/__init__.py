"""CPU expert kernels: one pass over a neuron-major segment, every storage format (issue 21 §1).

A segment is n neuron rows, each (gate row, up row, down column) of H weights (offload/layout.py),
stored as float32, bf16 or quantised bytes (offload/quant.py). `segment_forward` computes its partial
expert output for tokens x [T, H] without materialising a dequantised weight: experts.c widens or
unpacks each weight in registers as it streams the segment once (its docstring has the formulas).

Exactness: the neurons go in chunks of C (the model's neuron block, the granularity of every split
point): each chunk's partial sum starts from zero and adds its neurons in order, and the chunks are
added into a float32 accumulator in order. So a segment split at a multiple of C sums to the same bits
as the whole when the second part continues the first one's accumulator (`acc`): the engine's top +
bottom equals its whole expert, and every policy gives the resident run's tokens. Nothing depends on
the thread count.

`segments_forward` computes several segments for the same tokens in one call (a decode step's activated experts:
one wake of the kernels' threads, one ctypes call), each with the bits segment_forward gives it alone;
`experts_forward` several segments each for its own tokens (a prefill's experts), likewise.

`linear_forward` computes one dense projection y = x·ŵᵀ from a `--dense int8|int4` linear's rows (a row is one
projection of the experts' layout: models/dense.py). With `--activations int8` (Spec.int8_activations) the int8
and int4 rows' dot products over x use x quantised per block of 32 and integer arithmetic (experts.c § phase 1
with int8 activations: faster, within the tolerance docs/quantization.md states), and so does the down projection
where its rows are grouped along the neurons (Spec.code + DOWN_BY_NEURON: the gated activations quantised per group
of 32 neurons, experts.c § down by neuron); the split stays exact, since x̂ depends on x alone and â on its group.

The device path (torch on a GPU) and the CPU path call the stores' segment_forward, which comes here on
the CPU (x on the CPU, float32 or bf16, a SiLU-gated expert) and otherwise computes with torch. The
kernels compile on first use (kernels/build.py, a few seconds); without a C compiler, or with
FMOE_KERNELS=torch, experts compute with torch and one line says so. ctypes releases the GIL for the
call, so a host lane in another Python thread runs while the kernel does.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from dataclasses import dataclass

import torch

from fmoe_cli.errors import warn
from fmoe_cli.types import DEFAULT_ACTIVATIONS, DOWN_GROUP, EXPERT_FORMATS, QuantFormat

FORMAT_CODES = {torch.float32: 0, torch.bfloat16: 1, "int8": 2, "int4": 3, "int2": 4}  # experts.c's enum
DOWN_BY_NEURON = 16  # added to an int8/int4 code: the down rows are grouped along the neurons (experts.c FMT_DOWN_BY_NEURON)
COMPUTE_DTYPES = (torch.float32, torch.bfloat16)  # what x may be (experts.c: float32 or bf16 activations)
# Tokens of one expert (or one dense linear's call) above which torch's matmuls on dequantised blocks compute
# instead: the kernels' register tiles (T > 4) cost no more CPU than torch up to 64 tokens (benchmarks/kernels.py
# --tokens 16 64, docs/bench.md § CPU expert kernels); past 128 the tokens no longer stay in L2 while a row block
# is dotted with them (measured no further).
MAX_TOKENS = 128
MAX_HEAD_DIM = 1024  # decode.c's MAX_DIM: the widest attention head it takes
# A call's bytes of rows × tokens below which its chunks run on the calling thread alone: waking the pool's helper
# costs more than it saves there (docs/bench.md § Threads for small calls: the demo's calls, 65–590 KB, 12–17 % a
# token faster on one thread; experts.c's own floor is 65,536 weights × tokens).
THREADS_MIN_BYTES = 1 << 20


def threads_for(nbytes: int) -> int:
    """The threads a kernel call over `nbytes` of rows × tokens runs on: torch's intra-op count, or one below
    THREADS_MIN_BYTES (no bit depends on it)."""
    return torch.get_num_threads() if nbytes >= THREADS_MIN_BYTES else 1


class _OneThread:
    """`one_thread`'s block (models/attention.py, models/decoder.py, offload/link.py `device_copy`): a plain context
    manager (a generator-based one costs a few µs more a use, and the decode forwards use two a layer)."""

    __slots__ = ("threads",)

    def __enter__(self) -> None:
        self.threads = torch.get_num_threads()
        if self.threads != 1:
            torch.set_num_threads(1)

    def __exit__(self, *exc) -> bool:
        if self.threads != 1:
            torch.set_num_threads(self.threads)
        return False


def one_thread() -> _OneThread:
    """torch's intra-op threads set to one for the block, then back (a pair of calls costs < 1 µs)."""
    return _OneThread()


@dataclass(frozen=True)
class Spec:
    """What experts.c needs to know about one store's rows."""

    code: int  # FORMAT_CODES (+ DOWN_BY_NEURON)
    hidden: int  # H
    projection_bytes: int  # one projection row: H·itemsize, or the quantised codes + metadata
    group: int = 0  # G (quantised)
    meta_group: int = 0  # M (int2: scales per 8-bit scale group)
    chunk: int = 1  # C: neurons summed apart, then added in order (every split point is a multiple of C)
    int8_activations: bool = False  # --activations int8: x quantised per block of 32, integer dots (int8, int4)


def spec_of(experts: str, dtype: torch.dtype, hidden: int, chunk: int = 1,
            activations: str = DEFAULT_ACTIVATIONS, down_by_neuron: bool = False) -> Spec | None:
    """The Spec for rows of `dtype` (unquantised) or of the quantised format `experts`; None: not served here.
    chunk: the granularity of the splits the segments will see (ExpertShape.neuron_block); down_by_neuron: the
    down rows are grouped along the neurons (ExpertShape.down_by_neuron: chunk a multiple of DOWN_GROUP)."""
    fmt = EXPERT_FORMATS.get(experts)
    if fmt is None:
        code = FORMAT_CODES.get(dtype)
        return None if code is None else Spec(code, hidden, hidden * dtype.itemsize, chunk=chunk)
    return quant_spec(fmt, hidden, chunk, activations, down_by_neuron)


def quant_spec(fmt: QuantFormat, hidden: int, chunk: int = 1, activations: str = DEFAULT_ACTIVATIONS,
               down_by_neuron: bool = False) -> Spec:
    """The Spec for rows of H = `hidden` weights quantised in `fmt` (--activations: types.ACTIVATIONS)."""
    groups = hidden // fmt.group_size(hidden)
    assert not down_by_neuron or chunk % DOWN_GROUP == 0, (chunk, "a split would cut a down group")
    return Spec(FORMAT_CODES[f"int{fmt.bits}"] + (DOWN_BY_NEURON if down_by_neuron else 0), hidden,
                fmt.projection_bytes(hidden), fmt.group_size(hidden), fmt.meta_group_size(groups) if fmt.meta_group else 0,
                chunk, activations == "int8")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (FMOE_KERNELS=torch, or they cannot be built: said once)."""
    if os.environ.get("FMOE_KERNELS", "").strip().lower() == "torch":
        return None
    from fmoe_cli.kernels.build import build

    try:
        lib = build()
    except Exception as exc:  # no compiler, a failed compile, a library that does not load: torch computes
        warn(f"the CPU expert kernels are not available ({exc}); experts compute with torch (slower)")
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.fmoe_segment_forward.argtypes = [ctypes.c_int, ptr, i64, i64, i64, i64, i64, i64, ptr, ctypes.c_int, i64, ptr,
                                         ctypes.c_int, ptr, ctypes.c_int, ctypes.c_int]
    lib.fmoe_segment_forward.restype = ctypes.c_int
    lib.fmoe_segments_forward.argtypes = [ctypes.c_int, i64, ptr, ptr, i64, i64, i64, i64, i64, ptr, ctypes.c_int, i64,
                                          ptr, ptr, ctypes.c_int, ctypes.c_int]
    lib.fmoe_segments_forward.restype = ctypes.c_int
    lib.fmoe_experts_forward.argtypes = [ctypes.c_int, i64, ptr, ptr, i64, i64, i64, i64, i64, ptr, ctypes.c_int, ptr,
                                         ptr, ptr, ptr, ctypes.c_int, ctypes.c_int]
    lib.fmoe_experts_forward.restype = ctypes.c_int
    lib.fmoe_linear_forward.argtypes = [ctypes.c_int, ptr, i64, i64, i64, i64, i64, ptr, ctypes.c_int, i64, ptr,
                                        ctypes.c_int, ctypes.c_int]
    lib.fmoe_linear_forward.restype = ctypes.c_int
    f32 = ctypes.c_float
    lib.fmoe_add_rms_norm.argtypes = [ptr, ptr, i64, ptr, f32, ptr, ptr]
    lib.fmoe_add_rms_norm.restype = None
    lib.fmoe_attention_decode.argtypes = [ptr, i64, i64, i64, ptr, f32, ptr, ptr, ptr, ptr, i64, i64, f32, ptr]
    lib.fmoe_attention_decode.restype = ctypes.c_int
    lib.fmoe_router_decode.argtypes = [ptr, ptr, i64, i64, i64, ctypes.c_int, ptr, ptr, ptr]
    lib.fmoe_router_decode.restype = ctypes.c_int
    lib.fmoe_combine_decode.argtypes = [ptr, ptr, i64, i64, ptr]
    lib.fmoe_combine_decode.restype = None
    lib.fmoe_combine_prefill.argtypes = [i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
    lib.fmoe_combine_prefill.restype = None
    lib.fmoe_add_rms_norm_bf16.argtypes = lib.fmoe_add_rms_norm.argtypes
    lib.fmoe_add_rms_norm_bf16.restype = None
    lib.fmoe_attention_decode_bf16.argtypes = lib.fmoe_attention_decode.argtypes
    lib.fmoe_attention_decode_bf16.restype = ctypes.c_int
    lib.fmoe_attention_prefill.argtypes = [ptr, i64, i64, i64, i64, ptr, f32, ptr, ptr, ptr, ptr, i64, i64, f32, ptr]
    lib.fmoe_attention_prefill.restype = ctypes.c_int
    lib.fmoe_attention_prefill_bf16.argtypes = lib.fmoe_attention_prefill.argtypes
    lib.fmoe_attention_prefill_bf16.restype = ctypes.c_int
    lib.fmoe_decode_token.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr]  # models/token.py
    lib.fmoe_decode_token.restype = ctypes.c_int
    lib.fmoe_decode_token_bf16.argtypes = lib.fmoe_decode_token.argtypes
    lib.fmoe_decode_token_bf16.restype = ctypes.c_int
    lib.fmoe_simd.restype = ctypes.c_int
    # tests only, with ctypes' default int arguments and result (undeclared, so that benchmarks/prefill_kernels.py
    # configures an older build without them): fmoe_int8_dots() 0 scalar, 1 AVX2, 2 AVX-VNNI, 3 AVX-512 VNNI;
    # fmoe_prefill_tiles(0 or 1) the prefill tiles off or on
    lib.fmoe_pool_chunks_run.restype = ctypes.c_int64
    return lib


@contextlib.contextmanager
def off():
    """Within it, every expert and dense row computed as on a GPU: torch's matmuls, not these kernels (the device's
    code path on the CPU: tests/test_exactness.py's `cuda` link, benchmarks/families_survey.py)."""
    global library
    real = library
    library = lambda: None  # noqa: E731 - read as kernels.library() everywhere
    try:
        yield
    finally:
        library = real


def is_silu(act) -> bool:
    return act is torch.nn.functional.silu or type(act).__name__ in ("SiLU", "SiLUActivation")


def takes(x: torch.Tensor) -> bool:
    """Whether the kernels compute for these tokens x [T, H] (else: torch): on the CPU, float32 or bf16,
    at most MAX_TOKENS of them."""
    return (x.device.type == "cpu" and x.dtype in COMPUTE_DTYPES and x.shape[0] <= MAX_TOKENS
            and library() is not None)


def runs(x: torch.Tensor, act) -> bool:
    """Whether segment_forward computes for these tokens and this activation (else: torch). The same for
    every policy (it depends on the expert's tokens, not on where its rows are), so a policy's split
    experts take the same path as the resident run's whole ones."""
    return is_silu(act) and takes(x)


def check(status: int) -> None:
    """An expert kernel's status: 0 fine, -1 out of memory, -2 a segment that cuts a down group (a caller's bug)."""
    if status == -2:
        raise ValueError("a segment of down-by-neuron rows must be whole groups of DOWN_GROUP neurons")
    if status != 0:
        raise MemoryError("the expert kernel could not allocate its workspace")


def segment_forward(x: torch.Tensor, segment: torch.Tensor, spec: Spec, acc: torch.Tensor | None = None,
                    partial: bool = False) -> torch.Tensor:
    """Partial output of the neurons of `segment` ([n, 3, row] contiguous, on the CPU) for x [T, H].

    acc: a float32 [T, H] partial result of the neurons before this segment, continued in place (the
    split-exact sum). partial: return the float32 accumulator (to continue); else the result in x's
    dtype (bf16: the float32 sum rounded once)."""
    lib = library()
    x = x.contiguous()
    tokens, hidden = x.shape
    assert hidden == spec.hidden and segment.is_contiguous() and segment.device.type == "cpu"
    accumulate = acc is not None
    if acc is None:
        acc = torch.empty(tokens, hidden, dtype=torch.float32)
    assert acc.dtype == torch.float32 and acc.is_contiguous() and acc.shape == (tokens, hidden)
    rounded = None if partial or x.dtype == torch.float32 else torch.empty(tokens, hidden, dtype=x.dtype)
    status = lib.fmoe_segment_forward(
        spec.code, segment.data_ptr(), segment.shape[0], hidden, spec.projection_bytes, spec.group,
        spec.meta_group, spec.chunk, x.data_ptr(), int(x.dtype == torch.bfloat16), tokens, acc.data_ptr(),
        int(accumulate), None if rounded is None else rounded.data_ptr(),
        threads_for(3 * segment.shape[0] * spec.projection_bytes * tokens), int(spec.int8_activations))
    check(status)
    return acc if rounded is None else rounded


def segments_forward(x: torch.Tensor, segments: list[torch.Tensor], spec: Spec, partial: bool = False,
                     stacked: bool = False):
    """`segment_forward(x, segment, spec, partial=partial)` of each segment, for the same tokens x, in one call (a
    layer's activated experts at a decode step: one wake of the kernels' threads, one ctypes call, instead of one
    each). Each result has the bits segment_forward gives it alone (experts.c fmoe_segments_forward). A list of
    them; `stacked`: one tensor [n, T·H] of them in order (no op to split it)."""
    x = x.contiguous()
    tokens, hidden = x.shape
    assert hidden == spec.hidden
    assert all(s.is_contiguous() and s.device.type == "cpu" for s in segments)
    count = len(segments)
    shape = (count, tokens * hidden) if stacked else (count, tokens, hidden)
    acc = torch.empty(shape, dtype=torch.float32)
    rounded = None if partial or x.dtype == torch.float32 else torch.empty(shape, dtype=x.dtype)
    pointers = (ctypes.c_void_p * count)(*[s.data_ptr() for s in segments])
    counts = [s.shape[0] for s in segments]
    neurons = (ctypes.c_int64 * count)(*counts)
    status = library().fmoe_segments_forward(
        spec.code, count, pointers, neurons, hidden, spec.projection_bytes, spec.group, spec.meta_group, spec.chunk,
        x.data_ptr(), int(x.dtype == torch.bfloat16), tokens, acc.data_ptr(),
        None if rounded is None else rounded.data_ptr(), threads_for(3 * sum(counts) * spec.projection_bytes * tokens),
        int(spec.int8_activations))
    check(status)
    out = acc if rounded is None else rounded
    return out if stacked else list(out.unbind(0))


def experts_forward(xs: list[torch.Tensor], segments: list[torch.Tensor], spec: Spec, partial: bool = False) -> list:
    """`segment_forward(x, segment, spec, partial=partial)` of each (x, segment) pair, each with its own tokens (a
    prefill's experts), in one call: the threads take whole experts, the largest first, each computed as its own call
    computes it (experts.c fmoe_experts_forward: the same bits), one ctypes call and one wake of the threads for all."""
    xs = [x.contiguous() for x in xs]
    dtype, hidden, count = xs[0].dtype, spec.hidden, len(segments)
    assert all(x.dtype == dtype and x.shape[1] == hidden for x in xs) and len(xs) == count
    assert all(s.is_contiguous() and s.device.type == "cpu" for s in segments)
    sizes = [x.shape[0] for x in xs]
    acc = torch.empty(sum(sizes), hidden, dtype=torch.float32)
    rounded = None if partial or dtype == torch.float32 else torch.empty(sum(sizes), hidden, dtype=dtype)
    starts, at = [], 0
    for size in sizes:
        starts.append(at)
        at += size
    pointers = ctypes.c_void_p * count
    accs = pointers(*[acc.data_ptr() + start * hidden * 4 for start in starts])
    outs = None if rounded is None else pointers(*[rounded.data_ptr() + start * hidden * rounded.element_size()
                                                   for start in starts])
    order = sorted(range(count), key=lambda e: -sizes[e])  # the largest first: the threads' shares even out
    counts = ctypes.c_int64 * count
    status = library().fmoe_experts_forward(
        spec.code, count, pointers(*[s.data_ptr() for s in segments]), counts(*[s.shape[0] for s in segments]), hidden,
        spec.projection_bytes, spec.group, spec.meta_group, spec.chunk, pointers(*[x.data_ptr() for x in xs]),
        int(dtype == torch.bfloat16), counts(*sizes), accs, outs, counts(*order),
        threads_for(sum(3 * s.shape[0] * spec.projection_bytes * size for s, size in zip(segments, sizes))),
        int(spec.int8_activations))
    check(status)
    return list((acc if rounded is None else rounded).split(sizes))


def linear_forward(x: torch.Tensor, rows: torch.Tensor, spec: Spec) -> torch.Tensor:
    """y [T, O] float32 = x [T, H] · ŵᵀ for `rows` [O, projection_bytes] (a dense linear's rows, each one
    projection of the experts' formats: models/dense.py), without materialising ŵ. Each output is one
    row's dot product, so no bit depends on the thread count."""
    x = x.contiguous()
    tokens, hidden = x.shape
    assert hidden == spec.hidden and rows.is_contiguous() and rows.device.type == "cpu"
    y = torch.empty(tokens, rows.shape[0], dtype=torch.float32)
    status = library().fmoe_linear_forward(
        spec.code, rows.data_ptr(), rows.shape[0], hidden, spec.projection_bytes, spec.group, spec.meta_group,
        x.data_ptr(), int(x.dtype == torch.bfloat16), tokens, y.data_ptr(),
        threads_for(rows.shape[0] * spec.projection_bytes * tokens), int(spec.int8_activations))
    if status != 0:
        raise MemoryError("the linear kernel could not allocate its workspace")
    return y


# --- a decode token's steps between the weights (decode.c), float32 or bf16 compute -------------------------------


def decode_steps_in_c() -> bool:
    """Whether a float32 or bf16 decode token's norms and attention steps run in C (models/attention.py and
    decoder.py ask once a module, when they install its decode forward): wherever the kernels are built. Their bits
    are decode.c's, not torch's (tests give the torch steps transformers' bits by turning this off)."""
    return library() is not None


def _decode_function(name: str, dtype: torch.dtype):
    """decode.c's function `name` for rows of `dtype` (float32: its own; bf16: name_bf16)."""
    return getattr(library(), name if dtype == torch.float32 else name + "_bf16")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, add: torch.Tensor | None = None):
    """RMSNorm of one float32 or bf16 row x [..., n] (decode.c's formula: `weight · (x · r)`, r = 1/sqrt(mean(x²) +
    ε), the mean summed in its own order; bf16: x · r and the product rounded to bf16 as transformers' steps are), of
    x + add where `add` is given. Returns (x + add or None, the norm), each shaped as x. x, add and weight: of one
    dtype, contiguous, n values each."""
    n = x.shape[-1]
    out = torch.empty_like(x)
    total = None if add is None else torch.empty_like(x)
    _decode_function("fmoe_add_rms_norm", x.dtype)(
        x.data_ptr(), None if add is None else add.data_ptr(), n, weight.data_ptr(), eps,
        None if total is None else total.data_ptr(), out.data_ptr())
    return total, out


def attention_decode(qkv: torch.Tensor, heads_q: int, heads_k: int, dim: int, qk_weight: torch.Tensor | None,
                     eps: float, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     position: int, scale: float) -> torch.Tensor:
    """One float32 or bf16 decode token's attention (decode.c fmoe_attention_decode, _bf16: every tensor of qkv's
    dtype): qkv [1, (Hq + 2·Hk)·D] (overwritten: its q and k normed by qk_weight [Hq + Hk, D] if given, and rotated
    by cos, sin [D]); its k and v written into the cache's buffers keys, values [1, Hk, capacity, D] at `position`;
    the heads' outputs over positions [0, position], [1, Hq·D]."""
    out = torch.empty(1, heads_q * dim, dtype=qkv.dtype)
    status = _decode_function("fmoe_attention_decode", qkv.dtype)(
        qkv.data_ptr(), heads_q, heads_k, dim, None if qk_weight is None else qk_weight.data_ptr(), eps,
        cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.shape[-2], position, scale,
        out.data_ptr())
    if status != 0:
        raise MemoryError("the attention kernel could not allocate its scores")
    return out


def attention_prefill(qkv: torch.Tensor, heads_q: int, heads_k: int, dim: int, qk_weight: torch.Tensor | None,
                      eps: float, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      position: int, scale: float) -> torch.Tensor:
    """A prefill's T float32 or bf16 tokens' attention (decode.c fmoe_attention_prefill, _bf16): token t as
    `attention_decode` computes it at position `position + t` (causal), the same bits as T decode steps. qkv
    [T, (Hq + 2·Hk)·D] (overwritten), cos and sin [T, D]; their k and v written into keys, values [1, Hk, capacity, D]
    at positions [position, position + T); the heads' outputs [T, Hq·D]."""
    tokens = qkv.shape[0]
    out = torch.empty(tokens, heads_q * dim, dtype=qkv.dtype)
    status = _decode_function("fmoe_attention_prefill", qkv.dtype)(
        qkv.data_ptr(), tokens, heads_q, heads_k, dim, None if qk_weight is None else qk_weight.data_ptr(), eps,
        cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.shape[-2], position, scale,
        out.data_ptr())
    if status != 0:
        raise MemoryError("the attention kernel could not allocate its scores")
    return out


def router_decode(x: torch.Tensor, weight: torch.Tensor, top_k: int, normalise: bool):
    """One float32 token's router (decode.c fmoe_router_decode): x [1, H], weight [E, H] -> (logits [1, E], the top-k
    softmax weights [1, K] (normalised to sum 1 where `normalise`), their experts [1, K] int64, highest first)."""
    experts, hidden = weight.shape
    logits = torch.empty(1, experts, dtype=torch.float32)
    weights = torch.empty(1, top_k, dtype=torch.float32)
    index = torch.empty(1, top_k, dtype=torch.int64)
    status = library().fmoe_router_decode(x.data_ptr(), weight.data_ptr(), experts, hidden, top_k, int(normalise),
                                          logits.data_ptr(), weights.data_ptr(), index.data_ptr())
    if status == -2:
        raise ValueError(f"top-{top_k} of {experts} experts")
    if status != 0:
        raise MemoryError("the router kernel could not allocate its softmax")
    return logits, weights, index


def combine_decode(outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_k w_k · y_k of one float32 token's K expert outputs [K, H] (routing order) with its weights [1, K] -> [1, H]
    (decode.c fmoe_combine_decode: torch's `(y · wᵀ).sum(0)` order)."""
    k, hidden = outputs.shape
    out = torch.empty(1, hidden, dtype=torch.float32)
    library().fmoe_combine_decode(outputs.data_ptr(), weights.data_ptr(), k, hidden, out.data_ptr())
    return out


def combine_prefill(outputs: dict, ids: torch.Tensor, rows: torch.Tensor, starts: dict, weights: torch.Tensor):
    """Σ_k w_tk · y_tk of T float32 tokens [T, H] (experts.c fmoe_combine_prefill: each token as combine_decode sums
    it, the tokens on the kernels' threads), read where the experts left their rows: `outputs` expert -> its rows
    [T_e, H] (contiguous, tokens ascending), `ids` [T, K] the routed experts, `rows` [T·K] each slot's row in expert
    order, `starts` expert -> the row in expert order of its first, `weights` [T, K] float32."""
    tokens, k = ids.shape
    hidden = next(iter(outputs.values())).shape[-1]
    size = max(outputs) + 1
    assert all(y.dtype == torch.float32 and y.is_contiguous() and y.device.type == "cpu" for y in outputs.values())
    bases = (ctypes.c_void_p * size)(*[outputs[e].data_ptr() if e in outputs else None for e in range(size)])
    first = (ctypes.c_int64 * size)(*[starts.get(e, 0) for e in range(size)])
    ids, rows, weights = ids.contiguous(), rows.contiguous(), weights.contiguous()
    assert ids.dtype == rows.dtype == torch.int64 and weights.dtype == torch.float32 and rows.numel() == tokens * k
    out = torch.empty(tokens, hidden, dtype=torch.float32)
    library().fmoe_combine_prefill(tokens, k, hidden, ids.data_ptr(), rows.data_ptr(), bases, first,
                                   weights.data_ptr(), out.data_ptr(), threads_for(tokens * k * hidden * 4))
    return out
