"""`fmoe bench --replay-routing TRACE` (fmoe_cli/bench/routing.py): every router's top-k from a trace.

The engine gets exactly the trace's experts and weights, layer by layer, token by token (its observers' events and
its counters, not the tokens); `--trace-out` of a replayed run records the input trace's experts token for token,
across the trace's sequences; the trace's own rankings reach the prefetcher (`--predictor trace`); a trace of
another shape is one `error:` line, exit 2, before a weight is read."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from fmoe_cli.bench.routing import ReplayedRouting
from fmoe_cli.cli import app
from fmoe_cli.generate import stream_generate
from fmoe_cli.models.load import load_model
from fmoe_cli.offload.engine import open_engine
from fmoe_cli.planning.presets import make_settings
from fmoe_cli.trace import TraceWriter, read_trace

# the tiny Mixtral of conftest: 4 MoE layers, 8 experts, top-2
LAYERS, EXPERTS, TOP_K = 4, 8, 2


def write_trace(path, *, layers=LAYERS, experts=EXPERTS, top_k=TOP_K, sequences=(7, 30), rankings=False, seed=0):
    """Random routing (seeded): distinct experts, weights summing to 1, and with `rankings` a random full ranking
    per (token, layer); `sequences`: each sequence's token count."""
    g = torch.Generator().manual_seed(seed)
    with TraceWriter(path, num_layers=layers, num_experts=experts, top_k=top_k, model="synthetic") as w:
        for s, length in enumerate(sequences):
            for t in range(length):
                for j in range(layers):
                    ids = torch.randperm(experts, generator=g)[:top_k].tolist()
                    probs = torch.rand(top_k, generator=g, dtype=torch.float64)
                    predicted = torch.randperm(experts, generator=g).tolist() if rankings else None
                    w.record(f"s{s}", t, j, ids, (probs / probs.sum()).tolist(), predicted)
    return path


def stream(trace):
    """The trace's records as one stream: [token][layer] -> record (its sequences one after another)."""
    return [[seq.records[j][t] for j in range(len(trace.layers))] for seq in trace.sequences
            for t in range(len(seq.tokens))]


def quiet() -> Console:
    return Console(file=open(os.devnull, "w"))


# Hunyuan: the gate module around its matrix `wg`; Gemma 4: its router module, which the decoder layer calls itself;
# AFMoE, LFM2-MoE, HY-V3, MiniMax-M2: routers called with their block's bias beside the hidden state (AFMoE: a dense
# first layer, 3 MoE layers)
@pytest.mark.parametrize("family", ["mixtral", "hunyuan_v1_moe", "gemma4_text", "afmoe", "lfm2_moe", "hy_v3",
                                    "minimax_m2"])
def test_engine_gets_the_traces_experts_and_weights(checkpoints, tmp_path, family):
    trace = read_trace(write_trace(tmp_path / "t.jsonl", layers=LAYERS + 2))  # more layers: the first ones replay
    if family in ("lfm2_moe", "hy_v3", "minimax_m2"):  # (the survey's tiny checkpoints)
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
        import families_survey

        path = families_survey.build(family, tmp_path / family)
    else:
        path = checkpoints[family]
    lm = load_model(str(path), device="cpu", console=quiet())
    engine = open_engine(lm)
    shape = lm.shape
    engine.configure(make_settings("ondemand", shape, shape.min_staging_slots * shape.expert_bytes))
    events = []
    engine.observers.append(lambda e: events.append((e.layer, e.top_k_index.clone(), e.top_k_weights.clone())))
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    new_tokens = 12

    def run() -> list:
        events.clear()
        before = [state.counters.activations for state in engine.layers]
        list(stream_generate(lm.model, prompt, engine=engine, max_new_tokens=new_tokens, stop_on_eos=False))
        return [state.counters.activations - b for state, b in zip(engine.layers, before)]

    own = run()  # the model's own routing first: the trace's is another (else the test could not tell them apart)
    own_ids = [ids.tolist() for _, ids, _ in events]
    replay = ReplayedRouting(trace, shape)
    replay.install(lm.layers)
    try:
        replay.restart()
        activations = run()
    finally:
        replay.uninstall()
        engine.close()
        lm.store.close()
    routed = prompt.shape[1] + new_tokens - 1  # the last token is never fed back
    records = stream(trace)[:routed]
    assert shape.num_layers >= 3
    for j in range(shape.num_layers):
        ids = torch.cat([i for layer, i, _ in events if layer == j])
        weights = torch.cat([w for layer, _, w in events if layer == j])
        assert ids.tolist() == [list(records[t][j].experts) for t in range(routed)]
        assert torch.equal(weights, torch.tensor([records[t][j].probs for t in range(routed)]).to(weights.dtype))
        # the counters: the prefill's distinct experts, then each decode token's K (ondemand: every one loaded)
        want = len({e for t in range(prompt.shape[1]) for e in records[t][j].experts}) + TOP_K * (new_tokens - 1)
        assert activations[j] == want
    assert own_ids != [ids.tolist() for _, ids, _ in events] and sum(own) > 0


def bench(args):
    return CliRunner().invoke(app, ["bench", *args, "--device", "cpu", "--emulate-link", "20"])


def test_trace_out_of_a_replayed_run_records_the_input_trace(checkpoints, tmp_path):
    source = write_trace(tmp_path / "in.jsonl", layers=LAYERS + 1, rankings=True)  # 7 + 30 tokens
    out = tmp_path / "out.jsonl"
    tokens = 12
    result = bench([str(checkpoints["mixtral"]), "--replay-routing", str(source), "--compare", "lru,prefetch-only",
                    "--predictor", "trace", "--tokens", str(tokens), "--warmup", "2", "--prompt", "What does a router do?",
                    "--trace-out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["routing"]["replayed_from"] == str(source) and report["routing"]["layers"] == LAYERS
    assert report["routing"]["note"].startswith(f"routing: replayed from {source}")
    assert report["token_ids_identical"] and report["predictor"] == "trace"
    prompt = report["prompt_tokens"]
    assert prompt + tokens - 1 > 7  # the run crosses from the trace's first sequence into its second
    want = stream(read_trace(source))
    recorded = read_trace(out)
    assert sorted(s.id for s in recorded.sequences) == ["lru", "prefetch-only"]
    for seq in recorded.sequences:
        assert len(seq.tokens) == prompt + tokens - 1
        for t in range(len(seq.tokens)):
            for j in range(LAYERS):
                got, source_record = seq.records[j][t], want[t][j]
                assert got.experts == source_record.experts
                assert got.probs == pytest.approx(source_record.probs, rel=1e-6)
                if seq.id == "prefetch-only" and t >= prompt:  # a decode token: the trace's ranking prefetched it
                    assert got.predicted == source_record.predicted
    by_policy = {r["policy"]: r for r in report["runs"]}
    assert by_policy["prefetch-only"]["prefetch_precision"] > 0


def test_text_output_says_the_routing_is_replayed(checkpoints, tmp_path):
    source = write_trace(tmp_path / "in.jsonl")
    result = bench([str(checkpoints["mixtral"]), "--replay-routing", str(source), "--policy", "ondemand",
                    "--tokens", "3", "--warmup", "1", "--predictor", "eam", "--prompt", "Hi"])
    assert result.exit_code == 0, result.output
    assert f"routing: replayed from {source}" in result.stdout


@pytest.mark.parametrize("shape, message", [
    (dict(experts=16), "the trace routes over 16 experts a layer, the model has 8"),
    (dict(top_k=3), "the trace activates 3 experts a token, the model 2 (top-k)"),
    (dict(layers=3), "the trace has 3 MoE layers, the model 4"),
])
def test_a_trace_of_another_shape_is_refused_before_the_weights(checkpoints, tmp_path, monkeypatch, shape, message):
    def no_weights(*args, **kwargs):
        raise AssertionError("weights read before the trace's shape was checked")

    monkeypatch.setattr("fmoe_cli.models.load.read_checkpoint", no_weights)
    source = write_trace(tmp_path / "in.jsonl", **shape)
    result = bench([str(checkpoints["mixtral"]), "--replay-routing", str(source), "--tokens", "3"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output


def test_bad_replay_options_are_refused_at_once(checkpoints, tmp_path):
    source = write_trace(tmp_path / "in.jsonl", sequences=(5,))
    for args, message in (
        (["--replay-routing", str(source), "--tokens", "6"], "holds 5 tokens"),
        (["--replay-routing", str(tmp_path / "missing.jsonl")], "does not exist"),
        (["--predictor", "trace"], "needs fmoe bench --replay-routing"),
        (["--replay-routing", str(source), "--predictor", "trace", "--tokens", "2"], "has no rankings"),
    ):
        result = bench([str(checkpoints["mixtral"]), *args])
        assert result.exit_code == 2, (args, result.output)
        assert result.output.startswith("error: ") and message in result.output, (args, result.output)
    # the default prompt (43 tokens of the tiny tokenizer) is longer than the trace: once it is encoded (the model
    # loaded), one line
    result = bench([str(checkpoints["mixtral"]), "--replay-routing", str(source), "--tokens", "4"])
    assert result.exit_code == 2 and result.output.strip().splitlines()[-1].startswith("error: ")
    assert "use a shorter prompt" in result.output


def test_a_router_that_does_not_return_its_top_k_is_refused_in_one_line(checkpoints, tmp_path):
    """Inkling's router returns four values: refused at its first forward (where the model's own call gives it its
    arguments), one line, exit 2."""
    source = write_trace(tmp_path / "in.jsonl", sequences=(60,))
    result = bench([str(checkpoints["inkling_text"]), "--replay-routing", str(source), "--tokens", "3", "--prompt",
                    "a b", "--policy", "lru"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith("error: --replay-routing: the router of ") and "does not return its top-k" in lines[-1]
    assert "Traceback" not in result.output
