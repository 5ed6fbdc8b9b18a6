"""Offloading never changes the answer: every family × every policy × two budgets ×
two split ratios gives transformers' own greedy tokens, and logits within fp32
tolerance, on two links:
- `emulated`: the asynchronous emulated link (CudaLink's host semantics: wait() does not
  block, completion only by polling) on a virtual clock, moving real bytes into the
  staging slots (copy=True);
- `cuda`: CudaLink itself, the real CUDA code path with its pump thread, over a fake GPU
  that plays the copy stream chunk by chunk and leaves NaN in every destination until
  its chunk has been played (tests/fake_gpu.py): a read without the right wait, or a copy
  landing over a slot after its wait, shows up as NaN or wrong tokens. Its decode steps
  run as a GPU runs them: replayed from CUDA graph segments (generate.DecodeGraph) on
  tests/fake_graphs.py's recorder, which leaves garbage in what a capture computed until
  a replay writes it; a resident step is one segment, a loading plan's one more than its
  MoE layers (each cut runs the layer's experts eagerly). The eager step on the device's
  path (FMOE_CUDA_GRAPHS=0, a failed capture) is tests/test_decode_graph.py's.
The prompt activates more experts than the staging pool has slots, so prefill runs in waves."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

from fmoe_cli import kernels
from fmoe_cli.offload import layout

from fmoe_cli.generate import stream_generate
from fmoe_cli.models.demo import TINY_FAMILIES
from fmoe_cli.models.load import load_model
from fmoe_cli.models.token import LAYERS as TOKEN_LAYERS
from fmoe_cli.offload.engine import Engine
from fmoe_cli.offload.link import CudaLink, EmulatedLink, VirtualClock
from fmoe_cli.planning.plan import min_staging_slots
from fmoe_cli.planning.presets import PRESETS, make_settings
from fmoe_cli.types import Timings
import fake_gpu  # tests/fake_gpu.py
from fake_graphs import RecordedGraphs  # tests/fake_graphs.py

PROMPT = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11, 64, 128]])
# Not fewer: a cut reading the warm-up's routing weights (broken on purpose) first changed a token at 6 (qwen2_moe,
# deepseek_v2), 11 (qwen3_moe) and 14 (mixtral), and not within 32 in olmoe and deepseek_v3.
NEW_TOKENS = 32
SPLIT_POLICIES = {"uniform"}  # run at two θ; moepic's θ_i are the configurator's
# The configurator's inputs for `moepic` (T_load = 3 × T_exp, as MoEpic measured); no statistics: uniform routing.
TIMINGS = Timings(t_att=1e-4, t_moe=2e-4, t_head=1e-4, t_load=3e-4, top_k=2)


LINKS = ["emulated", "cuda"]
MOVED: set[int] = set()  # id() of the engines of the tests that moved bytes (family_setup's check on the fake GPU)


@pytest.fixture(scope="module", params=[(f, link) for f in TINY_FAMILIES for link in LINKS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def family_setup(request, checkpoints):
    family, link_kind = request.param
    if link_kind == "cuda":  # the device's code path: torch's matmuls (no C kernels), the engine's device side
        with fake_gpu.installed() as gpu, kernels.off():
            for setup in _family_setup(checkpoints[family], CudaLink(torch.device("cuda"), chunk_bytes=4096),
                                       device_side=True, graph_factory=RecordedGraphs):
                yield setup
            assert gpu.chunks_played == gpu.chunks_issued
            # copies were played wherever a test on this worker moved bytes (pytest-xdist may give a worker only
            # `resident` tests of a module: then nothing is copied)
            assert gpu.chunks_issued > 0 or id(setup[1]) not in MOVED
    else:
        yield from _family_setup(checkpoints[family], EmulatedLink(gbps=20, clock=VirtualClock(), copy=True))


def reference_answer(reference, prompt: torch.Tensor, new_tokens: int):
    """transformers' greedy answer: its token ids, the prompt and answer [1, P + N], and the logits over them."""
    want = reference.generate(prompt, max_new_tokens=new_tokens, do_sample=False)[0, prompt.shape[1]:].tolist()
    full_sequence = torch.cat([prompt, torch.tensor([want])], dim=1)
    with torch.no_grad():
        return want, full_sequence, reference(full_sequence).logits


def dequantizing(path) -> dict:
    """from_pretrained's arguments that load a block-scaled fp8 checkpoint dequantized, as fmoe reads it, also on an
    FP8 GPU (where transformers would otherwise compute in float8); none for any other checkpoint."""
    from fmoe_cli.models.config import fp8_block

    return {"quantization_config": transformers.FineGrainedFP8Config(dequantize=True)} \
        if fp8_block(path / "config.json") is not None else {}


@functools.cache
def transformers_answer(path) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """`reference_answer` of the checkpoint at `path` to PROMPT (once per process: both links compare with it)."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                  **dequantizing(path)).eval()
    # No EOS for the comparison: both sides generate exactly NEW_TOKENS greedy tokens
    # (min_new_tokens would mask EOS in the reference and change the argmax).
    reference.generation_config.eos_token_id = None
    return reference_answer(reference, PROMPT, NEW_TOKENS)


def _family_setup(path, link, device_side: bool = False, graph_factory=None):
    want, full_sequence, want_logits = transformers_answer(path)
    lm = load_model(str(path), device="cpu", dtype="float32")
    engine = Engine(lm.layers, lm.store, lm.shape, link, lm.device, lm.dtype)
    engine.device_side = device_side  # resident layers: routing used on the device (layout.routed_forward)
    engine.graph_factory = graph_factory  # decode steps replayed from graph segments (generate.DecodeGraph)
    engine.install(lm.model)
    yield lm, engine, want, full_sequence, want_logits
    engine.close()


def first_difference(got: list[int], want: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def check_segments(engine, layers: int, policy: str, routed: list) -> None:
    """The generation's decode steps ran as graph segments, captured once and replayed for every decode step: one
    segment for resident (every layer inside it, routed on the device: `routed` holds the two warm-up steps' and the
    capture's layers, none from a replay), else each MoE layer cuts the step (its experts run eagerly between
    segments)."""
    (graph,) = engine.decode_graphs.values()
    segments = 1 if policy == "resident" else layers + 1
    assert not graph.eager and graph.segments == RecordedGraphs.captured == segments, (policy, graph.segments)
    assert RecordedGraphs.replayed == (NEW_TOKENS - 1) * segments, policy
    if policy == "resident":
        assert graph.captured.graphed == [list(range(layers))] and len(routed) == 3 * layers
    else:
        assert [cut.layer for cut in graph.captured.breaks] == list(range(layers)), policy


def budgets(shape):
    """Tight: the staging pool plus one expert; loose: pool plus half of all experts."""
    pool = 2 * shape.top_k * shape.expert_bytes
    return {"tight": pool + shape.expert_bytes, "loose": pool + shape.all_experts_bytes // 2}


# Every policy at both budgets, but resident once: its plan holds every expert whatever the budget (the test checks
# that the loose budget's settings are the tight one's, so its row would run the same steps again).
CASES = [(budget, policy) for budget in ("tight", "loose") for policy in PRESETS
         if not (policy == "resident" and budget == "loose")]


@pytest.mark.parametrize("budget, policy", CASES)
def test_greedy_tokens_and_logits_match_transformers(family_setup, policy, budget, monkeypatch):
    lm, engine, want, full_sequence, want_logits = family_setup
    if policy == "resident":
        tight, loose = (make_settings(policy, lm.shape, b, timings=TIMINGS) for b in budgets(lm.shape).values())
        assert tight == loose
    routed = []  # the device path's resident decode layers (layout.routed_forward)
    real_routed = layout.routed_forward
    monkeypatch.setattr(layout, "routed_forward", lambda *args: routed.append(1) or real_routed(*args))
    thetas = [0.25, 0.5] if policy in SPLIT_POLICIES else [None]
    for theta in thetas:
        budget_bytes = budgets(lm.shape)[budget]
        timings = Timings(TIMINGS.t_att, TIMINGS.t_moe, TIMINGS.t_head, TIMINGS.t_load, lm.shape.top_k)
        engine.configure(make_settings(policy, lm.shape, budget_bytes, theta=theta, timings=timings))
        if budget == "tight" and policy != "resident":  # prefill in waves through the pool
            assert PROMPT.shape[1] * lm.shape.top_k > engine.settings.plan.staging_slots
        if PRESETS[policy].configured:  # the configurator's plan, within the budget, with the staging pool
            plan = engine.settings.plan
            assert plan.source == "configurator" and plan.total_bytes <= budget_bytes
            assert plan.staging_slots == min_staging_slots(lm.shape) and len(plan.layers) == lm.shape.num_layers
        token = getattr(lm.model, "decode_token", None)  # models/token.py
        runs = token.runs if token is not None else 0
        routed.clear()
        RecordedGraphs.reset()
        got = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine,
                                                   max_new_tokens=NEW_TOKENS, stop_on_eos=False)]
        assert got == want, f"{policy} θ={theta}: tokens differ from token {first_difference(got, want)}"
        if engine.graph_factory is not None:  # the device's decode steps: replayed graph segments
            check_segments(engine, lm.shape.num_layers, policy, routed)
        elif policy == "resident" and type(lm.model.model.layers[0]).__name__ in TOKEN_LAYERS:
            assert token.runs - runs == NEW_TOKENS - 1  # every decode token in one C call
        # The engine's cache is warm now; a prefill of the whole sequence (every expert
        # activated, in waves through the staging pool) must give the same logits.
        with torch.no_grad():
            logits = lm.model(full_sequence).logits
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
    counters = engine.counters()
    if counters.bytes_moved:
        MOVED.add(id(engine))
    if policy == "resident":
        assert counters.hit_rate == 1.0 and counters.bytes_moved == 0
    elif policy in ("ondemand", "prefetch-only"):
        assert counters.hits_full == counters.hits_top == 0
    if engine.settings.prefetch:  # prefetching settings really prefetch (moepic's plan may turn it off)
        assert counters.prefetch_issued > 0
    else:
        assert counters.prefetch_issued == 0


def test_split_really_splits(family_setup):
    """θ = 0.5 with room for every top: every activation after warm-up is a top hit plus a bottom load."""
    lm, engine, want, *_ = family_setup
    shape = lm.shape
    budget = 2 * shape.top_k * shape.expert_bytes + shape.all_experts_bytes // 2
    engine.configure(make_settings("uniform", shape, budget, theta=0.5))
    assert all(layer.cache_size == shape.num_experts for layer in engine.settings.plan.layers)
    got = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=8, stop_on_eos=False)]
    assert got == want[:8]
    MOVED.add(id(engine))
    c = engine.counters()
    assert c.hits_top > 0 and c.hits_full == 0
    assert c.bytes_demand + c.bytes_prefetch > 0
