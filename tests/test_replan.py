"""The moepic plan, statistics recorded by the engine and kept across sessions, and
re-planning while idle: a re-planned engine still gives transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DynamicCache

from fmoe_cli.generate import stream_generate
from fmoe_cli.models.demo import TINY_FAMILIES
from fmoe_cli.models.load import load_model
from fmoe_cli.offload.engine import Engine
from fmoe_cli.offload.link import EmulatedLink
from fmoe_cli.planning.autoplan import moepic_configuration, moepic_plan
from fmoe_cli.planning.configurator import DEFAULT_TAU
from fmoe_cli.planning.plan import uniform_plan
from fmoe_cli.planning.presets import PlanInputs, make_settings, settings_for
from fmoe_cli.planning.replan import Replanner
from fmoe_cli.planning.stats import RoutingStats, StatsRecorder, held_order, lcp_ranking, load_or_empty
from fmoe_cli.run import find_timings
from fmoe_cli.types import ExpertShape, Timings

PROMPT = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11, 64, 128]])
FIRST, SECOND = 12, 12  # tokens before and after the re-plan


def budget_of(shape: ExpertShape) -> int:
    return 2 * shape.top_k * shape.expert_bytes + shape.all_experts_bytes // 3


@pytest.fixture(scope="module", params=list(TINY_FAMILIES))
def setup(request, checkpoints):
    path = checkpoints[request.param]
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    want = reference.generate(PROMPT, max_new_tokens=FIRST + SECOND, do_sample=False)[0, PROMPT.shape[1]:].tolist()
    lm = load_model(str(path), device="cpu", dtype="float32")
    engine = Engine(lm.layers, lm.store, lm.shape, EmulatedLink(gbps=2), lm.device, lm.dtype)
    engine.install(lm.model)
    yield lm, engine, want
    engine.close()


def attach(lm, engine, budget, path, *, timings: Timings, tau: int = DEFAULT_TAU) -> Replanner:
    """What open_run does: this model's saved statistics observed by a Replanner, timings found first."""
    shape = lm.shape
    stats = load_or_empty(lm.model_id, shape.num_layers, shape.num_experts, shape.top_k, path)
    return Replanner(engine, PlanInputs(shape, budget, timings, model=lm.model_id), StatsRecorder(stats, path), tau)


def generate(lm, engine, ids, cache, n):
    return [e.token_id for e in stream_generate(lm.model, ids, engine=engine, max_new_tokens=n, stop_on_eos=False,
                                                past_key_values=cache)]


def test_replanned_engine_gives_transformers_tokens(setup, tmp_path):
    lm, engine, want = setup
    budget = budget_of(lm.shape)
    timings = find_timings(lm, engine.link, tmp_path / "no-profile.json", engine=engine)
    planner = attach(lm, engine, budget, tmp_path / "stats.json", timings=timings, tau=FIRST)
    assert planner.stats.tokens == 0 and planner.recorder in engine.observers
    engine.configure(settings_for("moepic", planner.plan_inputs()))
    first_plan = engine.settings.plan
    assert first_plan.source == "configurator" and first_plan.total_bytes <= budget
    assert not planner.on_idle()  # nothing recorded yet: not due
    cache = DynamicCache(config=lm.model.config)
    got = generate(lm, engine, PROMPT, cache, FIRST)
    # the prompt and the first FIRST-1 decode steps passed the first MoE layer
    assert planner.recorder.tokens == PROMPT.shape[1] + FIRST - 1
    assert planner.on_idle()  # τ tokens have passed: re-plan, rebuild the cache warm
    assert planner.replans == 1 and engine.settings.plan.total_bytes <= budget
    rebuilt, plan = engine.layers[0], engine.settings.plan
    # warm: the experts seen so far, as many as fit; a layer the new plan makes resident (every expert whole, from the
    # measured timings) holds them all from the start
    seen = sum(c > 0 for c in rebuilt.cache.policy.count)
    want_cached = lm.shape.num_experts if plan.resident_layer(0, lm.shape) else min(plan.layers[0].cache_size, seen)
    assert len(rebuilt.cache.cached()) == want_cached
    got += generate(lm, engine, torch.tensor([[got[-1]]]), cache, SECOND)
    assert got == want
    planner.close()
    assert planner.recorder not in engine.observers
    assert (tmp_path / "stats.json").exists()


def test_statistics_persist_across_sessions(setup, tmp_path):
    lm, engine, _ = setup
    budget = budget_of(lm.shape)
    path = tmp_path / "stats.json"
    timings = Timings(1e-4, 2e-4, 1e-4, 3e-4, lm.shape.top_k)
    first = attach(lm, engine, budget, path, timings=timings)
    engine.configure(settings_for("moepic", first.plan_inputs()))
    generate(lm, engine, PROMPT, None, 4)
    first.close()
    learned = first.stats.layers[1].rank_hist.copy()
    assert learned.sum() == (PROMPT.shape[1] + 3) * lm.shape.top_k
    second = attach(lm, engine, budget, path, timings=timings)
    assert (second.stats.layers[1].rank_hist == learned).all()
    assert second.stats.tokens == PROMPT.shape[1] + 3
    second.close()


def test_recorder_ranks_by_lcp_priority_before_the_token(setup):
    """The histogram of one decode step equals the rank of each activated expert computed by hand from the policy
    state before the step: in the order the cache holds them (`held_order`: the previous token's experts first,
    then the rest, each by LCP priority)."""
    lm, engine, _ = setup
    engine.configure(make_settings("lru", lm.shape, budget_of(lm.shape)))  # any policy: ranks are LCP's
    generate(lm, engine, PROMPT, None, 3)
    seen = []
    engine.observers.append(lambda ev: seen.append((ev.layer, held_order(lcp_ranking(ev.cache.policy, ev.cache.step),
                                                                         ev.cache.policy.last, ev.cache.step).tolist(),
                                                    ev.top_k_index.tolist(), ev.predicted)))
    recorder = StatsRecorder(RoutingStats.empty("m", lm.shape.num_layers, lm.shape.num_experts, lm.shape.top_k))
    engine.observers.append(recorder)
    try:
        generate(lm, engine, torch.tensor([[7]]), None, 1)
    finally:
        engine.observers.clear()
    assert len(seen) == lm.shape.num_layers
    for layer, ranking, rows, predicted in seen:
        expected = [0] * lm.shape.num_experts
        for e in rows[0]:
            expected[ranking.index(e)] += 1
        assert recorder.stats.layers[layer].rank_hist.tolist() == expected
        assert recorder.stats.layers[layer].predicted_tokens == (1 if predicted is not None else 0)
    assert recorder.tokens == 1


def test_engine_timings_use_the_emulated_link(setup, tmp_path):
    lm, engine, _ = setup
    t = find_timings(lm, engine.link, profile_path=tmp_path / "none.json", engine=engine)
    link = engine.link
    assert t.t_load == pytest.approx(lm.shape.expert_bytes / (link.gbps * 1e9) + link.latency_s)
    assert t.t_moe > 0 and t.t_att > 0 and t.t_head > 0 and t.top_k == lm.shape.top_k


def test_a_measurement_is_seen_by_a_scratch_recorder_not_by_the_engines_observers(setup):
    """The engine's costs are measured as a run pays them (a statistics recorder observing), but the
    measurement's traffic never enters the model's statistics or trace."""
    from fmoe_cli.planning.plan import min_staging_slots
    from fmoe_cli.planning.stats import scratch_recorder
    from fmoe_cli.profiling.model import model_timings

    lm, engine, _ = setup
    mine = StatsRecorder(RoutingStats.empty("m", lm.shape.num_layers, lm.shape.num_experts, lm.shape.top_k))
    engine.observers = [mine]
    scratch = scratch_recorder(lm.shape)
    engine.configure(make_settings("ondemand", lm.shape, min_staging_slots(lm.shape) * lm.shape.expert_bytes))
    timings = model_timings(lm, engine, prefill_len=4, quick=True, observers=[scratch])
    assert engine.observers == [mine] and mine.tokens == 0
    assert scratch.tokens > 0 and any(layer.predicted_tokens > 0 for layer in scratch.stats.layers)  # prefetching too
    assert timings.t_host_load is not None and timings.t_host_prefetch is not None
    engine.observers = []


SHAPE = ExpertShape(num_layers=4, num_experts=8, top_k=2, hidden=64, intermediate=256, dtype_bytes=2)


def skewed_stats(rng) -> RoutingStats:
    """Layer 0 routes uniformly at random, later layers ever more to experts 0 and 1."""
    stats = RoutingStats.empty("m", SHAPE.num_layers, SHAPE.num_experts, SHAPE.top_k)
    for _ in range(400):
        for layer in range(SHAPE.num_layers):
            p = torch.full((SHAPE.num_experts,), 1.0)
            p[:2] += 6.0 * layer
            chosen = torch.multinomial(p, SHAPE.top_k, generator=rng).tolist()
            stats.observe(layer, chosen, list(range(SHAPE.num_experts)), list(range(SHAPE.num_experts)))
    return stats


def test_moepic_plan_within_budget_uniform_without_stats_and_adapts_to_skew():
    rng = torch.Generator().manual_seed(0)
    timings = Timings(t_att=1e-4, t_moe=2e-4, t_head=1e-4, t_load=3e-4, top_k=2)  # T_load = 3 × T_exp
    budget = 4 * SHAPE.expert_bytes + 10 * SHAPE.expert_bytes
    plain = moepic_configuration(SHAPE, budget, timings)
    assert plain.uniform_routing
    # Algorithm 1 from the uniform start gives every layer the same plan (no reason to differ); the search from
    # the per-layer optimum may concentrate the budget (a cache's gain is not concave in its size), only when
    # that is predicted better
    first = plain.candidates[0]
    assert first[0] == "algorithm 1" and plain.total_exposed <= first[1]
    if plain.chosen == "algorithm 1":
        assert len({(lp.cache_size, lp.top_neurons) for lp in plain.plan.layers}) == 1
    skewed = moepic_configuration(SHAPE, budget, timings, skewed_stats(rng))
    assert not skewed.uniform_routing
    for config in (plain, skewed):
        assert config.plan.total_bytes <= budget
    assert skewed.total_exposed < plain.total_exposed
    plan = moepic_plan(SHAPE, budget, timings, skewed_stats(rng))
    assert plan.source == "configurator"
    uniform = uniform_plan(SHAPE, budget)
    assert plan.staging_slots == uniform.staging_slots


def test_fmoe_bench_runs_moepic_on_the_configured_plan_and_saves_statistics(checkpoints, tmp_path, monkeypatch):
    import json

    from typer.testing import CliRunner

    from fmoe_cli.cli import app
    from fmoe_cli.planning.stats import default_stats_path

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    path = str(checkpoints["mixtral"])
    result = CliRunner().invoke(app, ["bench", path, "--policy", "moepic", "--policy", "uniform", "--tokens", "4",
                                      "--warmup", "1", "--emulate-link", "20", "--json"])
    assert result.exit_code == 0, result.output
    runs = {r["policy"]: r for r in json.loads(result.stdout)["runs"]}
    assert runs["moepic"]["plan"].startswith("configurator:") and runs["uniform"]["plan"].startswith("uniform:")
    assert runs["moepic"]["token_ids"] == runs["uniform"]["token_ids"]
    saved = RoutingStats.load(default_stats_path(path))
    assert saved.tokens > 0  # both runs' tokens, recorded for the next session


def test_a_replan_takes_the_presets_settings_again(monkeypatch):
    """The re-planned settings are the preset's for the new plan (a plan may turn prefetch off),
    with the run's ω and ρ; only a configured preset is re-planned, only once τ tokens have passed."""
    from dataclasses import replace

    from fmoe_cli.planning.presets import PRESETS

    no_prefetch = replace(uniform_plan(SHAPE, 8 * SHAPE.expert_bytes), source="configurator", prefetch=False)
    monkeypatch.setitem(PRESETS, "moepic", replace(PRESETS["moepic"], make_plan=lambda inputs: no_prefetch))

    class Engine_:  # what the Replanner uses of an engine
        def __init__(self):
            self.observers, self.configured, self.settings = [], [], None

        def configure(self, settings, warm=False):
            self.settings = settings
            self.configured.append(warm)

    engine = _MoepicEngine()
    recorder = StatsRecorder(RoutingStats.empty("m", SHAPE.num_layers, SHAPE.num_experts, SHAPE.top_k))
    planner = Replanner(engine, PlanInputs(SHAPE, 8 * SHAPE.expert_bytes), recorder, tau=10)
    engine.settings = make_settings("lru", SHAPE, 8 * SHAPE.expert_bytes, omega=16, rho=0.5)
    recorder.tokens = 10
    assert not planner.on_idle() and engine.configured == []  # lru's plan reads no statistics
    engine.settings = make_settings("uniform", SHAPE, 8 * SHAPE.expert_bytes, omega=16, rho=0.5)
    engine.settings = replace(engine.settings, policy="moepic")
    recorder.tokens = 9
    assert not planner.on_idle()  # fewer than τ tokens
    recorder.tokens = 10
    assert planner.on_idle() and engine.configured == [True]
    s = engine.settings
    assert s.plan is no_prefetch and s.prefetch is False and (s.omega, s.rho) == (16, 0.5)


class _MoepicEngine:
    """What the re-planner sees of an engine running `moepic`: its settings and each configure (warm or not)."""

    def __init__(self):
        from dataclasses import replace

        self.observers, self.configured = [], []
        self.settings = replace(make_settings("uniform", SHAPE, 8 * SHAPE.expert_bytes), policy="moepic")

    def configure(self, settings, warm=False):
        self.settings = settings
        self.configured.append(warm)


def test_a_plan_made_without_recorded_routing_is_made_again_after_a_few_tokens():
    """Uniform routing assumed (nothing recorded): re-planned once FIRST_PLAN_TOKENS tokens are
    recorded, not τ; a plan made from recorded routing waits τ."""
    from fmoe_cli.planning.plan import MIN_PREDICTIONS
    from fmoe_cli.planning.replan import FIRST_PLAN_TOKENS

    engine = _MoepicEngine()
    recorder = StatsRecorder(RoutingStats.empty("m", SHAPE.num_layers, SHAPE.num_experts, SHAPE.top_k))
    timings = Timings(t_att=1e-4, t_moe=2e-4, t_head=1e-4, t_load=3e-4, top_k=SHAPE.top_k)
    planner = Replanner(engine, PlanInputs(SHAPE, 8 * SHAPE.expert_bytes, timings), recorder, tau=1000)
    assert planner.blind
    recorder.tokens = FIRST_PLAN_TOKENS - 1
    assert not planner.on_idle()
    recorder.tokens = FIRST_PLAN_TOKENS
    for layer in recorder.stats.layers:  # the decode tokens among them recorded the prefetcher's ranking
        layer.predicted_tokens = MIN_PREDICTIONS
    assert planner.on_idle() and engine.configured == [True] and not planner.blind
    recorder.tokens = FIRST_PLAN_TOKENS + 999
    assert not planner.on_idle()  # from now on τ
    recorder.tokens = FIRST_PLAN_TOKENS + 1000
    assert planner.on_idle()


def test_a_plan_made_before_the_predictor_was_judged_is_made_again_after_a_few_tokens():
    """Routing recorded but fewer than MIN_PREDICTIONS decode tokens with a prediction (statistics recorded
    by runs without prefetch, or a prompt's tokens alone): the configurator kept prefetch, so the plan is
    made again after FIRST_PLAN_TOKENS tokens, not τ, once it can judge the predictor."""
    from fmoe_cli.planning.plan import MIN_PREDICTIONS
    from fmoe_cli.planning.replan import FIRST_PLAN_TOKENS

    engine = _MoepicEngine()
    stats = RoutingStats.empty("m", SHAPE.num_layers, SHAPE.num_experts, SHAPE.top_k)
    for layer in stats.layers:
        layer.tokens, layer.predicted_tokens = 500, MIN_PREDICTIONS - 1
    recorder = StatsRecorder(stats)
    recorder.tokens = 500
    timings = Timings(t_att=1e-4, t_moe=2e-4, t_head=1e-4, t_load=3e-4, top_k=SHAPE.top_k)
    planner = Replanner(engine, PlanInputs(SHAPE, 8 * SHAPE.expert_bytes, timings), recorder, tau=1000)
    assert planner.blind
    recorder.tokens = 500 + FIRST_PLAN_TOKENS
    assert planner.on_idle() and planner.blind  # still too few predictions: again after a few tokens
    for layer in stats.layers:
        layer.predicted_tokens = MIN_PREDICTIONS
    recorder.tokens = 500 + 2 * FIRST_PLAN_TOKENS
    assert planner.on_idle() and not planner.blind
    recorder.tokens = 500 + 3 * FIRST_PLAN_TOKENS
    assert not planner.on_idle()  # from now on τ
