"""Whether a model fits here: host RAM for its experts and other weights, and disk for its download. Sizes alone, no
torch, so that a hub model that cannot run on this machine is refused from its config.json (kilobytes), before the
download of its weights (tens of gigabytes): models/hub.py `fetch_model_early`.

The load checks host RAM again with the built skeleton's exact sizes (models/load.py `check_host_ram` call); the check
before the download counts the experts alone (`config_expert_shape`), which a family fmoe does not know the layers of
skips.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

from fmoe_cli.errors import FmoeError
from fmoe_cli.models.config import config_expert_shape
from fmoe_cli.types import DTYPES, EXPERT_FORMATS, ExpertShape

GiB = 1024**3


def host_ram_needed(shape: ExpertShape, non_expert_bytes: int) -> int:
    """Host RAM a load needs at its peak: the expert store and the other weights (measured within 1.15×
    of this: tests/test_loading.py, benchmarks/loading.py)."""
    return shape.all_experts_bytes + non_expert_bytes


def host_ram_free() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def check_host_ram(label: str, shape: ExpertShape, non_expert_bytes: int | None) -> None:
    """Refuse, in one line with the numbers, a model that would not fit in host RAM (not the OOM killer).
    `non_expert_bytes` None: not known yet (before the download), the experts alone are held to the free RAM."""
    other = non_expert_bytes or 0
    need, free = host_ram_needed(shape, other), host_ram_free()
    if need <= free:
        return
    fitting = [f for f in EXPERT_FORMATS if host_ram_needed(replace(shape, experts=f), other) <= free]
    # (the most precise format that fits: EXPERT_FORMATS runs from bf16 to int2)
    hint = f"; --experts {fitting[0]} needs {host_ram_needed(replace(shape, experts=fitting[0]), other) / GiB:.1f} GiB" \
        if fitting else ""
    if shape.experts == "bf16" and shape.dtype_bytes == 4:  # float32 compute (the CPU's default) holds 4 bytes a weight
        halved = host_ram_needed(replace(shape, dtype_bytes=2), other // 2)
        if halved <= free:
            hint = f"; --dtype bfloat16 needs {halved / GiB:.1f} GiB" + (f", {hint[2:]}" if hint else "")
    parts = (f"experts {shape.all_experts_bytes / GiB:.1f} + other weights {other / GiB:.1f} GiB"
             if non_expert_bytes is not None else "its experts alone, before its other weights")
    raise FmoeError(f"{label} needs {'at least ' if non_expert_bytes is None else ''}{need / GiB:.1f} GiB of host RAM "
                    f"with --experts {shape.experts} ({parts}) but {free / GiB:.1f} GiB is free here{hint}")


def compute_dtype_bytes(dtype: str | None, on_cpu: bool) -> int:
    """The bytes of a run's compute dtype, known before torch (models/load.py `pick_dtype`): --dtype's, else float32
    on the CPU; on a GPU bfloat16 or float16, 2 either way."""
    if dtype not in (None, "auto"):
        return 4 if DTYPES[dtype] == "float32" else 2
    return 4 if on_cpu else 2


def check_host_ram_early(label: str, fields: dict, dtype_bytes: int, experts: str) -> None:
    """The host-RAM check from config.json's fields (models/config.py `check_servable`), before the download: the
    experts alone against the free RAM, where the family's MoE layers are known."""
    shape = config_expert_shape(fields, dtype_bytes, experts)
    if shape is not None:
        check_host_ram(label, shape, None)


def _existing(path: Path) -> Path:
    """`path` or its nearest existing parent (a cache directory not made yet is on its parent's disk)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_download_room(label: str, files: list[tuple[str, int]], cached: set[str], cache_dir: Path) -> None:
    """Refuse, in one line, a download that would fill the disk: `files` (name, bytes) of the snapshot, less those
    already `cached`, against the free space where the hub client keeps its cache."""
    names = [(name, size) for name, size in files if name not in cached]
    need = sum(size for _, size in names)
    free = shutil.disk_usage(_existing(cache_dir)).free
    if need > free:
        raise FmoeError(f"{label}'s download needs {need / GiB:.1f} GiB ({len(names)} files) but {free / GiB:.1f} GiB "
                        f"is free in {cache_dir} (HF_HOME or HF_HUB_CACHE can point it at a larger disk)")
