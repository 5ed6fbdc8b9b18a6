"""State files fmoe keeps for the user (issue 14): keyed by model identity, written atomically,
merged under a lock, set aside when damaged, and never the reason a result is lost."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import threading

import numpy as np
import pytest
from typer.testing import CliRunner

from fmoe_cli.cli import app
from fmoe_cli.files import writable_dir, write_atomic
from fmoe_cli.models.identity import checkpoint_fingerprint, model_key
from fmoe_cli.planning.stats import (
    RoutingStats,
    StatsRecorder,
    default_stats_path,
    load_or_empty,
    open_recorder,
)
from fmoe_cli.profiling.files import default_profile_path

N, K, L = 6, 2, 2


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody can write in: a 0o555 mode, or (as root, who ignores modes) a read-only mount."""
    d = tmp_path / "read-only"
    d.mkdir()
    os.chmod(d, 0o555)
    if writable_dir(d) is None:
        os.chmod(d, 0o755)
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(d)], capture_output=True)
        if mounted.returncode != 0:
            pytest.skip("cannot make a read-only directory here")
        yield d
        subprocess.run(["umount", str(d)], check=True)
    else:
        yield d
        os.chmod(d, 0o755)


def observed(tokens: int, seed: int = 0, model: str = "m") -> RoutingStats:
    rng = np.random.default_rng(seed)
    stats = RoutingStats.empty(model, L, N, K)
    for _ in range(tokens):
        for layer in range(L):
            stats.observe(layer, rng.choice(N, K, replace=False).tolist(), rng.permutation(N).tolist(),
                          rng.permutation(N).tolist())
    return stats


def observe_more(recorder: StatsRecorder, tokens: int, seed: int) -> None:
    more = observed(tokens, seed)
    for mine, extra in zip(recorder.stats.layers, more.layers):
        mine.add(extra)


# --- identity ----------------------------------------------------------------


def test_a_directory_named_demo_is_not_the_builtin_demo(tmp_path, monkeypatch):
    from fmoe_cli.models.demo import demo_path

    shutil.copytree(demo_path(), tmp_path / "demo")  # the very same files, elsewhere
    monkeypatch.chdir(tmp_path)
    builtin = default_stats_path("demo", tmp_path)
    for name in ("./demo", "demo/", str(tmp_path / "demo")):
        assert default_stats_path(name, tmp_path) != builtin, name
        assert default_profile_path(model_key(name), tmp_path) != default_profile_path(model_key("demo"), tmp_path), name
    # one directory named three ways is one model
    assert len({default_stats_path(name, tmp_path) for name in ("./demo", "demo/", str(tmp_path / "demo"))}) == 1
    # the built-in demo's 9,130 tokens survive a session of the local directory
    observed(9130, model="demo").save(builtin)
    local = open_recorder("./demo", L, N, K, default_stats_path("./demo", tmp_path))
    observe_more(local, 76, seed=1)
    local.save()
    assert RoutingStats.load(builtin).tokens == 9130


def test_fingerprint_sees_config_and_weight_headers_not_times(checkpoints, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(checkpoints["mixtral"], path)
    before = checkpoint_fingerprint(path)
    os.utime(path / "config.json", (1, 1))
    assert checkpoint_fingerprint(path) == before
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config, indent=7, sort_keys=True))  # same JSON, other text
    assert checkpoint_fingerprint(path) == before
    config["rms_norm_eps"] = 1e-3
    (path / "config.json").write_text(json.dumps(config))
    changed_config = checkpoint_fingerprint(path)
    assert changed_config != before
    weights = next(path.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[12] ^= 0x01  # one byte of the header's JSON (a tensor name, dtype or offset)
    weights.write_bytes(bytes(data))
    assert checkpoint_fingerprint(path) != changed_config
    assert model_key(str(path)) != model_key(str(checkpoints["mixtral"]))
    weights.write_bytes(b"garbage")  # a damaged file is hashed as it is, never raises
    assert len(checkpoint_fingerprint(path)) == 64


# --- atomic writes, locks, merging ---------------------------------------------


def test_concurrent_writers_and_a_reader_never_fail_nor_see_half_a_file(tmp_path):
    path = tmp_path / "state.json"
    write_atomic(path, json.dumps({"n": -1, "pad": "x" * 50_000}))
    errors: list[BaseException] = []
    bad_reads = 0
    stop = threading.Event()

    def writer(offset: int) -> None:
        try:
            for i in range(150):
                write_atomic(path, json.dumps({"n": offset + i, "pad": "x" * 50_000}))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    def reader() -> None:
        nonlocal bad_reads
        while not stop.is_set():
            try:
                json.loads(path.read_text())
            except json.JSONDecodeError:
                bad_reads += 1

    threads = [threading.Thread(target=writer, args=(o,)) for o in (0, 1000)]
    watcher = threading.Thread(target=reader)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    assert errors == [] and bad_reads == 0
    assert [p.name for p in tmp_path.iterdir() if p.name != ".state.json.lock"] == ["state.json"]  # no temporaries left


def test_two_sessions_saving_one_file_both_count(tmp_path):
    path = tmp_path / "m.stats.json"
    observed(100).save(path)
    first = open_recorder("m", L, N, K, path)
    second = open_recorder("m", L, N, K, path)  # started before the first saved
    observe_more(first, 10, seed=1)
    observe_more(second, 20, seed=2)
    first.save()
    second.save()
    assert RoutingStats.load(path).tokens == 130
    for counts in ("rank_hist", "predicted_rank_hist", "predicted_active_rank_hist"):  # every histogram adds up
        expected = sum(getattr(observed(n, seed).layers[0], counts) for n, seed in ((100, 0), (10, 1), (20, 2)))
        np.testing.assert_array_equal(getattr(RoutingStats.load(path).layers[0], counts), expected)
        np.testing.assert_array_equal(getattr(second.stats.layers[0], counts), expected)  # and the session has the sum
    # saving again adds only what is new since the last save
    observe_more(first, 5, seed=3)
    first.save()
    assert RoutingStats.load(path).tokens == 135 and first.stats.tokens == 135


def _session(path: str, saves: int) -> None:
    recorder = open_recorder("m", L, N, K, path)
    for i in range(saves):
        observe_more(recorder, 1, seed=i)
        recorder.save()


def test_concurrent_processes_add_up(tmp_path):
    path = tmp_path / "m.stats.json"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_session, args=(str(path), 40)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert RoutingStats.load(path).tokens == 120


# --- damaged files ---------------------------------------------------------------


@pytest.mark.parametrize("content, fragment", [
    ("{not json", "not valid JSON"),
    ("tokens", "tokens"),  # a count of -100 tokens
    ("predicted", "predicted"),  # more predicted tokens than tokens
    ("hist", "malformed"),  # a histogram of the wrong size
    ("joint", "does not add up"),  # predicted experts activated while cached, more than were activated
])
def test_damaged_statistics_are_set_aside_with_one_line(tmp_path, capsys, content, fragment):
    path = tmp_path / "m.stats.json"
    good = observed(5).to_dict()
    if content == "tokens":
        good["layers"][0]["tokens"] = -100
        text = json.dumps(good)
    elif content == "predicted":
        good["layers"][1]["predicted_tokens"] = 999
        text = json.dumps(good)
    elif content == "hist":
        good["layers"][0]["rank_hist"] = observed(1).to_dict()["layers"][0]["predicted_rank_hist"]
        text = json.dumps(good)
    elif content == "joint":
        good["layers"][0]["predicted_active_rank_hist"] = good["layers"][0]["predicted_rank_hist"]
        text = json.dumps(good)
    else:
        text = content
    path.write_text(text)
    stats = load_or_empty("m", L, N, K, path)
    assert stats.tokens == 0
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("warning:") and fragment in err, err
    aside = list(tmp_path.glob("m.stats.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text() == text  # kept for the user, byte for byte
    assert not path.exists()


def test_statistics_of_the_old_schema_are_set_aside_not_misread(tmp_path, capsys):
    """A version-1 file (before the joint count PAH_i: the same layout less `predicted_active_rank_hist`) is set aside
    as `.v1-<time>` with one warning that says why, and the session starts empty: its prefetch credit would be
    misread. A save over it does the same and writes version 2."""
    old = observed(5).to_dict()
    old["schema_version"] = 1
    for layer in old["layers"]:
        del layer["predicted_active_rank_hist"]
    text = json.dumps(old)
    path = tmp_path / "m.stats.json"
    path.write_text(text)
    stats = load_or_empty("m", L, N, K, path)
    assert stats.tokens == 0
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "older fmoe (schema version 1" in err and "moved it to" in err, err
    aside = list(tmp_path.glob("m.stats.json.v1-*"))
    assert len(aside) == 1 and aside[0].read_text() == text and not path.exists()
    recorder = open_recorder("m", L, N, K, path)  # nothing there now
    path.write_text(text)  # an old fmoe saved meanwhile
    observe_more(recorder, 3, seed=0)
    assert recorder.save() == path
    assert "older fmoe" in capsys.readouterr().err
    assert json.loads(path.read_text())["schema_version"] == 2 and RoutingStats.load(path).tokens == 3
    assert len(list(tmp_path.glob("m.stats.json.v1-*"))) == 2


def test_a_directory_in_place_of_the_statistics_file(tmp_path, capsys):
    path = tmp_path / "m.stats.json"
    path.mkdir()
    recorder = open_recorder("m", L, N, K, path)
    err = capsys.readouterr().err
    assert "is a directory" in err and len(err.strip().splitlines()) == 1, err
    observe_more(recorder, 3, seed=0)
    assert recorder.save() is None and path.is_dir()
    assert capsys.readouterr().err == ""  # said once


def test_corrupt_statistics_do_not_block_a_bench(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    model = str(checkpoints["mixtral"])
    path = default_stats_path(model)
    path.parent.mkdir(parents=True)
    path.write_text("{garbage")
    result = CliRunner().invoke(app, ["bench", model, "--policy", "lru", "--tokens", "2", "--warmup", "0",
                                      "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "lru" in result.stdout and "TPOT" in result.stdout
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "moved it to" in warnings[0], result.stderr
    assert RoutingStats.load(path).tokens > 0  # this session's statistics, saved afresh
    assert len(list(path.parent.glob(path.name + ".corrupt-*"))) == 1


# --- read-only directories ------------------------------------------------------------


def test_bench_with_a_read_only_config_directory_prints_its_results(checkpoints, read_only_dir, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(read_only_dir))
    result = CliRunner().invoke(app, ["bench", str(checkpoints["mixtral"]), "--policy", "moepic", "--policy", "lru",
                                      "--tokens", "2", "--warmup", "0", "--device", "cpu", "--emulate-link", "20"])
    assert result.exit_code == 0, result.output
    assert "moepic" in result.stdout and "lru" in result.stdout and "TPOT" in result.stdout
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "not kept" in warnings[0], result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize("with_model", [False, True], ids=["device", "model"])
def test_profile_with_a_read_only_config_directory(checkpoints, read_only_dir, monkeypatch, with_model):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(read_only_dir))
    args = ["profile", "--quick", "--device", "cpu", "--emulate-link", "16"]
    if with_model:
        args += ["--model", str(checkpoints["mixtral"]), "--prefill-len", "4"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "link (emulated)" in result.stdout
    assert "saved the profile" not in result.stdout
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    # One line per file that could not be kept (the device profile, and this machine's host profile beside it)
    assert sorted(w.split(" to ")[0] for w in warnings) == ["warning: cannot save the host profile",
                                                          "warning: cannot save the profile"], result.stderr
    assert "Traceback" not in result.output


def test_an_atomic_write_never_replaces_what_is_not_a_regular_file(tmp_path):
    """The rename would put the file where a device or a pipe was (root's /dev/null): refused, the path untouched."""
    from fmoe_cli.files import write_atomic

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        write_atomic(fifo, "{}")
    assert fifo.is_fifo() and [p.name for p in tmp_path.iterdir()] == ["pipe"]
    assert write_atomic(tmp_path / "p.json", "{}").read_text() == "{}"


def test_profile_out_in_a_read_only_directory_is_refused_before_measuring(read_only_dir):
    result = CliRunner().invoke(app, ["profile", "--quick", "--out", str(read_only_dir / "p.json")])
    assert result.exit_code == 2 and result.output.startswith("error: --out"), result.output


def test_chat_with_read_only_config_directory(checkpoints, read_only_dir, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(read_only_dir))
    result = CliRunner().invoke(app, ["chat", str(checkpoints["mixtral"]), "--temperature", "0", "--max-new-tokens",
                                      "3", "--device", "cpu", "--emulate-link", "20"], input="hi\nagain\n/exit\n")
    assert result.exit_code == 0, result.output
    assert result.stdout.count("tokens · TTFT") == 2
    assert "re-planning failed" not in result.output and "Traceback" not in result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "not kept" in warnings[0], result.stderr


def test_chat_with_read_only_history(read_only_dir, capsys):
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from fmoe_cli.chat.repl import prompt_reader

    with create_pipe_input() as pipe:
        read = prompt_reader(read_only_dir / "chat_history", pt_input=pipe, pt_output=DummyOutput())
        for text in ("first", "second"):
            pipe.send_text(text + "\r")
            assert read("") == text
    captured = capsys.readouterr()
    assert "Unhandled exception" not in captured.out + captured.err
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "history" in warnings[0], captured.err


def test_a_link_measurement_that_cannot_be_saved_is_made_and_said_once(read_only_dir, monkeypatch, capsys):
    """A read-only config directory: the process measures the link once and warns once, however many times a run
    asks for it (chat asked twice: two measurements, two warnings)."""
    import torch

    from fmoe_cli.profiling import device as device_module

    monkeypatch.setattr(device_module, "_UNSAVED_LINKS", {})
    measured = []
    real = device_module.measure_link
    monkeypatch.setattr(device_module, "measure_link", lambda *a, **k: measured.append(1) or real(*a, **k))
    first = device_module.device_link(torch.device("cpu"), config_dir=read_only_dir)
    assert device_module.device_link(torch.device("cpu"), config_dir=read_only_dir) is first
    assert len(measured) == 1
    assert capsys.readouterr().err.count("cannot save the link's measurement") == 1
