"""int8 / int4 / int2 experts: the quantiser's layout (every neuron carries its own scales, so
any split is one segment), its error, the byte sizes plans use, and the exactness
contract: greedy tokens equal transformers' generate on the same checkpoint with its
experts replaced by the dequantised weights, for every family and policy."""

from __future__ import annotations

import pytest
import torch
import transformers

from fmoe_cli.generate import stream_generate
from fmoe_cli.models.demo import TINY_FAMILIES
from fmoe_cli.models.load import load_model
from fmoe_cli.offload.engine import Engine
from fmoe_cli.offload.layout import DOWN, GATE, UP, segment_forward
from fmoe_cli.offload.link import EmulatedLink
from fmoe_cli.planning.presets import PRESETS, make_settings
from fmoe_cli.offload.quant import dequantize, quantize
from fmoe_cli.planning.plan import uniform_plan
from fmoe_cli.types import EXPERT_FORMATS, ExpertShape, Timings
from test_exactness import reference_answer

PROMPT = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11, 64, 128]])
NEW_TOKENS = 24
QUANT = ["int8", "int4", "int2"]


@pytest.mark.parametrize("name", QUANT)
def test_every_neuron_carries_its_scales(name):
    """Quantising a bottom segment alone gives the same bytes as the bottom of the whole expert:
    a split [0, k) / [k, I) is one contiguous segment with its scales."""
    fmt = EXPERT_FORMATS[name]
    torch.manual_seed(0)
    block = torch.randn(96, 3, 256) * torch.logspace(-3, 0, 96)[:, None, None]  # neurons of very different scale
    whole = quantize(block, fmt)
    for k in (1, 17, 64):
        assert torch.equal(whole[k:], quantize(block[k:], fmt))
        assert torch.equal(dequantize(whole[k:], fmt, 256, torch.float32), dequantize(whole, fmt, 256, torch.float32)[k:])
    assert whole.shape == (96, 3, fmt.projection_bytes(256)) and whole.dtype == torch.uint8


@pytest.mark.parametrize("name, max_error", [("int8", 0.5 / 127), ("int4", 0.5 / 15)])
def test_error_is_within_half_a_step_per_group(name, max_error):
    fmt = EXPERT_FORMATS[name]
    torch.manual_seed(1)
    block = torch.randn(32, 3, 512)
    back = dequantize(quantize(block, fmt), fmt, 512, torch.float32)
    groups = block.reshape(32, 3, -1, fmt.group_size(512))
    span = groups.abs().amax(-1) if fmt.bits == 8 else groups.amax(-1) - groups.amin(-1)
    error = (back - block).abs().reshape(groups.shape).amax(-1)
    assert (error <= span * max_error * 1.01 + 1e-3 * span).all()  # half a step (+ float16 scale rounding)
    assert error.mean() > 0  # really quantised


def test_segment_forward_splits_exactly():
    """Top + bottom of a quantised expert = the whole quantised expert (the engine's split stays exact)."""
    fmt = EXPERT_FORMATS["int4"]
    torch.manual_seed(2)
    q = quantize(torch.randn(64, 3, 128) * 0.05, fmt)
    x = torch.randn(5, 128)
    act = torch.nn.functional.silu
    w = dequantize(q, fmt, 128, torch.float32)
    whole = segment_forward(x, w, act)
    split = segment_forward(x, dequantize(q[:16], fmt, 128, torch.float32), act) + \
        segment_forward(x, dequantize(q[16:], fmt, 128, torch.float32), act)
    torch.testing.assert_close(split, whole)


def test_plans_cache_more_quantised_experts_in_the_same_budget():
    mixtral = dict(num_layers=32, num_experts=8, top_k=2, hidden=4096, intermediate=14336, dtype_bytes=2)
    sizes = {name: ExpertShape(**mixtral, experts=name).expert_bytes for name in EXPERT_FORMATS}
    assert sizes["bf16"] == 14336 * 3 * 4096 * 2
    assert 3.5 < sizes["bf16"] / sizes["int4"] < 3.6 and 1.9 < sizes["bf16"] / sizes["int8"] < 2.0
    qwen3_30b = dict(num_layers=48, num_experts=128, top_k=8, hidden=2048, intermediate=768, dtype_bytes=2)
    budget = 8 * 2**30
    cached = {name: sum(layer.cache_size for layer in
                        uniform_plan(ExpertShape(**qwen3_30b, experts=name), budget, theta=1.0).layers)
              for name in EXPERT_FORMATS}
    assert cached["int4"] >= 3.4 * cached["bf16"] and cached["int8"] >= 1.9 * cached["bf16"], cached


@pytest.fixture(scope="module", params=[(f, q) for f in TINY_FAMILIES for q in QUANT], ids=lambda p: f"{p[0]}-{p[1]}")
def quant_setup(request, checkpoints):
    family, experts = request.param
    path = checkpoints[family]
    lm = load_model(str(path), device="cpu", dtype="float32", experts=experts, dense="bf16")  # dense as stored
    assert lm.store.dtype == torch.uint8 and lm.shape.experts == experts
    # The reference: transformers' own model with its experts replaced by the dequantised weights.
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    from fmoe_cli.models.families import find_moe_layers

    for layer in find_moe_layers(reference, family):
        w = lm.store.dequantized(layer.index)  # [N, I, 3, H]
        with torch.no_grad():
            original = layer.experts.gate_up_proj.clone()
            layer.experts.gate_up_proj.copy_(torch.cat([w[:, :, GATE], w[:, :, UP]], dim=1))
            layer.experts.down_proj.copy_(w[:, :, DOWN].transpose(1, 2))
        assert not torch.equal(original, layer.experts.gate_up_proj)  # the weights really changed
    reference.generation_config.eos_token_id = None
    want, full_sequence, want_logits = reference_answer(reference, PROMPT, NEW_TOKENS)
    engine = Engine(lm.layers, lm.store, lm.shape, EmulatedLink(gbps=20), lm.device, lm.dtype)
    engine.install(lm.model)
    yield lm, engine, want, full_sequence, want_logits
    engine.close()


@pytest.mark.parametrize("policy", list(PRESETS))
def test_quantised_tokens_match_transformers_with_dequantised_experts(quant_setup, policy):
    lm, engine, want, full_sequence, want_logits = quant_setup
    shape = lm.shape
    budget = 2 * shape.top_k * shape.expert_bytes + shape.all_experts_bytes // 3
    for theta in ([0.25, 0.5] if policy == "uniform" else [None]):
        timings = Timings(t_att=1e-4, t_moe=2e-4, t_head=1e-4, t_load=3e-4, top_k=shape.top_k)  # as test_exactness
        engine.configure(make_settings(policy, shape, budget, theta=theta, timings=timings))
        got = [e.token_id for e in stream_generate(lm.model, PROMPT, engine=engine, max_new_tokens=NEW_TOKENS,
                                                   stop_on_eos=False)]
        assert got == want, f"{policy} θ={theta}: tokens differ"
        with torch.no_grad():  # a prefill of the whole sequence: every expert, in waves through the pool
            logits = lm.model(full_sequence).logits
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
    c = engine.counters()
    if policy not in ("resident",):
        # quantised bytes on the link: every load is a whole number of quantised neuron rows
        assert c.bytes_moved > 0 and c.bytes_moved % shape.neuron_bytes == 0


def test_plan_says_what_each_format_needs_and_caches_more_int4(checkpoints):
    import json

    from test_cli_errors import run

    path = str(checkpoints["mixtral"])
    reports = {}
    for fmt in EXPERT_FORMATS:
        result, text = run("plan", path, "--vram", "1700KiB", "--workspace", "1MiB", "--context", "0",
                           "--experts", fmt, "--dtype", "float32", "--json")
        assert result.exit_code == 0, text
        reports[fmt] = json.loads(result.stdout)
    host = reports["int4"]["host"]
    assert host["chosen"] == "int4" and host["free"] > 0
    shape = ExpertShape(4, 8, 2, 64, 64, 4)  # the tiny mixtral in float32 (--dtype float32)
    for fmt, entry in host["formats"].items():
        assert entry["experts"] == replace_format(shape, fmt).all_experts_bytes
        assert entry["needed"] == entry["experts"] + entry["non_expert"]
    assert reports["int4"]["shape"]["expert_bytes"] == replace_format(shape, "int4").expert_bytes
    # the VRAM plan spends the same budget on the chosen format's experts
    cached = {fmt: r["totals"]["cached_experts"] for fmt, r in reports.items()}
    assert cached["int8"] >= 2 * cached["bf16"] > 0
    assert cached["int4"] >= min(3.4 * cached["bf16"], 4 * 8) and cached["int4"] > cached["int8"]
    result, text = run("plan", path, "--vram", "1700KiB", "--workspace", "1MiB", "--context", "0", "--experts", "int4")
    assert "host RAM to load" in text and "int4" in text


def replace_format(shape, fmt):
    from dataclasses import replace

    return replace(shape, experts=fmt)


def test_a_model_that_does_not_fit_in_host_ram_is_refused_before_loading(checkpoints, monkeypatch):
    from test_cli_errors import assert_one_line_error, run

    import fmoe_cli.models.load as load
    import fmoe_cli.models.room as room

    monkeypatch.setattr(room, "host_ram_free", lambda: 100_000)
    monkeypatch.setattr(load, "read_checkpoint", lambda *a, **k: pytest.fail("read weights before refusing"))
    result, text = run("bench", str(checkpoints["mixtral"]), "--tokens", "2", "--experts", "bf16")
    assert_one_line_error(result, text, "host RAM", "--experts bf16", "free here")


@pytest.mark.parametrize("asked, device, experts, int8_dots, runs", [
    ("auto", "cpu", "int4", True, "int8"), ("auto", "cpu", "int8", True, "int8"),  # llama.cpp's Q4_0 / Q8_0 way
    ("auto", "cpu", "int2", True, "float"),  # HQQ rows have no integer dots
    ("auto", "cpu", "bf16", True, "float"),  # nothing quantised to dot
    ("auto", "cuda", "int4", True, "float"),  # the GPU computes with torch: the kernels are the CPU's
    ("auto", "cpu", "int4", False, "float"),  # no AVX2: the float dots, and the label says so
    ("float", "cpu", "int4", True, "float"), ("int8", "cpu", "int8", True, "int8"),  # asked: as asked
])
def test_activations_left_out_are_int8_beside_int8_and_int4_experts_on_the_cpu(asked, device, experts, int8_dots, runs):
    from fmoe_cli.types import resolve_activations

    assert resolve_activations(asked, device, experts, int8_dots) == runs


def test_a_load_resolves_auto_activations_and_its_store_computes_so(checkpoints, tmp_path, monkeypatch):
    """load_model(activations="auto"), as the CLI passes it: the model, its store and its dense rows compute in
    the resolved mode (int8 beside int4 experts with AVX2); left out, load_model keeps the exact float path (the
    exactness tests against transformers load so)."""
    from fmoe_cli.models.dense import QuantLinear
    from fmoe_cli.models.load import has_int8_dots

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = str(checkpoints["qwen3_moe"])
    for asked, want in (("auto", "int8" if has_int8_dots() else "float"), (None, "float")):
        lm = load_model(path, device="cpu", dtype="float32", experts="int4",
                        **({} if asked is None else {"activations": asked}))
        assert lm.activations == want and lm.store.kernel.int8_activations == (want == "int8")
        dense = [m for m in lm.model.modules() if isinstance(m, QuantLinear)]
        assert dense and all(m.kernel.int8_activations == (want == "int8") for m in dense)


def test_bench_and_chat_run_with_int4_experts(checkpoints):
    import json

    from fmoe_cli.models.load import has_int8_dots

    from test_cli_errors import run

    path = str(checkpoints["olmoe"])
    result, text = run("bench", path, "--experts", "int4", "--tokens", "3", "--warmup", "0", "--policy", "lru",
                       "--json")
    assert result.exit_code == 0, text
    report = json.loads(result.stdout)
    assert report["experts"] == "int4" and report["dense"] == "int4"  # --dense left out: int4 on the CPU beside int4
    # --activations left out: int8 on the CPU beside int4 experts where the kernels have AVX2's integer dots
    assert report["activations"] == ("int8" if has_int8_dots() else "float")
    shape = ExpertShape(4, 8, 2, 64, 64, 4, experts="int4")
    assert report["runs"][0]["bytes_per_token"] % shape.neuron_bytes == 0  # the link moves int4 rows
    result, text = run("chat", path, "--experts", "int8", "--temperature", "0", input="hello\n/exit\n")
    assert result.exit_code == 0, text
    assert f"int8 experts, int8 dense, {'int8' if has_int8_dots() else 'float'} activations" in text
    # the table's header and formats line say which mode ran, either way
    for activations in ("int8", "float"):
        result, text = run("bench", path, "--experts", "int4", "--activations", activations, "--tokens", "2",
                           "--warmup", "0", "--policy", "resident")
        assert result.exit_code == 0, text
        assert f"int4 experts, int4 dense, {activations} activations" in text
        assert f"activations {activations}" in " ".join(text.split())
    result, text = run("bench", path, "--experts", "fp4", "--tokens", "2")
    assert result.exit_code == 2 and text.startswith("error:") and "fp4" in text


class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of the tensors ops allocate (not views, not in-place results) while they are alive; the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        fresh = all(r.alias_info is None for r in func._schema.returns)
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if fresh and isinstance(t, torch.Tensor):
                nbytes = t.numel() * t.element_size()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, nbytes)
        return out

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


@pytest.mark.parametrize("experts", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_mixtral_shaped_quantised_forward_stays_within_its_workspace(experts, dtype):
    """Issue 20 §3: one Mixtral-shaped expert (H 4096, I 14336) computed from its quantised rows allocates at
    most DEQUANT_WORKSPACE_BYTES (64 MiB, counted in the device budget) at its peak, workspace included,
    not the 1 GiB of a whole expert dequantised to float32 then converted. Measured on the meta device."""
    import torch.nn.functional as F

    from fmoe_cli.offload.quant import DEQUANT_WORKSPACE_BYTES, QuantStore
    from fmoe_cli.types import ExpertShape, MiB

    shape = ExpertShape(32, 8, 2, 4096, 14336, dtype.itemsize, experts)
    store = QuantStore(shape, dtype, pin=False)
    segment = torch.empty(shape.intermediate, *store.row_shape, dtype=torch.uint8, device="meta")
    x = torch.empty(1, shape.hidden, dtype=dtype, device="meta")
    for _ in range(2):  # the first call allocates the workspace, the second reuses it
        with LiveBytes() as mode:
            out = store.segment_forward(x, segment, F.silu)
        assert out.shape == (1, shape.hidden)
        assert mode.peak <= DEQUANT_WORKSPACE_BYTES + MiB, f"{mode.peak / MiB:.0f} MiB"


@pytest.mark.parametrize("experts", ["int8", "int4"])
def test_a_segment_computed_in_neuron_blocks_sums_to_the_whole(monkeypatch, experts):
    """The blocks partition the neurons: their partial sums give the segment's output (to float rounding)."""
    import torch.nn.functional as F

    from fmoe_cli.offload import quant
    from fmoe_cli.types import EXPERT_FORMATS, ExpertShape

    shape = ExpertShape(1, 2, 1, 64, 96, 2, experts)
    assert shape.down_by_neuron  # blocks of whole down groups: 64 and 32 neurons
    store = quant.QuantStore(shape, torch.bfloat16, pin=False)
    g = torch.Generator().manual_seed(0)
    segment = quant.quantize(torch.randn(96, 3, 64, generator=g) * 0.1, EXPERT_FORMATS[experts], True)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    whole = segment_forward(x, quant.dequantize(segment, store.format, 64, torch.bfloat16, down_by_neuron=True),
                            F.silu)
    monkeypatch.setattr(quant, "block_rows", lambda hidden, dtype, down_group: 64)  # 2 blocks, the last one short
    calls = []
    real = quant.dequantize
    monkeypatch.setattr(quant, "dequantize", lambda seg, *a, **k: calls.append(seg.shape[0]) or real(seg, *a, **k))
    blocked = store.torch_forward(x, segment, F.silu)  # torch's path (a GPU's; the CPU's without the kernels)
    assert calls == [64, 32]
    torch.testing.assert_close(blocked, whole, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("experts", ["int8", "int4"])
@pytest.mark.parametrize("hidden", [2048, 256, 64])
def test_down_rows_grouped_along_the_neurons_hold_what_the_docs_say(experts, hidden):
    """offload/quant.py quantize_down (docs/quantization.md § Layout): tiles of G/32 hidden values × 32 neurons, each
    quantised alone (int8: its largest |w| is ±127·s; every weight within s/2 of ŵ), the codes at the documented
    bytes of the documented rows (what experts.c reads), the metadata after them; dequantize_down inverts it."""
    from fmoe_cli.offload.quant import dequantize_down, quantize_down
    from fmoe_cli.types import DOWN_GROUP

    fmt = EXPERT_FORMATS[experts]
    g = torch.Generator().manual_seed(7)
    down = torch.randn(64, hidden, generator=g) * torch.rand(64, 1, generator=g)  # neurons of different scales
    rows = quantize_down(down, fmt)
    assert rows.shape == (64, fmt.projection_bytes(hidden))
    w = dequantize_down(rows, fmt, hidden)
    hp, tile = hidden // DOWN_GROUP, fmt.group_size(hidden) // DOWN_GROUP
    width = next(b for b in (16, 8, 4, 2, 1) if hp % b == 0)
    code_bytes = hidden * fmt.bits // 8
    for n, h in [(0, 0), (5, hidden - 1), (37, hidden // 3), (63, 17 % hidden), (16, 1), (47, hidden // 2 + 1)]:
        group, neuron, piece, i = n // DOWN_GROUP, n % DOWN_GROUP, h // hp, h % hp
        row = rows[group * DOWN_GROUP + piece]
        b, k, j, ii = i // width, neuron % 16 // 4 if experts == "int4" else neuron // 4, neuron % 4, i % width
        meta = row[code_bytes:].view(torch.float16).float()
        if experts == "int8":
            at = ((b * 8 + k) * width + ii) * 4 + j
            q = int(row[at:at + 1].view(torch.int8))
            want = q * meta[i // tile]
        else:
            byte = int(row[((b * 4 + k) * width + ii) * 4 + j])
            q = byte & 15 if neuron < 16 else byte >> 4
            want = q * meta[2 * (i // tile)] + meta[2 * (i // tile) + 1]
        assert w[n, h].item() == pytest.approx(want.item(), rel=1e-6, abs=1e-7), (n, h)
    # each tile alone: R hidden values × 32 neurons
    tiles = down.reshape(2, DOWN_GROUP, DOWN_GROUP, hp // tile, tile).permute(0, 2, 3, 1, 4).reshape(2, DOWN_GROUP, hp // tile, -1)
    errors = (w - down).reshape(2, DOWN_GROUP, DOWN_GROUP, hp // tile, tile).permute(0, 2, 3, 1, 4).reshape(tiles.shape)
    if experts == "int8":
        s = tiles.abs().amax(-1) / 127
    else:
        s = (tiles.amax(-1) - tiles.amin(-1)) / 15
    assert (errors.abs().amax(-1) <= s * 0.5 * 1.01 + 1e-6).all()
    assert (errors.abs().amax(-1) > 0).any()


def test_each_thread_dequantises_into_its_own_workspace():
    """The host lane's workers dequantise blocks at once (torch's path: no kernels): one workspace each, or two of
    them write the same buffer and the host's partial sums are wrong; one thread reuses its own."""
    import threading
    import types

    from fmoe_cli.offload.quant import QuantStore

    store = types.SimpleNamespace(_workspace={})
    pointers = []

    def take() -> None:
        float32, bf16 = QuantStore._workspaces(store, torch.device("cpu"), torch.bfloat16, 1024)
        pointers.append((float32.data_ptr(), bf16.data_ptr()))

    take()
    worker = threading.Thread(target=take)
    worker.start()
    worker.join()
    take()
    assert pointers[0] == pointers[2] and not set(pointers[0]) & set(pointers[1])
