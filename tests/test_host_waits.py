"""Issue 37 §1: on a GPU the host waits for the device at most once per MoE layer of a decode step (the routing and the
predictor's scores read back together, `link.read_to_host`), and not at all in a layer whose routed experts are all
resident (`Engine._resident_device_decode`: routing used on the device, bookkeeping deferred to the token's end).

Counted, not timed, on the device's code path run on the CPU: the engine's `device_side`, torch's matmuls (no C
kernels), CudaLink over the fake GPU that leaves NaN in every unfinished copy (tests/fake_gpu.py); every tensor that
would be on the GPU is marked, and a host read of one is a wait (profiling/ops.py `count_host_waits`)."""

from __future__ import annotations

import pytest
import torch

import fake_gpu  # tests/fake_gpu.py
from fmoe_cli.generate import stream_generate
from fmoe_cli.models.load import load_model
from fmoe_cli.offload.engine import Engine
from fmoe_cli.offload.link import CudaLink
from fmoe_cli.planning.presets import make_settings
from fmoe_cli.profiling.ops import count_host_waits

PROMPT = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11, 64, 128]])
POLICIES = {"resident": None, "lru": None, "uniform": 0.5, "ondemand": None, "prefetch-only": None}


def run_device_path(path, policy: str, tokens: int = 6, count_from: int = 3):
    """Greedy tokens of `policy` on the device path over the fake GPU, and the host waits of decode steps
    count_from.. (counted per step)."""
    from fmoe_cli import kernels

    real_library = kernels.library
    kernels.library = lambda: None  # torch's matmuls: the device's expert compute
    try:
        with fake_gpu.installed():
            lm = load_model(str(path), device="cpu", dtype="float32")
            if hasattr(lm.model, "decode_token"):
                lm.model.decode_token.enabled = False  # the CPU's one-call token is not the device's path
            shape = lm.shape
            engine = Engine(lm.layers, lm.store, shape, CudaLink(torch.device("cuda"), chunk_bytes=4096), lm.device,
                            lm.dtype)
            engine.device_side = True
            engine.install(lm.model)
            budget = 2 * shape.top_k * shape.expert_bytes + shape.all_experts_bytes // 2
            engine.configure(make_settings(policy, shape, budget, theta=POLICIES[policy]))
            steps = stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=tokens, stop_on_eos=False)
            got = [next(steps).token_id for _ in range(count_from)]
            counts = []
            for _ in range(tokens - count_from):
                box = []
                counts.append(count_host_waits(lambda: box.append(next(steps)), engine, lm.model))
                got.append(box[0].token_id)
            totals = engine.counters()
            engine.close()
    finally:
        kernels.library = real_library
    return got, counts, shape, totals


@pytest.fixture(scope="module")
def resident_tokens(checkpoints):
    return run_device_path(checkpoints["qwen3_moe"], "resident")[0]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_at_most_one_host_wait_per_moe_layer(checkpoints, resident_tokens, policy):
    got, counts, shape, totals = run_device_path(checkpoints["qwen3_moe"], policy)
    assert got == resident_tokens
    for count in counts:
        assert count["moe_layers"] == shape.num_layers, count
        moe_waits = count["waits"].get("moe", 0)
        if policy == "resident":
            assert moe_waits == 0, count["where"]
            assert count["waits"].get("settle", 0) == 0, count["where"]  # the copies were done by the token's end
        else:
            assert moe_waits <= shape.num_layers, count["where"]
            assert {w for w in count["where"] if w.startswith("moe:")} == {"moe:read_to_host"}, count["where"]
        # outside the experts: the sampled token's one read (attention, norms and head read nothing back)
        assert count["where"].get("other:__int__") == count["waits"]["other"] == 1, count["where"]
    if policy == "resident":
        # the prefill's one read a layer (it takes the general path), none in decode; the bookkeeping was done
        assert totals.host_waits == shape.num_layers and totals.hits_full == totals.activations > 0
    else:
        assert totals.host_waits > 0
