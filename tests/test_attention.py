"""A decode token's attention on the CPU (models/attention.py): q/k/v fused into one kernel call under --dense
int8|int4, and the decode forward of the standard GQA families. With its steps as torch ops both give transformers'
bits: the same loaded model with and without them gives the same logits, bit for bit, every family, dtype and dense
format. A float32 token's steps in C (decode.c: kernels.attention_decode) are checked against a float64 reference
here, and against the torch steps in tests/test_decoder.py."""

from __future__ import annotations

import pytest
import torch

from fmoe_cli import kernels
from fmoe_cli.generate import stream_generate
from fmoe_cli.models import attention
from fmoe_cli.models.demo import TINY_FAMILIES

# The families whose attention gets the decode forward and fused q/k/v (models/attention.py DECODE_FAMILIES), and
# DeepSeek's MLA, checked to be left as it is; the other families' attention (GLM-4.5's, Gemma 4's) is transformers'
# own, untouched, and their tokens are tests/test_exactness.py's.
ATTENTION_FAMILIES = [f for f in TINY_FAMILIES
                      if f.startswith(("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek"))]
from fmoe_cli.models.dense import QuantLinear
from fmoe_cli.models.load import load_model
from fmoe_cli.offload.engine import Engine
from fmoe_cli.offload.link import EmulatedLink
from fmoe_cli.planning.presets import make_settings

PROMPT = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11, 64, 128]])
needs_kernels = pytest.mark.skipif(not kernels.library(), reason="no C compiler")


def attentions(model):
    return [layer.self_attn for layer in model.model.layers]


def load_perturbed(path, dtype: str, dense: str):
    """load_model, with the attention's norm weights and biases made random (a random checkpoint's are ones and
    zeros, under which a norm's weight or a bias given to the wrong projection would not show), then the decode
    forward installed again over them."""
    lm = load_model(str(path), device="cpu", dtype=dtype, dense=dense)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for attn in attentions(lm.model):
            attn.__dict__.pop("forward", None)
            for name in ("q_norm", "k_norm", "q_proj", "k_proj", "v_proj"):
                module = getattr(attn, name, None)
                for p in (getattr(module, "weight", None) if "norm" in name else None, getattr(module, "bias", None)):
                    if p is not None:
                        p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    attention.install_decode_attention(lm.model)
    return lm


def decode_logits(lm, steps: int = 6, cache=None) -> list[torch.Tensor]:
    """The logits of a greedy run's prefill and `steps` decode tokens, resident, on an instant link (from `cache`:
    default, stream_generate's own)."""
    shape = lm.shape
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(None), lm.device, lm.dtype)
    engine.install(lm.model)
    engine.configure(make_settings("resident", shape, 2 * shape.top_k * shape.expert_bytes + shape.all_experts_bytes))
    seen = []
    head = lm.model.lm_head
    real = head.forward
    head.forward = lambda x: seen.append(real(x)) or seen[-1]
    try:
        for _ in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=steps + 1, stop_on_eos=False,
                                 past_key_values=cache):
            pass
    finally:
        head.forward = real
        engine.close()
    return seen


@needs_kernels
@pytest.mark.parametrize("dense", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", [f for f in ATTENTION_FAMILIES if not f.startswith("deepseek")])
def test_fused_qkv_gives_each_projections_bits(checkpoints, family, dtype, dense):
    """One kernel call over the fused rows gives each of q, k and v the bits of its own QuantLinear's call; the
    QuantLinears' rows are views of the fused tensor (one copy)."""
    lm = load_perturbed(checkpoints[family], str(dtype).removeprefix("torch."), dense)
    for attn in attentions(lm.model):
        fused = attn.fused_qkv
        assert isinstance(fused, attention.FusedQKV), "no fused q/k/v"
        parts = (attn.q_proj, attn.k_proj, attn.v_proj)
        assert all(isinstance(p, QuantLinear) and p.packed.untyped_storage().data_ptr() ==
                   fused.rows.untyped_storage().data_ptr() for p in parts)
        for seed in range(3):
            x = torch.randn(1, lm.model.config.hidden_size, generator=torch.Generator().manual_seed(seed)).to(dtype)
            for got, p in zip(fused(x).split(fused.sizes, dim=-1), parts):
                assert torch.equal(got, p(x)), type(attn).__name__


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", [f for f in ATTENTION_FAMILIES if not f.startswith("deepseek")])
def test_float_qkv_rows_are_fused(checkpoints, family, dtype):
    """--dense bf16 (rows as stored): float32 and bf16 q/k/v rows are one kernel call at every size, each output the
    bits of its own linear's kernel row, each weight a view of the fused rows (one copy)."""
    torch_dtype = getattr(torch, dtype)
    lm = load_perturbed(checkpoints[family], dtype, "bf16")
    for attn in attentions(lm.model):
        fused = attn.fused_qkv
        assert isinstance(fused, attention.FusedQKV), "no fused q/k/v"
        parts = (attn.q_proj, attn.k_proj, attn.v_proj)
        assert all(p.weight.untyped_storage().data_ptr() == fused.rows.untyped_storage().data_ptr() for p in parts)
        x = torch.randn(1, lm.model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch_dtype)
        other = x.float() if dtype == "bfloat16" else x.bfloat16()
        assert fused.takes(x) and not fused.takes(other)  # float rows take tokens of their own dtype
        for got, p in zip(fused(x).split(fused.sizes, dim=-1), parts):
            assert torch.equal(got, p(x)), type(attn).__name__  # p(x): its kernel row (models/dense.py)


@pytest.mark.parametrize("dense", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ATTENTION_FAMILIES)
def test_decode_forward_gives_transformers_bits(checkpoints, family, dtype, dense, monkeypatch):
    """The same loaded model, with the decode forward (and fused q/k/v) and with transformers' own attention
    forward: the same logits, bit for bit, at the prefill and every decode step. The decode forward ran at every
    decode step of the standard families (never at the prefill), and never for DeepSeek's MLA."""
    if dense != "bf16" and not kernels.library():
        pytest.skip("no C compiler")
    torch_steps(monkeypatch)
    lm = load_perturbed(checkpoints[family], dtype, dense)

    def transformers_forward():
        for attn in attentions(lm.model):
            attn.__dict__.pop("forward", None)

    assert_decode_bits(lm, attention, family, transformers_forward, monkeypatch)


def torch_steps(monkeypatch) -> None:
    """A float32 decode token's norms and attention as torch ops (transformers' bits), not decode.c's: for the models
    loaded after this."""
    monkeypatch.setattr(kernels, "decode_steps_in_c", lambda: False)


def assert_decode_bits(lm, module, family: str, transformers_forward, monkeypatch, steps: int = 6) -> None:
    """The logits of a greedy run's prefill and `steps` decode tokens, then again after `transformers_forward()`
    has put transformers' own forwards back: equal bit for bit. `module.one_thread` (which the decode forwards call
    once a layer and a decode token) ran at every decode step of the standard families, never at the prefill, and
    never for DeepSeek."""
    ran = []
    real = module.one_thread
    monkeypatch.setattr(module, "one_thread", lambda: ran.append(1) or real())
    got = decode_logits(lm, steps)
    layers = len(lm.model.model.layers)
    assert len(ran) == (0 if family.startswith("deepseek") else steps * layers)
    transformers_forward()
    want = decode_logits(lm, steps)
    assert len(got) == len(want) == steps + 1
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step}: max |Δ| {(a.float() - b.float()).abs().max()}"


def test_one_thread_sdpa_gives_the_same_bits():
    """torch's flash attention on the CPU splits by head: one thread gives the bits of several (the decode
    forward's SDPA runs on one)."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for length in (1, 37, 600):
            q, k, v = (torch.randn(1, h, n, 64, generator=g).to(dtype) for h, n in ((16, 1), (4, length), (4, length)))
            want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.125, enable_gqa=True)
            with attention.one_thread():
                assert torch.get_num_threads() == 1
                got = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.125, enable_gqa=True)
            assert torch.equal(got, want)


def attention_ops(lm, decode_forward: bool) -> dict:
    """count_decode_ops over the fourth decode step of a resident run, the attention counted apart."""
    from fmoe_cli.profiling.ops import count_decode_ops

    if not decode_forward:
        for attn in attentions(lm.model):
            attn.__dict__.pop("forward", None)
    shape = lm.shape
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(None), lm.device, lm.dtype)
    engine.install(lm.model)
    engine.configure(make_settings("resident", shape, 2 * shape.top_k * shape.expert_bytes + shape.all_experts_bytes))
    steps = stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=6, stop_on_eos=False)
    for _ in range(4):
        next(steps)
    ops = count_decode_ops(lambda: next(steps), lm.model)
    engine.close()
    assert ops["attention_calls"] == len(lm.model.model.layers)
    return ops


# aten ops of one decode token's attention with the decode forward, at most, by (dtype, dense); transformers' own
# forward, counted the same way: Mixtral 36 / 48 / 44 / 48, Qwen2-MoE 36 / 51 / 38 / 51, Qwen3-MoE 52 / 64 / 60 / 64,
# OLMoE 52 / 64 / 60 / 64. bf16 rows as stored are one kernel call for q/k/v together (FusedQKV over the float rows:
# a reshape, the output's empty, its rounding to bf16, the bias's add where there is one) and one for o: Mixtral 37
# → 26, Qwen2-MoE 40 → 27, Qwen3-MoE 45 → 34, OLMoE 53 → 44 with the q/k/v rows fused (each projection its own call
# before); float32 rows likewise (every size since the token in C, models/token.py).
# The KV cache's update is 6 of them (generate.py's GrowingLayer: a narrow and a copy_ for each of k and v, and the
# views handed out; DynamicLayer's was 2 torch.cats, each copying the whole cache); RoPE 4 (a roll, two products and
# a sum), and the signed sin once a token (4 ops, shared out over the layers).
# float32 with its steps in C (decode.c: the norms, RoPE, the cache's append and the attention one call): 25 / 22,
# 25 / 23, 31 / 28 and 41 / 40 ops with them as torch ops → 12 / 7, 10 / 8, 12 / 7 (float32 q/k/v as one fused
# kernel call and o as its kernel row: views and the outputs' empties; four F.linear and a cat were 10 of them) and
# 27 / 25 (OLMoE's norms over the whole projections stay its modules).
# bf16 likewise (decode.c's bf16 functions): 26 / 24, 27 / 25, 34 / 32, 44 / 42 → 11 / 9, 12 / 10, 11 / 9, 29 / 27.
DECODE_ATTENTION_OPS = {
    "mixtral": {("float32", "bf16"): 12, ("float32", "int8"): 7, ("bfloat16", "bf16"): 11, ("bfloat16", "int8"): 9},
    "qwen2_moe": {("float32", "bf16"): 10, ("float32", "int8"): 8, ("bfloat16", "bf16"): 12, ("bfloat16", "int8"): 10},
    "qwen3_moe": {("float32", "bf16"): 12, ("float32", "int8"): 7, ("bfloat16", "bf16"): 11, ("bfloat16", "int8"): 9},
    "olmoe": {("float32", "bf16"): 27, ("float32", "int8"): 25, ("bfloat16", "bf16"): 29, ("bfloat16", "int8"): 27},
}
TORCH_STEPS = {  # the steps as torch ops (no kernels built)
    "mixtral": {("float32", "bf16"): 25, ("float32", "int8"): 22, ("bfloat16", "bf16"): 26, ("bfloat16", "int8"): 24},
    "qwen2_moe": {("float32", "bf16"): 25, ("float32", "int8"): 23, ("bfloat16", "bf16"): 27, ("bfloat16", "int8"): 25},
    "qwen3_moe": {("float32", "bf16"): 31, ("float32", "int8"): 28, ("bfloat16", "bf16"): 34, ("bfloat16", "int8"): 32},
    "olmoe": {("float32", "bf16"): 41, ("float32", "int8"): 40, ("bfloat16", "bf16"): 44, ("bfloat16", "int8"): 42},
}


@pytest.mark.parametrize("dense", ["bf16", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", list(DECODE_ATTENTION_OPS))
def test_decode_attention_ops(checkpoints, family, dtype, dense):
    """Every op the host dispatches costs it microseconds: a decode token's attention dispatches at most
    DECODE_ATTENTION_OPS[family][dtype, dense] aten ops (counted by profiling/ops.py's count_decode_ops, the attention apart),
    fewer than transformers' own forward."""
    if dense != "bf16" and not kernels.library():
        pytest.skip("no C compiler")
    path = str(checkpoints[family])
    ops = attention_ops(load_model(path, device="cpu", dtype=dtype, dense=dense), decode_forward=True)
    bound = (DECODE_ATTENTION_OPS if kernels.decode_steps_in_c() else TORCH_STEPS)[family][dtype, dense]
    assert ops["ops_per_attention"] <= bound, ops["by_op"]
    theirs = attention_ops(load_model(path, device="cpu", dtype=dtype, dense=dense), decode_forward=False)
    assert theirs["ops_per_attention"] > ops["ops_per_attention"], theirs["by_op"]


def reference_attention(qkv, heads_q, heads_k, dim, qk_weight, eps, cos, sin, keys, values, position, scale):
    """kernels.attention_decode's formulas in float64 (transformers' RMSNorm, rotate_half RoPE, softmax attention over
    positions [0, position] with the new k and v in place): (out [1, Hq·D], k [Hk, D], v [Hk, D])."""
    h = qkv.double().view(-1, dim)
    qk, v = h[:heads_q + heads_k], h[heads_q + heads_k:]
    if qk_weight is not None:
        qk = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + eps) * qk_weight.double().view(-1, dim)
    half = dim // 2
    rotated = torch.cat([-qk[:, half:], qk[:, :half]], -1)
    qk = qk * cos.double().view(dim) + rotated * sin.double().view(dim)
    q, k = qk[:heads_q], qk[heads_q:]
    ks, vs = keys[0, :, : position + 1].double().clone(), values[0, :, : position + 1].double().clone()
    ks[:, position], vs[:, position] = k, v
    group = heads_q // heads_k
    out = []
    for head in range(heads_q):
        p = torch.softmax((ks[head // group] @ q[head]) * scale, -1)
        out.append(p @ vs[head // group])
    return torch.cat(out)[None], k, v


@needs_kernels
@pytest.mark.parametrize("heads_q, heads_k, dim, norm", [(16, 4, 64, True), (4, 4, 32, False), (8, 2, 128, False),
                                                         (6, 3, 8, True)])
def test_attention_decode_in_c_against_float64(heads_q, heads_k, dim, norm):
    """kernels.attention_decode (decode.c): the heads' outputs within float32 rounding of the float64 formulas, the
    token's k (normed and rotated) and v written at the position and nothing else of the cache touched, for several
    GQA groupings, with and without Qwen3-MoE's per-head norms, at the first position, inside the buffers and at
    their last one."""
    g = torch.Generator().manual_seed(heads_q * dim)
    capacity = 40
    for position in (0, 17, capacity - 1):
        qkv = torch.randn(1, (heads_q + 2 * heads_k) * dim, generator=g)
        keys, values = (torch.randn(1, heads_k, capacity, dim, generator=g) for _ in range(2))
        qk_weight = (1 + 0.5 * torch.randn(heads_q + heads_k, 1, dim, generator=g)) if norm else None
        angles = (position + 1) * torch.rand(dim // 2, generator=g)
        cos, sin = (torch.cat([f(angles), f(angles)])[None, None] for f in (torch.cos, torch.sin))
        scale = dim ** -0.5
        want, k, v = reference_attention(qkv, heads_q, heads_k, dim, qk_weight, 1e-6, cos, sin, keys, values,
                                         position, scale)
        before_k, before_v = keys.clone(), values.clone()
        got = kernels.attention_decode(qkv.clone(), heads_q, heads_k, dim, qk_weight, 1e-6, cos, sin, keys, values,
                                       position, scale)
        assert got.shape == (1, heads_q * dim) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(keys[0, :, position].double(), k, rtol=1e-5, atol=1e-6)
        assert torch.equal(values[0, :, position], v.float())  # v is copied as it is
        untouched = torch.ones(capacity, dtype=torch.bool)
        untouched[position] = False
        assert torch.equal(keys[:, :, untouched], before_k[:, :, untouched])
        assert torch.equal(values[:, :, untouched], before_v[:, :, untouched])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_c_has_torchs_bits(dtype):
    """decode.c's RoPE rounds each product and the sum as torch's elementwise ops do (no FMA contraction; bf16: each
    to bf16): without norms, a token's k in the cache has the bits of the torch steps' `q·cos + rotate_half(q)·sin`
    in the model's dtype."""
    g = torch.Generator().manual_seed(0)
    heads_q, heads_k, dim = 8, 2, 64
    qkv = torch.randn(1, (heads_q + 2 * heads_k) * dim, generator=g).to(dtype)
    keys, values = torch.zeros(1, heads_k, 4, dim, dtype=dtype), torch.zeros(1, heads_k, 4, dim, dtype=dtype)
    angles = 5 * torch.rand(dim // 2, generator=g)
    cos, sin = (torch.cat([f(angles), f(angles)])[None, None].to(dtype) for f in (torch.cos, torch.sin))
    k = qkv.view(-1, dim)[heads_q:heads_q + heads_k]
    want = k * cos[0, 0] + torch.cat([-k[:, dim // 2:], k[:, :dim // 2]], -1) * sin[0, 0]
    kernels.attention_decode(qkv.clone(), heads_q, heads_k, dim, None, 0.0, cos, sin, keys, values, 2, 0.125)
    assert torch.equal(keys[0, :, 2], want)


@needs_kernels
def test_rms_norm_in_c():
    """kernels.rms_norm (decode.c): within float32 rounding of transformers' RMSNorm (its mean summed in another
    order: at most a few units in the last place apart), and x + add with torch's bits."""
    from fmoe_cli.models.attention import rms_norm

    g = torch.Generator().manual_seed(1)
    for width in (64, 1000, 2048):
        weight = 1 + 0.5 * torch.randn(width, generator=g)
        for _ in range(8):
            x, add = (3 * torch.randn(1, 1, width, generator=g) for _ in range(2))
            total, got = kernels.rms_norm(x, weight, 1e-6, add=add)
            assert torch.equal(total, x + add)
            torch.testing.assert_close(got, rms_norm(x + add, weight, 1e-6), rtol=4e-7, atol=1e-30)
            none, alone = kernels.rms_norm(x, weight, 1e-6)
            assert none is None
            torch.testing.assert_close(alone, rms_norm(x, weight, 1e-6), rtol=4e-7, atol=1e-30)


def c_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """decode.c's RMSNorm scale of each row of x [..., n]: the mean of squares summed in double, rounded to float32
    once, then ε added and the reciprocal root in float32 (float32 [..., 1])."""
    mean = (x.double() ** 2).mean(-1, keepdim=True).float()
    return 1 / torch.sqrt(mean + torch.tensor(eps, dtype=torch.float32))


def bf16_norm_with_c_scale(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' bf16 RMSNorm, torch's ops after the scale (x.to(float32) · r, .to(bf16), weight · h), with
    decode.c's scale: the bits decode.c must give."""
    return weight * (x.float() * c_scale(x, eps)).to(torch.bfloat16)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart a and b are, value for value (same signs)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@needs_kernels
def test_rms_norm_in_c_bf16():
    """kernels.rms_norm on bf16 rows: x + add with torch's bits; the norm with torch's bits given decode.c's scale
    (x · r rounded to bf16, then weight · h rounded: transformers' casts), and so at most one bf16 step from
    transformers' RMSNorm (its scale summed in another order), equal for most values."""
    from fmoe_cli.models.attention import rms_norm

    g = torch.Generator().manual_seed(1)
    equal = total_values = 0
    for width in (64, 1000, 2048):
        weight = (1 + 0.5 * torch.randn(width, generator=g)).bfloat16()
        for _ in range(8):
            x, add = ((3 * torch.randn(1, 1, width, generator=g)).bfloat16() for _ in range(2))
            total, got = kernels.rms_norm(x, weight, 1e-6, add=add)
            assert total.dtype == got.dtype == torch.bfloat16
            assert torch.equal(total, x + add)
            assert torch.equal(got, bf16_norm_with_c_scale(x + add, weight, 1e-6))
            none, alone = kernels.rms_norm(x, weight, 1e-6)
            assert none is None and torch.equal(alone, bf16_norm_with_c_scale(x, weight, 1e-6))
            theirs = rms_norm(x, weight, 1e-6)
            assert ulps(alone, theirs).max() <= 1
            equal += int((alone == theirs).sum())
            total_values += width
    assert equal >= 0.99 * total_values


@needs_kernels
@pytest.mark.parametrize("heads_q, heads_k, dim, norm", [(16, 4, 64, True), (4, 4, 32, False), (8, 2, 128, False),
                                                         (6, 3, 8, True)])
def test_attention_decode_in_c_bf16(heads_q, heads_k, dim, norm):
    """kernels.attention_decode on bf16 rows (a bf16 model's cache): q and k normed and rotated with torch's bf16
    bits (decode.c's norm scale), written back into qkv and, k and v, into the cache at the position (nothing else of
    it touched); each head's output the float64 softmax attention over those bf16 values with torch's CPU SDPA's
    bf16 steps (the weights exp(s − max s) rounded to bf16 before they weight the values, the output rounded to
    bf16) within one bf16 step, within bf16 rounding of the exact attention, and close to torch's SDPA itself."""
    g = torch.Generator().manual_seed(heads_q * dim)
    capacity, bf16, eps, half = 40, torch.bfloat16, 1e-6, dim // 2
    for position in (0, 17, capacity - 1):
        qkv = torch.randn(1, (heads_q + 2 * heads_k) * dim, generator=g).to(bf16)
        keys, values = (torch.randn(1, heads_k, capacity, dim, generator=g).to(bf16) for _ in range(2))
        qk_weight = (1 + 0.5 * torch.randn(heads_q + heads_k, 1, dim, generator=g)).to(bf16) if norm else None
        angles = (position + 1) * torch.rand(half, generator=g)
        cos, sin = (torch.cat([f(angles), f(angles)])[None, None].to(bf16) for f in (torch.cos, torch.sin))
        scale = dim ** -0.5
        heads = qkv.view(-1, dim)
        qk, v = heads[:heads_q + heads_k], heads[heads_q + heads_k:]
        if norm:
            qk = bf16_norm_with_c_scale(qk, qk_weight.view(-1, dim), eps)
        qk = qk * cos[0, 0] + torch.cat([-qk[:, half:], qk[:, :half]], -1) * sin[0, 0]  # torch's bf16 ops
        before_k, before_v = keys.clone(), values.clone()
        written = qkv.clone()
        got = kernels.attention_decode(written, heads_q, heads_k, dim, qk_weight, eps, cos, sin, keys, values,
                                       position, scale)
        assert got.shape == (1, heads_q * dim) and got.dtype == bf16
        assert torch.equal(written.view(-1, dim)[:heads_q + heads_k], qk)
        assert torch.equal(keys[0, :, position], qk[heads_q:]) and torch.equal(values[0, :, position], v)
        untouched = torch.ones(capacity, dtype=torch.bool)
        untouched[position] = False
        assert torch.equal(keys[:, :, untouched], before_k[:, :, untouched])
        assert torch.equal(values[:, :, untouched], before_v[:, :, untouched])
        group = heads_q // heads_k
        ks, vs = keys[0, :, :position + 1].double(), values[0, :, :position + 1].double()
        q = qk[:heads_q].double()
        sdpa_steps, exact = [], []
        for head in range(heads_q):
            s = (ks[head // group] @ q[head]) * scale
            e = torch.exp(s - s.max())
            sdpa_steps.append((e.to(bf16).double() @ vs[head // group]) / e.sum())
            exact.append(torch.softmax(s, -1) @ vs[head // group])
        assert ulps(got[0], torch.cat(sdpa_steps).to(bf16)).max() <= 1
        exact = torch.cat(exact)
        bound = 2 ** -8 * (exact.abs() + vs.abs().max())  # the weights' and the output's roundings to bf16
        assert ((got[0].double() - exact).abs() <= bound).all()
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            qk[None, :heads_q, None], keys[:, :, :position + 1], values[:, :, :position + 1], scale=scale,
            enable_gqa=group > 1)
        assert ((got[0].double() - sdpa.reshape(-1).double()).abs() <= bound).all()


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_prefill_attention_in_c_is_decode_steps(checkpoints, family, dtype, monkeypatch):
    """A prompt's attention in C (kernels.attention_prefill, once a layer at the prefill of an empty cache): each
    token's output and its keys and values in the cache have the bits `attention_decode` gives that token alone at its
    position, on buffers of its own (the T decode steps the prefill stands for); and the run's first token is the
    torch steps' (transformers') one."""
    from fmoe_cli import generate

    monkeypatch.setattr(generate, "MIN_CAPACITY", 4)  # the prompt's 10 positions: buffers grown past it
    calls = []
    real = kernels.attention_prefill

    def spy(qkv, heads_q, heads_k, dim, qk_weight, eps, cos, sin, keys, values, position, scale):
        given = qkv.clone()
        out = real(qkv, heads_q, heads_k, dim, qk_weight, eps, cos, sin, keys, values, position, scale)
        calls.append((given, heads_q, heads_k, dim, qk_weight, eps, cos, sin, keys.clone(), values.clone(), position,
                      scale, out))
        return out

    monkeypatch.setattr(kernels, "attention_prefill", spy)
    lm = load_perturbed(checkpoints[family], dtype, "int8")
    got = decode_logits(lm, steps=0)
    tokens = PROMPT.shape[1]
    assert len(calls) == len(lm.model.model.layers)
    for given, heads_q, heads_k, dim, qk_weight, eps, cos, sin, keys, values, position, scale, out in calls:
        assert position == 0 and given.shape[0] == tokens and keys.shape[-2] >= tokens
        own_keys, own_values = torch.zeros_like(keys), torch.zeros_like(values)
        for t in range(tokens):
            row = given[t:t + 1].clone()
            one = kernels.attention_decode(row, heads_q, heads_k, dim, qk_weight, eps, cos[t].contiguous(),
                                           sin[t].contiguous(), own_keys, own_values, t, scale)
            assert torch.equal(one[0], out[t]), f"token {t}"
        assert torch.equal(own_keys[..., :tokens, :], keys[..., :tokens, :])
        assert torch.equal(own_values[..., :tokens, :], values[..., :tokens, :])
    with monkeypatch.context() as m:
        torch_steps(m)
        want = decode_logits(load_perturbed(checkpoints[family], dtype, "int8"), steps=0)
    assert int(got[0].argmax()) == int(want[0].argmax())
