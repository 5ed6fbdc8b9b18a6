"""Block-scaled float8 checkpoints (DeepSeek-V3's and the `-FP8` repositories' layout: float8 weights, a float32 scale
per block, config.json's quantization_config fp8 with a weight_block_size) are dequantized as they are read
(models/checkpoint.py `dequantize`), as transformers dequantizes them on a machine without an FP8 GPU: every policy
gives transformers' own greedy tokens on the same float8 checkpoint."""

from __future__ import annotations

import pytest
import torch

from fmoe_cli.errors import FmoeError
from fmoe_cli.generate import stream_generate
from fmoe_cli.models.checkpoint import dequantize
from fmoe_cli.models.demo import FP8_BLOCK as BLOCK, quantize_fp8, write_fp8_copy
from fmoe_cli.offload.link import EmulatedLink, VirtualClock
from fmoe_cli.planning.presets import make_settings
from test_exactness import NEW_TOKENS, PROMPT, TIMINGS, _family_setup, budgets, dequantizing, first_difference


@pytest.fixture(scope="module", params=[("mixtral", False), ("qwen3_moe", False), ("deepseek_v3", False),
                                        ("qwen3_moe", True)], ids=["mixtral", "qwen3_moe", "deepseek_v3", "qwen3_moe-ue8m0"])
def fp8_checkpoint(request, checkpoints, tmp_path_factory):
    """(family, e8m0): e8m0, the scales as E8M0 exponents in bytes (scale_fmt "ue8m0"), 2^(b − 127) each."""
    pytest.importorskip("accelerate")  # transformers' fp8 loading needs it (the test extras' hqq pulls it in)
    family, e8m0 = request.param
    path = tmp_path_factory.mktemp("fp8") / family
    scaled = write_fp8_copy(checkpoints[family], path, e8m0=e8m0)
    assert any(".experts." in key for key in scaled) and any("attn" in key for key in scaled)
    return path


def test_every_policy_gives_transformers_tokens_on_a_float8_checkpoint(fp8_checkpoint):
    for lm, engine, want, _, want_logits in _family_setup(fp8_checkpoint, EmulatedLink(gbps=20, clock=VirtualClock(),
                                                                                              copy=True)):
        for policy in ("resident", "uniform", "lru", "moepic"):
            engine.configure(make_settings(policy, lm.shape, budgets(lm.shape)["tight"], timings=TIMINGS))
            got = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=NEW_TOKENS,
                                                       stop_on_eos=False)]
            assert got == want, f"{policy}: tokens differ from token {first_difference(got, want)}"


def test_the_weights_read_are_transformers_dequantized_ones(fp8_checkpoint, checkpoints):
    """Bit for bit transformers' dequantized parameters (and not the float checkpoint's: the float8 rounding shows)."""
    import transformers

    from fmoe_cli.models.load import load_model

    reference = transformers.AutoModelForCausalLM.from_pretrained(fp8_checkpoint, dtype=torch.float32,
                                                                  **dequantizing(fp8_checkpoint))
    original = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[fp8_checkpoint.name], dtype=torch.float32)
    lm = load_model(str(fp8_checkpoint), device="cpu", dtype="float32")
    name = next(n for n, _ in reference.named_parameters() if "o_proj" in n)
    ours, theirs = lm.model.get_parameter(name), reference.get_parameter(name)
    assert torch.equal(ours, theirs) and not torch.equal(theirs, original.get_parameter(name))
    layer = lm.layers[0]
    experts = reference.get_submodule(layer.name)
    block = lm.store.block(0, 3)  # expert 3 of the first MoE layer, [I, 3, H]: gate row, up row, down column
    gate_up, down = experts.gate_up_proj[3], experts.down_proj[3]  # [2I, H], [H, I]
    intermediate = down.shape[1]
    assert torch.equal(block[:, 0], gate_up[:intermediate]) and torch.equal(block[:, 1], gate_up[intermediate:])
    assert torch.equal(block[:, 2], down.t())


def test_dequantize_is_q_times_its_block_s_scale_also_where_the_block_is_cut_short():
    """ŵ[i, j] = q[i, j] · s[i // b, j // b]: a weight the block divides (transformers' dequantization, reshaped per
    block) and one it does not (DeepSeek-V3's kv_a_proj_with_mqa: [576, 7168] in 128-blocks, a [5, 56] grid; here
    [40, 50] in 16-blocks, [3, 4]); a grid of another shape is refused."""
    for rows, cols in ((64, 96), (40, 50)):
        weight = torch.randn(rows, cols) * 3
        fp8, scale = quantize_fp8(weight, 16)
        assert scale.shape == (-(-rows // 16), -(-cols // 16))
        want = torch.tensor([[fp8[i, j].item() * scale[i // 16, j // 16].item() for j in range(cols)]
                             for i in range(rows)])
        got = dequantize(fp8, scale, torch.float32, (16, 16))
        assert torch.equal(got, want) and got.is_contiguous()
        assert (got - weight).abs().max() <= weight.abs().max() * 0.07  # e4m3's rounding, not misplaced scales
        assert dequantize(fp8, scale, torch.bfloat16, (16, 16)).dtype == torch.bfloat16
    with pytest.raises(FmoeError, match=r"shape \[40, 50\] in blocks of \[16, 16\] has a scale grid of \[3, 4\], not \[2, 4\]"):
        dequantize(fp8, scale[:2], torch.float32, (16, 16))


def test_e8m0_scales_are_powers_of_two_read_from_their_bytes():
    """A scale stored as the byte b (E8M0, the MXFP8 layout) is 2^(b − 127), as transformers reads it, whether the byte
    is a U8 tensor or a float8_e8m0fnu one; the byte itself as a multiplier was 2^7 = 128 × off and more."""
    weight = torch.randn(40, 50) * 3
    fp8, exponents = quantize_fp8(weight, 16, e8m0=True)
    assert exponents.dtype == torch.uint8
    scale = (exponents.float() - 127).exp2()
    want = torch.tensor([[fp8[i, j].item() * scale[i // 16, j // 16].item() for j in range(50)] for i in range(40)])
    for stored in (exponents, exponents.view(torch.float8_e8m0fnu)):
        got = dequantize(fp8, stored, torch.float32, (16, 16))
        assert torch.equal(got, want)
    assert (got - weight).abs().max() <= weight.abs().max() * 0.07


def test_block_scales_of_another_dtype_are_refused_before_a_weight_is_read(checkpoints, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    import fmoe_cli.models.load as load
    from fmoe_cli.models.load import load_model

    path = tmp_path / "fp8"
    key = next(k for k in write_fp8_copy(checkpoints["mixtral"], path) if "o_proj" in k)
    tensors = load_file(str(path / "model.safetensors"))
    tensors[key + "_scale_inv"] = tensors[key + "_scale_inv"].to(torch.int32)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    monkeypatch.setattr(load, "read_checkpoint", lambda *a, **k: pytest.fail("read weights before refusing"))
    with pytest.raises(FmoeError, match=rf"{key}_scale_inv is stored as I32; fmoe reads block scales stored as F32, "):
        load_model(str(path), device="cpu", dtype="float32")


def test_a_scale_grid_of_another_shape_is_refused_before_a_weight_is_read(checkpoints, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    import fmoe_cli.models.load as load
    from fmoe_cli.models.load import load_model

    path = tmp_path / "fp8"
    key = next(k for k in write_fp8_copy(checkpoints["mixtral"], path) if "o_proj" in k)
    tensors = load_file(str(path / "model.safetensors"))
    tensors[key + "_scale_inv"] = tensors[key + "_scale_inv"][:1]  # a grid row short
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    monkeypatch.setattr(load, "read_checkpoint", lambda *a, **k: pytest.fail("read weights before refusing"))
    with pytest.raises(FmoeError, match=rf"{key}_scale_inv is a grid of \[1, 2\] scales, but {key} \[64, 64\] in "
                                        rf"blocks of \[32, 32\] needs \[2, 2\]"):
        load_model(str(path), device="cpu", dtype="float32")
