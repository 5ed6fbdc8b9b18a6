"""Profiles (docs/architecture.md § Profiles and timings): files round-trip, refuse another device / model / malformed JSON;
the link fit; `fmoe profile` end to end on a tiny checkpoint (quick mode)."""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fmoe_cli.cli import app
from fmoe_cli.errors import FmoeError
from fmoe_cli.profiling.device import device_identity, fit_link
from fmoe_cli.profiling.files import (
    DeviceIdentity,
    DeviceProfile,
    LayerTiming,
    LinkFit,
    ModelTimings,
    PhaseTimings,
    Profile,
    model_identity,
)

REPO = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((REPO / "profiles" / "schema.json").read_text())
runner = CliRunner()


def make_profile(identity: DeviceIdentity, config: Path) -> Profile:
    link = LinkFit("measured", 12.5e9, 8e-6, ((1 << 20, 9.2e-5), (1 << 21, 1.8e-4)), "pinned host → cuda:0")
    layers = (LayerTiming(0, False, 1e-4, 2e-4), LayerTiming(1, True, 1.5e-4, 6e-4))
    decode = PhaseTimings(1, layers, 3e-4)
    prefill = PhaseTimings(16, layers, 4e-4)
    timings = ModelTimings(model_identity("org/model", config), 2, decode, prefill, t_host_load=2.5e-5,
                           t_host_prefetch=4e-5, t_admit=6e-5, t_segment=7e-6)
    device = DeviceProfile(identity, link, 10 << 30, 9e11, "2.13.0", "12.8")
    return Profile(device, timings, created="2026-11-23T11:00:00+00:00")


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 8, "hidden_size": 64}))
    return path


def validate(data: dict) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(data, SCHEMA)


def test_round_trip_and_schema(tmp_path, config):
    gpu = DeviceIdentity("cuda", "NVIDIA GeForce RTX 4090", 24 << 30)
    profile = make_profile(gpu, config)
    path = profile.save(tmp_path / "p.json")
    loaded = Profile.load(path)
    assert loaded == profile
    validate(json.loads(path.read_text()))
    # T_exp is written for the reader: T_moe / K on MoE layers only
    layers = json.loads(path.read_text())["model"]["decode"]["layers"]
    assert layers[0]["t_exp"] is None and layers[1]["t_exp"] == pytest.approx(6e-4 / 2)
    loaded.check_device(gpu)
    loaded.check_model(model_identity("org/model", config))
    # the configurator's Timings: means over MoE layers, dense layers count with T_head,
    # T_load = latency + S_e / bandwidth
    t = loaded.model.timings(loaded.device.link, expert_bytes=int(12.5e6))
    assert (t.t_att, t.t_moe, t.top_k) == (1.5e-4, 6e-4, 2)
    assert t.t_head == pytest.approx(3e-4 + 1e-4 + 2e-4)
    assert t.t_load == pytest.approx(8e-6 + 1e-3)
    assert (t.t_host_load, t.t_host_prefetch, t.t_admit, t.t_segment) == (2.5e-5, 4e-5, 6e-5, 7e-6)  # h_load, h_pf, a_e, c
    older = json.loads(path.read_text())
    for key in ("t_host_load", "t_host_prefetch", "t_admit", "t_segment"):  # a profile saved before they were measured
        del older["model"][key]
    validate(older)
    t = Profile.from_dict(older).model.timings(loaded.device.link, expert_bytes=1)
    assert (t.t_host_load, t.t_host_prefetch, t.t_admit, t.t_segment) == (0.0, 0.0, 0.0, 0.0)
    # the engine's link at the model's copies (issue 37 §5), kept with the model's timings
    at_copies = LinkFit("measured", 5e10, 1e-5, ((9 << 20, 2e-4), (4 << 20, 1e-4)), "the engine's link")
    with_link = Profile(profile.device, replace(profile.model, link=at_copies))
    path = with_link.save(tmp_path / "q.json")
    validate(json.loads(path.read_text()))
    assert Profile.load(path) == with_link and Profile.load(path).model.load_link(profile.device.link) == at_copies
    assert loaded.model.load_link(loaded.device.link) == loaded.device.link  # none measured: the device's


def test_wrong_device_is_refused(config):
    profile = make_profile(DeviceIdentity("cuda", "NVIDIA GeForce RTX 4090", 24 << 30), config)
    for other in (DeviceIdentity("cuda", "NVIDIA GeForce RTX 3060", 12 << 30),
                  DeviceIdentity("cpu", "NVIDIA GeForce RTX 4090", 24 << 30),
                  DeviceIdentity("cuda", "NVIDIA GeForce RTX 4090", 48 << 30)):
        with pytest.raises(FmoeError, match="is for cuda 'NVIDIA GeForce RTX 4090'") as info:
            profile.check_device(other)
        assert "\n" not in str(info.value)


def test_wrong_model_is_refused(tmp_path, config):
    profile = make_profile(device_identity(), config)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 16, "hidden_size": 64}))
    with pytest.raises(FmoeError, match="times org/model"):
        profile.check_model(model_identity("org/model", other))
    # the same config with other key order and spacing is the same model
    same = tmp_path / "same.json"
    same.write_text(json.dumps({"hidden_size": 64, "num_local_experts": 8, "model_type": "mixtral"}, indent=4))
    profile.check_model(model_identity("whatever/name", same))
    device_only = Profile(profile.device, None)
    with pytest.raises(FmoeError, match="has no model timings"):
        device_only.check_model(model_identity("org/model", config))


@pytest.mark.parametrize("mutate, message", [
    (lambda d: "{not json", "not valid JSON"),
    (lambda d: [], "not an fmoe profile"),
    (lambda d: {**d, "kind": "something"}, "not an fmoe profile"),
    (lambda d: {**d, "schema_version": 99}, "schema version 99"),
    (lambda d: {**d, "device": {**d["device"], "link": {**d["device"]["link"], "bandwidth": "fast"}}}, "'bandwidth' should be float"),
    (lambda d: {**d, "device": {**d["device"], "link": {**d["device"]["link"], "bandwidth": 0}}}, "'bandwidth' must be > 0"),
    (lambda d: {**d, "device": {k: v for k, v in d["device"].items() if k != "device"}}, "'device' is missing"),
    (lambda d: {**d, "device": {**d["device"], "link": {**d["device"]["link"], "samples": [[1, 2, 3]]}}}, "'samples'"),
    (lambda d: {**d, "model": {**d["model"], "decode": {**d["model"]["decode"], "t_head": -1.0}}}, "'t_head' is negative"),
    (lambda d: {**d, "model": {**d["model"], "top_k": True}}, "'top_k' should be int"),
])
def test_malformed_profile_is_refused_in_one_line(tmp_path, config, mutate, message):
    good = make_profile(device_identity(), config).to_dict()
    bad = mutate(json.loads(json.dumps(good)))
    path = tmp_path / "bad.json"
    path.write_text(bad if isinstance(bad, str) else json.dumps(bad))
    with pytest.raises(FmoeError, match=message) as info:
        Profile.load(path)
    assert "\n" not in str(info.value)


def test_reference_profiles_state_every_source_and_are_not_this_device():
    references = sorted((REPO / "profiles").glob("*.json"))
    references = [p for p in references if p.name != "schema.json"]
    assert len(references) >= 3
    for path in references:
        validate(json.loads(path.read_text()))
        profile = Profile.load(path)
        assert profile.device.device.kind == "reference" and profile.device.link.kind == "spec"
        assert {"device.total_memory", "link.bandwidth"} <= set(profile.device.sources)
        assert all(len(source) > 20 for source in profile.device.sources.values())
        with pytest.raises(FmoeError, match="reference profile"):
            profile.check_device(device_identity())


def test_link_fit_recovers_latency_and_bandwidth():
    latency, bandwidth = 12e-6, 24e9
    samples = [(s, latency + s / bandwidth) for s in (1 << 20, 1 << 22, 1 << 24, 1 << 26)]
    got_latency, got_bandwidth = fit_link(samples)
    assert got_latency == pytest.approx(latency, rel=1e-6)
    assert got_bandwidth == pytest.approx(bandwidth, rel=1e-6)
    with pytest.raises(FmoeError):
        fit_link(samples[:1])


def test_fmoe_profile_model_on_the_cpu(checkpoints, tmp_path):
    path = checkpoints["deepseek_v2"]  # a dense first layer and three MoE layers
    out = tmp_path / "prof.json"
    result = runner.invoke(app, ["profile", "--model", str(path), "--quick", "--prefill-len", "8",
                                 "--emulate-link", "4", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed["path"] == str(out)
    profile = Profile.load(out)
    validate(json.loads(out.read_text()))
    profile.check_device(device_identity())
    profile.check_model(model_identity(str(path), path / "config.json"))
    link = profile.device.link
    assert (link.kind, link.bandwidth, link.note) == ("emulated", 4e9, "link: emulated 4 GB/s")
    decode, prefill = profile.model.decode, profile.model.prefill
    assert (decode.tokens, prefill.tokens) == (1, 8)
    assert [layer.moe for layer in decode.layers] == [False, True, True, True]
    assert all(layer.t_moe > 0 and layer.t_att >= 0 for layer in decode.layers + prefill.layers)
    model = profile.model
    measured = (model.t_host_load, model.t_host_prefetch, model.t_admit, model.t_segment)
    # c (t_segment) is a difference of two timings, clamped at 0: on a busy machine it can be 0 (measured, not None).
    assert all(x is not None and x >= 0 for x in measured) and model.t_admit > 0


def test_fmoe_profile_device_says_it_profiled_the_cpu(tmp_path):
    out = tmp_path / "device.json"
    result = runner.invoke(app, ["profile", "--quick", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "no GPU: profiled the CPU" in result.output
    assert f"saved the profile to {out}" in result.output.replace("\n", "")
    assert Profile.load(out).device.link.kind == "measured"


@pytest.mark.parametrize("args, message", [
    (["--emulate-link", "0"], "bandwidth > 0"),
    (["--prefill-len", "0"], "--prefill-len"),
    (["--model", "/no/such/model"], "no such model directory"),
])
def test_fmoe_profile_bad_input_is_one_line_exit_2(tmp_path, args, message):
    result = runner.invoke(app, ["profile", "--quick", "--out", str(tmp_path / "p.json"), *args])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output
    assert result.output.strip().startswith("error:") and len(result.output.strip().splitlines()) == 1


def test_host_work_per_load_is_time_less_exposed_less_resident_over_loaded_segments():
    """h_load of one block, on a scripted clock: each run takes 10 s, loads 2 segments and waits
    3 s on the link; resident the block takes 1 s → (10 − 3 − 1) / 2 = 3 s per loaded segment."""
    from fmoe_cli.profiling import layers

    state = {"t": 0.0, "segments": 0, "exposed": 0.0}

    def block():
        state["t"] += 10.0
        state["segments"] += 2
        state["exposed"] += 3.0

    runs = layers._host_per_load(block, 1.0, lambda: (state["segments"], state["exposed"]), 3,
                                 lambda: None, now=lambda: state["t"])
    assert runs == [3.0, 3.0, 3.0]


def test_a_measured_whole_step_scales_attention_and_head(config):
    """Layer timings miss the work around the layers (embedding, hooks, sampling): a measured resident
    decode step t_token scales T_att and T_head so that L·(T_att + T_moe) + T_head = t_token.
    One MoE layer (T_att 0.15, T_moe 0.6 ms) and a dense one (0.1 + 0.2 ms) with T_head 0.3 ms:
    timed 0.15 + 0.6 = 0.75 ms beside the experts; t_token 2.85 ms → × 3."""
    from dataclasses import replace

    profile = make_profile(DeviceIdentity("cuda", "x", 1 << 30), config)
    plain = profile.model.timings(profile.device.link, expert_bytes=1)
    scaled = replace(profile.model, t_token=2.85e-3).timings(profile.device.link, expert_bytes=1)
    assert (plain.t_att, plain.t_head) == (pytest.approx(1.5e-4), pytest.approx(6e-4))
    assert (scaled.t_att, scaled.t_head, scaled.t_moe) == (pytest.approx(4.5e-4), pytest.approx(1.8e-3), 6e-4)
    assert replace(profile.model, t_token=2.85e-3).timings(profile.device.link, 1, phase="prefill").t_att == 1.5e-4


def test_a_measured_expert_forward_is_t_exp_and_the_rest_of_t_moe_counts_with_attention(config):
    """t_expert (one expert's forward alone) is T_exp; what else the MoE block does (router, routing
    copy, dispatch, combine) cannot overlap the layer's loads and counts with T_att. MoE layer:
    T_att 0.15, T_moe 0.6 ms, K = 2; t_expert 0.1 ms → T_moe 0.2, T_att 0.15 + 0.4 = 0.55 ms."""
    from dataclasses import replace

    profile = make_profile(DeviceIdentity("cuda", "x", 1 << 30), config)
    t = replace(profile.model, t_expert=1e-4).timings(profile.device.link, expert_bytes=1)
    assert (t.t_moe, t.t_att, t.t_exp) == (pytest.approx(2e-4), pytest.approx(5.5e-4), pytest.approx(1e-4))
    slower = replace(profile.model, t_expert=4e-4).timings(profile.device.link, expert_bytes=1)  # K·t_expert > T_moe
    assert (slower.t_moe, slower.t_att) == (6e-4, 1.5e-4)  # T_moe as measured


def test_host_work_follows_its_formulas_from_paired_forwards(monkeypatch):
    """h_load and c from scripted one-layer forwards (profiling/model.py: host_work_s), less what each waited on
    the link: resident 1 ms; whole tops cached, K whole hits on the general path, 0.5 ms more; on demand K = 4
    loads, 4 h_load more than whole hits; split tops, K top hits each loading its bottom, 4 c more than on demand. The resident step, h_route, h_sub and h_pf from scripted decode steps (resident 1 s;
    on demand 0.18 s of lead over 6 layers, 0.12 s submitting 24 loads; with prefetch 0.3 s in the prefetch path
    of 6 layers, the engine's counter)."""
    from types import SimpleNamespace

    from fmoe_cli.offload.engine import Counters
    from fmoe_cli.planning.presets import make_settings
    from fmoe_cli.profiling import model as profiling_model
    from fmoe_cli.types import ExpertShape

    shape = ExpertShape(num_layers=6, num_experts=16, top_k=4, hidden=8, intermediate=256, dtype_bytes=2)
    h_load, h_pf, c = 0.01, 0.05, 0.02

    def step(settings):
        if settings.plan.resident:
            return 1.0, Counters()
        if settings.prefetch:
            return 1.0 + 24 * h_load + 6 * h_pf, Counters(needed_loads=24, misses=24, predict_s=6 * h_pf, predicts=6)
        # a busy machine's 0.3 s on the on-demand steps: their difference would read h_load 0.0225, not 0.01
        return 1.0 + 0.5 + 24 * h_load + 0.3, Counters(needed_loads=24, misses=24, exposed_s=0.5, lead_s=0.18, leads=6,
                                                        submit_s=0.12, submitted=24)

    class FakeEngine:
        def __init__(self):
            self.settings = make_settings("ondemand", shape, 8 * shape.expert_bytes)
            self.configured = []

        def configure(self, settings):
            self.settings = settings
            self.configured.append(settings)
            self.exposed = 0.0

        def counters(self):
            return Counters(exposed_s=self.exposed)

    general = 5e-4  # the general path's own work beside resident's fast path: whole hits pay it too, loads too
    forwards = {"h_load": h_load}  # what the forwards show per load (below: noise that reads it negative)

    def fake_layer_forward(lm, engine, reps, layers=None, warmup=20, **_):  # 1 ms resident
        assert layers is None  # no WholeLayers: every layer forwarded
        assert not engine.settings.prefetch  # h_pf is the decode steps' counter: no forward prefetches
        plan = engine.settings.plan
        if plan.resident:
            return 1e-3
        if plan.layers[0].top_neurons == shape.intermediate:  # whole tops cached: every one of the K a whole hit
            return 1e-3 + general
        if plan.layers[0].cache_size:  # split tops: every one of the K experts a top hit
            return 1e-3 + general + 4 * forwards["h_load"] + 4 * c
        return 1e-3 + general + 4 * forwards["h_load"]

    engine = FakeEngine()
    original = engine.settings

    def fake_generate(model, ids, *, engine, max_new_tokens, stop_on_eos):
        t, counters = step(engine.settings)
        return [SimpleNamespace(latency_s=t, counters=counters) for _ in range(max_new_tokens)]

    monkeypatch.setattr(profiling_model, "stream_generate", fake_generate)
    monkeypatch.setattr(profiling_model, "layer_forward_s", fake_layer_forward)
    monkeypatch.setattr(profiling_model, "decode_inputs", lambda *a: contextlib.nullcontext())  # no model to hook
    lm = SimpleNamespace(shape=shape, device=torch.device("cpu"), model=None)
    got = profiling_model.host_work_s(lm, engine, None, block_h_load=9.0, t_segment=1e-3, rounds=3)
    assert got == pytest.approx((h_load, h_pf, c, 1.0, 0.03, 0.005))  # h_route: 0.18 s over 6 forwards; h_sub 0.12 / 24
    # c is at least one more segment forward (t_segment): a smaller difference is noise
    floored = profiling_model.host_work_s(lm, engine, None, block_h_load=9.0, t_segment=0.5, rounds=1)
    assert floored[2] == 0.5
    assert engine.settings is original  # put back as it was
    # on demand, split tops, whole tops (h_load against whole hits, not resident's fast path: 0.01, not 0.01 + general / 4)
    assert {s.plan.layers[0].top_neurons for s in engine.configured if not s.plan.resident} == {0, 128, 256}
    # forwards that read a load cheaper than its submission (h_sub 0.005, the engine's counter): h_load is h_sub
    forwards["h_load"] = -0.002
    assert profiling_model.host_work_s(lm, engine, None, block_h_load=9.0, t_segment=1e-3, rounds=1)[0] == \
        pytest.approx(0.005)
    # where every expert cannot be resident (a GPU), h_load is the block's and c one segment forward's
    monkeypatch.setattr(profiling_model, "_resident_fits", lambda lm: False)
    gpu = profiling_model.host_work_s(lm, engine, None, block_h_load=9.0, t_segment=1e-3, rounds=1)
    assert (gpu[0], gpu[2], gpu[3]) == (9.0, 1e-3, None)


def test_the_prefetch_paths_host_work_is_the_median_of_the_decode_steps_counter(monkeypatch):
    """h_pf (profiling/model.py: host_work_s) is the engine's own counter of the prefetch path (Counters.predict_s /
    predicts: the predictor's scores and ranking, the prefetcher's submits) per decode step with prefetch, the
    median over every step of every round: one step slowed by other work on the machine (here 10 ms late) does not
    carry it, and no forward runs with prefetch (its link bytes went to the decode steps). It was the difference of
    paired forwards with and without prefetch, which on the demo read 0.000 to 0.46 ms from one quick estimate to
    the next (4 GB/s; the path takes 0.10-0.15 ms a layer, the counter of a prefetch-only run), and decided whether
    `moepic` prefetched at 4 GB/s (docs/bench.md § `moepic` across links)."""
    from types import SimpleNamespace

    from fmoe_cli.offload.engine import Counters
    from fmoe_cli.planning.presets import make_settings
    from fmoe_cli.profiling import model as profiling_model
    from fmoe_cli.types import ExpertShape

    shape = ExpertShape(num_layers=6, num_experts=16, top_k=4, hidden=8, intermediate=256, dtype_bytes=2)
    h_pf = 0.05
    steps = []

    class FakeEngine:
        def __init__(self):
            self.settings = make_settings("ondemand", shape, 8 * shape.expert_bytes)

        def configure(self, settings):
            self.settings = settings

        def counters(self):
            return Counters()

    def fake_layer_forward(lm, engine, reps, layers=None, warmup=20, **_):
        assert not engine.settings.prefetch
        return 1e-3 + (0.0 if engine.settings.plan.resident else 0.2)  # differences of forwards: no h_pf in them

    def fake_generate(model, ids, *, engine, max_new_tokens, stop_on_eos):
        events = []
        for _ in range(max_new_tokens):
            counters = Counters(needed_loads=24, misses=24)
            if engine.settings.prefetch:
                late = 10e-3 if len(steps) == 1 else 0.0  # one decode step's: the machine's, not the engine's
                steps.append(late)
                counters = Counters(needed_loads=24, misses=24, predict_s=6 * h_pf + late, predicts=6)
            events.append(SimpleNamespace(latency_s=1.0, counters=counters))
        return events

    monkeypatch.setattr(profiling_model, "stream_generate", fake_generate)
    monkeypatch.setattr(profiling_model, "layer_forward_s", fake_layer_forward)
    monkeypatch.setattr(profiling_model, "decode_inputs", lambda *a: contextlib.nullcontext())  # no model to hook
    lm = SimpleNamespace(shape=shape, device=torch.device("cpu"), model=None)
    got = profiling_model.host_work_s(lm, FakeEngine(), None, block_h_load=0.0, t_segment=0.0, rounds=1, tokens=4,
                                      layer_reps=100)
    assert got[1] == pytest.approx(h_pf)
    assert len(steps) == 5  # the prefill's token and 4 decode steps


def test_the_prefetch_path_is_read_in_decode_steps_of_the_layer_that_predicts_for_the_link_layer(checkpoints):
    """h_pf (profiling/model.py: host_work_s) is what a decode step's layer pays for prefetching: one run of the
    predictor and its prefetches' submits, the engine's counter. On a real engine (a tiny Qwen3-MoE, every layer
    but the link layer served whole), it is read in the decode steps with prefetch, from the layer before the link
    layer (its prefetches are real loads; every other layer predicts for a whole layer and issues none): the
    median of that layer's per-step counter. The forwards that replay the decode steps' tokens (h_load, c) run
    without prefetch."""
    from fmoe_cli.models.load import load_model
    from fmoe_cli.offload.engine import open_engine
    from fmoe_cli.offload.link import EmulatedLink, VirtualClock
    from fmoe_cli.planning.plan import min_staging_slots
    from fmoe_cli.planning.presets import make_settings
    from fmoe_cli.profiling import model as profiling_model

    lm = load_model(str(checkpoints["qwen3_moe"]), device="cpu", dtype="float32")
    shape = lm.shape
    engine = open_engine(lm, link=EmulatedLink(1000.0, clock=VirtualClock()))
    engine.configure(make_settings("ondemand", shape, min_staging_slots(shape) * shape.expert_bytes))
    whole = profiling_model.WholeLayers(engine)
    keep = whole.link_layer
    assert keep >= 1
    from fmoe_cli.offload import engine as engine_module

    # a scripted host clock for the engine: each reading 1 µs on, and layer j's predictor (its host part) j + 1 µs
    # more, so that layer j's path counts j + 3 µs (device part 1, the rest 1 + j + 1): the counter read tells
    # which layer it was read from
    tick = [0.0]

    def now():
        tick[0] += 1e-6
        return tick[0]

    after_layer = engine.predictor.after_layer

    def scripted(it, layer):
        tick[0] += (layer + 1) * 1e-6
        return after_layer(it, layer)

    forwards = []
    layer_forward = profiling_model.layer_forward_s

    def in_forwards(lm, engine, *args, **kwargs):
        forwards.append(engine.settings.prefetch)
        return layer_forward(lm, engine, *args, **kwargs)

    original = engine_module.host_now
    engine_module.host_now = now
    engine.predictor.after_layer = scripted
    profiling_model.layer_forward_s = in_forwards
    try:
        got = profiling_model.host_work_s(lm, engine, profiling_model.prompt_ids(lm, 2), block_h_load=0.0,
                                          t_segment=0.0, rounds=1, tokens=4, whole=whole, layer_reps=10)
    finally:
        engine_module.host_now = original
        profiling_model.layer_forward_s = layer_forward
        del engine.predictor.after_layer
        whole.close()
        engine.close()
    assert got[1] == pytest.approx((keep - 1 + 3) * 1e-6)  # the layer before the link layer's path
    assert forwards and not any(forwards)  # no forward prefetches

MIXTRAL_EXPERT_BYTES = 3 * 14336 * 4096 * 2  # one Mixtral-8x7B expert, bf16: 336 MiB


@pytest.fixture(scope="module")
def mixtral_shaped(tmp_path_factory):
    """A tiny checkpoint with Mixtral-8x7B's routing shape: 32 MoE layers, 8 experts, top-2."""
    from fmoe_cli.models.demo import build_random_moe
    from fmoe_cli.models.load import load_model

    path = build_random_moe(tmp_path_factory.mktemp("mixtral32") / "m", "mixtral", seed=1, num_hidden_layers=32,
                            num_local_experts=8, num_experts_per_tok=2)
    return load_model(str(path), device="cpu", dtype="float32")


@pytest.mark.parametrize("fits", [True, False], ids=["cpu", "gpu-path"])
def test_the_quick_measurement_moves_at_most_20_layers_of_experts(mixtral_shaped, fits, monkeypatch):
    """Issue 20 §4: the quick timings of a model with no saved profile move at most 20 × one layer's
    experts over the link (they moved 220·L·K experts twice: ~4.6 TiB for Mixtral bf16). On an emulated
    link shaped like PCIe 3.0 (12 GB/s) for Mixtral's 336 MiB experts, on a virtual clock (it moves only
    while the host waits on the link), that is under 10 s of link time. `gpu-path`: the branch of a
    model that does not fit on the device (one layer's experts stand in for every layer's)."""
    from fmoe_cli.offload.link import EmulatedLink, VirtualClock
    from fmoe_cli.profiling import model as profiling_model
    from fmoe_cli.run import measure_timings

    monkeypatch.setattr(profiling_model, "_resident_fits", lambda lm: fits)
    lm = mixtral_shaped
    shape = lm.shape
    clock = VirtualClock()
    link = EmulatedLink(12 * shape.expert_bytes / MIXTRAL_EXPERT_BYTES, clock=clock)  # 12 GB/s in Mixtral's units
    timings = measure_timings(lm, link=link)
    layer = shape.num_experts * shape.expert_bytes
    assert 0 < link.bytes_moved <= 20 * layer
    assert clock.t < 10.0  # s of link time for Mixtral-8x7B bf16 on PCIe 3.0
    assert len(timings.decode.layers) == 32 and all(t.t_moe > 0 for t in timings.decode.layers)
    assert timings.t_host_prefetch is not None and timings.t_segment > 0


def test_the_link_is_measured_once_per_device_with_small_copies(tmp_path, monkeypatch):
    """Issue 20 §4: a run without a profile measured the link at 1, 4 and 16 experts' size every time
    (16 Mixtral experts: 5.25 GiB pinned on the host and on the GPU). Now it is measured once per device,
    with copies of at most 32 MiB, and saved under the device's identity; the next run reads it; another
    device measures its own; `fmoe profile`'s device profile is used when it is of this device."""
    from fmoe_cli.offload.link import EmulatedLink
    from fmoe_cli.profiling import device as device_module
    from fmoe_cli.run import link_fit_of

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    pinned = []

    class Buffer(device_module.HostBuffer):
        def __init__(self, nbytes, pin, memory=None):
            pinned.append(nbytes)
            super().__init__(nbytes, pin=False)

    monkeypatch.setattr(device_module, "HostBuffer", Buffer)
    cpu = torch.device("cpu")
    first = link_fit_of(EmulatedLink(None), cpu)
    assert first.kind == "measured" and pinned and max(pinned) <= 32 << 20
    assert device_module.link_profile_path(device_identity(cpu)).exists()
    measured = len(pinned)
    again = link_fit_of(EmulatedLink(None), cpu)
    assert len(pinned) == measured and again == first  # read back, not measured again
    other = DeviceIdentity("cuda", "Other card", 12 << 30)
    monkeypatch.setattr(device_module, "device_identity", lambda device=None: other)
    link_fit_of(EmulatedLink(None), cpu)
    assert len(pinned) == 2 * measured  # another device: its own measurement, its own file
    assert device_module.link_profile_path(other) != device_module.link_profile_path(device_identity(cpu))
    from fmoe_cli.profiling.files import default_profile_path

    profiled = LinkFit("measured", 7e9, 9e-6, ((1 << 20, 1.6e-4), (1 << 21, 3.1e-4)), "fmoe profile")
    Profile(DeviceProfile(other, profiled)).save(default_profile_path())  # `fmoe profile`: profiles/device.json
    assert link_fit_of(EmulatedLink(None), cpu) == profiled and len(pinned) == 2 * measured


def test_fmoe_profile_labels_each_time_per_layer_expert_or_token(config):
    """Issue 22 §4: the table's "T_exp" (T_moe / K, 0.18–0.21 ms) disagreed with the summary's T_exp (0.083 ms, one
    expert's forward alone). The table says T_moe/K per layer's activated expert, the summary T_exp per expert, and
    a line gives what the configurator uses, per layer, per expert and per token."""
    import io
    from dataclasses import replace

    from rich.console import Console

    from fmoe_cli.bench.profile import render

    profile = make_profile(DeviceIdentity("cuda", "NVIDIA GeForce RTX 4090", 24 << 30), config)
    profile = replace(profile, model=replace(profile.model, t_expert=1e-4))  # T_moe / K = 3e-4 s: 3 × one forward
    out = io.StringIO()
    render(profile, None, 12_500_000, Console(file=out, width=250))
    text = out.getvalue()
    assert "T_moe/K ms" in text and "decode T_exp ms" not in text
    assert "0.300" in text  # T_moe / K of layer 1, per activated expert
    assert "T_exp per expert (one expert's forward alone" in text and "0.100 ms" in text
    assert "the configurator uses (means over the MoE layers): T_att 0.550 ms per layer" in text  # 0.15 + (0.6 − 2·0.1)
    assert "T_exp 0.100 ms per expert, T_moe = K·T_exp 0.200 ms per layer" in text


def test_an_admission_is_timed_between_expert_forwards_as_a_decode_step_pays_it(monkeypatch):
    """a_e (profiling/model.py: admission_in_context): two expert forwards with the admission's copy between them
    against the same two without, in alternate repeats, on a scripted clock. The copy takes 0.25 and leaves the next
    forward 0.5 slower (the caches it evicted): a_e reads 0.75, not the copy's own 0.25 (what timing it alone gave).
    Where the forwards beside a copy happen to run faster (noise), a_e is still at least the copy's own time."""
    from fmoe_cli.profiling import model as profiling_model

    def scripted(forward_s, copy_s, after_copy_s):
        clock = {"now": 0.0, "copied": False}
        monkeypatch.setattr(profiling_model, "host_now", lambda: clock["now"])

        def forward(_):
            clock["now"] += after_copy_s if clock["copied"] else forward_s
            clock["copied"] = False

        def copy(_):
            clock["now"] += copy_s
            clock["copied"] = True

        return profiling_model.admission_in_context(forward, copy, repeats=10)

    assert scripted(1.0, 0.25, 1.5) == pytest.approx(0.75)
    assert scripted(1.0, 0.25, 0.9) == pytest.approx(0.25)  # the difference reads 0.15: the copy alone is the floor


def test_the_admission_cost_is_measured_on_the_demo_cpu_as_a_positive_time():
    """admission_copy_s on the demo's real store: the CPU path (cold slots, LCP's victim, the copy between two
    forwards) runs and reads a positive time of the order of a copy of one expert."""
    import io

    from rich.console import Console

    from fmoe_cli.models.load import load_model
    from fmoe_cli.profiling.model import admission_copy_s

    lm = load_model("demo", device="cpu", console=Console(file=io.StringIO()))
    assert 0 < admission_copy_s(lm, repeats=4) < 1.0


def test_the_admission_slots_are_in_proportion_to_the_host_store():
    """The quick estimate's a_e copies into cold slots of host memory (issue 39 §6): they span at most 1/16 of the
    host store and ADMISSION_SLOTS_BYTES, and hold at least two experts. A fixed 64 MiB was 10 slots of a 576 MiB
    bf16 store (0.10 × it) and 113 of the demo's 0.56 MiB experts (more than its 54 MiB store)."""
    from types import SimpleNamespace

    from fmoe_cli.profiling.model import ADMISSION_SLOTS_BYTES, admission_slots

    MiB = 1 << 20

    def store(experts: int, hidden: int, intermediate: int, dtype=torch.bfloat16):
        expert = torch.ones(intermediate, 3, hidden, dtype=dtype)
        return SimpleNamespace(expert=lambda layer, e: expert, nbytes=experts * expert.nbytes)

    m614 = store(96, 1024, 1024)  # 6 layers × 16 experts of hidden 1024: 576 MiB
    slots = admission_slots(m614)
    assert slots.shape == (6, 1024, 3, 1024) and slots.nbytes == 36 * MiB  # 576 / 16
    assert torch.equal(slots[-1], m614.expert(0, 0))  # every slot's pages touched
    assert admission_slots(store(32, 256, 256, torch.float32)).shape[0] == 2  # 24 MiB of 0.75 MiB experts: 1.5 MiB, two
    assert admission_slots(store(2, 1024, 1024)).shape[0] == 2  # at least two, even beyond 1/16
    huge = admission_slots(store(48 * 128, 2048, 768))  # a3b's bf16 store (54 GiB): the fixed cap
    assert huge.shape[0] == ADMISSION_SLOTS_BYTES // (9 * MiB) and huge.nbytes <= ADMISSION_SLOTS_BYTES


def test_the_admission_cost_on_the_demo_copies_into_slots_of_its_own_store(monkeypatch):
    """admission_copy_s allocates its slots through admission_slots, for the model's own host store: the demo's
    54 MiB store gets 6 slots of one expert (3.4 MiB), not 64 MiB."""
    import io

    from rich.console import Console

    from fmoe_cli.models.load import load_model
    from fmoe_cli.profiling import model as profiling_model

    lm = load_model("demo", device="cpu", console=Console(file=io.StringIO()))
    made = []
    real = profiling_model.admission_slots
    monkeypatch.setattr(profiling_model, "admission_slots", lambda store: made.append(real(store)) or made[-1])
    assert profiling_model.admission_copy_s(lm, repeats=2) > 0
    (slots,) = made
    expert = lm.store.expert(0, 0)
    assert slots.shape[1:] == expert.shape
    assert 2 * expert.nbytes <= slots.nbytes <= lm.store.nbytes // 16


def test_the_unquantised_expert_timing_dequantises_one_expert_not_a_layer(monkeypatch, tmp_path):
    """expert_compute_s(unquantised=True) (the CPU's stand-in link is shaped from it on every bench and chat start)
    dequantises one expert of an int4 store: I rows, where the whole first layer (N·I rows in float32, then in the
    compute dtype) was 318 MiB of transient host memory beside a 165 MiB int4 store (issue 39 §6). The one expert is
    the layer's expert 0, bit for bit."""
    import io

    from rich.console import Console

    from fmoe_cli.models.load import load_model
    from fmoe_cli.offload import quant
    from fmoe_cli.profiling.model import expert_compute_s

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the converted store: not the user's cache
    lm = load_model("demo", device="cpu", experts="int4", console=Console(file=io.StringIO()))
    rows = []
    real = quant.dequantize
    monkeypatch.setattr(quant, "dequantize", lambda segment, *a, **k: rows.append(segment.shape[0]) or real(segment, *a, **k))
    assert expert_compute_s(lm, repeats=2, unquantised=True) > 0
    assert rows == [lm.shape.intermediate]
    assert torch.equal(lm.store.dequantized(1, expert=3)[0], lm.store.dequantized(1)[3])


def test_the_engines_link_is_timed_at_the_models_copies_until_they_land(checkpoints):
    """Issue 37 §5: the link the configurator prices loads with is the engine's own (CudaLink: chunks, the store's
    memory), timed at the copies it issues for this model (one expert, its bottoms at θ 0.5 and 0.75), each until the
    compute stream holds the data. On the fake GPU a chunk lands only when someone waits for it: every chunk issued
    has been played once the measurement returns."""
    import fake_gpu  # tests/fake_gpu.py
    from fmoe_cli.models.load import load_model
    from fmoe_cli.offload.link import CudaLink
    from fmoe_cli.profiling.model import engine_copy_starts, engine_link

    lm = load_model(str(checkpoints["qwen3_moe"]), device="cpu", dtype="float32")
    shape = lm.shape
    starts = engine_copy_starts(shape)
    assert starts == [0, shape.top_neurons(0.5), shape.top_neurons(0.75)] and len(set(starts)) == 3, starts
    with fake_gpu.installed() as gpu:
        link = CudaLink(torch.device("cuda"), chunk_bytes=1024, pump_thread=False)  # several chunks a copy
        fit = engine_link(lm, link, repeats=2)
        issued, played = gpu.chunks_issued, gpu.chunks_played  # before close, which lands whatever is left
        link.close()
    neuron = lm.store.expert(0, 0)[0].nbytes  # one neuron's rows, the store's format
    assert [b for b, _ in fit.samples] == [(shape.intermediate - k) * neuron for k in starts]
    assert fit.samples[0][0] == shape.expert_bytes
    # 3 copies of each size (a warm-up and 2 timed), 1 KiB chunks: every chunk issued and landed when it returns
    assert issued == sum(3 * -(-nbytes // 1024) for nbytes, _ in fit.samples) == played
    assert fit.kind == "measured" and fit.bandwidth > 0 and "the engine's link" in fit.note
