"""A model's config.json, checked as the user wrote it, before transformers reads it (no torch).

transformers fills a missing field with its class default (Mixtral's hidden_size 4096) and
refuses a mistyped one with a traceback; a plan made from either is silently wrong. Every field
a plan needs must be there, be an integer (not "4096", not 1e12) within what any model has, and
agree with the others (top-k ≤ the number of experts).
"""

from __future__ import annotations

from pathlib import Path

from fmoe_cli.errors import FmoeError
from fmoe_cli.files import read_json

# Config keys that name the number of routed experts, by family.
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
INTERMEDIATE_KEYS = ("moe_intermediate_size", "intermediate_size")  # an expert's neurons I (the first present)
# Every field a plan reads, with the largest value any model has by far (a larger one is a typo).
REQUIRED = {"hidden_size": 1 << 18, "num_hidden_layers": 1 << 12, "num_attention_heads": 1 << 12,
            "vocab_size": 1 << 24, "num_experts_per_tok": 1 << 12}
OPTIONAL = {"num_key_value_heads": 1 << 12, "head_dim": 1 << 16, "max_position_embeddings": 1 << 30,
            "first_k_dense_replace": 1 << 12}
MAX_EXPERTS = 1 << 12  # routed experts per layer (planning/stats.py keeps an N×N histogram per layer)
MAX_INTERMEDIATE = 1 << 20


def text_fields(raw: dict) -> dict:
    """The language model's fields (a multimodal config nests them in `text_config`)."""
    nested = raw.get("text_config")
    return {**raw, **nested} if isinstance(nested, dict) else raw


def _count(fields: dict, key: str, limit: int, source: str) -> int:
    value = fields[key]
    if type(value) is not int:
        raise FmoeError(f"{source}: {key} must be an integer, got {value!r}")
    if not 1 <= value <= limit:
        raise FmoeError(f"{source}: {key} = {value} is not a size any model has (1 to {limit})")
    return value


def check_config_fields(raw: object, source: str) -> None:
    """One line for the first field of a MoE config that is missing, mistyped, out of range or
    inconsistent. A config without a routed-expert count is left to the dense-model check."""
    if not isinstance(raw, dict):
        raise FmoeError(f"{source} is not a JSON object")
    fields = text_fields(raw)
    experts_key = next((k for k in EXPERT_COUNT_KEYS if fields.get(k) is not None), None)
    if experts_key is None:
        return  # no routed experts: a dense model, refused as such once transformers has read it
    experts = _count(fields, experts_key, MAX_EXPERTS, source)
    for key, limit in REQUIRED.items():
        if fields.get(key) is None:
            raise FmoeError(f"{source} has no {key} (a plan needs it; fmoe never assumes a default)")
        _count(fields, key, limit, source)
    for key, limit in OPTIONAL.items():
        if fields.get(key) is not None and not (key == "first_k_dense_replace" and fields[key] == 0):
            _count(fields, key, limit, source)
    intermediate = next((k for k in INTERMEDIATE_KEYS if fields.get(k) is not None), None)
    if intermediate is None:
        raise FmoeError(f"{source} has no {' or '.join(INTERMEDIATE_KEYS)} (an expert's size)")
    _count(fields, intermediate, MAX_INTERMEDIATE, source)
    k = fields["num_experts_per_tok"]
    if k > experts:
        raise FmoeError(f"{source}: num_experts_per_tok = {k} routes to more experts than the {experts} "
                        f"of each layer ({experts_key})")
    if fields["hidden_size"] % fields["num_attention_heads"] and fields.get("head_dim") is None:
        raise FmoeError(f"{source}: hidden_size {fields['hidden_size']} is not a multiple of "
                        f"num_attention_heads {fields['num_attention_heads']}")
    dense = fields.get("first_k_dense_replace") or 0
    if dense >= fields["num_hidden_layers"]:
        raise FmoeError(f"{source}: first_k_dense_replace = {dense} leaves no MoE layer of "
                        f"{fields['num_hidden_layers']}")


def check_config_file(path: Path) -> int | None:
    """config.json read (size-limited) and its fields checked (`check_config_fields`); returns the model's context
    (max_position_embeddings) where it says, so that the options beyond it are refused before torch is imported."""
    raw = read_json(path, "model config")
    check_config_fields(raw, str(path))
    context = text_fields(raw).get("max_position_embeddings")
    return context if type(context) is int and context > 0 else None
