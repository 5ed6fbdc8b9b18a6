"""`fmoe bench`: the JSON object, the ratios, --compare with every policy, identical tokens,
the trace it records, the 80-column table, --prompt-file."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch
from rich.console import Console
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from fmoe_cli.bench.run import encode_prompt, read_prompt, render
from fmoe_cli.trace import read_trace
from fmoe_cli.cli import app
from fmoe_cli.errors import FmoeError
from fmoe_cli.planning.presets import PRESETS, parse_policies

TOKENS = 5
RUN_KEYS = {"policy": str, "ttft_ms": float, "tpot_ms": dict, "tokens_per_s": float, "hit_rate": float,
            "prefetch_precision": float, "prefetch_recall": float, "exposed_load_ms_per_token": float,
            "bytes_per_token": float, "peak_device_bytes": int, "token_ids": list}


@pytest.fixture(scope="module")
def compare_all(checkpoints, tmp_path_factory):
    """One `fmoe bench --compare all --json --trace-out` run over a tiny Mixtral (emulated link)."""
    trace = tmp_path_factory.mktemp("bench") / "trace.jsonl"
    result = CliRunner().invoke(app, [
        "bench", str(checkpoints["mixtral"]), "--compare", "all", "--tokens", str(TOKENS), "--warmup", "1",
        "--device", "cpu", "--emulate-link", "20", "--json", "--trace-out", str(trace),
        "--prompt", "What does a router do?",
    ])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), trace


def test_json_schema(compare_all):
    report, _ = compare_all
    assert isinstance(report["model"], str) and report["device"] == "cpu"
    assert report["link"]["kind"] == "emulated" and report["link"]["gbps"] == 20
    assert "emulated" in report["link"]["label"]
    for run in report["runs"]:
        for key, kind in RUN_KEYS.items():
            assert isinstance(run[key], kind), (run["policy"], key)
        assert set(run["tpot_ms"]) == {"median", "p90"}
        assert 0 < run["tpot_ms"]["median"] <= run["tpot_ms"]["p90"]
        assert 0 <= run["hit_rate"] <= 1 and 0 <= run["prefetch_precision"] <= 1 and 0 <= run["prefetch_recall"] <= 1
        assert run["peak_device_bytes"] > 0 and len(run["token_ids"]) == TOKENS
    by_policy = {r["policy"]: r for r in report["runs"]}
    assert by_policy["resident"]["hit_rate"] == 1.0 and by_policy["resident"]["bytes_per_token"] == 0
    assert by_policy["ondemand"]["hit_rate"] == 0.0 and by_policy["ondemand"]["prefetch_precision"] == 0.0
    assert by_policy["ondemand"]["bytes_per_token"] > 0


def test_compare_runs_every_policy_with_identical_tokens(compare_all, checkpoints):
    report, _ = compare_all
    assert [r["policy"] for r in report["runs"]] == list(PRESETS)
    ids = {tuple(r["token_ids"]) for r in report["runs"]}
    assert len(ids) == 1 and report["token_ids_identical"] is True
    # … and they are transformers' own greedy tokens for the same prompt.
    from fmoe_cli.models.load import load_model

    lm = load_model(str(checkpoints["mixtral"]), device="cpu", console=Console(file=io.StringIO()))
    prompt_ids = encode_prompt(lm, "What does a router do?")
    model = AutoModelForCausalLM.from_pretrained(checkpoints["mixtral"], dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(prompt_ids, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False,
                             pad_token_id=lm.tokenizer.pad_token_id)
    assert list(ids)[0] == tuple(out[0, prompt_ids.shape[1]:].tolist())
    assert report["prompt_tokens"] == prompt_ids.shape[1]


def test_ratios_are_to_the_first_policy(compare_all):
    report, _ = compare_all
    base = report["runs"][0]
    assert report["ratios_to"] == base["policy"] == "moepic"
    for run in report["runs"]:
        r = run["ratios"]
        assert r["tpot_median"] == pytest.approx(run["tpot_ms"]["median"] / base["tpot_ms"]["median"])
        assert r["tpot_p90"] == pytest.approx(run["tpot_ms"]["p90"] / base["tpot_ms"]["p90"])
        assert r["ttft"] == pytest.approx(run["ttft_ms"] / base["ttft_ms"])
        assert r["tokens_per_s"] == pytest.approx(run["tokens_per_s"] / base["tokens_per_s"])
    assert base["ratios"]["tpot_median"] == 1.0


def test_trace_out_holds_each_measured_run(compare_all):
    report, path = compare_all
    trace = read_trace(path)
    assert [s.id for s in trace.sequences] == list(PRESETS)  # one sequence per policy, warm-up left out
    per_run = report["prompt_tokens"] + TOKENS - 1  # the last token is generated, never fed
    assert all(len(s.tokens) == per_run for s in trace.sequences)
    assert trace.layers == (0, 1, 2, 3) and trace.num_experts == 8
    lines = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    with_prediction = {rec["seq"] for rec in lines if "predicted" in rec}
    assert "lru" in with_prediction  # the prefetching policies record their ranking
    moepic = next(run for run in report["runs"] if run["policy"] == "moepic")
    assert ("moepic" in with_prediction) == ("no prefetch" not in moepic["plan"])  # as its plan says
    assert "ondemand" not in with_prediction  # no prefetch, no prediction
    # Routing is the model's, not the policy's: every policy's trace routes identically.
    routes = {tuple(tuple(r.experts) for layer in s.records for r in layer) for s in trace.sequences}
    assert len(routes) == 1


def test_table_fits_80_columns(compare_all):
    report, _ = compare_all
    out = io.StringIO()
    render(report, Console(file=out, width=80, color_system=None))
    lines = out.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert "emulated 20 GB/s" in out.getvalue()
    rows = [line for line in lines if line.split()[:1] and line.split()[0] in PRESETS]
    assert [row.split()[0] for row in rows] == list(PRESETS)
    for row in rows:  # one line per policy, every cell whole (no wrapping, no ellipsis)
        cells = row.split()
        assert len(cells) == 13 and "…" not in row  # … the host lane's ms per token among them
        assert all(re.fullmatch(r"[0-9.]+|–", c) for c in cells[1:])
    assert rows[0].split()[-1] == "1.00"


def test_prompt_file_and_policy_parsing(tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("Why is the sky blue?\n", encoding="utf-8")
    assert read_prompt(None, str(f)) == "Why is the sky blue?\n"
    with pytest.raises(FmoeError, match="not both"):
        read_prompt("x", str(f))
    with pytest.raises(FmoeError, match="does not exist"):
        read_prompt(None, str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(FmoeError, match="empty"):
        read_prompt(None, str(tmp_path / "empty.txt"))
    assert parse_policies(None, None) == ["moepic", "lru", "resident"]
    assert parse_policies(["lru"], "moepic,lru,lfu") == ["lru", "moepic", "lfu"]
    assert parse_policies(None, "all") == list(PRESETS)


def test_prompt_file_on_the_command_line(checkpoints, tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("Tell me about experts.", encoding="utf-8")
    result = CliRunner().invoke(app, ["bench", str(checkpoints["mixtral"]), "--policy", "lru", "--tokens", "2",
                                      "--warmup", "0", "--device", "cpu", "--prompt-file", str(f), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [r["policy"] for r in report["runs"]] == ["lru"]
    # no GPU, no --emulate-link: bench emulates a link shaped like a consumer card (tests/test_reference.py)
    assert report["link"]["kind"] == "emulated" and "shaped like" in report["link"]["label"]


def test_lcp_omega_and_rho_are_settable(checkpoints, compare_all):
    """--lcp-omega/--lcp-rho reach the LCP policy; other values never change the tokens; bad ones are refused."""
    from fmoe_cli.offload.policies import make_policy
    from fmoe_cli.planning.presets import make_settings
    from fmoe_cli.types import ExpertShape

    shape = ExpertShape(num_layers=2, num_experts=8, top_k=2, hidden=8, intermediate=8, dtype_bytes=4)
    settings = make_settings("uniform", shape, 10**6, omega=16, rho=0.5)
    assert (settings.omega, settings.rho) == (16, 0.5)
    policy = make_policy("lcp", 8, omega=16, rho=0.5)
    assert (policy.omega, policy.rho) == (16, 0.5)
    base, _ = compare_all
    result = CliRunner().invoke(app, [
        "bench", str(checkpoints["mixtral"]), "--policy", "uniform", "--tokens", str(TOKENS), "--warmup", "1",
        "--device", "cpu", "--emulate-link", "20", "--json", "--prompt", "What does a router do?",
        "--lcp-omega", "1", "--lcp-rho", "0.01",
    ])
    assert result.exit_code == 0, result.output
    run = json.loads(result.stdout)["runs"][0]
    assert run["token_ids"] == next(r for r in base["runs"] if r["policy"] == "uniform")["token_ids"]
    for bad in (["--lcp-rho", "1.5"], ["--lcp-omega", "0"]):
        result = CliRunner().invoke(app, ["bench", str(checkpoints["mixtral"]), "--device", "cpu", *bad])
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
        assert "LCP needs" in result.output


def test_rounds_interleave_the_policies_in_one_process_and_replan_each_run(checkpoints, monkeypatch, tmp_path):
    """Issue 22 §5: `--rounds N` runs every policy once a round in this process, the order reversed every other
    round; each run after the first is configured afresh (its cache warmed again) and a configured plan (`moepic`)
    is made again from the statistics so far; the figures are the medians of the rounds', the ratio also paired
    within each round; every round's tokens are the same; the trace keeps each measured run apart."""
    import statistics

    import fmoe_cli.bench.run as bench_run
    import fmoe_cli.run as run_module

    calls, planned = [], []
    real_bench, real_plan = bench_run.bench_policy, run_module.settings_for

    def spy_bench(lm, engine, settings, *args, configure=True, **kwargs):
        calls.append((settings.policy, configure))
        return real_bench(lm, engine, settings, *args, configure=configure, **kwargs)

    def spy_plan(policy, *args, **kwargs):
        planned.append(policy)
        return real_plan(policy, *args, **kwargs)

    monkeypatch.setattr(bench_run, "bench_policy", spy_bench)
    monkeypatch.setattr(run_module, "settings_for", spy_plan)
    trace = tmp_path / "rounds.jsonl"
    result = CliRunner().invoke(app, [
        "bench", str(checkpoints["mixtral"]), "--policy", "moepic", "--policy", "lru", "--policy", "ondemand",
        "--rounds", "3", "--tokens", "3", "--warmup", "1", "--device", "cpu", "--emulate-link", "20", "--json",
        "--trace-out", str(trace)])
    assert result.exit_code == 0, result.output
    order = ["moepic", "lru", "ondemand"]
    assert [p for p, _ in calls] == order + order[::-1] + order
    assert [c for _, c in calls] == [False] + [True] * 8  # only the first run takes open_run's configuration
    assert planned.count("moepic") == 3  # when the run opened, then in rounds 2 and 3
    report = json.loads(result.stdout)
    assert report["rounds"] == 3 and [r["policy"] for r in report["runs"]] == order
    base = report["runs"][0]
    for run in report["runs"]:
        medians = [x["tpot_ms"]["median"] for x in run["rounds"]]
        assert len(medians) == 3 and run["tpot_ms"]["median"] == statistics.median(medians)
        assert run["hit_rate"] == statistics.median(x["hit_rate"] for x in run["rounds"])
        paired = [m / b["tpot_ms"]["median"] for m, b in zip(medians, base["rounds"])]
        assert run["ratios"]["tpot_paired"] == {"median": statistics.median(paired), "min": min(paired),
                                                "max": max(paired), "rounds": 3}
    assert next(r for r in report["runs"] if r["policy"] == "ondemand")["hit_rate"] == 0.0
    assert report["token_ids_identical"] is True
    assert [s.id for s in read_trace(trace).sequences] == [f"{p}-round{n}" for n, names in
                                                           enumerate([order, order[::-1], order], 1) for p in names]
    out = io.StringIO()
    render(report, Console(file=out, width=80, color_system=None))
    assert all(len(line) <= 80 for line in out.getvalue().splitlines())
    assert re.search(r"lru +3 rounds, [0-9.]+–[0-9.]+ ms · paired [0-9.]+ \([0-9.]+–[0-9.]+\)", out.getvalue())


def test_combine_rounds_takes_each_figure_s_median():
    """A policy's rounds as one row: medians (not means) of every figure, the highest peak, the last plan, the first
    round's tokens; a round cut short by Ctrl-C marks the row partial. One round keeps its `rounds` too."""
    from fmoe_cli.bench.run import RunResult, combine_rounds

    def result(tpot: float, hit: float, peak: int, plan: str, measured=None) -> RunResult:
        return RunResult(policy="lru", ttft_ms=tpot * 10, tpot_ms={"median": tpot, "p90": tpot + 1},
                         tokens_per_s=1000 / tpot, hit_rate=hit, prefetch_precision=0.5, prefetch_recall=0.5,
                         exposed_load_ms_per_token=tpot / 10, bytes_per_token=100.0, peak_device_bytes=peak, plan=plan,
                         token_ids=[int(tpot)], measured=measured)

    one = combine_rounds([result(5.0, 0.1, 10, "a")])  # Ctrl-C left one round of this policy
    assert one.tpot_ms == {"median": 5.0, "p90": 6.0} and [r["plan"] for r in one.rounds] == ["a"]
    row = combine_rounds([result(10.0, 0.2, 30, "a"), result(1.0, 0.9, 10, "b"), result(4.0, 0.3, 20, "c", 2)])
    assert row.tpot_ms == {"median": 4.0, "p90": 5.0} and row.ttft_ms == 40.0 and row.hit_rate == 0.3
    assert row.tokens_per_s == 250.0 and row.exposed_load_ms_per_token == 0.4
    assert row.peak_device_bytes == 30 and row.plan == "c" and row.token_ids == [10] and row.measured == 2
    assert [r["plan"] for r in row.rounds] == ["a", "b", "c"] and row.rounds[0]["tpot_ms"]["median"] == 10.0


def test_a_gpu_runs_every_policy_once_unmeasured_before_the_rounds(checkpoints, monkeypatch, tmp_path):
    """Issue 37 §6: on a GPU (`warm_round_tokens` > 0; here patched, the CPU has none) every policy first runs once,
    unmeasured, so that the process's warm-up is not the first measured policy's; then the rounds run as without it,
    each configured afresh, and the trace and the report hold only the measured runs."""
    import fmoe_cli.bench.run as bench_run

    calls = []
    real_bench = bench_run.bench_policy

    def spy_bench(lm, engine, settings, prompt_ids, tokens, *args, configure=True, **kwargs):
        calls.append((settings.policy, tokens, configure))
        return real_bench(lm, engine, settings, prompt_ids, tokens, *args, configure=configure, **kwargs)

    monkeypatch.setattr(bench_run, "bench_policy", spy_bench)
    monkeypatch.setattr(bench_run, "warm_round_tokens", lambda device: 2)
    trace = tmp_path / "warm.jsonl"
    result = CliRunner().invoke(app, [
        "bench", str(checkpoints["mixtral"]), "--policy", "lru", "--policy", "ondemand", "--rounds", "2",
        "--tokens", "3", "--warmup", "1", "--device", "cpu", "--emulate-link", "20", "--json", "--trace-out", str(trace)])
    assert result.exit_code == 0, result.output
    assert calls == [("lru", 2, False), ("ondemand", 2, True),  # the warm round: open_run configured lru
                     ("lru", 3, True), ("ondemand", 3, True), ("ondemand", 3, True), ("lru", 3, True)]
    report = json.loads(result.stdout)
    assert report["warm_round_tokens"] == 2 and all(len(r["rounds"]) == 2 for r in report["runs"])
    assert all(len(r["token_ids"]) == 3 for r in report["runs"])
    assert [s.id for s in read_trace(trace).sequences] == ["lru-round1", "ondemand-round1", "ondemand-round2",
                                                           "lru-round2"]
