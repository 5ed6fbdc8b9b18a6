"""int2 experts (offload/hqq.py) against the `hqq` package itself (a test extra): the half-quadratic
solver finds zeros no worse than hqq's, the stored format (8-bit scales and zeros, as hqq stores
Mixtral's experts) reconstructs no worse than hqq with float16 metadata, and the row layout's sizes."""

from __future__ import annotations

import torch
from hqq.core.optimize import optimize_weights_proximal_legacy
from hqq.core.quantize import Quantizer

from fmoe_cli.offload import hqq
from fmoe_cli.offload.quant import dequantize, quantize
from fmoe_cli.types import EXPERT_FORMATS, ExpertShape

INT2 = EXPERT_FORMATS["int2"]


def weights(rows: int, hidden: int, seed: int) -> torch.Tensor:
    """Gaussian rows with a few outliers (what the L_p, p < 1, objective is for), of different scales."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, hidden, generator=g) * 0.02 * torch.logspace(-1, 0, rows)[:, None]
    outliers = torch.rand(rows, hidden, generator=g) < 0.002
    return torch.where(outliers, w * 8, w)


def l1_per_group(w: torch.Tensor, back: torch.Tensor) -> torch.Tensor:
    return (w - back).abs().reshape(-1, 16).mean(-1)


def test_solver_zeros_are_no_worse_than_hqqs_per_group():
    """hqq's optimize_weights_proximal on [groups, 16] (axis=1: one group per row) against ours from the
    same starting point: every group's ‖w − ŵ‖₁ is ≤ hqq's, and the solver beats plain min/max."""
    w = weights(64, 1024, seed=0).reshape(-1, 16)
    inv, zero = hqq.minmax(w, 2)
    want_q, want_inv, want_zero = optimize_weights_proximal_legacy(w, inv, zero, [0, 3], axis=1, device="cpu")
    assert torch.equal(want_inv, inv)  # hqq optimises only the zero
    theirs = l1_per_group(w, (want_q - want_zero) / want_inv)
    ours_zero = hqq.optimize_zero(w, inv, zero, 2)
    ours = l1_per_group(w, ((w * inv + ours_zero).round().clamp(0, 3) - ours_zero) / inv)
    rtn = l1_per_group(w, ((w * inv + zero).round().clamp(0, 3) - zero) / inv)
    assert (ours <= theirs * (1 + 1e-5) + 1e-9).all()
    assert (ours <= rtn * (1 + 1e-5) + 1e-9).all()  # never worse than where it started, group by group
    assert ours.mean() < 0.97 * rtn.mean()  # the solver moved the zeros
    assert (ours_zero != zero).float().mean() > 0.3


def test_the_best_iterate_comes_early():
    """Why ITERS = 10 (not hqq's 20): per group, the zero of least error is among the first rounds."""
    w = weights(64, 1024, seed=1).reshape(-1, 16)
    inv, zero = hqq.minmax(w, 2)
    at_20 = hqq.optimize_zero(w, inv, zero, 2, iters=20)
    at_default = hqq.optimize_zero(w, inv, zero, 2)
    assert torch.equal(at_20, at_default)


def test_stored_int2_reconstructs_no_worse_than_hqq_with_float_metadata():
    """The whole format — 2-bit codes, G = 16, the scales and zeros as 8-bit codes — against hqq's
    Quantizer (nbits=2, group_size=16, axis=1, optimize=True) keeping its scales and zeros in float32."""
    hidden = 4096
    w = weights(48, hidden, seed=2)
    codes, meta = Quantizer.quantize(w, nbits=2, group_size=16, axis=1, optimize=True, device="cpu")
    meta["compute_dtype"] = torch.float32
    theirs = Quantizer.dequantize(codes, meta)
    ours = dequantize(quantize(w.reshape(16, 3, hidden), INT2), INT2, hidden, torch.float32).reshape(w.shape)
    rtn_codes, rtn_meta = Quantizer.quantize(w, nbits=2, group_size=16, axis=1, optimize=False, device="cpu")
    rtn_meta["compute_dtype"] = torch.float32
    rtn = Quantizer.dequantize(rtn_codes, rtn_meta)
    error = {name: (w - back).abs().mean() / w.abs().mean() for name, back in
             (("ours", ours), ("hqq", theirs), ("rtn", rtn))}
    assert error["ours"] <= error["hqq"] * 1.01, error
    assert error["ours"] < error["rtn"] * 0.97, error
    assert 0.2 < error["ours"] < 0.4, error  # really 2-bit: a quarter-ish of each weight is lost
    mse = {name: ((w - back) ** 2).mean() for name, back in (("ours", ours), ("hqq", theirs))}
    assert mse["ours"] <= mse["hqq"] * 1.05, mse


def test_row_layout_and_sizes():
    """One projection row: H/4 code bytes, H/16 scale codes, H/16 zero codes, float16 (σ, z) per 128
    scales and one for the zeros; Mixtral's expert at ≈ 3.02 bits a weight."""
    assert INT2.projection_bytes(4096) == 1024 + 256 + 256 + 4 * 2 + 4
    mixtral = ExpertShape(32, 8, 2, 4096, 14336, 2, experts="int2")
    assert mixtral.expert_bytes == 14336 * 3 * 1548
    assert 3.0 < mixtral.expert_bytes * 8 / (14336 * 3 * 4096) < 3.05
    assert INT2.projection_bytes(64) == 16 + 4 + 4 + 4 + 4  # small H: one scale group of 4
    # codes: byte j holds codes j, j + H/4, j + H/2, j + 3H/4 from the high bits down (hqq's pack_2bit_u8)
    hidden, quarter = 64, 16
    codes = (torch.arange(hidden) + torch.arange(hidden) // quarter) % 4  # every group of 16 spans 0…3: exact
    row = codes.float().expand(1, 3, hidden).contiguous()
    packed = quantize(row, INT2)
    q = codes.reshape(4, quarter)
    want = q[0] << 6 | q[1] << 4 | q[2] << 2 | q[3]
    assert torch.equal(packed[0, :, :quarter], want.to(torch.uint8).expand(3, quarter))
    assert torch.equal(dequantize(packed, INT2, hidden, torch.float32), row)


def test_dequantising_any_row_range_alone_gives_the_same_weights():
    """What a blocked dequantiser needs: rows [a, b) dequantised alone equal rows [a, b) of the whole."""
    packed = quantize(weights(40, 256, seed=3).reshape(40, 1, 256).expand(40, 3, 256).contiguous(), INT2)
    whole = dequantize(packed, INT2, 256, torch.float32)
    for a, b in ((0, 16), (5, 6), (17, 40)):
        out = torch.empty(b - a, 3, 256)
        assert torch.equal(hqq.dequantize_into(packed[a:b], INT2, 256, out), whole[a:b])
