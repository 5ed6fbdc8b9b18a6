"""tools/random_checkpoint.py: a random checkpoint at a given shape, its experts straight into the converted store.

The store it writes for quantised experts is byte for byte the one fmoe's loader writes when it converts the same
weights (the checkpoint built with bf16 experts, same seed); the checkpoint loads, its shapes those of its config."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from fmoe_cli.models.demo import build_tokenizer
from fmoe_cli.models.identity import checkpoint_fingerprint
from fmoe_cli.models.load import load_model
from fmoe_cli.offload.converted import converted_path
from fmoe_cli.offload.engine import open_engine
from fmoe_cli.planning.presets import make_settings

TOOL = Path(__file__).resolve().parent.parent / "tools" / "random_checkpoint.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("random_checkpoint", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def small(tool):
    """Mixtral's layout at a small size: H 64, I 256 (two of the loader's blocks of 128 neurons), 4 experts, top-2."""
    return tool.ModelShape("MixtralConfig", dict(
        hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False), 3)


def build(tool, out: Path, experts: str, quantize: str = "exact", seed: int = 3, layers: int = 2):
    plan = tool.plan_build(out, small(tool), layers, experts, build_tokenizer())
    store = tool.write_checkpoint(plan, seed, quantize, "cpu", Console(file=open(os.devnull, "w")))
    return plan, store


def quiet() -> Console:
    return Console(file=open(os.devnull, "w"))


@pytest.mark.parametrize("experts", ["int2", "int4", "int8"])
def test_store_is_the_loaders_conversion_byte_for_byte(tool, tmp_path, experts):
    build(tool, tmp_path / "bf16", "bf16")
    fingerprint = checkpoint_fingerprint(tmp_path / "bf16")
    converted = converted_path(fingerprint, experts)
    assert not converted.exists()
    load_model(str(tmp_path / "bf16"), device="cpu", experts=experts, console=quiet()).store.close()
    by_loader = converted.read_bytes()  # what fmoe wrote converting the bf16 experts it read
    converted.unlink()
    _, store = build(tool, tmp_path / experts, experts)
    assert checkpoint_fingerprint(tmp_path / experts) == fingerprint  # the same header: the loader's file name
    assert store == converted and store.read_bytes() == by_loader
    # the expert tensors of the quantised build are a hole: the file is no smaller, the disk it takes is
    weights = tmp_path / experts / "model.safetensors"
    assert weights.stat().st_size == (tmp_path / "bf16" / "model.safetensors").stat().st_size
    assert weights.stat().st_blocks * 512 < 0.9 * weights.stat().st_size


@pytest.mark.parametrize("quantize", ["exact", "pool"])
def test_checkpoint_loads_with_the_config_shapes(tool, tmp_path, quantize):
    plan, store = build(tool, tmp_path / "m", "int2", quantize, layers=3)
    lm = load_model(str(tmp_path / "m"), device="cpu", experts="int2", console=quiet())
    try:
        config = plan.config
        shape = lm.shape
        assert (shape.num_layers, shape.num_experts, shape.top_k, shape.hidden, shape.intermediate) == (
            config.num_hidden_layers, config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
            config.intermediate_size) == (3, 4, 2, 64, 256)
        # the store the loader maps is the builder's (nothing converted from the hole)
        assert bytes(torch.cat([t.reshape(-1) for t in lm.store.layers]).numpy()) in store.read_bytes()
        for name, tensor_shape, is_expert in plan.tensors:
            if not is_expert:
                assert tuple(lm.model.get_parameter(name).shape) == tensor_shape
        engine = open_engine(lm)  # every expert loaded on demand from the store
        try:
            engine.configure(make_settings("ondemand", shape, shape.min_staging_slots * shape.expert_bytes))
            logits = lm.model(input_ids=torch.tensor([[1, 2, 3]])).logits
            assert logits.shape == (1, 3, config.vocab_size) and torch.isfinite(logits).all()
            assert engine.counters().activations > 0
        finally:
            engine.close()
    finally:
        lm.store.close()


def test_refuses_a_non_empty_directory_and_too_many_layers(tool, tmp_path, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("")
    for argv in ([str(tmp_path / "x"), "--shape", "mixtral-8x7b"],
                 [str(tmp_path / "y"), "--shape", "mixtral-8x7b", "--layers", "33"]):
        with pytest.raises(SystemExit) as exc:
            tool.main(argv)
        assert exc.value.code == 2
        assert capsys.readouterr().err.startswith("error: ")
    assert not (tmp_path / "y").exists()
