"""The built-in `demo` model: works offline, on first use.

If the package ships trained demo weights (`fmoe_cli/models/demo_model/`), that is
the demo. Otherwise fmoe builds a tiny *random-weight* Mixtral locally (seeded, so
every machine gets the same one): enough to exercise and measure the engine, not
to talk to. Its name says so wherever it is shown.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import platformdirs
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from fmoe_cli.models.hub import SHIPPED_DEMO

SHIPPED = SHIPPED_DEMO
RANDOM_DEMO_VERSION = "random-v1"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = (
    "In the beginning the offloading engine moved experts from the host to the device. "
    "A mixture of experts routes every token to a few experts; the router decides which. "
    "Hot experts stay on the device, cold experts wait in host memory until they are needed. "
    "The quick brown fox jumps over the lazy dog while the cache keeps what it will use again. "
)


def demo_label(path: Path) -> str:
    if path == SHIPPED:
        return "fmoe demo (tiny trained demo model, not a useful assistant)"
    return "fmoe demo (RANDOM weights: for measuring the engine, its text is noise)"


def demo_path(cache_dir: Path | None = None) -> Path:
    if (SHIPPED / "config.json").exists():
        return SHIPPED
    path = (cache_dir or Path(platformdirs.user_cache_dir("fmoe"))) / f"demo-{RANDOM_DEMO_VERSION}"
    if not (path / "model.safetensors").exists():
        build_random_moe(path, family="mixtral", seed=0)
    return path


def build_tokenizer(vocab_size: int = 384):
    """A small byte-level BPE tokenizer with a chat template (no download)."""
    specials = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


# Tiny shapes of every supported family: the tests' fixtures and the random demo.
TINY_FAMILIES: dict[str, tuple[str, dict]] = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        intermediate_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=96, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        head_dim=16, intermediate_size=128, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=64, num_experts=8, num_experts_per_tok=2)),
    # DeepSeek: shared expert, a dense first layer, MLA (one KV head per query head).
    "deepseek_v2": ("DeepseekV2Config", dict(
        num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=64, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, topk_method="greedy")),
    "deepseek_v3": ("DeepseekV3Config", dict(
        num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=64, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        routed_scaling_factor=1.5)),
    # GLM-4.5: sigmoid routing with a correction bias, group-limited, scaled; a shared expert, a dense first layer.
    "glm4_moe": ("Glm4MoeConfig", dict(
        intermediate_size=128, moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.5)),
    # Gemma 4: the experts beside a dense MLP in every layer, a router module around its projection, GELU experts,
    # top-k as top_k_experts (full attention only: a sliding window's decode steps do not replay from CUDA graphs).
    "gemma4_text": ("Gemma4TextConfig", dict(
        head_dim=16, global_head_dim=16, intermediate_size=128, enable_moe_block=True, num_experts=8, top_k_experts=2,
        moe_intermediate_size=64, hidden_size_per_layer_input=16, vocab_size_per_layer_input=384,
        layer_types=["full_attention"] * 4)),
}
# Families served and checked more cheaply (tests/test_families.py: resident and one split policy against
# transformers), each for what it does differently.
MORE_FAMILIES: dict[str, tuple[str, dict]] = {
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(  # top-k as moe_k, experts as moe_num_experts, a dense first layer
        intermediate_size=128, moe_intermediate_size=64, moe_num_experts=8, moe_k=2, moe_layer_start_index=1)),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", dict(  # top-k as moe_topk, a per-layer list as Hunyuan-A13B's
        head_dim=16, intermediate_size=128, num_experts=8, moe_topk=[2, 2, 2, 2])),  # config.json; the router in `wg`
    "afmoe": ("AfmoeConfig", dict(  # the router's matrix in its `gate`; a shared expert, a dense first layer
        head_dim=16, intermediate_size=128, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
        num_dense_layers=1, num_shared_experts=1,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"])),
    "inkling_text": ("InklingTextConfig", dict(  # the router's rows: the routed experts', then the shared experts'
        head_dim=16, intermediate_size=128, moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, layer_types=["hybrid_sliding"] * 4, mlp_layer_types=["sparse"] * 4)),
    "phimoe": ("PhimoeConfig", dict(intermediate_size=128, num_local_experts=8, num_experts_per_tok=2)),
    "granitemoe": ("GraniteMoeConfig", dict(  # the MoE block as `block_sparse_moe`, no `mlp`
        intermediate_size=128, num_local_experts=8, num_experts_per_tok=2)),
    "qwen3_next": ("Qwen3NextConfig", dict(  # linear-attention layers, a gated shared expert
        head_dim=16, intermediate_size=128, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
        shared_expert_intermediate_size=96, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, layer_types=["linear_attention"] * 3 + ["full_attention"])),
}


# The routers' matrices (Hunyuan's gate.wg, Gemma 4's router.proj, Inkling's gate): spread in a random checkpoint.
ROUTER_WEIGHTS = ("gate.weight", "gate.wg.weight", "router.proj.weight", "router.gate.weight")


def tiny_config(family: str, vocab_size: int, eos_token_id: int = 1, pad_token_id: int = 0, **overrides):
    config_class, shape = TINY_FAMILIES[family] if family in TINY_FAMILIES else MORE_FAMILIES[family]
    kwargs = dict(
        bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=pad_token_id, vocab_size=vocab_size,
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False,
    )
    kwargs.update(shape)
    kwargs.update(overrides)
    return getattr(transformers, config_class)(**kwargs)


def build_random_moe(path: Path, family: str = "mixtral", seed: int = 0, **overrides) -> Path:
    """Save a seeded random MoE checkpoint (safetensors + tokenizer) in the hub layout."""
    tokenizer = build_tokenizer()
    config = tiny_config(
        family, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        **overrides,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init gives near-uniform routers; spread the router weights so that routing varies.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(ROUTER_WEIGHTS) and p.dim() == 2:
                p.normal_(0.0, 0.5)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def write_untied_demo(path: Path) -> Path:
    """The shipped demo with its LM head untied from the embedding (the head a copy of the trained embedding, so the
    same logits): a trained model whose head `--dense` quantises (the demo's own head is the embedding, a lookup).
    For the dense tolerance (tests/test_dense.py, benchmarks/quantization.py)."""
    model = AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(SHIPPED).save_pretrained(path)
    return path


FP8_BLOCK = 32  # the tiny models' 64- or 128-wide weights in whole blocks (real checkpoints: 128 × 128)
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


def quantize_fp8(weight: torch.Tensor, block: int = FP8_BLOCK, e8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] -> float8 e4m3 [R, C] and its scale grid [ceil(R / block), ceil(C / block)] (each block's max at 448; the
    last blocks cut short where `block` does not divide the weight, as DeepSeek-V3's kv_a_proj_with_mqa): float32, or
    with `e8m0` each scale rounded up to a power of two 2^e and stored as the byte e + 127 (scale_fmt "ue8m0")."""
    rows, cols = weight.shape
    grid = (-(-rows // block), -(-cols // block))
    padded = torch.nn.functional.pad(weight.float(), (0, grid[1] * block - cols, 0, grid[0] * block - rows))
    blocks = padded.reshape(grid[0], block, grid[1], block)
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12) / 448.0
    if e8m0:
        scale = scale.log2().ceil().exp2()
    fp8 = (blocks / scale).to(torch.float8_e4m3fn).reshape(grid[0] * block, grid[1] * block)[:rows, :cols]
    scale = scale.reshape(grid)
    return fp8.contiguous(), (scale.log2() + 127).to(torch.uint8) if e8m0 else scale


def write_fp8_copy(source: Path, path: Path, e8m0: bool = False) -> list[str]:
    """A copy of the float checkpoint at `source` in the block-scaled fp8 layout (DeepSeek-V3's, the -FP8
    repositories'): every linear weight stored as float8 with its scales (a weight the block does not divide with its
    last blocks cut short; `e8m0`: powers of two stored as bytes, scale_fmt "ue8m0"), embeddings, LM head, norms and
    routers left float as in those checkpoints; returns the keys stored as float8. For tests/test_fp8.py and
    benchmarks/gpu_check.py."""
    shutil.copytree(source, path)
    tensors = load_file(str(path / "model.safetensors"))
    stored, scaled = {}, []
    for key, value in tensors.items():
        linear = value.dim() == 2 and key.endswith(".weight") and not any(
            part in key for part in ("embed", "lm_head", ".gate.weight", "norm"))
        if linear:
            stored[key], stored[key + "_scale_inv"] = quantize_fp8(value, e8m0=e8m0)
            scaled.append(key)
        else:
            stored[key] = value
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    quantization = {**FP8_QUANTIZATION, "scale_fmt": "ue8m0"} if e8m0 else FP8_QUANTIZATION
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    return scaled
