"""`fmoe bench` and `fmoe replay`. The bench's own options are checked here, without torch
(the command line checks them before anything heavy is imported)."""

from __future__ import annotations

from pathlib import Path

from fmoe_cli.errors import FmoeError
from fmoe_cli.files import read_text, writable_dir
from fmoe_cli.offload import check_bandwidth
from fmoe_cli.options import check_device_text
from fmoe_cli.prediction import TRACE_PREDICTOR
from fmoe_cli.trace import Trace

PROMPT_LIMIT = 16 << 20  # bytes: a prompt file longer than any model's context by far


def read_prompt(prompt: str | None, prompt_file: str | None) -> str | None:
    """The prompt text from --prompt or --prompt-file (not both); None: the default prompt."""
    if prompt is not None and prompt_file is not None:
        raise FmoeError("give --prompt or --prompt-file, not both")
    if prompt_file is None and prompt is None:
        return None
    text = prompt if prompt_file is None else read_text(Path(prompt_file), "prompt file", PROMPT_LIMIT)
    if not text.strip():
        raise FmoeError("the prompt is empty")
    return text


def check_counts(tokens: int, warmup: int, rounds: int = 1, limit: int | None = None) -> None:
    """The counts' ranges; `limit`: the positions a run can hold at most (RunOptions.context_limit), which --tokens
    and --warmup must leave one of for the prompt (the exact check, with the prompt's length, once it is encoded)."""
    if tokens < 1:
        raise FmoeError("--tokens must be at least 1")
    if warmup < 0:
        raise FmoeError("--warmup must be 0 or more")
    if rounds < 1:
        raise FmoeError("--rounds must be at least 1")
    for option, count in (("--tokens", tokens), ("--warmup", warmup)):
        if limit is not None and count >= limit:
            raise FmoeError(f"{option} {count}: the context of {limit} tokens holds the prompt too; use "
                            f"{option} {limit - 1} or less")


def check_replay(trace: Trace, tokens: int, warmup: int, predictor: str) -> None:
    """--replay-routing: the trace must hold the tokens a run routes (a prompt of at least one token and --tokens,
    or --warmup, less one; the exact count once the prompt is encoded: bench/routing.py, check_replay_length), and
    rankings for --predictor trace."""
    longest = max(tokens, warmup)
    if longest > trace.num_tokens:
        option = "--tokens" if tokens >= warmup else "--warmup"
        raise FmoeError(f"--replay-routing {trace.path} holds {trace.num_tokens} tokens, fewer than {option} "
                        f"{longest} and a prompt route; use {option} {max(trace.num_tokens - 1, 1)} or less")
    if predictor == TRACE_PREDICTOR and not any(r.predicted is not None for seq in trace.sequences
                                                for layer in seq.records for r in layer):
        raise FmoeError(f"--predictor {TRACE_PREDICTOR}: the trace {trace.path} has no rankings (`predicted`: an fmoe "
                        f"trace of a run that prefetched has them; a vLLM trace has none); use --predictor eam")


MAX_PREFILL_LEN = 1 << 16  # tokens of `fmoe profile`'s timed prompt (a model's own context bounds it further)


def check_profile_options(*, out: str | Path | None, emulate_link: float | None, prefill_len: int, device: str,
                          overwrite: bool = False) -> None:
    """`fmoe profile`'s own options (a model's are RunOptions'): the file asked for must be writable, and new unless
    `overwrite` (--force: a profile with a model's timings was replaced by a device-only one, as --trace-out's), before
    anything is measured."""
    check_device_text(device)
    if emulate_link is not None:
        check_bandwidth(emulate_link)
    if not 1 <= prefill_len <= MAX_PREFILL_LEN:
        raise FmoeError(f"--prefill-len must be between 1 and {MAX_PREFILL_LEN}, got {prefill_len}")
    if out is not None:  # the user asked for this file: refuse a place it cannot go before measuring
        if Path(out).is_dir():
            raise FmoeError(f"--out {out} is a directory; give a file name")
        if Path(out).exists() and not Path(out).is_file():  # a device or a pipe: the save would replace it
            raise FmoeError(f"--out {out} is not a regular file; give a file name")
        if Path(out).exists() and not overwrite:
            raise FmoeError(f"--out {out} exists; give another name, or pass --force to overwrite it")
        if not Path(out).parent.is_dir():  # as --trace-out: a mistyped directory is not made
            raise FmoeError(f"--out {out}: no directory {Path(out).parent}")
        if (why := writable_dir(Path(out).parent)) is not None:
            raise FmoeError(f"--out {out}: cannot write in {Path(out).parent} ({why})")
