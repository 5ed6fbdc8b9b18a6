"""Files fmoe keeps for the user: JSON read with one-line errors, atomic writes, file names per model.

Profiling and planning both use these; this module imports nothing of fmoe except errors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from fmoe_cli.errors import FmoeError


def read_json(path: Path, what: str, hint: str = "") -> object:
    """JSON from a file, or a one-line FmoeError saying what is wrong (`hint`: what to do if it is missing)."""
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, IsADirectoryError):
        raise FmoeError(f"no {what} at {path}{hint}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FmoeError(f"{what} {path} is not valid JSON ({exc.__class__.__name__}: {exc})") from None


def write_atomic(path: Path, text: str) -> Path:
    """Write through a temporary file and rename: never leave a half-written file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def model_slug(model: str) -> str:
    """A file name for a model id or directory ('mistralai/Mixtral-8x7B-v0.1' -> 'mistralai--Mixtral-8x7B-v0.1')."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "--", model.strip().rstrip("/")).strip("-.")
    return slug or "model"
