"""int2 experts as HQQ stores Mixtral's: 2-bit codes in groups of 16, the zero found by HQQ's
half-quadratic solver, and the group scales and zeros themselves quantised to 8 bits.

HQQ (Badri & Shaji 2023, "Half-Quadratic Quantization of Large Machine Learning Models";
the `hqq` package, core/optimize.py) quantises a group w of G weights affinely,

    q = clamp(round(w / s + z), 0, 2^b − 1),    ŵ = (q − z) · s,

with s from the group's min/max (s = (max − min) / (2^b − 1)) and the zero z refined by a
half-quadratic split of  min_z ‖w − ŵ(z)‖_p^p  (p = 0.7 < 1: robust to outliers), with
W_e the auxiliary error and β the penalty (inverse scale s⁻¹ as in hqq's code):

    W_q = round(w·s⁻¹ + z),  W_r = (W_q − z)·s
    W_e = shrink_p(w − W_r, β) = sign(x)·relu(|x| − |x|^(p−1)/β)      (x = w − W_r)
    z   = mean_G(W_q − (w − W_e)·s⁻¹)                                  (20 rounds, β = 10)

Mixtral-offloading (and MoEpic's Mixtral setting) store the experts with hqq's
BaseQuantizeConfig(nbits=2, group_size=16, quant_zero=True, quant_scale=True): the group
scales are quantised to 8 bits in groups of 128 (min/max, not optimised) and the zeros to
8 bits (min/max). fmoe keeps that storage, per neuron row so that any top/bottom split is one
segment with its metadata (offload/quant.py). Deviations from hqq, each no worse in error:
- groups run along H for all three projections (hqq's axis=1 groups the down projection along I);
- the solver stops per group, keeping the iterate of least ‖w − ŵ‖₁ (hqq stops when the whole
  tensor's mean error stops falling and keeps the last step, so a row's codes would depend on
  which rows were quantised with it);
- the zeros' 8-bit min/max is per projection row (hqq: one per tensor), and the weights' codes
  are computed from the stored (dequantised) scale and zero.

One projection row of H weights (G = 16, n_g = H/G groups, M scales per 8-bit scale group):

    [H/4 code bytes][n_g scale codes][n_g zero codes][n_g/M × (σ, z) float16][(σ, z) float16]

(byte j of the codes holds, from the high bits down, codes j, j + H/4, j + H/2, j + 3H/4:
hqq's pack_2bit_u8 along the row, so unpacking writes four contiguous quarters).
"""

from __future__ import annotations

import torch

from fmoe_cli.types import QuantFormat

# hqq's optimize_weights_proximal defaults are 20 rounds, β = 10, p = 0.7, stopping early when the tensor's
# error stops falling (after 8 rounds on Gaussian weights); per group, the best iterate on 4096 Gaussian groups
# was always among the first 7 (tests/test_hqq.py), so 10 rounds lose nothing and halve the conversion time.
ITERS, BETA, LP_NORM = 10, 10.0, 0.7
META_BITS = 8


def shrink_lp(x: torch.Tensor, beta: float, p: float) -> torch.Tensor:
    """The generalised soft threshold: argmin_e |e|^p + β/2·(e − x)²  ≈  sign(x)·relu(|x| − |x|^(p−1)/β)."""
    a = x.abs()
    return x.sign() * (a - a.pow(p - 1) / beta).clamp_min(0)


def minmax(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hqq's starting point along the last axis: (s⁻¹, z), s⁻¹ = (2^b − 1)/(max − min) (1 where the
    range is ≤ 1e-4; at most 2e4), z = −min·s⁻¹. Shapes [..., 1]."""
    qmax = 2**bits - 1
    low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    span = high - low
    inv = torch.where(span.abs() <= 1e-4, torch.ones_like(span), qmax / span).clamp(max=2e4)
    return inv, -low * inv


def optimize_zero(w: torch.Tensor, inv: torch.Tensor, zero: torch.Tensor, bits: int,
                  iters: int = ITERS, beta: float = BETA, p: float = LP_NORM) -> torch.Tensor:
    """HQQ's proximal solver for z, per group: w [..., G], s⁻¹ and z [..., 1] -> the z of least
    ‖w − ŵ‖₁ among the starting one and the `iters` updates. The z update is hqq's
    mean_G(W_q − (w − W_e)·s⁻¹), written as mean(W_q) − s⁻¹·(mean(w) − mean(W_e)) (s⁻¹ is constant in a group)."""
    qmax = 2**bits - 1
    mean_w = w.mean(-1, keepdim=True)
    best_zero, best_err = zero, torch.full_like(zero, float("inf"))
    for step in range(iters + 1):
        q = torch.addcmul(zero, w, inv).round_().clamp_(0, qmax)  # W_q
        x = q.sub(zero).div_(inv).neg_().add_(w)  # w − W_r
        a = x.abs()
        err = a.mean(-1, keepdim=True)
        better = err < best_err
        best_err, best_zero = torch.where(better, err, best_err), torch.where(better, zero, best_zero)
        if step == iters:
            break
        # W_e = sign(x)·relu(|x| − |x|^(p−1)/β)
        e = a.sub_(a.pow(p - 1).div_(beta)).clamp_min_(0).mul_(x.sign_())
        zero = q.mean(-1, keepdim=True) - inv * (mean_w - e.mean(-1, keepdim=True))
    return best_zero


def _meta_quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """8-bit min/max of x [..., m] in groups of `group` (hqq's optimize=False quantiser):
    codes [..., m] uint8, (σ, z) [..., m/group, 2] float16, and x̂ = (code − z)·σ float32."""
    g = x.reshape(*x.shape[:-1], -1, group)
    inv, zero = minmax(g, META_BITS)
    sigma, zero = (1 / inv).half(), zero.half()  # stored as float16: the codes come from what is stored
    q = (g / sigma.float() + zero.float()).round_().clamp_(0, 2**META_BITS - 1)
    back = (q - zero.float()) * sigma.float()
    return q.to(torch.uint8).reshape(x.shape), torch.cat([sigma, zero], -1), back.reshape(x.shape)


def quantize(block: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """[n, 3, H] float -> [n, 3, projection_bytes] uint8 (the module docstring's row)."""
    n, three, hidden = block.shape
    g = fmt.group_size(hidden)
    groups = hidden // g
    w = block.float().reshape(n, three, groups, g)
    inv, zero = minmax(w, fmt.bits)
    zero = optimize_zero(w, inv, zero, fmt.bits)
    scale_q, scale_meta, scale = _meta_quantize((1 / inv).squeeze(-1), fmt.meta_group_size(groups))
    zero_q, zero_meta, zero = _meta_quantize(zero.squeeze(-1), groups)
    q = (w / scale[..., None] + zero[..., None]).round_().clamp_(0, 2**fmt.bits - 1).to(torch.uint8)
    quarter = hidden // 4
    q = q.reshape(n, three, 4, quarter)
    codes = q[:, :, 0] << 6 | q[:, :, 1] << 4 | q[:, :, 2] << 2 | q[:, :, 3]  # [n, 3, H/4]
    meta = torch.cat([scale_meta, zero_meta], dim=-2).view(torch.uint8).reshape(n, three, -1)
    return torch.cat([codes, scale_q, zero_q, meta], dim=-1)


def dequantize_into(segment: torch.Tensor, fmt: QuantFormat, hidden: int, out: torch.Tensor) -> torch.Tensor:
    """[n, 3, projection_bytes] uint8 -> ŵ written into `out` (float32 [n, 3, H]); a plain function of the
    rows given, so a caller may dequantise any row range alone."""
    n, three, _ = segment.shape
    groups = hidden // fmt.group_size(hidden)
    meta_groups = groups // fmt.meta_group_size(groups)
    quarter = hidden // 4
    codes = segment[..., :quarter]
    scale_q = segment[..., quarter:quarter + groups]
    zero_q = segment[..., quarter + groups:quarter + 2 * groups]
    meta = segment[..., quarter + 2 * groups:].contiguous().view(torch.float16).float().reshape(n, three, -1, 2)
    # σ, z of the scales' 8-bit groups; of the zeros' one group
    scale = (scale_q.float().reshape(n, three, meta_groups, -1) - meta[:, :, :meta_groups, 1:2]) \
        * meta[:, :, :meta_groups, 0:1]  # [n, 3, meta groups, M]
    zero = (zero_q.float() - meta[:, :, meta_groups:, 1]) * meta[:, :, meta_groups:, 0]  # [n, 3, groups]
    quarters = out.view(n, three, 4, quarter)
    for i, shift in enumerate((6, 4, 2, 0)):
        quarters[:, :, i].copy_((codes >> shift) & 3)
    w = out.view(n, three, groups, -1)
    w.sub_(zero[..., None]).mul_(scale.reshape(n, three, groups, 1))  # ŵ = (q − z)·s
    return out
