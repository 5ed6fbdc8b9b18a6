"""The benchmark scripts' first-run messages (they are not part of the package, but a newcomer runs them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_routing_report_says_it_needs_the_bible_program():
    """Without Debian's `bible` on PATH the default held-out text cannot be made: one line saying what to install."""
    env = dict(os.environ, PATH="/nonexistent", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "routing_report.py")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "apt-get install bible-kjv" in result.stderr and "--text FILE" in result.stderr  # its own option
    assert "Traceback" not in result.stderr
