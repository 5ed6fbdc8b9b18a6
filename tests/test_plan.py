"""Plans before the configurator: budgets, uniform / resident plans, the staging pool."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fmoe_cli.errors import FmoeError
from fmoe_cli.types import ExpertShape
from fmoe_cli.planning.plan import min_staging_slots, parse_budget, resident_plan, uniform_plan

MiB = 1024**2
# Mixtral-8x7B in bf16: 32 layers × 8 experts, top-2, H = 4096, I = 14336.
MIXTRAL = ExpertShape(num_layers=32, num_experts=8, top_k=2, hidden=4096, intermediate=14336, dtype_bytes=2)


@pytest.mark.parametrize("text, expected", [
    ("6GiB", 6 * 1024**3), ("512MiB", 512 * MiB), ("1.5G", int(1.5 * 1024**3)), ("2GB", 2 * 10**9),
    ("1048576B", MiB), (" 25% ", 250), ("100%", 1000),
])
def test_parse_budget(text: str, expected: int) -> None:
    assert parse_budget(text, all_experts_bytes=1000) == expected


@pytest.mark.parametrize("text", ["", "six gigs", "0%", "120%", "-1GiB", "5 parsecs", "25", "1048576"])
def test_parse_budget_refuses_with_one_line(text: str) -> None:
    with pytest.raises(FmoeError) as err:
        parse_budget(text, all_experts_bytes=1000)
    assert "\n" not in str(err.value)


def test_mixtral_expert_bytes() -> None:
    # I · 3 · H · 2 bytes = 14336 · 3 · 4096 · 2 = 352,321,536 B = 336 MiB per expert
    assert MIXTRAL.expert_bytes == 336 * MiB
    assert min_staging_slots(MIXTRAL) == 4  # 2·K: this layer's and the next layer's experts


def test_budget_below_the_staging_pool_says_how_much_is_needed() -> None:
    with pytest.raises(FmoeError, match=r"1000\.0 MiB is too small.*4 expert slots × 336\.00 MiB = 1344\.0 MiB"):
        uniform_plan(MIXTRAL, 1000 * MiB)


def test_uniform_plan_by_hand() -> None:
    # 12 GiB budget: staging 4 · 336 MiB = 1344 MiB; V_e = 12288 − 1344 = 10944 MiB, V_i = 342 MiB per layer.
    # θ = 0.5 → k = 7168 neurons (a whole number of 64-neuron blocks), a top segment is 168 MiB: V_e holds
    # floor(10944 / 168) = 65 tops, 2 per layer and one more in one layer (⌊V_i / 168⌋ = 2 per layer would leave
    # 192 MiB unused).
    plan = uniform_plan(MIXTRAL, 12 * 1024 * MiB, theta=0.5)
    assert plan.staging_slots == 4
    assert all(lp.top_neurons == 7168 and lp.split == 0.5 for lp in plan.layers)
    assert sorted(lp.cache_size for lp in plan.layers) == [2] * 31 + [3]
    assert plan.total_bytes == 4 * 336 * MiB + 65 * 168 * MiB


@given(layers=st.integers(1, 64), experts=st.integers(1, 64), share=st.floats(0.0, 1.2),
       theta=st.sampled_from([0.25, 0.5, 1.0]))
def test_uniform_plan_leaves_less_than_one_segment_unused(layers, experts, share, theta) -> None:
    """Every cached segment the budget holds beside the staging pool is placed (at most every expert), evenly: the
    layers' cache sizes differ by one at most."""
    shape = replace(MIXTRAL, num_layers=layers, num_experts=experts)
    slots = min_staging_slots(shape)
    budget = slots * shape.expert_bytes + int(share * shape.all_experts_bytes)
    plan = uniform_plan(shape, budget, theta)
    segment = shape.top_neurons(theta) * shape.neuron_bytes
    sizes = [lp.cache_size for lp in plan.layers]
    assert sum(sizes) == min((budget - slots * shape.expert_bytes) // segment, experts * layers)
    assert max(sizes) - min(sizes) <= 1 and max(sizes) <= experts and plan.total_bytes <= budget


@given(budget_mib=st.integers(1344, 200_000), theta=st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]))
def test_uniform_plan_never_exceeds_the_budget(budget_mib: int, theta: float) -> None:
    plan = uniform_plan(MIXTRAL, budget_mib * MiB, theta)
    assert plan.total_bytes <= budget_mib * MiB
    assert plan.staging_slots >= min_staging_slots(MIXTRAL)
    for lp in plan.layers:
        assert 0 <= lp.cache_size <= MIXTRAL.num_experts
        assert 0.0 <= lp.split <= 1.0


def test_prefetch_only_gives_the_whole_budget_to_staging() -> None:
    plan = uniform_plan(MIXTRAL, 3000 * MiB, theta=0.0)
    assert plan.staging_slots == 3000 // 336 and all(lp.cache_size == 0 for lp in plan.layers)


def test_resident_plan_holds_every_expert_whole() -> None:
    plan = resident_plan(MIXTRAL)
    assert all(lp.cache_size == 8 and lp.split == 1.0 for lp in plan.layers)
    assert plan.cache_bytes == MIXTRAL.all_experts_bytes


def test_whole_experts_spread_over_layers_when_a_layer_share_is_under_one_expert() -> None:
    # Mixtral at 6 GiB: V_e = 6144 − 1344 MiB; V_e / 32 = 150 MiB < one 336 MiB expert.
    from fmoe_cli.planning.plan import spread

    plan = uniform_plan(MIXTRAL, 6 * 1024 * MiB, theta=1.0)
    sizes = [lp.cache_size for lp in plan.layers]
    assert sum(sizes) == (6 * 1024 - 4 * 336) // 336 == 14  # every expert that fits is cached
    assert set(sizes) == {0, 1} and plan.total_bytes <= 6 * 1024 * MiB
    assert sizes == spread(14, 32) and sizes[:16].count(1) == 7  # evenly over depth
    assert uniform_plan(MIXTRAL, 12 * 1024 * MiB, theta=0.5).layers[0].cache_size == 2  # a share ≥ one: V_e / L


class FakeConfig:
    num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size = 32, 32, 8, 4096


class MlaConfig:  # DeepSeek-V3's attention: K of 128 + 64 dims and V of 128 per head, 128 heads, 61 layers
    num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size = 61, 128, 128, 7168
    qk_nope_head_dim, qk_rope_head_dim, v_head_dim = 128, 64, 128


def test_kv_cache_counts_mla_key_and_value_dims() -> None:
    """One formula for the run and the plan: MLA's K (nope + rope) and V dims, not hidden / heads twice."""
    from fmoe_cli.planning.plan import kv_cache_bytes

    assert kv_cache_bytes(MlaConfig(), 1, 2) == 61 * 128 * (128 + 64 + 128) * 2  # 4.8 MiB a token
    assert kv_cache_bytes(MlaConfig(), 10, 2) == 10 * kv_cache_bytes(MlaConfig(), 1, 2)


def test_budget_against_the_device_in_one_line_with_mib() -> None:
    from fmoe_cli.planning.plan import Room, check_budget_text, check_plan_fits, kv_cache_bytes, resolve_budget

    assert kv_cache_bytes(FakeConfig(), 4096, 2) == 2 * 32 * 8 * 128 * 2 * 4096  # Mixtral: 512 MiB at 4k tokens
    room = Room(free=12 * 1024 * MiB, non_expert=0, kv=512 * MiB, workspace=512 * MiB)
    assert room.bytes == 11 * 1024 * MiB
    assert resolve_budget("auto", MIXTRAL, room) == 11 * 1024 * MiB  # the default: what fits
    assert resolve_budget("6GiB", MIXTRAL, room) == 6 * 1024 * MiB
    with pytest.raises(FmoeError, match=r"^--vram-budget 21504 MiB does not fit on this device: it has 11264 MiB "
                                        r"\(free 12288 MiB − KV cache 512 MiB − workspace 512 MiB\)"):
        resolve_budget("25%", MIXTRAL, room)  # 25 % of Mixtral's experts: 21 GiB
    with pytest.raises(FmoeError, match=r"resident needs 86016 MiB for every expert on the device; this device has "
                                        r"11264 MiB"):
        check_plan_fits(resident_plan(MIXTRAL), room)
    check_plan_fits(uniform_plan(MIXTRAL, 6 * 1024 * MiB), room)
    tiny = Room(free=1024 * MiB, non_expert=0, kv=256 * MiB, workspace=512 * MiB)
    with pytest.raises(FmoeError, match=r"the staging pool needs 1344 MiB, the device has 256 MiB"):
        resolve_budget("auto", MIXTRAL, tiny)
    assert resolve_budget("auto", MIXTRAL, None) == MIXTRAL.all_experts_bytes // 4  # the CPU: 25 %
    assert resolve_budget(None, MIXTRAL, None) == 4 * 336 * MiB  # the staging pool alone
    with pytest.raises(FmoeError, match="cannot read the budget"):
        check_budget_text("lots")
    check_budget_text("auto")


def test_a_budget_that_does_not_fit_is_refused_before_a_weight_is_read(checkpoints, monkeypatch) -> None:
    from fmoe_cli.models import load
    from fmoe_cli.run import RunOptions, open_run

    def never(*args, **kwargs):
        raise AssertionError("the weights were read before the budget was checked")

    monkeypatch.setattr(load, "read_checkpoint", never)
    with pytest.raises(FmoeError, match=r"VRAM budget 0\.0 MiB is too small: the staging pool alone needs"):
        with open_run(RunOptions(model=str(checkpoints["mixtral"]), policies=("lru",), vram_budget="1KiB",
                                 device="cpu")):
            pass


@pytest.mark.parametrize("policy, fits_as_resident", [
    ("moepic", True), ("lru", True), ("lfu", True), ("cache-only", True),
    ("uniform", False), ("prefetch-only", False), ("ondemand", False)])
def test_a_budget_that_holds_every_expert_runs_a_caching_policy_as_resident(policy: str, fits_as_resident: bool) -> None:
    """A budget that holds every expert (`--vram-budget 100%`, or everything plus the staging pool) gives a caching
    policy the resident plan (no staging pool, no prefetch: planning/plan.py `resident_if_fits`), its source saying
    whose it is; its eviction stays. The policies that study a fixed split (uniform's θ 0.5) or loading (no cache) keep
    their plans (their table entries say so); so does every policy one byte short of every expert."""
    from fmoe_cli.planning.presets import make_settings
    from fmoe_cli.types import Timings

    timings = Timings(t_att=1e-4, t_moe=2e-4, t_head=1e-4, t_load=3e-4, top_k=2)
    everything = MIXTRAL.all_experts_bytes
    for fits in (everything, everything + min_staging_slots(MIXTRAL) * MIXTRAL.expert_bytes):
        settings = make_settings(policy, MIXTRAL, fits, timings=timings)
        assert settings.plan.resident == fits_as_resident and settings.eviction != ""
        if fits_as_resident:
            own = make_settings(policy, MIXTRAL, everything // 2, timings=timings).plan.source
            assert settings.plan == replace(resident_plan(MIXTRAL), source=f"{own}, every expert resident", prefetch=False)
            assert not settings.prefetch and settings.plan.summary().startswith(f"{own}, every expert resident: ")
    short = make_settings(policy, MIXTRAL, everything - 1, timings=timings)
    assert not short.plan.resident and short.plan.staging_slots > 0
