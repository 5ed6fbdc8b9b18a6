"""Which model a saved file belongs to: a checkpoint's fingerprint and the model key of file names.

Saved routing statistics, profiles and converted stores are per model. A name alone
does not say which model: a local directory called `demo` is not the built-in demo,
and a directory re-used for another checkpoint is another model. So files are keyed by

    model key = <readable name>-<12 hex digits of sha256(where the model comes from, fingerprint)>

where "where it comes from" is `builtin:demo`, the resolved directory (`dir:/abs/path`),
or the hub id (`hub:org/name`), and the fingerprint hashes config.json (canonical JSON)
and every weight file's name, size and safetensors header (tensor names, dtypes, shapes,
offsets). Cheap: the headers only, never the weights; a changed revision changes it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from fmoe_cli.files import model_slug

MAX_HEADER_BYTES = 100 * 1024**2  # safetensors' own limit on the JSON header
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _model_dir(path: Path) -> tuple[Path, Path]:
    """(directory, its config.json) for a model directory or a config.json path."""
    path = Path(path).expanduser()
    if path.is_file():
        return path.parent, path
    return path, path / "config.json"


def checkpoint_fingerprint(path: Path) -> str:
    """sha256 (hex) of config.json (canonical JSON: key order and spaces do not matter) and, per weight
    file in name order, its name, size and safetensors header. Never raises on a damaged file: its
    bytes are hashed as they are (the loader says what is wrong with it)."""
    directory, config = _model_dir(path)
    h = hashlib.sha256()
    try:
        text = config.read_bytes()
        try:
            h.update(json.dumps(json.loads(text), sort_keys=True, separators=(",", ":")).encode())
        except (ValueError, UnicodeDecodeError):
            h.update(text)
    except OSError:
        h.update(b"no config.json")
    try:
        weights = sorted(p for p in directory.iterdir() if p.name.endswith(WEIGHT_SUFFIXES) and p.is_file())
    except OSError:
        weights = []
    for weight in weights:
        h.update(b"\0" + weight.name.encode() + b"\0")
        try:
            size = weight.stat().st_size
            h.update(str(size).encode())
            if weight.suffix == ".safetensors":
                with open(weight, "rb") as f:
                    head = f.read(8)
                    h.update(head)
                    if len(head) == 8:  # u64 little-endian header length, then the JSON header
                        (n,) = struct.unpack("<Q", head)
                        h.update(f.read(min(n, size - 8, MAX_HEADER_BYTES)))
        except OSError:
            h.update(b"unreadable")
    return h.hexdigest()


def model_source(model: str) -> str:
    """Where a model named on the command line comes from (as models.load.resolve_model resolves it):
    'builtin:demo', 'dir:<absolute resolved path>' or 'hub:<id>'."""
    if model == "demo":
        return "builtin:demo"
    local = Path(model).expanduser()
    if local.exists():
        return f"dir:{local.resolve()}"
    return f"hub:{model.strip().rstrip('/')}"


def model_key(model: str, path: Path | None = None) -> str:
    """The file-name key of a model: readable name plus a hash of its source and fingerprint.

    `model`: as the user named it (id, directory, config.json or 'demo'); `path`: its resolved
    directory (or config.json) if known, else `model` itself when it is local. A hub id whose
    files are not at hand is keyed by its id alone."""
    source = model_source(model)
    if source.startswith("dir:") and Path(source[4:]).is_file():  # a config.json: its directory is the model
        source = f"dir:{Path(source[4:]).parent}"
    where = path if path is not None else (Path(source[4:]) if source.startswith("dir:") else None)
    fingerprint = checkpoint_fingerprint(where) if where is not None else "unknown"
    name = source.split(":", 1)[1]
    readable = model_slug(name if source.startswith("hub:") else Path(name).name)
    digest = hashlib.sha256(f"{source}\n{fingerprint}".encode()).hexdigest()[:12]
    return f"{readable}-{digest}"
