"""Interrupted work leaves nothing behind (issue 22 §3): a writer killed mid-write leaves its
temporary, which the next start sweeps; `fmoe cache` lists what fmoe keeps, with sizes, and clears
the converted stores only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from fmoe_cli.cli import app
from fmoe_cli.disk import CACHES, STALE_S, places, sweep

KILLED_WRITER = """
import os, sys, time
from pathlib import Path
import fmoe_cli.files as files
def hang(*args):
    print("written", flush=True)
    time.sleep(600)
os.replace = hang  # the rename never comes: SIGKILL arrives first
files.write_atomic(Path(sys.argv[1]) / "profile.json", "{}" * 1000)
"""


def test_a_temporary_of_a_killed_writer_is_swept(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "written"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
    left = list(tmp_path.glob(".profile.json.*.tmp"))
    assert len(left) == 1 and f".{child.pid}." in left[0].name  # the writer's pid is in the name
    assert sweep([tmp_path]) == left and not left[0].exists()
    assert not (tmp_path / "profile.json").exists()


def test_sweep_keeps_a_live_writers_temporary_and_everything_else(tmp_path):
    live = tmp_path / f".stats.json.{os.getppid()}.abcd1234.tmp"  # a running process (the test runner's parent)
    old = tmp_path / f".stats.json.{os.getppid()}.efgh5678.tmp"
    plain = tmp_path / "notes.tmp"  # not one of fmoe's temporaries
    mine = tmp_path / "stats.json"
    for path in (live, old, plain, mine):
        path.write_text("x")
    stale = time.time() - STALE_S - 60
    os.utime(old, (stale, stale))
    assert sweep([tmp_path]) == [old]
    assert live.exists() and plain.exists() and mine.exists()


def test_fmoe_cache_lists_with_sizes_and_clears_the_converted_stores_only():
    where = places()
    config, cache = where["profiles and routing statistics"], where[CACHES]
    (cache / "converted").mkdir(parents=True, exist_ok=True)
    kernel = cache / "kernels" / "fmoe-0123.so"  # compiled kernels: kept (another fmoe may be loading them)
    kernel.parent.mkdir(parents=True, exist_ok=True)
    kernel.write_bytes(b"\0" * 16)
    store = cache / "converted" / "0123456789abcdef0123-int4-v2.safetensors"
    store.write_bytes(b"\0" * 3 * 2**20)
    profile = config / "profiles" / "device.json"
    profile.parent.mkdir(parents=True, exist_ok=True)
    profile.write_text("{}")
    listed = CliRunner().invoke(app, ["cache", "--json"])
    assert listed.exit_code == 0, listed.output
    report = json.loads(listed.stdout)
    sizes = {p["path"]: p["bytes"] for p in report["places"]}
    assert sizes[str(cache)] >= 3 * 2**20 and sizes[str(config)] >= 2
    text = CliRunner().invoke(app, ["cache"]).stdout
    assert str(cache) in text and "MiB" in text
    cleared = CliRunner().invoke(app, ["cache", "clear"])
    assert cleared.exit_code == 0 and "MiB freed" in cleared.stdout, cleared.output
    assert not store.exists() and profile.exists() and kernel.exists()
    bad = CliRunner().invoke(app, ["cache", "bogus"])
    assert bad.exit_code == 2 and bad.output.startswith("error: unknown action 'bogus'")


HELD_LOCK = """
import sys, time
from pathlib import Path
from fmoe_cli.files import locked
with locked(Path(sys.argv[1]) / "stats.json"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_stale_lock_files_are_swept_and_a_held_or_live_one_is_kept(tmp_path):
    """Issue 22 §3: a killed session leaves `.<file>.lock` beside its statistics forever. The lock file names
    its owner's pid; the sweep removes one whose owner is gone, or last taken over a day ago, unless someone
    holds it now; a lock taken after the sweep works on a fresh file."""
    from fmoe_cli.files import lock_owner, locked

    child = subprocess.Popen([sys.executable, "-c", HELD_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        held = tmp_path / ".stats.json.lock"
        assert lock_owner(held) == child.pid
        stale = time.time() - STALE_S - 60
        os.utime(held, (stale, stale))
        assert sweep([tmp_path]) == [] and held.exists()  # old, but held right now: kept
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
    os.utime(held, None)  # fresh, but its owner is dead
    live = tmp_path / ".profile.json.lock"
    live.write_text(str(os.getppid()))  # a running process, released: kept
    old = tmp_path / ".history.lock"
    old.write_text("")  # no pid, last taken over a day ago
    os.utime(old, (stale, stale))
    other = tmp_path / "notes.lock"  # not fmoe's
    other.write_text("1")
    assert sorted(sweep([tmp_path])) == sorted([held, old])
    assert live.exists() and other.exists() and not held.exists()
    with locked(tmp_path / "stats.json") as ok:
        assert ok and lock_owner(held) == os.getpid()
