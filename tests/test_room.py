"""A hub model that cannot run here is refused from its config.json, before its weights are downloaded
(models/hub.py `fetch_model_early`, models/config.py `check_servable`, models/room.py): weights stored quantised, a
dense model, options beyond its context, experts beyond the free host RAM, a download beyond the free disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fmoe_cli.errors import FmoeError
from fmoe_cli.models import hub, room
from fmoe_cli.models.config import check_servable, config_expert_shape, moe_layer_indices, text_fields
from fmoe_cli.options import RunOptions

MIXTRAL_8X22B = {  # Mixtral-8x22B's config.json, the fields a check reads (141 B parameters: 525 GiB in float32)
    "model_type": "mixtral", "hidden_size": 6144, "intermediate_size": 16384, "num_hidden_layers": 56,
    "num_attention_heads": 48, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 32768, "max_position_embeddings": 65536, "torch_dtype": "bfloat16",
}
GiB = 1024**3


def write_config(directory: Path, fields: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(fields))
    return directory / "config.json"


# Fields that place the MoE layers differently in each family (inputs that tell the rules apart).
LAYOUTS = [
    ("mixtral", {}), ("olmoe", {}),
    ("qwen2_moe", {"decoder_sparse_step": 2}), ("qwen2_moe", {"mlp_only_layers": [0, 3]}),
    ("qwen3_moe", {"mlp_only_layers": [2]}), ("qwen3_moe", {"decoder_sparse_step": 3, "mlp_only_layers": [2]}),
    ("qwen3_moe", {"mlp_only_layers": [0]}), ("qwen3_moe", {"mlp_only_layers": [5]}),  # (one index: a list, not a value)
    ("deepseek_v2", {"first_k_dense_replace": 2}), ("deepseek_v3", {"first_k_dense_replace": 1}),
    ("deepseek_v3", {"first_k_dense_replace": None}),  # left out of config.json: the class's default (3)
]


@pytest.mark.parametrize("family, fields", LAYOUTS, ids=lambda v: str(v))
def test_the_experts_counted_from_config_json_are_the_skeleton_s(family, fields, tmp_path):
    """`config_expert_shape` from config.json's fields as the checks read them (`text_fields`) equals `expert_shape` of
    the model transformers builds from it."""
    import torch

    from fmoe_cli.models.demo import tiny_config
    from fmoe_cli.models.load import build_skeleton, expert_shape

    config = tiny_config(family, vocab_size=64, num_hidden_layers=6, **{k: v for k, v in fields.items() if v is not None})
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    if fields.get("first_k_dense_replace", 0) is None:
        saved.pop("first_k_dense_replace")  # as a config.json that never wrote it
        config = type(config).from_dict(saved)
    _, layers = build_skeleton(config, torch.float32, "tiny")
    fields = text_fields(saved)
    assert [layer.decoder_index for layer in layers] == moe_layer_indices(fields)
    for experts in ("bf16", "int4"):
        assert config_expert_shape(fields, 4, experts) == expert_shape(layers, torch.float32, experts)


def test_a_family_whose_layers_are_not_known_is_not_counted():
    assert moe_layer_indices({**MIXTRAL_8X22B, "model_type": "some_new_moe"}) is None
    assert config_expert_shape({**MIXTRAL_8X22B, "model_type": "some_new_moe"}, 2, "bf16") is None
    # a model with its own code (--trust-remote-code) may name its fields otherwise: not counted, no KeyError
    dbrx = {"model_type": "mixtral", "n_layers": 40, "d_model": 6144, "ffn_config": {"moe_num_experts": 16}}
    assert moe_layer_indices(dbrx) is None and config_expert_shape(dbrx, 2, "bf16") is None
    assert config_expert_shape({k: v for k, v in MIXTRAL_8X22B.items() if k != "num_local_experts"}, 2, "bf16") is None


@pytest.mark.parametrize("quantization, method", [
    ({"quant_method": "fp8", "activation_scheme": "static"}, "fp8"),  # per-tensor fp8 (block-scaled: tests/test_fp8.py)
    ({"quant_method": "fp8", "weight_block_size": [128]}, "fp8"),
    ({"quant_method": "gptq", "bits": 4}, "gptq"), ({"quant_method": "awq"}, "awq"), ({"load_in_4bit": True}, "unnamed"),
])
def test_weights_stored_quantised_are_refused_from_config_json(quantization, method, tmp_path):
    path = write_config(tmp_path, {**MIXTRAL_8X22B, "quantization_config": quantization})
    with pytest.raises(FmoeError, match=rf"org/model's weights are stored quantised \({method}: .*unquantised"):
        check_servable(path, "org/model")


def test_block_scaled_fp8_is_read(tmp_path):
    """DeepSeek-V3's and the -FP8 repositories' quantization_config: dequantized as read (tests/test_fp8.py)."""
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert check_servable(write_config(tmp_path, {**MIXTRAL_8X22B, "quantization_config": fp8}), "org/model")


def test_a_dense_model_is_refused_from_config_json_unless_its_own_code_says(tmp_path):
    dense = {k: v for k, v in MIXTRAL_8X22B.items() if k not in ("num_local_experts", "num_experts_per_tok")}
    path = write_config(tmp_path, {**dense, "model_type": "llama"})
    with pytest.raises(FmoeError, match=r"org/model \(llama\): config.json names no routed experts \(num_local_experts, "
                                        r"num_experts, n_routed_experts, moe_num_experts\): a dense model"):
        check_servable(path, "org/model")
    assert check_servable(path, "org/model", trust_remote_code=True)["model_type"] == "llama"
    assert check_servable(write_config(tmp_path / "moe", MIXTRAL_8X22B), "org/model")["hidden_size"] == 6144


def test_experts_beyond_the_free_host_ram_are_refused_with_the_format_that_fits(tmp_path, monkeypatch):
    """The experts alone (56 layers × 8 × 3 × 6144 × 16384) against the free RAM; the hint names the largest format
    that fits; float32 on the CPU counts 4 bytes a weight, --dtype bfloat16 2."""
    config = write_config(tmp_path, MIXTRAL_8X22B)
    experts = 56 * 8 * 3 * 6144 * 16384
    monkeypatch.setattr(room, "host_ram_free", lambda: experts * 3)  # 2 bytes a weight fit, float32's 4 do not
    with pytest.raises(FmoeError, match=r"needs at least 504.0 GiB of host RAM with --experts bf16 \(its experts "
                                        r"alone, before its other weights\) but 378.0 GiB is free here; --dtype bfloat16 "
                                        r"needs 252.0 GiB, --experts int8 needs 128.0 GiB$"):
        RunOptions(model="org/model", device="cpu").check_model_config(config)
    RunOptions(model="org/model", device="cpu", dtype="bfloat16").check_model_config(config)
    RunOptions(model="org/model", device="cpu", experts="int4").check_model_config(config)
    monkeypatch.setattr(room, "host_ram_free", lambda: experts // 20)  # not even int2
    with pytest.raises(FmoeError, match=r"is free here$"):
        RunOptions(model="org/model", device="cpu", experts="int2").check_model_config(config)


def test_the_load_still_checks_host_ram_with_the_other_weights(checkpoints, monkeypatch):
    """The check before torch lets a model through whose experts fit; the load's own check counts the other weights
    too (the skeleton's exact sizes) and refuses before a weight is read."""
    import fmoe_cli.models.load as load

    shape_bytes = {}
    real = room.check_host_ram

    def recording(label, shape, non_expert_bytes):
        shape_bytes[non_expert_bytes is None] = shape.all_experts_bytes
        return real(label, shape, non_expert_bytes)

    monkeypatch.setattr(load, "check_host_ram", recording)
    monkeypatch.setattr(room, "host_ram_free", lambda: shape_bytes.get(False, 0) + 1)  # experts only, not the rest
    monkeypatch.setattr(load, "read_checkpoint", lambda *a, **k: pytest.fail("read weights before refusing"))
    with pytest.raises(FmoeError, match=r"needs \d.* GiB of host RAM with --experts bf16 \(experts .* other weights"):
        load.load_model(str(checkpoints["mixtral"]), device="cpu")


class FakeHub:
    """The hub client's side of `fetch_model_early`: config.json's snapshot, the file listing, the full download."""

    def __init__(self, root: Path, config: dict, files: list[tuple[str, int]] | None, cached: set[str] = frozenset()):
        self.root, self.files, self.cached, self.calls = root, files, set(cached), []
        write_config(root, config)

    def download(self, repo_id, patterns, what, progress=True):
        self.calls.append(tuple(patterns))
        return self.root

    def snapshot_files(self, repo_id, patterns):
        self.calls.append("listing")
        return None if self.files is None else (self.files, self.cached, self.root / "hub")


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    def make(config=MIXTRAL_8X22B, files=None, cached=frozenset()):
        fake = FakeHub(tmp_path / "snapshot", config, files, cached)
        monkeypatch.setattr(hub, "download", fake.download)
        monkeypatch.setattr(hub, "snapshot_files", fake.snapshot_files)
        monkeypatch.setattr(room.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 100 * GiB})())
        return fake
    return make


def test_config_json_comes_alone_and_first_and_is_checked_before_the_weights(fake_hub):
    fake = fake_hub(files=[("config.json", 1000), ("model-1.safetensors", 60 * GiB)])
    seen = []
    hub.fetch_model_early("org/model", False, lambda config: seen.append(json.loads(config.read_text())["hidden_size"]))
    assert fake.calls == [("config.json",), "listing", tuple(hub.model_patterns(False))] and seen == [6144]

    fake.calls.clear()
    with pytest.raises(FmoeError, match="refused"):
        hub.fetch_model_early("org/model", False, lambda config: (_ for _ in ()).throw(FmoeError("refused")))
    assert fake.calls == [("config.json",)]  # neither listed nor downloaded


def test_a_download_beyond_the_free_disk_is_refused_counting_what_is_cached(fake_hub):
    files = [("config.json", 1000), ("model-1.safetensors", 60 * GiB), ("model-2.safetensors", 50 * GiB)]
    fake = fake_hub(files=files)
    with pytest.raises(FmoeError, match=r"org/model's download needs 110.0 GiB \(3 files\) but 100.0 GiB is free in "):
        hub.fetch_model_early("org/model", False)
    assert tuple(hub.model_patterns(False)) not in fake.calls
    fake = fake_hub(files=files, cached={"model-2.safetensors"})  # 60 GiB left to come
    hub.fetch_model_early("org/model", False)
    assert fake.calls[-1] == tuple(hub.model_patterns(False))


def test_without_the_hub_s_listing_the_download_goes_on(fake_hub):
    fake = fake_hub(files=None)
    hub.fetch_model_early("org/model", False)
    assert fake.calls == [("config.json",), "listing", tuple(hub.model_patterns(False))]


def test_the_listing_failing_is_no_listing(monkeypatch):
    import huggingface_hub

    calls = []

    def broken(self, repo_id, **kwargs):
        calls.append(kwargs)
        raise OSError("no route to host")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", broken)
    assert hub.snapshot_files("org/model", hub.model_patterns(False)) is None
    assert calls == [{"files_metadata": True, "timeout": hub.LISTING_TIMEOUT_S}]  # one request, bounded


def test_the_listing_selects_the_patterns_counts_the_lfs_sizes_and_the_blobs_held(monkeypatch, tmp_path):
    """A file whose blob an earlier snapshot left in the cache counts as held: the download links it (after an
    upstream edit moved `main` on, with only config.json in its snapshot)."""
    import huggingface_hub
    from huggingface_hub.hf_api import BlobLfsInfo, RepoSibling

    siblings = [RepoSibling("config.json", size=900, blob_id="a"),
                RepoSibling("model-1.safetensors", size=135, blob_id="b", lfs=BlobLfsInfo(7 * GiB, "sha-one", 135)),
                RepoSibling("model-2.safetensors", size=135, blob_id="c", lfs=BlobLfsInfo(5 * GiB, "sha-two", 135)),
                RepoSibling("pytorch_model.bin", size=135, blob_id="d", lfs=BlobLfsInfo(7 * GiB, "sha-bin", 135)),
                RepoSibling("modeling_x.py", size=500, blob_id="e")]
    info = type("Info", (), {"siblings": siblings})()
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo_id, **kwargs: info)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    blobs = tmp_path / "models--org--model" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "sha-two").write_bytes(b"")
    files, held, cache = hub.snapshot_files("org/model", hub.model_patterns(False))
    assert files == [("config.json", 900), ("model-1.safetensors", 7 * GiB), ("model-2.safetensors", 5 * GiB)]
    assert held == {"model-2.safetensors"} and cache == tmp_path
    files, _, _ = hub.snapshot_files("org/model", hub.model_patterns(True))
    assert ("modeling_x.py", 500) in files


@pytest.mark.parametrize("args, fragment", [
    (("chat", "org/gptq-moe"), "org/gptq-moe's weights are stored quantised (gptq"),
    (("bench", "org/gptq-moe", "--tokens", "4"), "org/gptq-moe's weights are stored quantised (gptq"),
    (("bench", "org/big-moe", "--tokens", "70000"), "--tokens 70000: the context of 65536 tokens"),
    (("chat", "org/big-moe", "--context", "100000"), "--context 100000 is longer than the model's context of 65536"),
    # what only transformers' model of the config tells (load.check_skeleton), before the weights too
    (("chat", "org/gpt-oss"), "(GptOssExperts): experts with biases are not served yet"),
    (("bench", "org/vl-moe", "--tokens", "4"), "(qwen3_vl_moe): transformers registers no AutoModelForCausalLM"),
    (("serve", "org/vl-moe", "--port", "0"), "(qwen3_vl_moe): transformers registers no AutoModelForCausalLM"),
])
def test_a_command_on_a_hub_model_refuses_from_its_config_json(args, fragment, fake_hub, monkeypatch):
    """The commands' own path (cli.py `_fetch_model`): one line, exit 2, and the weights never asked for."""
    import transformers

    from test_cli_errors import assert_one_line_error, run

    configs = {"org/gptq-moe": {**MIXTRAL_8X22B, "quantization_config": {"quant_method": "gptq", "bits": 4}},
               "org/gpt-oss": transformers.AutoConfig.for_model("gpt_oss").to_dict(),
               "org/vl-moe": transformers.AutoConfig.for_model("qwen3_vl_moe").to_dict()}
    fake = fake_hub(config=configs.get(args[1], MIXTRAL_8X22B), files=[("config.json", 1000)])
    monkeypatch.setattr(room, "host_ram_free", lambda: 10**15)
    result, text = run(*args)
    assert_one_line_error(result, text, fragment)
    assert fake.calls == [("config.json",)]


@pytest.mark.parametrize("config, args, fragment", [
    ({**MIXTRAL_8X22B, "quantization_config": {"quant_method": "gptq"}}, ("chat",), "weights are stored quantised (gptq"),
    (MIXTRAL_8X22B, ("bench", "--device", "cpu"), "needs at least 504.0 GiB of host RAM with --experts bf16"),
    ({**MIXTRAL_8X22B, "model_type": "llama", "num_local_experts": None}, ("serve", "--port", "0"), "names no routed experts"),
    ({**MIXTRAL_8X22B, "quantization_config": {"quant_method": "awq"}}, ("plan", "--vram", "12GiB"),
     "weights are stored quantised (awq"),
], ids=["gptq", "host RAM", "dense", "plan"])
def test_a_local_model_is_refused_from_its_config_json_before_torch(config, args, fragment, tmp_path):
    """A model directory (config.json alone here: no weights, no tokenizer) is checked as a hub model's config is,
    before torch is imported (tests/test_fast_errors.py's probe)."""
    import psutil
    from test_fast_errors import run_cli

    if "host RAM" in fragment and psutil.virtual_memory().available > 504 * GiB:
        pytest.skip("this machine has the RAM")
    write_config(tmp_path / "model", config)
    out, err = run_cli(args[0], str(tmp_path / "model"), *args[1:])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err
    assert out.strip().splitlines()[-1] == "HEAVY [] 2", out
