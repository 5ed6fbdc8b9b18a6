#!/usr/bin/env python3
"""Every MoE family of the installed transformers through fmoe: served exactly, refused, or served wrongly.

For each causal-LM family whose experts module uses transformers' `use_experts_implementation`, a tiny random
checkpoint (hidden 64, 4 layers, 8 experts top-2, the family's other sizes shrunk to fit; saved as
models/demo.py's `build_random_moe` saves one, with its tokenizer) is run greedily by transformers (float32, CPU:
the reference, as tests/test_exactness.py's `transformers_answer`) and by fmoe's engine (load_model + Engine +
stream_generate, as the tests' `_family_setup`) under `resident`, then `lru`, `moepic` and `uniform` (θ = 0.5) at a
tight budget (the staging pool plus one expert), on the CPU's path (its C kernels) and on the device's (torch's
matmuls, routing used on the device, as tests/test_exactness.py's `cuda` link). The policies plan with fixed
timings; the per-layer profile that `fmoe bench` and `chat` plan moepic and hybrid with is taken once too, and must
time every MoE layer the engine serves. Each family's outcome:

- exact: every policy gives transformers' tokens;
- refused: fmoe raised its one-line error (FmoeError) — the line is shown;
- WRONG: a policy's tokens differ (the first differing position);
- crash: any other exception (its type and message);
- skipped: no tiny causal LM builds from the config, or transformers' own generate fails on it — why.

A family transformers builds no causal LM of (multimodal, OCR, diffusion) goes through fmoe's loader up to the
weights only (its default config: refused or not). gemma4 and qwen3_5_moe are also run from an image-text checkpoint
(`MULTIMODAL`), as their hub checkpoints are.

    python benchmarks/families_survey.py [--out DIR] [--families a,b] [--tokens 32]

Checkpoints go to DIR (default: a temporary directory); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from fmoe_cli import kernels  # noqa: E402
from fmoe_cli.errors import FmoeError  # noqa: E402
from fmoe_cli.generate import stream_generate  # noqa: E402
from fmoe_cli.models.demo import ROUTER_WEIGHTS, build_tokenizer  # noqa: E402
from fmoe_cli.models.families import check_is_moe  # noqa: E402
from fmoe_cli.models.load import build_skeleton, load_model  # noqa: E402
from fmoe_cli.offload.engine import Engine  # noqa: E402
from fmoe_cli.offload.link import EmulatedLink, VirtualClock  # noqa: E402
from fmoe_cli.planning.presets import make_settings  # noqa: E402
from fmoe_cli.profiling.files import model_identity  # noqa: E402
from fmoe_cli.profiling.layers import time_layers  # noqa: E402
from fmoe_cli.types import Timings  # noqa: E402

PROMPT = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11, 64, 128]])  # tests/test_exactness.py's
TIMINGS = Timings(t_att=1e-4, t_moe=2e-4, t_head=1e-4, t_load=3e-4, top_k=2)
POLICIES = [("resident", None), ("lru", None), ("moepic", None), ("uniform", 0.5)]

# Sizes set wherever the family's config has the field (a family without it keeps its default).
SIZES = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts=8, n_routed_experts=8, moe_num_experts=8,
    num_experts_per_tok=2, moe_k=2, max_position_embeddings=512, tie_word_embeddings=False,
    shared_expert_intermediate_size=96, moe_shared_expert_intermediate_size=64, n_shared_experts=1,
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, qk_head_dim=24,
    n_group=2, topk_group=1, first_k_dense_replace=1, num_dense_layers=1, moe_layer_start_index=1,
    num_shared_experts=1,
    # linear attention / state-space mixers
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_expand=2, mamba_dt_rank=8,
    ssm_state_size=16, num_nextn_predict_layers=0, index_n_heads=4, index_head_dim=16, index_topk=64,
)
# What the survey served exactly (29 Nov 2026, docs/architecture.md § Families): tests/test_families.py holds the KV
# cache a plan reserves for each to the bytes of transformers' StaticCache of its tiny config.
SERVED_EXACTLY = (
    "afmoe", "aria", "axk1", "axk2", "cohere2_moe", "deepseek_v2", "deepseek_v3", "deepseek_v32", "dots1", "dots3_note",
    "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint", "gemma4", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa",
    "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "inkling",
    "jamba", "kolibri1", "laguna", "lfm2_moe", "mellum", "mimo_v2_flash", "minimax_m2", "mixtral", "olmoe", "phimoe",
    "qwen2_moe", "qwen3_5_moe", "qwen3_moe", "qwen3_next", "qwen4_exp", "solar_open",
)
# Families whose MoE layer placement or other fields need more than SIZES.
EXTRA: dict[str, dict] = {
    "deepseek_v2": dict(topk_method="greedy"),
    "qwen3_moe": dict(norm_topk_prob=True),
    "jamba": dict(attn_layer_period=4, attn_layer_offset=2),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "granitemoehybrid": dict(mamba_n_heads=8, mamba_d_head=16,
                             layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]),
    "zaya": dict(num_experts_per_tok=1),
    "gemma4": dict(enable_moe_block=True, top_k_experts=2, hidden_size_per_layer_input=16,
                   vocab_size_per_layer_input=384, global_head_dim=16),
    "inkling2": dict(unpadded_vocab_size=384, swa_num_attention_heads=4, swa_num_key_value_heads=2),
    "inkling2_loop": dict(unpadded_vocab_size=384, swa_num_attention_heads=4, swa_num_key_value_heads=2),
    "qwen4_exp": dict(indexer_compress_ratio=4, indexer_budget=64, indexer_n_heads=2, indexer_kv_heads=1,
                      indexer_head_dim=16),
}
# Multimodal configs: their text model, where transformers registers one as a causal LM.
TEXT_MODEL = {
    "aria": "aria_text", "gemma4": "gemma4_text", "dots3_note": "dots3_note_text", "qwen3_5_moe": "qwen3_5_moe_text",
    "qwen4_exp": "qwen4_exp_text", "minimax_m3_vl": "minimax_m3_vl_text", "inkling": "inkling_text",
    "inkling2": "inkling2_text", "inkling2_loop": "inkling2_loop_text",
}
# Families whose hub checkpoints are image-text models that AutoModelForCausalLM builds: also surveyed from such a
# checkpoint (the text model as above, a small vision tower).
MULTIMODAL = {
    "gemma4": dict(vision_config=None, audio_config=None),
    "qwen3_5_moe": dict(vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                           out_hidden_size=64, num_position_embeddings=64)),
}


def moe_families() -> list[str]:
    """Every model type whose modeling file decorates an experts module with `use_experts_implementation`."""
    root = Path(transformers.__file__).parent / "models"
    return sorted(p.parent.name for p in root.glob("*/modeling_*.py") if "use_experts_implementation" in p.read_text())


def shrink_lists(kwargs: dict, default, layers: int) -> None:
    """Per-layer lists of the default config (layer_types, mlp_layer_types …) cut to `layers`; a hybrid's
    layer_types keep one attention layer (transformers' cache needs one)."""
    total = vars(default).get("num_hidden_layers")
    for key, value in vars(default).items():
        if key.startswith("_") or not isinstance(value, list) or not value or key in kwargs:
            continue
        if key == "layer_types" or (len(value) == total and key != "mlp_only_layers"):
            kwargs[key] = value[:layers]
    kinds = kwargs.get("layer_types")
    attention = [k for k in vars(default).get("layer_types") or () if "attention" in k and "linear" not in k]
    if kinds and attention and not any(k in attention for k in kinds):
        kwargs["layer_types"] = kinds[:-1] + [attention[0]]


def tiny_config(family: str, vocab: int, eos: int, pad: int, **overrides):
    """The family's tiny text config (SIZES, EXTRA), `overrides` last (tests/test_families.py: a short window)."""
    model_type = TEXT_MODEL.get(family, family)
    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    fields = set(getattr(config_class, "__dataclass_fields__", ())) | set(config_class.attribute_map)
    kwargs = {k: v for k, v in SIZES.items() if k in fields}
    if "qk_rope_head_dim" in fields:  # MLA: its head_dim is the rope part; one KV head per query head
        kwargs.pop("head_dim", None)
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    shrink_lists(kwargs, default, kwargs.get("num_hidden_layers", 4))
    kwargs.update(EXTRA.get(family, {}))
    kwargs.update(vocab_size=vocab, eos_token_id=eos, pad_token_id=pad, bos_token_id=None, **overrides)
    return config_class(**kwargs)


def build(family: str, path: Path, seed: int = 1, multimodal: bool = False) -> Path:
    """multimodal: the family's image-text model around the tiny text model (`MULTIMODAL`'s small vision tower),
    saved as its hub checkpoints are."""
    if (path / "config.json").exists():
        return path
    tokenizer = build_tokenizer()
    config = tiny_config(family, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    if multimodal:
        config = CONFIG_MAPPING[family](text_config=config.to_dict(), **MULTIMODAL[family])
        model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # spread the routers (as build_random_moe): near-uniform routing hides routing bugs
        for name, p in model.named_parameters():
            if name.endswith((*ROUTER_WEIGHTS, "router.weight")) and p.dim() == 2:
                p.normal_(0.0, 0.5)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def reference_tokens(path: Path, tokens: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        return model.generate(PROMPT, max_new_tokens=tokens, do_sample=False)[0, PROMPT.shape[1]:].tolist()


def fmoe_tokens(path: Path, tokens: int, device_path: bool = False) -> dict[str, list[int]]:
    """Each policy's greedy tokens; device_path: the device's code path (torch's matmuls, routing used on the
    device: Engine.device_side), as tests/test_exactness.py's `cuda` link runs it, on the CPU."""
    with kernels.off() if device_path else contextlib.nullcontext():
        return _fmoe_tokens(path, tokens, device_path)


def _fmoe_tokens(path: Path, tokens: int, device_path: bool) -> dict[str, list[int]]:
    lm = load_model(str(path), device="cpu", dtype="float32")
    engine = Engine(lm.layers, lm.store, lm.shape, EmulatedLink(gbps=20, clock=VirtualClock(), copy=True),
                    lm.device, lm.dtype)
    engine.device_side = device_path
    engine.install(lm.model)
    tight = 2 * lm.shape.top_k * lm.shape.expert_bytes + lm.shape.expert_bytes
    timings = Timings(TIMINGS.t_att, TIMINGS.t_moe, TIMINGS.t_head, TIMINGS.t_load, lm.shape.top_k)
    got = {}
    try:
        if not device_path:  # what moepic and hybrid plan with in fmoe bench and chat: every MoE layer timed
            engine.configure(make_settings("resident", lm.shape, tight, timings=timings))
            timed = time_layers(lm.model, PROMPT, model_identity=model_identity(lm.model_id, lm.path / "config.json"),
                                top_k=lm.shape.top_k, decode_steps=1, repeats=1)
            moe = [t.index for t in timed.decode.layers if t.moe]
            if moe != [layer.decoder_index for layer in lm.layers]:
                raise RuntimeError(f"the profile times MoE layers {moe}, the engine serves "
                                   f"{[layer.decoder_index for layer in lm.layers]}")
        for policy, theta in POLICIES:
            engine.configure(make_settings(policy, lm.shape, tight, theta=theta, timings=timings))
            events = stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=tokens, stop_on_eos=False)
            got[policy + (" (device path)" if device_path else "")] = [e.token_id for e in events]
    finally:
        engine.close()
    return got


def skeleton_only(family: str) -> tuple[str, str]:
    """A family transformers builds no causal LM of: what fmoe's loader does with its (default) config, up to the
    weights."""
    try:
        config = CONFIG_MAPPING[family]()
        check_is_moe(config, family)
        build_skeleton(config, torch.float32, family)
    except FmoeError as exc:
        return "refused", first_line(exc)
    except Exception as exc:  # noqa: BLE001
        return "crash", f"{type(exc).__name__}: {first_line(exc)}"
    return "skipped", "no causal LM in transformers, yet fmoe built one (no tiny checkpoint made)"


def survey(family: str, root: Path, tokens: int, multimodal: bool = False) -> tuple[str, str]:
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            path = build(family, root / (family + ("-multimodal" if multimodal else "")), multimodal=multimodal)
    except Exception as exc:  # noqa: BLE001 - a survey: every failure is a row
        return "skipped", f"no tiny causal LM: {type(exc).__name__}: {first_line(exc)}"
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            want = reference_tokens(path, tokens)
    except Exception as exc:  # noqa: BLE001
        return "skipped", f"transformers' own generate fails: {type(exc).__name__}: {first_line(exc)}"
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            got = {**fmoe_tokens(path, tokens), **fmoe_tokens(path, tokens, device_path=True)}
    except FmoeError as exc:
        return "refused", first_line(exc)
    except Exception as exc:  # noqa: BLE001
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        return "crash", f"{type(exc).__name__}: {first_line(exc)} ({Path(frame.filename).name}:{frame.lineno})"
    wrong = [f"{p}@{first_difference(t, want)}" for p, t in got.items() if t != want]
    if wrong:
        return "WRONG", "first differing token: " + ", ".join(wrong)
    return "exact", f"{len(got)} runs, {len(set(want))} distinct tokens of {len(want)}"


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:160]


def first_difference(got: list[int], want: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="where the checkpoints go (default: a temp dir)")
    parser.add_argument("--families", default=None, help="comma-separated model types (default: every MoE family)")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = args.out or Path(tempfile.mkdtemp(prefix="fmoe-families-"))
    families = args.families.split(",") if args.families else moe_families()
    print(f"transformers {transformers.__version__}, {len(families)} families, checkpoints in {root}", flush=True)
    rows = []
    for family in families:
        start = time.perf_counter()
        model_type = TEXT_MODEL.get(family, family)
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            outcome, detail = skeleton_only(family)
        else:
            outcome, detail = survey(family, root, args.tokens)
        rows.append((family, outcome, detail))
        print(f"| {family} | {outcome} | {detail} | {time.perf_counter() - start:.0f} s", flush=True)
        if family in MULTIMODAL:  # its checkpoint as the hub has it: the image-text model's weights
            start, name = time.perf_counter(), f"{family} (image-text checkpoint)"
            outcome, detail = survey(family, root, args.tokens, multimodal=True)
            rows.append((name, outcome, detail))
            print(f"| {name} | {outcome} | {detail} | {time.perf_counter() - start:.0f} s", flush=True)
    print("\n| family | outcome | detail |\n|---|---|---|")
    for family, outcome, detail in rows:
        print(f"| {family} | {outcome} | {detail} |")
    counts = {}
    for _, outcome, _ in rows:
        counts[outcome] = counts.get(outcome, 0) + 1
    print(", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
    main()
