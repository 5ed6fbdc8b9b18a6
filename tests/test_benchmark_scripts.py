"""The benchmark scripts' first-run messages (they are not part of the package, but a newcomer runs them)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_routing_report_says_it_needs_the_bible_program():
    """Without Debian's `bible` on PATH the default held-out text cannot be made: one line saying what to install."""
    env = dict(os.environ, PATH="/nonexistent", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "routing_report.py")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "apt-get install bible-kjv" in result.stderr and "--text FILE" in result.stderr  # its own option
    assert "Traceback" not in result.stderr


def benchmark(name: str):
    """A script of benchmarks/ imported as a module (its main() and helpers called in-process)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_simulate_paper_prints_the_issue_s_json_shape(capsys):
    """`benchmarks/simulate.py paper --json`: {"mixtral-int2": {"96": {policy: {"tpot_ms", "ttft_ms"}}, "160": …},
    "qwen1.5-moe-bf16": {"240": …, "480": …}}: the default budgets, then a short run in-process at one budget of
    each (12 tokens of each Mixtral sequence, 2 × 12 synthetic; each budget costs the configurator ~10 s)."""
    import json

    simulate = benchmark("simulate")
    defaults = simulate.parser().parse_args(["paper"])
    assert defaults.trace is None  # $FMOE_MIXTRAL_TRACE, else traces/demo.jsonl (said in one line)
    assert defaults.mixtral_budgets == [96, 160] and defaults.qwen_budgets == [240, 480]
    simulate.main(["paper", "--json", "--limit", "12", "--sequences", "2", "--tokens", "12", "--prompt", "4",
                   "--mixtral-budgets", "160", "--qwen-budgets", "480"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report) == {"mixtral-int2", "qwen1.5-moe-bf16"}
    assert set(report["mixtral-int2"]) == {"160"} and set(report["qwen1.5-moe-bf16"]) == {"480"}
    for model in report.values():
        for budget in model.values():
            assert {"moepic", "lru", "lfu", "prefetch-only"} <= set(budget)
            for policy in budget.values():
                assert set(policy) == {"tpot_ms", "ttft_ms"} and policy["tpot_ms"] > 0 and policy["ttft_ms"] > 0
    resident = report["mixtral-int2"]["160"]["resident"]["tpot_ms"]
    assert all(p["tpot_ms"] >= resident * 0.999 for p in report["mixtral-int2"]["160"].values())


def test_the_mixtral_trace_is_found_by_option_or_environment_and_refused_when_missing(tmp_path, monkeypatch, capsys):
    """benchmarks/mixtral_trace.py: --trace first, then $FMOE_MIXTRAL_TRACE, else None (the benchmark says so in one
    line and runs on traces/demo.jsonl); a path given that is not a file is one `error:` line, exit 2."""
    trace = benchmark("mixtral_trace")
    here, there = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    here.write_text("{}\n")
    there.write_text("{}\n")
    monkeypatch.delenv(trace.ENV, raising=False)
    assert trace.find(None) is None
    monkeypatch.setenv(trace.ENV, str(there))
    assert trace.find(None) == there and trace.find(str(here)) == here
    line = trace.absent_line("the demo trace alone")
    assert "\n" not in line and trace.ENV in line and "Mario928/speculative-moe" in line and "216e26e" in line
    for option, env, named in ((str(tmp_path / "none.jsonl"), str(there), "--trace"), (None, str(tmp_path), trace.ENV)):
        monkeypatch.setenv(trace.ENV, env)
        with pytest.raises(SystemExit) as stop:
            trace.find(option)
        assert stop.value.code == 2
        assert capsys.readouterr().err.startswith(f"error: {named} ")


def test_synthetic_routing_has_the_shape_it_was_fitted_to():
    simulate = benchmark("simulate")

    target = {"top_share": 0.183, "overlap": 0.397, "experts": 8, "top_k": 2}
    zipf, stick = simulate.fit_synthetic(target, 60, 4)
    seqs = simulate.synthetic_routing(1, 60, 4, 1, 3000, zipf=zipf, stick=stick, seed=3)
    counts = [0] * 60
    same = 0
    for n, token in enumerate(seqs[0]):
        assert len(set(token.experts[0])) == 4
        for e in token.experts[0]:
            counts[e] += 1
        if n:
            same += len(set(token.experts[0]) & set(seqs[0][n - 1].experts[0]))
    share = max(counts) / sum(counts) * 60
    assert abs(share - 0.183 * 8) < 0.2, share
    assert abs(same / (2999 * 4) - 0.397) < 0.04


def test_link_policies_pairs_moepic_with_each_policy_within_a_round():
    """benchmarks/link_policies.py: moepic ÷ P is taken round by round (the same process), then its median and
    spread; a round whose machine was slow for every policy cancels out of the pair. The best other policy is
    the one of least median TPOT, `resident` excluded."""
    link_policies = benchmark("link_policies")
    tpot = {"moepic": [10.0, 20.0, 11.0], "uniform": [9.0, 19.0, 12.0], "ondemand": [11.5, 11.5, 11.5],
            "resident": [5.0, 5.0, 5.0]}
    row = link_policies.summarise(tpot, ["a", "b", "c"])
    assert row["best_other"] == "ondemand"  # median 11.5 against uniform's 12.0 (resident's 5.0 is no baseline)
    uniform = row["moepic_over"]["uniform"]
    assert uniform["rounds"] == [10 / 9, 20 / 19, 11 / 12]
    assert uniform["median"] == 20 / 19 and uniform["min"] == 11 / 12 and uniform["max"] == 10 / 9
    assert row["moepic_over_best"] == row["moepic_over"]["ondemand"]
    assert row["moepic_over_best_medians"] == 11.0 / 11.5


def test_link_policies_reports_the_host_costs_each_link_planned_from(tmp_path):
    """benchmarks/link_policies.py: each link's quick estimate (or profile) in its config directory gives the
    engine's costs the configurator planned from (h_pf decides whether moepic prefetches at 4 GB/s); with --raw
    the link's saved files are kept. A statistics file (no such figures) is copied, not reported."""
    import json

    link_policies = benchmark("link_policies")
    profiles = tmp_path / "link-4" / "fmoe" / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "demo-abc.quick.json").write_text(json.dumps({"model": {"t_host_prefetch": 1.9e-4,
                                                                        "t_host_load": 6e-5, "top_k": 4}}))
    (profiles / "demo-abc.stats.json").write_text(json.dumps({"layers": []}))
    found = link_policies.plan_inputs(tmp_path / "link-4", tmp_path / "raw")
    assert found == {"demo-abc.quick.json": {"t_host_load": 6e-5, "t_host_prefetch": 1.9e-4}}
    assert (tmp_path / "raw" / "fmoe" / "profiles" / "demo-abc.stats.json").exists()


def test_link_policies_cuts_one_round_out_of_a_process_s_rounds():
    """benchmarks/link_policies.py: the rounds of one `fmoe bench --rounds N` process read as N one-round reports
    (what summarise and --pool take), each run's figures that round's; a one-round report is itself."""
    link_policies = benchmark("link_policies")
    report = {"rounds": 2, "runs": [
        {"policy": "moepic", "tpot_ms": {"median": 9.0, "p90": 9.0}, "plan": "b", "rounds": [
            {"tpot_ms": {"median": 8.0, "p90": 8.5}, "plan": "a"}, {"tpot_ms": {"median": 10.0, "p90": 11.0}, "plan": "b"}]},
        {"policy": "ondemand", "tpot_ms": {"median": 7.0, "p90": 7.0}, "plan": "o", "rounds": [
            {"tpot_ms": {"median": 6.0, "p90": 6.0}, "plan": "o"}, {"tpot_ms": {"median": 7.5, "p90": 8.0}, "plan": "o"}]}]}
    first = link_policies.one_round(report, 0)
    assert [(r["policy"], r["tpot_ms"]["median"], r["plan"]) for r in first["runs"]] == [("moepic", 8.0, "a"),
                                                                                        ("ondemand", 6.0, "o")]
    assert [r["tpot_ms"]["median"] for r in link_policies.one_round(report, 1)["runs"]] == [10.0, 7.5]
    single = {"rounds": 1, "runs": [{"policy": "lru", "tpot_ms": {"median": 3.0}}]}
    assert link_policies.one_round(single, 0) is single


def _raw_round(directory: Path, r: int, link: str, tpot: dict[str, float], prefetch: bool = True) -> None:
    import json

    runs = [{"policy": p, "tpot_ms": {"median": t},
             "plan": "configurator: …" + ("" if prefetch or p != "moepic" else ", no prefetch")} for p, t in tpot.items()]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"round{r}-link{link}.json").write_text(json.dumps({"runs": runs}))


def test_link_policies_pools_the_rounds_of_earlier_runs(tmp_path):
    """benchmarks/link_policies.py --pool: the rounds of several runs' --raw directories, per link; moepic ÷ each
    policy paired within each round, median and quartiles over the pooled rounds, apart by whether moepic's plan
    prefetched (its plan's summary ends in 'no prefetch' when not)."""
    link_policies = benchmark("link_policies")
    for n, (moepic, prefetch) in enumerate([(10.0, True), (12.0, False), (9.0, False)]):
        _raw_round(tmp_path / f"run{n}", 1, "4", {"moepic": moepic, "ondemand": 10.0, "resident": 5.0}, prefetch)
    _raw_round(tmp_path / "run0", 1, "16", {"moepic": 8.0, "ondemand": 10.0, "resident": 5.0})
    rounds = link_policies.read_rounds([tmp_path / f"run{n}" for n in range(3)])
    assert sorted(rounds) == ["16", "4"] and len(rounds["4"]) == 3
    row = link_policies.pool_summary(rounds["4"], per_run=5)
    assert row["rounds"] == 3
    assert row["moepic_over"]["all"]["ondemand"]["median"] == 1.0
    assert row["moepic_over"]["prefetch"]["ondemand"]["rounds"] == 1
    assert row["moepic_over"]["no prefetch"]["ondemand"]["median"] == pytest.approx(1.05)  # 1.2 and 0.9


def test_a_tie_with_the_best_of_several_policies_often_reads_above_the_target_in_one_run():
    """What one run of 5 rounds says (link_policies.pass_rates): rounds drawn from a pool in which moepic ties every
    other policy, each policy's TPOT ±12 % at random in each round. The best other policy is the one of least median
    in the run, so moepic ÷ it reads above 1 more often than below: with six policies tied, a run of 5 rounds meets
    ≤ 1.05 on both readings about half the time (0.50), though moepic loses to none of them; where moepic is 10 %
    faster than every other policy, nearly always (0.96). (On the demo at 4 GB/s the 40 pooled rounds of eight runs gave
    0.49, with moepic's paired medians 0.89–0.98 against every policy: docs/bench.md § `moepic` across links.)"""
    link_policies = benchmark("link_policies")
    rng = random.Random(7)
    policies = ("moepic", "lru", "lfu", "uniform", "cache-only", "prefetch-only", "ondemand")

    def pool(moepic_factor: float) -> list[dict[str, float]]:
        return [{p: 10.0 * (moepic_factor if p == "moepic" else 1.0) * rng.uniform(0.88, 1.12) for p in policies}
                for _ in range(200)]

    tied = link_policies.pass_rates(pool(1.0), per_run=5, draws=2000)
    faster = link_policies.pass_rates(pool(0.9), per_run=5, draws=2000)
    assert tied["both"] < 0.6 and tied["both"] <= min(tied["paired"], tied["ratio_of_medians"])
    assert faster["both"] > 0.9
    # one run's figures: the best other by median TPOT, then moepic ÷ it paired per round and as a ratio of medians
    paired, medians = link_policies.run_verdict([{"moepic": 10.0, "a": 9.0, "b": 12.0}, {"moepic": 11.0, "a": 12.0,
                                                                                         "b": 10.5}])
    assert (paired, medians) == (pytest.approx((10 / 9 + 11 / 12) / 2), pytest.approx(10.5 / 10.5))


def test_a_run_s_interval_resamples_whole_rounds():
    """link_policies.interval: the run's rounds drawn again with replacement, each round whole (its policies stay
    paired): where moepic equals the best other in every round, however far the rounds' levels move, every
    resample reads 1; where it is slower in some rounds, the band spans the run's own reading."""
    link_policies = benchmark("link_policies")
    rng = random.Random(3)
    levels = [rng.uniform(5, 15) for _ in range(9)]
    tied = [{"moepic": v, "ondemand": v, "lru": v * 1.2} for v in levels]
    band = link_policies.interval(tied, draws=500)
    assert band["paired"] == (1.0, 1.0) and band["ratio_of_medians"] == (1.0, 1.0)
    mixed = [{"moepic": v * (1.1 if r % 3 == 0 else 0.97), "ondemand": v, "lru": v * 1.2} for r, v in enumerate(levels)]
    band = link_policies.interval(mixed, draws=500)
    paired, _ = link_policies.run_verdict(mixed)
    assert band["paired"][0] <= paired <= band["paired"][1] and band["paired"][0] < band["paired"][1]


def test_an_aa_test_deals_one_policy_s_runs_out_to_copies_as_rounds_interleave():
    """link_policies --aa: the runs of one policy, in the order they ran, dealt out to copies as `fmoe bench
    --rounds` orders policies (reversed every other round); each copy then read as moepic against the others."""
    link_policies = benchmark("link_policies")
    assert link_policies.aa_copies([1, 2, 3, 4, 5, 6, 7], 3) == [[1, 6], [2, 5], [3, 4]]
    # copy 0 is 10 % slower than the others in every round: it reads 1.1; each other copy 1.0 (the third ties it)
    values = []
    for r in range(4):
        row = [11.0, 10.0, 10.0]
        values += row if r % 2 == 0 else row[::-1]
    row = link_policies.aa_summary(values, 3)
    assert row["rounds"] == 4 and row["medians"] == [11.0, 10.0, 10.0]
    assert row["ratio_of_medians"] == [pytest.approx(1.1), 1.0, 1.0] and row["above_target"] == 1
    assert row["paired"] == [pytest.approx(1.1), 1.0, 1.0]


def test_link_policies_refuses_too_few_rounds_or_copies_in_one_line():
    """link_policies: --rounds 0 or --copies 1 (an A/A test needs two copies) is one argparse error, exit 2, before
    anything runs."""
    for flags in (["--rounds", "0"], ["--aa", "ondemand", "--copies", "1"]):
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "link_policies.py"), *flags],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "at least" in done.stderr and "Traceback" not in done.stderr


def test_peer_llamacpp_options_quick_and_bad_input():
    """benchmarks/peer_llamacpp.py: --quick is the smallest run (demo, f32 and q4, one round of 16 tokens, no waiting),
    an option given beside it wins; without it every model and format, 3 rounds of 64. A model or format it does not
    know, or 0 rounds, is one argparse error, exit 2, before anything is built."""
    peer = benchmark("peer_llamacpp")
    quick = peer.options(["--quick", "--cache-dir", "x"])
    assert (quick.models, quick.formats, quick.rounds, quick.tokens, quick.max_wait, quick.run_wait) == \
        (["demo"], ["f32", "q4"], 1, 16, 0, 0)
    assert quick.cache_dir == Path("x").resolve()
    assert peer.options(["--quick", "--rounds", "2", "--models", "big,demo"]).rounds == 2
    assert peer.options(["--quick", "--models", "big,demo"]).models == ["big", "demo"]
    full = peer.options(["--formats", "q4 q8,q4"])
    assert (full.models, full.formats, full.rounds, full.tokens, full.max_wait) == (["a3b", "big", "demo"],
                                                                                   ["q4", "q8"], 3, 64, 600)
    for flags in (["--models", "mixtral"], ["--formats", "q2"], ["--rounds", "0"], ["--tokens", "x"]):
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peer_llamacpp.py"), *flags],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "error:" in done.stderr and "Traceback" not in done.stderr, flags
        assert not done.stdout


def test_peer_llamacpp_counts_the_bytes_a_decode_token_reads():
    """fmoe_bytes against a plain count of a Qwen3-MoE checkpoint's tensors: a decode token reads every non-expert
    tensor (the LM head whole, one row of the embedding) and top-k of each layer's E experts, each in its format."""
    peer = benchmark("peer_llamacpp")
    h, layers, heads, kv, hd, width, experts, k, vocab = 64, 3, 4, 2, 16, 32, 8, 2, 100
    config = {"hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
              "head_dim": hd, "moe_intermediate_size": width, "num_experts": experts, "num_experts_per_tok": k,
              "vocab_size": vocab}
    per_layer = {"q": heads * hd * h, "k": kv * hd * h, "v": kv * hd * h, "o": h * heads * hd, "q_norm": hd,
                 "k_norm": hd, "input_norm": h, "post_norm": h, "router": experts * h}
    expert = 3 * width * h
    for label, dtype_bytes, expert_bits in (("f32", 4, 32), ("bf16", 2, 16), ("q4", 4, 4.5)):
        dense = sum(per_layer.values()) * layers + h + vocab * h + h  # final norm, LM head, one embedding row
        want = dense * dtype_bytes + layers * k * expert * expert_bits / 8
        assert peer.fmoe_bytes(config, *peer.FMOE_BITS[label]) == pytest.approx(want), label
    # int8 attention (--dense int8): its rows and the head at 8 + 16/128 bits, the small tensors in the dtype
    rows = (per_layer["q"] + per_layer["k"] + per_layer["v"] + per_layer["o"]) * layers + vocab * h
    small = (sum(per_layer.values()) * layers + 2 * h) - (rows - vocab * h)
    assert peer.fmoe_bytes(config, 4, 32, "int8") == pytest.approx(rows * (8 + 16 / 128) / 8 + small * 4
                                                                   + layers * k * expert * 4)


def _peer_run(directory: Path, model: str, label: str, r: int, llama_ms: float, fmoe_ms: float, others: float):
    """A round's raw files as peer_llamacpp writes them: llama-bench's JSON, fmoe bench's, and each run's .cpu line
    (wall, own CPU, the machine's busy CPU, the others' cores before), `others` being the others' share of 2 cores."""
    import json

    wall, cpu = 10.0, 20.0 * (1 - others)
    busy = cpu + others * wall * os.cpu_count()
    for tool in ("llama", "fmoe"):
        (directory / f"{tool}_{model}-{label}_r{r}.cpu").write_text(f"{wall} {cpu} {busy} 0.1\n")
    (directory / f"llama_{model}-{label}_r{r}.json").write_text(json.dumps([
        {"n_prompt": 64, "n_gen": 0, "avg_ns": 1e8, "avg_ts": 640.0},
        {"n_prompt": 0, "n_gen": 16, "avg_ns": llama_ms * 16 * 1e6, "avg_ts": 1000 / llama_ms}]))
    (directory / f"fmoe_{model}-{label}_r{r}.json").write_text(json.dumps(
        {"dense": "bf16", "prompt_tokens": 64, "runs": [{"tpot_ms": {"median": fmoe_ms}, "ttft_ms": 200.0}]}))


def test_peer_llamacpp_summarises_the_clean_rounds_of_each_cell(tmp_path, monkeypatch):
    """A cell's TPOT is the median of its rounds in which the other processes left the run its cores (all rounds when
    none did); one line per cell says both tools' decode and prefill and fmoe ÷ llama.cpp of each."""
    import argparse
    import json

    peer = benchmark("peer_llamacpp")
    (tmp_path / "models" / "demo").mkdir(parents=True)
    (tmp_path / "models" / "demo" / "config.json").write_text((ROOT / "fmoe_cli" / "models" / "demo_model" /
                                                               "config.json").read_text())
    out = tmp_path / "results" / "run-1"
    out.mkdir(parents=True)
    _peer_run(out, "demo", "q4", 1, llama_ms=2.0, fmoe_ms=3.0, others=0.0)
    _peer_run(out, "demo", "q4", 2, llama_ms=2.5, fmoe_ms=9.0, others=0.6)  # a busy round: left out
    _peer_run(out, "demo", "q4", 3, llama_ms=3.0, fmoe_ms=3.6, others=0.02)
    for r in (1, 2):
        _peer_run(out, "demo", "f32", r, llama_ms=4.0, fmoe_ms=5.0 + r, others=0.7)  # none clean: all rounds
    monkeypatch.setattr(peer, "gguf_bytes", lambda path, config: 1e6)
    args = argparse.Namespace(models=["demo"], formats=["f32", "q4"], rounds=3, threads=2)
    rows = {r["fmt"]: r for r in peer.summarise(args, tmp_path, out, 10e9)}
    q4 = rows["q4"]
    assert (q4["llama_tpot"], q4["fmoe_tpot"]) == (2.5, 3.3) and q4["fmoe_clean"] == "2/3"
    assert q4["decode_ratio"] == pytest.approx(3.3 / 2.5) and q4["prefill_ratio"] == pytest.approx(320 / 640)
    assert q4["llama_floor"] == pytest.approx(0.1)  # 1 MB at 10 GB/s: 0.1 ms
    assert rows["f32"]["fmoe_tpot"] == 6.5 and rows["f32"]["fmoe_clean"] == "0/2"
    line = peer.cell_line(q4)
    assert "\n" not in line and line.startswith("demo-q4: decode fmoe 3.30 ms, llama.cpp 2.50 ms")
    assert "fmoe ÷ llama.cpp 1.32" in line and "fmoe ÷ llama.cpp 0.50" in line
    json.dumps(rows)  # the summary is JSON


def test_peer_llamacpp_builds_without_amx_where_the_cpu_lists_it():
    """A CPU without AMX: llama.cpp's native build. One that lists AMX (a VM may list it without granting its tile
    state, and a native build's quantised prefill then dies in ggml's AMX matmul): every other extension the CPU
    lists, one by one, and the rest off."""
    peer = benchmark("peer_llamacpp")
    epyc = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c bmi2\n"
    xeon = "processor\t: 0\nflags\t\t: fpu avx avx2 fma f16c bmi2 avx512f avx512_vnni amx_tile amx_int8\n"
    assert peer.cpu_flags(epyc) == ["-DGGML_NATIVE=ON"]
    flags = peer.cpu_flags(xeon)
    assert flags[0] == "-DGGML_NATIVE=OFF" and not any("AMX" in f for f in flags)
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX2=ON", "-DGGML_AVX512_BF16=OFF",
            "-DGGML_AVX_VNNI=OFF"} <= set(flags)


def test_peer_llamacpp_writes_a_random_checkpoint_fmoe_and_transformers_load(tmp_path, monkeypatch):
    """The random-weight checkpoints (a3b, big) at a tiny shape: the keys a Qwen3-MoE checkpoint has (transformers
    loads it with nothing missing or unexpected), the demo's tokenizer beside it, and fmoe loads it as that shape."""
    from transformers import AutoModelForCausalLM

    from fmoe_cli.models.load import load_model

    peer = benchmark("peer_llamacpp")
    monkeypatch.setitem(peer.SHAPES, "tiny", (64, 2, 4, 2, 16, 32, 8, 2))
    out = tmp_path / "tiny"
    peer.write_random_model("tiny", out)
    assert (out / "tokenizer.json").is_file() and not list(out.glob("*.tmp"))
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    lm = load_model(str(out), device="cpu", dtype="float32")
    assert (lm.shape.num_layers, lm.shape.num_experts, lm.shape.top_k, lm.shape.hidden) == (2, 8, 2, 64)


def test_prefill_kernels_compares_two_builds_and_refuses_bad_input():
    """benchmarks/prefill_kernels.py: bad input is one `error:` line and exit 2 before torch is imported; a small run
    against HEAD compiles both builds and says whether they give the same bits (they do: the same kernels' source, or
    a work tree whose changes keep the bits)."""
    script = [sys.executable, str(ROOT / "benchmarks" / "prefill_kernels.py")]
    bad = subprocess.run([*script, "--tokens", "1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == ["error: --tokens from 2, --rounds and --repeats from 1"]
    missing = subprocess.run([*script, "--against", "no-such-revision-here"], capture_output=True, text=True,
                             timeout=60)
    assert missing.returncode == 2 and missing.stderr.startswith("error: --against no-such-revision-here")
    run = subprocess.run([*script, "--against", "HEAD", "--models", "big", "--formats", "int4", "--tokens", "6",
                          "--rounds", "1", "--repeats", "1"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "big int4 experts, int8 activations" in run.stdout and run.stdout.count("the same bits") == 2, run.stdout


def test_replay_routing_measures_and_simulates_every_policy(checkpoints, tmp_path, monkeypatch, capsys):
    """`benchmarks/replay_routing.py MODEL TRACE --json`: the bench's report with the replayed routing, and per
    policy the simulator's TPOT with the profile's timings and with compute fitted to the measured resident run
    (which the fit then gives back: a check that the simulation replays what was measured)."""
    import json

    from test_replay_routing import write_trace

    monkeypatch.setenv("FMOE_EMULATED_CLOCK", "cpu")  # (main sets it; restored after the test)
    trace = write_trace(tmp_path / "t.jsonl", sequences=(40,))
    replay_routing = benchmark("replay_routing")
    # bf16 experts: the tiny int2 expert (6 KiB) loads in 24.4 × its 0.014 ms at 0.018 GB/s, so near the emulated
    # link's floor (0.01) that a busy CI machine's slower quick estimate took it under and the run refused
    replay_routing.main([str(checkpoints["mixtral"]), str(trace), "--rounds", "1", "--tokens", "4", "--warmup", "1",
                         "--policies", "lru,resident", "--per-layer", "2", "--prompt", "Hi", "--experts", "bf16",
                         "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["routing"]["replayed_from"] == str(trace) and report["predictor"] == "eam"
    extra = report["replay_routing"]
    assert extra["load_over_compute"] == pytest.approx(768 / 31.5077, rel=1e-3)  # the A6000's, profiles/
    assert extra["budget_experts"] == 2 * 4 + 4  # two a layer and the staging pool (2 × top-2)
    assert "--replay-routing" in extra["command"]
    sims = extra["simulated"]
    assert set(sims) == {"lru", "resident"} and set(sims["lru"]) == {"profile", "resident fit"}
    resident = {r["policy"]: r for r in report["runs"]}["resident"]["tpot_ms"]["median"]
    assert sims["resident"]["resident fit"]["tpot_ms"] == pytest.approx(resident, rel=1e-6)
    assert sims["lru"]["profile"]["tpot_ms"] > sims["resident"]["profile"]["tpot_ms"]


def test_replay_routing_gap_walks_from_the_paper_setting_to_the_measured_run(checkpoints, tmp_path, monkeypatch,
                                                                            capsys):
    """`replay_routing.py … --from-json RUN --gap`: the simulator walked from `simulate.py paper`'s setting to the
    measured run's, one change at a time, and a sweep of the load ratio. The walk's last row is the run's own
    setting: it gives the same simulated TPOT as the run's simulation; the first prices the admission copy as the
    paper setting did until 28 Nov (2 × the roofline T_exp, both × the compute factor), the second at the card's
    bandwidth, as `simulate.py paper` does now."""
    import json

    from test_replay_routing import write_trace

    monkeypatch.setenv("FMOE_EMULATED_CLOCK", "cpu")
    trace = write_trace(tmp_path / "t.jsonl", sequences=(40, 36))  # the paper setting: a 32-token prompt
    replay_routing = benchmark("replay_routing")
    common = [str(checkpoints["mixtral"]), str(trace), "--rounds", "1", "--tokens", "4", "--warmup", "1",
              "--per-layer", "2", "--prompt", "Hi", "--json"]
    replay_routing.main([*common, "--policies", "lru,moepic"])
    run = tmp_path / "run.json"
    run.write_text(capsys.readouterr().out.strip().splitlines()[-1])
    replay_routing.main([*common, "--from-json", str(run), "--gap", "--gap-ratios", "3,24.375"])
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["gap"]
    walk = [r for r in rows if r["part"] == "walk"]
    sweep = [r for r in rows if r["part"] == "sweep"]
    assert len(walk) == 6 and [r["load_over_compute"] for r in sweep] == [3, 24.375]
    assert walk[0]["a_e_over_t_exp"] == pytest.approx(2.0)
    factor = float(walk[0]["label"].split("× ")[1].split(",")[0])
    assert walk[1]["a_e_over_t_exp"] == pytest.approx(2.0 / factor, rel=1e-2)
    assert walk[0]["tokens"] == "paper" and walk[-1]["tokens"] == "run" and walk[-1]["layers"] == 4
    simulated = json.loads(run.read_text())["replay_routing"]["simulated"]
    for policy in ("lru", "moepic"):  # the walk ends at the run's setting: the run's own simulation
        assert walk[-1]["policies"][policy]["tpot_ms"] == pytest.approx(simulated[policy]["profile"]["tpot_ms"],
                                                                        rel=1e-6)
    for r in rows:
        p = r["policies"]
        assert r["moepic_over_lru"] == pytest.approx(p["moepic"]["tpot_ms"] / p["lru"]["tpot_ms"])
        assert r["resident_over_lru"] <= min(v["tpot_ms"] for v in p.values()) / p["lru"]["tpot_ms"] + 1e-9


@pytest.mark.parametrize("extra", [["--clock", "cpu"], ["--load-ratio", "2.6"], ["--gap"], ["--from-json", "r.json"]])
def test_replay_routing_on_a_gpu_refuses_what_shapes_an_emulated_link(extra, capsys):
    """`replay_routing.py --device cuda` (issue 38 §3 on a lent GPU) measures over the GPU's own link on the wall
    clock: what shapes or replays an emulated link is refused as an option error (exit 2), before anything is read."""
    replay_routing = benchmark("replay_routing")
    with pytest.raises(SystemExit) as info:
        replay_routing.main(["/nonexistent/model", "/nonexistent/trace", "--device", "cuda", *extra])
    assert info.value.code == 2
    assert "error: --device cuda measures on the GPU's own link" in capsys.readouterr().err


def test_replay_routing_on_a_machine_without_a_gpu_says_so_before_loading(checkpoints, tmp_path, monkeypatch, capsys):
    import torch

    from test_replay_routing import write_trace

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    replay_routing = benchmark("replay_routing")
    monkeypatch.setattr("fmoe_cli.models.load.load_model", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(SystemExit) as info:
        replay_routing.main([str(checkpoints["mixtral"]), str(write_trace(tmp_path / "t.jsonl", sequences=(8,))),
                             "--device", "cuda"])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: --device cuda: torch sees no CUDA GPU here"


def test_the_gpu_check_refuses_a_missing_trace_and_skips_part_d_without_one(tmp_path):
    """Part D (issue 38's table on the device) needs a Mixtral-8x7B trace: a path that is not a file is refused in
    one line, exit 2; without --trace the part says it was skipped and the check goes on."""
    script = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--parts", "d"]
    bad = subprocess.run([*script, "--trace", str(tmp_path / "none.jsonl")], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "--trace" in bad.stderr and "no such file" in bad.stderr, bad.stderr
    skipped = subprocess.run([*script, "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                             cwd=ROOT)
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert "skipped: part D needs --trace" in (tmp_path / "out" / "gpu_check.md").read_text()


def test_hit_spread_counts_a_token_s_hits_as_the_engine_s_cache_holds_them(tmp_path, capsys):
    """One layer, N = 4, K = 2, the same two experts for 10 tokens, a cache of 3: the first token misses both, the
    next 9 hit both: shares (0.1, 0, 0.9) against the binomial of the same mean, p = 1.8 / 2 = 0.9: (0.01, 0.18,
    0.81); total variation (0.09 + 0.18 + 0.09) / 2 = 0.18. A bad --sizes is one line, exit 2."""
    import json

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import hit_spread

    from fmoe_cli.trace import TraceWriter

    path = tmp_path / "same.jsonl"
    with TraceWriter(path, num_layers=1, num_experts=4, top_k=2, model="tiny") as writer:
        for token in range(10):
            writer.record(0, token, 0, (0, 1), (0.5, 0.5))
    hit_spread.main(["--trace", str(path), "--sizes", "3", "--json"])
    (layer,) = json.loads(capsys.readouterr().out)["sizes"]["3"]["layers"]
    assert layer["measured"] == pytest.approx([0.1, 0.0, 0.9])
    assert layer["binomial"] == pytest.approx([0.01, 0.18, 0.81])
    assert layer["total_variation"] == pytest.approx(0.18)
    for bad in ("0", "x"):
        result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hit_spread.py"), "--sizes", bad],
                                cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and result.stderr.startswith("error:")


def test_prefill_parts_splits_a_prefill_by_part_and_thread():
    """benchmarks/prefill_parts.py: bad input is one `error:` line and exit 2; a demo run (one prefill) reports each
    part's wall, every thread's CPU and the calling thread's, the kernels' CPU apart from the rest, and the model of a
    quiet machine's wall from them."""
    script = [sys.executable, str(ROOT / "benchmarks" / "prefill_parts.py")]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    bad = subprocess.run([*script, "demo", "--repeats", "0"], capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == ["error: --repeats from 1"]
    missing = subprocess.run([*script, "demo", "--prompt-file", "/no/such/prompt"], capture_output=True, text=True,
                             timeout=60, env=env)
    assert missing.returncode == 2 and missing.stderr.startswith("error: --prompt-file /no/such/prompt")
    run = subprocess.run([*script, "demo", "--experts", "int8", "--repeats", "1", "--json"], capture_output=True,
                         text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    (one,) = report["rounds"]
    parts = one["parts"]
    assert list(parts) == ["attention", "attention rows", "norms", "router", "moe glue", "experts", "layer glue",
                           "other"]
    assert parts["experts"][1] > 0 and parts["attention rows"][1] > 0 and parts["attention"][1] > 0
    assert abs(sum(p[1] for p in parts.values()) - one["cpu_ms"]) < 1e-6 * max(1.0, one["cpu_ms"])
    assert one["kernels_cpu_ms"] == parts["experts"][1] + parts["attention rows"][1]
    assert one["quiet_model_ms"] == one["cpu_ms"] - one["kernels_cpu_ms"] / 2


def test_down_by_neuron_bad_input_is_one_line_exit_2(tmp_path):
    """benchmarks/down_by_neuron.py: a bad option, a path that is no model and a checkpoint fmoe refuses each end in
    one `error:` line with exit code 2 (the first two before torch is imported)."""
    script = [sys.executable, str(ROOT / "benchmarks" / "down_by_neuron.py")]
    (tmp_path / "config.json").write_text("{}")
    for args in (["demo", "--rounds", "0"], [str(tmp_path / "nothing")], [str(tmp_path)]):
        result = subprocess.run([*script, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert result.returncode == 2 and result.stderr.startswith("error:"), (args, result.stderr[-500:])
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_host_per_layer_times_what_graph_segments_leave_eager(tmp_path, monkeypatch):
    """The forecast of a segmented GPU step's host work: the loading policies' experts forward timed per MoE layer
    (one call a layer a token), the rest of the step per token, and the engine's own method put back after."""
    from fmoe_cli.offload.engine import Engine

    host_per_layer = benchmark("host_per_layer")

    monkeypatch.setenv("FMOE_KERNELS", "torch")
    real = Engine.experts_forward
    eager = host_per_layer.eager_part(host_per_layer.checkpoint(tmp_path / "tiny"), tokens=2, rounds=2)
    assert Engine.experts_forward is real
    assert set(eager) == {"lru", "moepic"}
    for figures in eager.values():
        assert 0 < figures["spread"][0] <= figures["experts_ms_per_layer"] <= figures["spread"][1]
        assert figures["rest_ms_per_token"] > 0


FAKE_WORKER = """
import json, os, sys
# a stand-in for host_per_layer.py's worker: says which package it imported (its tree, or FAKE_PACKAGE), then answers
# each block with its tree's fixed ms a layer (the tree's MS file)
print(json.dumps({"package": os.environ.get("FAKE_PACKAGE", os.getcwd())}), flush=True)
ms = float(open("MS").read())
for line in sys.stdin:
    policy, tokens = line.split()
    print(json.dumps({"ms_per_layer": ms * (2 if policy == "lru" else 1)}), flush=True)
"""


def test_host_per_layer_paired_mode_pairs_the_trees_and_checks_their_packages(tmp_path, monkeypatch):
    """`--paired`: blocks A B B A over two worker processes a tree, the ratio this ÷ old per pair and policy, each
    tree's figures; a worker that imported fmoe_cli from another tree than its own (this script's own tree first on
    sys.path: every A/B was an A/A once) stops the run with one line. Fake workers stand in for the real ones (the
    real ones each load torch and the model)."""
    host_per_layer = benchmark("host_per_layer")
    this, old = tmp_path / "this", tmp_path / "old"
    for tree, ms in ((this, "0.9"), (old, "1.2")):
        tree.mkdir()
        (tree / "MS").write_text(ms)
    worker = tmp_path / "worker.py"
    worker.write_text(FAKE_WORKER)
    monkeypatch.setattr(host_per_layer, "__file__", str(worker))
    monkeypatch.setattr(host_per_layer, "ROOT", this)
    result = host_per_layer.paired(old, tmp_path / "model", pairs=3, tokens=4, device_path=False)
    assert set(result) == set(host_per_layer.POLICIES)
    for policy, figures in result.items():
        scale = 2 if policy == "lru" else 1
        assert figures["ratio"] == {"median": 0.75, "min": 0.75, "max": 0.75, "pairs": 3}
        assert figures["this_ms_per_layer"] == 0.9 * scale and figures["old_ms_per_layer"] == 1.2 * scale
    monkeypatch.setenv("FAKE_PACKAGE", str(this))  # the old tree's workers import this tree's package
    with pytest.raises(SystemExit, match="worker imported fmoe_cli from"):
        host_per_layer.paired(old, tmp_path / "model", pairs=1, tokens=4, device_path=False)


def test_cache_bound_counts_the_window_and_pools_the_budget(tmp_path, capsys):
    """benchmarks/cache_bound.py on a 2-layer trace whose layer 0 alternates two experts and layer 1 never repeats
    one: one slot a layer, lru misses everything; the per-layer optimum keeps one of layer 0's (2 hits of 12); the
    pooled two slots keep both (4); a staging slot more changes nothing here (layer 1 has no reuse to keep). The
    window (`--tokens 4`) counts the first 4 tokens only."""
    from fmoe_cli.trace import TraceWriter, read_trace

    layers = [[[0], [1], [0], [1], [0], [1]], [[0], [1], [2], [3], [4], [5]]]
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, num_layers=2, num_experts=8) as w:
        for j, routes in enumerate(layers):
            for t, route in enumerate(routes):
                w.record("s0", t, j, route, [1.0])
    bound = benchmark("cache_bound")
    result = bound.count(read_trace(path), 2, None, 1, 1, policies=("lru",))
    assert result["activations"] == 12
    assert result["hit_rate"] == {"lru": 0, "lru, shared budget": 0, "lru, shared budget + staging": 0,
                                  "belady": 2 / 12, "belady, shared budget": 4 / 12,
                                  "belady, shared budget + staging": 4 / 12}
    assert result["misses_over_lru"]["belady, shared budget"] == 8 / 12
    assert bound.count(read_trace(path), 2, 4, 1, 0, policies=("lru",))["activations"] == 8
    bound.main([str(path), "--per-layer", "1", "--staging", "1", "--json"])
    assert json.loads(capsys.readouterr().out)["hit_rate"]["belady, shared budget"] == 4 / 12
    with pytest.raises(SystemExit) as exited:
        bound.main([str(path), "--layers", "3"])
    assert exited.value.code == 2 and "the trace has 2" in capsys.readouterr().err
    # one LRU over both layers: layer 1 routes expert 5 every token, layer 0 alternates 0 and 1. Two slots pooled
    # keep what one a layer keeps (layer 1's 5 hits); a third slot (staging) keeps layer 0's pair across tokens too
    # (4 more), which one slot a layer never does
    routes = [[[0], [1], [0], [1], [0], [1]], [[5]] * 6]
    assert bound.shared_lru_hits(routes, 2) == 5 and bound.shared_lru_hits(routes, 3) == 9
    assert bound.shared_lru_hits(routes, 0) == 0 and bound.shared_lru_hits(routes, 12) == 9  # all but the 3 firsts


def test_the_gpu_check_skips_part_b_without_the_time_for_it(tmp_path):
    """A lent GPU's command has a hard limit: part B (a 9 GiB build, a profile, the bench) is not begun with less
    than its least time left of --seconds, and each section is written as it ends."""
    script = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--parts", "b",
              "--seconds", "5", "--out", str(tmp_path / "out")]
    result = subprocess.run(script, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "part B needs 150" in (tmp_path / "out" / "gpu_check.md").read_text()
    assert "built in" not in result.stdout  # nothing was built


def test_families_survey_rows(tmp_path):
    """`benchmarks/families_survey.py`: a served family's row is `exact` (its 8 runs, CPU and device paths), a family
    transformers builds no causal LM of is `refused` with fmoe's line, and one fmoe serves wrongly is `WRONG`."""
    survey = benchmark("families_survey")
    outcome, detail = survey.survey("olmoe", tmp_path, tokens=6)
    assert outcome == "exact" and detail.startswith("8 runs"), detail
    outcome, detail = survey.skeleton_only("qwen3_vl_moe")
    assert outcome == "refused" and "registers no AutoModelForCausalLM" in detail
    from fmoe_cli.offload.engine import Engine

    real = Engine.experts_forward
    try:
        Engine.experts_forward = lambda self, *args: real(self, *args) * 1.5  # noqa: E731 - every policy wrong
        outcome, detail = survey.survey("olmoe", tmp_path, tokens=6)
    finally:
        Engine.experts_forward = real
    assert outcome == "WRONG" and "resident@" in detail, detail
