"""Bad options are refused in one line before the model loads; a bad command line reads like any
other bad input; nothing stray on stderr (issue 14, items 7 and the first-run list)."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

import fmoe_cli.run as run_module
from fmoe_cli.cli import app, main


def refuse_loading(*args, **kwargs):
    raise AssertionError("the model was loaded before the options were checked")


@pytest.fixture
def malformed_profile(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"kind": "fmoe-profile", "schema_version": 1, "device": {"device": {}}}))
    return str(path)


@pytest.mark.parametrize("command, args, fragment", [
    ("bench", ("--policy", "bogus"), "unknown policy"),
    ("bench", ("--emulate-link", "0"), "--emulate-link"),
    ("bench", ("--emulate-link", "inf"), "finite"),
    ("bench", ("--emulate-link", "nan"), "--emulate-link"),
    ("bench", ("--emulate-link", "1e-9"), "slower than any"),
    ("bench", ("--lcp-rho", "0"), "ρ"),
    ("bench", ("--lcp-omega", "inf"), "finite ω"),
    ("chat", ("--emulate-link", "inf"), "finite"),
    ("chat", ("--profile", "/nonexistent/profile.json"), "no profile"),
    ("chat", ("--profile", "MALFORMED"), "malformed"),
    ("chat", ("--temperature", "nan"), "--temperature"),
    ("chat", ("--temperature", "inf"), "--temperature"),
    ("bench", ("--vram-budget", "1000TB"), "more than this machine's memory"),
    ("chat", ("--vram-budget", "1000TiB"), "more than this machine's memory"),
    ("bench", ("--vram-budget", "25"), "has no unit"),
], ids=lambda v: " ".join(v) if isinstance(v, tuple) else v)
def test_options_are_checked_before_the_model_loads(monkeypatch, malformed_profile, command, args, fragment):
    monkeypatch.setattr(run_module, "load_model", refuse_loading)
    args = tuple(malformed_profile if a == "MALFORMED" else a for a in args)
    result = CliRunner().invoke(app, [command, "demo", "--device", "cpu", *args], input="hi\n/exit\n")
    text = result.output.strip()
    assert result.exit_code == 2, text
    assert len(text.splitlines()) == 1 and text.startswith("error: ") and fragment in text, text


@pytest.mark.parametrize("argv, fragment", [
    (["bench", "--tokens", "abc"], "Invalid value for '--tokens'"),
    (["bench", "--no-such-option"], "No such option: --no-such-option"),
    (["chat", "--temperature", "warm"], "Invalid value for '--temperature'"),
    (["nosuchcommand"], "No such command 'nosuchcommand'"),
])
def test_a_bad_command_line_is_one_error_line(monkeypatch, capsys, argv, fragment):
    monkeypatch.setattr(sys, "argv", ["fmoe", *argv])
    with pytest.raises(SystemExit) as exit_:
        main()
    captured = capsys.readouterr()
    assert exit_.value.code == 2
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], captured.err


def test_version(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["fmoe", "--version"])
    with pytest.raises(SystemExit) as exit_:
        main()
    from fmoe_cli import __version__

    assert exit_.value.code == 0 and capsys.readouterr().out == f"fmoe {__version__}\n"


def test_no_stray_line_on_stderr(checkpoints):
    result = CliRunner().invoke(app, ["bench", str(checkpoints["mixtral"]), "--policy", "lru", "--tokens", "2",
                                      "--warmup", "0", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert result.stderr == "", repr(result.stderr)
    assert result.stdout.splitlines()[0].strip()  # the first line of the output is not blank either


def test_plan_vram_is_a_size_not_a_share(checkpoints):
    result = CliRunner().invoke(app, ["plan", str(checkpoints["mixtral"]), "--vram", "25%"])
    text = result.output.strip()
    assert result.exit_code == 2 and len(text.splitlines()) == 1 and "--vram '25%': give the device's memory" in text, text


# --- bounded runs (item 8) and Ctrl-C mid-bench (item 6) -------------------------------------------


def test_bench_beyond_the_model_context_is_refused(checkpoints):
    result = CliRunner().invoke(app, ["bench", str(checkpoints["mixtral"]), "--policy", "lru", "--tokens", "600",
                                      "--warmup", "0", "--device", "cpu"])
    text = result.output.strip()
    assert result.exit_code == 2 and len(text.splitlines()) == 1, text
    assert "--tokens 600" in text and "context of 512 tokens" in text, text


def test_chat_answers_end_at_the_context(checkpoints):
    """--max-new-tokens beyond the context (--context 40): every answer stops where the context ends, and the
    footer shows how much of it the conversation uses."""
    import io

    from rich.console import Console

    from fmoe_cli.chat.repl import ChatOptions, open_chat
    from fmoe_cli.run import RunOptions

    chat = open_chat(ChatOptions(RunOptions(model=str(checkpoints["mixtral"]), device="cpu", context=40),
                                 temperature=0.0, max_new_tokens=100_000_000), err_console=Console(file=io.StringIO()))
    try:
        stats = chat.session.ask("hello there")
        prompt = len(chat.session.encode([{"role": "user", "content": "hello there"}]))
        assert stats.finish_reason == "eos" or stats.tokens == 40 - prompt
        assert stats.tokens <= 40 - prompt
        assert stats.context == 40 and stats.context_used == prompt + stats.tokens
        assert stats.footer().endswith(f"context {prompt + stats.tokens}/40 · float32")  # and the compute dtype
    finally:
        chat.close()


def test_chat_drops_the_oldest_turns_to_fit_the_context(checkpoints):
    long = "the quick brown fox jumps over the lazy dog " * 6
    result = CliRunner().invoke(app, ["chat", str(checkpoints["mixtral"]), "--temperature", "0", "--max-new-tokens",
                                      "200", "--device", "cpu"], input=f"{long}\n{long}\n{long}\n/exit\n")
    assert result.exit_code == 0, result.output
    assert result.stdout.count("tokens · TTFT") == 3
    notices = [line for line in result.stdout.splitlines() if "oldest messages no longer fit" in line]
    assert notices and "context of 512 tokens" in notices[0], result.stdout


def test_ctrl_c_mid_bench_prints_the_finished_policies_as_partial(checkpoints, monkeypatch):
    import fmoe_cli.bench.run as bench_run

    real = bench_run.bench_policy
    calls = []

    def interrupted_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_run, "bench_policy", interrupted_second)
    result = CliRunner().invoke(app, ["bench", str(checkpoints["mixtral"]), "--policy", "lru", "--policy", "lfu",
                                      "--policy", "uniform", "--tokens", "2", "--warmup", "0", "--device", "cpu"])
    assert result.exit_code == 130, result.output
    rows = [line.split()[0] for line in result.stdout.splitlines() if line.split() and line.split()[0] in
            ("lru", "lfu", "uniform")]
    assert rows == ["lru"], result.stdout
    assert "PARTIAL: interrupted (Ctrl-C) after 1 of 3 policies; not run: lfu, uniform" in result.stdout


@pytest.mark.parametrize("as_json", [False, True])
@pytest.mark.parametrize("cut_run, cut_at", [(4, 2), (3, 0)])
def test_ctrl_c_in_a_later_round_reports_every_round_measured(checkpoints, monkeypatch, as_json, cut_run, cut_at):
    """`--rounds 2` (round 2 runs lfu, then lru): Ctrl-C in lru's second run after 2 tokens, both rows print, each
    the medians of the rounds it has, lru marked partial; Ctrl-C before lfu's second run measured anything, each
    row is its one round. Exit 130 either way."""
    import fmoe_cli.bench.run as bench_run

    real_bench, real_generate = bench_run.bench_policy, bench_run.stream_generate
    runs = []

    def count_runs(*args, **kwargs):
        runs.append(args[2].policy)
        return real_bench(*args, **kwargs)

    def cut(*args, **kwargs):
        for n, event in enumerate(real_generate(*args, **kwargs)):
            if len(runs) == cut_run and n == cut_at:
                raise KeyboardInterrupt
            yield event

    monkeypatch.setattr(bench_run, "bench_policy", count_runs)
    monkeypatch.setattr(bench_run, "stream_generate", cut)
    result = CliRunner().invoke(app, ["bench", str(checkpoints["mixtral"]), "--policy", "lru", "--policy", "lfu",
                                      "--rounds", "2", "--tokens", "4", "--warmup", "0", "--device", "cpu",
                                      *(["--json"] if as_json else [])])
    assert result.exit_code == 130, result.output
    assert runs == ["lru", "lfu", "lfu", "lru"][:cut_run]
    if cut_run == 4:
        rows, finished, line = [("lru", 2, [None, 2]), ("lfu", None, [None, None])], ["lfu"], "lru* 2, lfu 2"
    else:
        rows, finished, line = [("lru", None, [None]), ("lfu", None, [None])], [], "lru 1, lfu 1"
    if as_json:
        report = json.loads(result.stdout)
        assert [(r["policy"], r["measured"], [x["measured"] for x in r["rounds"]]) for r in report["runs"]] == rows
        assert report["interrupted"] == {"finished": finished, "requested": ["lru", "lfu"], "round": 2}
    else:
        assert f"PARTIAL: interrupted (Ctrl-C) in round 2 of 2; rounds measured: {line}" in \
            result.stdout.replace("\n", " "), result.stdout
        assert "2 of 2 rounds interleaved" in result.stdout.replace("\n", " "), result.stdout  # not all 2 asked


def test_bench_shows_progress_per_token(checkpoints, monkeypatch):
    import io

    from rich.console import Console
    from rich.progress import Progress

    from fmoe_cli.bench.run import run_bench
    from fmoe_cli.run import RunOptions

    advanced: list[str] = []
    real = Progress.advance
    monkeypatch.setattr(Progress, "advance", lambda self, task, n=1: (advanced.append(self._tasks[task].description),
                                                                     real(self, task, n)))
    console = Console(file=io.StringIO(), force_terminal=True, width=100)  # a terminal: the bar is shown
    run_bench(RunOptions(model=str(checkpoints["mixtral"]), policies=("lru", "lfu"), device="cpu",
                         record_statistics=False), tokens=3, warmup=1, prompt="hello", console=console)
    assert [d for d in advanced if ":" in d] == ["lru: 1 warm-up + 3 tokens"] * 4 + ["lfu: 1 warm-up + 3 tokens"] * 4


def test_plan_without_vram_on_a_cpu_machine_says_why(checkpoints):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: plan defaults to its memory")
    result = CliRunner().invoke(app, ["plan", str(checkpoints["mixtral"])])
    text = result.output.strip()
    assert result.exit_code == 2 and len(text.splitlines()) == 1, text
    assert "`fmoe profile` here measures the CPU" in text and "--vram 12GiB" in text and "--profile profiles/" in text


def test_without_a_gpu_behind_a_driver_node_torch_still_says_why(checkpoints, monkeypatch):
    """Where a GPU driver's node exists but torch sees no GPU (a CPU build of torch, say), the early check lets the
    command through and torch's own answer is the same one line: plan's, and a run's `pick_device`."""
    import torch

    from fmoe_cli.errors import FmoeError
    from fmoe_cli.models.load import pick_device
    from fmoe_cli.planning import plan

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setattr(plan, "surely_no_gpu", lambda: False)
    result = CliRunner().invoke(app, ["plan", str(checkpoints["mixtral"])])
    text = result.output.strip()
    assert result.exit_code == 2 and text.startswith("error: ") and len(text.splitlines()) == 1, text
    assert plan.NO_GPU_TO_PLAN in " ".join(text.split()), text
    with pytest.raises(FmoeError, match="device cuda requested but no CUDA GPU is available"):
        pick_device("cuda")


def test_the_shipped_demo_trace_replays():
    import io
    from pathlib import Path

    from rich.console import Console

    from fmoe_cli.bench.replay import run_replay

    trace = Path(__file__).resolve().parents[1] / "traces" / "demo.jsonl"
    obj = run_replay(str(trace), "2,4", "lru,lcp", True, console=Console(file=io.StringIO()))
    assert (obj["sequences"], obj["layers"], obj["experts"]) == (1, 6, 16) and obj["tokens"] > 100


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_during_the_first_policy_prints_its_tokens_so_far_as_partial(checkpoints, monkeypatch, as_json):
    """Issue 22 §3: Ctrl-C during the measured tokens of the first policy (`--tokens 900` on a slow link)
    prints the row of what was measured, marked partial (in --json too), and exits 130."""
    import fmoe_cli.bench.run as bench_run

    real = bench_run.stream_generate

    def cut_after_three(*args, **kwargs):
        for n, event in enumerate(real(*args, **kwargs)):
            if n == 3:
                raise KeyboardInterrupt
            yield event

    monkeypatch.setattr(bench_run, "stream_generate", cut_after_three)
    result = CliRunner().invoke(app, ["bench", str(checkpoints["mixtral"]), "--policy", "lru", "--policy", "lfu",
                                      "--tokens", "8", "--warmup", "0", "--device", "cpu",
                                      *(["--json"] if as_json else [])])
    assert result.exit_code == 130, result.output
    if as_json:
        report = json.loads(result.stdout)
        assert [(r["policy"], r["measured"], len(r["token_ids"])) for r in report["runs"]] == [("lru", 3, 3)]
        assert report["interrupted"] == {"finished": [], "requested": ["lru", "lfu"]}
    else:
        rows = [line.split()[0] for line in result.stdout.splitlines() if line.split()[:1] in (["lru*"], ["lfu"])]
        assert rows == ["lru*"], result.stdout
        assert ("PARTIAL: interrupted (Ctrl-C) after 0 of 2 policies; lru* cut short after 3 of 8 measured tokens; "
                "not run: lfu") in result.stdout.replace("\n", " ")
