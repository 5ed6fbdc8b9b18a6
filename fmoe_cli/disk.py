"""What fmoe keeps on disk (`fmoe cache`), and the sweep of what interrupted work left behind.

Three places (platformdirs): the config directory (profiles, routing statistics), the cache
directory (converted quantised stores; the random demo when the trained one is not shipped) and
the data directory (chat history). Writes are atomic through temporaries named
`.<file>.<pid>.<random>.tmp`; a process killed mid-write (SIGKILL during an int4 conversion)
leaves one behind. `sweep` removes a temporary whose writer is gone (its pid is not running) or
that is older than a day (another machine's pid, or a name without one), at every run's start; and a
lock file (`.<file>.lock`, holding its last owner's pid) whose owner is gone or that was last taken
over a day ago, when nobody holds it (fmoe_cli/files.py: `remove_unheld_lock`).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

from rich.text import Text

TEMPORARY = re.compile(r"^\..+?(?:\.(\d+))?\.[^.]+\.tmp$")  # .<file>.<pid>.<random>.tmp (pid: optional)
STALE_S = 24 * 3600  # a temporary older than this is orphaned whatever its pid says


CACHES = "caches (converted stores, compiled kernels)"


def converted_dir() -> Path:
    """Where quantised experts are converted to (offload/converted.py), kept between runs: what `fmoe cache clear`
    empties (not the compiled kernels beside it, which another fmoe may be building or loading)."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("fmoe")) / "converted"


def places() -> dict[str, Path]:
    """What each place holds -> where it is."""
    import platformdirs

    return {"profiles and routing statistics": Path(platformdirs.user_config_dir("fmoe")),
            CACHES: Path(platformdirs.user_cache_dir("fmoe")),
            "chat history": Path(platformdirs.user_data_dir("fmoe"))}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid > 0  # another user's process (or an impossible pid: not alive)
    return True


def orphaned(path: Path, now: float | None = None) -> bool:
    """A temporary file of fmoe's whose writer is gone (its pid is not running, or it is over a day old)."""
    match = TEMPORARY.match(path.name)
    if match is None:
        return False
    try:
        age = (time.time() if now is None else now) - path.stat().st_mtime
    except OSError:
        return False
    pid = match.group(1)
    return age > STALE_S or (pid is not None and int(pid) != os.getpid() and not _alive(int(pid)))


def stale_lock(path: Path, now: float | None = None) -> bool:
    """A lock file of fmoe's (`.<name>.lock`, files.locked) whose last owner is gone (its pid is not running)
    or that was last taken over a day ago. (Whether someone holds it now is checked when it is removed.)"""
    from fmoe_cli.files import lock_owner

    if not (path.name.startswith(".") and path.name.endswith(".lock")):
        return False
    try:
        age = (time.time() if now is None else now) - path.stat().st_mtime
    except OSError:
        return False
    pid = lock_owner(path)
    return age > STALE_S or (pid is not None and pid != os.getpid() and not _alive(pid))


def sweep(roots: list[Path] | None = None) -> list[Path]:
    """Remove the orphaned temporaries and the stale lock files nobody holds under `roots` (default: every
    place); returns what was removed."""
    from fmoe_cli.files import remove_unheld_lock

    removed = []
    for root in roots if roots is not None else list(places().values()):
        if not root.is_dir():
            continue
        for path in root.rglob("*.tmp"):
            if path.is_file() and orphaned(path):
                try:
                    path.unlink()
                    removed.append(path)
                except OSError:
                    pass  # (a read-only place, or gone meanwhile: nothing to do)
        for path in root.rglob(".*.lock"):
            if path.is_file() and stale_lock(path) and remove_unheld_lock(path):
                removed.append(path)
    return removed


def usage(root: Path) -> list[tuple[Path, int]]:
    """(entry, bytes) for every top-level entry of `root` (a directory's: everything under it), largest first."""
    if not root.is_dir():
        return []
    entries = []
    for entry in root.iterdir():
        files = [entry] if not entry.is_dir() else [p for p in entry.rglob("*") if p.is_file()]
        entries.append((entry, sum(p.stat().st_size for p in files if not p.is_symlink())))
    return sorted(entries, key=lambda e: -e[1])


def clear(root: Path) -> int:
    """Remove everything under `root` (kept: `root` itself); returns the bytes freed."""
    freed = 0
    for entry, size in usage(root):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
        freed += size
    return freed


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def run_cache(action: str, as_json: bool, console) -> dict:
    """`fmoe cache`: list every place with its entries and sizes; `clear`: empty the converted stores (rebuilt on
    the next quantised load), never the compiled kernels, profiles, statistics or history."""
    import json

    from fmoe_cli.errors import FmoeError

    if action not in ("list", "clear"):
        raise FmoeError(f"unknown action {action!r}: use `fmoe cache` (list) or `fmoe cache clear`")
    swept = sweep()
    where = places()
    freed = None
    if action == "clear":
        freed = clear(converted_dir())
    report = {"places": [{"what": what, "path": str(root), "bytes": sum(n for _, n in usage(root)),
                          "entries": [{"path": str(p), "bytes": n} for p, n in usage(root)]}
                         for what, root in where.items()],
              "swept": [str(p) for p in swept], "freed": freed}
    if as_json:
        print(json.dumps(report))
        return report
    for place in report["places"]:
        console.print(Text.assemble((place["what"], "bold"), f": {place['path']} ({_size(place['bytes'])})"),
                      highlight=False)
        for entry in place["entries"]:
            console.print(f"  {_size(entry['bytes']):>10}  {Path(entry['path']).name}", highlight=False)
    for path in swept:
        console.print(f"removed {'an unused lock file (left by a finished run)' if path.name.endswith('.lock') else 'an orphaned temporary file'}: {path}", highlight=False)
    if freed is not None:
        console.print(f"cleared the converted stores: {_size(freed)} freed (profiles, statistics and history kept)",
                      highlight=False)
    return report
