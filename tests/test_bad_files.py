"""Bad files end with one `error:` line naming the file and the real cause, exit code 2, memory
bounded (issue 22 §2). Each runs the command in a child process under a memory limit and a
timeout: an unbounded read is an out-of-memory failure or a timeout here, not a hung suite."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

MEMORY_LIMIT = 3 << 30  # bytes of address space: torch alone maps ~1.5 GiB; a whole /dev/zero needs more


def fmoe(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    code = "import sys; from fmoe_cli.cli import main; sys.argv = ['fmoe', *sys.argv[1:]]; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          preexec_fn=limit)


def one_error(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    return lines[0]


def write_lines(path: Path, lines: list, end: str = "\n") -> str:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + end)
    return str(path)


HEADER = {"fmoe_trace": 1, "num_layers": 2, "num_experts": 8}


def test_replay_dev_zero_stops_at_the_first_line():
    line = one_error(fmoe("replay", "/dev/zero", timeout=60))
    assert "/dev/zero:1: not a trace record: a line longer than 1048576" in line, line


def test_plan_trace_dev_zero_names_the_real_cause():
    line = one_error(fmoe("plan", "demo", "--vram", "1GiB", "--trace", "/dev/zero", timeout=60))
    assert "/dev/zero:1: not a trace record" in line, line


def test_a_header_then_short_records_names_the_record_and_what_is_missing(tmp_path):
    path = write_lines(tmp_path / "short.jsonl", [HEADER, {"seq": 0}])
    line = one_error(fmoe("replay", path))
    assert f"{path}:2: bad trace line: missing fields 'token', 'layer', 'experts', 'probs'" in line, line


def test_a_record_cut_short_at_the_end_of_the_file_says_so(tmp_path):
    path = write_lines(tmp_path / "cut.jsonl", [HEADER, '{"seq": 0, "token": 0, "layer": 0, "experts": [1'], end="")
    line = one_error(fmoe("replay", path))
    assert f"{path}:2: bad trace line: not valid JSON" in line and "cut short" in line, line


@pytest.mark.parametrize("args", [
    ("chat", "demo", "--profile", "/dev/zero"),
    ("plan", "demo", "--vram", "12GiB", "--profile", "/dev/zero"),
])
def test_profile_dev_zero_is_not_read_whole(args):
    line = one_error(fmoe(*args, timeout=60))
    assert "profile /dev/zero is larger than 16 MiB: not a profile" in line, line
