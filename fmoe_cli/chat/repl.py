"""`fmoe chat`: the read-eval-print loop around a ChatSession.

Keys (prompt-toolkit): Enter sends; Esc then Enter (or Alt+Enter) inserts a new line;
Ctrl-C at the prompt clears the line; Ctrl-C during an answer stops it (the
conversation is kept); Ctrl-D on an empty line quits. History persists in the
user data directory. When stdin is not a terminal, lines are read plainly (one
message per line), so `fmoe chat` can be scripted.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import platformdirs
from prompt_toolkit import PromptSession
from prompt_toolkit.history import FileHistory, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from fmoe_cli.trace import RouteRecorder, TraceWriter
from fmoe_cli.chat import ChatOptions
from fmoe_cli.chat.session import ChatSession, IdleHook, IdleWork
from fmoe_cli.errors import FmoeError, warn
from fmoe_cli.files import set_aside
from fmoe_cli.generate import SamplingParams
from fmoe_cli.models.config import sampling_defaults
from fmoe_cli.models.load import LoadedModel, native_bf16, precision_label
from fmoe_cli.offload.engine import Counters, Engine
from fmoe_cli.run import open_run

MiB = 1024**2
KEYS = "Enter sends · Esc+Enter new line · Ctrl-C stops an answer · Ctrl-D quits · /help"
COMMANDS = {
    "/help": "this help",
    "/stats": "per-layer hit rates, prefetch accuracy, exposed load time, device memory",
    "/plan": "the current cache plan (V_i, C_i, θ_i per layer)",
    "/system TEXT": "set the system prompt (/system alone shows it; /system - clears it)",
    "/reset": "start a new conversation (the system prompt stays)",
    "/save FILE": "save the conversation as JSON (an existing FILE is kept: /save! FILE replaces it)",
    "/exit": "quit (also Ctrl-D)",
}
Reader = Callable[[str], str]  # default text -> the user's input; raises KeyboardInterrupt / EOFError
# Makes the idle hook instead of the run's re-planner (tests): (model, engine, expert budget bytes) -> hook.
IdleFactory = Callable[[LoadedModel, Engine, int], IdleHook | None]


# --- input -------------------------------------------------------------------


def history_path() -> Path:
    return Path(platformdirs.user_data_dir("fmoe")) / "chat_history"


def prompt_reader(history: Path | None, *, pt_input=None, pt_output=None) -> Reader:
    """A prompt-toolkit reader: Enter submits, Esc+Enter / Alt+Enter inserts a newline."""
    bindings = KeyBindings()

    @bindings.add("enter")
    def _submit(event) -> None:
        event.current_buffer.validate_and_handle()

    @bindings.add("escape", "enter")
    def _newline(event) -> None:
        event.current_buffer.insert_text("\n")

    store = InMemoryHistory()
    if history is not None:
        try:  # history is appended after every message: it must open for appending now
            set_aside_large_history(history)
            history.parent.mkdir(parents=True, exist_ok=True)
            with open(history, "ab"):
                pass
            store = _file_history()(str(history))
        except OSError as exc:
            warn(f"chat history {history} cannot be written ({exc.strerror or exc}); "
                 "this session's history is not kept")
    session = PromptSession(history=store, multiline=True, key_bindings=bindings, input=pt_input, output=pt_output,
                            prompt_continuation="... ")
    return lambda default: session.prompt(">>> ", default=default)


MAX_HISTORY_BYTES = 8 * 2**20  # prompt-toolkit reads the whole history file at start: ~2.5 × its size in memory


def set_aside_large_history(history: Path) -> None:
    """A history file beyond MAX_HISTORY_BYTES (it grows by every message, and is read whole at the start: 512 MiB
    made a chat take 1.27 GB) is moved aside, kept for the user, and a new one starts; one line says so."""
    try:
        size = history.stat().st_size
    except OSError:
        return
    if size > MAX_HISTORY_BYTES:
        aside = set_aside(history, "large")
        warn(f"chat history {history} is {size / 2**20:.0f} MiB, more than {MAX_HISTORY_BYTES // 2**20} MiB: moved "
             f"to {aside.name}, and a new history starts")


def _file_history():
    class SafeFileHistory(FileHistory):
        """A FileHistory that stops writing (one warning) instead of failing inside the event loop."""

        def store_string(self, string: str) -> None:
            if getattr(self, "_failed", False):
                return
            try:
                super().store_string(string)
            except OSError as exc:
                self._failed = True
                warn(f"chat history {self.filename} cannot be written ({exc.strerror or exc}); "
                     "this session's history is not kept")

    return SafeFileHistory


def line_reader(stream=None) -> Reader:
    """Plain lines from a pipe (stdin not a terminal): one message per line, EOF quits."""
    stream = stream or sys.stdin
    raw = getattr(stream, "buffer", None)  # bytes: a line that is not UTF-8 is read, and refused by the loop

    def read(default: str) -> str:
        line = raw.readline().decode("utf-8", "surrogateescape") if raw is not None else stream.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n").removesuffix("\r")

    return read


def not_utf8(text: str) -> str | None:
    """None for proper text; else what is wrong, for one line. Input that is not UTF-8 reaches Python
    as lone surrogates (the bytes escaped), which no tokenizer can encode."""
    bad = [c for c in text if "\udc80" <= c <= "\udcff"]
    if not bad:
        bad = [c for c in text if "\ud800" <= c <= "\udfff"]
        return None if not bad else "the message holds a lone UTF-16 surrogate; it was not sent"
    shown = " ".join(f"0x{ord(c) - 0xDC00:02x}" for c in bad[:3])
    return f"the message is not UTF-8 text (bytes {shown}{' …' if len(bad) > 3 else ''}); it was not sent"


@contextlib.contextmanager
def held_typeahead(fd: int) -> Iterator[list[str]]:
    """While an answer streams: the terminal does not echo keystrokes into it (ECHO and ICANON off,
    ISIG kept: Ctrl-C still stops the answer); afterwards what was typed is read without waiting and
    handed back (appended to the yielded list) for the next prompt. Not a terminal: does nothing."""
    typed: list[str] = []
    try:
        import termios

        saved = termios.tcgetattr(fd)
    except (ImportError, OSError, ValueError):  # no termios (Windows), not a terminal
        yield typed
        return
    quiet = termios.tcgetattr(fd)
    quiet[3] &= ~(termios.ECHO | termios.ICANON)  # lflag
    quiet[6][termios.VMIN], quiet[6][termios.VTIME] = 0, 0  # reads never wait
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        with ctrl_c_raises():
            yield typed
    finally:
        data = b""
        try:
            while chunk := os.read(fd, 4096):
                data += chunk
        except OSError:
            pass
        termios.tcsetattr(fd, termios.TCSANOW, saved)
        text = data.decode("utf-8", "replace")
        text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z~]|\x1b.?", "", text)  # arrow keys and other escape sequences
        kept: list[str] = []
        for c in text:
            if c in "\x7f\b":  # backspace: the terminal did not erase, so do it here
                if kept:
                    kept.pop()
            elif c in "\n\t" or c >= " ":
                kept.append(c)
        typed.append("".join(kept).rstrip("\n"))


@contextlib.contextmanager
def ctrl_c_raises() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt in the block, also in a chat started with SIGINT ignored (a non-interactive
    shell starts its background commands so, and they pass it on: Python then installs no handler). prompt-toolkit
    takes Ctrl-C at the prompt as a key whatever the signal's disposition, so the answer must stop on it too (seen:
    a test suite started in the background, where every pseudo-terminal chat ran its whole answer through Ctrl-C).
    The disposition is put back afterwards. Only the main thread can set a handler; elsewhere nothing changes."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


# --- output ------------------------------------------------------------------

_CONTROL = {c: "\ufffd" for c in range(32) if chr(c) not in "\n\t"} | {127: "\ufffd"}


def say(console: Console, text: str, style: str | None = None) -> None:
    """One line of plain text: no markup, highlighting or emoji codes read into it."""
    console.print(text, style=style, markup=False, highlight=False, emoji=False)


def error(console: Console, message: str) -> None:
    console.print(Text.assemble(("error:", "bold red"), " ", message), highlight=False)


def printable(text: str) -> str:
    """Model text for the terminal: control characters (a bell, an escape sequence) shown as U+FFFD."""
    return text.translate(_CONTROL)



def sampling_line(sampling: SamplingParams, source: str) -> str:
    """The header's sampling: greedy, or each step that is on; where the defaults came from."""
    if sampling.temperature == 0:
        steps = "greedy (temperature 0)"
    else:
        steps = " · ".join([f"temperature {sampling.temperature:g}"]
                           + ([f"top-p {sampling.top_p:g}"] if sampling.top_p < 1 else [])
                           + ([f"top-k {sampling.top_k}"] if sampling.top_k > 0 else [])
                           + ([f"min-p {sampling.min_p:g}"] if sampling.min_p > 0 else []))
    if sampling.repetition_penalty != 1:
        steps += f" · repetition penalty {sampling.repetition_penalty:g}"
    uses_defaults = sampling.temperature != 0 or sampling.repetition_penalty != 1  # (greedy reads no other field)
    return f"sampling {steps}" + (f" (defaults: {source})" if source and uses_defaults else "")


def header_lines(session: ChatSession, link_label: str, budget_bytes: int, profile: str | None) -> list[str]:
    lm = session.lm
    label = lm.label
    if lm.model_id == "demo" and "tiny" not in label.lower():
        label = f"tiny demo model: {label}"
    dtype = str(lm.dtype).removeprefix("torch.")
    precision = precision_label(dtype, lm.shape.experts, lm.dense, lm.activations)
    if lm.device.type == "cuda" and dtype == "float16" and not native_bf16(lm.device):
        precision += ": this card has no native bfloat16"
    lines = [
        f"[bold]fmoe chat[/bold] · {escape(label)}",
        f"device {lm.device} ({precision}) · {link_label} · "
        f"VRAM budget {budget_bytes / MiB:.1f} MiB for experts",
        f"plan {session.settings.plan.summary()}",
    ]
    if session.context_limit:
        lines.append(f"context {session.context_limit} tokens (--context: the KV cache reserved, the window kept)")
    lines.append(sampling_line(session.sampling, session.sampling_source))
    if profile:
        lines.append(f"profile {profile}")
    lines.append(f"[dim]{KEYS}[/dim]")
    return lines


def help_table() -> Table:
    table = Table(box=None, show_header=False, padding=(0, 2, 0, 0))
    table.add_column(style="bold")
    table.add_column()
    for command, what in COMMANDS.items():
        table.add_row(command, what)
    table.add_row("//text", "send a message that starts with '/'")
    table.add_row("", "")
    for key, what in (("Enter", "send"), ("Esc+Enter", "new line (also Alt+Enter)"),
                      ("Ctrl-C", "stop the answer (the conversation is kept) / clear the line"),
                      ("Ctrl-D", "quit (on an empty line)")):
        table.add_row(key, what)
    return table


def stats_table(session: ChatSession) -> Table:
    """Per-layer counters over the session (plus the answer in flight, none between turns)."""
    totals = session.layer_totals or [Counters() for _ in session.engine.layers]
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), show_edge=False, title="expert cache, this session")
    for col in ("layer", "active", "hit", "full", "top", "miss", "prec", "rec", "exp ms", "MiB in"):
        table.add_column(col, justify="right")

    def row(name: str, c: Counters) -> list[str]:
        return [name, str(c.activations), f"{c.hit_rate:.2f}", str(c.hits_full), str(c.hits_top), str(c.misses),
                f"{c.prefetch_precision:.2f}", f"{c.prefetch_recall:.2f}", f"{c.exposed_s * 1000:.1f}",
                f"{c.bytes_moved / MiB:.1f}"]

    for i, c in enumerate(totals):
        table.add_row(*row(str(i), c))
    table.add_row(*row("all", sum(totals, Counters())), style="bold")
    return table


def memory_line(session: ChatSession, budget_bytes: int) -> str:
    engine, plan = session.engine, session.settings.plan
    return (f"device memory used by fmoe: {session.device_bytes() / MiB:.1f} MiB (non-expert weights "
            f"{session.lm.non_expert_bytes / MiB:.1f}, expert caches {plan.cache_bytes / MiB:.1f}, staging "
            f"{(engine.pool.nbytes if engine.pool else 0) / MiB:.1f}); expert budget {budget_bytes / MiB:.1f} MiB")


def plan_table(session: ChatSession) -> Table:
    plan = session.settings.plan
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), show_edge=False)
    for col in ("layer", "V_i MiB", "C_i", "θ_i", "k_i"):
        table.add_column(col, justify="right")
    for i, lp in enumerate(plan.layers):
        table.add_row(str(i), f"{lp.vram_bytes / MiB:.2f}", str(lp.cache_size), f"{lp.split:.3f}", str(lp.top_neurons))
    return table


# --- the loop ------------------------------------------------------------------


def handle_command(line: str, session: ChatSession, console: Console, budget_bytes: int) -> bool:
    """Run one slash command; False means exit."""
    name, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    if name in ("/exit", "/quit", "/bye"):
        return False
    if name in ("/help", "/?"):
        console.print(help_table())
    elif name == "/stats":
        console.print(stats_table(session))
        say(console, memory_line(session, budget_bytes))
    elif name == "/plan":
        say(console, f"plan {session.settings.plan.summary()}")
        console.print(plan_table(session))
    elif name == "/system":
        if not arg:
            say(console, f"system prompt: {session.system!r}" if session.system else
                "no system prompt; set one with /system TEXT")
        else:
            session.check_system(None if arg == "-" else arg)
            session.system = None if arg == "-" else arg
            say(console, "system prompt cleared" if session.system is None else "system prompt set", "dim")
    elif name == "/reset":
        session.reset()
        say(console, "conversation cleared", "dim")
    elif name in ("/save", "/save!"):
        if not arg:
            say(console, "usage: /save FILE", "yellow")
        else:
            path = session.save(arg, overwrite=name == "/save!")
            say(console, f"saved {len(session.messages)} messages to {path}", "dim")
    else:
        say(console, f"unknown command {name}; /help lists the commands", "yellow")
    return True


def repl(session: ChatSession, read: Reader, console: Console, budget_bytes: int, idle: IdleHook | None = None,
         hold: Callable[[], contextlib.AbstractContextManager[list[str]]] | None = None) -> None:
    """Read, answer, repeat. Bad input and failures print one line; the typed text is never lost
    (after an error it comes back at the prompt). `hold`: a terminal's typeahead keeper (see
    `held_typeahead`): what is typed during an answer is not echoed into it and comes back at the prompt."""
    work = IdleWork(idle)
    hold = hold or (lambda: contextlib.nullcontext([]))
    pending = ""
    try:
        while True:
            try:
                text = read(pending)
            except KeyboardInterrupt:  # Ctrl-C at the prompt: clear the line
                pending = ""
                continue
            except EOFError:  # Ctrl-D
                break
            pending = ""
            if not text.strip():
                continue
            if (problem := not_utf8(text)) is not None:
                error(console, problem)
                continue
            try:
                problem = work.wait()  # the device is needed again: the idle work must be done
            except KeyboardInterrupt:  # Ctrl-C while re-planning finishes: keep the text, ask again
                console.print()
                pending = text
                continue
            if problem:
                say(console, problem, "yellow")
            if text.startswith("/") and not text.startswith("//"):
                try:
                    if not handle_command(text, session, console, budget_bytes):
                        break
                except FmoeError as exc:
                    error(console, str(exc))
                continue
            message = text[1:] if text.startswith("//") else text
            typed: list[str] = []
            try:
                with hold() as typed:
                    stats = session.ask(message, on_text=lambda t: console.print(
                        printable(t), end="", markup=False, highlight=False, emoji=False, soft_wrap=True))
            except FmoeError as exc:
                error(console, str(exc))
                pending = text
                continue
            except KeyboardInterrupt:  # before the answer began (ask handles it once generating)
                console.print()
                pending = text
                continue
            except Exception as exc:  # a failure inside generation: report it, keep the text
                console.print()
                first = str(exc).splitlines()[0] if str(exc) else ""
                error(console, f"the answer failed: {exc.__class__.__name__}: {first}")
                pending = text
                continue
            console.print()
            if stats.dropped:
                say(console, f"(the {stats.dropped} oldest messages no longer fit the model's context of "
                             f"{session.context_limit} tokens: this answer did not see them)", "yellow")
            say(console, stats.footer(), "dim")
            pending = "".join(typed)  # typed during the answer: the start of the next message
            work.start()  # re-plan while the user types the next message
    finally:
        work.wait()


@dataclass
class Chat:
    """A started chat: the session and what the loop and the header need."""

    session: ChatSession
    budget_bytes: int
    link_label: str
    profile: str | None = None
    idle: IdleHook | None = None
    resources: ExitStack = field(default_factory=ExitStack)  # the run: statistics, engine, trace writer
    trace: TraceWriter | None = None  # --trace-out: a failure to write it is said when the chat ends

    def header(self, console: Console) -> None:
        for line in header_lines(self.session, self.link_label, self.budget_bytes, self.profile):
            console.print(line, highlight=False)

    def loop(self, read: Reader, console: Console, hold=None) -> None:
        repl(self.session, read, console, self.budget_bytes, self.idle, hold)

    def close(self) -> None:
        self.resources.close()
        if self.trace is not None and self.trace.error is not None:
            warn(f"{self.trace.error}; the chat itself was not affected")


def open_chat(opts: ChatOptions, err_console: Console | None = None, make_idle: IdleFactory | None = None) -> Chat:
    """Check the options, set up the run (model loading progress on `err_console`), start the session."""
    opts.check()
    with ExitStack() as stack:
        run = stack.enter_context(open_run(opts.run, err_console))
        recorder = RouteRecorder(run.writer) if run.writer is not None else None
        if recorder is not None:  # one trace sequence per turn
            run.engine.observers.append(recorder)
        idle = make_idle(run.lm, run.engine, run.budget_bytes) if make_idle is not None else run.idle
        sampling, source = opts.sampling(sampling_defaults(run.lm.path))
        session = ChatSession(run.lm, run.engine, system=opts.system,
                              sampling=SamplingParams(**sampling, seed=opts.seed), sampling_source=source,
                              max_new_tokens=opts.max_new_tokens, recorder=recorder, context=run.context)
        session.check_system(opts.system)
        return Chat(session, run.budget_bytes, run.engine.link.label(), run.profile, idle, stack.pop_all(), run.writer)


def run_chat(opts: ChatOptions, console: Console | None = None, err_console: Console | None = None,
             read: Reader | None = None) -> ChatSession:
    """`fmoe chat`: start, print the header, run the loop until /exit or Ctrl-D. Returns the session."""
    console = console or Console()
    chat = open_chat(opts, err_console)
    try:
        chat.header(console)
        hold = None
        if read is None:
            terminal = sys.stdin.isatty()
            read = prompt_reader(history_path()) if terminal else line_reader()
            hold = partial(held_typeahead, sys.stdin.fileno()) if terminal else None
        chat.loop(read, console, hold)
    finally:
        chat.close()
    return chat.session
