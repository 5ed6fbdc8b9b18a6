"""Imports go one way (docs/architecture.md): the layers contract in pyproject.toml
([tool.importlinter]) fails on any import — module-level or inside a function — from a
lower package to a higher one, so no import cycle between packages can appear."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import fmoe_cli

ROOT = Path(fmoe_cli.__file__).parent.parent


def test_imports_go_one_way():
    # lint-imports imports the packages it checks: run it on this checkout, in a child process.
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                             "sys.exit(lint_imports_command())", "--config", str(ROOT / "pyproject.toml"),
                             "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "1 kept, 0 broken" in result.stdout


def test_cli_imports_no_torch():
    """`fmoe --help` stays fast: the option tables cli.py reads import no torch or transformers."""
    code = "import sys, fmoe_cli.cli; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
