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
from fmoe_cli.types import REPETITION_PENALTY_RANGE, ExpertShape

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


# The names some families' config.json give a field a plan reads (their configuration class's attribute_map):
# ERNIE-4.5's moe_k, Hunyuan's and Aria's moe_topk, Bailing's and Kimi-Linear's num_experts_per_token, Gemma 4's
# top_k_experts, Bailing's and Kimi-Linear's model_max_length.
ALIASES = {"num_experts_per_tok": ("moe_k", "moe_topk", "num_experts_per_token", "top_k_experts"),
           "max_position_embeddings": ("model_max_length",)}


# The fields a family may give per layer, each layer the same (Hunyuan-A13B's `moe_topk: [8] * 32`), read as one
# integer; only these (a list of layer indices, as Qwen's `mlp_only_layers: [0]`, stays a list)
PER_LAYER_FIELDS = frozenset({"num_experts_per_tok", *ALIASES["num_experts_per_tok"], *EXPERT_COUNT_KEYS,
                              *INTERMEDIATE_KEYS, "num_shared_expert"})


def uniform_value(value: object) -> object:
    """A per-layer list of one integer repeated (Hunyuan-A13B's `moe_topk: [8, 8, …]`, its
    `moe_intermediate_size`) as that integer; anything else as it is (a list of several values stays a list, and
    is refused as no integer). For the fields in PER_LAYER_FIELDS only."""
    if isinstance(value, list) and value and all(type(v) is int for v in value) and len(set(value)) == 1:
        return value[0]
    return value


def config_top_k(config) -> int | None:
    """A transformers config object's experts per token, under any of its families' names (`ALIASES`)."""
    for key in ("num_experts_per_tok", *ALIASES["num_experts_per_tok"]):
        value = uniform_value(getattr(config, key, None))
        if type(value) is int:
            return value
    return None


def text_fields(raw: dict) -> dict:
    """The language model's fields (a multimodal config nests them in `text_config`), each field a plan reads under
    its usual name (`ALIASES`; Nemotron-H's layer count from its per-layer block types), a per-layer list of one value
    as that value (`uniform_value`)."""
    nested = raw.get("text_config")
    fields = {**raw, **nested} if isinstance(nested, dict) else dict(raw)
    fields = {key: uniform_value(value) if key in PER_LAYER_FIELDS else value for key, value in fields.items()}
    for key, aliases in ALIASES.items():
        if fields.get(key) is None:
            fields[key] = next((fields[a] for a in aliases if fields.get(a) is not None), None)
    blocks = fields.get("layers_block_type")
    if fields.get("num_hidden_layers") is None and isinstance(blocks, list):
        fields["num_hidden_layers"] = len(blocks)
    return fields


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
    return model_context(text_fields(raw))


def model_context(fields: dict) -> int | None:
    """The model's own context (max_position_embeddings, `text_fields`'), where it says."""
    context = fields.get("max_position_embeddings")
    return context if type(context) is int and context > 0 else None


def quantization_of(raw: dict) -> object:
    """config.json's quantization_config, at its top or in its text model's fields."""
    return raw.get("quantization_config") or text_fields(raw).get("quantization_config")


def block_scaled_fp8(quantization: object) -> bool:
    """Whether a `quantization_config` is transformers' fine-grained fp8 (float8 weights, a float32 scale per block of
    `weight_block_size`): fmoe dequantizes those as it reads them (models/checkpoint.py `dequantize`)."""
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "fp8":
        return False
    block = quantization.get("weight_block_size")
    return isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)


def fp8_block(path: Path) -> tuple[int, int] | None:
    """The [rows, columns] of a block-scaled fp8 checkpoint's blocks (its config.json's weight_block_size), None for
    any other."""
    quantization = quantization_of(read_json(path, "model config"))
    return tuple(quantization["weight_block_size"]) if block_scaled_fp8(quantization) else None


def check_servable(path: Path, label: str, trust_remote_code: bool = False) -> dict:
    """config.json's fields (`check_config_file`), then what makes a checkpoint one fmoe cannot serve, from config.json
    alone: weights stored quantised (a `quantization_config`: GPTQ, AWQ, bitsandbytes, per-tensor fp8 …; fmoe reads
    float weights, and block-scaled fp8 ones, and quantises the experts itself) and a dense model. For a hub id this runs on its config.json before the
    weights are downloaded (models/hub.py `fetch_model_early`), not after tens of gigabytes. Returns the fields.
    A model with its own code (`trust_remote_code`) may name its experts otherwise: left to the loaded config."""
    raw = read_json(path, "model config")
    check_config_fields(raw, str(path))
    fields = text_fields(raw)
    quantization = quantization_of(raw)
    if quantization and not block_scaled_fp8(quantization):
        method = quantization.get("quant_method", "unnamed") if isinstance(quantization, dict) else "unnamed"
        raise FmoeError(f"{label}'s weights are stored quantised ({method}: config.json's quantization_config); fmoe "
                        f"reads bfloat16, float16 or float32 checkpoints, and block-scaled fp8 ones, and quantises the "
                        f"experts itself (--experts int8, int4 or int2): use the model's unquantised checkpoint")
    counted = any(type(fields.get(key)) is int and fields[key] > 0 for key in EXPERT_COUNT_KEYS)
    if not counted and not trust_remote_code:
        raise FmoeError(f"{label} ({fields.get('model_type', 'no model_type')}): config.json names no routed experts "
                        f"({', '.join(EXPERT_COUNT_KEYS)}): a dense model, or a Mixture-of-Experts family fmoe does "
                        f"not serve")
    return fields


# The configuration classes' defaults of the fields that place a family's MoE layers (transformers 5's
# configuration_*.py), for a config.json that leaves them out.
_FIRST_DENSE_DEFAULT = {"deepseek_v2": 0, "deepseek_v3": 3}


def moe_layer_indices(fields: dict) -> list[int] | None:
    """The decoder layers that hold routed experts, as transformers' modeling_*.py builds them from these fields, for
    the families fmoe knows (None for others): what a check before the download counts (models/room.py). Held to the
    built skeleton's layers in tests/test_room.py."""
    kind, count = fields.get("model_type"), fields.get("num_hidden_layers")
    if type(count) is not int or count < 1:
        return None  # (a model with its own code may name it otherwise: --trust-remote-code lets it through)
    if kind in ("mixtral", "olmoe"):
        return list(range(count))
    if kind in ("qwen2_moe", "qwen3_moe"):  # (i not in mlp_only_layers) and (i + 1) % decoder_sparse_step == 0
        step, only = fields.get("decoder_sparse_step") or 1, fields.get("mlp_only_layers") or []
        if type(step) is not int or step < 1 or not isinstance(only, list):
            return None
        return [i for i in range(count) if i not in only and (i + 1) % step == 0]
    if kind in _FIRST_DENSE_DEFAULT:  # i >= first_k_dense_replace
        first = fields.get("first_k_dense_replace")
        return list(range(_FIRST_DENSE_DEFAULT[kind] if first is None else first, count))
    return None


def config_expert_shape(fields: dict, dtype_bytes: int, experts: str) -> ExpertShape | None:
    """The routed experts' shape from config.json's fields (`check_servable`'s), with the compute dtype's bytes and
    the experts' format: `models/load.py expert_shape` of the built skeleton, known before the download. None for a
    family whose MoE layers `moe_layer_indices` cannot place."""
    layers = moe_layer_indices(fields)
    count = next((fields[k] for k in EXPERT_COUNT_KEYS if type(fields.get(k)) is int and fields[k] > 0), None)
    intermediate = next((fields[k] for k in INTERMEDIATE_KEYS if type(fields.get(k)) is int), None)
    sizes = (fields.get("num_experts_per_tok"), fields.get("hidden_size"))
    if not layers or count is None or intermediate is None or not all(type(v) is int for v in sizes):
        return None
    return ExpertShape(len(layers), count, fields["num_experts_per_tok"], fields["hidden_size"], intermediate,
                       dtype_bytes, experts)


# The sampling a model's authors recommend, from its generation_config.json (chat and serve start from it): each
# field with the range transformers' GenerationConfig accepts.
SAMPLING_FIELDS = {"temperature": (float, 0.0, float("inf")), "top_p": (float, 0.0, 1.0), "top_k": (int, 0, 1 << 24),
                   "min_p": (float, 0.0, 1.0), "repetition_penalty": (float, *REPETITION_PENALTY_RANGE)}


def sampling_defaults(model_dir: Path | None) -> dict[str, float | int]:
    """generation_config.json's temperature, top_p, top_k, min_p and repetition_penalty where it samples (`do_sample`
    true), each a number in its range (a field that is not is left out); {} for a model without one, or one that
    decodes greedily."""
    path = None if model_dir is None else Path(model_dir) / "generation_config.json"
    if path is None or not path.is_file():
        return {}
    try:
        raw = read_json(path, "generation config")
    except FmoeError:
        return {}  # (transformers too goes on without a broken generation_config.json)
    if not isinstance(raw, dict) or raw.get("do_sample") is not True:
        return {}
    found: dict[str, float | int] = {}
    for key, (kind, low, high) in SAMPLING_FIELDS.items():
        value = raw.get(key)
        if type(value) in ((int, float) if kind is float else (int,)) and low <= value <= high:
            found[key] = kind(value)
    return found
