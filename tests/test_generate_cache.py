"""The KV cache a CPU generation writes in place (generate.py: GrowingLayer, new_cache): the same logits as
transformers' DynamicCache (a torch.cat every step), bit for bit, every family, dtype and dense format, at the
prefill and every decode step, across its buffers' growth, and after a crop (chat's reuse of a conversation)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from fmoe_cli import generate, kernels
from fmoe_cli.generate import GrowingLayer, new_cache
from fmoe_cli.models.demo import TINY_FAMILIES
from fmoe_cli.models.load import load_model
from test_attention import decode_logits  # tests/test_attention.py


@pytest.mark.parametrize("dense", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_growing_cache_gives_dynamic_cache_bits(checkpoints, family, dtype, dense, monkeypatch):
    """The same loaded model from new_cache (its buffers at least 4 positions, so they grow 6 times over the run)
    and from DynamicCache: the same logits bit for bit at the prefill and every decode step."""
    if dense != "bf16" and not kernels.library():
        pytest.skip("no C compiler")
    monkeypatch.setattr(kernels, "decode_steps_in_c", lambda: False)  # the torch steps (float32 in C: test_decoder.py)
    monkeypatch.setattr(generate, "MIN_CAPACITY", 4)
    lm = load_model(str(checkpoints[family]), device="cpu", dtype=dtype, dense=dense)
    ours = new_cache(lm.model)
    assert all(type(layer) is GrowingLayer for layer in ours.layers)
    steps = 24
    got = decode_logits(lm, steps, ours)
    grown = {layer._buffers[0].shape[-2] for layer in ours.layers}
    want = decode_logits(lm, steps, DynamicCache(config=lm.model.config))
    assert len(got) == len(want) == steps + 1 and ours.get_seq_length() == 10 + steps  # (the prompt's 10 tokens)
    assert min(grown) >= ours.get_seq_length() and max(grown) < 2 * ours.get_seq_length()
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step}: max |Δ| {(a.float() - b.float()).abs().max()}"


def test_growing_layer_keeps_dynamic_layers_values():
    """Update by update, a crop, an assignment from outside (DynamicLayer's batch methods): GrowingLayer's keys and
    values equal DynamicLayer's, and its buffers grow geometrically, not every step."""
    from transformers.cache_utils import DynamicLayer

    g = torch.Generator().manual_seed(0)
    ours, theirs = GrowingLayer(), DynamicLayer()
    capacities = set()
    for length in (7, 1, 1, 300, 1, 1, 2, 1):
        k, v = torch.randn(1, 2, length, 8, generator=g), torch.randn(1, 2, length, 6, generator=g)
        got, want = ours.update(k, v), theirs.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(got, want)) and ours.get_seq_length() == theirs.get_seq_length()
        capacities.add(ours._buffers[0].shape[-2])
    assert len(capacities) == 2  # 256, then 1.5 × 308
    for layer in (ours, theirs):
        layer.crop(-5)
    k, v = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 2, 3, 6, generator=g)
    assert all(torch.equal(a, b) for a, b in zip(ours.update(k, v), theirs.update(k, v)))
    for layer in (ours, theirs):
        layer.batch_repeat_interleave(2)
    k, v = torch.randn(2, 2, 1, 8, generator=g), torch.randn(2, 2, 1, 6, generator=g)
    assert all(torch.equal(a, b) for a, b in zip(ours.update(k, v), theirs.update(k, v)))
    assert ours.keys.shape == (2, 2, ours.get_seq_length(), 8)


def test_new_cache_on_the_cpu_only(checkpoints):
    """A model on another device keeps transformers' DynamicLayers (nothing of this runs on a CUDA model)."""
    lm = load_model(str(checkpoints["qwen3_moe"]), device="cpu", dtype="float32")
    assert all(type(layer) is GrowingLayer for layer in new_cache(lm.model).layers)
    lm.model.to("meta")
    assert not any(type(layer) is GrowingLayer for layer in new_cache(lm.model).layers)


def test_decode_appends_to_a_growing_layer_without_the_caches_wrapper(checkpoints, monkeypatch):
    """models/attention.py's decode forward writes a decode token's keys and values by the GrowingLayer's own update
    (attention.append), not through transformers' Cache.update (its steps cost µs a layer and do nothing for it):
    the wrapper runs at the prefill only (transformers' forward), and on every step for transformers' DynamicLayer,
    which keeps its own update. The values are the same (test_growing_cache_gives_dynamic_cache_bits)."""
    monkeypatch.setattr(kernels, "decode_steps_in_c", lambda: False)
    lm = load_model(str(checkpoints["mixtral"]), device="cpu", dtype="float32")
    layers, steps = lm.model.config.num_hidden_layers, 4
    calls = []
    real = DynamicCache.update
    monkeypatch.setattr(DynamicCache, "update", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    got = decode_logits(lm, steps, new_cache(lm.model))
    assert len(calls) == layers
    calls.clear()
    want = decode_logits(lm, steps, DynamicCache(config=lm.model.config))
    assert len(calls) == layers * (1 + steps)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_greedy_sampling_of_float32_logits_casts_nothing():
    """generate.sample_next at temperature 0: float32 logits are read as they are (no `to`: one op a token fewer on
    the decode step, which runs in inference mode, where torch dispatches a same-dtype `.float()`), bf16 ones cast
    to float32 first; the argmax either way."""
    from fmoe_cli.generate import SamplingParams, sample_next
    from fmoe_cli.profiling.ops import OpCounter

    logits = torch.randn(384, generator=torch.Generator().manual_seed(3))
    counter = OpCounter()
    with torch.inference_mode(), counter:
        token = sample_next(logits, SamplingParams(), None)
    casts = {"to", "_to_copy"}
    assert token == int(logits.argmax()) and not casts & {name for _, name in counter.ops}, counter.ops
    counter.ops.clear()
    with torch.inference_mode(), counter:
        token = sample_next(logits.bfloat16(), SamplingParams(), None)
    assert token == int(logits.bfloat16().float().argmax()) and casts & {name for _, name in counter.ops}, counter.ops


def test_next_logits_calls_the_model_as_calling_it_would(checkpoints):
    """generate.next_logits calls the causal LM's forward without nn.Module's call where nothing hooks the model
    (offload/layout.py `called`): the same logits as calling it; and a hook on the model runs at every step."""
    from fmoe_cli.offload.engine import Engine
    from fmoe_cli.offload.link import EmulatedLink
    from fmoe_cli.planning.presets import make_settings

    lm = load_model(str(checkpoints["mixtral"]), device="cpu", dtype="float32")
    shape = lm.shape
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(None), lm.device, lm.dtype)
    engine.install(lm.model)
    engine.configure(make_settings("resident", shape, 2 * shape.top_k * shape.expert_bytes + shape.all_experts_bytes))
    ids = torch.tensor([[5, 17, 42, 99]])
    with torch.inference_mode():
        got = generate.next_logits(lm.model, ids, cache := new_cache(lm.model))
        got_next = generate.next_logits(lm.model, torch.tensor([[int(got.argmax())]]), cache)
        want_cache = new_cache(lm.model)
        want = lm.model(input_ids=ids, past_key_values=want_cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        want_next = lm.model(input_ids=torch.tensor([[int(want.argmax())]]), past_key_values=want_cache,
                             use_cache=True, logits_to_keep=1).logits[0, -1]
        assert torch.equal(got, want) and torch.equal(got_next, want_next)
        calls = []
        lm.model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape[1]),
                                           with_kwargs=True)
        generate.next_logits(lm.model, torch.tensor([[7]]), cache)
        assert calls == [1]
    engine.close()
