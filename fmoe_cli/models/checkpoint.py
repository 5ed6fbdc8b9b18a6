"""Read a safetensors checkpoint into a model skeleton whose routed experts were never built.

transformers 5 renames checkpoint keys and stacks the hub's per-expert tensors
(`…experts.{e}.w1/w2/w3`, `…experts.{e}.gate_proj/up_proj/down_proj`) into fused
[N, 2I, H] / [N, H, I] parameters while loading (conversion_mapping.py). fmoe asks
transformers for the same renamings and converters, loads every non-expert tensor
into the skeleton, and reads each expert — from the per-expert tensors or from a
fused one, one expert at a time — straight into its [I, 3, H] block of the host
store. No fused copy of the experts is ever built, so peak host memory is the store
plus the non-expert weights plus one expert.

Block-scaled float8 checkpoints (config.json's `quantization_config` fp8 with a `weight_block_size`, as DeepSeek-V3's
and the `-FP8` repositories): a float8 weight with its `…weight_scale_inv` grid is dequantized as it is read, as
transformers does on a machine without an FP8 GPU (integrations/finegrained_fp8.py `Fp8Dequantize`): the float32
product of each block and its scale, rounded once to the parameter's dtype. fmoe then serves the dequantized model
(quantised further with --experts, as any float checkpoint).

Files are read with `pread` into reused scratch buffers, not through a memory map:
pages of a mapped file count in the process's resident set for as long as the map is
open, and a fresh tensor per piece leaves the allocator's free lists holding memory.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from safetensors import SafetensorError, safe_open

from fmoe_cli.errors import FmoeError
from fmoe_cli.models.config import fp8_block
from fmoe_cli.types import MoeLayer
from fmoe_cli.offload.layout import DOWN, GATE, UP

INDEX = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
                      "F8_E8M0": torch.float8_e8m0fnu}
# The converter operations fmoe knows how to undo into the packed layout; anything else is refused.
KNOWN_OPS = {"MergeModulelist", "Concatenate"}


def weight_files(path: Path) -> list[Path]:
    """The safetensors files transformers would load: the index's, else model.safetensors, else all of them."""
    index = path / INDEX
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise FmoeError(f"{index} is not a valid safetensors index ({type(exc).__name__}): download it again") from None
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise FmoeError(f"{path}: {INDEX} names {missing[0]}, which is missing (incomplete download?)")
        return [path / n for n in names]
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    return sorted(path.glob("*.safetensors"))


def open_weights(file: Path):
    """safe_open, with a truncated, empty or garbage file (or a corrupt header) as one line of user error."""
    try:
        return safe_open(str(file), framework="pt", device="cpu", backend="pread")
    except (SafetensorError, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise FmoeError(f"{file} is not a valid safetensors file ({reason}): it is truncated or corrupt; "
                        f"delete it and download the model again") from None


class WeightFile:
    """One safetensors file: its header (validated by safetensors itself), read with pread."""

    def __init__(self, file: Path) -> None:
        open_weights(file)  # validates the header and that the data covers it
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        self.file = file
        self.data_start = 8 + n
        self.entries = {k: v for k, v in header.items() if k != "__metadata__"}
        self.fd = os.open(file, os.O_RDONLY)

    def keys(self) -> list[str]:
        return list(self.entries)

    def dtype(self, key: str) -> torch.dtype:
        name = self.entries[key]["dtype"]
        if name not in SAFETENSORS_DTYPES:
            raise FmoeError(f"{self.file}: {key} has dtype {name}, which fmoe does not load")
        return SAFETENSORS_DTYPES[name]

    def shape(self, key: str) -> list[int]:
        return list(self.entries[key]["shape"])

    def nbytes(self, key: str) -> int:
        begin, end = self.entries[key]["data_offsets"]
        return end - begin

    def read(self, key: str, out: torch.Tensor | None = None, index: int | None = None) -> torch.Tensor:
        """The tensor, or its `index`-th entry along dim 0 (one expert of a fused tensor), into `out`'s memory."""
        shape = self.shape(key)
        size = self.nbytes(key)
        part = 0
        if index is not None:
            shape, size, part = shape[1:], size // shape[0], index
        raw = torch.empty(size, dtype=torch.uint8) if out is None else out.view(-1).view(torch.uint8)[:size]
        view = memoryview(raw.numpy())
        offset = self.data_start + self.entries[key]["data_offsets"][0] + part * size
        done = 0
        while done < size:
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise FmoeError(f"{self.file} ended early (truncated?): download the model again")
            done += n
        return raw.view(self.dtype(key)).view(shape)

    def close(self) -> None:
        os.close(self.fd)


def check_weight_files(path: Path) -> None:
    """Open every weight file's header (cheap): bad files are refused before any slow work."""
    for file in weight_files(path):
        open_weights(file)


@dataclass(frozen=True)
class ExpertPiece:
    """Where one checkpoint tensor goes in the packed store."""

    layer: int  # MoE layer index
    expert: int | None  # None: a fused tensor holding every expert
    rows: tuple[int, ...]  # GATE / UP / DOWN: which rows of the packed [I, 3, H] block it fills


def _transforms(model):
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return renamings, converters


def classify_keys(model, layers: list[MoeLayer], keys: list[str]) -> tuple[dict[str, str], dict[str, ExpertPiece]]:
    """Checkpoint keys -> (non-expert key -> model parameter name, expert key -> where it goes in the store)."""
    from transformers.core_model_loading import rename_source_key

    renamings, converters = _transforms(model)
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    meta_state = model.state_dict()
    owner = {}  # experts parameter name -> (MoE layer, parameter: gate_up_proj | down_proj)
    for layer in layers:
        owner[f"{layer.name}.gate_up_proj"] = (layer, "gate_up_proj")
        owner[f"{layer.name}.down_proj"] = (layer, "down_proj")
    plain: dict[str, str] = {}
    experts: dict[str, ExpertPiece] = {}
    for key in keys:
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_state)
        if target not in owner:
            if pattern is not None:
                raise FmoeError(f"unsupported checkpoint layout: {key} needs a conversion fmoe does not serve")
            if target in meta_state:
                plain[key] = target
            continue  # an unexpected key: transformers ignores it too
        layer, param = owner[target]
        if pattern is None:  # the fused layout: one tensor holds every expert of the layer
            experts[key] = ExpertPiece(layer.index, None, (GATE, UP) if param == "gate_up_proj" else (DOWN,))
            continue
        converter = by_pattern[pattern]
        ops = {type(op).__name__ for op in converter.operations}
        if not ops <= KNOWN_OPS:
            raise FmoeError(f"unsupported checkpoint layout: {key} is converted by {sorted(ops - KNOWN_OPS)}")
        match = re.search(r"\.experts\.(\d+)\.", key)
        if match is None:
            raise FmoeError(f"unsupported checkpoint layout: cannot tell the expert of {key}")
        # The converter concatenates its sources in order along the fused dimension: [gate; up] (chunk(2)).
        row = DOWN if param == "down_proj" else (GATE, UP)[converter.source_patterns.index(pattern)]
        experts[key] = ExpertPiece(layer.index, int(match.group(1)), (row,))
    return plain, experts


FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # what a floating-point weight may be stored as (float8: with its scales)
FLOAT8_DTYPES = ("F8_E4M3", "F8_E5M2")
# what a float8 weight's block scales may be stored as: floats, or E8M0 exponents (config's scale_fmt "ue8m0", the
# MXFP8 layout) as one byte each, U8 or F8_E8M0, the scale 2^(b − 127) (`decode_scales`)
SCALE_DTYPES = ("F32", "F16", "BF16", "U8", "F8_E8M0")
SCALE_SUFFIX = "_scale_inv"  # a float8 weight's block scales: `KEY_scale_inv`, [rows / block, columns / block]


def scale_keys(files: list[WeightFile]) -> dict[str, tuple[WeightFile, str]]:
    """float8 weight key -> (the file holding its scale grid, the grid's key), over every file of the checkpoint."""
    return {key[: -len(SCALE_SUFFIX)]: (f, key) for f in files for key in f.keys() if key.endswith(SCALE_SUFFIX)}


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid of a [R, C] float8 weight in blocks of `block`: ceil(R / b_r) × ceil(C / b_c) (the last row and
    column of blocks cut short where the block does not divide the weight: DeepSeek-V3's kv_a_proj_with_mqa, [576,
    7168] in 128 × 128 blocks, has a [5, 56] grid)."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: tuple[int, int]) -> torch.Tensor:
    """A block-scaled float8 weight [R, C] in `dtype`: ŵ[i, j] = q[i, j] · s[i // b_r, j // b_c] in float32, rounded once
    (transformers' Fp8Dequantize._dequantize_one's operations where the block divides the weight; where it does not,
    the cut-short blocks as DeepSeek's own weight_dequant, where transformers' dequantizing load would refuse or
    misplace them)."""
    rows, cols = weight.shape
    grid_rows, grid_cols = scale.shape
    if (grid_rows, grid_cols) != scale_grid((rows, cols), block):
        raise FmoeError(f"a float8 weight of shape [{rows}, {cols}] in blocks of {list(block)} has a scale grid of "
                        f"{list(scale_grid((rows, cols), block))}, not [{grid_rows}, {grid_cols}]")
    padded = weight.to(torch.float32)
    if rows % block[0] or cols % block[1]:  # (zeros in the cut-short blocks' missing part, cropped after)
        padded = torch.nn.functional.pad(padded, (0, grid_cols * block[1] - cols, 0, grid_rows * block[0] - rows))
    blocks = padded.reshape(grid_rows, block[0], grid_cols, block[1])
    scales = decode_scales(scale).reshape(grid_rows, grid_cols).unsqueeze(-1).unsqueeze(1)
    whole = (blocks * scales).to(dtype).reshape(grid_rows * block[0], grid_cols * block[1])
    return whole if whole.shape == (rows, cols) else whole[:rows, :cols].contiguous()


def decode_scales(scale: torch.Tensor) -> torch.Tensor:
    """A scale grid in float32: E8M0 exponents stored as bytes are 2^(b − 127), as transformers' Fp8Dequantize reads
    them (the raw byte as a multiplier would be silently wrong); float8_e8m0fnu and floats convert as they are."""
    if scale.dtype == torch.uint8:
        return (scale.to(torch.float32) - 127.0).exp2()
    return scale.to(torch.float32)


def _expected_shape(layers: list[MoeLayer], piece: ExpertPiece) -> tuple[int, ...]:
    """The shape of a checkpoint tensor that fills `piece`: the fused parameter's own (N, 2I, H / N, H, I,
    or transposed), else one expert's nn.Linear weight ([I, H] for gate or up, [H, I] for down)."""
    experts = layers[piece.layer].experts
    fused = experts.down_proj if piece.rows == (DOWN,) else experts.gate_up_proj
    if piece.expert is None:
        return tuple(fused.shape)
    n, two_i, h = experts.gate_up_proj.shape
    if getattr(experts, "is_transposed", False):
        n, h, two_i = experts.gate_up_proj.shape
    return (h, two_i // 2) if piece.rows == (DOWN,) else (two_i // 2, h)


def check_checkpoint(path: Path, model, layers: list[MoeLayer]) -> None:
    """Every tensor's header against the model's own parameters (the skeleton built from config.json),
    before a byte of weights is read: a shape that disagrees with the config, or a dtype fmoe cannot
    load exactly (float8 without its scales), is one line naming the file and the tensor."""
    meta_state = model.state_dict()
    files = [WeightFile(file) for file in weight_files(path)]
    try:
        scales = scale_keys(files)
        block = fp8_block(path / "config.json") if scales else None
        for weights in files:
            plain, experts = classify_keys(model, layers, weights.keys())
            for key, target in {**plain, **experts}.items():
                if isinstance(target, ExpertPiece):
                    expected, floating = _expected_shape(layers, target), True
                else:
                    expected, floating = tuple(meta_state[target].shape), meta_state[target].is_floating_point()
                dtype, shape = weights.entries[key]["dtype"], tuple(weights.shape(key))
                scaled = dtype in FLOAT8_DTYPES and key in scales
                if floating and dtype not in FLOAT_DTYPES and not scaled:
                    raise FmoeError(f"{weights.file}: {key} is stored as {dtype}; fmoe loads {', '.join(FLOAT_DTYPES)} "
                                    f"weights, and float8 ones with their block scales ({key}{SCALE_SUFFIX}), which "
                                    f"this one lacks")
                if scaled and (len(shape) != 2 or (isinstance(target, ExpertPiece) and target.expert is None)):
                    raise FmoeError(f"{weights.file}: {key} is a float8 tensor of shape {list(shape)}: fmoe "
                                    f"dequantizes 2-D weights only (one expert's, or a linear layer's)")
                if scaled and block is None:
                    raise FmoeError(f"{weights.file}: {key} is float8 with block scales, but config.json's "
                                    f"quantization_config names no weight_block_size to read them by")
                if scaled:
                    scale_file, scale_key = scales[key]
                    if scale_file.entries[scale_key]["dtype"] not in SCALE_DTYPES:
                        raise FmoeError(f"{scale_file.file}: {scale_key} is stored as "
                                        f"{scale_file.entries[scale_key]['dtype']}; fmoe reads block scales stored as "
                                        f"{', '.join(SCALE_DTYPES)}")
                    grid = tuple(scale_file.shape(scale_key))
                    if grid != scale_grid(shape, block):
                        raise FmoeError(f"{scale_file.file}: {scale_key} is a grid of {list(grid)} scales, but "
                                        f"{key} {list(shape)} in blocks of {list(block)} needs "
                                        f"{list(scale_grid(shape, block))} (a damaged file, or another layout)")
                if shape != expected:
                    raise FmoeError(f"{weights.file}: {key} has shape {list(shape)} but the model's config.json makes it "
                                    f"{list(expected)} (a checkpoint of another model, or a damaged file)")
    finally:
        for weights in files:
            weights.close()


def _loaded_dtype(model, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype transformers' from_pretrained gives this parameter (some stay float32)."""
    strict = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    loose = getattr(model, "_keep_in_fp32_modules", None) or []
    keep = list(strict) if dtype in (torch.float16, torch.bfloat16) else []
    keep += list(loose) if dtype == torch.float16 else []
    return torch.float32 if any(m in name.split(".") or m in name for m in keep) else dtype


def _set_tensor(model, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if attr in module._parameters:
        param = torch.nn.Parameter(value, requires_grad=False)
        param._is_hf_initialized = True
        module._parameters[attr] = param
    else:
        value._is_hf_initialized = True
        module._buffers[attr] = value


def read_checkpoint(path: Path, model, layers: list[MoeLayer], store, dtype: torch.dtype, console: Console) -> None:
    """Load the non-expert weights into `model` (a meta-device skeleton) and every routed expert into `store`
    (store None: the experts are already in a converted store; they are not read)."""
    files = [WeightFile(f) for f in weight_files(path)]
    try:
        _read(path, files, model, layers, store, dtype, console)
    finally:
        for f in files:
            f.close()


def _read(path: Path, files: list[WeightFile], model, layers, store, dtype: torch.dtype, console: Console) -> None:
    plan = []  # (file, key, parameter name or ExpertPiece)
    scales = scale_keys(files)  # float8 weights: their block scales, dequantized as they are read
    fp8_blocks = fp8_block(path / "config.json") if scales else None  # (check_checkpoint: known wherever scales are)

    def read(f: WeightFile, key: str, out: torch.Tensor | None, index: int | None, dtype: torch.dtype) -> torch.Tensor:
        value = f.read(key, out, index)
        if key in scales and value.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale_file, scale_key = scales[key]
            value = dequantize(value, scale_file.read(scale_key), dtype, fp8_blocks)
        return value

    for f in files:
        plain, experts = classify_keys(model, layers, f.keys())
        plan += [(f, key, target) for key, target in {**plain, **experts}.items()]
    _check_every_expert_present(layers, [t for _, _, t in plan if isinstance(t, ExpertPiece)])
    if store is None:
        plan = [(f, key, target) for f, key, target in plan if isinstance(target, str)]
    total = sum(f.nbytes(key) for f, key, _ in plan)
    n_experts, intermediate = (store.shape.num_experts, store.shape.intermediate) if store is not None else (0, 0)
    scratch: torch.Tensor | None = None  # one piece as read from the file, reused
    # Per-expert pieces arrive tensor by tensor; an expert goes to the store once its three rows are in.
    pending: dict[tuple[int, int], tuple[torch.Tensor, set[int]]] = {}
    columns = [TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
               TransferSpeedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("loading weights", total=total)
        for f, key, target in plan:
            if isinstance(target, str):
                loaded = _loaded_dtype(model, target, dtype)
                value = read(f, key, None, None, loaded)
                if value.is_floating_point():
                    value = value.to(loaded)
                _set_tensor(model, target, value)
                progress.advance(task, f.nbytes(key))
                continue
            fused = target.expert is None
            piece_bytes = f.nbytes(key) // (n_experts if fused else 1)
            if scratch is None or scratch.numel() < piece_bytes:
                scratch = torch.empty(piece_bytes, dtype=torch.uint8)
            for e in range(n_experts) if fused else (target.expert,):
                # per-expert: gate/up [I, H], down [H, I]; fused: gate_up [2I, H], down [H, I] (transposed: [H, 2I], [I, H])
                weight = read(f, key, scratch, e if fused else None, dtype)
                if fused and getattr(layers[target.layer].experts, "is_transposed", False):
                    weight = weight.t()
                entry = pending.get((target.layer, e))
                if entry is None:
                    entry = pending[(target.layer, e)] = (store.block(target.layer, e), set())
                block, rows = entry
                if target.rows == (DOWN,):
                    block[:, DOWN].copy_(weight.t())
                elif len(target.rows) == 2:  # [gate; up]
                    block[:, GATE].copy_(weight[:intermediate])
                    block[:, UP].copy_(weight[intermediate:])
                else:
                    block[:, target.rows[0]].copy_(weight)
                rows.update(target.rows)
                if rows == {GATE, UP, DOWN}:
                    store.put(target.layer, e, block)
                    del pending[(target.layer, e)]
                progress.advance(task, piece_bytes)
    if pending:
        (layer, expert), _ = next(iter(pending.items()))
        raise FmoeError(f"{path}: the checkpoint lacks part of expert {expert} of MoE layer {layer}")


def _check_every_expert_present(layers: list[MoeLayer], pieces: list[ExpertPiece]) -> None:
    fused = {(p.layer, r) for p in pieces if p.expert is None for r in p.rows}
    seen = {(p.layer, p.expert, r) for p in pieces if p.expert is not None for r in p.rows}
    for layer in layers:
        count = layer.experts.gate_up_proj.shape[0]  # N (the skeleton's meta shape)
        for r in (GATE, UP, DOWN):
            if (layer.index, r) in fused:
                continue
            missing = [e for e in range(count) if (layer.index, e, r) not in seen]
            if missing:
                raise FmoeError(f"the checkpoint has no weights for expert {missing[0]} of {layer.name} "
                                f"(incomplete download, or a layout fmoe does not know)")
