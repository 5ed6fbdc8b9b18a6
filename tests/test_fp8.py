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
from test_exactness import NEW_TOKENS, PROMPT, TIMINGS, _family_setup, budgets, first_difference


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "deepseek_v3"])
def fp8_checkpoint(request, checkpoints, tmp_path_factory):
    pytest.importorskip("accelerate")  # transformers' fp8 loading needs it (the test extras' hqq pulls it in)
    path = tmp_path_factory.mktemp("fp8") / request.param
    scaled = write_fp8_copy(checkpoints[request.param], path)
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

    reference = transformers.AutoModelForCausalLM.from_pretrained(fp8_checkpoint, dtype=torch.float32)
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


def test_dequantize_is_blockwise_and_refuses_a_grid_that_does_not_divide():
    weight = torch.arange(64 * 96, dtype=torch.float32).reshape(64, 96) / 1000
    fp8, scale = quantize_fp8(weight)
    got = dequantize(fp8, scale, torch.float32)
    blocks = [[fp8[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float() * scale[i, j] for j in range(3)]
              for i in range(2)]
    assert torch.equal(got, torch.cat([torch.cat(row, dim=1) for row in blocks], dim=0))
    assert dequantize(fp8, scale, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(FmoeError, match=r"shape \[64, 96\] does not divide into its scale grid \[3, 3\]"):
        dequantize(fp8, torch.ones(3, 3), torch.float32)
