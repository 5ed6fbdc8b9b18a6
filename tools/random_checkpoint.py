#!/usr/bin/env python3
"""Random-weight MoE checkpoints at a real model's exact shape, written straight into fmoe's converted store.

    python tools/random_checkpoint.py OUT --shape mixtral-8x7b --layers 4 --experts int2 [--quantize pool]
    python tools/random_checkpoint.py OUT --shape qwen3-30b-a3b --experts bf16 --device cuda
    fmoe bench OUT --experts int2 --dense int4 --replay-routing TRACE …

Shapes (`SHAPES`): Mixtral-8x7B (32 layers, 8 experts of 4096 × 14336, top-2) and Qwen3-30B-A3B (48 layers, 128
experts of 2048 × 768, top-8), attention, vocabulary and norms as their config.json; `--layers N` keeps the first N
(a CPU run in minutes). Routing is random too: for real routing, replay a trace (`fmoe bench --replay-routing`).

What is written, streamed (one expert in memory at a time, so a machine with less RAM than the bf16 model builds the
int2 one):
- OUT/config.json, a small byte-level tokenizer with a chat template (models/demo.py: the prompt's ids are valid in
  any vocabulary), and OUT/model.safetensors: every non-expert weight drawn (normal, σ = 0.02; norms 1) in bf16,
  and the experts as the model's fused tensors (`gate_up_proj` [N, 2I, H], `down_proj` [N, H, I]). With
  `--experts bf16` the experts are drawn and written there; with int8 / int4 / int2 their bytes in the checkpoint
  are a hole of a sparse file (zeros, no disk), and the experts go to
- fmoe's converted store (offload/converted.py: <cache>/converted/<fingerprint>-<format>-v2.safetensors), the file
  `fmoe … --experts FORMAT` maps instead of converting: quantised as the loader quantises (offload/quant.py,
  offload/hqq.py), so the loader finds it and never reads the hole. (Loading the checkpoint with another expert
  format converts the hole: zeros.)

`--quantize exact` (default): every expert drawn in bf16 from its own seed (seed, layer, expert) and quantised as
fmoe's loader does, in the same blocks of neurons: the store is byte for byte the one `fmoe` writes when it loads
the same checkpoint built with `--experts bf16` (tests/test_random_checkpoint.py). int2's HQQ solver is slow on a CPU
(minutes an expert of Mixtral's; a GPU: `--device cuda`). `--quantize pool`: every neuron row of every expert a
copy of one of POOL_ROWS rows quantised exactly (drawn by a seeded generator): the same bytes per expert, the same
kernels and link work, in seconds; a store no bf16 checkpoint converts to.

The disk it takes and the time it will take are said before anything is written (the time from one block of
neurons drawn and quantised now); `--dry-run` stops there. A progress bar shows the bytes written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fmoe_cli.models.demo import build_tokenizer  # noqa: E402
from fmoe_cli.models.identity import checkpoint_fingerprint  # noqa: E402
from fmoe_cli.models.load import build_skeleton, expert_shape  # noqa: E402
from fmoe_cli.offload.converted import ConvertedWriter, converted_path  # noqa: E402
from fmoe_cli.offload.layout import DOWN, GATE, UP  # noqa: E402
from fmoe_cli.offload.quant import QUANTIZE_ROWS, quantize  # noqa: E402
from fmoe_cli.types import DOWN_GROUP, EXPERT_FORMATS  # noqa: E402

GiB = 1024**3
STD = 0.02  # every drawn weight: normal(0, STD) (routers: ROUTER_STD, so that random routing varies)
ROUTER_STD = 0.5
POOL_ROWS = 4 * QUANTIZE_ROWS  # --quantize pool: neuron rows quantised exactly, copied into every expert
SAFETENSORS_ALIGN = 8


@dataclass(frozen=True)
class ModelShape:
    config_class: str  # transformers' config class
    fields: dict  # its arguments (the real model's config.json, the figures that matter)
    layers: int  # the real model's decoder layers


SHAPES = {
    "mixtral-8x7b": ModelShape("MixtralConfig", dict(  # mistralai/Mixtral-8x7B-v0.1 config.json
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
        num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-5,
        rope_theta=1e6, sliding_window=None, tie_word_embeddings=False), 32),
    "qwen3-30b-a3b": ModelShape("Qwen3MoeConfig", dict(  # Qwen/Qwen3-30B-A3B config.json
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[]), 48),
}


def make_config(shape: ModelShape, layers: int, tokenizer):
    import transformers

    config = getattr(transformers, shape.config_class)(
        **shape.fields, num_hidden_layers=layers, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    config.dtype = "bfloat16"
    return config


# --- what is drawn -------------------------------------------------------------------------------------------------
def generator(seed: int, *where: int, device: str = "cpu") -> torch.Generator:
    """The seed of one tensor or one expert: the same values whatever else is built, in whatever order."""
    value = seed
    for w in where:
        value = value * 1_000_003 + w + 1
    return torch.Generator(device=device).manual_seed(value % (1 << 63))


def expert_rows(seed: int, layer: int, expert: int, intermediate: int, hidden: int, device: str):
    """One expert's bf16 weights in fmoe's packed layout, block by block of QUANTIZE_ROWS neurons (the loader's
    quantisation blocks): (first neuron, [n, 3, H] bf16: gate row, up row, down column of each neuron)."""
    g = generator(seed, layer, expert, device=device)
    for start in range(0, intermediate, QUANTIZE_ROWS):
        n = min(QUANTIZE_ROWS, intermediate - start)
        yield start, (torch.randn(n, 3, hidden, generator=g, device=device) * STD).to(torch.bfloat16)


def dense_tensor(seed: int, index: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A non-expert weight: norms 1, routers normal(0, ROUTER_STD), the rest normal(0, STD), in bf16."""
    if name.endswith("norm.weight") or "layernorm" in name:
        return torch.ones(shape, dtype=torch.bfloat16)
    std = ROUTER_STD if name.endswith("gate.weight") else STD
    return (torch.randn(shape, generator=generator(seed, 1 << 20, index)) * std).to(torch.bfloat16)


# --- the plan: files, bytes, time -----------------------------------------------------------------------------------
@dataclass
class Build:
    out: Path
    config: object
    tensors: list[tuple[str, tuple[int, ...], bool]]  # (name, shape, an experts tensor) in the file's order
    expert_tensors: list[tuple[str, str]]  # per MoE layer: its fused gate_up_proj and down_proj
    shape: object  # ExpertShape of the format asked
    experts: str  # bf16, int8, int4, int2

    @property
    def quantised(self) -> bool:
        return EXPERT_FORMATS[self.experts] is not None

    def nbytes(self, expert_tensors: bool) -> int:
        return sum(2 * _numel(s) for _, s, is_expert in self.tensors if is_expert == expert_tensors)

    @property
    def disk_bytes(self) -> int:
        """What takes disk: the non-expert weights, and the experts (the checkpoint's bf16, or the store)."""
        return self.nbytes(False) + (self.shape.all_experts_bytes if self.quantised else self.nbytes(True))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def plan_build(out: Path, shape: ModelShape, layers: int, experts: str, tokenizer) -> Build:
    config = make_config(shape, layers, tokenizer)
    model, moe_layers = build_skeleton(config, torch.bfloat16, "random checkpoint")
    expert_tensors = [(f"{layer.name}.gate_up_proj", f"{layer.name}.down_proj") for layer in moe_layers]
    expert_names = {name for pair in expert_tensors for name in pair}
    tensors = [(name, tuple(t.shape), name in expert_names) for name, t in model.state_dict().items()]
    return Build(out, config, tensors, expert_tensors, expert_shape(moe_layers, torch.float32, experts), experts)


def seconds_per_expert(build: Build, quantize_mode: str, device: str) -> float:
    """One block of neurons drawn (and quantised) now, scaled to an expert (the second of two: the first pays for
    torch's first calls)."""
    shape = build.shape
    blocks = expert_rows(0, 0, 0, shape.intermediate, shape.hidden, device)
    for _ in range(2):
        start = time.perf_counter()
        _, rows = next(blocks)
        if build.quantised:
            quantize(rows.float(), EXPERT_FORMATS[build.experts], shape.down_by_neuron)
        elapsed = time.perf_counter() - start
    blocks = -(-shape.intermediate // QUANTIZE_ROWS)
    if build.quantised and quantize_mode == "pool":  # the pool once, then copies
        return elapsed * POOL_ROWS / QUANTIZE_ROWS / (shape.num_layers * shape.num_experts)
    return elapsed * blocks


# --- writing -------------------------------------------------------------------------------------------------------
def safetensors_header(build: Build) -> tuple[bytes, dict[str, int]]:
    """The checkpoint's header (bf16 tensors, contiguous in the file's order) and each tensor's data offset."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offsets, offset = {}, 0
    for name, shape, _ in build.tensors:
        size = 2 * _numel(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offsets[name] = offset
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % SAFETENSORS_ALIGN)
    return struct.pack("<Q", len(text)) + text, offsets


def write_checkpoint(build: Build, seed: int, quantize_mode: str, device: str, console: Console) -> Path | None:
    """Every file of the checkpoint; the converted store's path (None for bf16 experts)."""
    out = build.out
    out.mkdir(parents=True, exist_ok=True)
    build.config.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    head, offsets = safetensors_header(build)
    total = len(head) + build.nbytes(False) + build.nbytes(True)
    weights = out / "model.safetensors"
    shape = build.shape
    to_write = build.nbytes(False) + (shape.all_experts_bytes if build.quantised else build.nbytes(True))
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
               TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as bar, open(weights, "wb") as f:
        task = bar.add_task("weights", total=to_write)
        f.write(head)
        f.truncate(total)  # the experts' hole when they are quantised: a sparse file
        for index, (name, tensor_shape, is_expert) in enumerate(build.tensors):
            if is_expert:
                continue
            bar.update(task, description=name)
            value = dense_tensor(seed, index, name, tensor_shape)
            f.seek(len(head) + offsets[name])
            f.write(memoryview(value.view(torch.uint8).reshape(-1).numpy()))
            bar.advance(task, value.numel() * 2)
        if not build.quantised:
            _write_bf16_experts(build, f, len(head), offsets, seed, device, bar, task)
    if not build.quantised:
        return None
    fingerprint = checkpoint_fingerprint(out)  # config.json and the safetensors header: final now
    path = converted_path(fingerprint, build.experts)
    with Progress(*columns, console=console, transient=False) as bar, ConvertedWriter(path, fingerprint, shape) as w:
        task = bar.add_task("experts", total=shape.all_experts_bytes)
        _write_store(build, w, seed, quantize_mode, device, bar, task)
    return path


def _write_bf16_experts(build: Build, f, data_start: int, offsets: dict, seed: int, device: str, bar, task) -> None:
    """The fused [N, 2I, H] gate_up and [N, H, I] down tensors of every layer, an expert at a time."""
    shape = build.shape
    i_, h = shape.intermediate, shape.hidden
    for layer, (gate_up, down) in enumerate(build.expert_tensors):
        for e in range(shape.num_experts):
            bar.update(task, description=f"layer {layer} expert {e}")
            block = torch.cat([rows for _, rows in expert_rows(seed, layer, e, i_, h, device)]).cpu()  # [I, 3, H]
            fused = torch.cat([block[:, GATE], block[:, UP]])  # [2I, H]
            f.seek(data_start + offsets[gate_up] + e * fused.numel() * 2)
            f.write(memoryview(fused.contiguous().view(torch.uint8).reshape(-1).numpy()))
            column = block[:, DOWN].t().contiguous()  # [H, I]
            f.seek(data_start + offsets[down] + e * column.numel() * 2)
            f.write(memoryview(column.view(torch.uint8).reshape(-1).numpy()))
            bar.advance(task, 2 * (fused.numel() + column.numel()))


def _write_store(build: Build, writer: ConvertedWriter, seed: int, quantize_mode: str, device: str, bar, task) -> None:
    shape = build.shape
    fmt = EXPERT_FORMATS[build.experts]
    row = shape.neuron_bytes
    pool = None
    if quantize_mode == "pool":
        pool = torch.cat([quantize(rows.float(), fmt, shape.down_by_neuron).cpu() for _, rows in
                          expert_rows(seed, 1 << 16, 0, POOL_ROWS, shape.hidden, device)])  # [POOL_ROWS, 3, bytes]
    for layer in range(shape.num_layers):
        for e in range(shape.num_experts):
            bar.update(task, description=f"layer {layer} expert {e}")
            base = e * shape.intermediate * row
            if pool is not None:
                if shape.down_by_neuron:  # whole down groups (their rows hold each other's down weights)
                    groups = torch.randint(0, POOL_ROWS // DOWN_GROUP, (shape.intermediate // DOWN_GROUP,),
                                           generator=generator(seed, layer, e))
                    pick = (groups[:, None] * DOWN_GROUP + torch.arange(DOWN_GROUP)).reshape(-1)
                else:
                    pick = torch.randint(0, POOL_ROWS, (shape.intermediate,), generator=generator(seed, layer, e))
                writer.write(layer, base, pool[pick])
                bar.advance(task, shape.expert_bytes)
                continue
            for start, rows in expert_rows(seed, layer, e, shape.intermediate, shape.hidden, device):
                codes = quantize(rows.float(), fmt, shape.down_by_neuron).cpu()  # as QuantStore.put: the loader's blocks
                writer.write(layer, base + start * row, codes)
                bar.advance(task, codes.numel())


# --- the command ---------------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the checkpoint's directory (new, or empty)")
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the real model's)")
    p.add_argument("--experts", choices=list(EXPERT_FORMATS), default="int2",
                   help="the experts' format: bf16 in the checkpoint, else fmoe's converted store")
    p.add_argument("--quantize", choices=("exact", "pool"), default="exact")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where experts are drawn and quantised (cpu, cuda)")
    p.add_argument("--dry-run", action="store_true", help="say the disk and time it takes, write nothing")
    return p


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    shape = SHAPES[args.shape]
    layers = shape.layers if args.layers is None else args.layers
    if not 1 <= layers <= shape.layers:
        fail(f"--layers must be between 1 and {shape.layers} for {args.shape}, got {layers}")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        fail(f"{args.out} exists and is not an empty directory")
    console = Console(stderr=True)
    torch.set_grad_enabled(False)
    build = plan_build(args.out, shape, layers, args.experts, build_tokenizer())
    per_expert = seconds_per_expert(build, args.quantize, args.device)
    experts = build.shape.num_layers * build.shape.num_experts
    disk = build.disk_bytes
    console.print(f"{args.shape} × {layers} layers, experts {args.experts}"
                  + (f" (--quantize {args.quantize})" if build.quantised else "") + f": {experts} experts of "
                  f"{build.shape.expert_bytes / 2**20:.1f} MiB; disk {disk / GiB:.2f} GiB (non-expert weights "
                  f"{build.nbytes(False) / GiB:.2f} GiB, experts {(disk - build.nbytes(False)) / GiB:.2f} GiB"
                  + (f" in the converted store; the checkpoint's {build.nbytes(True) / GiB:.1f} GiB of bf16 experts "
                     f"a sparse hole" if build.quantised else "") + f"); time about {per_expert * experts / 60:.1f} "
                  f"min for the experts ({per_expert:.2f} s each, from one block of {QUANTIZE_ROWS} neurons "
                  f"now on {args.device})", highlight=False)
    free = shutil.disk_usage(args.out.parent if not args.out.exists() else args.out).free
    if disk > free:
        fail(f"the build needs {disk / GiB:.1f} GiB of disk, {free / GiB:.1f} GiB is free")
    if args.dry_run:
        return
    started = time.perf_counter()
    try:
        store = write_checkpoint(build, args.seed, args.quantize, args.device, console)
    except BaseException:
        (args.out / "model.safetensors").unlink(missing_ok=True)  # never a checkpoint whose weights are half there
        raise
    console.print(f"wrote {args.out}" + (f" and the converted store {store}" if store else "")
                  + f" in {(time.perf_counter() - started) / 60:.1f} min", highlight=False)


if __name__ == "__main__":
    main()
