"""The `fmoe` command line: the commands and their options, nothing else."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

# Only modules without torch here: every option is checked before anything heavy is imported.
from fmoe_cli import chat as chat_defaults
from fmoe_cli import serve as serve_defaults
from fmoe_cli.bench import check_counts, check_profile_options, check_replay, read_prompt
from fmoe_cli.chat import ChatOptions
from fmoe_cli.disk import run_cache
from fmoe_cli.errors import FmoeError
from fmoe_cli.models.config import check_servable
from fmoe_cli.models.hub import fetch_config_early, fetch_model_early
from fmoe_cli.bench.replay import DEFAULT_EVICTIONS, run_replay
from fmoe_cli.offload.policies import LCP_OMEGA, LCP_RHO, POLICIES
from fmoe_cli.options import RunOptions
from fmoe_cli.planning.plan import DEFAULT_BUDGET, check_plan_options
from fmoe_cli.planning.presets import DEFAULT_POLICY, PRESETS, parse_policies
from fmoe_cli.prediction import DEFAULT_PREDICTOR, PREDICTORS, TRACE_PREDICTOR, TRACE_PREDICTOR_HELP
from fmoe_cli.trace import read_trace
from fmoe_cli.types import AUTO_ACTIVATIONS, DEFAULT_DENSE, DEFAULT_EXPERTS

try:  # typer ≥ 0.20 carries its own copy of click
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover - older typer
    from click.exceptions import ClickException


class _App(typer.Typer):
    """Typer with bad command lines (`--tokens abc`, an unknown option) in fmoe's one-line format:
    `error: …` and exit code 2, as every other bad input (not click's boxed usage panel)."""

    def __call__(self, *args, **kwargs):
        if "standalone_mode" in kwargs:
            return super().__call__(*args, **kwargs)
        try:
            code = super().__call__(*args, standalone_mode=False, **kwargs)
        except ClickException as exc:
            message = exc.format_message()
            if message:  # (no message: `fmoe` alone, the help was shown)
                where = exc.ctx.command_path if getattr(exc, "ctx", None) is not None else "fmoe"
                err_console.print(error_line(f"{message} (see `{where} --help`)"), highlight=False, soft_wrap=True)
            sys.exit(exc.exit_code)
        except typer.Abort:
            err_console.print("interrupted")
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


app = _App(
    help="Chat with a Mixture-of-Experts LLM on a GPU that cannot hold it.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
err_console = Console(stderr=True)


def error_line(message: str) -> Text:
    """`error: MESSAGE`, the message as plain text: what the user typed or a file held may hold brackets, which rich
    would read as markup (a `[/x]` would end in a traceback)."""
    return Text.assemble(("error:", "bold red"), " ", message)


def _version(value: bool) -> None:
    if value:
        from fmoe_cli import __version__

        print(f"fmoe {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    """fmoe: split-expert cache, LCP eviction, speculative prefetch (MoEpic)."""


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # before tokenizers is first imported
    import transformers  # slow: only once a command runs, never for --help

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _fetch_model(opts: RunOptions, then=None) -> None:
    """A hub model's config.json fetched before torch is imported (models/hub.py `fetch_model_early`): an unknown id
    or no network one line in under a second; then checked against the run (`RunOptions.check_model_config`, then
    `then(the model's context)`, then transformers' model of it built on the meta device: `load.check_skeleton`, which
    imports torch, 4–5 s, as the command would next) before the weights come."""
    def check(config):
        context = opts.check_model_config(config)
        if then is not None:
            then(context)
        if not opts.trust_remote_code:  # (a model's own code comes with its weights)
            with err_console.status(f"checking {opts.model}'s config.json …"):
                from fmoe_cli.models.load import check_skeleton  # torch: the command imports it next anyway

                check_skeleton(config, opts.model)

    fetch_model_early(opts.model, opts.trust_remote_code, check)


def user_errors(command):
    """Bad input: one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except FmoeError as exc:
            err_console.print(error_line(str(exc)), highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130) from None

    return wrapper


# The option tables are light (no torch): --help stays fast, and the help lists what the tables hold.
POLICY_NAMES = ", ".join(PRESETS)
ModelArg = Annotated[str, typer.Argument(help="Hugging Face model id, a local model directory, or 'demo'.")]
ProfileOpt = Annotated[str | None, typer.Option(help="A device profile from `fmoe profile` (JSON).")]
DeviceOpt = Annotated[str, typer.Option(help="auto, cpu or cuda[:N].")]
DtypeOpt = Annotated[str, typer.Option(help="auto (bfloat16 on CUDA, float16 on cards below sm_80, float32 on CPU), float32, bfloat16, float16.")]
BudgetOpt = Annotated[str, typer.Option(
    "--vram-budget", help="Device memory for experts: auto (what fits on this device; CPU: 25%), 6GiB, 512MiB, or a share of all routed experts such as 25%.")]
LinkOpt = Annotated[float | None, typer.Option(
    "--emulate-link", metavar="GBPS", help="Emulate a host→device link of this many GB/s (any device).")]
OmegaOpt = Annotated[float, typer.Option(
    "--lcp-omega", help="LCP ω: tokens over which an idle expert's priority decays by ρ (MoEpic Eq. 4).")]
RhoOpt = Annotated[float, typer.Option("--lcp-rho", help="LCP ρ ∈ (0, 1]: the decay per ω idle tokens.")]
PredictorOpt = Annotated[str, typer.Option(help=f"Expert predictor of the prefetcher: {', '.join(PREDICTORS)}.")]
TraceOpt = Annotated[str | None, typer.Option(help="Record the routing of every measured run or turn (JSONL trace).")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Let --trace-out overwrite an existing file.")]
TrustOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Allow the repository's own Python code to run.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
ExpertsOpt = Annotated[str, typer.Option(
    "--experts", help="How the routed experts are stored and moved: bf16 (unquantised, in --dtype), int8, int4 "
                      "or int2 (weight-only, group-wise: about 2× / 3.5× / 5.3× fewer bytes in RAM and on the link; "
                      "int2 is HQQ's 2-bit setting for Mixtral's experts).")]
DenseOpt = Annotated[str, typer.Option(
    "--dense", help="How the attention projections and the LM head are stored: bf16 (unquantised, in --dtype), int8 "
                    "(weight-only, group 128) or int4 (group 64: MoEpic's and Mixtral-offloading's attention beside "
                    "int2 experts; the LM head int8). The embedding stays as stored. Default (auto): on the CPU int8 beside "
                    "int8 experts and int4 beside int4 experts, else bf16.")]

ActivationsOpt = Annotated[str, typer.Option(
    "--activations", help="What the CPU kernels multiply int8/int4 weights with: float (the tokens in --dtype: the "
                          "dequantised weights' result, exact) or int8 (quantised per block of 32 and integer dot "
                          "products, as llama.cpp's Q8_0: faster, within a stated tolerance). Default (auto): int8 on "
                          "the CPU beside int8 and int4 experts (with AVX2), else float.")]


HostThreadsOpt = Annotated[int, typer.Option(
    "--host-threads", metavar="N", help="CPU threads of the host lane, where a plan computes misses and bottoms "
                                        "on the host beside the GPU (the hybrid preset).")]
ContextOpt = Annotated[int | None, typer.Option(
    "--context", metavar="TOKENS", help="Tokens of KV cache to reserve on the device; chat keeps its window inside "
                                        "(default: 8192, at most the model's, less on a small GPU).")]


def run_options(model: str, policies, *, dtype: str, lcp_omega: float = LCP_OMEGA, lcp_rho: float = LCP_RHO,
                **fields) -> RunOptions:
    """The RunOptions of a command line (fmoe_cli/options.py: what every option means), checked
    without torch: a bad one is refused at once."""
    opts = RunOptions(model=model, policies=tuple(policies), omega=lcp_omega, rho=lcp_rho,
                      dtype=None if dtype == "auto" else dtype, **fields)
    opts.check()
    return opts


@app.command()
@user_errors
def bench(
    model: ModelArg = "demo",
    policy: Annotated[list[str] | None, typer.Option(
        help=f"Policy to run (repeatable; the first is the ratios' base): {POLICY_NAMES}.")] = None,
    compare: Annotated[str | None, typer.Option(
        help="Policies to run side by side, comma-separated (or 'all'), after any --policy.")] = None,
    vram_budget: BudgetOpt = DEFAULT_BUDGET,
    tokens: Annotated[int, typer.Option(help="Tokens to generate per policy.")] = 32,
    warmup: Annotated[int, typer.Option(help="Tokens generated before measuring (same prompt).")] = 4,
    rounds: Annotated[int, typer.Option(help="Run every policy this many times, rounds interleaved in this process "
                                              "(order reversed every other round); figures are the rounds' medians.")] = 1,
    prompt: Annotated[str | None, typer.Option(help="Prompt (default: a short question).")] = None,
    prompt_file: Annotated[str | None, typer.Option(help="Read the prompt from this text file.")] = None,
    trace_out: TraceOpt = None,
    force: ForceOpt = False,
    replay_routing: Annotated[str | None, typer.Option(
        "--replay-routing", metavar="TRACE",
        help="Take every MoE layer's top-k experts and weights from this routing trace (fmoe JSONL or vLLM) instead "
             "of the router, token by token; the tokens generated are then meaningless.")] = None,
    predictor: Annotated[str, typer.Option(
        help=f"Expert predictor of the prefetcher: {', '.join(PREDICTORS)}; {TRACE_PREDICTOR} "
             f"({TRACE_PREDICTOR_HELP}).")] = DEFAULT_PREDICTOR,
    lcp_omega: OmegaOpt = LCP_OMEGA,
    lcp_rho: RhoOpt = LCP_RHO,
    emulate_link: LinkOpt = None,
    dtype: DtypeOpt = "auto",
    experts: ExpertsOpt = DEFAULT_EXPERTS,
    dense: DenseOpt = DEFAULT_DENSE,
    activations: ActivationsOpt = AUTO_ACTIVATIONS,
    device: DeviceOpt = "auto",
    profile: ProfileOpt = None,
    context: ContextOpt = None,
    host_threads: HostThreadsOpt = 1,
    trust_remote_code: TrustOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Measure TTFT/TPOT, hit rate and link traffic of the offloading engine, policy by policy."""
    opts = run_options(model, parse_policies(policy, compare), vram_budget=vram_budget, predictor=predictor,
                       lcp_omega=lcp_omega, lcp_rho=lcp_rho, emulate_link=emulate_link, trace_out=trace_out,
                       overwrite_trace=force, dtype=dtype, experts=experts, dense=dense, activations=activations,
                       device=device,
                       trust_remote_code=trust_remote_code, shape_link=True, context=context,
                       host_threads=host_threads, replay_routing=replay_routing, profile=profile,
                       if_fits=("resident",) if policy is None and compare is None else ())
    check_counts(tokens, warmup, rounds, opts.context_limit())
    prompt_text = read_prompt(prompt, prompt_file)
    replay = None
    if replay_routing is not None:  # (the standard library alone: a malformed trace is one line at once)
        replay = read_trace(replay_routing)
        check_replay(replay, tokens, warmup, predictor)
    _fetch_model(opts, lambda context: check_counts(tokens, warmup, rounds, context if opts.context is None else opts.context))
    _quiet_libraries()
    from fmoe_cli.bench.run import render, run_bench  # torch: only once the options read

    report = run_bench(opts, tokens=tokens, warmup=warmup, prompt=prompt_text, console=err_console, rounds=rounds,
                       replay=replay)
    if as_json:
        print(json.dumps(report))
    else:
        render(report, Console())
    if report.get("interrupted"):  # the finished policies were printed, marked partial
        raise typer.Exit(130)
    if report.get("trace_error"):  # a full disk: the results are printed first
        raise FmoeError(f"{report['trace_error']} (the results above are complete)")


@app.command()
@user_errors
def chat(
    model: ModelArg = "demo",
    vram_budget: BudgetOpt = DEFAULT_BUDGET,
    policy: Annotated[str, typer.Option(help=f"{POLICY_NAMES}.")] = DEFAULT_POLICY,
    profile: ProfileOpt = None,
    system: Annotated[str | None, typer.Option(help="System prompt.")] = None,
    temperature: Annotated[float | None, typer.Option(help="0 = greedy. Default: the model's generation_config.json, "
                                                     "else 0.7.")] = None,
    top_p: Annotated[float | None, typer.Option("--top-p", help="Nucleus sampling threshold. Default: the model's, "
                                                "else 0.9.")] = None,
    top_k: Annotated[int | None, typer.Option("--top-k", help="Sample among the k most likely tokens (0: off). "
                                              "Default: the model's, else 0.")] = None,
    min_p: Annotated[float | None, typer.Option("--min-p", help="Drop tokens below min-p × the most likely's "
                                                "probability (0: off). Default: the model's, else 0.")] = None,
    repetition_penalty: Annotated[float | None, typer.Option(help="Divide the logits of tokens already in the "
                                                             "conversation by this (1: off). Default: the model's, "
                                                             "else 1.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Longest answer, in tokens.")] = chat_defaults.MAX_NEW_TOKENS,
    seed: Annotated[int | None, typer.Option(help="Sampling seed (reproducible answers).")] = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    experts: ExpertsOpt = DEFAULT_EXPERTS,
    dense: DenseOpt = DEFAULT_DENSE,
    activations: ActivationsOpt = AUTO_ACTIVATIONS,
    predictor: PredictorOpt = DEFAULT_PREDICTOR,
    lcp_omega: OmegaOpt = LCP_OMEGA,
    lcp_rho: RhoOpt = LCP_RHO,
    emulate_link: LinkOpt = None,
    trace_out: TraceOpt = None,
    force: ForceOpt = False,
    context: ContextOpt = None,
    host_threads: HostThreadsOpt = 1,
    trust_remote_code: TrustOpt = False,
) -> None:
    """Chat with a MoE model. Enter sends, Esc+Enter adds a line, Ctrl-C stops an answer, Ctrl-D quits."""
    opts = ChatOptions(run_options(model, [policy], vram_budget=vram_budget, predictor=predictor, lcp_omega=lcp_omega,
                                   lcp_rho=lcp_rho, emulate_link=emulate_link, trace_out=trace_out,
                                   overwrite_trace=force, dtype=dtype, experts=experts, dense=dense, activations=activations,
                       device=device,
                                   trust_remote_code=trust_remote_code, profile=profile, context=context,
                                   host_threads=host_threads),
                       system=system, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                       repetition_penalty=repetition_penalty,
                       max_new_tokens=max_new_tokens, seed=seed)
    opts.check()
    _fetch_model(opts.run)
    _quiet_libraries()
    from fmoe_cli.chat.repl import run_chat  # torch: only once the options read

    run_chat(opts, err_console=err_console)


@app.command()
@user_errors
def serve(
    model: ModelArg = "demo",
    host: Annotated[str, typer.Option(help="Address to listen on (anything but loopback: set an API key).")] = serve_defaults.HOST,
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port; the one bound is printed).")] = serve_defaults.PORT,
    api_key: Annotated[str | None, typer.Option(
        envvar=serve_defaults.API_KEY_ENV, show_envvar=True,
        help="Require `Authorization: Bearer KEY` on every endpoint but /health.")] = None,
    max_queue: Annotated[int, typer.Option(help="Requests that may wait behind the one being answered; more get a 429.")] = serve_defaults.MAX_QUEUE,
    grace: Annotated[float, typer.Option(help="On Ctrl-C or SIGTERM: seconds the answer in progress may take to finish before it is cancelled.")] = serve_defaults.GRACE_S,
    vram_budget: BudgetOpt = DEFAULT_BUDGET,
    policy: Annotated[str, typer.Option(help=f"{POLICY_NAMES}.")] = DEFAULT_POLICY,
    profile: ProfileOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    experts: ExpertsOpt = DEFAULT_EXPERTS,
    dense: DenseOpt = DEFAULT_DENSE,
    activations: ActivationsOpt = AUTO_ACTIVATIONS,
    predictor: PredictorOpt = DEFAULT_PREDICTOR,
    lcp_omega: OmegaOpt = LCP_OMEGA,
    lcp_rho: RhoOpt = LCP_RHO,
    emulate_link: LinkOpt = None,
    trace_out: TraceOpt = None,
    force: ForceOpt = False,
    context: ContextOpt = None,
    host_threads: HostThreadsOpt = 1,
    trust_remote_code: TrustOpt = False,
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /metrics)."""
    options = serve_defaults.ServeOptions(host=host, port=port, api_key=api_key, max_queue=max_queue, grace_s=grace)
    options.check()  # before anything slow
    opts = run_options(model, [policy], vram_budget=vram_budget, predictor=predictor, lcp_omega=lcp_omega,
                       lcp_rho=lcp_rho, emulate_link=emulate_link, trace_out=trace_out, overwrite_trace=force,
                       dtype=dtype, experts=experts, dense=dense, activations=activations, device=device,
                       trust_remote_code=trust_remote_code,
                       profile=profile, context=context, host_threads=host_threads)
    ChatOptions(opts).check()  # what a conversation asks of the run's options (--context), as `fmoe chat` checks it
    sock = options.bind()  # a port in use is one line too, before anything slow is imported
    serve_defaults.limit_malloc_arenas()  # before torch's and the server's threads exist
    try:
        _fetch_model(opts)
        _quiet_libraries()
        from fmoe_cli.serve.app import run_serve  # fastapi, uvicorn and torch: only once the options read
    except BaseException:
        sock.close()
        raise
    run_serve(opts, options, sock, err_console)


@app.command()
@user_errors
def cache(
    action: Annotated[str, typer.Argument(help="list (the default), or clear: remove the converted stores "
                                               "(profiles, statistics and chat history are kept).")] = "list",
    as_json: JsonOpt = False,
) -> None:
    """What fmoe keeps on disk, with sizes (orphaned temporaries of interrupted work are removed)."""
    run_cache(action, as_json, Console())


@app.command()
@user_errors
def replay(
    trace: Annotated[str, typer.Argument(help="Routing trace: fmoe JSONL (as --trace-out writes it), or a vLLM routing dump.")],
    cache_sizes: Annotated[str, typer.Option("--cache-sizes", help="Experts cached per layer: 1-7, 2,4,6 or 1-3,6.")] = "1-7",
    policies: Annotated[str, typer.Option(
        help=f"Comma-separated eviction policies: {', '.join(POLICIES)} (belady is always added).")] = ",".join(
        DEFAULT_EVICTIONS),
    as_json: JsonOpt = False,
) -> None:
    """Replay a routing trace through the engine's cache policies: hit rate per policy and cache size."""
    run_replay(trace, cache_sizes, policies, as_json)


@app.command()
@user_errors
def plan(
    model: Annotated[str, typer.Argument(help="Hugging Face model id (only config.json is fetched), a model directory, or a config.json.")],
    vram: Annotated[str | None, typer.Option(help="Device memory to plan for, e.g. 12GiB (default: the profile's device, else this GPU).")] = None,
    profile: Annotated[str | None, typer.Option(help="A profile from `fmoe profile` (or profiles/*.json): link, memory, timings.")] = None,
    context: ContextOpt = None,
    workspace: Annotated[str, typer.Option(help="Reserve for activations, the allocator and the CUDA context.")] = "512MiB",
    dtype: Annotated[str, typer.Option(help="auto (the config's, else bfloat16), bfloat16, float16, float32.")] = "auto",
    experts: ExpertsOpt = DEFAULT_EXPERTS,
    dense: DenseOpt = DEFAULT_DENSE,
    trace: Annotated[str | None, typer.Option(help="A routing trace (fmoe or vLLM format) to simulate TPOT over.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """How the configurator would split the device memory for MODEL, and the TPOT each policy would get
    (from config.json alone, no weights)."""
    check_plan_options(model, vram=vram, profile_path=profile, context=context, dtype=dtype, workspace=workspace,
                       experts=experts, trace=trace, dense=dense)
    routing = None if trace is None else read_trace(trace)  # (the standard library alone: one line at once)
    config = fetch_config_early(model)  # (before torch, as `_fetch_model`)
    if config is not None:
        check_servable(config, model)  # a checkpoint fmoe cannot serve is no plan: said before torch
    _quiet_libraries()
    from fmoe_cli.planning.report import run_plan  # torch and transformers: only once the options and trace read

    run_plan(model, vram=vram, profile_path=profile, context=context, dtype=None if dtype == "auto" else dtype,
             as_json=as_json, console=Console(), workspace=workspace, experts=experts, trace=trace,
             dense=dense, routing=routing)


@app.command()
@user_errors
def profile(
    model: Annotated[str | None, typer.Option(help="Also time this model layer by layer (id, directory or 'demo').")] = None,
    out: Annotated[str | None, typer.Option(help="Where to write the profile (default: the user's config directory).")] = None,
    emulate_link: LinkOpt = None,
    prefill_len: Annotated[int, typer.Option(help="Prompt length of the timed prefill.")] = 64,
    quick: Annotated[bool, typer.Option(help="Fewer transfer sizes and repeats (seconds, less precise).")] = False,
    dtype: DtypeOpt = "auto",
    experts: ExpertsOpt = DEFAULT_EXPERTS,
    dense: DenseOpt = DEFAULT_DENSE,
    activations: ActivationsOpt = AUTO_ACTIVATIONS,
    device: DeviceOpt = "auto",
    trust_remote_code: TrustOpt = False,
    as_json: JsonOpt = False,
    force: Annotated[bool, typer.Option("--force", help="Let --out overwrite an existing file.")] = False,
) -> None:
    """Measure the host→device link and memory (and per-layer times with --model); save a profile."""
    # The model's layers are timed on the engine of a run without a cache, link emulation or statistics.
    opts = None if model is None else run_options(
        model, ["ondemand"], vram_budget=None, dtype=dtype, experts=experts, dense=dense, activations=activations,
        device=device,
        trust_remote_code=trust_remote_code, record_statistics=False)
    check_profile_options(out=out, emulate_link=emulate_link, prefill_len=prefill_len, device=device, overwrite=force)
    if opts is not None:
        _fetch_model(opts)
    _quiet_libraries()
    from fmoe_cli.bench.profile import run_profile  # torch: only once the options read

    run_profile(opts, out=None if out is None else Path(out), emulate_link=emulate_link, prefill_len=prefill_len,
                quick=quick, as_json=as_json, device=device, console=err_console if as_json else Console())


def main() -> None:
    app()  # exits with the command's code


if __name__ == "__main__":
    sys.exit(main())
