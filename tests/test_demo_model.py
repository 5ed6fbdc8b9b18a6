"""The shipped demo model (fmoe_cli/models/demo_model) and its training script."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from fmoe_cli.generate import stream_generate
from fmoe_cli.models.demo import SHIPPED, demo_path
from fmoe_cli.models.load import load_model
from fmoe_cli.offload.engine import Engine
from fmoe_cli.offload.link import EmulatedLink
from fmoe_cli.planning.presets import make_settings
from fmoe_cli.types import Timings
from fmoe_cli.planning.plan import parse_budget

ROOT = Path(__file__).resolve().parents[1]


def test_the_trained_demo_ships_in_the_package_within_40_mb() -> None:
    assert demo_path() == SHIPPED, "the trained demo model is missing from fmoe_cli/models/demo_model"
    weights = sum(p.stat().st_size for p in SHIPPED.glob("*.safetensors"))
    assert 0 < weights <= 40 * 10**6
    assert not list(SHIPPED.glob("*.bin")) and not list(SHIPPED.glob("*.pt"))
    config = json.loads((SHIPPED / "config.json").read_text())
    assert config["model_type"] in {"qwen3_moe", "mixtral"}


@pytest.fixture(scope="module")
def demo():
    lm = load_model("demo", device="cpu", dtype="float32")
    yield lm


@pytest.mark.parametrize("policy", ["moepic", "lru"])
def test_demo_greedy_through_the_engine_equals_transformers(demo, policy: str) -> None:
    from transformers import AutoModelForCausalLM

    assert "tiny trained demo model" in demo.label
    messages = [{"role": "user", "content": "In the beginning God created the heaven and the earth."}]
    ids = demo.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    prompt = torch.tensor([ids])

    reference = AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None  # always 32 new tokens
    expected = reference.generate(prompt, max_new_tokens=32, do_sample=False)[0, prompt.shape[1]:].tolist()

    engine = Engine(demo.layers, demo.store, demo.shape, EmulatedLink(50.0), demo.device, demo.dtype)
    engine.install(demo.model)
    try:
        timings = Timings(t_att=1e-4, t_moe=2e-4, t_head=1e-4, t_load=3e-4, top_k=demo.shape.top_k)  # moepic's
        engine.configure(make_settings(policy, demo.shape, parse_budget("25%", demo.shape.all_experts_bytes),
                                       timings=timings))
        got = [e.token_id for e in stream_generate(demo.model, prompt, engine=engine, max_new_tokens=32,
                                                   stop_on_eos=False)]
    finally:
        engine.close()
    assert got == expected
    text = demo.tokenizer.decode(got)
    assert sum(c.isalpha() for c in text) > len(text) / 2  # words, not byte noise


def test_training_script_runs_a_few_steps(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import train_demo
    finally:
        sys.path.pop(0)
    corpus = tmp_path / "corpus.txt"
    verses = [f"And the {w} said unto them, Go ye into the {v}, and abide there until the {d}."
              for w in ("king", "prophet", "servant", "woman") for v in ("city", "field", "house")
              for d in ("morning", "evening")]
    corpus.write_text("\n\n".join("\n".join(verses[i:i + 4]) for i in range(0, len(verses), 4)), encoding="utf-8")
    out = tmp_path / "run"
    assert train_demo.main(["--tiny", "--steps", "2", "--corpus", str(corpus), "--out", str(out)]) == 0
    final = out / "final"
    assert (final / "config.json").exists() and list(final.glob("*.safetensors"))
    info = json.loads((final / "training_info.json").read_text())
    assert info["steps_done"] == 2 and len(info["history"]) == 1
    assert info["args"]["out"] == "run"  # the run directory's name, no path of this machine
    lm = load_model(str(final), device="cpu", dtype="float32")  # loads through the same path as a hub model
    assert lm.shape.num_experts == 4 and lm.shape.top_k == 2
