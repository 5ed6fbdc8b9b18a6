"""Issue 37 §1: a loading layer's decode step on the device path computes its loaded whole experts by one grouped matmul
a projection over the staging pool's slots (offload/engine.py `_loaded_decode`, offload/pool.py `stacked_rows`), not
one segment forward per load. Run on the CPU on the device's code path (the engine's `device_side`, torch's matmuls,
the store's grouping on) with K = 8 (a Qwen3-30B-A3B-shaped router on a tiny checkpoint): the same greedy tokens and
logits as `resident` on the emulated link and on CudaLink over the NaN-filling fake GPU (tests/fake_gpu.py: a slot read
before its copy's wait, or released to the next copy before its readers, shows up as NaN), the same hits, loads and
prefetches as the one-by-one loop on the emulated link, and the grouped calls really made, one a layer where every
routed expert loads. Whether torch's grouped matmul on CUDA takes the pool's strided views (bf16 included) only a GPU
can confirm; a refusal is `store.segments_forward`'s: one line, those experts one by one, and the store's grouping off,
which sends every later step to the loop (a refusal on the CPU would be a bug and raises: taken here for a GPU's)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import fake_gpu  # tests/fake_gpu.py
from fmoe_cli import kernels
from fmoe_cli.generate import stream_generate
from fmoe_cli.models.load import load_model
from fmoe_cli.offload import layout
from fmoe_cli.offload.engine import Engine
from fmoe_cli.offload.link import CudaLink, EmulatedLink, VirtualClock
from fmoe_cli.offload.store import GROUP_FROM
from fmoe_cli.planning.presets import make_settings
from fmoe_cli.types import Timings

PROMPT = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11, 64, 128]])
NEW_TOKENS = 10
LOADING = ("lru", "lfu", "ondemand", "prefetch-only", "moepic", "uniform")  # uniform: θ = 0.5, every cached expert split
# what the engine's loads decide (not times): the same under the grouped decode and the one-by-one loop
COUNTED = ("activations", "hits_full", "hits_top", "misses", "bytes_demand", "bytes_prefetch", "prefetch_issued",
           "prefetch_used", "needed_loads", "prefetch_covered", "host_waits")


@pytest.fixture(scope="module")
def top8(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint routing K = 8 of 16 experts (the a3b model's K)."""
    from fmoe_cli.models.demo import build_random_moe

    return build_random_moe(tmp_path_factory.mktemp("top8") / "qwen3-top8", family="qwen3_moe", seed=1,
                            num_experts=16, num_experts_per_tok=8)


@contextlib.contextmanager
def device_path(link_kind: str):
    """torch's matmuls (the device's expert compute) and the link: CudaLink over the fake GPU, or the emulated link
    on a virtual clock moving real bytes into the staging slots."""
    real = kernels.library
    kernels.library = lambda: None
    try:
        if link_kind == "cuda":
            with fake_gpu.installed() as gpu:
                yield CudaLink(torch.device("cuda"), chunk_bytes=4096)
            assert gpu.chunks_played == gpu.chunks_issued > 0
        else:
            yield EmulatedLink(gbps=20, clock=VirtualClock(), copy=True)
    finally:
        kernels.library = real


def run(path, link, dtype: str, policies, grouping: bool = True, events: list | None = None):
    """Each policy's greedy tokens, each decode step's logits, its counters, the grouped calls it made over the
    staging pool's slots (`pooled`: their sizes) and its split experts' grouped tops and bottoms (`split`: ("tops" or
    "bottoms", size) in call order), on one engine on the device path; `events` gets a ("pooled", size) per pooled
    call."""
    lm = load_model(str(path), device="cpu", dtype=dtype)
    if hasattr(lm.model, "decode_token"):
        lm.model.decode_token.enabled = False
    lm.store.grouping = grouping
    shape = lm.shape
    engine = Engine(lm.layers, lm.store, shape, link, lm.device, lm.dtype)
    engine.device_side = True
    engine.install(lm.model)
    timings = Timings(t_att=1e-4, t_moe=2e-4, t_head=1e-4, t_load=3e-4, top_k=shape.top_k)
    budget = 2 * shape.top_k * shape.expert_bytes + shape.all_experts_bytes // 4  # a quarter of the experts cached
    logits, pooled, split, out = [], [], [], {}
    head = lm.model.get_output_embeddings().register_forward_hook(lambda m, a, y: logits.append(y[0, -1].clone()))
    real = {name: getattr(layout, name) for name in ("grouped_forward", "grouped_tops", "grouped_bottoms")}

    def grouped(x, segments, act):  # the calls over the pool's slots (a cache's whole experts have their own stack)
        if segments[0].stack is engine.pool.stacked_rows(lm.store)[0].stack:
            pooled.append(len(segments))
            if events is not None:
                events.append(("pooled", len(segments)))
        return real["grouped_forward"](x, segments, act)

    layout.grouped_forward = grouped
    layout.grouped_tops = lambda x, segments, *a: split.append(("tops", len(segments))) or real["grouped_tops"](
        x, segments, *a)
    layout.grouped_bottoms = lambda x, segments, *a: split.append(("bottoms", len(segments))) or real[
        "grouped_bottoms"](x, segments, *a)
    try:
        for policy in policies:
            engine.configure(make_settings(policy, shape, budget, timings=timings,
                                           theta=0.5 if policy == "uniform" else None))
            logits.clear(), pooled.clear(), split.clear()
            tokens = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=NEW_TOKENS,
                                                          stop_on_eos=False)]
            counters = engine.counters()
            out[policy] = {"tokens": tokens, "logits": torch.stack(logits[1:]), "pooled": list(pooled),
                           "split": list(split), "counted": {name: getattr(counters, name) for name in COUNTED}}
    finally:
        for name, function in real.items():
            setattr(layout, name, function)
        head.remove()
        engine.close()
    return out, shape


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("link", ["emulated", "cuda"])
def test_grouped_loads_give_the_resident_tokens(top8, link, dtype):
    """Every loading policy: `resident`'s greedy tokens (float32: its decode logits to float rounding, the grouped
    and one-by-one products differing only there), with its loaded whole experts grouped over the pool's slots —
    `ondemand` loads every routed expert whole: exactly one grouped call of K a decode layer — and a layer's split
    experts' tops grouped over its cache, then their bottoms, as many, over the pool's rows [k, I)."""
    with device_path(link) as made:
        got, shape = run(top8, made, dtype, ("resident", *LOADING))
    want = got.pop("resident")
    for policy, result in got.items():
        assert result["tokens"] == want["tokens"], policy
        if dtype == "float32":
            torch.testing.assert_close(result["logits"], want["logits"], atol=1e-4, rtol=1e-4, msg=policy)
        assert result["counted"]["misses"] > 0, policy  # it really loaded
        assert result["pooled"] and min(result["pooled"]) >= GROUP_FROM, policy
        if result["counted"]["hits_top"]:  # split experts: each layer's grouped tops, then as many bottoms grouped
            calls = result["split"]
            assert calls and calls[0::2] == [("tops", n) for _, n in calls[1::2]], (policy, calls)
            assert all(what == "bottoms" and n >= GROUP_FROM for what, n in calls[1::2]), (policy, calls)
    assert got["ondemand"]["pooled"] == [shape.top_k] * (NEW_TOKENS - 1) * shape.num_layers
    assert got["uniform"]["counted"]["hits_top"] and got["moepic"]["counted"]["hits_top"]  # the split path ran


def test_grouped_loads_keep_the_loops_loads_and_admissions(top8):
    """On the emulated link (a virtual clock) the grouped decode makes the same hits, loads, admissions and
    prefetches as the one-by-one loop it replaces (the store's grouping off), and the same tokens."""
    with device_path("emulated") as made:
        grouped, _ = run(top8, made, "float32", LOADING)
    with device_path("emulated") as made:
        loop, _ = run(top8, made, "float32", LOADING, grouping=False)
    for policy in LOADING:
        assert grouped[policy]["pooled"] and not loop[policy]["pooled"], policy
        assert grouped[policy]["tokens"] == loop[policy]["tokens"], policy
        assert grouped[policy]["counted"] == loop[policy]["counted"], policy


def test_the_prediction_is_queued_before_the_grouped_call(top8, monkeypatch):
    """As in the loop, the layer's prediction (its prefetches) is queued once every demand load is, before the loads
    are computed, so that the link moves the prefetches while the device computes: with `prefetch-only` each grouped
    call over the pool's slots comes right after its layer's prediction."""
    events = []
    real_prefetch = Engine._prefetch
    monkeypatch.setattr(Engine, "_prefetch", lambda self, i, *a: events.append(("prefetch", i)) or
                        real_prefetch(self, i, *a))
    with device_path("emulated") as made:
        got, _ = run(top8, made, "float32", ("prefetch-only",), events=events)
    assert got["prefetch-only"]["pooled"]
    pooled = [n for n, event in enumerate(events) if event[0] == "pooled"]
    assert len(pooled) == len(got["prefetch-only"]["pooled"])
    assert all(events[n - 1][0] == "prefetch" for n in pooled), events


@pytest.mark.parametrize("refused", ["grouped_forward", "grouped_tops", "grouped_bottoms"])
def test_a_refused_grouped_matmul_falls_back_one_by_one_with_one_line(top8, monkeypatch, capsys, refused):
    """torch's grouped matmul refusing the pool's or the cache's views on a GPU (a card, dtype or stride its checks do
    not take, found at the first call; taken here for a GPU's: `HostStore.may_refuse`): one line, those experts one
    by one (a top begun in a group continued alone: layout.bottom_alone), the store's grouping off from then on, and
    the tokens of the run that never grouped."""
    from fmoe_cli.offload.store import HostStore

    with device_path("emulated") as made:
        want, _ = run(top8, made, "float32", ("uniform", "ondemand"), grouping=False)
    capsys.readouterr()
    monkeypatch.setattr(HostStore, "may_refuse", staticmethod(lambda x: True))
    calls = []

    def refusing(*args):
        calls.append(1)
        raise RuntimeError("grouped gemm: this card, dtype or stride is not supported")

    if refused == "grouped_bottoms":  # the tops grouped first: their bottoms continue them one by one
        monkeypatch.setattr(layout, "grouped_bottoms", refusing)
    else:
        monkeypatch.setattr(layout, refused, refusing)
    with device_path("emulated") as made:
        got, _ = run(top8, made, "float32", ("uniform", "ondemand"))
    assert calls == [1]  # refused once, then never asked again
    for policy in ("uniform", "ondemand"):
        assert got[policy]["tokens"] == want[policy]["tokens"], policy
        torch.testing.assert_close(got[policy]["logits"], want[policy]["logits"], atol=1e-4, rtol=1e-4)
    err = capsys.readouterr().err
    assert err.count("grouped matmul does not run here") == 1 and err.count("\n") == 1, err
