"""`fmoe chat` end to end without a terminal: a scripted reader, prompt-toolkit's pipe
input for the keys, and the CLI over a pipe (stdin not a terminal)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from rich.console import Console
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.main import get_command
from typer.testing import CliRunner

import fmoe_cli.chat.session as session_module
from fmoe_cli.trace import read_trace
from fmoe_cli.chat.repl import Chat, ChatOptions, open_chat, prompt_reader
from fmoe_cli.cli import app
from fmoe_cli.planning.presets import PRESETS
from fmoe_cli.run import RunOptions

MAX_NEW = 6


class Script:
    """A reader that plays a list of inputs; an exception class in the list is raised instead.
    Records the default text it was offered each time (the text given back after an error);
    `on_read(n)` runs before the n-th read."""

    def __init__(self, items, on_read=None) -> None:
        self.items = list(items)
        self.defaults: list[str] = []
        self.on_read = on_read

    def __call__(self, default: str) -> str:
        self.defaults.append(default)
        if self.on_read is not None:
            self.on_read(len(self.defaults))
        if not self.items:
            raise EOFError
        item = self.items.pop(0)
        if isinstance(item, type) and issubclass(item, BaseException):
            raise item
        return item


def start(path, **options) -> Chat:
    opts = ChatOptions(RunOptions(model=str(path), device="cpu", **options), temperature=0.0, max_new_tokens=MAX_NEW)
    return open_chat(opts, err_console=Console(file=io.StringIO()))


def talk(chat_: Chat, items, on_read=None) -> tuple[str, Script]:
    """Header + loop over scripted input, like `fmoe chat`; returns (what was printed, the script)."""
    out = io.StringIO()
    console = Console(file=out, width=80, color_system=None)
    script = Script(items, on_read)
    try:
        chat_.header(console)
        chat_.loop(script, console)
    finally:
        chat_.close()
    return out.getvalue(), script


def chat(path, items, on_read=None, **options):
    c = start(path, **options)
    out, script = talk(c, items, on_read)
    return c.session, out, script


@pytest.fixture(scope="module")
def reference(checkpoints):
    """transformers' own greedy generate on the same checkpoint: (tokenizer, generate(conversation) -> ids)."""
    path = checkpoints["mixtral"]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def generate(messages) -> list[int]:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        return out[0, len(ids):].tolist()

    def keys(ids: list[int]) -> list[torch.Tensor]:
        """Every layer's cached keys after one plain forward over `ids`."""
        with torch.inference_mode():
            cache = model(torch.tensor([ids]), use_cache=True).past_key_values
        return [layer.keys for layer in cache.layers]

    generate.keys = keys
    return generate


def assert_kv_cache_matches(session, reference) -> None:
    """The KV cache kept for the next turn equals a fresh forward over the ids it claims to hold."""
    assert session._kv is not None and session._kv.get_seq_length() == len(session._kv_ids)
    for mine, theirs in zip((layer.keys for layer in session._kv.layers), reference.keys(session._kv_ids), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_scripted_conversation_commands_and_save(checkpoints, reference, tmp_path):
    saved = tmp_path / "conversation.json"
    kv_checked = []

    def check_kv(n):  # the 8th read comes right after the second answer (which reused the first's cache)
        if n == 8:
            assert_kv_cache_matches(session, reference)
            kv_checked.append(n)

    c = start(checkpoints["mixtral"], emulate_link=50.0)
    session = c.session
    out, _ = talk(c, [
        "/system be brief", "hello there", "/help", "/stats", "/plan", "/frobnicate", "what now?",
        f"/save {saved}", "/reset", "/exit", "never read",
    ], on_read=check_kv)
    lines = out.splitlines()
    assert "link: emulated 50 GB/s" in out
    assert any(line.startswith("plan configurator:") for line in lines)  # moepic runs the configured plan
    assert any(line.endswith("Ctrl-D quits · /help") for line in lines[:8])  # keys and the help hint
    assert "sampling greedy (temperature 0)" in lines  # (start's temperature: the tokens are transformers')
    assert "/save FILE" in out and "Esc+Enter" in out  # /help lists commands and keys
    assert sum(1 for line in lines if "tokens · TTFT" in line) == 2  # one footer per answer
    assert any(line.split()[:1] == ["all"] for line in lines)  # /stats total row
    assert "device memory used by fmoe" in out
    assert "θ_i" in out  # /plan
    hint = [line for line in lines if "frobnicate" in line]
    assert hint == ["unknown command /frobnicate; /help lists the commands"]
    assert all(len(line) <= 80 for line in lines)

    data = json.loads(saved.read_text())
    assert data["system"] == "be brief"
    roles = [m["role"] for m in data["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in data["messages"] if m["role"] == "user"] == ["hello there", "what now?"]
    assert session.messages == []  # /reset after /save; "/exit" ended the loop before "never read"

    # The second answer reused the first turn's KV cache and still equals transformers' generate.
    conversation = data["messages"]
    full_prompt = session.encode(conversation[1:4])
    first_prompt = session.encode(conversation[1:2])  # system + first question + the assistant header
    assert 0 < session.last_stats.prompt_tokens <= len(full_prompt) - len(first_prompt)
    assert session.last_answer_ids == reference(conversation[:4])
    assert kv_checked == [8]


def test_ctrl_c_during_answer_keeps_the_conversation(checkpoints, reference, monkeypatch):
    """Ctrl-C arrives inside an expert's forward of the 4th token (experts pinned, loads in flight)."""
    from fmoe_cli.offload.store import HostStore

    real_stream, real_segment = session_module.stream_generate, HostStore.segment_forward
    state = {"answers": 0, "armed": False}

    def stream(*args, **kwargs):
        state["answers"] += 1
        for i, event in enumerate(real_stream(*args, **kwargs)):
            yield event
            state["armed"] = state["answers"] == 1 and i == 2

    def segment(*args, **kwargs):
        if state["armed"]:
            state["armed"] = False
            raise KeyboardInterrupt
        return real_segment(*args, **kwargs)

    monkeypatch.setattr(session_module, "stream_generate", stream)
    monkeypatch.setattr(HostStore, "segment_forward", segment)
    checks = {}

    def after_interrupt(n):  # the 2nd read: right after the interrupted answer
        if n == 2:
            engine = session.engine
            checks["pinned"] = [e for layer in engine.layers for e in range(engine.shape.num_experts)
                                if layer.cache.is_pinned(e)]
            checks["in_use"] = [x for x in engine.pool.entries if x is not None and x.in_use]
            checks["kv"] = session._kv

    c = start(checkpoints["mixtral"])
    session = c.session
    out, _ = talk(c, ["first question", "second question"], on_read=after_interrupt)
    assert "stopped (Ctrl-C) · 3 tokens" in out
    assert checks == {"pinned": [], "in_use": [], "kv": None}  # engine rebuilt clean, KV cache dropped
    roles = [m["role"] for m in session.messages]
    assert roles == ["user", "assistant", "user", "assistant"]  # the partial answer is kept
    full = reference([{"role": "user", "content": "first question"}])
    tok = session.lm.tokenizer
    assert session.messages[1]["content"] == tok.decode(full[:3], skip_special_tokens=True)  # what was shown
    # After the interrupt (KV cache dropped, engine rebuilt) the next answer is exact.
    assert session.last_answer_ids == reference(session.messages[:3])


def test_error_during_answer_gives_the_text_back(checkpoints, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("device on fire")
        yield  # a generator, like the real one

    def restore(n):  # the 3rd read: after the failure, generation works again
        if n == 3:
            monkeypatch.undo()

    monkeypatch.setattr(session_module, "stream_generate", broken)
    session, out, script = chat(checkpoints["mixtral"], ["my long question", KeyboardInterrupt, "typed again"],
                                on_read=restore)
    assert "error: the answer failed: RuntimeError: device on fire" in out
    assert script.defaults[:2] == ["", "my long question"]  # the text came back at the prompt
    assert script.defaults[2] == ""  # Ctrl-C at the prompt cleared it
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["typed again"]


def test_slash_slash_sends_a_slash_message_and_bad_save_is_one_line(checkpoints, tmp_path):
    session, out, _ = chat(checkpoints["mixtral"], ["//etc/hosts is a file", f"/save {tmp_path}/no/such/dir/x.json",
                                                    "/save"])
    assert session.messages[0]["content"] == "/etc/hosts is a file"
    assert sum(1 for line in out.splitlines() if line.startswith("error: cannot write")) == 1
    assert "usage: /save FILE" in out


def test_prompt_toolkit_keys(tmp_path):
    history = tmp_path / "history"
    with create_pipe_input() as pipe:
        read = prompt_reader(history, pt_input=pipe, pt_output=DummyOutput())
        pipe.send_text("line one\x1b\rline two\r")  # Esc+Enter: newline; Enter: submit
        assert read("") == "line one\nline two"
        pipe.send_text("abc\x03")  # Ctrl-C at the prompt
        with pytest.raises(KeyboardInterrupt):
            read("")
        pipe.send_text("\r")  # the text given back after an error is pre-filled
        assert read("given back") == "given back"
        pipe.send_text("\x04")  # Ctrl-D on an empty line
        with pytest.raises(EOFError):
            read("")
    assert "line one" in history.read_text()


def test_cli_chat_over_a_pipe_with_trace(checkpoints, tmp_path):
    trace = tmp_path / "chat.jsonl"
    result = CliRunner().invoke(app, [
        "chat", str(checkpoints["mixtral"]), "--temperature", "0", "--max-new-tokens", "4", "--device", "cpu",
        "--emulate-link", "20", "--trace-out", str(trace), "--seed", "3",
    ], input="hi\nand again\n/exit\n")
    assert result.exit_code == 0, result.output
    assert "link: emulated 20 GB/s" in result.stdout
    assert result.stdout.count("tokens · TTFT") == 2
    t = read_trace(trace)
    assert [s.id for s in t.sequences] == [1, 2]  # one sequence per turn
    assert t.layers == (0, 1, 2, 3)


def spawn_chat(checkpoint, tmp_path, *, max_new_tokens: int, columns: int, preexec_fn=None):
    """`fmoe chat` in a pseudo-terminal (pexpect), greedy, on a 0.5 GB/s emulated link; history under tmp_path.
    preexec_fn: run in the child before the chat starts (pexpect's)."""
    import os
    import sys

    pexpect = pytest.importorskip("pexpect")
    env = dict(os.environ, XDG_DATA_HOME=str(tmp_path), PROMPT_TOOLKIT_NO_CPR="1", HF_HUB_OFFLINE="1")
    return pexpect.spawn(sys.executable, ["-m", "fmoe_cli.cli", "chat", str(checkpoint), "--device", "cpu",
                                          "--temperature", "0", "--max-new-tokens", str(max_new_tokens),
                                          "--emulate-link", "0.5"],
                         env=env, encoding="utf-8", timeout=120, dimensions=(24, columns), preexec_fn=preexec_fn)


# In a terminal's output, from the start of what has not been matched yet: escape sequences (CSI, a two-byte
# ESC, a charset designation, OSC) and whitespace, then the first character of text.
ANSWER_TEXT = r"^(?:\x1b\[[0-9;?<=>]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()*+].|\x1b[^\[\]()*+]|\s)*[^\s\x1b]"


def test_the_answer_text_pattern_skips_terminal_sequences():
    import re

    pattern = re.compile(ANSWER_TEXT, re.DOTALL)
    assert pattern.match("\r\n\x1b[?1l\x1b>\x1b[?25h\x1b]0;t\x07 Hi").group().endswith("H")
    assert pattern.match("\x1b[?1l\x1b>") is None  # only sequences so far: wait for text
    assert pattern.match("\x1b[?1") is None  # a sequence cut in the middle is not text
    assert pattern.match("\x1b(B\x1b[0m") is None


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_ctrl_c_in_a_real_terminal(checkpoints, tmp_path, sigint):
    """A pseudo-terminal: Ctrl-C while an answer streams stops it and the chat goes on; Ctrl-C at the
    prompt clears the line; Ctrl-D quits with exit code 0. Also in a chat started with SIGINT ignored (what a
    non-interactive shell's background command passes on: a test suite started with `&` ran every answer through
    its Ctrl-C before `ctrl_c_raises`)."""
    import signal

    pexpect = pytest.importorskip("pexpect")
    disposition = signal.SIG_DFL if sigint == "default" else signal.SIG_IGN
    child = spawn_chat(checkpoints["mixtral"], tmp_path, max_new_tokens=400, columns=80,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, disposition))
    try:
        child.expect(">>>")
        child.send("tell me everything\r")
        child.expect("tell me everything")
        child.expect_exact("\x1b[?2004l")  # prompt-toolkit has left the prompt (bracketed paste off)
        # The answer's first text: it streams from here (400 tokens take many seconds), so the Ctrl-C lands in it
        # and not in the prefill (a fixed sleep did, on a loaded machine: "before the answer began" is another path).
        # `\S` alone also matched the ESC of prompt-toolkit's own sequences after the prompt (Ctrl-C then landed
        # in the prefill): skip whole escape sequences and whitespace from where the last match ended.
        child.expect(ANSWER_TEXT)
        child.sendintr()  # Ctrl-C during the answer
        child.expect(r"stopped \(Ctrl-C\)")
        child.expect(">>>")
        child.send("half-typed")
        child.sendintr()  # Ctrl-C at the prompt: the line is cleared, the chat goes on
        child.expect(">>>")
        child.send("/save " + str(tmp_path / "c.json") + "\r")
        child.expect("saved 2 messages")
        child.expect(">>>")
        child.sendeof()  # Ctrl-D
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    messages = json.loads((tmp_path / "c.json").read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert "half-typed" not in (tmp_path / "fmoe" / "chat_history").read_text()


def test_idle_hook_runs_between_turns_never_during_an_answer(checkpoints, monkeypatch):
    events: list[str] = []
    real_stream = session_module.stream_generate

    def stream(*args, **kwargs):
        events.append("answer starts")
        yield from real_stream(*args, **kwargs)
        events.append("answer ends")

    def make_idle(lm, engine, budget):
        assert engine.settings is not None and budget > 0

        def hook():
            events.append("idle")
            if events.count("idle") == 2:
                raise RuntimeError("stats file unwritable")

        return hook

    monkeypatch.setattr(session_module, "stream_generate", stream)
    opts = ChatOptions(RunOptions(model=str(checkpoints["mixtral"]), device="cpu"), temperature=0.0, max_new_tokens=3)
    c = open_chat(opts, err_console=Console(file=io.StringIO()), make_idle=make_idle)
    out, _ = talk(c, ["one", "two", "three"])
    assert events == ["answer starts", "answer ends", "idle", "answer starts", "answer ends", "idle",
                      "answer starts", "answer ends", "idle"]
    flat = " ".join(out.split())  # (the console wraps at 80 columns)
    assert flat.count("re-planning") == 1, out
    assert "re-planning failed (RuntimeError: stats file unwritable); the chat goes on with the plan it had" in flat


def test_non_utf8_input_is_refused_in_one_line(checkpoints):
    result = CliRunner().invoke(app, ["chat", str(checkpoints["mixtral"]), "--temperature", "0", "--max-new-tokens",
                                      "2", "--device", "cpu"], input=b"caf\xe9 au lait\nhi\n/exit\n")
    assert result.exit_code == 0, result.output
    errors = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert errors == ["error: the message is not UTF-8 text (bytes 0xe9); it was not sent"], result.stdout
    assert result.stdout.count("tokens · TTFT") == 1  # the next message is answered


def test_text_typed_during_an_answer_comes_back_at_the_prompt(checkpoints, tmp_path):
    """A pseudo-terminal: keys pressed while an answer streams are not echoed into it, and they are
    the start of the next message (with backspace applied)."""
    import re

    pexpect = pytest.importorskip("pexpect")
    child = spawn_chat(checkpoints["mixtral"], tmp_path, max_new_tokens=60, columns=200)
    try:
        child.expect(">>>")
        child.send("tell me everything\r")
        child.expect_exact("\x1b[?2004l")  # prompt-toolkit has left the prompt: the answer streams
        child.send("typed ahedd\x7f\x7fad")  # two backspaces: "typed ahead" (one write: read together)
        child.expect(r"tokens · TTFT")
        answer = child.before
        child.expect(">>>")
        # pre-filled at the prompt: drawn whole, or (keys that came after the answer ended, on a loaded machine)
        # drawn and then edited there; the message it became is checked in the saved conversation below
        child.expect("typed ahe")
        child.send(" too\r")
        child.expect(r"tokens · TTFT")
        child.expect(">>>")
        child.send("/save " + str(tmp_path / "c.json") + "\r")
        child.expect("saved 4 messages")
        child.expect(">>>")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert "typed" not in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", answer)  # not echoed into the answer
    messages = json.loads((tmp_path / "c.json").read_text())["messages"]
    assert messages[2] == {"role": "user", "content": "typed ahead too"}


def test_save_never_overwrites_without_save_bang(checkpoints, tmp_path):
    """Issue 22 §3: /save over an existing file refuses in one line and keeps it; /save! replaces it."""
    mine = tmp_path / "mine.json"
    mine.write_text("the user's own file\n")
    session, out, _ = chat(checkpoints["mixtral"], ["hello", f"/save {mine}"])
    assert mine.read_text() == "the user's own file\n"
    unwrapped = "".join(out.split())  # the 80-column console breaks a long path anywhere
    assert "".join(f"error: {mine} exists: nothing saved; `/save! {mine}` replaces it".split()) in unwrapped
    session, out, _ = chat(checkpoints["mixtral"], ["hello", f"/save! {mine}"])
    assert json.loads(mine.read_text())["messages"][0]["content"] == "hello"


@pytest.mark.parametrize("command", ["/save", "/save!"])
def test_save_to_a_directory_says_it_is_one_and_offers_no_save_bang(checkpoints, tmp_path, command):
    """/save or /save! to a directory: one line that names it a directory, never the /save! hint
    (/save! cannot write there either)."""
    session, out, _ = chat(checkpoints["mixtral"], ["hello", f"{command} {tmp_path}"])
    unwrapped = "".join(out.split())  # the 80-column console breaks a long path anywhere
    assert "".join(f"error: {tmp_path} is a directory: nothing saved".split()) in unwrapped
    assert sum(1 for line in out.splitlines() if line.startswith("error:")) == 1
    assert "/save!" not in unwrapped and list(tmp_path.iterdir()) == []


def test_a_replan_that_runs_out_of_device_memory_says_so_and_the_chat_goes_on(checkpoints, monkeypatch):
    """Issue 20 §2: the idle re-plan runs out of device memory for its plan (and for the plan before): the
    engine builds the staging pool alone, the chat says so in one line, and the next answers run on it."""
    from fmoe_cli.offload.engine import Engine

    real_build = Engine._build
    state = {"oom": False}

    def build(self, settings, policies, steps):
        if state["oom"] and any(lp.cache_size for lp in settings.plan.layers):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return real_build(self, settings, policies, steps)

    def make_idle(lm, engine, budget):
        def hook():
            state["oom"] = True
            engine.configure(engine.settings, warm=True)  # a re-plan to the same plan: it no longer fits

        return hook

    monkeypatch.setattr(Engine, "_build", build)
    opts = ChatOptions(RunOptions(model=str(checkpoints["mixtral"]), device="cpu", policies=("lru",)),
                       temperature=0.0, max_new_tokens=3)
    c = open_chat(opts, err_console=Console(file=io.StringIO()), make_idle=make_idle)
    session = c.session
    out, _ = talk(c, ["one", "two", "three"])
    flat = " ".join(out.split())  # (the console wraps at 80 columns)
    assert flat.count("re-planning: out of device memory for the plan") == 1, out  # what it does instead:
    assert "loading every expert on demand" in flat and "FmoeError" not in flat and "failed" not in flat
    assert session.turns == 3 and sum(1 for m in session.messages if m["role"] == "assistant") == 3
    assert all(lp.cache_size == 0 for lp in session.engine.settings.plan.layers)


def test_the_options_table_of_docs_chat_md_is_what_fmoe_chat_help_lists():
    """docs/chat.md § Options: every option of `fmoe chat`, in --help's order, nothing else; every policy."""
    command = get_command(app).commands["chat"]
    options = [p.opts[0] for p in command.params if p.opts[0].startswith("--")]
    doc = (Path(__file__).resolve().parent.parent / "docs" / "chat.md").read_text(encoding="utf-8")
    section = doc.split("\n## Options\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("`")[1] for line in section.splitlines() if line.startswith("| `--")]
    assert [row.split()[0] for row in rows] == options
    policy_row = next(line for line in section.splitlines() if line.startswith("| `--policy`"))
    assert [word.strip("`,") for word in policy_row.split("|")[3].split("(")[0].split()] == list(PRESETS)


def test_a_chat_seed_moves_on_each_turn_within_what_the_generator_takes():
    """`fmoe chat --seed S`: answer t samples with S + t − 1, wrapped into torch's seed range: the largest seed's
    second answer is the smallest seed, where it overflowed and every answer after the first failed."""
    import torch

    from fmoe_cli.chat.session import turn_seed
    from fmoe_cli.types import SEED_RANGE

    assert [turn_seed(5, t) for t in (1, 2, 3)] == [5, 6, 7]
    assert turn_seed(SEED_RANGE[1], 1) == SEED_RANGE[1] and turn_seed(SEED_RANGE[1], 2) == SEED_RANGE[0]
    for turn in (1, 2, 3):
        torch.Generator().manual_seed(turn_seed(SEED_RANGE[1], turn))  # every one taken


def test_a_history_file_too_large_to_read_is_set_aside(tmp_path, monkeypatch, capsys):
    """prompt-toolkit reads the whole history at the start: one beyond the cap is moved aside (kept, with one line)
    and a new one starts."""
    import fmoe_cli.chat.repl as repl

    monkeypatch.setattr(repl, "MAX_HISTORY_BYTES", 1000)
    history = tmp_path / "history"
    history.write_text("\n# 2026-11-29\n+" + "x" * 2000 + "\n")
    with create_pipe_input() as pipe:
        read = prompt_reader(history, pt_input=pipe, pt_output=DummyOutput())
        pipe.send_text("hello\r")
        assert read("") == "hello"
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("history.large-")]
    assert len(aside) == 1 and "x" * 2000 in aside[0].read_text()
    assert "hello" in history.read_text() and "x" * 2000 not in history.read_text()
    assert capsys.readouterr().err.count("more than 0 MiB: moved to history.large-") == 1
