"""Every error path of the CLI: exit code 2, exactly one line of output, no traceback."""

from __future__ import annotations

import shutil

import pytest
import torch
from typer.testing import CliRunner

from fmoe_cli.cli import app


def run(*args: str, input: str | None = None):
    result = CliRunner().invoke(app, list(args), input=input)
    text = (result.stdout + result.stderr).strip()
    return result, text


def assert_one_line_error(result, text: str, *fragments: str) -> None:
    assert result.exit_code == 2, text
    assert len(text.splitlines()) == 1, text
    assert text.startswith("error: "), text
    assert "Traceback" not in text
    for fragment in fragments:
        assert fragment in text, text


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory):
    """A tiny dense Llama saved with save_pretrained (safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("dense") / "llama"
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def pickle_only(checkpoints, tmp_path_factory):
    """A MoE config with only pickle weights (pytorch_model.bin)."""
    path = tmp_path_factory.mktemp("pickle") / "mixtral-bin"
    path.mkdir()
    shutil.copy(checkpoints["mixtral"] / "config.json", path / "config.json")
    (path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    return path


COMMANDS = [("bench", "--tokens", "2", "--warmup", "0"), ("chat",)]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_unknown_model_id_offline(command, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result, text = run(command[0], "no-such-org/no-such-moe-model", *command[1:], input="/exit\n")
    assert_one_line_error(result, text, "no-such-org/no-such-moe-model")


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_directory_without_config(command, tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    result, text = run(command[0], str(tmp_path), *command[1:], input="/exit\n")
    assert_one_line_error(result, text, "config.json")


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_dense_model_is_refused(command, dense_checkpoint):
    result, text = run(command[0], str(dense_checkpoint), *command[1:], input="/exit\n")
    assert_one_line_error(result, text)
    assert "mixture-of-experts" in text.lower() or "moe" in text.lower() or "dense" in text.lower()


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_too_small_budget_says_how_many_mib(command, checkpoints):
    result, text = run(command[0], str(checkpoints["mixtral"]), "--vram-budget", "1KiB", "--device", "cpu",
                       *command[1:], input="/exit\n")
    assert_one_line_error(result, text, "MiB", "too small")


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_pickle_only_checkpoint_is_refused(command, pickle_only):
    result, text = run(command[0], str(pickle_only), *command[1:], input="/exit\n")
    assert_one_line_error(result, text, "safetensors")


@pytest.mark.parametrize("args, fragment", [
    (("--policy", "fastest"), "unknown policy"),
    (("--compare", "lru,bogus"), "unknown policy"),
    (("--emulate-link", "0"), "GB/s"),
    (("--tokens", "0"), "--tokens"),
    (("--prompt", "x", "--prompt-file", "y"), "not both"),
    (("--prompt-file", "/nonexistent/prompt.txt"), "does not exist"),
    (("--device", "tpu"), "device"),
    (("--vram-budget", "lots"), "budget"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bench_bad_options(checkpoints, args, fragment):
    result, text = run("bench", str(checkpoints["mixtral"]), "--device", "cpu", "--warmup", "0", *args)
    assert_one_line_error(result, text, fragment)


@pytest.mark.parametrize("args, fragment", [
    (("--policy", "fastest"), "unknown policy"),
    (("--temperature", "-1"), "--temperature"),
    (("--top-p", "0"), "--top-p"),
    (("--max-new-tokens", "0"), "--max-new-tokens"),
    (("--predictor", "oracle"), "unknown predictor"),
    (("--profile", "/nonexistent/profile.json"), "profile"),
    (("--trace-out", "/nonexistent/dir/trace.jsonl"), "trace"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_chat_bad_options(checkpoints, args, fragment):
    result, text = run("chat", str(checkpoints["mixtral"]), "--device", "cpu", *args, input="hello\n/exit\n")
    assert_one_line_error(result, text, fragment)


def test_unreadable_and_malformed_traces(tmp_path):
    result, text = run("replay", str(tmp_path / "missing.jsonl"))
    assert_one_line_error(result, text, "does not exist")
    result, text = run("replay", str(tmp_path))
    assert_one_line_error(result, text, "directory")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"fmoe_trace": 1}\n{"seq": 0, "token": 0, "layer": 0, "experts": [1, 1], "probs": [0.5, 0.5]}\n')
    result, text = run("replay", str(bad))
    assert_one_line_error(result, text, "bad.jsonl:2")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    result, text = run("replay", str(binary))
    assert_one_line_error(result, text)
    result, text = run("replay", str(bad), "--cache-sizes", "7-1")
    assert_one_line_error(result, text, "--cache-sizes")


@pytest.mark.parametrize("args", [("bench", "demo", "--policy", "[/x]"), ("replay", "[/x].jsonl"),
                                  ("bench", "demo", "--vram-budget", "[/a]"), ("replay", "[red]oops.jsonl")],
                         ids=["policy", "trace name", "budget", "a style's name"])
def test_what_the_user_typed_is_shown_as_typed(args):
    """An error line shows the user's text as text: brackets are not rich markup (a `[/x]` ended in a traceback, a
    `[red]` vanished)."""
    result, text = run(*args)
    assert_one_line_error(result, text, args[-1])


def test_profile_prefill_beyond_the_models_context_is_refused():
    result, text = run("profile", "--quick", "--model", "demo", "--prefill-len", "1100", "--device", "cpu")
    assert_one_line_error(result, text, "--prefill-len 1100 is beyond the model's context of 1024 tokens")


def test_weights_that_make_the_output_nan_are_refused_in_one_line(checkpoints, tmp_path):
    """A damaged weight file whose header reads (here: one router's weights NaN) is not served as garbage tokens, nor
    let into the router's kernel with NaN scores (it wrote out of bounds): one line once the prompt ran."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "damaged"
    shutil.copytree(checkpoints["mixtral"], path)
    (weights,) = path.glob("*.safetensors")
    tensors = load_file(weights)
    name = next(n for n in tensors if n.endswith("layers.0.block_sparse_moe.gate.weight"))  # (the stored names)
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, weights, metadata={"format": "pt"})
    result, text = run("bench", str(path), "--tokens", "2", "--warmup", "0", "--policy", "lru", "--device", "cpu")
    assert_one_line_error(result, text, "the model's output is NaN")
