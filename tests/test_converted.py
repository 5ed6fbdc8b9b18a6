"""The converted store: the first int8/int4 load writes it, later loads map it instead of
quantising again; a corrupt, stale or interrupted one is never used."""

from __future__ import annotations

import io
import os

import pytest
import torch
from rich.console import Console

import fmoe_cli.offload.converted as converted_module
from fmoe_cli.models.identity import checkpoint_fingerprint
from fmoe_cli.models.load import load_model
from fmoe_cli.offload.converted import converted_path
from fmoe_cli.offload.quant import QuantStore


@pytest.fixture
def model(checkpoints, tmp_path, monkeypatch):
    """A private copy of a checkpoint and a private cache directory."""
    monkeypatch.setattr(converted_module, "converted_dir", lambda: tmp_path / "cache")
    path = tmp_path / "model"
    path.mkdir()
    for f in checkpoints["qwen2_moe"].iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    return path


def load(path, experts="int4"):
    out = io.StringIO()
    lm = load_model(str(path), device="cpu", dtype="float32", experts=experts, console=Console(file=out, width=400))
    return lm, out.getvalue()


def never_quantise(monkeypatch):
    monkeypatch.setattr(QuantStore, "put", lambda *a: pytest.fail("quantised again instead of mapping the store"))


def test_second_load_maps_the_converted_store(model, monkeypatch):
    first, _ = load(model)
    path = converted_path(checkpoint_fingerprint(model), "int4")
    assert path.exists() and path.stat().st_size >= first.store.nbytes
    never_quantise(monkeypatch)
    second, text = load(model)
    assert text.strip() == ""
    for a, b in zip(first.store.layers, second.store.layers):
        assert torch.equal(a, b)
    assert not any(p.name.endswith(".tmp") for p in path.parent.iterdir())


def test_each_format_has_its_own(model, monkeypatch):
    load(model, "int4")
    load(model, "int8")
    names = sorted(p.name for p in (converted_module.converted_dir()).iterdir())
    assert [n.split("-")[1] for n in names] == ["int4", "int8"]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_store_is_set_aside_and_rebuilt(model, damage):
    first, _ = load(model)
    path = converted_path(checkpoint_fingerprint(model), "int4")
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "garbage": os.urandom(5000), "empty": b""}[damage])
    again, text = load(model)
    assert "is corrupt" in text and "rebuilding" in text
    for a, b in zip(first.store.layers, again.store.layers):
        assert torch.equal(a, b)
    assert path.exists() and path.read_bytes() == data  # rebuilt
    assert any(".bad-" in p.name for p in path.parent.iterdir())  # set aside, not deleted


def test_stale_store_is_rebuilt(model, monkeypatch):
    monkeypatch.setattr(converted_module, "FORMAT_VERSION", 0)
    load(model)
    old = converted_path(checkpoint_fingerprint(model), "int4")
    monkeypatch.undo()
    monkeypatch.setattr(converted_module, "converted_dir", lambda: old.parent)
    path = converted_path(checkpoint_fingerprint(model), "int4")
    os.replace(old, path)  # an old version's file under this version's name
    _, text = load(model)
    assert "stale" in text and "format version" in text


def test_changed_checkpoint_gets_a_new_store(model, monkeypatch):
    load(model)
    import json

    before = converted_path(checkpoint_fingerprint(model), "int4")
    config = json.loads((model / "config.json").read_text())
    config["rms_norm_eps"] *= 2
    (model / "config.json").write_text(json.dumps(config))
    after = converted_path(checkpoint_fingerprint(model), "int4")
    assert before.exists() and after != before and not after.exists()


def test_interrupted_write_leaves_nothing_behind(model, monkeypatch):
    def crash(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(converted_module.os, "fsync", crash)
    lm, text = load(model)  # the load itself succeeds; saving is a warning
    assert "could not save the converted store" in text
    directory = converted_module.converted_dir()
    assert list(directory.iterdir()) == []  # no partial file, no temporary left
    monkeypatch.undo()
    monkeypatch.setattr(converted_module, "converted_dir", lambda: directory)
    load(model)
    assert converted_path(checkpoint_fingerprint(model), "int4").exists()


class RecordingCudart:
    """torch.cuda.cudart() as the GPU path calls it: records registrations; `refuse` flags fail."""

    def __init__(self, refuse: int = 0) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.refuse = refuse

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append((ptr, nbytes, flags))
        return 801 if flags & self.refuse else 0  # cudaErrorNotSupported

    def cudaHostUnregister(self, ptr):
        return 0


def test_a_mapped_store_is_page_locked_read_only_and_portable(model, monkeypatch):
    """Issue 20 §5: the converted store is a private writable mapping; registering it for writing would
    copy every page into RAM. It is registered read-only (8) and portable (1: a run on cuda:1 copies from
    it in another context than the current device's); a store in ordinary memory is portable only."""
    from fmoe_cli.offload.converted import open_converted
    from fmoe_cli.offload.store import HostStore

    HOST_REGISTER_PORTABLE, HOST_REGISTER_READ_ONLY = 0x01, 0x08  # cuda_runtime_api.h

    lm, _ = load(model)
    fingerprint = checkpoint_fingerprint(model)
    mapped = open_converted(converted_path(fingerprint, "int4"), fingerprint, lm.shape, Console(file=io.StringIO()))
    cudart = RecordingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    store = QuantStore(lm.shape, torch.float32, pin=True)
    store.allocate(mapped)
    assert [c[0] for c in cudart.calls] == [t.data_ptr() for t in mapped]
    assert {c[2] for c in cudart.calls} == {HOST_REGISTER_PORTABLE | HOST_REGISTER_READ_ONLY}
    cudart.calls.clear()
    plain = HostStore(load(model, "bf16")[0].shape, torch.float32, pin=True)
    plain.allocate()
    assert {c[2] for c in cudart.calls} == {HOST_REGISTER_PORTABLE}
    # a card that cannot register read-only: registered writable (copied into RAM), with one warning
    cudart = RecordingCudart(refuse=HOST_REGISTER_READ_ONLY)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    again = QuantStore(lm.shape, torch.float32, pin=True)
    again.allocate(mapped)
    assert [c[2] for c in cudart.calls] == [HOST_REGISTER_PORTABLE | HOST_REGISTER_READ_ONLY,
                                            HOST_REGISTER_PORTABLE] * lm.shape.num_layers
    assert all(buffer.registered for buffer in again._buffers)


def test_a_store_of_the_previous_format_is_rebuilt_not_misread(model, monkeypatch):
    """Format version 3 groups the int8/int4 down projections along the neurons (offload/quant.py quantize_down): a
    version-2 store (down rows grouped along H, as the last release wrote them) has the very same size and shape, so
    only its version tells it apart. Its name carries the version, so this fmoe never opens it: the load quantises
    again and writes a version-3 store whose rows are the new layout's, and the old file is left as it was. int2's
    rows did not change: its stores keep version 2 (hours of HQQ conversion are not thrown away)."""
    from fmoe_cli.offload import converted
    from fmoe_cli.types import ExpertShape

    monkeypatch.setattr(converted_module, "FORMAT_VERSION", 2)
    monkeypatch.setattr(ExpertShape, "down_by_neuron", property(lambda self: False))  # the version-2 rows
    old_lm, _ = load(model)
    old = converted_path(checkpoint_fingerprint(model), "int4")
    assert old.name.endswith("-int4-v2.safetensors") and old.exists()
    old_bytes = old.read_bytes()
    monkeypatch.undo()
    monkeypatch.setattr(converted_module, "converted_dir", lambda: old.parent)
    new = converted_path(checkpoint_fingerprint(model), "int4")
    assert new != old and new.name.endswith("-int4-v3.safetensors") and not new.exists()
    puts, put = [], QuantStore.put
    monkeypatch.setattr(QuantStore, "put", lambda self, *a: puts.append(1) or put(self, *a))
    lm, text = load(model)
    assert puts, "quantised again, not read from the old store"
    monkeypatch.setattr(QuantStore, "put", put)
    assert lm.shape.down_by_neuron and new.exists() and old.read_bytes() == old_bytes
    assert "stale" not in text and "corrupt" not in text
    for was, now in zip(old_lm.store.layers, lm.store.layers):
        assert was.shape == now.shape
        assert torch.equal(was[..., :2, :], now[..., :2, :])  # gate and up rows as before
        assert not torch.equal(was[..., 2, :], now[..., 2, :])  # the down rows in the new layout
    again, _ = load(model)  # and maps the new store on the next start
    for a, b in zip(lm.store.layers, again.store.layers):
        assert torch.equal(a, b)
    assert converted.format_version("int2") == 2 and converted.format_version("int8") == 3
