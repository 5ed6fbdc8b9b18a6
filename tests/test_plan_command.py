"""`fmoe plan MODEL` from config.json alone: per-layer plan, totals, what fits; bad input
is one line and exit code 2."""

from __future__ import annotations

import json

import pytest
import transformers
from typer.testing import CliRunner

from fmoe_cli.cli import app
from fmoe_cli.planning.stats import RoutingStats, default_stats_path
from fmoe_cli.types import ExpertShape, Timings
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

MiB = 1024**2
runner = CliRunner()


@pytest.fixture(autouse=True)
def own_config_dir(tmp_path, monkeypatch):
    """Statistics are read from the user's config directory: use an empty one."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def plan_json(*args: str) -> dict:
    result = runner.invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def one_line_error(result, message: str) -> None:
    assert result.exit_code == 2, result.output
    text = result.output.strip()
    assert text.startswith("error:") and message in text and "Traceback" not in text, text
    assert len(text.splitlines()) == 1


def test_plan_from_a_model_directory(checkpoints):
    path = checkpoints["mixtral"]
    report = plan_json(str(path), "--vram", "64MiB", "--workspace", "8MiB", "--context", "256", "--dtype", "float32")
    shape, memory, layers = report["shape"], report["memory"], report["layers"]
    assert (shape["moe_layers"], shape["experts"], shape["top_k"]) == (4, 8, 2)
    assert shape["expert_bytes"] == 64 * 3 * 64 * 4  # I·3·H·4 bytes (float32 config)
    assert report["uniform_routing"] and report["sources"]["statistics"].startswith("uniform routing")
    assert len(layers) == 4
    assert sum(layer["vram_bytes"] for layer in layers) <= memory["expert_budget"]
    assert all(0 <= layer["split"] <= 1 and layer["cache_size"] <= 8 for layer in layers)
    assert memory["device"] == 64 * MiB and memory["workspace"] == 8 * MiB
    # every part of the device budget adds up to V
    parts = memory["non_expert"] + memory["staging"] + memory["kv_cache"] + memory["workspace"] + memory["expert_budget"]
    assert parts == memory["device"]
    # the same model named by its config.json file plans the same
    again = plan_json(str(path / "config.json"), "--vram", "64MiB", "--workspace", "8MiB", "--context", "256",
                      "--dtype", "float32")
    assert again["layers"] == layers


def test_plan_text_says_it_assumes_uniform_routing(checkpoints):
    result = runner.invoke(app, ["plan", str(checkpoints["mixtral"]), "--vram", "64MiB", "--workspace", "8MiB"])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "assumes uniform routing" in out and "per-layer plan" in out and "expert cache budget" in out


def test_plan_uses_recorded_statistics(checkpoints):
    path = checkpoints["mixtral"]
    stats = RoutingStats.empty(str(path), 4, 8, 2)
    for _ in range(50):
        for layer in range(4):
            stats.observe(layer, [0, 1], list(range(8)), list(range(8)))
    stats.save(default_stats_path(str(path)))
    report = plan_json(str(path), "--vram", "64MiB", "--workspace", "8MiB")
    assert not report["uniform_routing"] and "50 recorded tokens" in report["sources"]["statistics"]
    result = runner.invoke(app, ["plan", str(path), "--vram", "64MiB", "--workspace", "8MiB"])
    assert "assumes uniform routing" not in result.output


def test_mixtral_8x7b_from_its_config(tmp_path):
    """Hand check: one expert = 3·4096·14336·2 B = 336 MiB; KV per token = 32 layers · 8 KV heads ·
    (128 + 128) · 2 B = 128 KiB, so the default 8192 tokens = 1 GiB (--context 4096: 512 MiB); the staging
    pool holds 2K = 4 experts."""
    config = transformers.MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                        num_local_experts=8, num_experts_per_tok=2)
    config.dtype = "bfloat16"
    config.save_pretrained(tmp_path / "mixtral")
    report = plan_json(str(tmp_path / "mixtral"), "--vram", "24GiB")
    assert report["shape"]["expert_bytes"] == 336 * MiB
    assert report["memory"]["kv_cache"] == 1024 * MiB and report["memory"]["context_tokens"] == 8192
    assert plan_json(str(tmp_path / "mixtral"), "--vram", "24GiB", "--context", "4096")["memory"]["kv_cache"] == 512 * MiB
    assert report["memory"]["staging"] == 4 * 336 * MiB
    assert not report["memory"]["whole_model_fits"]
    assert sum(layer["vram_bytes"] for layer in report["layers"]) <= report["memory"]["expert_budget"]


def test_auto_plans_in_the_run_s_dtype_not_the_config_s(checkpoints):
    """`--dtype auto` is what a run picks (load.pick_dtype): a GPU's bfloat16 whatever config.json's dtype (OLMoE's
    says float32: its plan counted every weight twice), the CPU's float32 with a CPU profile."""
    path = str(checkpoints["mixtral"])  # (a float32 config)
    auto = plan_json(path, "--vram", "64MiB", "--workspace", "8MiB")
    wide = plan_json(path, "--vram", "64MiB", "--workspace", "8MiB", "--dtype", "float32")
    assert auto["shape"]["expert_bytes"] == 64 * 3 * 64 * 2 and wide["shape"]["expert_bytes"] == 64 * 3 * 64 * 4
    assert 2 * auto["memory"]["non_expert"] == pytest.approx(wide["memory"]["non_expert"], rel=0.01)  # (but buffers)
    assert auto["memory"]["kv_cache"] * 2 == wide["memory"]["kv_cache"]


def test_a_model_transformers_builds_no_causal_lm_of_is_one_line(tmp_path):
    """An image-text MoE (Qwen3-VL-MoE): one line, not AutoModelForCausalLM's traceback."""
    config = transformers.AutoConfig.for_model("qwen3_vl_moe")
    config.save_pretrained(tmp_path / "vl")
    one_line_error(runner.invoke(app, ["plan", str(tmp_path / "vl"), "--vram", "12GiB"]),
                   "transformers registers no AutoModelForCausalLM for it")


def _mixtral_8x7b(tmp_path):
    config = transformers.MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                        num_local_experts=8, num_experts_per_tok=2)
    config.dtype = "bfloat16"
    config.save_pretrained(tmp_path / "mixtral")
    return str(tmp_path / "mixtral")


def test_mixtral_bf16_at_12gib_caches_where_a_cache_pays(tmp_path):
    """Issue 22 §4: Mixtral-8x7B bf16 at 12 GiB on an RTX 3060's figures (uniform routing) planned 755 ms, the
    same as `ondemand`, caching nothing in 6.2 GiB: every ζ-move from the uniform start gains nothing (Algorithm 1
    prices 853.5 ms, with a chance-level predictor's prefetches). Whole layers of tops (C = 8: nothing ever admitted) pay; the
    search from the per-layer optimum finds them, and the plan names the winner among the priced plans."""
    report = plan_json(_mixtral_8x7b(tmp_path), "--vram", "12GiB", "--profile", "profiles/rtx-3060-12gb.json")
    chooser, tpot = report["configurator"], report["tpot"]["policies"]
    assert report["totals"]["cached_experts"] > 0
    assert tpot["moepic"]["tpot_s"] < 0.95 * tpot["ondemand"]["tpot_s"]
    assert tpot["moepic"]["tpot_s"] <= min(p["tpot_s"] for name, p in tpot.items() if name != "resident") + 1e-9
    prices = chooser["candidates"]
    assert prices["algorithm 1"] > 1.2 * prices[chooser["chosen"]]  # the uniform start alone misses it
    assert prices[chooser["chosen"]] == pytest.approx(report["totals"]["exposed_s_per_token"])
    assert chooser["chosen"] in chooser["why"]
    text = runner.invoke(app, ["plan", _mixtral_8x7b(tmp_path), "--vram", "12GiB", "--profile",
                               "profiles/rtx-3060-12gb.json"]).output
    assert "moepic's plan: " + chooser["chosen"] in " ".join(text.split())


def test_plan_names_what_each_hit_counts(tmp_path):
    """Issue 22 §4: int4 showed "hit rate 1.00" beside 166 ms of exposed load. A top hit (the top θ_i
    cached) still loads its bottom: the plan gives top hits, whole hits and the loads left per token,
    K·(1 − H_i·θ_i), per layer and per policy, and says what each counts."""
    path = _mixtral_8x7b(tmp_path)
    report = plan_json(path, "--vram", "12GiB", "--profile", "profiles/rtx-3060-12gb.json", "--experts", "int4")
    k = report["shape"]["top_k"]
    split = [layer for layer in report["layers"] if 0 < layer["split"] < 1 and layer["hit_rate"] == 1.0]
    assert split, "expected a layer whose every activation is a top hit"
    for layer in report["layers"]:
        assert layer["loads"] == pytest.approx(k * (1 - layer["hit_rate"] * layer["split"]))
        assert layer["whole_hit_rate"] == (layer["hit_rate"] if layer["split"] == 1.0 else 0.0)
    assert split[0]["whole_hit_rate"] == 0.0 and split[0]["loads"] > 0
    for policy in report["tpot"]["policies"].values():
        assert 0.0 <= policy["whole_hit_rate"] <= policy["hit_rate"] <= 1.0
    text = " ".join(runner.invoke(app, ["plan", path, "--vram", "12GiB", "--profile", "profiles/rtx-3060-12gb.json",
                                        "--experts", "int4"]).output.split())
    assert "top hit: activated experts whose top segment" in text and "whole hit: the whole expert is" in text


def test_a_plan_that_caches_nothing_says_why():
    """One layer of 2 experts (top-1), uniform routing, T_load = 4 s, an admission a_e = 20 s and a split hit's
    extra c = 10 s: one cached expert would be hit half the time, saving 1·0.5·4 = 2 s per token while its misses'
    admissions cost 1·0.5·20 = 10 s; two halves cost c per hit. Nothing is cached, and the plan says why."""
    from fmoe_cli.planning.configurator import vram_allocation
    from fmoe_cli.planning.report import why_plan
    from fmoe_cli.types import ExpertShape, Timings

    shape = ExpertShape(1, 2, 1, 1, 4, 1)
    stats = RoutingStats.assume_uniform("m", 1, 2, 1)
    timings = Timings(t_att=0.0, t_moe=1.0, t_head=0.0, t_load=4.0, top_k=1, t_admit=20.0, t_segment=10.0)
    config = vram_allocation(shape.expert_bytes, stats, timings, shape, max_prefetch=0)  # V_e: one expert
    assert config.plan.cache_bytes == 0
    why = why_plan(config, timings, stats, shape)
    assert "caches nothing" in why and "2000.00 ms of loading" in why and "10000.00 ms" in why, why


def test_plan_with_a_profile_of_this_model_uses_its_timings(checkpoints, tmp_path):
    path = checkpoints["mixtral"]
    layers = tuple(LayerTiming(i, True, 2e-4, 4e-4) for i in range(4))
    timings = ModelTimings(model_identity(str(path), path / "config.json"), 2, PhaseTimings(1, layers, 1e-4))
    link = LinkFit("measured", 1e9, 1e-5, ((1 << 20, 1e-3), (1 << 21, 2e-3)), "test")
    device = DeviceProfile(DeviceIdentity("cuda", "Some GPU", 64 * MiB), link, memory_bandwidth=1e11)
    profile = Profile(device, timings).save(tmp_path / "p.json")
    report = plan_json(str(path), "--profile", str(profile), "--workspace", "8MiB", "--dtype", "float32")
    assert report["sources"]["timings"].startswith("measured")
    assert report["sources"]["vram"] == "the profile's device" and report["memory"]["device"] == 64 * MiB
    t = report["timings"]
    assert (t["t_att"], t["t_moe"], t["t_head"]) == (2e-4, 4e-4, 1e-4)
    assert t["t_load"] == pytest.approx(1e-5 + 64 * 3 * 64 * 4 / 1e9)
    # a profile that times another model is refused
    other = checkpoints["olmoe"]
    one_line_error(runner.invoke(app, ["plan", str(other), "--profile", str(profile)]), "times")
    # a device-only profile with a memory bandwidth gives a roofline estimate
    device_only = Profile(device, None).save(tmp_path / "d.json")
    report = plan_json(str(path), "--profile", str(device_only), "--workspace", "8MiB", "--dtype", "float32")
    assert report["sources"]["timings"].startswith("roofline")
    assert report["timings"]["t_exp"] == pytest.approx(64 * 3 * 64 * 4 / 1e11)


def test_too_small_a_budget_says_how_much_is_needed(checkpoints):
    path = str(checkpoints["mixtral"])
    memory = plan_json(path, "--vram", "64MiB", "--workspace", "8MiB")["memory"]
    need = memory["device"] - memory["expert_budget"]  # U_n + U_b + KV + workspace
    # workspace 8 + KV 0.5 (the model's own context, 512 tokens · 4 layers · 2 heads · (32 + 32) · 4 B) + weights
    assert 8.5 * MiB < need < 9.5 * MiB
    result = runner.invoke(app, ["plan", path, "--vram", "1MiB", "--workspace", "8MiB"])
    one_line_error(result, f"needs at least {need / MiB:.0f} MiB")
    # and what would shrink it: the options not already at their smallest
    one_line_error(result, "smaller: --experts int4 or int2 (the staging pool), --dense int8 or int4")
    smallest = runner.invoke(app, ["plan", path, "--vram", "1MiB", "--workspace", "8MiB", "--experts", "int2",
                                   "--dense", "int4", "--context", "64"])
    one_line_error(smallest, "; smaller: a smaller --context (the KV cache)")


def test_resident_says_when_it_does_not_fit(checkpoints):
    """The TPOT table's resident row is every expert on the device: where the budget cannot hold them it says so
    (it read as the best row, 0 ms exposed, on a model 7 times the card)."""
    path = str(checkpoints["mixtral"])
    small = plan_json(path, "--vram", "10MiB", "--workspace", "8MiB", "--dtype", "float32")["tpot"]["policies"]["resident"]
    big = plan_json(path, "--vram", "4GiB", "--workspace", "8MiB", "--dtype", "float32")["tpot"]["policies"]["resident"]
    assert small["fits"] is False and big["fits"] is True
    text = runner.invoke(app, ["plan", path, "--vram", "10MiB", "--workspace", "8MiB", "--dtype", "float32"],
                         env={"COLUMNS": "200"}).stdout
    assert "resident (does not fit)" in " ".join(text.split())


@pytest.mark.parametrize("args, message", [
    (["org/not-cached-model", "--vram", "1GiB"], "no network"),
    (["/no/such/dir", "--vram", "1GiB"], "no such file or model directory"),
    (["MODEL", "--vram", "lots"], "--vram 'lots': give the device's memory as a size such as 12GiB"),
    (["MODEL", "--vram", "auto"], "--vram 'auto': give the device's memory as a size"),
    (["MODEL", "--vram", "12"], "--vram '12': give the device's memory as a size"),
    (["MODEL", "--vram", "50%"], "--vram '50%': give the device's memory as a size"),
    (["MODEL", "--vram", "1GiB", "--workspace", "50%"], "--workspace '50%': give the device memory kept for"),
    (["MODEL", "--vram", "1GiB", "--profile", "PROFILE"], "not valid JSON"),
    (["MODEL", "--vram", "1GiB", "--context", "-1"], "--context"),
])
def test_bad_input_is_one_line_exit_2(checkpoints, tmp_path, monkeypatch, args, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    args = [str(checkpoints["mixtral"]) if a == "MODEL" else str(bad) if a == "PROFILE" else a for a in args]
    one_line_error(runner.invoke(app, ["plan", *args]), message)


def test_plan_predicts_tpot_per_policy(checkpoints, tmp_path):
    """Without a trace: the configurator's model priced for every policy; with an fmoe or vLLM trace
    of the model's shape: the simulation over it. A trace of another shape is one error line."""
    from fmoe_cli.trace import TraceWriter

    path = str(checkpoints["mixtral"])
    report = plan_json(path, "--vram", "64MiB", "--workspace", "8MiB")
    tpot = report["tpot"]
    assert tpot["how"].startswith("model:")
    assert set(tpot["policies"]) >= {"moepic", "lru", "lfu", "prefetch-only", "resident"}
    shape = report["shape"]
    layers, experts, k = shape["moe_layers"], shape["experts"], shape["top_k"]
    trace = tmp_path / "t.jsonl"
    rng = __import__("random").Random(0)
    with TraceWriter(trace, num_layers=layers, num_experts=experts, top_k=k) as w:
        for t in range(40):
            for layer in range(layers):
                w.record(0, t, layer, rng.sample(range(experts), k), [1 / k] * k)
    report = plan_json(path, "--vram", "64MiB", "--workspace", "8MiB", "--trace", str(trace))
    sim = report["tpot"]
    assert sim["how"].startswith("simulated:") and "eam" in sim["how"]
    # one source (issue 22 §4): the per-layer plan is the one the simulation runs, from the trace's statistics
    assert str(trace) in report["sources"]["statistics"] and not report["uniform_routing"]
    assert report["configurator"]["plan"] == sim["policies"]["moepic"]["plan"]
    assert sim["policies"]["resident"]["exposed_s"] == 0.0
    assert all(p["tpot_s"] >= sim["policies"]["resident"]["tpot_s"] - 1e-12 for p in sim["policies"].values())
    other = tmp_path / "other.jsonl"
    with TraceWriter(other, num_layers=layers + 1, num_experts=experts, top_k=k) as w:
        for layer in range(layers + 1):
            w.record(0, 0, layer, list(range(k)), [1 / k] * k)
    one_line_error(runner.invoke(app, ["plan", path, "--vram", "64MiB", "--workspace", "8MiB", "--trace", str(other)]),
                   "layers")
    one_line_error(runner.invoke(app, ["plan", path, "--vram", "64MiB", "--trace", str(tmp_path / "nope")]),
                   "no such file")


def test_the_default_context_fits_beside_a_useful_cache():
    """--context N: what is asked, within the model's own context; by default 8192 tokens, at most the model's,
    halved (down to 2048) while its KV cache would take more than a quarter of the room beside the weights."""
    from fmoe_cli.errors import FmoeError
    from fmoe_cli.planning.plan import resolve_context

    def kib128(tokens):  # Mixtral's KV cache: 128 KiB a token
        return tokens * 128 * 1024

    assert resolve_context(None, 32768, kib128, None) == 8192  # the CPU: no device room to share
    assert resolve_context(None, 4096, kib128, None) == 4096  # the model's own context is shorter
    assert resolve_context(None, 32768, kib128, 20 * 1024 * MiB) == 8192  # 1 GiB of 20: fits
    assert resolve_context(None, 32768, kib128, 3 * 1024 * MiB) == 4096  # 1 GiB > 3/4 GiB: halved once
    assert resolve_context(None, 32768, kib128, 100 * MiB) == 2048  # never below 2048
    assert resolve_context(30000, 32768, kib128, 100 * MiB) == 30000  # asked for: as asked
    with pytest.raises(FmoeError, match="longer than the model's context of 32768"):
        resolve_context(40000, 32768, kib128, None)
    with pytest.raises(FmoeError, match="must be ≥ 0"):
        resolve_context(-1, 32768, kib128, None)


def test_plan_prices_each_configured_plan_once(checkpoints, monkeypatch):
    """`fmoe plan` prices the configured plan for its report and again for its TPOT table's moepic (and hybrid, with
    the host's figures): one configurator run per distinct inputs (planning/autoplan.py reused_configurations); outside
    that pass nothing is reused (a chat's statistics change between plans)."""
    from fmoe_cli.planning import autoplan

    runs = []
    real = autoplan.vram_allocation
    monkeypatch.setattr(autoplan, "vram_allocation", lambda *a, **kw: runs.append(kw["host_lane"]) or real(*a, **kw))
    report = plan_json(str(checkpoints["mixtral"]), "--vram", "64MiB", "--workspace", "8MiB", "--context", "256")
    assert runs and len(runs) == len(set(runs))  # each host_lane setting priced once
    assert report["configurator"]["plan"] == report["tpot"]["policies"][report["configured_policy"]]["plan"]
    shape = ExpertShape(num_layers=2, num_experts=4, top_k=2, hidden=8, intermediate=16, dtype_bytes=4)
    timings = Timings(t_att=1e-4, t_moe=2e-4, t_head=1e-4, t_load=3e-4, top_k=2)
    runs.clear()
    for _ in range(2):
        autoplan.moepic_configuration(shape, shape.all_experts_bytes, timings)
    assert len(runs) == 2
