"""Streamed loading: every family, in the hub's per-expert layout, the fused layout and
sharded with an index, loads into exactly the weights transformers' from_pretrained
gives, without ever building the experts in the model; a bad weight file is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from safetensors.torch import save_file

from fmoe_cli.models.demo import TINY_FAMILIES, build_random_moe
from fmoe_cli.models.families import find_moe_layers
from fmoe_cli.models.load import load_model
from fmoe_cli.offload.layout import pack_experts
from test_cli_errors import assert_one_line_error, run


def save_fused(reference, path, shards: int = 1) -> None:
    """The checkpoint as transformers 5 holds it in memory (fused [N, 2I, H] experts), optionally sharded."""
    path.mkdir(parents=True)
    reference.config.save_pretrained(path)
    state = {k: v.contiguous() for k, v in reference.state_dict().items() if k != "lm_head.weight"
             or not reference.config.tie_word_embeddings}
    keys = sorted(state)
    if shards == 1:
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in keys[s::shards]}
        save_file(part, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module", params=list(TINY_FAMILIES))
def family(request, checkpoints, tmp_path_factory):
    hub = checkpoints[request.param]
    reference = transformers.AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp(f"layouts-{request.param}")
    save_fused(reference, root / "fused")
    save_fused(reference, root / "sharded", shards=3)
    return request.param, reference, {"hub": hub, "fused": root / "fused", "sharded": root / "sharded"}


@pytest.mark.parametrize("layout", ["hub", "fused", "sharded"])
def test_loads_the_weights_transformers_loads(family, layout):
    name, reference, paths = family
    if layout == "hub":  # the tiny checkpoints really are in the hub's per-expert layout (Gemma 4's hub layout: fused)
        from safetensors import safe_open

        keys = list(safe_open(str(paths["hub"] / "model.safetensors"), "pt").keys())
        per_expert = any(".experts.3." in k for k in keys) and not any(k.endswith("gate_up_proj") for k in keys)
        assert per_expert == (name != "gemma4_text")
    lm = load_model(str(paths[layout]), device="cpu", dtype="float32")
    want_layers = find_moe_layers(reference, name)
    assert len(lm.store.layers) == len(want_layers)
    for got, want in zip(lm.store.layers, want_layers):
        torch.testing.assert_close(got, pack_experts(want.experts), atol=0, rtol=0)
    expert_params = {f"{layer.name}.{p}" for layer in want_layers for p in ("gate_up_proj", "down_proj")}
    got_state = lm.model.state_dict()
    for key, value in reference.state_dict().items():
        if key in expert_params:
            assert got_state[key].numel() == 0, f"{key}: the model holds the experts"
            continue
        torch.testing.assert_close(got_state[key], value, atol=0, rtol=0, msg=key)
    for key, value in reference.named_buffers():
        torch.testing.assert_close(dict(lm.model.named_buffers())[key], value, atol=0, rtol=0, msg=key)
    if reference.config.tie_word_embeddings:
        assert lm.model.lm_head.weight is lm.model.get_input_embeddings().weight


def test_bfloat16_keeps_what_transformers_keeps_in_float32(checkpoints):
    path = checkpoints["deepseek_v3"]  # its router's correction bias stays float32 (_keep_in_fp32_modules_strict)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    lm = load_model(str(path), device="cpu", dtype="bfloat16")
    got = dict(lm.model.named_parameters())
    for key, value in reference.named_parameters():
        if key in got and got[key].numel():
            assert got[key].dtype == value.dtype, key
            torch.testing.assert_close(got[key], value, atol=0, rtol=0, msg=key)
    assert lm.store.layers[0].dtype == torch.bfloat16


def test_missing_expert_is_refused(checkpoints, tmp_path):
    from safetensors.torch import load_file

    src = checkpoints["qwen3_moe"]
    state = load_file(str(src / "model.safetensors"))
    del state["model.layers.2.mlp.experts.5.up_proj.weight"]
    (tmp_path / "m").mkdir()
    save_file(state, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "m" / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(Exception, match="expert 5 of model.layers.2.mlp.experts"):
        load_model(str(tmp_path / "m"), device="cpu", dtype="float32")


PEAK_SCRIPT = textwrap.dedent("""
    import sys, torch, transformers
    from rich.console import Console
    from fmoe_cli.models.load import build_skeleton, load_model
    from fmoe_cli.profiling.memory import peak_rss, reset_peak_rss
    # imports (the family's modeling code, the tokenizer's) first: their memory is not the load's
    build_skeleton(transformers.AutoConfig.from_pretrained(sys.argv[1]), torch.float32, "warm-up")
    transformers.AutoTokenizer.from_pretrained(sys.argv[1])
    base = reset_peak_rss()
    lm = load_model(sys.argv[1], device="cpu", dtype="float32", console=Console(file=open("/dev/null", "w")))
    print(peak_rss() - base, lm.store.nbytes + lm.non_expert_bytes)
""")


def test_peak_host_memory_is_the_store_plus_the_rest(tmp_path):
    """A checkpoint whose experts are ~200 MB: the load's peak RSS stays within 1.15 × (store + non-expert).
    (transformers' own load plus packing peaks at ≥ 2×.)"""
    path = build_random_moe(tmp_path / "big", family="qwen3_moe", seed=0, hidden_size=512, moe_intermediate_size=512,
                            num_experts=16, num_hidden_layers=4)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path)], capture_output=True, text=True, env=env,
                         check=True).stdout.split()
    grown, needed = int(out[-2]), int(out[-1])
    assert needed > 150e6
    assert grown <= 1.15 * needed, f"peak grew by {grown / 1e6:.0f} MB for {needed / 1e6:.0f} MB of weights"


AFTER_LOAD_SCRIPT = textwrap.dedent("""
    import sys, torch, transformers
    from rich.console import Console
    from fmoe_cli import kernels
    from fmoe_cli.models.load import build_skeleton, load_model
    from fmoe_cli.profiling.memory import anon_rss
    build_skeleton(transformers.AutoConfig.from_pretrained(sys.argv[1]), torch.float32, "warm-up")
    transformers.AutoTokenizer.from_pretrained(sys.argv[1])
    kernels.library()
    base = anon_rss()
    lm = load_model(sys.argv[1], device="cpu", dtype="float32", experts=sys.argv[2],
                    console=Console(file=open("/dev/null", "w")))
    print(anon_rss() - base, lm.store.nbytes + lm.non_expert_bytes, len(getattr(lm.store, "_blocks", [])))
""")


def test_after_a_first_int4_load_the_process_holds_the_model_and_little_else(tmp_path):
    """Anonymous RSS after a first int4 load (quantising while reading) ÷ (store + non-expert) ≤ 1.15: the float32
    block it quantised from and the C heap's freed temporaries are not kept for the run (issue 39 §6). Here 1.07;
    1.43 before (42 MB held for 30 MB of weights; 210 MiB for the 172 MiB int4 model of 6 layers of hidden 1024)."""
    experts = "int4"
    path = build_random_moe(tmp_path / "m", family="qwen3_moe", seed=0, hidden_size=512, moe_intermediate_size=512,
                            num_experts=16, num_hidden_layers=4)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), XDG_CACHE_HOME=str(tmp_path / "cache"))  # no converted store yet
    out = subprocess.run([sys.executable, "-c", AFTER_LOAD_SCRIPT, str(path), experts], capture_output=True,
                         text=True, env=env, check=True).stdout.split()
    held, needed, blocks = int(out[-3]), int(out[-2]), int(out[-1])
    assert blocks == 0
    assert held <= 1.15 * needed, f"{held / 1e6:.1f} MB held after the load for {needed / 1e6:.1f} MB of weights"


BAD_FILES = {
    "truncated": lambda data: data[: len(data) // 2],
    "empty": lambda data: b"",
    "garbage": lambda data: os.urandom(4096),
    "corrupt-header": lambda data: data[:8] + b"{not json" + data[17:],
}
COMMANDS = [("bench", "--tokens", "2", "--warmup", "0"), ("chat",), ("profile", "--quick", "--model")]


@pytest.mark.parametrize("damage", list(BAD_FILES))
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_bad_weight_file_is_one_line(command, damage, checkpoints, tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    src = checkpoints["mixtral"]
    for f in src.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    weights = path / "model.safetensors"
    weights.write_bytes(BAD_FILES[damage](weights.read_bytes()))
    args = [command[0], *command[1:], str(path)] if command[0] == "profile" else [command[0], str(path), *command[1:]]
    result, text = run(*args, input="/exit\n")
    assert_one_line_error(result, text, "model.safetensors", "truncated or corrupt")


def test_store_is_page_locked_at_its_exact_size_and_released(checkpoints, monkeypatch):
    """On CUDA the store's memory is registered in place (cudaHostRegister) at exactly each layer's
    size — not pin_memory(), which rounds to a power of two — and unregistered on close. Here a
    recording stand-in for torch.cuda.cudart() takes the calls the GPU path makes."""
    from fmoe_cli.offload.store import HostStore

    calls = []

    class Cudart:
        def cudaHostRegister(self, ptr, nbytes, flags):
            calls.append(("register", ptr, nbytes, flags))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    lm = load_model(str(checkpoints["mixtral"]), device="cpu", dtype="float32")
    shape = lm.shape
    store = HostStore(shape, torch.float32, pin=True)
    store.allocate()
    layer_bytes = shape.num_experts * shape.intermediate * 3 * shape.hidden * 4
    assert [c[2] for c in calls] == [layer_bytes] * shape.num_layers  # exact, e.g. 196608 (not 262144)
    assert [c[1] for c in calls] == [t.data_ptr() for t in store.layers]
    store.close()
    assert [c for c in calls if c[0] == "unregister"] == [("unregister", t.data_ptr()) for t in store.layers]
    store.close()  # twice: nothing more
    assert len(calls) == 2 * shape.num_layers


@pytest.mark.parametrize(("capability", "want"), [((7, 5), torch.float16), ((6, 1), torch.float16),
                                                   ((8, 0), torch.bfloat16), ((8, 9), torch.bfloat16)])
def test_auto_dtype_is_float16_on_a_card_without_native_bfloat16(capability, want, monkeypatch):
    """Issue 20 §5: below sm_80 (T4, RTX 20-series) bfloat16 is emulated: auto picks float16 there, asking
    the run's own device; an explicit dtype is kept; the chat header says why it is float16."""
    from types import SimpleNamespace

    from fmoe_cli.chat.repl import header_lines
    from fmoe_cli.generate import SamplingParams
    from fmoe_cli.models.load import pick_dtype

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or capability)
    device = torch.device("cuda", 1)
    assert pick_dtype(None, device) is want and pick_dtype("auto", device) is want
    assert asked == [device, device]
    assert pick_dtype("bfloat16", device) is torch.bfloat16 and pick_dtype(None, torch.device("cpu")) is torch.float32
    lm = SimpleNamespace(label="m", model_id="m", device=device, dtype=want, shape=SimpleNamespace(experts="bf16"),
                         dense="bf16", activations="float")
    session = SimpleNamespace(lm=lm, settings=SimpleNamespace(plan=SimpleNamespace(summary=lambda: "p")), context_limit=None,
                              sampling=SamplingParams(), sampling_source="")
    device_line = header_lines(session, "link: x", 2**20, None)[1]
    name = str(want).removeprefix("torch.")
    assert device_line.startswith(f"device cuda:1 ({name}")
    assert ("no native bfloat16" in device_line) == (want is torch.float16)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    import re

    span = None
    for line in open("/proc/self/smaps").read().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            span = (int(m.group(1), 16), int(m.group(2), 16))
        elif span and span[0] <= address < span[1] and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages: Linux")
def test_the_store_asks_for_huge_pages_for_memory_it_allocates_not_for_a_mapped_file(tmp_path):
    """A store's own buffers (an unconverted model's experts, written by the loader) are advised MADV_HUGEPAGE before
    they are written ("hg" in the mapping's VmFlags: the kernel backs their whole 2 MB pages with huge pages where
    THP is on); a memory-mapped converted store is the page cache's and is left alone."""
    from fmoe_cli.offload.store import HUGE_PAGE, HostBuffer

    own = HostBuffer(8 * HUGE_PAGE, pin=False)
    assert "hg" in _vm_flags(own.tensor.data_ptr() + 4 * HUGE_PAGE)
    path = tmp_path / "store.bin"
    path.write_bytes(bytes(8 * HUGE_PAGE))
    mapped = torch.from_file(str(path), shared=False, size=8 * HUGE_PAGE, dtype=torch.uint8)
    HostBuffer(8 * HUGE_PAGE, pin=False, memory=mapped)
    assert "hg" not in _vm_flags(mapped.data_ptr() + 4 * HUGE_PAGE)
