"""Sampling: transformers' steps in transformers' order (temperature, top-k, top-p, min-p), and the defaults a model's
generation_config.json recommends (chat and serve start from them)."""

from __future__ import annotations

import json

import pytest
import torch

from fmoe_cli.chat import SAMPLING, ChatOptions
from fmoe_cli.generate import SamplingParams, sample_next
from fmoe_cli.models.config import sampling_defaults


def transformers_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution transformers' logits processors sample from, in the order its generate builds them."""
    from transformers import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                              TopPLogitsWarper)

    steps = [TemperatureLogitsWarper(params.temperature)]
    steps += [TopKLogitsWarper(params.top_k)] if params.top_k else []
    steps += [TopPLogitsWarper(params.top_p)] if params.top_p < 1 else []
    steps += [MinPLogitsWarper(params.min_p)] if params.min_p else []
    scores = LogitsProcessorList(steps)(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())
    return torch.softmax(scores[0], dim=-1)


def drawn(logits: torch.Tensor, params: SamplingParams, draws: int = 3000) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(logits.shape[0])
    for _ in range(draws):
        counts[sample_next(logits, params, generator)] += 1
    return counts / draws


@pytest.mark.parametrize("params", [
    SamplingParams(1.0, top_k=3), SamplingParams(0.7, top_p=0.8), SamplingParams(1.3, min_p=0.2),
    SamplingParams(0.6, top_p=0.95, top_k=5, min_p=0.05),  # Qwen3's kind: every step on
    SamplingParams(1.0, top_p=0.6, min_p=0.5), SamplingParams(2.0, top_k=4, top_p=0.5),
], ids=repr)
def test_the_draws_follow_transformers_distribution(params):
    """Which tokens can be drawn is exactly transformers' support, and how often within sampling noise (3000 draws)."""
    logits = torch.tensor([2.0, 1.6, 1.5, 1.1, 0.7, 0.3, 0.0, -0.4, -1.0, -2.5])
    want = transformers_probs(logits, params)
    got = drawn(logits, params)
    assert torch.equal(got > 0, want > 0), (got, want)
    assert torch.allclose(got, want, atol=0.035), (got, want)


def test_top_k_keeps_ties_at_the_k_th_and_min_p_one_keeps_the_most_likely():
    logits = torch.tensor([3.0, 1.0, 1.0, 1.0, 0.5])
    assert set(drawn(logits, SamplingParams(5.0, top_k=2), 600).nonzero().flatten().tolist()) == {0, 1, 2, 3}
    assert drawn(logits, SamplingParams(5.0, min_p=1.0), 200).tolist() == [1.0, 0, 0, 0, 0]
    assert drawn(logits, SamplingParams(5.0, top_k=1), 200).tolist() == [1.0, 0, 0, 0, 0]


def write_generation_config(tmp_path, **fields):
    (tmp_path / "generation_config.json").write_text(json.dumps(fields))
    return tmp_path


def test_the_model_s_recommended_sampling_is_read_where_it_samples(tmp_path):
    qwen3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [1, 2]}
    assert sampling_defaults(write_generation_config(tmp_path, **qwen3)) == {"temperature": 0.6, "top_p": 0.95,
                                                                            "top_k": 20}
    assert sampling_defaults(write_generation_config(tmp_path, **{**qwen3, "do_sample": False})) == {}  # greedy
    odd = {"do_sample": True, "temperature": "hot", "top_p": 1.5, "top_k": 2.5, "min_p": 0}
    assert sampling_defaults(write_generation_config(tmp_path, **odd)) == {"min_p": 0.0}  # only what is in range
    (tmp_path / "generation_config.json").write_text("{not json")
    assert sampling_defaults(tmp_path) == {} and sampling_defaults(tmp_path / "none") == {} and sampling_defaults(None) == {}


def test_the_command_line_wins_then_the_model_then_fmoe():
    recommended = {"temperature": 0.6, "top_k": 20}
    used, source = ChatOptions(top_p=0.5).sampling(recommended)
    assert used == {**SAMPLING, "temperature": 0.6, "top_p": 0.5, "top_k": 20}
    assert source == "the model's generation_config.json"
    used, source = ChatOptions(temperature=0.0, top_k=0).sampling(recommended)
    assert used == {**SAMPLING, "temperature": 0.0, "top_k": 0} and source == ""  # nothing taken from the model
    assert ChatOptions().sampling({}) == (SAMPLING, "")


def test_a_request_s_sampling_then_the_model_s_then_openai_s():
    from fmoe_cli.serve.app import request_sampling
    from fmoe_cli.serve.protocol import ChatRequest

    request = ChatRequest(messages=[{"role": "user", "content": "hi"}], top_p=0.5, seed=3)
    assert request_sampling(request, {"temperature": 0.6, "top_k": 20}) == SamplingParams(0.6, 0.5, 3, 20, 0.0)
    assert request_sampling(request, {}) == SamplingParams(1.0, 0.5, 3, 0, 0.0)
    request = ChatRequest(messages=[{"role": "user", "content": "hi"}], top_k=0, min_p=0.1)
    assert request_sampling(request, {"top_k": 20}) == SamplingParams(1.0, 1.0, None, 0, 0.1)
    request = ChatRequest(messages=[{"role": "user", "content": "hi"}], top_k=-1)  # vLLM's "off"
    assert request_sampling(request, {"top_k": 20}).top_k == 0


def test_the_repetition_penalty_is_transformers_and_counts_the_whole_conversation(checkpoints):
    """Greedy with a repetition penalty: transformers' generate's tokens, also where the generation continues a
    conversation whose earlier tokens are only in the KV cache (`history`: they are penalized too)."""
    import transformers
    from transformers import RepetitionPenaltyLogitsProcessor

    from fmoe_cli.generate import new_cache, next_logits, penalize_repeats, stream_generate
    from fmoe_cli.models.load import load_model
    from fmoe_cli.offload.engine import Engine
    from fmoe_cli.offload.link import EmulatedLink, VirtualClock
    from fmoe_cli.planning.presets import make_settings

    logits, seen = torch.tensor([2.0, -1.0, 0.5, -3.0, 1.0]), torch.tensor([1, 2, 2, 4])
    want = RepetitionPenaltyLogitsProcessor(1.3)(seen[None], logits[None].clone())[0]
    assert torch.equal(penalize_repeats(logits, seen, 1.3), want)

    path = checkpoints["qwen3_moe"]
    prompt = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11, 64, 128, 5, 17]])
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    want = reference.generate(prompt, max_new_tokens=24, do_sample=False, repetition_penalty=1.3)[0, 12:].tolist()
    assert want != reference.generate(prompt, max_new_tokens=24, do_sample=False)[0, 12:].tolist()  # it matters
    lm = load_model(str(path), device="cpu", dtype="float32")
    engine = Engine(lm.layers, lm.store, lm.shape, EmulatedLink(gbps=20, clock=VirtualClock()), lm.device, lm.dtype)
    engine.install(lm.model)
    engine.configure(make_settings("resident", lm.shape, lm.shape.all_experts_bytes))
    greedy = SamplingParams(0.0, repetition_penalty=1.3)
    try:
        got = [e.token_id for e in stream_generate(lm.model, prompt, engine=engine, max_new_tokens=24,
                                                   sampling=greedy, stop_on_eos=False)]
        assert got == want
        # The conversation continued: the prompt and the answer's first 11 tokens in the cache alone (the tokens a
        # model repeats are its answer's), the 12th the new input; the rest of the answer must follow.
        so_far = torch.cat([prompt, torch.tensor([want[:11]])], dim=1)
        cache = new_cache(lm.model)
        next_logits(lm.model, so_far, cache)
        got = [e.token_id for e in stream_generate(lm.model, torch.tensor([want[11:12]]), engine=engine,
                                                   max_new_tokens=12, sampling=greedy, stop_on_eos=False,
                                                   past_key_values=cache, history=so_far[0].tolist())]
        assert got == want[12:]
    finally:
        engine.close()


def test_the_repetition_penalty_s_whole_range_draws_a_token():
    """At the range's ends (types.REPETITION_PENALTY_RANGE, what chat and serve accept) a penalised logit stays finite:
    a draw, not 'probability tensor contains inf or nan' (1e-39 made a logit of 80 inf and the draw inf − inf)."""
    from fmoe_cli.types import REPETITION_PENALTY_RANGE

    logits = torch.linspace(-80.0, 80.0, 64)
    seen = torch.tensor([63, 0, 5])
    for penalty in REPETITION_PENALTY_RANGE:
        for temperature in (0.0, 0.7):
            token = sample_next(logits, SamplingParams(temperature, repetition_penalty=penalty), torch.Generator(), seen)
            assert 0 <= token < 64
    with pytest.raises(RuntimeError):  # (what the range keeps out)
        sample_next(logits, SamplingParams(0.7, repetition_penalty=1e-39), torch.Generator(), seen)


def test_the_header_names_where_defaults_came_from_only_where_they_count():
    """Greedy reads no other sampling field: `--temperature 0` is not 'defaults: the model's generation_config.json'."""
    from fmoe_cli.chat.repl import sampling_line

    source = "the model's generation_config.json"
    assert sampling_line(SamplingParams(0.0), source) == "sampling greedy (temperature 0)"
    assert sampling_line(SamplingParams(0.0, repetition_penalty=1.1), source).endswith(f"(defaults: {source})")
    assert sampling_line(SamplingParams(0.6, top_p=0.95, top_k=20), source) == (
        f"sampling temperature 0.6 · top-p 0.95 · top-k 20 (defaults: {source})")
