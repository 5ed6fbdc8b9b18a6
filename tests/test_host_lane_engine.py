"""The engine's host lane (issue 24; offload/host.py: HostLane): with misses and bottoms computed on the host
(host and device both the CPU here), greedy tokens still equal transformers' generate, for every family, for
plans with every layer on the host (llama.cpp's pattern), split experts (top on the device, bottom on the host)
and layers alternating between the link and the host; with one and two host threads."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers

from fmoe_cli.generate import stream_generate
from fmoe_cli.models.demo import TINY_FAMILIES
from fmoe_cli.models.load import load_model
from fmoe_cli.offload.engine import Engine
from fmoe_cli.offload.link import CudaLink, EmulatedLink, VirtualClock
from fmoe_cli.planning.configurator import LLAMA_CPP, host_baselines
from fmoe_cli.planning.plan import uniform_plan
from fmoe_cli.types import EngineSettings
import fake_gpu  # tests/fake_gpu.py

PROMPT = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11, 64, 128]])
NEW_TOKENS = 24


def plans(shape):
    budget = 2 * shape.top_k * shape.expert_bytes + shape.all_experts_bytes // 2
    split = uniform_plan(shape, budget, 0.5)
    whole = uniform_plan(shape, budget, 1.0)
    return {
        "llama.cpp pattern": host_baselines(shape, budget)[LLAMA_CPP],
        "split, host bottoms": replace(split, layers=tuple(replace(layer, host=True) for layer in split.layers)),
        "alternating link / host": replace(whole, layers=tuple(replace(layer, host=i % 2 == 0)
                                                               for i, layer in enumerate(whole.layers))),
    }


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_greedy_tokens_with_the_host_lane_match_transformers(checkpoints, family):
    check_family(checkpoints[family], family, lambda: EmulatedLink(gbps=20, clock=VirtualClock(), copy=True))


def test_the_cache_fills_on_the_cuda_link_leave_no_half_written_slot(checkpoints):
    """CudaLink over the fake GPU, which leaves NaN in a destination until its chunk is played: a top read before
    its fill landed shows up as NaN or wrong tokens."""
    with fake_gpu.installed() as gpu:
        check_family(checkpoints["mixtral"], "mixtral", lambda: CudaLink(torch.device("cuda"), chunk_bytes=4096))
        assert gpu.chunks_played == gpu.chunks_issued > 0


def check_family(path, family, make_link):
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    want = reference.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)[0, PROMPT.shape[1]:].tolist()
    lm = load_model(str(path), device="cpu", dtype="float32")
    for threads in (1, 2):
        engine = Engine(lm.layers, lm.store, lm.shape, make_link(), lm.device, lm.dtype, host_threads=threads)
        engine.install(lm.model)
        try:
            for name, plan in plans(lm.shape).items():
                engine.configure(EngineSettings(name, plan, "lcp", True, 128.0, 0.25))
                got = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=NEW_TOKENS,
                                                           stop_on_eos=False)]
                assert got == want, f"{family} {name}, {threads} host threads: tokens differ"
                c = engine.counters()
                assert c.host_segments > 0 and c.host_s > 0
                if name == "split, host bottoms":  # tops on the device, bottoms on the host
                    assert c.hits_top > 0
                if name == "llama.cpp pattern":  # nothing cached: every decode expert on the host, nothing loaded in decode
                    assert c.hits_full == c.hits_top == 0
        finally:
            engine.close()
