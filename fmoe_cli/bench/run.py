"""`fmoe bench`: TTFT/TPOT and the engine's counters, for one or more policies in one process.

Every policy runs on the same prompt in the same process, after the same warm-up;
the first policy is the base of the ratios. Figures per run:

    TTFT            prefill + first token (ms)
    TPOT            median and p90 of the decode steps (ms)
    tokens/s        1000 / mean TPOT
    hit rate        (whole hits + top-segment hits) / activated experts, decode steps
    precision       prefetched segments used / prefetched segments issued
    recall          loads a prefetch had already issued / activated experts that needed a load
    exposed         time the compute waited on the link, ms per decode token
    bytes/token     bytes moved host → device per decode token (demand + prefetch)
    peak            device: torch's peak allocation on CUDA; on the CPU (no device memory of
                    its own) the peak resident set size of the process during the run
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import psutil
import torch
from rich import box
from rich.console import Console
from rich.text import Text
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from fmoe_cli.bench import check_counts, read_prompt  # noqa: F401 (read_prompt: re-exported)
from fmoe_cli.bench.routing import (ROUTING_ONLY_PREDICTORS, ReplayedRouting, check_replay_length,
                                    replay_note)
from fmoe_cli.profiling.host import host_format, host_line, saved_host_profile
from fmoe_cli.trace import RouteRecorder, Trace
from fmoe_cli.errors import FmoeError
from fmoe_cli.generate import DEFAULT_PROMPT, SamplingParams, encode_messages, stream_generate
from fmoe_cli.models.load import LoadedModel, precision_label
from fmoe_cli.offload.engine import Counters, Engine, EngineSettings
from fmoe_cli.run import RunOptions, context_length, open_run
from fmoe_cli.types import DEFAULT_ACTIVATIONS

MiB = 1024**2


@dataclass
class RunResult:
    policy: str
    ttft_ms: float
    tpot_ms: dict  # {"median", "p90"}
    tokens_per_s: float
    hit_rate: float
    prefetch_precision: float
    prefetch_recall: float
    exposed_load_ms_per_token: float
    bytes_per_token: float
    peak_device_bytes: int  # CUDA: peak allocated; CPU: peak RSS of the process during the run
    plan: str
    token_ids: list[int]
    engine_device_bytes: int = 0  # what the engine accounts on the device: non-expert weights + caches + staging
    measured: int | None = None  # Ctrl-C cut the run short after this many measured tokens (None: it finished)
    host_ms_per_token: float = 0.0  # the host lane's compute (offload/host.py), beside the exposed load
    decode_graph: bool = False  # its decode steps replayed from CUDA graphs (generate.DecodeGraph)
    decode_segments: int = 0  # … the graph segments a step runs (1: one graph; L + 1: cut at L routing reads)
    rounds: list[dict] | None = None  # --rounds N > 1: each round's figures (round_figures); the fields above are their medians


MEDIAN_KEYS = ("ttft_ms", "tokens_per_s", "hit_rate", "prefetch_precision", "prefetch_recall",
               "exposed_load_ms_per_token", "bytes_per_token", "host_ms_per_token")  # a row's: its rounds' median
ROUND_KEYS = MEDIAN_KEYS + ("tpot_ms", "plan", "measured")  # what the report keeps of each round


def round_figures(result: RunResult) -> dict:
    """One round of a policy, as the report keeps it under the policy's `rounds`."""
    return {key: getattr(result, key) for key in ROUND_KEYS}


def combine_rounds(results: list[RunResult]) -> RunResult:
    """A policy's rounds (in the order run) as one result: every figure the median of its rounds' (TPOT: the
    median of the rounds' medians, and of their p90s), the peak the highest, the plan and tokens the last and
    first round's; `rounds` keeps each round's figures (one round, when Ctrl-C left only one: its own)."""
    cut = [r.measured for r in results if r.measured is not None]
    return replace(
        results[0],
        **{key: statistics.median(getattr(r, key) for r in results) for key in MEDIAN_KEYS},
        tpot_ms={q: statistics.median(r.tpot_ms[q] for r in results) for q in ("median", "p90")},
        peak_device_bytes=max(r.peak_device_bytes for r in results),
        engine_device_bytes=max(r.engine_device_bytes for r in results),
        plan=results[-1].plan,
        measured=cut[0] if cut else None,
        rounds=[round_figures(r) for r in results],
    )


class PartialRun(KeyboardInterrupt):
    """Ctrl-C during a policy's measured tokens: what was measured so far comes with the interrupt."""

    def __init__(self, result: RunResult) -> None:
        super().__init__()
        self.result = result


def encode_prompt(lm: LoadedModel, prompt: str) -> torch.Tensor:
    """[1, T]: one user message with the chat template (the plain text without one)."""
    return torch.tensor([encode_messages(lm.tokenizer, [{"role": "user", "content": prompt}], lm.model_id,
                                         plain=True)])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def bench_policy(lm: LoadedModel, engine: Engine, settings: EngineSettings, prompt_ids: torch.Tensor,
                 tokens: int, warmup: int = 0, *, before_measure: Callable[[], None] | None = None,
                 configure: bool = True, advance: Callable[[], object] = lambda: None,
                 on_generate: Callable[[], object] = lambda: None) -> RunResult:
    """Configure the engine for one policy (unless `configure` is False: it is, and unused), warm it up
    on the prompt, then measure `tokens` tokens (greedy).

    `before_measure` runs after the warm-up, right before the measured generation (a trace recorder
    starts its sequence there, so the trace holds the measured run only). `advance` runs after every
    token (a progress bar); `on_generate` before each generation, the warm-up's and the measured one
    (replayed routing starts again at the trace's first token)."""
    if configure:
        engine.configure(settings)
    capacity = prompt_ids.shape[-1] + max(tokens, warmup)  # one decode cache on a GPU for the warm-up and the run
    if warmup:
        on_generate()
        for _ in stream_generate(lm.model, prompt_ids, engine=engine, max_new_tokens=warmup, stop_on_eos=False,
                                 capacity=capacity):
            advance()
    if before_measure is not None:
        before_measure()
    process = psutil.Process()
    if lm.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(lm.device)
    rss = process.memory_info().rss
    events = []
    cut = False
    on_generate()
    try:
        for event in stream_generate(lm.model, prompt_ids, engine=engine, max_new_tokens=tokens, stop_on_eos=False,
                                     sampling=SamplingParams(), capacity=capacity):
            events.append(event)
            rss = max(rss, process.memory_info().rss)  # sampled once per token, outside the timed step
            advance()
    except KeyboardInterrupt:
        if not events:
            raise
        cut = True  # the tokens measured so far are reported, marked partial
    decode = events[1:] or events
    steady = sum((e.counters for e in decode), Counters())
    tpot = [e.latency_s * 1000 for e in decode]
    engine_bytes = lm.non_expert_bytes + engine.device_bytes()
    peak = torch.cuda.max_memory_allocated(lm.device) if lm.device.type == "cuda" else rss
    n = len(decode)
    result = RunResult(
        policy=settings.policy,
        ttft_ms=events[0].latency_s * 1000,
        tpot_ms={"median": statistics.median(tpot), "p90": percentile(tpot, 0.9)},
        tokens_per_s=1000 / statistics.mean(tpot),
        hit_rate=steady.hit_rate,
        prefetch_precision=steady.prefetch_precision,
        prefetch_recall=steady.prefetch_recall,
        exposed_load_ms_per_token=steady.exposed_s * 1000 / n,
        bytes_per_token=steady.bytes_moved / n,
        peak_device_bytes=peak,
        plan=engine.settings.plan.summary(),  # what the measured run used (a re-plan after the warm-up may change it)
        token_ids=[e.token_id for e in events],
        engine_device_bytes=engine_bytes,
        measured=len(events) if cut else None,
        host_ms_per_token=steady.host_s * 1000 / n,
        decode_graph=any(g.graph is not None for g in engine.decode_graphs.values()),
        decode_segments=max((g.segments for g in engine.decode_graphs.values()), default=0),
    )
    if cut:
        raise PartialRun(result)
    return result


def ratios(run: dict, base: dict) -> dict:
    """Run ÷ base (the first policy): TTFT, TPOT median and p90, tokens/s, bytes/token; with rounds, also
    TPOT paired within each round (`tpot_paired`: median, min and max over the rounds both ran)."""
    def div(a: float, b: float) -> float | None:
        return a / b if b else None

    out = {
        "ttft": div(run["ttft_ms"], base["ttft_ms"]),
        "tpot_median": div(run["tpot_ms"]["median"], base["tpot_ms"]["median"]),
        "tpot_p90": div(run["tpot_ms"]["p90"], base["tpot_ms"]["p90"]),
        "tokens_per_s": div(run["tokens_per_s"], base["tokens_per_s"]),
        "bytes_per_token": div(run["bytes_per_token"], base["bytes_per_token"]),
    }
    if run.get("rounds") and base.get("rounds"):
        paired = [a["tpot_ms"]["median"] / b["tpot_ms"]["median"] for a, b in zip(run["rounds"], base["rounds"])]
        out["tpot_paired"] = {"median": statistics.median(paired), "min": min(paired), "max": max(paired),
                              "rounds": len(paired)}
    return out


def bench_report(lm: LoadedModel, link, budget_bytes: int, runs: list[RunResult], *,
                 prompt_tokens: int | None = None, tokens: int | None = None, warmup: int | None = None,
                 token_ids: list[list[int]] | None = None, rounds: int = 1) -> dict:
    """The `--json` object: {"model", "device", "link": {"kind", "gbps"}, "runs": [...]} plus extra keys.
    `token_ids`: every run's tokens, every round's (default: the runs')."""
    run_dicts = [asdict(r) for r in runs]
    if rounds == 1:
        for r in run_dicts:
            del r["rounds"]
    token_ids = token_ids or [r["token_ids"] for r in run_dicts]
    for r in run_dicts:
        r["ratios"] = ratios(r, run_dicts[0])
    return {
        "model": lm.model_id,
        "label": lm.label,
        "device": str(lm.device),
        "dtype": str(lm.dtype).removeprefix("torch."),
        "experts": lm.shape.experts,
        "dense": lm.dense,
        "activations": lm.activations,
        # host RAM of the expert store, and the weights on the device beside it (dense at their stored size)
        "weights": {"experts_bytes": lm.shape.all_experts_bytes, "non_expert_bytes": lm.non_expert_bytes},
        "link": {"kind": link.kind, "gbps": link.gbps, "label": link.label()},
        "vram_budget_bytes": budget_bytes,
        "prompt_tokens": prompt_tokens,
        "tokens": tokens,
        "warmup": warmup,
        "rounds": rounds,
        "ratios_to": run_dicts[0]["policy"] if run_dicts else None,
        # (a partial run is compared over the tokens it measured; with rounds, every round of every policy)
        "token_ids_identical": len({tuple(ids[:min(map(len, token_ids))]) for ids in token_ids}) <= 1,
        "runs": run_dicts,
    }


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def bench_table(report: dict) -> Table:
    """One row per policy, short headers; fits 80 columns (units and meanings in the caption)."""
    runs = report["runs"]
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False)  # one space between columns
    columns = [("policy", "left"), ("TTFT", "right"), ("TPOT", "right"), ("p90", "right"), ("tok/s", "right"),
               ("hit", "right"), ("prec", "right"), ("rec", "right"), ("exp", "right"), ("host", "right"), ("MiB/t", "right"),
               ("peak", "right"), ("ratio", "right")]
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True)
    for r in runs:
        table.add_row(
            r["policy"] + ("*" if r.get("measured") is not None else ""), f"{r['ttft_ms']:.1f}", f"{r['tpot_ms']['median']:.1f}", f"{r['tpot_ms']['p90']:.1f}",
            f"{r['tokens_per_s']:.1f}", f"{r['hit_rate']:.2f}", f"{r['prefetch_precision']:.2f}",
            f"{r['prefetch_recall']:.2f}", f"{r['exposed_load_ms_per_token']:.2f}", f"{r.get('host_ms_per_token', 0.0):.2f}",
            f"{r['bytes_per_token'] / MiB:.2f}", f"{r['peak_device_bytes'] / MiB:.0f}",
            _fmt(r.get("ratios", {}).get("tpot_median")),
        )
    return table


def render(report: dict, console: Console) -> None:
    """Header lines (model, device, link — 'emulated' when it is), the table, the legend, the token check."""
    peak = "peak RSS of the process (CPU)" if report["device"] == "cpu" else "peak device memory"
    weights, activations = report["weights"], report.get("activations", DEFAULT_ACTIVATIONS)
    precision = precision_label(report["dtype"], report["experts"], report["dense"], activations)
    console.print(Text(report["label"], style="bold"), highlight=False)  # (a model's path: text, not markup)
    console.print(f"device {report['device']} ({precision}) · {report['link']['label']}", highlight=False, markup=False)
    def stored(fmt: str) -> str:  # `bf16` is the unquantised format: the rows in the compute dtype
        return f"unquantised, {report['dtype']}" if fmt == "bf16" else fmt

    console.print(f"formats: experts {stored(report['experts'])} ({weights['experts_bytes'] / MiB:.1f} MiB in host RAM)"
                  f" · dense {stored(report['dense'])} (non-expert weights {weights['non_expert_bytes'] / MiB:.1f} MiB on the "
                  f"device) · activations {activations}",
                  highlight=False)
    timings = f" · timings: {report['timings']}" if report.get("timings") else ""  # the configurator's
    console.print(f"expert budget {report['vram_budget_bytes'] / MiB:.1f} MiB · "
                  f"predictor {report.get('predictor', 'speculative')}{timings}", highlight=False)
    if report.get("routing"):
        console.print(report["routing"]["note"], highlight=False, soft_wrap=True)
    if report.get("host_profile"):
        console.print(report["host_profile"]["line"], highlight=False)
    if report.get("tokens") is not None:
        console.print(f"{report['prompt_tokens']} prompt tokens, {report['tokens']} measured after "
                      f"{report['warmup']} warm-up tokens, greedy", highlight=False)
    if report.get("warm_round_tokens"):
        console.print(f"every policy ran once unmeasured first ({report['warm_round_tokens']} tokens): the device's "
                      f"warm-up is no policy's", highlight=False)
    console.print(bench_table(report))
    console.print(f"[dim]ms: TTFT, TPOT median, p90, exp = exposed load per token, host = the host lane's compute per token. "
                  f"tok/s = 1000 ÷ the mean TPOT (slow tokens count). hit = hit rate; prec/rec = "
                  f"prefetch precision/recall; MiB/t = moved per token; peak = {peak}, MiB; "
                  f"ratio = TPOT ÷ TPOT of {report['ratios_to']}.[/dim]", highlight=False)
    if report.get("rounds", 1) > 1:
        cut = report.get("interrupted")  # (Ctrl-C: the rounds begun, of those asked)
        rounds = f"{cut['round']} of {report['rounds']}" if cut and cut.get("round") else str(report["rounds"])
        console.print(f"[dim]{rounds} rounds interleaved in this process (the order reversed every other "
                      f"round); TPOT, the other figures and ratio are medians of the rounds'. Per policy: TPOT min–max "
                      f"over the rounds; TPOT ÷ {report['ratios_to']}'s paired within each round, median (min–max):[/dim]",
                      highlight=False)
        for r in report["runs"]:
            per_round = [x["tpot_ms"]["median"] for x in r["rounds"]]
            paired = r["ratios"].get("tpot_paired")
            console.print(f"  {r['policy']:<14} {len(per_round)} rounds, {min(per_round):.1f}–{max(per_round):.1f} ms"
                          + ("" if paired is None else f" · paired {paired['median']:.3f} "
                                                       f"({paired['min']:.3f}–{paired['max']:.3f})"), highlight=False)
    if len(report["runs"]) > 1:  # (one policy: nothing to compare)
        console.print("token ids identical across policies" if report["token_ids_identical"] else
                      "[red]token ids DIFFER across policies[/red]")
    if report.get("timing_note"):
        console.print(Text(f"note: {report['timing_note']}", style="dim"), highlight=False)
    if report.get("interrupted") and report.get("rounds", 1) > 1:
        console.print(f"[yellow]PARTIAL: interrupted (Ctrl-C) in round {report['interrupted']['round']} of "
                      f"{report['rounds']}; rounds measured: "
                      + ", ".join(f"{r['policy']}{'*' if r.get('measured') is not None else ''} {len(r['rounds'])}"
                                  for r in report["runs"]) + "[/yellow]", highlight=False)
    elif report.get("interrupted"):
        done, asked = report["interrupted"]["finished"], report["interrupted"]["requested"]
        cut = [r for r in report["runs"] if r.get("measured") is not None]
        during = "".join(f"; {r['policy']}* cut short after {r['measured']} of {report['tokens']} measured tokens"
                         for r in cut)
        skipped = [p for p in asked if p not in done and p not in {r["policy"] for r in cut}]
        console.print(f"[yellow]PARTIAL: interrupted (Ctrl-C) after {len(done)} of {len(asked)} policies{during}"
                      f"{'; not run: ' + ', '.join(skipped) if skipped else ''}[/yellow]", highlight=False)


def check_context(limit: int | None, prompt_tokens: int, new_tokens: int, option: str) -> None:
    """Refuse a run longer than the context (--context, at most the model's): prompt plus new tokens."""
    if limit is not None and prompt_tokens >= limit:
        raise FmoeError(f"the prompt is longer than the context ({prompt_tokens} tokens > {limit}): give a shorter "
                        f"prompt (fewer than {limit} tokens, and room for --tokens)")
    if limit is not None and prompt_tokens + new_tokens > limit:
        raise FmoeError(f"{option} {new_tokens}: the prompt ({prompt_tokens} tokens) plus {new_tokens} new tokens exceed "
                        f"the context of {limit} tokens (--context); use {option} {max(limit - prompt_tokens, 0)} or less")


WARM_ROUND_TOKENS = 16  # a GPU's unmeasured round: every policy, its warm-up and this many tokens


def warm_round_tokens(device: torch.device) -> int:
    """Tokens of the unmeasured round `fmoe bench` runs first on this device (0: none). On a GPU the first policy
    run in a process paid its warm-up (CUDA context, cuBLAS handles and workspaces, the caching allocator's first
    blocks, the clocks ramping up), which the warm-up tokens did not cover: on the first H200 run two policies with
    one plan read 20.4 and 16.2 ms a token, and single rounds ran 5x slower than others (issue 37 §6). The CPU has
    none of it (and its runs are the suite's and the benchmarks': no round is added there)."""
    return WARM_ROUND_TOKENS if device.type == "cuda" else 0


def run_bench(opts: RunOptions, *, tokens: int, warmup: int, prompt: str | None = None, console: Console | None = None,
              rounds: int = 1, replay: Trace | None = None) -> dict:
    """`fmoe bench`: set up the run, run every policy on the same prompt, return the report (the --json object).

    `rounds` > 1: every policy runs once a round, rounds one after another in this process, the order reversed
    every other round (no policy always first or last); each run re-plans its policy from the statistics so far
    (a configured plan) and warms its cache afresh, as the first round's did. A policy's figures are then the
    medians of its rounds' (combine_rounds), and its ratio to the first policy is also paired within each round:
    what a machine's drift between processes or minutes moves, it moves for every policy alike.

    `replay`: every router's top-k taken from this trace (bench/routing.py); the statistics the plans are made
    from are the trace's (a scratch file: the model's own are neither read nor written), and every run starts
    with a fresh predictor."""
    console = console or Console(stderr=True)
    check_counts(tokens, warmup, rounds)
    prompt = DEFAULT_PROMPT if prompt is None else prompt
    if replay is None:
        return _run_bench(opts, tokens, warmup, prompt, console, rounds, None)
    with tempfile.TemporaryDirectory(prefix="fmoe-replay-") as scratch:
        opts = replace(opts, replay_routing=replay.path, stats_path=Path(scratch) / "routing.stats.json")
        return _run_bench(opts, tokens, warmup, prompt, console, rounds, replay)


def _run_bench(opts: RunOptions, tokens: int, warmup: int, prompt: str, console: Console, rounds: int,
               trace: Trace | None) -> dict:
    interrupted = False
    replay: list[ReplayedRouting] = []

    def check_model(shape) -> None:
        """Before a weight is read: the trace's shape against the model's, and the trace's statistics saved
        where this run reads its statistics from."""
        if trace is not None:
            replay.append(ReplayedRouting(trace, shape))
            replay[0].statistics(shape, opts.model).save(opts.stats_path)

    with open_run(opts, console, say_timing_note=False, check_model=check_model) as run, ExitStack() as hooks:  # the note: under the table
        lm, engine = run.lm, run.engine
        prompt_ids = encode_prompt(lm, prompt)
        check_context(run.context or context_length(lm), prompt_ids.shape[-1], max(tokens, warmup), "--tokens" if tokens >= warmup else "--warmup")
        routing = replay[0] if replay else None
        if routing is not None:
            check_replay_length(trace, prompt_ids.shape[-1], tokens, warmup)
            routing.install(lm.layers)
            hooks.callback(routing.uninstall)
            engine.graph_veto = "the routing is replayed from a trace, token by token, by Python"  # a graph: frozen
            hooks.callback(setattr, engine, "graph_veto", None)
            console.print(replay_note(routing), highlight=False, soft_wrap=True, markup=False)
            if opts.predictor not in ROUTING_ONLY_PREDICTORS:
                console.print(f"[dim]note: --predictor {opts.predictor} reads the model's hidden states, which did "
                              f"not make the replayed routing: its predictions run but are not the traced model's; "
                              f"{' and '.join(ROUTING_ONLY_PREDICTORS)} predict from the routing "
                              f"(docs/replay-routing.md)[/dim]", highlight=False, soft_wrap=True)
        recorder = RouteRecorder(run.writer) if run.writer is not None else None
        measured: list[list[RunResult]] = [[] for _ in run.settings]  # per policy, its rounds in order
        index = round_index = 0
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
            warm = warm_round_tokens(lm.device)
            if warm:  # every policy once, unmeasured: the process's warm-up is not the first measured policy's
                task = bar.add_task(f"warm-up round (unmeasured): {len(run.settings)} policies",
                                    total=len(run.settings))
                for index in range(len(run.settings)):
                    bench_policy(lm, engine, run.settings_for(index, replan=index > 0), prompt_ids, warm, warmup,
                                 configure=index > 0)
                    bar.advance(task)
                    run.idle()
                bar.remove_task(task)
            try:
                for round_index in range(rounds):
                    order = range(len(run.settings))
                    for index in (order if round_index % 2 == 0 else reversed(order)):
                        first = round_index == 0 and index == 0 and not warm  # open_run configured the engine for it
                        s = run.settings_for(index, replan=not first)
                        seq = s.policy if rounds == 1 else f"{s.policy}-round{round_index + 1}"

                        def start(seq: str = seq) -> None:
                            run.idle()  # after the warm-up: a plan made without recorded routing is made again
                            if recorder is not None:  # one trace sequence per measured run
                                recorder.start_sequence(seq)
                                engine.observers.append(recorder)
                        if routing is not None:  # a fresh predictor: no run learns from an earlier one's routing
                            engine.predictor = routing.predictor(opts.predictor, lm.layers, lm.shape)
                            engine.predictor.replan()
                        label = s.policy if rounds == 1 else f"{s.policy} (round {round_index + 1}/{rounds})"
                        task = bar.add_task(f"{label}: {warmup} warm-up + {tokens} tokens", total=warmup + tokens)
                        measured[index].append(bench_policy(lm, engine, s, prompt_ids, tokens, warmup,
                                                            before_measure=start, configure=not first,
                                                            advance=lambda task=task: bar.advance(task),
                                                            on_generate=routing.restart if routing else lambda: None))
                        bar.remove_task(task)
                        if recorder is not None:
                            engine.observers.remove(recorder)
                        run.idle()  # the device is idle between runs: statistics saved, re-planned if due
            except KeyboardInterrupt as exc:  # Ctrl-C: what was measured is reported, marked partial
                if isinstance(exc, PartialRun):
                    measured[index].append(exc.result)  # the policy it cut short
                if not any(measured):
                    raise
                interrupted = True
    runs = [combine_rounds(results) if rounds > 1 else results[0] for results in measured if results]
    report = bench_report(lm, engine.link, run.budget_bytes, runs, prompt_tokens=prompt_ids.shape[-1], tokens=tokens,
                          warmup=warmup, token_ids=[r.token_ids for results in measured for r in results],
                          rounds=rounds)
    report["timings"] = run.timing_source  # the configurator's: "profile", "quick estimate", or None
    report["timing_note"] = run.timing_note  # how to make a quick estimate firm, where that could change the plan
    host = saved_host_profile()  # this machine's host profile (`fmoe profile`), for the host lane's figures
    fit = None if host is None else host.fit(host_format(lm.shape))
    report["host_profile"] = {"line": host_line(host, host_format(lm.shape)),
                              "fit": None if fit is None else asdict(fit)}
    if interrupted:
        report["interrupted"] = {"finished": [results[0].policy for results in measured if len(results) == rounds
                                              and all(r.measured is None for r in results)],
                                 "requested": list(opts.policies)}
        if rounds > 1:
            report["interrupted"]["round"] = round_index + 1  # the round Ctrl-C came in
    report["predictor"] = opts.predictor
    report["warm_round_tokens"] = warm
    if routing is not None:
        report["routing"] = {"replayed_from": str(routing.path), "note": replay_note(routing),
                             "layers": routing.num_layers, "trace_layers": routing.trace_layers,
                             "trace_tokens": routing.num_tokens, "sequences": len(routing.sequences)}
    if run.writer is not None and run.writer.error is not None:  # reported after the results (fmoe_cli/cli.py)
        report["trace_error"] = run.writer.error
    return report
