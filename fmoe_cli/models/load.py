"""Resolve a model id (hub or local directory) and load it: the model is built without
its routed experts (meta device), its other weights are read into it, and every
expert is read from the safetensors files straight into the host store
(models/checkpoint.py). Peak host memory: the store plus the non-expert weights.

Safe by default: weights come from safetensors only and a repository's own Python
code runs only with `trust_remote_code=True`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from fmoe_cli.errors import FmoeError, no_gpu, unknown_device, warn
from fmoe_cli.models import demo
from fmoe_cli.generate import TOKENIZER_FILES
from fmoe_cli.models.config import check_servable, config_top_k
from fmoe_cli.models.hub import download_model, local_model_dir
from fmoe_cli.models.room import check_host_ram
from fmoe_cli.models.attention import install_decode_attention
from fmoe_cli.models.decoder import install_decode_layers
from fmoe_cli.models.dense import (dense_bytes_saved, flatten_head_input, one_row_kernels, one_row_matvec,
                                   quantize_dense)
from fmoe_cli.models.families import MoeLayer, check_is_moe, find_moe_layers
from fmoe_cli.models.checkpoint import check_checkpoint, check_weight_files, read_checkpoint
from fmoe_cli.models.identity import checkpoint_fingerprint, model_key
from fmoe_cli.offload.converted import converted_path, open_converted, save_converted
from fmoe_cli.offload.quant import make_store
from fmoe_cli.offload.store import HostStore, trim_heap
from fmoe_cli.types import (
    DEFAULT_ACTIVATIONS,
    DEFAULT_DENSE,
    DEFAULT_EXPERTS,
    DENSE_FORMATS,
    DTYPES,
    EXPERT_FORMATS,
    ExpertShape,
    check_activations,
    check_dense_format,
    check_dtype,
    check_expert_format,
    resolve_activations,
    resolve_dense,
)

GiB = 1024**3


@dataclass
class LoadedModel:
    model_id: str
    path: Path
    label: str  # what to show the user
    model: torch.nn.Module
    tokenizer: object | None
    layers: list[MoeLayer]
    shape: ExpertShape
    store: HostStore
    device: torch.device
    dtype: torch.dtype
    non_expert_bytes: int  # U_n: everything of the model on the device but the routed experts (dense at stored size)
    dense: str = "bf16"  # how the attention (and head) are stored: types.DENSE_FORMATS (resolved: never auto)
    activations: str = DEFAULT_ACTIVATIONS  # what the CPU kernels multiply int8/int4 rows with (types.ACTIVATIONS)

    @property
    def timings_key(self) -> str:
        """The file-name key of this model's timings (its profile, a run's quick estimate): the model's key and the
        formats it runs in, whose times differ (one int2 expert's forward is not a bf16 one's; float32 compute is
        not bfloat16's). Keyed by the model alone until 28 Nov, a profile measured in one format planned every other."""
        return f"{model_key(self.model_id, self.path)}.{self.formats}"

    @property
    def formats(self) -> str:
        """The formats it runs in, `<experts>-<dense>-<dtype>-<activations>` (its timings' and their files' key)."""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.shape.experts}-{self.dense}-{dtype}-{self.activations}"


def has_int8_dots() -> bool:
    """The CPU kernels' AVX2 integer dots are here (experts.c q8_shape), which --activations int8 needs."""
    from fmoe_cli import kernels

    lib = kernels.library()
    return lib is not None and lib.fmoe_simd() > 0


def warn_without_int8_dots() -> None:
    """--activations int8 needs the CPU kernels' AVX2 integer dots (experts.c q8_shape); without them the float32
    dots run (exact), and one line says so rather than the mode silently not happening."""
    if not has_int8_dots():
        warn("--activations int8 needs the CPU kernels with AVX2, which this machine has not: the experts and dense "
             "rows multiply float activations (the exact path)")


def precision_label(dtype: str, experts: str, dense: str = "bf16", activations: str = DEFAULT_ACTIVATIONS) -> str:
    """What the user sees of the numbers: 'float32', 'bfloat16, int4 experts, int4 dense, int8 activations' or
    'float32, int8 experts, float activations': the activations wherever a row is quantised (the mode changes
    the numbers there, and neither mode is everywhere the default)."""
    quantised = EXPERT_FORMATS[experts] is not None or DENSE_FORMATS[dense] is not None
    parts = [dtype] + ([f"{experts} experts"] if EXPERT_FORMATS[experts] is not None else []) \
        + ([f"{dense} dense"] if DENSE_FORMATS[dense] is not None else []) \
        + ([f"{activations} activations"] if quantised else [])
    return ", ".join(parts)


def resolve_model(model_id: str, trust_remote_code: bool = False) -> tuple[Path, str]:
    """A local directory, `demo`, or a hub id (downloaded with a progress bar)."""
    if model_id == "demo":
        path = demo.demo_path()
        return path, demo.demo_label(path)
    path = local_model_dir(model_id) or download_model(model_id, trust_remote_code)
    _check_weights(path, model_id)
    return path, model_id


def _check_weights(path: Path, model_id: str) -> None:
    if any(path.glob("*.safetensors")):
        check_weight_files(path)  # a truncated or corrupt file: one line, before any slow work
        return
    if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        raise FmoeError(
            f"{model_id} has only pickle weights (.bin/.pt); fmoe loads safetensors only, because unpickling runs code"
        )
    raise FmoeError(f"{model_id} has no safetensors weights")


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise unknown_device(device) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise no_gpu(device)
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise FmoeError(f"device {device} requested but this machine has {count} CUDA GPU{'s' if count > 1 else ''}"
                            f" (cuda:0{f' to cuda:{count - 1}' if count > 1 else ''})")
        # the current device: every CUDA call that names none (streams, events, graphs, synchronize) is about this one
        torch.cuda.set_device(dev)
    return dev


BF16_CAPABILITY = (8, 0)  # Ampere on: native bfloat16 matmuls; below (T4, RTX 20-series) bfloat16 is emulated


def native_bf16(device: torch.device) -> bool:
    """Whether the CUDA card computes bfloat16 natively (compute capability ≥ 8.0)."""
    return tuple(torch.cuda.get_device_capability(device)) >= BF16_CAPABILITY


def pick_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """auto: float32 on the CPU; on CUDA bfloat16, or float16 on a card without native bfloat16."""
    if dtype in (None, "auto"):
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if native_bf16(device) else torch.float16
    check_dtype(dtype)
    return getattr(torch, DTYPES[dtype])


def load_model(
    model_id: str,
    device: str = "auto",
    dtype: str | None = None,
    trust_remote_code: bool = False,
    console: Console | None = None,
    experts: str = DEFAULT_EXPERTS,
    before_read=None,
    dense: str = DEFAULT_DENSE,
    activations: str = DEFAULT_ACTIVATIONS,
) -> LoadedModel:
    """`experts`: how the routed experts are stored (types.EXPERT_FORMATS): bf16 = unquantised, in `dtype`;
    `dense`: the attention projections (and LM head) (types.DENSE_FORMATS, models/dense.py);
    `activations`: what the CPU kernels multiply quantised rows with (types.ACTIVATIONS; "auto": the CLI's default,
    int8 on the CPU beside int8/int4 experts; left out here: float, the exact path).
    `before_read(shape, non_expert_bytes, config, device)`: the caller's checks once the sizes are
    known and before a weight is read (run.py: the expert budget against the device)."""
    console = console or Console(stderr=True)
    check_expert_format(experts)
    check_dense_format(dense)
    check_activations(activations)
    path, label = resolve_model(model_id, trust_remote_code)
    dev = pick_device(device)
    torch_dtype = pick_dtype(dtype, dev)
    dense = resolve_dense(dense, dev.type, experts)
    if activations == "int8" and dev.type == "cpu":
        warn_without_int8_dots()
    activations = resolve_activations(activations, dev.type, experts, int8_dots=dev.type == "cpu" and has_int8_dots())
    check_servable(path / "config.json", model_id, trust_remote_code)  # its fields, as written, before transformers reads them
    config = read_config(path, model_id, trust_remote_code)
    model, layers = build_skeleton(config, torch_dtype, model_id, trust_remote_code)
    shape = expert_shape(layers, torch_dtype, experts)
    non_expert_bytes = skeleton_non_expert_bytes(model, layers, dense)
    check_checkpoint(path, model, layers)  # every tensor's shape and dtype against the config, from the headers
    tokenizer = load_tokenizer(path, model_id, trust_remote_code)  # (a broken one named before the weights load)
    # before a byte is read; the load's peak holds the dense weights unquantised until each is quantised
    check_host_ram(label, shape, skeleton_non_expert_bytes(model, layers))
    if before_read is not None:
        before_read(shape, non_expert_bytes, config, dev)
    store = make_store(shape, torch_dtype, pin=dev.type == "cuda", activations=activations)
    to_save = None  # (path, fingerprint) of a converted store to write after this load
    try:
        mapped = None
        if EXPERT_FORMATS[experts] is not None:  # quantised: from the converted store if there is a good one
            fingerprint = checkpoint_fingerprint(path)
            converted = converted_path(fingerprint, experts)
            mapped = open_converted(converted, fingerprint, shape, console)
            if mapped is None:
                to_save = (converted, fingerprint)
        store.allocate(mapped)
        read_checkpoint(path, model, layers, store if mapped is None else None, torch_dtype, console)
        store.end_load()
        for layer in layers:
            _free_expert_weights(layer.experts, torch_dtype)
        _finish_skeleton(model, model_id)
        quantize_dense(model, dense, activations)  # one copy: each float weight is dropped once quantised
        flatten_head_input(model)  # a prefill's last-token slice: torch's fast bf16 matmul (models/dense.py)
        if dev.type == "cpu":
            if not one_row_kernels(model):  # a decode token's float rows through the kernels (models/dense.py)
                one_row_matvec(model)  # without them, bf16 rows as torch.mv: F.linear's bits sooner
    except BaseException:
        store.close()
        raise
    if to_save is not None:
        _save_converted(to_save[0], store, to_save[1], shape, console)
    model.eval().requires_grad_(False)
    model.to(dev)
    if dev.type == "cpu":
        install_decode_attention(model)  # q/k/v in one kernel call, a decode token's attention (models/attention.py)
        install_decode_layers(model)  # a decode token's norms, residual adds and router (models/decoder.py)
    non_expert = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    trim_heap()  # the load's freed temporaries back to the system, not resident for the run
    return LoadedModel(model_id, path, label, model, tokenizer, layers, shape, store, dev, torch_dtype, non_expert, dense,
                       activations)


def load_tokenizer(path: Path, model_id: str, trust_remote_code: bool = False):
    """The model's tokenizer; None when it has no tokenizer file at all (the weights still load: encoding a
    prompt then names the files it lacks, generate.no_tokenizer); a file that does not load: one line.
    Without any vocabulary file transformers may still build the config's tokenizer class with an empty
    vocabulary, which encodes every prompt to nothing: that is no tokenizer either."""
    from transformers import AutoTokenizer

    present = [name for name in TOKENIZER_FILES if (path / name).exists()]
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        if not present:
            return None
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise FmoeError(f"{model_id}: its tokenizer ({', '.join(present)}) does not load: {reason}") from None
    if not present and not tokenizer("a")["input_ids"]:
        return None
    return tokenizer


def _save_converted(path: Path, store, fingerprint: str, shape: ExpertShape, console: Console) -> None:
    """Keep the quantised store for the next load; a failure to save is a warning, not fatal."""
    try:
        with console.status(f"saving the {shape.experts} experts for the next start ({store.nbytes / GiB:.2f} GiB) …"):
            save_converted(path, store.layers, fingerprint, shape)
    except OSError as exc:
        console.print(f"warning: could not save the converted store to {path} ({exc.strerror or exc}); "
                      f"the next start converts again", highlight=False)


def read_config(path: Path, model_id: str, trust_remote_code: bool = False):
    """transformers' config of the model directory `path`, a Mixture-of-Experts one (else one line)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        raise FmoeError(f"{model_id}: {str(exc).splitlines()[0]} (pass --trust-remote-code for custom code)") from None
    check_is_moe(config, model_id)
    return config


def check_skeleton(config_path: Path, model_id: str) -> None:
    """What only transformers' model of config.json tells, built on the meta device (no memory, no weights): a family
    transformers builds no causal LM of, an experts module or router fmoe does not serve (Llama 4's, gpt-oss's). For
    a hub id before its weights are downloaded (cli.py `_fetch_model`: not 218 GB of Llama-4-Scout for one line); a
    model with its own code is left to the load (its code comes with the weights)."""
    build_skeleton(read_config(config_path.parent, model_id), torch.bfloat16, model_id)


def build_skeleton(config, dtype: torch.dtype, model_id: str, trust_remote_code: bool = False):
    """The model on the meta device (shapes, no memory) and its MoE layers."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = getattr(config, "model_type", None)
    custom = getattr(config, "auto_map", None) or {}  # a repository's own code (--trust-remote-code)
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and "AutoModelForCausalLM" not in custom:
        # Qwen3-VL-MoE, GLM-4.5V, ERNIE-4.5-VL …: transformers builds them as image-text models only
        raise FmoeError(f"{model_id} ({kind}): transformers registers no AutoModelForCausalLM for it (a multimodal "
                        f"or encoder model, or a family only its own class builds, as Mistral 4); fmoe serves text "
                        f"generation from AutoModelForCausalLM models only")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    return model, find_moe_layers(model, model_id)


def _finish_skeleton(model, model_id: str) -> None:
    """What transformers' from_pretrained does after reading the weights: tie the weights, build the
    non-persistent buffers (rotary inv_freq …) with the model's own init; any weight still missing is an error."""
    for name, buffer in model.named_buffers():
        if buffer.is_meta:
            module_name, _, attr = name.rpartition(".")
            model.get_submodule(module_name)._buffers[attr] = torch.empty_like(buffer, device="cpu")
    model.tie_weights()
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise FmoeError(f"{model_id}: the checkpoint has no weights for {missing[0]} "
                        f"({len(missing)} missing; incomplete download?)")
    for p in model.parameters():
        p._is_hf_initialized = True
    model.initialize_weights()  # only what is not marked initialised: the buffers just built


def skeleton_non_expert_bytes(model, layers: list[MoeLayer], dense: str = "bf16") -> int:
    """U_n from the (meta) model: every parameter and buffer but the routed experts, the `dense` targets at
    their stored size."""
    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    return (nbytes(list(model.parameters()) + list(model.buffers())) - sum(nbytes(l.experts.parameters()) for l in layers)
            - dense_bytes_saved(model, dense))


def expert_shape(layers: list[MoeLayer], dtype: torch.dtype, experts: str = DEFAULT_EXPERTS) -> ExpertShape:
    first = layers[0].experts
    n, two_i, h = first.gate_up_proj.shape
    if getattr(first, "is_transposed", False):
        n, h, two_i = first.gate_up_proj.shape
    for layer in layers[1:]:
        if tuple(layer.experts.gate_up_proj.shape) != tuple(first.gate_up_proj.shape):
            raise FmoeError(f"unsupported expert layout: {layer.name} differs in shape from {layers[0].name}")
    top_k = getattr(layers[0].router, "top_k", None) or config_top_k(first.config)
    if type(top_k) is not int:
        raise FmoeError(f"{layers[0].name}: cannot tell how many experts a token is routed to (the router has no "
                        f"top_k, and config.json gives no single num_experts_per_tok)")
    return ExpertShape(len(layers), n, top_k, h, two_i // 2, torch.tensor([], dtype=dtype).element_size(), experts)


def _free_expert_weights(experts: torch.nn.Module, dtype: torch.dtype) -> None:
    """The experts live in the host store: the module keeps empty parameters (its forward is the engine's)."""
    empty = torch.empty(0, dtype=dtype)
    experts.gate_up_proj = torch.nn.Parameter(empty, requires_grad=False)
    experts.down_proj = torch.nn.Parameter(empty.clone(), requires_grad=False)
