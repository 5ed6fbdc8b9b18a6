"""The repository as a clone sees it: no tracked file names a path that exists only on the machines it was made on."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Written in pieces so that this file does not name them itself.
OUTSIDE = ("/wor" "k/", "../sha" "red")


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60)


def test_no_tracked_file_names_a_path_outside_the_repository():
    """`git grep` over the tracked files for the project machines' absolute paths and the shared folder beside the
    checkout: a clone has neither, so nothing may depend on or point a reader at them."""
    if shutil.which("git") is None or git("rev-parse", "--show-toplevel").stdout.strip() != str(ROOT):
        pytest.skip("not a git checkout")
    found = git("grep", "-n", "-F", *[a for path in OUTSIDE for a in ("-e", path)])
    assert found.returncode in (0, 1), found.stderr  # 1: no match
    assert found.stdout == "", "tracked files name paths outside the repository:\n" + found.stdout
