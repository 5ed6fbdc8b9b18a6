"""The host profile (issue 21 §2): the CPU's expert throughput per format, on a scripted clock; its file,
`fmoe profile`, and where `fmoe plan` and `fmoe bench` show it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fmoe_cli.cli import app
from fmoe_cli.profiling.device import device_identity
from fmoe_cli.profiling.files import DeviceProfile, LinkFit, Profile
from fmoe_cli.profiling.host import (
    host_format,
    host_line,
    host_profile_path,
    measure_format,
    measure_host,
    saved_host_profile,
)
from fmoe_cli.types import ExpertShape

REPO = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((REPO / "profiles" / "schema.json").read_text())
runner = CliRunner()
LATENCY, BANDWIDTH = 30e-6, 20e9


class ScriptedClock:
    """Time moves only when a forward runs: latency + weight bytes / bandwidth, × tokens^0 (decode) or per token."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def forward(self, store, x, rows):
        segment = rows if not isinstance(rows, tuple) else rows[0]
        nbytes = segment.shape[0] * store.shape.neuron_bytes
        self.now += (LATENCY + nbytes / BANDWIDTH) * x.shape[0]
        return x


@pytest.mark.parametrize("fmt", ["f32", "int4"])
def test_the_fit_recovers_latency_and_bandwidth_on_a_scripted_clock(fmt):
    clock = ScriptedClock()
    fit = measure_format(fmt, hidden=256, intermediate=256, top_k=4, prefill_tokens=8, repeats=3, warmup=1,
                         pool_bytes=1 << 20, timer=clock, forward=clock.forward)
    assert fit.format == fmt
    assert fit.latency == pytest.approx(LATENCY, rel=1e-6)
    assert fit.bandwidth == pytest.approx(BANDWIDTH, rel=1e-6)
    one = LATENCY + fit.expert_bytes / BANDWIDTH
    assert fit.t_expert == pytest.approx(one)
    assert fit.t_layer == pytest.approx(4 * one)  # the top-K, one after another
    assert fit.t_prefill == pytest.approx(8 * one)
    assert fit.segment_time(fit.expert_bytes) == pytest.approx(one)
    assert len(fit.samples) == 3  # an eighth, half and all of I


def test_the_host_profile_round_trips_through_the_profile_file(tmp_path):
    clock = ScriptedClock()
    host = measure_host(("f32", "int8"), quick=True, prefill_tokens=4, timer=clock, forward=clock.forward,
                        hidden=128, intermediate=128, top_k=2)
    assert [f.format for f in host.formats] == ["f32", "int8"] and host.kind == "measured"
    profile = Profile(DeviceProfile(device_identity(), LinkFit("measured", 1e9, 0.0), host=host), created="x")
    loaded = Profile.load(profile.save(tmp_path / "p.json"))
    assert loaded == profile
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(profile.to_dict(), SCHEMA)
    damaged = profile.to_dict()
    damaged["device"]["host"]["formats"][0]["bandwidth"] = 0
    with pytest.raises(Exception, match="bandwidth"):
        Profile.from_dict(damaged)


def test_host_format_names_the_rows_the_host_reads():
    shape = ExpertShape(2, 8, 2, 64, 128, 4)
    assert host_format(shape) == "f32"
    assert host_format(ExpertShape(2, 8, 2, 64, 128, 2)) == "bf16"
    assert host_format(ExpertShape(2, 8, 2, 64, 128, 2, "int4")) == "int4"
    assert "not profiled" in host_line(None)


def test_fmoe_profile_measures_the_host_and_plan_shows_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # this machine's host profile: this test's only
    out = tmp_path / "device.json"
    result = runner.invoke(app, ["profile", "--quick", "--prefill-len", "4", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "host expert compute" in result.output
    host = Profile.load(out).device.host
    assert host is not None and host.fit("f32").bandwidth > 0 and host.fit("f32").t_layer > 0
    assert saved_host_profile() == host and host_profile_path().exists()  # kept per machine
    planned = runner.invoke(app, ["plan", "demo", "--vram", "1GiB", "--json"])
    assert planned.exit_code == 0, planned.output
    report = json.loads(planned.stdout)
    assert report["host_compute"]["source"].startswith("measured on this machine")
    assert "host expert compute" in report["host_compute"]["line"]
    # the per-layer plan is hybrid's, each layer's misses and bottoms on the link or the host, TPOT predicted for
    # hybrid and llama.cpp's pattern (every routed expert on the host) beside the policies
    assert report["configured_policy"] == "hybrid"
    assert {layer["misses_and_bottoms"] for layer in report["layers"]} <= {"host", "link"}
    assert {"hybrid", "llama.cpp pattern", "moepic", "lru"} <= set(report["tpot"]["policies"])
    shown = runner.invoke(app, ["plan", "demo", "--vram", "1GiB"])
    assert shown.exit_code == 0 and "per-layer plan of hybrid" in shown.output and "llama.cpp" in shown.output
    # planned for the CPU the profile measured (it is the device there): no host lane, as the runs there have none
    on_cpu = json.loads(runner.invoke(app, ["plan", "demo", "--vram", "1GiB", "--profile", str(out), "--json"]).stdout)
    assert on_cpu["host_compute"]["source"].startswith("none: the profile's device is the CPU")
    assert on_cpu["configured_policy"] != "hybrid" and "hybrid" not in on_cpu["tpot"]["policies"]
    # … and --dense auto as a run there resolves it (int8 beside int8 experts; a GPU's plan keeps it bf16)
    for profile, dense in ((["--profile", str(out)], "int8"), ([], "bf16")):
        planned = runner.invoke(app, ["plan", "demo", "--vram", "1GiB", "--experts", "int8", *profile, "--json"])
        assert json.loads(planned.stdout)["dense"]["format"] == dense, planned.stdout[:300]


def test_a_quick_profile_measures_bf16_too():
    """Issue 37 §5: `fmoe profile --quick` measures the host lane in bf16 beside f32 (a GPU's default dtype: without
    it `hybrid` could not plan a bf16 model there), and in the model's own format."""
    from fmoe_cli.bench.profile import quick_host_formats
    from fmoe_cli.types import ExpertShape

    assert quick_host_formats(None) == ("f32", "bf16")
    shape = ExpertShape(num_layers=2, num_experts=8, top_k=2, hidden=64, intermediate=64, dtype_bytes=2, experts="int4")
    assert quick_host_formats(shape) == ("f32", "bf16", "int4")
