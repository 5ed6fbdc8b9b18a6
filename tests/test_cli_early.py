"""Bad options are refused in one line before the model loads; a bad command line reads like any
other bad input; nothing stray on stderr (issue 14, items 7 and the first-run list)."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

import fmoe_cli.run as run_module
from fmoe_cli.cli import app, main


def refuse_loading(*args, **kwargs):
    raise AssertionError("the model was loaded before the options were checked")


@pytest.fixture
def malformed_profile(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"kind": "fmoe-profile", "schema_version": 1, "device": {"device": {}}}))
    return str(path)


@pytest.mark.parametrize("command, args, fragment", [
    ("bench", ("--policy", "bogus"), "unknown policy"),
    ("bench", ("--emulate-link", "0"), "--emulate-link"),
    ("bench", ("--emulate-link", "inf"), "finite"),
    ("bench", ("--emulate-link", "nan"), "--emulate-link"),
    ("bench", ("--emulate-link", "1e-9"), "slower than any"),
    ("bench", ("--lcp-rho", "0"), "ρ"),
    ("bench", ("--lcp-omega", "inf"), "finite ω"),
    ("chat", ("--emulate-link", "inf"), "finite"),
    ("chat", ("--profile", "/nonexistent/profile.json"), "no profile"),
    ("chat", ("--profile", "MALFORMED"), "malformed"),
    ("chat", ("--temperature", "nan"), "--temperature"),
    ("chat", ("--temperature", "inf"), "--temperature"),
    ("bench", ("--vram-budget", "1000TB"), "more than this machine's memory"),
    ("chat", ("--vram-budget", "1000TiB"), "more than this machine's memory"),
    ("bench", ("--vram-budget", "25"), "has no unit"),
], ids=lambda v: " ".join(v) if isinstance(v, tuple) else v)
def test_options_are_checked_before_the_model_loads(monkeypatch, malformed_profile, command, args, fragment):
    monkeypatch.setattr(run_module, "load_model", refuse_loading)
    args = tuple(malformed_profile if a == "MALFORMED" else a for a in args)
    result = CliRunner().invoke(app, [command, "demo", "--device", "cpu", *args], input="hi\n/exit\n")
    text = result.output.strip()
    assert result.exit_code == 2, text
    assert len(text.splitlines()) == 1 and text.startswith("error: ") and fragment in text, text


@pytest.mark.parametrize("argv, fragment", [
    (["bench", "--tokens", "abc"], "Invalid value for '--tokens'"),
    (["bench", "--no-such-option"], "No such option: --no-such-option"),
    (["chat", "--temperature", "warm"], "Invalid value for '--temperature'"),
    (["nosuchcommand"], "No such command 'nosuchcommand'"),
])
def test_a_bad_command_line_is_one_error_line(monkeypatch, capsys, argv, fragment):
    monkeypatch.setattr(sys, "argv", ["fmoe", *argv])
    with pytest.raises(SystemExit) as exit_:
        main()
    captured = capsys.readouterr()
    assert exit_.value.code == 2
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], captured.err


def test_version(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["fmoe", "--version"])
    with pytest.raises(SystemExit) as exit_:
        main()
    from fmoe_cli import __version__

    assert exit_.value.code == 0 and capsys.readouterr().out == f"fmoe {__version__}\n"


def test_no_stray_line_on_stderr(checkpoints):
    result = CliRunner().invoke(app, ["bench", str(checkpoints["mixtral"]), "--policy", "lru", "--tokens", "2",
                                      "--warmup", "0", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert result.stderr == "", repr(result.stderr)
    assert result.stdout.splitlines()[0].strip()  # the first line of the output is not blank either


def test_plan_vram_is_a_size_not_a_share(checkpoints):
    result = CliRunner().invoke(app, ["plan", str(checkpoints["mixtral"]), "--vram", "25%"])
    text = result.output.strip()
    assert result.exit_code == 2 and len(text.splitlines()) == 1 and "--vram 25%" in text, text
