"""The families beyond the full exactness matrix (tests/test_exactness.py's TINY_FAMILIES): their config.json read under
their own field names."""

from __future__ import annotations

import pytest

from fmoe_cli.models.config import check_config_fields, text_fields


@pytest.mark.parametrize("fields, top_k", [
    ({"moe_k": 6, "moe_num_experts": 64}, 6),  # ERNIE-4.5
    ({"moe_topk": 8, "num_experts": 64}, 8),  # Hunyuan-A13B
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


def test_layer_count_of_a_config_with_per_layer_block_types():
    """Nemotron-H's config.json may give its layers as `layers_block_type` (transformers drops num_hidden_layers)."""
    raw = {"layers_block_type": ["mamba", "moe", "attention", "moe"], "n_routed_experts": 8}
    assert text_fields(raw)["num_hidden_layers"] == 4
