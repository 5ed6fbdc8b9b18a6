"""The CPU expert kernels (fmoe_cli/kernels): the values of torch's path for every format, the split-exact
sum (a top continued by its bottom gives the whole's bits, whatever the thread count), the engine's
policies giving the resident run's logits bit for bit, the fallback to torch, the compile cache, and the
GIL released while a kernel runs (a host lane computes beside the main thread)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from fmoe_cli import kernels
from fmoe_cli.offload import layout, quant
from fmoe_cli.types import EXPERT_FORMATS, ExpertShape

FORMATS = ["f32", "bf16", "int8", "int4", "int2"]

needs_kernels = pytest.mark.skipif(kernels.library() is None, reason="no C compiler: the torch path only")


def expert(name: str, hidden: int, intermediate: int, seed: int = 0, chunk: int = 1, dtype=None,
           activations: str = "float", by_neuron: bool = False):
    """(stored rows, the weights they stand for [n, 3, H] float32, Spec, compute dtype); dtype: the compute
    dtype of quantised rows (default float32); activations: --activations of quantised rows; by_neuron: int8/int4
    down rows grouped along the neurons (ExpertShape.down_by_neuron, the stores' layout where I and G allow it)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(intermediate, 3, hidden, generator=g) * 0.05
    fmt = EXPERT_FORMATS.get(name)
    if fmt is None:
        dtype = torch.bfloat16 if name == "bf16" else torch.float32
        stored = w.to(dtype)
        return stored, stored.float(), kernels.spec_of("bf16", dtype, hidden, chunk), dtype
    stored = quant.quantize(w, fmt, by_neuron)
    spec = kernels.spec_of(name, None, hidden, chunk, activations, by_neuron)
    return stored, quant.dequantize(stored, fmt, hidden, torch.float32, down_by_neuron=by_neuron), spec, dtype or torch.float32


WITH_DTYPES = [("f32", None), ("bf16", None), *[(q, d) for q in ("int8", "int4", "int2")
                                                for d in (torch.float32, torch.bfloat16)]]


@needs_kernels
@pytest.mark.parametrize("name, dtype", WITH_DTYPES)
@pytest.mark.parametrize("hidden, intermediate", [(64, 64), (2048, 48), (96, 42)])  # 96: the scalar paths
# one token (decode's path); several (register tiles: 3, 6, and 13 with remainder tiles; hidden 96: ŵ decoded per row)
@pytest.mark.parametrize("tokens", [1, 3, 6, 13])
def test_the_kernel_computes_what_torch_computes(name, dtype, hidden, intermediate, tokens):
    """float32: the dequantised weights' result to rounding. bf16 activations: torch's bf16 ops on the
    weights rounded to bf16 (the kernels keep ŵ in float32: a bf16 rounding apart)."""
    # 42: chunks 32 (two blocks of the register tiles' 16 down rows), 10 (four, four, two neurons)
    stored, w, spec, dtype = expert(name, hidden, intermediate, dtype=dtype, chunk=32)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = kernels.segment_forward(x, stored, spec)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    if dtype == torch.float32:
        want = layout.segment_forward(x, w, F.silu)  # the dequantised weights in float32: rounding apart
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    else:  # torch's bf16 ops on the same weights, each op rounded to bf16
        want = layout.segment_forward(x, w.to(dtype), F.silu)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())
        if name == "bf16":  # the same weights and roundings: at most a unit in the last place apart
            assert (got.float() - want.float()).abs().max() <= want.abs().max() * 2**-7


@needs_kernels
@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inputs, outputs", [(2048, 200), (96, 70)])  # 96: the scalar paths
@pytest.mark.parametrize("tokens", [1, 5, 13])
def test_a_dense_projection_through_the_kernel_is_torchs_on_the_dequantised_weight(name, dtype, inputs, outputs,
                                                                                   tokens):
    """`--dense` on the CPU (models/dense.py QuantLinear): y = x·ŵᵀ + b from the packed rows, to rounding of
    torch's matmul on the dequantised weight; the same bits with 1 or 2 threads (each output one row's dot)."""
    from fmoe_cli.models.dense import QuantLinear

    torch.manual_seed(3)
    linear = torch.nn.Linear(inputs, outputs, bias=True).to(dtype)
    q = QuantLinear(linear, EXPERT_FORMATS[name])
    x = torch.randn(1, tokens, inputs).to(dtype)
    got = q(x)
    assert got.dtype == dtype and got.shape == (1, tokens, outputs)
    want = x.float() @ q.dequantized(dtype=torch.float32).T + linear.bias.float()
    scale = want.abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 2**-7  # bf16: the float32 result rounded once
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * scale)
    torch.testing.assert_close(q.torch_forward(x).float(), want, rtol=4 * tol, atol=4 * tol * scale)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(q(x), got)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("activations", ["float", "int8"])
def test_a_dense_projections_many_tokens_each_get_their_own_bits(name, activations):
    """From 8 tokens int8 and int4 rows take the tokens-in-lanes tiles (experts.c gemm_rows): each output one float32
    chain in input order, so a token's outputs are the same bits among any 8 or more tokens, with 1 or 2 threads,
    whatever tile of rows (6, then fewer; jobs of 32 rows: 70 = 32 + 32 + 6) or of tokens (16, then 8 in the lanes,
    the padding's lanes zero) it falls in; the values are torch's on the dequantised weight. --activations int8: from
    2 tokens dots_q8's tiles (two rows × 1-4 tokens; 70 rows: pairs only), each row and token rows_dot_q8's own
    operations, so the same holds from 2 tokens on, and a token among others has its bits alone (1 token: decode's
    path); the values are x̂'s."""
    from fmoe_cli.models.dense import QuantLinear

    torch.manual_seed(4)
    q = QuantLinear(torch.nn.Linear(2048, 71 if activations == "int8" else 70, bias=False), EXPERT_FORMATS[name],
                    activations)  # int8: 71, an odd row left after the pairs
    x = torch.randn(1, 29, 2048)
    whole = q(x)
    quantised = activations == "int8" and kernels.library().fmoe_simd() > 0
    want = (quantised_tokens(x[0]) if quantised else x) @ q.dequantized(dtype=torch.float32).T
    torch.testing.assert_close(whole, want.reshape(whole.shape), rtol=1e-5, atol=1e-5 * want.abs().max().item())
    spans = [(0, 8), (3, 9), (5, 16), (1, 17), (2, 24), (0, 29)]
    if activations == "int8":
        spans += [(0, 1), (7, 1), (4, 2), (9, 3), (11, 5)]
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for start, size in spans:
                part = q(x[:, start:start + size])
                assert torch.equal(part, whole[:, start:start + size]), f"tokens {start}..{start + size - 1}, {count}"
    finally:
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activations", ["float", "int8"])
@pytest.mark.parametrize("by_neuron", [False, True])
def test_the_prefill_tiles_give_the_token_by_token_paths_bits(name, dtype, activations, by_neuron):
    """A prefill's tiles (experts.c: with int8 activations the gate and up dots of dots_q8, AVX-512 VNNI or AVX2; down
    rows grouped along the neurons: by_neuron_tiles_chunk's gate, up and down tiles) against the same call with the
    tiles off (fmoe_prefill_tiles(0): every token's dots and down alone, the paths before the tiles): the same bits,
    for every tile shape and tail (13 and 7 tokens: tiles of 4, 4, 4, 1 and 4, 2, 1), each build (the narrower builds
    run this too). So the tiles change no token of any policy. int8 activations' dense rows too (kernels.linear_forward:
    pairs of rows × 1-4 tokens against each token's rows_dot_q8)."""
    from fmoe_cli.models.dense import QuantLinear

    library = kernels.library()
    stored, _, spec, dtype = expert(name, 2048, 96, chunk=32, dtype=dtype, activations=activations, by_neuron=by_neuron)
    if by_neuron:
        assert spec.code & kernels.DOWN_BY_NEURON
    torch.manual_seed(6)
    dense = QuantLinear(torch.nn.Linear(2048, 37, bias=False), EXPERT_FORMATS[name], activations)
    for tokens in (13, 7, 2):
        x = torch.randn(tokens, 2048, generator=torch.Generator().manual_seed(tokens)).to(dtype)
        tiled, tiled_rows = kernels.segment_forward(x, stored, spec), dense(x.float()[None])
        try:
            library.fmoe_prefill_tiles(0)
            alone, alone_rows = kernels.segment_forward(x, stored, spec), dense(x.float()[None])
        finally:
            library.fmoe_prefill_tiles(1)
        assert torch.equal(tiled, alone), f"{tokens} tokens: the tiles' bits are not the token-by-token paths'"
        assert torch.equal(tiled_rows, alone_rows), f"{tokens} tokens, dense rows"


def quantised_tokens(x: torch.Tensor) -> torch.Tensor:
    """x̂ of --activations int8 (experts.c quantize_x): per block of 32, d = max|x| / 127, x̂ = round(x / d)·d."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse) * d).reshape(x.shape)


def int8_activations_gated(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
    """The int8-activation mode's x̂ and gated activations a = silu(x̂·W_gateᵀ) ⊙ (x̂·W_upᵀ) for tokens x and the
    dequantised expert w [I, 3, H]; (None, None) on a CPU without AVX2, which runs the float32 dots (experts.c
    q8_shape): there `got` is checked against the float forward here."""
    if kernels.library().fmoe_simd() == 0:
        want = layout.segment_forward(x, w, F.silu)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        return None, None
    x_hat = quantised_tokens(x)
    return x_hat, F.silu(x_hat @ w[:, 0].T) * (x_hat @ w[:, 1].T)


@needs_kernels
@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("hidden", [2048, 128])
@pytest.mark.parametrize("tokens", [1, 3, 13])  # 3, 13 at H = 2048: experts.c dots_q8's tiles (4, 4, 4, 1 tokens)
def test_int8_activations_compute_the_quantised_tokens_result(name, hidden, tokens):
    """--activations int8: gate and up (and a dense row) multiply x̂, the tokens quantised per block of 32, with
    integer dot products; the down projection is float32. So the result is x̂'s through the dequantised
    weights, to float rounding; and it is not x's (the quantisation really happens)."""
    stored, w, spec, _ = expert(name, hidden, 48, activations="int8")
    assert spec.int8_activations
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(4))
    got = kernels.segment_forward(x, stored, spec)
    x_hat, a = int8_activations_gated(got, x, w)
    if a is None:
        return
    want = a @ w[:, 2]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert (got - layout.segment_forward(x, w, F.silu)).abs().max() > 1e-4 * want.abs().max()
    rows = stored[:, 0].contiguous()  # the gate rows as a dense linear's
    y = kernels.linear_forward(x, rows, spec)
    torch.testing.assert_close(y, x_hat @ w[:, 0].T, rtol=1e-5, atol=1e-5 * y.abs().max().item())


def quantised_groups(a: torch.Tensor) -> torch.Tensor:
    """â of the down projection's activations [T, I] in the int8 mode: quantised per group of 32 neurons as x is."""
    return quantised_tokens(a)


# Down rows grouped along the neurons (offload/quant.py quantize_down, experts.c § down by neuron): H = 2048 and 512
# take the vector paths (blocks of 16 hidden values a piece), 256 and 64 the scalar one (8 and 2 a piece).
BY_NEURON_SHAPES = [(2048, 64, 64), (512, 96, 32), (256, 96, 32), (64, 64, 32)]


@needs_kernels
@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden, intermediate, chunk", BY_NEURON_SHAPES)
@pytest.mark.parametrize("tokens", [1, 3])
def test_down_by_neuron_rows_computes_what_torch_computes(name, dtype, hidden, intermediate, chunk, tokens):
    """Float activations: the result of the dequantised weights (quantize_down's grouping) to float rounding."""
    stored, w, spec, dtype = expert(name, hidden, intermediate, chunk=chunk, dtype=dtype, by_neuron=True)
    assert spec.code & kernels.DOWN_BY_NEURON
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = kernels.segment_forward(x, stored, spec)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    want = layout.segment_forward(x, w if dtype == torch.float32 else w.to(dtype), F.silu)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance * want.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("hidden, intermediate, chunk", BY_NEURON_SHAPES)
@pytest.mark.parametrize("tokens", [1, 3, 13])  # 3, 13 at H = 2048: the prefill tiles (experts.c by_neuron_q8_chunk)
def test_down_by_neuron_int8_activations_compute_the_quantised_result(name, hidden, intermediate, chunk, tokens):
    """--activations int8 with down rows grouped along the neurons: gate and up multiply x̂ (x per block of 32), and
    the down projection multiplies â, the gated activations quantised per group of 32 neurons, with integer dots: the
    result is â·ŵ_down to float rounding; not a's (the second quantisation really happens)."""
    stored, w, spec, _ = expert(name, hidden, intermediate, chunk=chunk, activations="int8", by_neuron=True)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(4))
    got = kernels.segment_forward(x, stored, spec)
    _, a = int8_activations_gated(got, x, w)
    if a is None:
        return
    want = quantised_groups(a) @ w[:, 2]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert (got - a @ w[:, 2]).abs().max() > 1e-4 * want.abs().max()


@needs_kernels
@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activations", ["float", "int8"])
@pytest.mark.parametrize("hidden, intermediate, chunk", [(1024, 64, 32), (2048, 96, 32)])  # big's H; three groups
def test_down_by_neuron_prefill_gives_each_token_the_bits_it_gets_among_any_tokens(name, dtype, activations, hidden,
                                                                                    intermediate, chunk):
    """Down rows grouped along the neurons, several tokens (a prefill: with int8 activations on AVX-512 VNNI the tiles
    of experts.c by_neuron_q8_chunk, 1-4 tokens a gate/up tile, 1-8 a down tile): each token's outputs have the bits it
    gets among any other tokens, in any tile shape and position; with int8 activations also the bits it gets alone
    (decode's path), so a prefill and a decode of the same token agree. The values: test above."""
    stored, _, spec, dtype = expert(name, hidden, intermediate, chunk=chunk, dtype=dtype, activations=activations,
                                    by_neuron=True)
    x = torch.randn(13, hidden, generator=torch.Generator().manual_seed(5)).to(dtype)
    whole = kernels.segment_forward(x, stored, spec)
    for start, count in [(0, 2), (1, 3), (2, 4), (3, 5), (0, 6), (5, 7), (4, 8), (2, 9), (1, 12)]:
        part = kernels.segment_forward(x[start:start + count], stored, spec)
        assert torch.equal(part, whole[start:start + count]), f"tokens {start}..{start + count - 1} of 13"
    if activations == "int8":
        for t in range(13):
            assert torch.equal(kernels.segment_forward(x[t:t + 1], stored, spec), whole[t:t + 1]), f"token {t} alone"


@needs_kernels
@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activations", ["float", "int8"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_down_by_neuron_top_continued_by_its_bottom_gives_the_whole_bit_for_bit(name, dtype, activations, tokens):
    """Down rows grouped along the neurons, split at every multiple of the chunk (whole groups of 32), in one call
    or one each, with 1 or 2 threads: the whole's bits (every policy's tokens are the resident run's). A segment
    that would cut a group is refused."""
    for hidden, intermediate, chunk in [(2048, 256, 64), (256, 128, 32)]:
        stored, _, spec, dtype = expert(name, hidden, intermediate, chunk=chunk, dtype=dtype, activations=activations,
                                        by_neuron=True)
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
        whole = kernels.segment_forward(x, stored, spec)
        for k in range(chunk, intermediate, chunk):
            top = kernels.segment_forward(x, stored[:k], spec, partial=True)
            assert torch.equal(kernels.segment_forward(x, stored[k:], spec, acc=top), whole), f"split at {k}"
        together = kernels.segments_forward(x, [stored, stored[:chunk]], spec)
        assert torch.equal(together[0], whole)
        assert torch.equal(together[1], kernels.segment_forward(x, stored[:chunk], spec))
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(2)
            two = kernels.segment_forward(x, stored, spec)
            torch.set_num_threads(1)
            assert torch.equal(kernels.segment_forward(x, stored, spec), two)
        finally:
            torch.set_num_threads(threads)
        with pytest.raises(ValueError, match="whole groups"):
            kernels.segment_forward(x, stored[:16], replace(spec, chunk=16))


@needs_kernels
@pytest.mark.parametrize("name, dtype, activations", [(n, d, "float") for n, d in WITH_DTYPES]
                         + [(n, d, "int8") for n in ("int8", "int4") for d in (torch.float32, torch.bfloat16)])
def test_a_tokens_outputs_do_not_depend_on_the_tile_it_falls_in(name, dtype, activations):
    """Several tokens (T > 1: the register tiles; int8 and int4 at H = 2048, ŵ decoded in the tiles' registers,
    experts.c prefill_fused; with --activations int8 the integer dots of dots_q8, 1-4 tokens a tile) give each token
    the bits it gets among any other tokens: every output's operations are the same in every tile shape and position
    (the remainder tiles of 1-4 tokens for the dots, 1-5 for the down rows), so an expert's result for a token is a
    function of that token's x alone. A bit that depended on where a tile starts or how wide it is would fail here."""
    # chunks of 32 and 8: blocks of 16, 16, 8
    stored, w, spec, dtype = expert(name, 2048, 40, chunk=32, dtype=dtype, activations=activations)
    x = torch.randn(13, 2048, generator=torch.Generator().manual_seed(3)).to(dtype)
    whole = kernels.segment_forward(x, stored, spec)
    if dtype == torch.float32:  # the values too (the invariance alone would pass a kernel wrong in every tile alike)
        if activations == "int8" and kernels.library().fmoe_simd() > 0:
            x_hat = quantised_tokens(x)
            want = (F.silu(x_hat @ w[:, 0].T) * (x_hat @ w[:, 1].T)) @ w[:, 2]
        else:
            want = layout.segment_forward(x, w, F.silu)
        torch.testing.assert_close(whole, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    for start, count in [(0, 2), (1, 3), (2, 4), (3, 5), (0, 6), (5, 7), (4, 9), (1, 12)]:
        part = kernels.segment_forward(x[start:start + count], stored, spec)
        assert torch.equal(part, whole[start:start + count]), f"tokens {start}..{start + count - 1} of 13"


@needs_kernels
@pytest.mark.parametrize("name, dtype, activations", [(n, d, "float") for n, d in WITH_DTYPES]
                         + [(n, d, "int8") for n in ("int8", "int4") for d in (torch.float32, torch.bfloat16)])
# 1: decode's own path (experts.c pass_chunk_one); 3, 11: the register tiles (prefill_chunk)
@pytest.mark.parametrize("tokens", [1, 3, 11])
def test_a_top_continued_by_its_bottom_gives_the_whole_bit_for_bit(name, dtype, activations, tokens):
    """At every multiple of the chunk, and with 1 or 2 threads: what makes every policy's tokens the resident run's.
    With --activations int8 too: x̂ depends on x alone, so top and bottom quantise it alike. Chunks of 16 (whole
    groups of four neurons) and of 6 (four, then two alone)."""
    hidden = 128
    for intermediate, chunk in [(96, 16), (42, 6)]:
        stored, _, spec, dtype = expert(name, hidden, intermediate, chunk=chunk, dtype=dtype, activations=activations)
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
        whole = kernels.segment_forward(x, stored, spec)
        for k in range(chunk, intermediate, chunk):
            top = kernels.segment_forward(x, stored[:k], spec, partial=True)
            assert top.dtype == torch.float32
            split = kernels.segment_forward(x, stored[k:], spec, acc=top)
            assert torch.equal(split, whole), f"split at {k} of {intermediate} (chunk {chunk})"
    stored, _, spec, dtype = expert(name, 2048, 256, chunk=64, dtype=dtype, activations=activations)  # threads
    x = torch.randn(tokens, 2048).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = kernels.segment_forward(x, stored, spec)
        torch.set_num_threads(1)
        assert torch.equal(kernels.segment_forward(x, stored, spec), two)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("name, dtype, activations", [(n, d, "float") for n, d in WITH_DTYPES]
                         + [(n, torch.float32, "int8") for n in ("int8", "int4")])
@pytest.mark.parametrize("partial", [False, True])
def test_a_prefills_experts_in_one_call_give_each_experts_own_bits(name, dtype, activations, partial):
    """A prefill's experts, each with its own tokens (1 to 14 of them: the decode path, the register tiles), in one
    call (kernels.experts_forward, the threads taking whole experts): each output is bit for bit the expert's own
    call's, shapes and dtypes too, with 1 or 2 threads; partial: the float32 sums a bottom continues."""
    experts = [expert(name, 256, 48, seed=e, chunk=16, dtype=dtype, activations=activations) for e in range(5)]
    dtype = experts[0][3]
    segments, spec = [stored for stored, *_ in experts], experts[0][2]
    xs = [torch.randn(tokens, 256, generator=torch.Generator().manual_seed(10 + tokens)).to(dtype)
          for tokens in (3, 1, 14, 2, 7)]
    alone = [kernels.segment_forward(x, s, spec, partial=partial) for x, s in zip(xs, segments)]
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            got = kernels.experts_forward(xs, segments, spec, partial=partial)
            assert len(got) == len(alone)
            for e, (g, want) in enumerate(zip(got, alone)):
                assert g.dtype == want.dtype and g.shape == want.shape, e
                assert torch.equal(g, want), f"expert {e} ({xs[e].shape[0]} tokens), {count} threads"
    finally:
        torch.set_num_threads(threads)


@needs_kernels
def test_a_prefills_experts_go_to_the_kernels_in_one_call(monkeypatch):
    """The store's segments_forward sends experts with tokens of their own (a prefill) through kernels.experts_forward
    (one call), and the same tokens for all (a decode step) through kernels.segments_forward."""
    from fmoe_cli.offload.quant import QuantStore

    shape = ExpertShape(1, 4, 1, 256, 48, 4, "int4")
    store = QuantStore(shape, torch.float32, pin=False)
    segments = [expert("int4", 256, 48, seed=e, chunk=shape.neuron_block)[0] for e in range(3)]
    calls = []
    for entry in ("experts_forward", "segments_forward", "segment_forward"):
        real = getattr(kernels, entry)
        monkeypatch.setattr(kernels, entry,
                            lambda *a, real=real, entry=entry, **k: calls.append(entry) or real(*a, **k))
    xs = [torch.randn(t, 256) for t in (2, 5, 1)]
    store.segments_forward(xs, segments, F.silu)
    assert calls == ["experts_forward"]
    calls.clear()
    store.segments_forward([xs[2]] * 3, segments, F.silu)
    assert calls == ["segments_forward"]


@needs_kernels
@pytest.mark.parametrize("name, dtype, activations", [(n, d, "float") for n, d in WITH_DTYPES]
                         + [(n, torch.float32, "int8") for n in ("int8", "int4")])
@pytest.mark.parametrize("tokens", [1, 3])
def test_a_layers_experts_in_one_call_give_each_experts_own_bits(name, dtype, activations, tokens):
    """kernels.segments_forward (a decode step's activated experts, one kernel call): each expert's output (and
    partial accumulator) equals segment_forward's for it alone, bit for bit, segments of several sizes (whole
    experts, tops), with 1 or 2 threads; the store groups a decode step's experts that way."""
    stored, _, spec, dtype = expert(name, 2048, 256, chunk=64, dtype=dtype, activations=activations)
    others = [expert(name, 2048, 256, seed=s, chunk=64, dtype=dtype, activations=activations)[0] for s in (1, 2)]
    segments = [stored, others[0][:128], others[1], stored[:64]]
    x = torch.randn(tokens, 2048, generator=torch.Generator().manual_seed(5)).to(dtype)
    threads = torch.get_num_threads()
    try:
        for n in (2, 1):
            torch.set_num_threads(n)
            for partial in (False, True):
                alone = [kernels.segment_forward(x, s, spec, partial=partial) for s in segments]
                together = kernels.segments_forward(x, segments, spec, partial=partial)
                assert all(torch.equal(a, b) for a, b in zip(alone, together)), (n, partial)
        ones = replace(spec, chunk=1)  # chunks of one neuron: partials past experts.c's GROUP_PARTIAL_FLOATS, one call each
        alone = [kernels.segment_forward(x, s, ones) for s in segments]
        assert all(torch.equal(a, b) for a, b in zip(alone, kernels.segments_forward(x, segments, ones)))
    finally:
        torch.set_num_threads(threads)
    store = quant.make_store(ExpertShape(1, 4, 1, 2048, 256, 2, name if name not in ("f32", "bf16") else "bf16"),
                             dtype, pin=False, activations=activations)
    calls = []
    real = kernels.segments_forward
    try:
        kernels.segments_forward = lambda *a, **k: calls.append(1) or real(*a, **k)
        got = store.segments_forward([x] * len(segments), segments, F.silu)
    finally:
        kernels.segments_forward = real
    assert calls == [1] and all(torch.equal(a, store.segment_forward(x, s, F.silu)) for a, s in zip(got, segments))


@needs_kernels
@pytest.mark.parametrize("experts, dtype, activations", [("bf16", "float32", "float"), ("bf16", "bfloat16", "float"),
                                                         ("int4", "float32", "float"), ("int8", "bfloat16", "float"),
                                                         ("int4", "float32", "int8"), ("int8", "bfloat16", "int8")])
def test_every_policy_gives_the_resident_logits_bit_for_bit(checkpoints, experts, dtype, activations):
    """The engine on the CPU: a split policy's top hits (top + bottom) and misses (loaded whole) give the
    resident run's logits exactly, not only to rounding (with --activations int8: that mode's resident run)."""
    from fmoe_cli.generate import stream_generate
    from fmoe_cli.models.load import load_model
    from fmoe_cli.offload.engine import Engine
    from fmoe_cli.offload.link import EmulatedLink, VirtualClock
    from fmoe_cli.planning.presets import make_settings

    lm = load_model(str(checkpoints["qwen3_moe"]), device="cpu", dtype=dtype, experts=experts, activations=activations)
    assert lm.store.kernel.int8_activations == (activations == "int8")
    engine = Engine(lm.layers, lm.store, lm.shape, EmulatedLink(gbps=20, clock=VirtualClock(), copy=True),
                    lm.device, lm.dtype)
    engine.install(lm.model)
    shape = lm.shape
    prompt = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])
    results = {}
    try:
        for policy, theta in [("resident", None), ("uniform", 0.5), ("lru", None)]:
            budget = 2 * shape.top_k * shape.expert_bytes + shape.all_experts_bytes // 2
            engine.configure(make_settings(policy, shape, budget, theta=theta))
            tokens = [e.token_id for e in stream_generate(lm.model, prompt, engine=engine, max_new_tokens=6,
                                                          stop_on_eos=False)]
            with torch.no_grad():
                logits = lm.model(torch.cat([prompt, torch.tensor([tokens])], 1)).logits
            results[policy] = tokens, logits
            if policy == "uniform":
                assert engine.counters().hits_top > 0  # top + bottom really ran
    finally:
        engine.close()
    tokens, logits = results.pop("resident")
    for policy, (got_tokens, got_logits) in results.items():
        assert got_tokens == tokens and torch.equal(got_logits, logits), policy


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    """A tiny qwen3_moe of hidden 1024 (2 layers, 8 experts × 64 neurons): wide enough for the prefill tiles of down
    rows grouped along the neurons (experts.c by_neuron_tiles: H a multiple of 512; int8's H/G a multiple of 8)."""
    from fmoe_cli.models.demo import build_random_moe

    return build_random_moe(tmp_path_factory.mktemp("wide") / "qwen3_moe", family="qwen3_moe", seed=1,
                            hidden_size=1024, num_hidden_layers=2)


@needs_kernels
@pytest.mark.parametrize("experts, dtype, wide", [("int4", "float32", False), ("int8", "bfloat16", False),
                                                  ("int4", "bfloat16", False), ("int8", "float32", True),
                                                  ("int4", "float32", True)])
def test_int8_activations_keep_every_policy_on_the_resident_tokens_bit_for_bit(request, experts, dtype, wide):
    """--activations int8, the CPU's default beside int8/int4 experts (issue 39 §1): every preset policy (splits,
    misses loaded whole, prefetch, the host lane) gives that mode's resident run's tokens, and the logits of a prefill
    over them, bit for bit: x̂ depends on x alone, so a top and its bottom quantise the same tokens. The prompt
    routes more experts than the staging pool holds, so the prefill runs in waves. wide: hidden 1024, where a
    prefill's experts of several tokens run the down-by-neuron tiles (on AVX-512)."""
    from fmoe_cli.generate import stream_generate
    from fmoe_cli.models.load import load_model
    from fmoe_cli.offload.engine import Engine
    from fmoe_cli.offload.link import EmulatedLink, VirtualClock
    from fmoe_cli.planning.presets import PRESETS, make_settings
    from fmoe_cli.types import Timings

    if kernels.library().fmoe_simd() == 0:
        pytest.skip("no AVX2: --activations int8 runs the float dots here")
    checkpoint = (request.getfixturevalue("wide_checkpoint") if wide
                  else request.getfixturevalue("checkpoints")["qwen3_moe"])
    lm = load_model(str(checkpoint), device="cpu", dtype=dtype, experts=experts, activations="int8")
    assert lm.activations == "int8" and lm.store.kernel.int8_activations and lm.shape.down_by_neuron
    engine = Engine(lm.layers, lm.store, lm.shape, EmulatedLink(gbps=20, clock=VirtualClock(), copy=True),
                    lm.device, lm.dtype, host_threads=1)
    engine.install(lm.model)
    shape = lm.shape
    prompt = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11, 64, 128]])
    budget = 2 * shape.top_k * shape.expert_bytes + shape.all_experts_bytes // 3
    timings = Timings(t_att=1e-4, t_moe=2e-4, t_head=1e-4, t_load=3e-4, top_k=shape.top_k)  # as test_exactness
    results, split = {}, False
    try:
        for policy in ["resident"] + [p for p in PRESETS if p != "resident"]:
            for theta in ([0.25, 0.5] if policy == "uniform" else [None]):
                engine.configure(make_settings(policy, shape, budget, theta=theta, timings=timings))
                before = engine.counters().hits_top
                tokens = [e.token_id for e in stream_generate(lm.model, prompt, engine=engine, max_new_tokens=12,
                                                              stop_on_eos=False)]
                split |= engine.counters().hits_top > before
                with torch.no_grad():
                    logits = lm.model(torch.cat([prompt, torch.tensor([tokens])], 1)).logits
                results[policy, theta] = tokens, logits
    finally:
        engine.close()
    assert split  # a top + bottom ran somewhere
    tokens, logits = results.pop(("resident", None))
    for (policy, theta), (got_tokens, got_logits) in results.items():
        assert got_tokens == tokens, f"{policy} θ={theta}: tokens differ from the resident run's"
        assert torch.equal(got_logits, logits), f"{policy} θ={theta}: logits differ from the resident run's"


def test_without_the_kernels_the_stores_compute_with_torch(monkeypatch):
    """FMOE_KERNELS=torch (or no compiler): the torch path, the same values to rounding."""
    shape = ExpertShape(1, 2, 1, 64, 32, 4, "int4")
    store = quant.QuantStore(shape, torch.float32, pin=False)
    stored, w, _, _ = expert("int4", 64, 32)
    x = torch.randn(2, 64)
    with_kernels = store.segment_forward(x, stored, F.silu)
    monkeypatch.setenv("FMOE_KERNELS", "torch")
    kernels.library.cache_clear()
    try:
        assert kernels.library() is None and not kernels.runs(x, F.silu)
        calls = []
        real = quant.dequantize
        monkeypatch.setattr(quant, "dequantize", lambda *a, **k: calls.append(1) or real(*a, **k))
        torch_path = store.segment_forward(x, stored, F.silu)
        assert calls, "the torch path dequantises"
        torch.testing.assert_close(torch_path, with_kernels, rtol=1e-5, atol=1e-6)
    finally:
        monkeypatch.delenv("FMOE_KERNELS")
        kernels.library.cache_clear()


def test_a_failed_compile_falls_back_to_torch_in_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("FMOE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    kernels.library.cache_clear()
    try:
        assert kernels.library() is None
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("warning:") and "torch" in err[0], err
        assert kernels.library() is None and capsys.readouterr().err == ""  # said once
    finally:
        kernels.library.cache_clear()
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.so"))  # nothing half-written left


@needs_kernels
def test_the_library_is_compiled_once_and_cached(monkeypatch, tmp_path):
    """Three first uses at once in an empty cache: one compiles, the others wait on the lock and load its library.
    The compiler is the run's own build copied into place (every other kernel test runs what gcc made; here the lock
    and the cache are what is tested), and it returns only once the other two threads have come to the lock, as they
    do during a real compile of seconds: without the lock, or without the check after it, they would compile too."""
    import fcntl
    import shutil
    import types

    from fmoe_cli.kernels import build

    built = build.library_path(build.compiler())  # the run's library (needs_kernels built it)
    monkeypatch.setenv("FMOE_KERNEL_CACHE", str(tmp_path))
    at_lock, arrived = threading.Condition(), []
    real_flock = fcntl.flock

    def flock(*args):
        with at_lock:
            arrived.append(1)
            at_lock.notify_all()
        return real_flock(*args)

    def compiler(command, **_):
        with at_lock:  # this thread and the other two at the lock (a bound where they never come)
            at_lock.wait_for(lambda: len(arrived) >= 3, timeout=20)
        shutil.copyfile(built, command[command.index("-o") + 1])
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(fcntl, "flock", flock)
    monkeypatch.setattr(build, "subprocess", types.SimpleNamespace(run=compiler))
    compiles = []
    real = build._compile
    monkeypatch.setattr(build, "_compile", lambda *a: compiles.append(1) or real(*a))
    results = []
    workers = [threading.Thread(target=lambda: results.append(build.build())) for _ in range(3)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert len(results) == 3 and compiles == [1]  # concurrent first uses: one compile (the lock)
    build.build()
    assert compiles == [1] and len(list(tmp_path.glob("experts-*.so"))) == 1


@needs_kernels
def test_the_gil_is_released_while_a_kernel_runs():
    """A host lane (another Python thread) computes experts while the main thread runs Python."""
    import time

    stored, _, spec, dtype = expert("f32", 2048, 768)
    x = torch.randn(64, 2048)  # one call of ~0.1 s or more
    call = []
    done = threading.Event()

    def lane():
        start = time.perf_counter()
        kernels.segment_forward(x, stored, spec)
        call.extend([start, time.perf_counter()])
        done.set()

    stamps = []
    worker = threading.Thread(target=lane)
    worker.start()
    while not done.is_set():
        stamps.append(time.perf_counter())  # the main thread's turns
        time.sleep(0.001)
    worker.join()
    start, end = call
    quarter = (end - start) / 4
    # holding the GIL (ctypes.PyDLL) would give the main thread no turn in the middle of the call
    assert sum(start + quarter < t < end - quarter for t in stamps) >= 3, (end - start, len(stamps))


POOL_STRESS = """
import sys, torch
from torch import nn
from fmoe_cli import kernels
from fmoe_cli.models.dense import QuantLinear
from fmoe_cli.types import EXPERT_FORMATS
torch.set_num_threads(2)
lib = kernels.library()
x = torch.randn(1, 1024)
lines = [QuantLinear(nn.Linear(1024, o, bias=False), EXPERT_FORMATS["int8"]) for o in (64, 1024)]  # 2, 32 chunks
want = [q(x) for q in lines]
start = lib.fmoe_pool_chunks_run()
for _ in range(int(sys.argv[1])):
    for q, w in zip(lines, want):  # a job of 2 chunks, then one of 32: a stale helper of the first sees 32
        assert torch.equal(q(x), w)
print(lib.fmoe_pool_chunks_run() - start)
"""


@needs_kernels
def test_each_chunk_of_a_pool_job_runs_once_whatever_the_helpers_timing():
    """The kernels' thread pool (experts.c parallel_chunks): a helper descheduled between loading the ticket of a
    finished job and claiming from it must not claim a chunk of the next one (the race seen once as a SIGFPE: it ran
    a chunk with the next job's function or total and counted it into that job's `done`, so the caller could return
    before its output was complete). FMOE_POOL_STALL_NS widens both windows (the helper's, between its load and its
    claim; the caller's, between writing a job and opening it); with the job written while the old ticket is still
    up, about a third of these jobs gain a chunk run twice."""
    rounds = 150
    env = {**os.environ, "FMOE_POOL_STALL_NS": "20000", "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", POOL_STRESS, str(rounds)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) == rounds * (2 + 32)


@needs_kernels
def test_many_tokens_of_one_expert_go_to_torchs_matmuls(monkeypatch):
    """Above MAX_TOKENS (a very long prefill's expert) torch's matmuls compute: the store takes them, for every
    policy alike (the choice depends on the tokens only), with the same values to rounding."""
    from fmoe_cli.offload.store import HostStore

    shape = ExpertShape(1, 2, 1, 64, 32, 4)
    store = HostStore(shape, torch.float32, pin=False)
    stored, w, spec, _ = expert("f32", 64, 32)
    few, many = torch.randn(kernels.MAX_TOKENS, 64), torch.randn(kernels.MAX_TOKENS + 1, 64)
    assert kernels.runs(few, F.silu) and not kernels.runs(many, F.silu)
    calls = []
    monkeypatch.setattr(store, "torch_forward", lambda *a: calls.append(1) or HostStore.torch_forward(store, *a))
    store.segment_forward(few, stored, F.silu)
    assert calls == []
    out = store.segment_forward(many, stored, F.silu)
    assert calls == [1]
    torch.testing.assert_close(out, kernels.segment_forward(many, stored, spec), rtol=1e-5, atol=1e-6)


@needs_kernels
def test_the_benchmark_runs():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, str(root / "benchmarks" / "kernels.py"), "--hidden", "64",
                             "--intermediate", "64", "--rounds", "1", "--repeats", "1", "--pool-mb", "0.1",
                             "--tokens", "1", "2"], cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    for name in FORMATS:
        assert f"│ {name} " in result.stdout


@needs_kernels
@pytest.mark.parametrize("experts, max_logit_error, min_top1", [("int8", 1.0, 0.99), ("int4", 1.0, 0.99)])
def test_int8_activations_stay_within_the_published_tolerance(experts, max_logit_error, min_top1):
    """docs/quantization.md § --activations int8: the demo model on a KJV passage (tests/test_dense.py's), int8/int4
    experts and the default dense (int8 beside int8, int4 beside int4), against the same load with float activations (which is transformers' model
    on the dequantised weights to float rounding: tests/test_quant.py, tests/test_dense.py): the largest logit
    error and the top-1 agreement."""
    import transformers

    from fmoe_cli.models.demo import SHIPPED
    from fmoe_cli.models.load import load_model

    if kernels.library().fmoe_simd() == 0:
        pytest.skip("no AVX2: --activations int8 runs the float dots here (test_int8_activations_need_avx2)")
    from fmoe_cli.offload.engine import Engine
    from fmoe_cli.offload.link import EmulatedLink
    from fmoe_cli.planning.presets import make_settings
    from test_dense import KJV

    ids = transformers.AutoTokenizer.from_pretrained(SHIPPED)(KJV, return_tensors="pt")["input_ids"]
    logits = {}
    for activations in ("float", "int8"):
        lm = load_model("demo", device="cpu", dtype="float32", experts=experts, activations=activations)
        engine = Engine(lm.layers, lm.store, lm.shape, EmulatedLink(None), lm.device, lm.dtype)
        engine.install(lm.model)
        engine.configure(make_settings("resident", lm.shape, 0))
        with torch.no_grad():  # forwards of 32 tokens, as the tolerance was measured (docs/quantization.md)
            logits[activations] = torch.cat([lm.model(ids[:, start:start + 32]).logits[0]
                                             for start in range(0, ids.shape[1], 32)])
        engine.close()
    want, got = logits["float"], logits["int8"]
    error = (got - want).abs().max().item()
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert 0 < error <= max_logit_error and top1 >= min_top1, (error, top1)


@pytest.mark.parametrize("simd, warned", [(0, True), (1, False)])
def test_int8_activations_need_avx2_and_say_so_without_it(monkeypatch, capsys, simd, warned):
    """experts.c runs the int8-activation dots only with AVX2 (q8_shape); elsewhere the float dots run, and the
    load says so in one line instead of the mode silently not happening."""
    from fmoe_cli.models.load import warn_without_int8_dots

    class Library:
        def fmoe_simd(self):
            return simd

    monkeypatch.setattr(kernels, "library", lambda: Library())
    warn_without_int8_dots()
    err = capsys.readouterr().err
    assert ("--activations int8 needs the CPU kernels with AVX2" in err) == warned, err


# The tests of values and bits, run again on each narrower build than this machine's (below).
CORE_TESTS = ("computes_what_torch or top_continued or in_one_call or int8_activations_compute "
              "or dense_projection or own_bits or down_by_neuron or tile_it_falls_in or token_by_token")


# FMOE_KERNEL_ISA, the CPU flags it needs, and what the build's probe says: fmoe_simd, fmoe_int8_dots
NARROWER_BUILDS = [("avx2vnni", {"avx2", "fma", "f16c", "avx_vnni"}, "1 2"), ("avx2", {"avx2", "fma", "f16c"}, "1 1"),
                   ("scalar", set(), "0 0")]


@needs_kernels
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the x86-64 builds")
@pytest.mark.parametrize("isa, flags, level", NARROWER_BUILDS)
def test_the_narrower_builds_pass_the_same_value_and_bit_tests(isa, flags, level):
    """The native build runs the widest paths this CPU has (16-lane AVX-512 on this project's machine). A user's
    CPU may have AVX2 only (8 lanes, other register tiles; Intel's 12th-14th generation with AVX-VNNI's 256-bit int8
    dots, AMD's Zen 3 without) or neither (the scalar paths): FMOE_KERNEL_ISA builds those here, and the value and
    split-exactness tests must pass on each. The probe checks the build really is the narrower one (an ignored
    FMOE_KERNEL_ISA would test the native build twice)."""
    from fmoe_cli.kernels.build import cpu_flags

    if not flags <= set(cpu_flags().split()):
        pytest.skip(f"this CPU cannot run the {isa} build")
    env = {**os.environ, "FMOE_KERNEL_ISA": isa}
    # one process: the probe's line, then (only if it is the narrower build) the tests, on the library it loaded
    script = ("import sys, pytest; from fmoe_cli import kernels; lib = kernels.library(); "
              "probe = f'{lib.fmoe_simd()} {lib.fmoe_int8_dots()}'; print('probe', probe, flush=True); "
              "sys.exit(pytest.main(sys.argv[2:]) if probe == sys.argv[1] else 3)")
    run = subprocess.run([sys.executable, "-c", script, level, __file__, "-o", "addopts=", "-q", "-x", "-n", "0",
                          "-p", "no:cacheprovider", "-k", CORE_TESTS], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.stdout.splitlines()[:1] == [f"probe {level}"], run.stdout[:500] + run.stderr[-2000:]
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1], run.stdout[-500:]


@pytest.mark.parametrize("chosen, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_torchs_openmp_threads_sleep_between_ops_unless_the_user_chose(chosen, expected):
    """fmoe_cli, imported before torch (as the CLI and the benchmarks do), makes torch's OpenMP threads sleep when an op
    ends instead of spinning on the cores the kernels' own threads need next (fmoe_cli/__init__.py); a user's own
    OMP_WAIT_POLICY is kept. The policy is read by libgomp itself, as torch loads it."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if chosen:
        env["OMP_WAIT_POLICY"] = chosen
    probe = ("import fmoe_cli, torch, ctypes, os; "
             "print(os.environ['OMP_WAIT_POLICY'], 'torch' in __import__('sys').modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [expected, "True"]


@needs_kernels
def test_small_calls_run_on_the_calling_thread(monkeypatch):
    """A call below kernels.THREADS_MIN_BYTES (bytes of rows × tokens) asks experts.c for one thread (a wake of the pool's
    helper costs more than it saves there: docs/bench.md § Threads for small calls); a larger one for torch's
    intra-op count. Every entry (one segment, a layer's segments, a prefill's experts, a dense projection), at the
    floor's edge."""
    lib = kernels.library()
    asked = []
    for name, position in (("fmoe_segment_forward", -2), ("fmoe_segments_forward", -2), ("fmoe_experts_forward", -2),
                           ("fmoe_linear_forward", -2)):
        real = getattr(lib, name)
        monkeypatch.setattr(lib, name, lambda *args, real=real, position=position: asked.append(args[position])
                            or real(*args))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    hidden, neurons = 64, 32
    spec = kernels.spec_of("", torch.float32, hidden)
    segment = torch.randn(neurons, 3, hidden)
    rows = torch.randn(48, hidden).view(torch.uint8)
    work = {"segment": 3 * neurons * hidden * 4, "segments": 2 * 3 * neurons * hidden * 4, "linear": 48 * hidden * 4}
    for floor, threads in ((min(work.values()), 3), (max(work.values()) + 1, 1)):
        monkeypatch.setattr(kernels, "THREADS_MIN_BYTES", floor)
        asked.clear()
        x = torch.randn(1, hidden)
        kernels.segment_forward(x, segment, spec)
        kernels.segments_forward(x, [segment, segment], spec)
        kernels.experts_forward([x, x.clone()], [segment, segment], spec)  # the same work as segments_forward's
        kernels.linear_forward(x, rows, spec)
        assert asked == [threads] * 4
    monkeypatch.setattr(kernels, "THREADS_MIN_BYTES", work["segments"])  # exactly at the floor: threads
    asked.clear()
    kernels.segments_forward(torch.randn(1, hidden), [segment, segment], spec)
    kernels.experts_forward([torch.randn(1, hidden), torch.randn(1, hidden)], [segment, segment], spec)
    kernels.segment_forward(torch.randn(1, hidden), segment, spec)  # below it: one
    assert asked == [3, 3, 1]
