"""Bad options are refused before anything heavy is imported (issue 22 §1): the `error:` line is
printed, and the process exits 2, while neither torch nor transformers is in sys.modules: that is
what makes an option error answer in a fraction of a second instead of 6–8 s."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "huggingface_hub", "safetensors", "numpy")
# main() exits; the modules loaded at that moment are printed on stdout, after the command's own output.
PROBE = ("import sys\nfrom fmoe_cli.cli import main\nsys.argv = ['fmoe', *sys.argv[1:]]\n"
         "try:\n    main()\nexcept SystemExit as exc:\n"
         f"    print('HEAVY', sorted(set({HEAVY!r}) & set(sys.modules)), exc.code)\n")


def run_cli(*args: str) -> tuple[str, str]:
    result = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120)
    return result.stdout, result.stderr


@pytest.fixture
def existing(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("keep me\n")
    return str(path)


@pytest.mark.parametrize("args, fragment", [
    (("bench", "demo", "--policy", "bogus"), "unknown policy 'bogus'"),
    (("bench", "/nonexistent/model"), "no such model directory: /nonexistent/model"),
    (("bench", "demo", "--vram-budget", "12xx"), "cannot read the budget '12xx'"),
    (("bench", "demo", "--vram-budget", "1000TiB"), "more than this machine's memory"),
    (("bench", "demo", "--emulate-link", "0"), "--emulate-link"),
    (("bench", "demo", "--prompt-file", "/nonexistent/prompt.txt"), "prompt file /nonexistent/prompt.txt does not exist"),
    (("bench", "demo", "--prompt-file", "/dev/zero"), "prompt file /dev/zero is larger than 16 MiB"),
    (("bench", "demo", "--tokens", "0"), "--tokens must be at least 1"),
    (("bench", "demo", "--rounds", "0"), "--rounds must be at least 1"),
    (("bench", "demo", "--tokens", "100000000"), "--tokens 100000000: the context of 1024 tokens holds the prompt"),
    (("bench", "demo", "--warmup", "99999999999999999999999"), "--warmup 99999999999999999999999: the context of 1024 tokens"),
    (("chat", "demo", "--context", "100000"), "--context 100000 is longer than the model's context of 1024 tokens"),
    (("bench", "demo", "--dtype", "int3"), "unknown dtype 'int3'"),
    (("bench", "demo", "--experts", "int3"), "unknown expert format 'int3'"),
    (("bench", "demo", "--dense", "int2"), "unknown dense format 'int2'"),
    (("chat", "demo", "--dense", "fp4"), "unknown dense format 'fp4'"),
    (("serve", "demo", "--dense", "fp4"), "unknown dense format 'fp4'"),
    (("plan", "demo", "--dense", "fp4"), "unknown dense format 'fp4'"),
    (("bench", "demo", "--activations", "int4"), "unknown activations 'int4'"),
    (("chat", "demo", "--activations", "fp8"), "unknown activations 'fp8'"),
    (("bench", "demo", "--device", "tpu"), "unknown device 'tpu'"),
    (("bench", "demo", "--trace-out", "EXISTING"), "exists; give another name, or pass --force"),
    (("bench", "demo", "--replay-routing", "/nonexistent/t.jsonl"), "trace /nonexistent/t.jsonl does not exist"),
    (("bench", "demo", "--replay-routing", "EXISTING"), "bad trace line"),
    (("bench", "demo", "--predictor", "trace"), "needs fmoe bench --replay-routing"),
    (("chat", "demo", "--predictor", "trace"), "needs fmoe bench --replay-routing"),
    (("chat", "demo", "--temperature", "nan"), "--temperature"),
    (("chat", "demo", "--top-k", "-1"), "--top-k must be 0 (off) or more, got -1"),
    (("chat", "demo", "--min-p", "1.5"), "--min-p must be in [0, 1] (0: off), got 1.5"),
    (("chat", "demo", "--repetition-penalty", "0"), "--repetition-penalty must be in [0.001, 1000] (1: off), got 0.0"),
    (("chat", "demo", "--repetition-penalty", "1e-39"), "--repetition-penalty must be in [0.001, 1000] (1: off), got 1e-39"),
    (("chat", "demo", "--context", "0"), "--context must be at least 16 tokens for a conversation"),
    (("serve", "demo", "--context", "1"), "--context must be at least 16 tokens for a conversation"),
    (("chat", "demo", "--seed", "999999999999999999999999"), "--seed must be between -9223372036854775808 and"),
    (("chat", "demo", "--profile", "/nonexistent/profile.json"), "no profile at /nonexistent/profile.json"),
    (("chat", "demo", "--profile", "/dev/zero"), "profile /dev/zero is larger than 16 MiB"),
    (("serve", "demo", "--policy", "bogus"), "unknown policy 'bogus'"),
    (("chat", "demo", "--host-threads", "0"), "--host-threads must be between 1 and 256, got 0"),
    (("plan", "demo", "--vram", "25%"), "--vram '25%': give the device's memory as a size"),
    (("plan", "demo", "--vram", "12GiB", "--workspace", "50%"), "--workspace '50%': give the device memory kept"),
    (("plan", "demo", "--context", "-1"), "--context must be ≥ 0"),
    (("plan", "/nonexistent/config.json"), "no such file or model directory"),
    (("plan", "demo", "--vram", "12GiB", "--profile", "/dev/zero"), "profile /dev/zero is larger than 16 MiB"),
    (("profile", "--prefill-len", "0"), "--prefill-len must be between 1 and 65536, got 0"),
    (("profile", "--prefill-len", "99999999"), "--prefill-len must be between 1 and 65536, got 99999999"),
    (("profile", "--out", "EXISTING/p.json"), "p.json: no directory"),
    (("profile", "--out", "/nonexistent/dir/p.json"), "--out /nonexistent/dir/p.json: no directory /nonexistent/dir"),
    (("profile", "--out", "FIFO"), "is not a regular file; give a file name"),
    (("profile", "--out", "EXISTING"), "exists; give another name, or pass --force to overwrite it"),
    (("profile", "--model", "/nonexistent/model"), "no such model directory"),
    (("replay", "/nonexistent/trace.jsonl"), "trace /nonexistent/trace.jsonl does not exist"),
    (("plan", "demo", "--vram", "1GiB", "--trace", "/dev/zero"), "/dev/zero:1: not a trace record"),
], ids=lambda v: " ".join(v) if isinstance(v, tuple) else None)
def test_an_option_error_comes_before_torch_is_imported(existing, tmp_path, args, fragment):
    fifo = tmp_path / "fifo"  # a path that is not a regular file (as /dev/null is, which root's save would replace)
    os.mkfifo(fifo)
    out, err = run_cli(*(a.replace("EXISTING", existing).replace("FIFO", str(fifo)) for a in args))
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err
    assert out.strip().splitlines()[-1] == "HEAVY [] 2", out


NO_GPU_CASES = [
    (("plan", "demo"), "no GPU on this machine, so no GPU memory to plan for"),
    (("bench", "demo", "--device", "cuda"), "device cuda requested but no CUDA GPU is available"),
    (("chat", "demo", "--device", "cuda:0"), "device cuda:0 requested but no CUDA GPU is available"),
    (("profile", "--device", "cuda"), "device cuda requested but no CUDA GPU is available"),
]


@pytest.mark.parametrize("args, fragment", NO_GPU_CASES, ids=lambda v: " ".join(v) if isinstance(v, tuple) else None)
def test_a_gpu_asked_of_a_machine_without_one_is_refused_before_torch(args, fragment):
    """`--device cuda`, or `fmoe plan` with neither --vram nor --profile, where no GPU driver's node exists: refused
    before torch is imported (7 s of imports before, for the same line)."""
    from fmoe_cli.profiling.machine import surely_no_gpu

    if not surely_no_gpu():
        pytest.skip("a GPU may be here: torch decides")
    out, err = run_cli(*args)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err
    assert out.strip().splitlines()[-1] == "HEAVY [] 2", out


def test_no_gpu_is_said_only_where_no_driver_node_exists(monkeypatch):
    from fmoe_cli.profiling import machine

    present: set[str] = set()
    monkeypatch.setattr(machine.os.path, "exists", lambda path: path in present)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert machine.surely_no_gpu()
    for node in machine.GPU_NODES:  # any one driver's node: maybe a GPU, torch decides
        present.clear()
        present.add(node)
        assert not machine.surely_no_gpu(), node
    for hidden in ("", " ", "-1"):  # every device hidden from CUDA, whatever the nodes
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert machine.surely_no_gpu()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert not machine.surely_no_gpu()


@pytest.mark.parametrize("args", [("--help",), ("--version",), ("bench", "--help"), ("plan", "--help")])
def test_help_and_version_import_nothing_heavy(args):
    out, err = run_cli(*args)
    assert err == "" and out.strip().splitlines()[-1] == "HEAVY [] 0", out + err


@pytest.mark.parametrize("args", [("plan", "no-such-org/no-such-moe", "--vram", "1GiB"), ("bench", "no-such-org/no-such-moe"),
                                  ("chat", "no-such-org/no-such-moe"), ("profile", "--model", "no-such-org/no-such-moe"),
                                  ("serve", "no-such-org/no-such-moe", "--port", "0")], ids=lambda a: a[0])
def test_a_hub_model_is_fetched_before_torch_is_imported(args, tmp_path, monkeypatch):
    """A hub id's files come before torch and transformers (models/hub.py `fetch_model_early`,
    `fetch_config_early`): offline and not cached,
    the command says so in one line with only the hub client loaded (it took the 6–8 s of those imports before)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    out, err = run_cli(*args)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot download no-such-org/no-such-moe") \
        and "no network" in lines[0], err
    assert out.strip().splitlines()[-1] == "HEAVY ['huggingface_hub'] 2", out


def test_the_early_fetch_is_the_command_s_own_download(tmp_path, monkeypatch):
    """The command's `download` of the files fetched early takes their snapshot, without a second call to the hub;
    other files (another pattern list) are asked for."""
    import huggingface_hub

    from fmoe_cli.models import hub

    calls = []

    def snapshot_download(repo_id, allow_patterns, **kwargs):
        calls.append((repo_id, tuple(allow_patterns)))
        return str(tmp_path / repo_id.replace("/", "--"))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(hub, "_fetched", {})
    monkeypatch.setattr(hub, "snapshot_files", lambda repo_id, patterns: None)  # (the disk's room: tests/test_room.py)
    hub.fetch_model_early("org/model", False)
    hub.fetch_model_early("demo", False)  # not a hub id: nothing fetched
    (tmp_path / "config.json").write_text("{}")
    hub.fetch_config_early(str(tmp_path))  # a local directory: nothing fetched
    hub.fetch_config_early(str(tmp_path / "config.json"))  # a local config.json: nothing fetched
    assert hub.download("org/model", hub.model_patterns(False), "org/model") == tmp_path / "org--model"
    assert calls == [("org/model", ("config.json",)), ("org/model", tuple(hub.model_patterns(False)))]
    hub.download("org/model", hub.model_patterns(True), "org/model")  # with its code: other files
    assert len(calls) == 3 and "*.py" in calls[2][1] and "*.py" not in calls[1][1]
