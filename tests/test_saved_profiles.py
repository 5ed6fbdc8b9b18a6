"""Saved profiles (issue 14, item 10): a damaged one is re-measured with a message; a profile of an
emulated link is kept apart from the real one and never stands in for the real link."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fmoe_cli.cli import app
from fmoe_cli.models.load import load_model
from fmoe_cli.offload.engine import open_engine
from fmoe_cli.run import find_timings
from fmoe_cli.models.identity import model_key
from fmoe_cli.profiling.files import Profile, default_profile_path


@pytest.fixture(scope="module")
def loaded(checkpoints):
    lm = load_model(str(checkpoints["mixtral"]), device="cpu", dtype="float32")
    engine = open_engine(lm)  # the real (CPU) link, no emulation
    yield lm, engine
    engine.close()


def test_a_damaged_saved_profile_is_remeasured_and_says_so(loaded, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    lm, engine = loaded
    path = default_profile_path(lm.timings_key)
    path.parent.mkdir(parents=True)
    path.write_text('{"kind": "fmoe-profile", "schema_version": 1, "device": {')
    timings = find_timings(lm, engine.link, engine=engine)
    assert timings.t_moe > 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("warning: not using the saved profile") and "not valid JSON" in err
    # set aside (kept for the user), so the next run neither reads it nor says it again
    aside = [p for p in path.parent.iterdir() if p.name.startswith(path.name + ".corrupt-")]
    assert len(aside) == 1 and not path.exists() and f"moved to {aside[0].name}" in " ".join(err.split())
    find_timings(lm, engine.link, engine=engine)
    assert "not valid JSON" not in capsys.readouterr().err


def test_a_named_profile_that_does_not_read_is_left_where_it_is(loaded, tmp_path, monkeypatch, capsys):
    """--profile FILE is the user's: not used, said so, never moved."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    lm, engine = loaded
    named = tmp_path / "mine.json"
    named.write_text("{not json")
    find_timings(lm, engine.link, profile_path=named, engine=engine)
    assert named.read_text() == "{not json" and "not valid JSON" in capsys.readouterr().err


def test_a_damaged_host_profile_is_set_aside_once(tmp_path, capsys):
    from fmoe_cli.profiling.host import host_profile_path, saved_host_profile

    path = host_profile_path(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"kind":')
    assert saved_host_profile(tmp_path) is None
    assert "not valid JSON" in capsys.readouterr().err and not path.exists()
    assert saved_host_profile(tmp_path) is None and capsys.readouterr().err == ""


def test_an_emulated_profile_is_kept_apart(loaded, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    lm, engine = loaded
    result = CliRunner().invoke(app, ["profile", "--model", lm.model_id, "--emulate-link", "8", "--quick",
                                      "--prefill-len", "4", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    real = default_profile_path(lm.timings_key)
    emulated = default_profile_path(lm.timings_key, emulated=8.0)  # one per link
    assert emulated.exists() and not real.exists()
    assert Profile.load(emulated).device.link.kind == "emulated"
    # even when named explicitly, an emulated profile's link is not taken for the real one
    timings = find_timings(lm, engine.link, profile_path=emulated, engine=engine)
    assert timings.t_load != pytest.approx(lm.shape.expert_bytes / 8e9)
    assert capsys.readouterr().err.strip() == ""  # its layer timings are used: nothing to warn about


def test_a_quick_estimate_says_so_and_a_profile_makes_it_firm(checkpoints, tmp_path, monkeypatch):
    """Without a saved profile the configured plan rests on a quick measurement: the run says so, once, under
    its table (--json: in the report, not on stderr), and how to make it firm; after `fmoe profile --model` it says
    nothing and the report names the profile."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    model = str(checkpoints["mixtral"])
    bench = ["bench", model, "--policy", "moepic", "--tokens", "2", "--warmup", "0", "--device", "cpu"]
    first = CliRunner().invoke(app, [*bench, "--json"])
    assert first.exit_code == 0, first.output
    report = json.loads(first.stdout)
    assert report["timings"] == "quick estimate"
    assert f"`fmoe profile --model {model}` measures this model once" in report["timing_note"]
    assert "quick timing estimate" not in first.stderr
    shown = CliRunner().invoke(app, bench)  # the estimate the first run kept: still the plan's, still said
    assert shown.exit_code == 0, shown.output
    assert shown.stdout.count("quick timing estimate") == 1 and "quick timing estimate" not in shown.stderr
    assert shown.stdout.index("ms: TTFT") < shown.stdout.index("quick timing estimate")  # under the table's legend
    profiled = CliRunner().invoke(app, ["profile", "--model", model, "--quick", "--prefill-len", "4", "--device", "cpu"])
    assert profiled.exit_code == 0, profiled.output
    second = CliRunner().invoke(app, [*bench, "--json"])
    assert second.exit_code == 0, second.output
    report = json.loads(second.stdout)
    assert report["timings"] == "profile" and report["timing_note"] is None
    assert "quick timing estimate" not in second.stderr


def test_no_quick_estimate_note_where_a_profile_could_not_change_the_plan(checkpoints, tmp_path, monkeypatch):
    """A budget that holds every expert: the configured plan caches them all whatever the timings, so a quick
    estimate is not worth a note (the report still says where its timings came from)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    model = str(checkpoints["mixtral"])
    done = CliRunner().invoke(app, ["bench", model, "--policy", "moepic", "--tokens", "2", "--warmup", "0",
                                    "--device", "cpu", "--vram-budget", "100%", "--json"])
    assert done.exit_code == 0, done.output
    report = json.loads(done.stdout)
    assert report["timings"] == "quick estimate" and report["timing_note"] is None
    assert "quick timing estimate" not in done.stderr


def test_a_first_start_shows_each_step_and_keeps_the_quick_estimate(checkpoints, tmp_path, monkeypatch):
    """Issue 22 §4: a first chat was silent for ~40 s. On a terminal each step of the set-up is shown with its
    time (load, the configurator's timing, the plan); the quick estimate is kept, so the next start reads it
    instead of timing the model again (`fmoe profile --model` still makes it firm)."""
    import io
    import re

    from rich.console import Console

    import fmoe_cli.run as run_module
    from fmoe_cli.options import RunOptions
    from fmoe_cli.run import open_run

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    opts = RunOptions(model=str(checkpoints["mixtral"]), device="cpu", policies=("moepic",), emulate_link=20.0)

    def start() -> tuple[str, str | None]:
        out = io.StringIO()
        with open_run(opts, Console(file=out, force_terminal=True, width=300)) as run:
            source = run.timing_source
        return re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue()), source

    first, source = start()
    assert source == "quick estimate"
    for step in ("loaded the model: ", "timed the model for the configurator (a quick estimate, kept for the next "
                 "run): ", "planned moepic: "):
        assert re.search(re.escape(step) + r"\d+\.\d s", first), first
    lm_key = next((tmp_path / "fmoe" / "profiles").glob("*.quick.json"))
    assert Profile.load(lm_key).model is not None

    def no_measuring(*args, **kwargs):
        raise AssertionError("the kept quick estimate should be read, not measured again")

    monkeypatch.setattr(run_module, "measure_timings", no_measuring)
    second, source = start()
    assert source == "quick estimate" and "read the quick estimate an earlier run kept: " in second, second


def test_a_profile_of_another_link_is_said_and_the_runs_link_planned_for(loaded, tmp_path, monkeypatch):
    """Issue 22 §5: a profile per link (device and bandwidth). An emulated run reads its own link's profile; a
    profile whose link is more than 20 % away is said so, and T_load is the run's link."""
    from fmoe_cli.offload.link import EmulatedLink

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    lm, engine = loaded
    key = lm.timings_key
    for gbps in ("8", "2"):
        result = CliRunner().invoke(app, ["profile", "--model", lm.model_id, "--emulate-link", gbps, "--quick",
                                          "--prefill-len", "4", "--device", "cpu"])
        assert result.exit_code == 0, result.output
        assert default_profile_path(key, emulated=float(gbps)).exists()  # one file per link
    notes = []
    near = EmulatedLink(8.5)  # within 20 % of the 8 GB/s profile: its own, nothing said
    timings = find_timings(lm, near, note=notes.append)
    assert notes == [] and timings.t_load == pytest.approx(lm.shape.expert_bytes / 8.5e9 + near.latency_s)
    far = EmulatedLink(16.0)  # no profile of this link: another link's, 100 % away, said so
    timings = find_timings(lm, far, profile_path=default_profile_path(key, emulated=2.0), note=notes.append)
    assert len(notes) == 1 and "2 GB/s, this run's is 16 GB/s (more than 20% apart)" in notes[0], notes
    assert "--emulate-link 16" in notes[0]
    assert timings.t_load == pytest.approx(lm.shape.expert_bytes / 16e9 + far.latency_s)


def test_the_engines_link_at_the_models_copies_prices_its_loads(loaded, tmp_path, monkeypatch):
    """Issue 37 §5: where a profile's model timings carry the engine's link timed at this model's copy sizes
    (`ModelTimings.link`, measured on a GPU), T_load is priced with it, not with the device's fit of plain copies; it
    survives a save and a load; the CPU's link (which moves nothing) is not timed; an emulated run keeps its own."""
    from dataclasses import replace

    from fmoe_cli.offload.link import EmulatedLink
    from fmoe_cli.profiling.files import LinkFit

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    lm, engine = loaded
    result = CliRunner().invoke(app, ["profile", "--model", lm.model_id, "--quick", "--prefill-len", "4",
                                      "--device", "cpu"])
    assert result.exit_code == 0, result.output
    path = default_profile_path(lm.timings_key)
    profile = Profile.load(path)
    assert profile.model.link is None  # on the CPU: not timed
    device_link = profile.device.link
    at_copies = LinkFit("measured", device_link.bandwidth / 3, 2e-4, ((4096, 3e-4), (2048, 2.5e-4)), "the engine's link")
    Profile(profile.device, replace(profile.model, link=at_copies), created=profile.created).save(path)
    assert Profile.load(path).model.link == at_copies
    timings = find_timings(lm, engine.link, engine=engine)
    assert timings.t_load == pytest.approx(at_copies.transfer_time(lm.shape.expert_bytes))
    assert timings.t_load != pytest.approx(device_link.transfer_time(lm.shape.expert_bytes))
    emulated = EmulatedLink(8.0)
    timings = find_timings(lm, emulated, profile_path=path)
    assert timings.t_load == pytest.approx(lm.shape.expert_bytes / 8e9 + emulated.latency_s)


def test_a_profile_is_kept_per_format_and_the_note_names_it(loaded, checkpoints, tmp_path, monkeypatch):
    """A model's timings are kept per format (`LoadedModel.timings_key`: experts, dense, dtype, activations): a
    profile measured with bf16 experts does not plan an int8 run (their T_exp differ), which measures its own; the
    quick estimate's note names the profile command with the run's formats."""
    from types import SimpleNamespace

    from fmoe_cli.run import quick_estimate_note

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    lm, engine = loaded
    result = CliRunner().invoke(app, ["profile", "--model", lm.model_id, "--quick", "--prefill-len", "4",
                                      "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert default_profile_path(lm.timings_key).exists()
    int8 = load_model(str(checkpoints["mixtral"]), device="cpu", dtype="float32", experts="int8")
    assert int8.timings_key != lm.timings_key and int8.timings_key.startswith(model_key(lm.model_id, lm.path))
    how = []
    find_timings(int8, engine.link, on_quick=how.append)
    assert how == ["measured"] and default_profile_path(int8.timings_key, quick=True).exists()
    find_timings(lm, engine.link, on_quick=how.append)
    assert how == ["measured"]  # the bf16 run: its profile, no quick estimate
    opts = SimpleNamespace(model="m", dtype=None, experts="int8", dense="auto", activations="auto")
    note = quick_estimate_note(opts, lm.shape, 0)
    assert "`fmoe profile --model m --experts int8` measures" in note
    plain = SimpleNamespace(**{**vars(opts), "experts": "bf16"})
    assert "`fmoe profile --model m` measures" in quick_estimate_note(plain, lm.shape, 0)


def test_a_profile_given_for_other_formats_is_not_used(loaded, checkpoints, tmp_path, monkeypatch, capsys):
    """--profile FILE of the bf16 model given to an int8 run (a file's name no longer tells): the profile records the
    formats it timed, and the run does not plan with them (it measures, saying why); `fmoe plan` refuses them for
    another --experts."""
    from fmoe_cli.planning.report import run_plan
    from fmoe_cli.errors import FmoeError
    from rich.console import Console
    import io

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    lm, engine = loaded
    out = tmp_path / "mine.json"
    result = CliRunner().invoke(app, ["profile", "--model", lm.model_id, "--quick", "--prefill-len", "4",
                                      "--device", "cpu", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert Profile.load(out).model.formats == lm.formats
    int8 = load_model(str(checkpoints["mixtral"]), device="cpu", dtype="float32", experts="int8")
    how = []
    find_timings(int8, engine.link, profile_path=out, on_quick=how.append)
    assert how == ["measured"] and f"as {lm.formats}" in capsys.readouterr().err
    find_timings(lm, engine.link, profile_path=out, on_quick=how.append)
    assert how == ["measured"]  # its own formats: the profile's timings
    with pytest.raises(FmoeError, match="the profile times .* experts as bf16, the plan is for --experts int8"):
        run_plan(lm.model_id, vram="64MiB", profile_path=str(out), context=None, dtype=None, as_json=True,
                 console=Console(file=io.StringIO()), workspace="8MiB", experts="int8")


def test_bench_plans_with_the_profile_it_is_given(checkpoints, tmp_path, monkeypatch):
    """`fmoe bench --profile FILE`, as chat and serve take it (bench had no such option), and its header names where
    the configurator's timings came from."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    model = str(checkpoints["mixtral"])
    out = tmp_path / "mine.json"
    result = CliRunner().invoke(app, ["profile", "--model", model, "--quick", "--prefill-len", "4", "--device", "cpu",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    bench = ["bench", model, "--policy", "moepic", "--tokens", "2", "--warmup", "0", "--device", "cpu"]
    given = CliRunner().invoke(app, [*bench, "--profile", str(out), "--json"])
    assert given.exit_code == 0, given.output
    assert json.loads(given.stdout)["timings"] == "profile"
    shown = CliRunner().invoke(app, bench)  # nothing saved where bench looks (--out put it elsewhere)
    assert "timings: quick estimate" in " ".join(shown.stdout.split())


def test_a_newer_fmoe_s_profile_is_left_where_it_is_and_an_older_one_named_by_its_version(tmp_path):
    """Two fmoe versions may share a config directory: a newer schema is the newer fmoe's (left, said so); an older
    one is set aside as `<name>.v<N>-<time>`; a file replaced since it was read is not moved."""
    import os

    import fmoe_cli.profiling.files as files
    from fmoe_cli.errors import FmoeError

    path = tmp_path / "p.json"
    for version, left in ((files.PROFILE_SCHEMA_VERSION + 1, True), (0, False)):
        path.write_text(json.dumps({"kind": "fmoe-profile", "schema_version": version, "device": {}}))
        with pytest.raises(FmoeError, match="a newer fmoe's" if left else r"moved to p\.json\.v0-"):
            files.load_or_set_aside(path)
        assert path.exists() == left
    path.write_text("{not json")
    real_read = files.read_json

    def saved_meanwhile(p, *args, **kwargs):  # another process saves a valid profile right after this one read
        try:
            return real_read(p, *args, **kwargs)
        finally:
            os.replace(tmp_path / "new.json", p)

    (tmp_path / "new.json").write_text('{"kind": "fmoe-profile", "new": true}' + " " * 50)
    files.read_json = saved_meanwhile
    try:
        with pytest.raises(FmoeError, match="not valid JSON"):
            files.load_or_set_aside(path)
    finally:
        files.read_json = real_read
    assert '"new": true' in path.read_text() and not list(tmp_path.glob("p.json.corrupt-*"))
