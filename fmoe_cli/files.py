"""Files fmoe keeps for the user: JSON read with one-line errors, atomic writes, locks, file names per model.

Profiling and planning both use these; this module imports nothing of fmoe except errors.

- `write_atomic`: a unique temporary file in the same directory, fsync, then rename: a reader
  sees the old file or the new one, never half of one; two writers never share a temporary.
- `locked(path)`: an exclusive lock (`.<name>.lock` beside the file, holding its last owner's pid)
  around read-merge-write, so two sessions saving the same file both count. Where no lock can be
  taken (a read-only directory, a system without `fcntl`), it goes on unlocked: the write itself
  then fails or wins. A lock file nobody holds can be removed (`remove_unheld_lock`: the sweep).
- `set_aside(path)`: a damaged file is renamed `<name>.corrupt-<time>` (one of an old schema version
  `<name>.v<version>-<time>`), never deleted.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import json
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from fmoe_cli.errors import FmoeError, reading


MiB = 1 << 20
JSON_LIMIT = 16 * MiB  # a profile, a config.json: far larger is not one (`--profile /dev/zero`)


def read_bytes(path: Path, what: str, limit: int) -> bytes:
    """The bytes of a user's file, read only up to `limit` (+1 to tell): a larger file, or an endless
    one (/dev/zero), is a one-line FmoeError naming it, never a process that grows until it is killed."""
    with reading(path, what), open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise FmoeError(f"{what} {path} is larger than {limit / MiB:g} MiB: not a {what}")
    return data


def read_text(path: Path, what: str, limit: int) -> str:
    """A user's UTF-8 text file of at most `limit` bytes (`read_bytes`), or a one-line FmoeError."""
    data = read_bytes(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise FmoeError(f"{what} {path} is not a text (UTF-8) file") from None


def read_json(path: Path, what: str, hint: str = "", limit: int = JSON_LIMIT) -> object:
    """JSON from a file of at most `limit` bytes, or a one-line FmoeError saying what is wrong (`hint`:
    what to do if it is missing)."""
    path = Path(path)
    if path.is_dir():
        raise FmoeError(f"{what} {path} is a directory, not a file; move it away{hint}")
    if not path.exists():
        raise FmoeError(f"no {what} at {path}{hint}")
    data = read_bytes(path, what, limit)
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FmoeError(f"{what} {path} is not valid JSON ({exc.__class__.__name__}: {exc})") from None


def write_atomic(path: Path, text: str) -> Path:
    """Write `text` to a unique temporary file beside `path`, fsync it, rename it over `path`.

    Raises OSError (a read-only directory, a full disk, a path that is not a regular file: the rename would replace a
    device or a pipe, /dev/null for root, with the file): the caller decides whether that is fatal."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise OSError(errno.EEXIST, "not a regular file", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    # .<name>.<pid>.<random>.tmp: a temporary whose writer is gone is swept at the next start (disk.py)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename itself survives a crash once the directory is synced
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return path


def lock_path(path: Path) -> Path:
    """The lock file of `path`: `.<name>.lock` beside it."""
    return path.parent / f".{path.name}.lock"


@contextlib.contextmanager
def locked(path: Path) -> Iterator[bool]:
    """Hold an exclusive lock for `path` (blocks until other holders are done). Yields whether it is held.

    The lock file holds its last owner's pid. A lock taken on a file that was removed meanwhile (the sweep
    removes a stale one: `remove_unheld_lock`) is let go and taken again on the file now at the path, so
    two holders never lock two different files."""
    path = Path(path)
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks here; writes stay atomic
        yield False
        return
    where = lock_path(path)
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(where, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            yield False
            return
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            current = os.stat(where).st_ino
        except OSError:
            current = None
        if current == os.fstat(fd).st_ino:
            break
        os.close(fd)  # removed (or replaced) while we waited: lock the file at the path now
    try:
        with contextlib.suppress(OSError):  # the owner, for the sweep (a read-only lock file: no pid)
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
        yield True
    finally:
        os.close(fd)  # releases the lock


def lock_owner(where: Path) -> int | None:
    """The pid a lock file names (its last holder), None when it names none."""
    try:
        text = where.read_text()[:32].strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def remove_unheld_lock(where: Path) -> bool:
    """Remove the lock file `where` if nobody holds it (taken without waiting, removed while held: `locked`
    then never locks it again). Returns whether it was removed."""
    try:
        import fcntl
    except ImportError:
        return False
    try:
        fd = os.open(where, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: in use
        os.close(fd)
        return False
    try:
        if os.stat(where).st_ino != os.fstat(fd).st_ino:
            return False
        where.unlink()
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def set_aside(path: Path, why: str = "corrupt", read: os.stat_result | None = None) -> Path | None:
    """Rename a damaged file to `<name>.<why>-<UTC time>` (kept for the user, out of the way; `why`: `corrupt`,
    or the old schema version of a file this fmoe no longer reads, e.g. `v1`). `read`: the file's stat when it was
    read; where the file there now is another (another process saved a new one since), nothing is moved: None."""
    path = Path(path)
    if read is not None:
        try:
            now = os.stat(path)
        except OSError:
            return None
        if (now.st_ino, now.st_mtime_ns, now.st_size) != (read.st_ino, read.st_mtime_ns, read.st_size):
            return None
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target = path.with_name(f"{path.name}.{why}-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.{why}-{stamp}-{n}")
    os.replace(path, target)
    return target


def writable_dir(directory: Path) -> str | None:
    """None if files can be created in `directory` (made if missing), else why not (one phrase)."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".fmoe-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def model_slug(model: str) -> str:
    """A file name for a model id or directory ('mistralai/Mixtral-8x7B-v0.1' -> 'mistralai--Mixtral-8x7B-v0.1')."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "--", model.strip().rstrip("/")).strip("-.")
    return slug or "model"
