"""Bad files end with one `error:` line naming the file and the real cause, exit code 2, memory
bounded (issue 22 §2). A file that could be read without bound (/dev/zero) is given to the command
in a child process under a memory limit and a timeout: an unbounded read is an out-of-memory
failure or a timeout here, not a hung suite. The small bad files (a tiny checkpoint, a short trace)
are given to the command in-process, as tests/test_cli_errors.py does."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fmoe_cli.cli import app

MEMORY_LIMIT = 3 << 30  # bytes of address space: torch alone maps ~1.5 GiB; a whole /dev/zero needs more


def fmoe(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    code = "import sys; from fmoe_cli.cli import main; sys.argv = ['fmoe', *sys.argv[1:]]; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          preexec_fn=limit)


def fmoe_here(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    """The command run in this process (a small input: nothing to bound)."""
    result = CliRunner().invoke(app, list(args), input=input)
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


def one_error(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    assert not result.stdout.startswith("error:")  # stdout (the results, when there are any) is apart
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
    line = one_error(fmoe_here("replay", path))
    assert f"{path}:2: bad trace line: missing fields 'token', 'layer', 'experts', 'probs'" in line, line


def test_a_record_cut_short_at_the_end_of_the_file_says_so(tmp_path):
    path = write_lines(tmp_path / "cut.jsonl", [HEADER, '{"seq": 0, "token": 0, "layer": 0, "experts": [1'], end="")
    line = one_error(fmoe_here("replay", path))
    assert f"{path}:2: bad trace line: not valid JSON" in line and "cut short" in line, line


@pytest.mark.parametrize("args", [
    ("chat", "demo", "--profile", "/dev/zero"),
    ("plan", "demo", "--vram", "12GiB", "--profile", "/dev/zero"),
])
def test_profile_dev_zero_is_not_read_whole(args):
    line = one_error(fmoe(*args, timeout=60))
    assert "profile /dev/zero is larger than 16 MiB: not a profile" in line, line


# --- malformed checkpoints: checked against config.json before anything is loaded ---------------


def copy_checkpoint(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def rewrite_header(file: Path, edit) -> None:
    """A safetensors file with its header edited (the data left as it is)."""
    import struct

    data = file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    file.write_bytes(struct.pack("<Q", len(new)) + new + data[8 + n:])


def halve_first_dim(header: dict, suffix: str) -> str:
    key = next(k for k in header if k.endswith(suffix))
    rows, cols = header[key]["shape"]
    header[key]["shape"] = [rows // 2, cols * 2]  # the same bytes: only the config can tell
    return key


@pytest.mark.parametrize("suffix", ["layers.0.block_sparse_moe.experts.0.w1.weight", "layers.0.self_attn.o_proj.weight"])
def test_a_tensor_shape_that_disagrees_with_the_config(checkpoints, tmp_path, suffix):
    path = copy_checkpoint(checkpoints["mixtral"], tmp_path / "model")
    rewrite_header(path / "model.safetensors", lambda h: halve_first_dim(h, suffix))
    line = one_error(fmoe_here("bench", str(path), "--policy", "lru", "--tokens", "1", "--warmup", "0",
                               "--device", "cpu"))
    assert "model.safetensors" in line and suffix in line and "has shape [32, 128]" in line, line
    assert "config.json makes it [64, 64]" in line, line


def test_a_float8_checkpoint_without_its_scales_is_refused(checkpoints, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    path = copy_checkpoint(checkpoints["mixtral"], tmp_path / "model")
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k: v.to(torch.float8_e4m3fn) for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    line = one_error(fmoe_here("bench", str(path), "--policy", "lru", "--tokens", "1", "--warmup", "0",
                               "--device", "cpu"))
    assert "is stored as F8_E4M3" in line and "float8 ones with their block scales" in line, line
    assert "which this one lacks" in line, line


@pytest.mark.parametrize("field, value, fragment", [
    ("hidden_size", "4096", "hidden_size must be an integer, got '4096'"),
    ("hidden_size", 1e12, "hidden_size must be an integer, got 1000000000000.0"),
    ("hidden_size", 10**12, "hidden_size = 1000000000000 is not a size any model has"),
    ("hidden_size", None, "has no hidden_size (a plan needs it; fmoe never assumes a default)"),
    ("num_hidden_layers", 0, "num_hidden_layers = 0 is not a size any model has"),
    ("num_experts_per_tok", 16, "num_experts_per_tok = 16 routes to more experts than the 8 of each layer"),
    ("intermediate_size", -1, "intermediate_size = -1 is not a size"),
])
@pytest.mark.parametrize("command", ["bench", "plan"])
def test_config_fields_are_checked_as_written(checkpoints, tmp_path, command, field, value, fragment):
    path = copy_checkpoint(checkpoints["mixtral"], tmp_path / "model")
    config = json.loads((path / "config.json").read_text())
    if value is None:
        del config[field]
    else:
        config[field] = value
    (path / "config.json").write_text(json.dumps(config))
    extra = ("--vram", "1GiB") if command == "plan" else ("--device", "cpu")
    line = one_error(fmoe_here(command, str(path), *extra))
    assert f"{path}/config.json" in line and fragment in line, line


# --- a save that fails: the results come first ----------------------------------------------


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a disk that is always full)")
@pytest.mark.parametrize("as_json", [False, True])
def test_bench_trace_out_on_a_full_disk_prints_the_results_first(checkpoints, as_json):
    result = fmoe_here("bench", str(checkpoints["mixtral"]), "--policy", "lru", "--tokens", "2", "--warmup", "0",
                       "--device", "cpu", "--trace-out", "/dev/full", "--force", *(("--json",) if as_json else ()))
    line = one_error(result)
    assert "cannot write trace /dev/full: No space left on device (the results above are complete)" in line, line
    if as_json:
        report = json.loads(result.stdout)
        assert [r["policy"] for r in report["runs"]] == ["lru"] and "No space left" in report["trace_error"]
    else:
        assert any(row.split()[:1] == ["lru"] for row in result.stdout.splitlines()), result.stdout


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_trace_writer_on_a_full_disk_keeps_the_reason_and_never_raises():
    from fmoe_cli.trace import TraceWriter

    writer = TraceWriter("/dev/full", num_layers=1, overwrite=True, buffer_lines=2)
    for token in range(5):  # the first flush fails; the records after it are dropped, not raised
        writer.record(0, token, 0, [1], [1.0])
    writer.close()
    assert writer.closed and writer.error == "cannot write trace /dev/full: No space left on device"


# --- what a prompt, a system prompt and a tokenizer need --------------------------------------


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("keep", ["tokenizer_config.json", "nothing"])
def test_a_deleted_tokenizer_is_named(checkpoints, tmp_path, family, keep):
    """tokenizer.json gone, its config kept; or a directory of config.json and weights alone (transformers then
    builds an empty tokenizer that encodes every prompt to nothing): either way the line names the files it lacks."""
    path = copy_checkpoint(checkpoints[family], tmp_path / "model")
    for file in path.iterdir():
        if file.name != "config.json" and not file.name.endswith(".safetensors") and file.name != keep:
            file.unlink()
    assert (keep == "nothing") == (sorted(f.name for f in path.iterdir() if f.name != "config.json"
                                          and not f.name.endswith(".safetensors")) == [])
    line = one_error(fmoe_here("bench", str(path), "--policy", "lru", "--tokens", "1", "--warmup", "0",
                               "--device", "cpu"))
    assert "has no tokenizer: none of tokenizer.json" in line and str(path) in line, line


def test_a_prompt_file_longer_than_the_context_says_so(checkpoints, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("word " * 5000)  # ~1 token a word: 10 × the tiny model's 512
    line = one_error(fmoe_here("bench", str(checkpoints["mixtral"]), "--policy", "lru", "--tokens", "1",
                               "--warmup", "0", "--device", "cpu", "--prompt-file", str(prompt)))
    assert "the prompt is longer than the context (" in line and " tokens > 512)" in line, line


def test_a_huge_system_prompt_is_refused_once_at_the_start(checkpoints):
    result = fmoe_here("chat", str(checkpoints["mixtral"]), "--device", "cpu", "--system", "word " * 1000,
                       input="hello\nhello again\n/exit\n")
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stdout + result.stderr  # once, not per message
    assert "the system prompt alone is" in errors[0] and "context of 512 tokens" in errors[0], errors
