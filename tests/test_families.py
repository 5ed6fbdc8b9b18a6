"""The families beyond the full exactness matrix (tests/test_exactness.py's TINY_FAMILIES): their config.json read under
their own field names; each served one (models/demo.py MORE_FAMILIES) gives transformers' greedy tokens under
`resident` and a split policy; what cannot be served is refused in one line, by what its modules are
(benchmarks/families_survey.py surveys every family)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers

from fmoe_cli.errors import FmoeError
from fmoe_cli.generate import stream_generate
from fmoe_cli.models.config import check_config_fields, text_fields
from fmoe_cli.models.demo import MORE_FAMILIES
from fmoe_cli.models.load import build_skeleton
from fmoe_cli.offload.link import EmulatedLink, VirtualClock
from fmoe_cli.planning.presets import make_settings
from fmoe_cli.profiling.files import model_identity
from fmoe_cli.profiling.layers import time_layers
from test_exactness import NEW_TOKENS, PROMPT, TIMINGS, _family_setup, budgets, first_difference  # tests/

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import families_survey  # noqa: E402 (benchmarks/: every family's tiny config, and which the survey serves exactly)


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_family_gives_transformers_tokens_resident_and_split(checkpoints, family):
    """`resident`, then `uniform` at θ = 0.5 on the tight budget (the staging pool and one expert: prefill in waves,
    every decode token's experts split or loaded): transformers' own greedy tokens."""
    for lm, engine, want, *_ in _family_setup(checkpoints[family], EmulatedLink(gbps=20, clock=VirtualClock(),
                                                                                 copy=True)):
        for policy, theta in (("resident", None), ("uniform", 0.5)):
            engine.configure(make_settings(policy, lm.shape, budgets(lm.shape)["tight"], theta=theta,
                                           timings=TIMINGS))
            got = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=NEW_TOKENS,
                                                       stop_on_eos=False)]
            assert got == want, f"{family} {policy}: tokens differ from token {first_difference(got, want)}"
        assert engine.counters().bytes_moved > 0


@pytest.mark.parametrize("family", ["gemma4_text", "afmoe", "granitemoe"])
def test_the_profile_times_each_moe_layer(checkpoints, family):
    """time_layers (what moepic and hybrid plan with) times the MoE part of each layer the engine serves, found by its
    experts: Gemma 4's experts module on the layer itself, AFMoE's block with a `router`, Granite's
    `block_sparse_moe` beside no `mlp`. Until 29 Nov it timed `layer.mlp` where it had `.experts` and `.gate`: 'the
    profile times no MoE layer' (Gemma 4, AFMoE, Aria, Phi-3.5-MoE), an AttributeError (Granite, Jamba, LFM2)."""
    for lm, engine, *_ in _family_setup(checkpoints[family], EmulatedLink(gbps=20, clock=VirtualClock(), copy=True)):
        engine.configure(make_settings("resident", lm.shape, budgets(lm.shape)["tight"], timings=TIMINGS))
        timings = time_layers(lm.model, PROMPT, model_identity=model_identity(lm.model_id, lm.path / "config.json"),
                              top_k=lm.shape.top_k, decode_steps=1, repeats=1)
        for phase in (timings.decode, timings.prefill):
            assert [t.index for t in phase.layers if t.moe] == [layer.decoder_index for layer in lm.layers]
            assert all(t.t_moe > 0 for t in phase.layers if t.moe)


@pytest.mark.parametrize("fields, top_k", [
    ({"moe_k": 6, "moe_num_experts": 64}, 6),  # ERNIE-4.5
    ({"moe_topk": 8, "num_experts": 64}, 8),
    ({"moe_topk": [8] * 4, "moe_intermediate_size": [3072] * 4, "num_experts": 64}, 8),  # Hunyuan-A13B's lists
    ({"text_config": {"top_k_experts": 8, "num_experts": 128}}, 8),  # Gemma 4, nested
    ({"num_experts_per_token": 8, "num_experts": 256}, 8),  # Bailing, Kimi-Linear
    ({"num_experts_per_tok": 4, "moe_k": 6, "num_experts": 64}, 4),  # the usual name first
])
def test_top_k_is_read_under_each_familys_name(fields, top_k):
    """A plan's top-k from config.json under the name its family gives it (transformers' attribute_map), so the
    checks before the download pass these models (they said 'has no num_experts_per_tok' until 29 Nov)."""
    raw = {"hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
           "vocab_size": 384, **fields}
    assert text_fields(raw)["num_experts_per_tok"] == top_k
    check_config_fields(raw, "config.json")


def test_a_per_layer_list_of_several_values_is_refused_in_one_line():
    raw = {"hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
           "vocab_size": 384, "num_experts": 64, "moe_topk": [8, 8, 4, 4]}
    with pytest.raises(FmoeError, match="num_experts_per_tok must be an integer, got \\[8, 8, 4, 4\\]"):
        check_config_fields(raw, "config.json")


def test_layer_count_of_a_config_with_per_layer_block_types():
    """Nemotron-H's config.json may give its layers as `layers_block_type` (transformers drops num_hidden_layers)."""
    raw = {"layers_block_type": ["mamba", "moe", "attention", "moe"], "n_routed_experts": 8}
    assert text_fields(raw)["num_hidden_layers"] == 4


def tiny(model_type: str, **fields):
    return transformers.AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=384, **fields)


@pytest.mark.parametrize("config, why", [
    # MiniMax keeps its lightning attention's states in MiniMaxCache, refusing the caches fmoe generates with
    (lambda: tiny("minimax", num_local_experts=8, num_experts_per_tok=2, head_dim=16,
                  layer_types=["linear_attention", "full_attention"]), "a cache of its own (MiniMaxCache)"),
    # ZAYA routes through an MLP: no [N, H] matrix for the predictors
    (lambda: tiny("zaya", num_experts=8, num_experts_per_tok=1),
     "no router with a weight matrix to its 8 experts"),
    # Qwen3-VL-MoE: an image-text model only, no causal LM (AutoModelForCausalLM raised a ValueError traceback)
    (lambda: transformers.AutoConfig.for_model("qwen3_vl_moe"), "(qwen3_vl_moe): transformers registers no AutoModelForCausalLM"),
    # gpt-oss: biased experts with a clamped, interleaved gate
    (lambda: tiny("gpt_oss", num_local_experts=8, num_experts_per_tok=2, head_dim=16),
     "experts with biases are not served yet"),
])
def test_what_cannot_be_served_is_refused_in_one_line(config, why):
    with pytest.raises(FmoeError) as refused:
        build_skeleton(config(), torch.float32, "model")
    message = str(refused.value)
    assert why in message and "\n" not in message


def static_cache_bytes(config, tokens: tuple[int, ...], dtype=torch.float32) -> list[int]:
    """The bytes transformers' StaticCache (the GPU's decode cache) holds after a forward of each of `tokens` tokens
    (one random model of `config`): keys, values, indexer keys, and a linear-attention layer's conv and recurrent
    states (dicts of one tensor a state)."""
    from transformers import StaticCache

    from fmoe_cli.generate import cache_kwarg

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    sizes = []
    for length in tokens:
        cache = StaticCache(config=model.config, max_cache_len=length)
        with torch.no_grad():
            model(torch.randint(2, 60, (1, length)), **{cache_kwarg(model): cache}, use_cache=True)
        held = {id(t): t for layer in cache.layers for value in vars(layer).values()
                for t in (value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple))
                          else [value])
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 3}
        sizes.append(sum(t.numel() * t.element_size() for t in held.values()))
    return sizes


def survey_config(family: str, **overrides):
    """The survey's tiny config of `family` (benchmarks/families_survey.py), its sliding window (if it has one) 8."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    default = CONFIG_MAPPING[families_survey.TEXT_MODEL.get(family, family)]()
    window = {"sliding_window": 8} if getattr(default, "sliding_window", None) else {}
    return families_survey.tiny_config(family, 64, 1, 0, **window, **overrides)


@pytest.mark.parametrize("family", families_survey.SERVED_EXACTLY)
def test_the_kv_cache_a_plan_reserves_is_what_transformers_allocates(family):
    """plan.kv_cache_bytes against the bytes a StaticCache holds, for every family the survey serves exactly, its
    tiny config at 5 and 20 tokens (below and above a sliding window of 8), float32 and bf16: per-head K and V,
    multi-head latent attention's latent (DeepSeek: one kv_lora_rank + qk_rope row a layer, 71× less than the expanded
    heads on DeepSeek-V3), a sliding-window layer's window and its own heads (Inkling, MiMo-V2-Flash), dots3's layers
    of their own heads and its indexer's keys (float32), a linear-attention or state-space layer's fixed state (its
    conv states; its recurrent state, float32), Inkling's four short convolutions a layer (float32). Until 29 Nov
    the states were not counted here: the plan was under on Inkling (10.7× at 12 tokens) and on every hybrid at few
    tokens (Jamba 2.7×), over at many."""
    from fmoe_cli.planning import plan

    config = survey_config(family)
    for dtype in (torch.float32, torch.bfloat16):
        for tokens, held in zip((5, 20), static_cache_bytes(config, (5, 20), dtype)):
            planned = plan.kv_cache_bytes(config, tokens, torch.tensor([], dtype=dtype).element_size())
            assert planned == held, (family, dtype, tokens, held, planned)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe", "jamba", "granitemoehybrid", "lfm2_moe"])
def test_a_linear_attention_layer_s_reserve_does_not_grow_with_tokens(family):
    """A linear-attention, state-space or short-convolution layer keeps a fixed state: the reserve grows by the
    attention layers' keys and values alone (Jamba's: where attn_layer_period and attn_layer_offset put them)."""
    from fmoe_cli.planning import plan

    config = survey_config(family)
    kinds = plan.cache_layers(config)
    attention = sum(kind == "full_attention" for _, kind, _ in kinds)
    assert 0 < attention < len(kinds)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = attention * 2 * config.num_key_value_heads * head_dim * 4  # K and V of each, float32
    assert plan.kv_cache_bytes(config, 100_000, 4) - plan.kv_cache_bytes(config, 10, 4) == 99_990 * per_token
    assert plan.kv_cache_bytes(config, 10, 4) > 10 * per_token  # and the fixed states beside them


@pytest.mark.parametrize("family, overrides", [
    ("afmoe", {}),  # 3 sliding layers of 4
    ("gemma4_text", {"layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]}),
])
def test_a_sliding_window_layer_s_kv_reserve_is_its_window(family, overrides):
    """A sliding-window layer's static cache holds its window, not the context: 12 tokens, a window of 4."""
    from fmoe_cli.models.demo import tiny_config
    from fmoe_cli.planning import plan

    config = tiny_config(family, vocab_size=64, sliding_window=4, **overrides)
    (held,), planned = static_cache_bytes(config, (12,)), plan.kv_cache_bytes(config, 12, 4)
    assert held <= planned <= 1.05 * held, (held, planned)
    assert planned < plan.kv_cache_bytes(config, 1, 4) * 12  # (the window caps it)
