"""The converted store on disk: a quantised host store, saved once, memory-mapped after.

The first quantised (int8/int4/int2) load of a checkpoint quantises every expert (minutes for a large
model); it then writes the packed store to the user cache as one safetensors file,

    <cache>/converted/<checkpoint fingerprint[:20]>-<format>-v<format_version(format)>.safetensors

with one uint8 tensor [N, I, 3, row bytes] per MoE layer and, in its metadata, the
format version, the fingerprint, the format and the expert shape. Later loads map the
file (`torch.from_file`, private mapping): start-up reads only the header, and pages
become resident only when touched (or when page-locked for a GPU).

Writes are atomic (a unique temporary name in the same directory, fsync, rename), so
an interrupted write never leaves a file under the final name. A file that does not
open as safetensors (truncated, garbage, corrupt header) or whose metadata does not
match (another version, fingerprint, format or shape: stale) is set aside and
rebuilt, with one line saying so; it is never used. (The tensor bytes themselves are
not checksummed: hashing tens of GB would cost the start-up this file exists to save.)
"""

from __future__ import annotations

import json
import os
import struct
import uuid
from pathlib import Path

import torch
from rich.console import Console
from safetensors import SafetensorError, safe_open

from fmoe_cli.types import ExpertShape
from fmoe_cli.disk import converted_dir

# 2: int4 rows pack code j with code j + H/2 (1 packed neighbours); 3: int8 and int4 down projections grouped along
# the neurons (offload/quant.py quantize_down). A format the last change left alone keeps its version (KEPT_VERSIONS:
# an int2 store takes hours to convert), so only the changed formats' stores are rebuilt.
FORMAT_VERSION = 3
KEPT_VERSIONS = {"int2": 2}
ALIGN = 64  # data offsets of every tensor: page-friendly, and any dtype view is aligned




def format_version(experts: str) -> int:
    """The version of `experts`' stored rows (in the store's name and metadata: an older one is never read)."""
    return KEPT_VERSIONS.get(experts, FORMAT_VERSION)


def converted_path(fingerprint: str, experts: str, directory: Path | None = None) -> Path:
    return (directory or converted_dir()) / f"{fingerprint[:20]}-{experts}-v{format_version(experts)}.safetensors"


def _metadata(fingerprint: str, shape: ExpertShape) -> dict[str, str]:
    geometry = {"num_layers": shape.num_layers, "num_experts": shape.num_experts, "hidden": shape.hidden,
                "intermediate": shape.intermediate, "neuron_bytes": shape.neuron_bytes}
    return {"fmoe_converted_store": str(format_version(shape.experts)), "fingerprint": fingerprint, "experts": shape.experts,
            "shape": json.dumps(geometry, sort_keys=True)}


def save_converted(path: Path, layers: list[torch.Tensor], fingerprint: str, shape: ExpertShape) -> None:
    """Write the store's layers (uint8 tensors) as safetensors, atomically, without copying them in memory."""
    with ConvertedWriter(path, fingerprint, shape) as writer:
        for i, t in enumerate(layers):
            writer.write(i, 0, t)


class ConvertedWriter:
    """A converted store written piece by piece (a builder that never holds a layer: tools/random_checkpoint.py),
    atomically: under a temporary name until `close` after a complete write (fsync, rename); an error or an
    interrupt leaves no file under the final name.

        with ConvertedWriter(path, fingerprint, shape) as w:
            w.write(layer, byte_offset_in_layer, uint8_tensor)   # any order, every byte of every layer once
    """

    def __init__(self, path: Path, fingerprint: str, shape: ExpertShape) -> None:
        self.path = Path(path)
        self.layer_bytes = shape.num_experts * shape.intermediate * shape.neuron_bytes
        header: dict = {"__metadata__": _metadata(fingerprint, shape)}
        offset = 0
        self.offsets = []
        for i in range(shape.num_layers):
            offset = -(-offset // ALIGN) * ALIGN
            header[f"layer.{i}"] = {"dtype": "U8", "shape": [self.layer_bytes],
                                    "data_offsets": [offset, offset + self.layer_bytes]}
            self.offsets.append(offset)
            offset += self.layer_bytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-(8 + len(text)) % ALIGN)  # the data starts aligned
        self.start = 8 + len(text)
        self.size = self.start + offset
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        self._file = open(self.tmp, "wb")
        self._file.write(struct.pack("<Q", len(text)))
        self._file.write(text)

    def write(self, layer: int, offset: int, data: torch.Tensor) -> None:
        raw = data.contiguous().view(torch.uint8).reshape(-1)
        assert offset + raw.numel() <= self.layer_bytes, (layer, offset, raw.numel())
        self._file.seek(self.start + self.offsets[layer] + offset)
        self._file.write(memoryview(raw.numpy()))

    def close(self) -> None:
        """Finish: the file complete under its final name (on an error, no file left at all)."""
        try:
            self._file.truncate(self.size)
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self.tmp, self.path)
        finally:
            self.abort()

    def abort(self) -> None:
        """Give up: the temporary removed (nothing once `close` renamed it)."""
        self._file.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> ConvertedWriter:
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


def open_converted(path: Path, fingerprint: str, shape: ExpertShape, console: Console) -> list[torch.Tensor] | None:
    """The memory-mapped layers (uint8, layer_bytes each) of a valid converted store at `path`, else None
    (nothing there; or corrupt / stale: set aside with a message, to be rebuilt)."""
    if not path.exists():
        return None
    problem = _check(path, fingerprint, shape)
    if problem is not None:
        aside = path.with_name(path.name + f".bad-{uuid.uuid4().hex[:8]}")
        try:
            os.replace(path, aside)
            where = f"moved to {aside.name}"
        except OSError:
            where = "left in place"
        console.print(f"converted store {path} is {problem}: rebuilding it ({where})", highlight=False)
        return None
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    start = 8 + n
    size = path.stat().st_size
    flat = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)  # a private map: lazy pages
    return [flat[start + header[f"layer.{i}"]["data_offsets"][0]: start + header[f"layer.{i}"]["data_offsets"][1]]
            for i in range(shape.num_layers)]


def _check(path: Path, fingerprint: str, shape: ExpertShape) -> str | None:
    """None if usable, else what is wrong (corrupt or stale)."""
    try:
        with safe_open(str(path), framework="pt", device="cpu", backend="pread") as f:
            metadata = f.metadata() or {}
            keys = set(f.keys())
            sizes = {k: f.get_slice(k).get_shape() for k in keys}
    except (SafetensorError, OSError, ValueError) as exc:
        return f"corrupt ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
    if metadata.get("fmoe_converted_store") != str(format_version(shape.experts)):
        return (f"stale (format version {metadata.get('fmoe_converted_store')!r}, this fmoe writes "
                f"{format_version(shape.experts)})")
    want = _metadata(fingerprint, shape)
    for key in ("fingerprint", "experts", "shape"):
        if metadata.get(key) != want[key]:
            return f"stale (its {key} does not match the checkpoint)"
    layer_bytes = shape.num_experts * shape.intermediate * shape.neuron_bytes
    if keys != {f"layer.{i}" for i in range(shape.num_layers)} or any(s != [layer_bytes] for s in sizes.values()):
        return "corrupt (its tensors do not match its shape)"
    return None
