"""`fmoe serve` through the openai client and raw HTTP, on a real uvicorn on a loopback port
(in-process: one model load for the module; the command itself in a subprocess at the end).

Timing-dependent behaviour (a request waiting, a client gone mid-answer) is driven by a gate
in the generation loop that the test opens token by token, never by sleeps."""

from __future__ import annotations

import http.client
import io
import json
import socket
import threading
import time

import openai
import pytest
import torch
from hypothesis import given, settings, strategies as st
from rich.console import Console
from transformers import AutoModelForCausalLM

import fmoe_cli.chat.session as session_module
from fmoe_cli.chat import ChatOptions
from fmoe_cli.chat.repl import open_chat
from fmoe_cli.generate import encode_messages, encode_text
from fmoe_cli.models.demo import SHIPPED
from fmoe_cli.options import RunOptions
from fmoe_cli.serve import ServeOptions
from fmoe_cli.serve.app import SHUTDOWN_SLACK_S, serve_in, start_service

WAIT_S = 60  # a generous bound on waiting for an event (a failing test, not a slow one, reaches it)


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def http_request(port: int, method: str, path: str, body: bytes | str | None = None, headers: dict | None = None):
    """(status, headers, decoded JSON or text) over plain HTTP."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        data = response.read().decode()
        try:
            data = json.loads(data)
        except json.JSONDecodeError:
            pass
        return response.status, response.headers, data  # headers: case-insensitive
    finally:
        conn.close()


class Server:
    """The app on a real uvicorn in a thread, on a free loopback port."""

    def __init__(self, service) -> None:
        self.service = service
        self.sock = ServeOptions(port=0).bind()
        self.port = self.sock.getsockname()[1]
        self.server = serve_in(service, self.sock, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, "the server to start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=kwargs.pop("api_key", "none"), max_retries=0, **kwargs)

    def request(self, method: str, path: str, body: bytes | str | None = None, headers: dict | None = None):
        return http_request(self.port, method, path, body, headers)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT_S)
        self.service.worker.close(cancel_current=True)
        self.service.worker.join(WAIT_S)
        self.sock.close()


@pytest.fixture(scope="module")
def chat_run():
    chat = open_chat(ChatOptions(RunOptions(model="demo", device="cpu")), Console(file=io.StringIO()))
    yield chat
    chat.close()


@pytest.fixture(scope="module")
def server(chat_run):
    s = Server(start_service(chat_run.session, "demo", ServeOptions(port=0), chat_run.idle))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(chat_run):
    """transformers' own greedy generate on the demo checkpoint: ids -> generated ids (EOS dropped)."""
    model = AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32).eval()
    tok = chat_run.session.lm.tokenizer

    def generate(ids: list[int], n: int) -> list[int]:
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, top_k=None, top_p=None,
                             temperature=None, pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
        return [t for t in out if t != tok.eos_token_id]

    return generate


def chat_ids(server, messages) -> list[int]:
    return encode_messages(server.service.session.lm.tokenizer, messages, "demo")


def decode(server, ids) -> str:
    return server.service.session.lm.tokenizer.decode(ids, skip_special_tokens=True)


def finish(expected: list[int], n: int) -> str:
    return "length" if len(expected) == n else "stop"


MESSAGES = [{"role": "user", "content": "The LORD is my shepherd; I shall not want."}]


def test_health_and_models(server):
    assert server.request("GET", "/health")[:1] == (200,)
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["demo"]
    assert server.client().models.retrieve("demo").id == "demo"
    status, _, body = server.request("GET", "/v1/models/other")
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_chat_at_temperature_0_equals_transformers(server, reference):
    expected = reference(chat_ids(server, MESSAGES), 12)
    done = server.client().chat.completions.create(model="demo", messages=MESSAGES, max_tokens=12, temperature=0)
    assert done.choices[0].message.content == decode(server, expected)
    assert done.choices[0].message.role == "assistant"
    assert done.usage.completion_tokens == min(len(expected) + 1, 12)  # an EOS counts
    assert done.usage.prompt_tokens == len(chat_ids(server, MESSAGES))
    assert done.choices[0].finish_reason == finish(expected, 12)


def test_chat_stream_with_usage(server, reference):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "In the beginning"}]
    expected = reference(chat_ids(server, messages), 10)
    chunks = list(server.client().chat.completions.create(
        model="demo", messages=messages, max_completion_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == decode(server, expected)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish(expected, 10)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == min(len(expected) + 1, 10)
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completions_stream_and_not(server, reference):
    prompt = "And God said, Let there be light"
    expected = decode(server, reference(encode_text(server.service.session.lm.tokenizer, prompt, "demo"), 9))
    client = server.client()
    done = client.completions.create(model="demo", prompt=prompt, max_tokens=9, temperature=0)
    assert done.object == "text_completion" and done.choices[0].text == expected
    chunks = list(client.completions.create(model="demo", prompt=prompt, max_tokens=9, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == done.choices[0].finish_reason


# --- the queue, cancellation and concurrency (driven by a gate, never by sleeps) ------------


class Gate:
    """Holds the generation loop before each token until the test lets it through."""

    def __init__(self, monkeypatch) -> None:
        self.permits = threading.Semaphore(0)
        self.arrivals = 0  # tokens the loop has asked for (the last may be waiting)
        self.opened = False
        real = session_module.stream_generate

        def gated(*args, **kwargs):
            events = real(*args, **kwargs)
            try:
                while True:
                    self.arrivals += 1
                    if not self.opened:
                        assert self.permits.acquire(timeout=WAIT_S), "the test never opened the gate"
                    try:
                        event = next(events)
                    except StopIteration:
                        return
                    yield event
            finally:
                events.close()

        monkeypatch.setattr(session_module, "stream_generate", gated)

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self.permits.release()

    def open(self) -> None:
        self.opened = True
        self.release(1000)


def server_idle(server) -> bool:
    """The module's server is answering nothing and not re-planning: its idle work (chat_run.idle) uses the session
    that a test's own server shares, and ran into that server's answer (a test after one that left it re-planning)."""
    worker = server.service.worker
    return worker.current is None and worker.queue_length == 0 and not worker.idling


@pytest.fixture
def gate(monkeypatch, server):
    wait_for(lambda: server_idle(server), "the worker to be idle")
    g = Gate(monkeypatch)
    yield g
    g.open()  # nothing stays held whatever the test did
    wait_for(lambda: server_idle(server), "the worker to be idle")


@pytest.fixture
def jobs(monkeypatch, server):
    """The jobs the worker takes, in order."""
    taken = []
    handle = server.service.worker.handle

    def recording(job):
        taken.append(job)
        handle(job)

    monkeypatch.setattr(server.service.worker, "handle", recording)
    return taken


def in_thread(fn, *args, **kwargs):
    """Run fn in a thread; returns a function that joins it and gives its result (or raises its error)."""
    out = {}

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def result():
        thread.join(WAIT_S)
        assert not thread.is_alive(), "the request never finished"
        if "error" in out:
            raise out["error"]
        return out["value"]

    return result


def chat_text(server, messages, n, stream=False, **kwargs) -> str:
    client = server.client()
    if not stream:
        return client.chat.completions.create(model="demo", messages=messages, max_tokens=n, temperature=0,
                                              **kwargs).choices[0].message.content
    chunks = client.chat.completions.create(model="demo", messages=messages, max_tokens=n, temperature=0, stream=True,
                                            **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def raw_stream(server, body: dict) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    return conn


def test_four_concurrent_clients_get_their_own_answers(server, reference, gate, jobs):
    prompts = ["In the beginning", "The LORD is my shepherd", "Thou shalt not", "Behold, I stand at the door"]
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    running = [in_thread(chat_text, server, c, 8, stream=i % 2 == 1) for i, c in enumerate(conversations)]
    # all four are in: one being answered (held at the gate), three waiting in the queue
    wait_for(lambda: server.service.worker.current is not None and server.service.worker.queue_length == 3,
             "four requests in")
    gate.open()
    answers = [r() for r in running]
    assert answers == [decode(server, reference(chat_ids(server, c), 8)) for c in conversations]
    assert len(set(answers)) == 4  # four different answers: a mix-up would show
    assert sorted(job.ids for job in jobs) == sorted(chat_ids(server, c) for c in conversations)  # each once


def test_a_full_queue_gets_429_with_retry_after(server, reference, gate, jobs, monkeypatch):
    monkeypatch.setattr(server.service.worker, "max_queue", 1)
    first = in_thread(chat_text, server, MESSAGES, 4, stream=True)
    wait_for(lambda: gate.arrivals == 1, "the first request to be answered")
    second = in_thread(chat_text, server, MESSAGES[:1] + [], 5)
    wait_for(lambda: server.service.worker.queue_length == 1, "the second request to wait")
    status, headers, body = server.request("POST", "/v1/chat/completions",
                                           json.dumps({"messages": MESSAGES, "max_tokens": 3}))
    assert status == 429 and int(headers["Retry-After"]) >= 1
    assert body["error"]["type"] == "rate_limit_error" and "busy" in body["error"]["message"]
    with pytest.raises(openai.RateLimitError):
        server.client().chat.completions.create(model="demo", messages=MESSAGES, max_tokens=3)
    gate.open()
    expected = reference(chat_ids(server, MESSAGES), 5)
    assert first() == decode(server, expected[:4]) and second() == decode(server, expected)
    assert len(jobs) == 2  # the refused ones never reached the engine


def test_a_client_gone_mid_stream_cancels_within_one_token(server, reference, gate, jobs):
    messages = [{"role": "user", "content": "And God said"}]
    assert len(reference(chat_ids(server, messages), 8)) == 8  # a long answer: only a cancel ends it early
    conn = raw_stream(server, {"messages": messages, "max_tokens": 200, "temperature": 0, "stream": True})
    gate.release(3)
    wait_for(lambda: gate.arrivals == 4, "three tokens out, the fourth held")
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")  # the stream has begun
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    job = jobs[-1]
    wait_for(job.cancelled.is_set, "the server to see the client gone")
    gate.open()
    wait_for(lambda: server.service.worker.current is None, "the engine to be free")
    assert job.generated == job.generated_at_cancel == 4  # the token in progress, then no more
    # the engine serves the next request, exactly
    expected = reference(chat_ids(server, MESSAGES), 6)
    assert chat_text(server, MESSAGES, 6) == decode(server, expected)


def test_a_client_gone_while_waiting_is_never_answered(server, reference, gate, jobs):
    first = in_thread(chat_text, server, MESSAGES, 3)
    wait_for(lambda: gate.arrivals == 1, "the first request to be answered")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({"messages": MESSAGES, "max_tokens": 3}))
    wait_for(lambda: server.service.worker.queue_length == 1, "the second request to wait")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_for(lambda: server.service.worker.queue_length == 0, "the waiting request to be dropped")
    gate.open()
    assert first() == decode(server, reference(chat_ids(server, MESSAGES), 3))
    assert len(jobs) == 1


# --- stop strings, prompt reuse ---------------------------------------------------------


def token_pieces(server, ids: list[int]) -> list[str]:
    """The text each token adds (as the detokenizer streams it)."""
    tok = server.service.session.lm.tokenizer
    return [tok.decode(ids[:i + 1], skip_special_tokens=True)[len(tok.decode(ids[:i], skip_special_tokens=True)):]
            for i in range(len(ids))]


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_split_across_tokens_never_shows(server, reference, stream):
    messages = [{"role": "user", "content": "And God said"}]
    answer = reference(chat_ids(server, messages), 16)
    pieces = token_pieces(server, answer)
    full = "".join(pieces)
    # a stop string made of the end of one token and the start of the next, found first there
    i = next(i for i in range(2, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2
             and full.find(pieces[i][-2:] + pieces[i + 1][:2]) == len("".join(pieces[:i + 1])) - 2)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    client = server.client()
    if stream:
        chunks = list(client.chat.completions.create(model="demo", messages=messages, max_tokens=16, temperature=0,
                                                     stream=True, stop=["never in the text", stop]))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reason = chunks[-1].choices[0].finish_reason
    else:
        done = client.chat.completions.create(model="demo", messages=messages, max_tokens=16, temperature=0, stop=stop)
        text, reason = done.choices[0].message.content, done.choices[0].finish_reason
    assert text == full[:full.find(stop)] and reason == "stop"


def test_completions_stop_string(server, reference):
    prompt = "In the beginning"
    full = decode(server, reference(encode_text(server.service.session.lm.tokenizer, prompt, "demo"), 12))
    stop = full[len(full) // 2: len(full) // 2 + 3]
    done = server.client().completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    assert done.choices[0].text == full[:full.find(stop)] and done.choices[0].finish_reason == "stop"


def test_a_conversation_sent_again_reuses_the_kv_cache(server, reference):
    from fmoe_cli.chat.session import common_prefix

    tok = server.service.session.lm.tokenizer
    client = server.client()
    first = [{"role": "user", "content": "Blessed are the meek"}]
    ids1 = chat_ids(server, first)
    done = client.chat.completions.create(model="demo", messages=first, max_tokens=6, temperature=0)
    answer = reference(ids1, 6)
    generated = answer + ([tok.eos_token_id] if len(answer) < 6 else [])
    second = first + [{"role": "assistant", "content": done.choices[0].message.content},
                      {"role": "user", "content": "for they shall inherit the earth"}]
    ids2 = chat_ids(server, second)
    cached = min(common_prefix(ids1 + generated[:-1], ids2), len(ids2) - 1)
    assert cached > len(ids1)  # the answer's tokens are reused too, not only the first prompt
    again = client.chat.completions.create(model="demo", messages=second, max_tokens=6, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == cached
    assert again.usage.prompt_tokens == len(ids2)
    assert again.choices[0].message.content == decode(server, reference(ids2, 6))  # reuse changes no token


# --- security and bad input --------------------------------------------------------------


def test_api_key(server, monkeypatch):
    from dataclasses import replace

    monkeypatch.setattr(server.service, "options", replace(server.service.options, api_key="sekret"))
    assert server.request("GET", "/health")[0] == 200  # open
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}, {"Authorization": "Basic sekret"}):
        for path in ("/v1/models", "/metrics"):
            status, got, body = server.request("GET", path, headers=headers)
            assert status == 401 and body["error"]["code"] == "invalid_api_key", (path, headers)
            assert got["WWW-Authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").chat.completions.create(model="demo", messages=MESSAGES, max_tokens=2)
    assert server.client(api_key="sekret").chat.completions.create(model="demo", messages=MESSAGES, max_tokens=2)
    assert server.request("GET", "/metrics", headers={"Authorization": "Bearer sekret"})[0] == 200


def test_oversize_body(server, monkeypatch):
    from dataclasses import replace

    monkeypatch.setattr(server.service, "options", replace(server.service.options, max_body=1000))
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 1000}]})
    status, _, reply = server.request("POST", "/v1/chat/completions", body)
    assert status == 413 and reply["error"]["code"] == "request_too_large"
    # without a Content-Length (chunked), the limit holds as the body arrives
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S)
    conn.request("POST", "/v1/chat/completions", body=iter([body[:600].encode(), body[600:].encode()]),
                 encode_chunked=True, headers={"Transfer-Encoding": "chunked"})
    assert conn.getresponse().status == 413
    conn.close()


@pytest.mark.parametrize("body, status, fragment", [
    ("{bad json", 400, "not valid JSON"),
    ("[1, 2]", 400, "JSON object"),
    ('{"messages": "hello"}', 400, "messages"),
    ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}', 400, "max_tokens"),
    ('{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', 400, "temperature"),
    ('{"messages": [{"role": "user", "content": "hi"}], "top_k": -2}', 400, "top_k"),  # (-1 and 0: off)
    ('{"messages": [{"role": "user", "content": "hi"}], "min_p": 1.5}', 400, "min_p"),
    ('{"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 0}', 400, "repetition_penalty"),
    ('{"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 1e-39}', 400, "repetition_penalty"),
    ('{"messages": [{"role": "wizard", "content": "hi"}]}', 400, "messages.0.role"),
    ('{"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4o"}', 404, "gpt-4o"),
    ('{"messages": [{"role": "user", "content": "hi"}], "n": 2}', 400, "n > 1 is not supported"),
    ('{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}', 400, "tools"),
    ('{"messages": [{"role": "user", "content": "hi"}], "logprobs": true}', 400, "logprobs"),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400, "only text"),
    ('{"messages": [{"role": "user"}]}', 400, "messages.0.content: a message needs content"),
    ('{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": null}]}', 400,
     "messages.1.content: a message needs content"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null}]}', 400,
     "messages.1.content: a message needs content"),
    ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}', 400, "context is 1024 tokens"),
    ('{"messages": [{"role": "user", "content": "hi"}], "stop": ""}', 400, "stop string"),
    # hostile bodies: nesting (json's own recursion limit, then ours), encoding, numbers, ranges
    ("[" * 10_000 + "]" * 10_000, 400, "nested more than 32 levels"),
    ('{"messages": [{"role": "user", "content": "hi"}], "metadata": ' + "[" * 40 + "]" * 40 + "}", 400,
     "nested more than 32 levels"),
    ('{"messages": [{"role": "user", "content": "caf\xe9"}]}'.encode("latin-1"), 400, "not UTF-8"),
    ('{"messages": [{"role": "user", "content": "hi"}]}'.encode("utf-16"), 400, "not UTF-8"),
    ('{"messages": [{"role": "user", "content": "half a pair \\ud800"}]}', 400, "lone UTF-16 surrogate"),
    ('{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "NaN is not a JSON value"),
    ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1' + "0" * 5000 + "}", 400, "4300 digits"),
    ('{"messages": [{"role": "user", "content": "hi"}], "seed": 18446744073709551616}', 400, "seed"),
])
def test_bad_requests_get_openai_errors(server, jobs, body, status, fragment):
    got, _, reply = server.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    assert got == status and fragment in reply["error"]["message"] and reply["error"]["type"], reply
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert jobs == []  # refused before the queue


def test_hostile_completions_and_sampling_edges(server, reference):
    status, _, reply = server.request("POST", "/v1/completions", '{"prompt": "half a pair \\udfff", "max_tokens": 2}')
    assert status == 400 and "surrogate" in reply["error"]["message"]
    for ids in ("[1, 2, 3]", "[[1, 2], [3]]"):  # OpenAI's token-id prompts: said in words, not pydantic's
        status, _, reply = server.request("POST", "/v1/completions", '{"prompt": %s, "max_tokens": 2}' % ids)
        assert status == 400 and reply["error"]["message"] == "token-id prompts are not supported: send the prompt as text"
        assert reply["error"]["param"] == "prompt"
    # a temperature or top_p too small for float32: greedy, and the same answer as temperature 0
    prompt = "In the beginning"
    expected = decode(server, reference(encode_text(server.service.session.lm.tokenizer, prompt, "demo"), 6))
    for extreme in ({"temperature": 1e-300}, {"temperature": 1.0, "top_p": 1e-320}):
        done = server.client().completions.create(model="demo", prompt=prompt, max_tokens=6, **extreme)
        assert done.choices[0].text == expected, extreme


def test_a_prompt_longer_than_the_context_and_unknown_paths(server):
    status, _, reply = server.request("POST", "/v1/completions", json.dumps({"prompt": "and " * 1100}))
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded"
    status, _, reply = server.request("GET", "/v1/nothing")
    assert status == 404 and "error" in reply
    status, _, reply = server.request("GET", "/v1/chat/completions")
    assert status == 405 and "error" in reply


def test_a_prompt_too_long_in_characters_or_messages_is_refused_before_tokenising(server, jobs, monkeypatch):
    import fmoe_cli.serve.app as app_module

    tokenised = []  # characters of each completion prompt tokenised; conversations templated
    monkeypatch.setattr(app_module, "encode_text", lambda tok, text, model: tokenised.append(len(text))
                        or encode_text(tok, text, model))
    monkeypatch.setattr(app_module, "encode_messages", lambda tok, messages, model: tokenised.append(messages)
                        or encode_messages(tok, messages, model))
    service = server.service
    assert service.longest_token == max(map(len, service.session.lm.tokenizer.get_vocab())) == 15
    bound = (service.context - 1) * service.longest_token  # 1023 tokens of at most 15 characters

    def complete(chars: int):
        return server.request("POST", "/v1/completions", json.dumps({"prompt": "a" * chars}))

    status, _, reply = complete(bound + 1)
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    assert f"the prompt is {bound + 1} characters" in reply["error"]["message"] and tokenised == []
    status, _, reply = complete(bound)  # could fit, in characters: tokenised, then refused by its tokens
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded" and tokenised == [bound]
    assert "characters" not in reply["error"]["message"]
    tokenised.clear()
    many = [{"role": "user", "content": ""}] * service.context  # a token a message at least: cannot fit
    status, _, reply = server.request("POST", "/v1/chat/completions", json.dumps({"messages": many}))
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    assert f"{service.context} messages" in reply["error"]["message"] and tokenised == []
    parts = [{"type": "text", "text": "a" * (bound // 2 + 1)}] * 2  # the characters of every part count
    status, _, reply = server.request("POST", "/v1/chat/completions",
                                      json.dumps({"messages": [{"role": "user", "content": parts}]}))
    assert status == 400 and "characters" in reply["error"]["message"] and tokenised == []
    assert jobs == []


@settings(max_examples=100, deadline=None)
@given(pieces=st.lists(st.one_of(st.sampled_from(["Nebuchadnezzar", " transgressions", "<|user|>", " ", "\n", "é"]),
                                 st.text(max_size=8)), max_size=40))
def test_no_token_of_the_demo_stands_for_more_characters_than_the_longest_entry(chat_run, pieces):
    """What the refusal by characters stands on: a prompt of n characters is at least n / longest_token tokens."""
    from fmoe_cli.serve.app import longest_token

    tok = chat_run.session.lm.tokenizer
    text = "".join(pieces)
    assert len(tok(text, add_special_tokens=False)["input_ids"]) * longest_token(tok) >= len(text)


def test_tokenising_waits_for_a_place_in_the_queue(server, reference, gate, jobs, monkeypatch):
    """Tokenising and templating are admitted as the queue is: with --max-queue 1, one answer running
    and one prompt being tokenised, a third request is a 429 and is never tokenised."""
    import fmoe_cli.serve.app as app_module

    monkeypatch.setattr(server.service.worker, "max_queue", 1)
    first = in_thread(chat_text, server, MESSAGES, 3)
    wait_for(lambda: gate.arrivals == 1, "the first request to be answered")
    hold, tokenised = threading.Event(), []

    def held_encode(tok, messages, model):
        tokenised.append(messages)
        assert hold.wait(WAIT_S)
        return encode_messages(tok, messages, model)

    monkeypatch.setattr(app_module, "encode_messages", held_encode)
    second = in_thread(chat_text, server, MESSAGES, 4)
    wait_for(lambda: len(tokenised) == 1, "the second prompt to be tokenised")
    assert server.service.worker.queue_length == 1  # its place is held while it is tokenised
    third = in_thread(server.request, "POST", "/v1/chat/completions",
                      json.dumps({"messages": [{"role": "user", "content": "never tokenised"}], "max_tokens": 2}))
    status, headers, body = third()
    assert status == 429 and body["error"]["code"] == "queue_full" and int(headers["Retry-After"]) >= 1
    assert len(tokenised) == 1
    hold.set()
    gate.open()
    expected = reference(chat_ids(server, MESSAGES), 4)
    assert first() == decode(server, expected[:3]) and second() == decode(server, expected)
    assert len(jobs) == 2 and server.service.worker.queue_length == 0


def test_metrics_parse_and_count(server):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict:
        status, headers, text = server.request("GET", "/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain")
        return {s.name + json.dumps(s.labels, sort_keys=True): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    before = scrape()
    client = server.client()
    usages = [client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=5, temperature=0).usage,
              client.completions.create(model="demo", prompt="In the beginning", max_tokens=4, temperature=0).usage]
    after = scrape()

    def grew(name: str) -> float:
        return after[name + "{}"] - before.get(name + "{}", 0.0)

    assert grew("fmoe_completion_tokens_total") == sum(u.completion_tokens for u in usages)
    assert grew("fmoe_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert grew("fmoe_prompt_cached_tokens_total") == sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert grew("fmoe_time_to_first_token_seconds_count") == 2
    assert grew("fmoe_time_per_output_token_seconds_count") == sum(u.completion_tokens - 1 for u in usages)
    chat_ok = 'fmoe_requests_total{"path": "/v1/chat/completions", "status": "200"}'
    assert after[chat_ok] - before.get(chat_ok, 0) == 1
    # the engine's figures over the server's life: every answer of the module's session went through it
    from fmoe_cli.offload.engine import Counters

    session = sum(server.service.session.layer_totals, Counters())
    assert after["fmoe_expert_hit_rate{}"] == pytest.approx(session.hit_rate)
    assert after["fmoe_link_bytes_total{}"] == session.bytes_moved
    assert after["fmoe_exposed_load_ms_per_token{}"] >= 0 and after["fmoe_queue_length{}"] == 0
    assert after["fmoe_link_bytes_total{}"] > 0  # the demo plan caches a share of the experts: misses load


# --- shutdown -----------------------------------------------------------------------------


def sse_events(text: str) -> list:
    """The data of each SSE event: decoded JSON, or the string (`[DONE]`)."""
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ")]


def stream_content(events: list) -> str:
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events if isinstance(e, dict) and e.get("choices"))


@pytest.mark.parametrize("grace_s, stream", [(30.0, True), (0.0, True), (0.0, False)])
def test_shutdown_ends_the_answer_as_a_response_and_refuses_the_queue(chat_run, server, reference, gate, grace_s, stream):
    """The answer in progress finishes within the grace period, or ends: a stream with an error event and
    [DONE] (a complete chunked body: read() returns), a JSON answer as a 503. Requests still waiting,
    streamed or not, get a 503 in JSON."""
    own = Server(start_service(chat_run.session, "demo", ServeOptions(port=0, grace_s=grace_s)))
    try:
        conn = raw_stream(own, {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "stream": stream})
        wait_for(lambda: gate.arrivals == 1, "the answer to begin")
        waiting = [in_thread(own.request, "POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "stream": s}))
                   for s in (True, False)]
        wait_for(lambda: own.service.worker.queue_length == 2, "two requests to wait")
        own.server.should_exit = True  # as Ctrl-C or SIGTERM do
        for result in waiting:
            status, headers, reply = result()
            assert status == 503 and headers["Content-Type"] == "application/json", (status, reply)
            assert "shutting down" in reply["error"]["message"]
        if grace_s:  # the answer in progress finishes
            gate.open()
            events = sse_events(conn.getresponse().read().decode())
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
            assert stream_content(events) == decode(server, reference(chat_ids(server, MESSAGES), 6))
        else:  # ended at once, while the engine is still held
            job = own.service.worker.current
            response = conn.getresponse()
            if stream:  # as a stream: an error event, [DONE], the end of the chunked body
                events = sse_events(response.read().decode())
                assert events[-1] == "[DONE]" and events[-2]["error"]["message"].startswith("the server is shutting down")
            else:
                reply = json.loads(response.read())
                assert response.status == 503 and reply["error"]["message"].startswith("the server is shutting down")
            assert job.cancelled.is_set()
            gate.open()
            wait_for(lambda: own.service.worker.current is None, "the engine to be free")
            assert job.generated == job.generated_at_cancel == 1  # within one token
        own.thread.join(WAIT_S)
        assert not own.thread.is_alive()
    finally:
        own.stop()


def test_a_body_still_arriving_when_the_grace_is_over_gets_a_503(chat_run, server, monkeypatch, caplog):
    import logging

    import fmoe_cli.serve.app as app_module

    monkeypatch.setattr(app_module, "SHUTDOWN_SLACK_S", 0.05)  # uvicorn cancels what still runs after it
    wait_for(lambda: server_idle(server), "the worker to be idle")  # (the session is shared: see server_idle)
    own = Server(start_service(chat_run.session, "demo", ServeOptions(port=0, grace_s=0.0)))
    try:
        conn = http.client.HTTPConnection("127.0.0.1", own.port, timeout=WAIT_S)
        conn.putrequest("POST", "/v1/chat/completions")
        conn.putheader("Content-Length", "1000")
        conn.endheaders(b'{"messages": [')  # and the rest never comes
        wait_for(lambda: own.server.server_state.tasks, "the request to be read")
        with caplog.at_level(logging.WARNING, logger="fmoe.serve"):
            own.server.should_exit = True
            response = conn.getresponse()
            reply = json.loads(response.read())
            own.thread.join(WAIT_S)
        assert response.status == 503 and reply["error"]["message"] == "the server is shutting down"
        assert [r.getMessage() for r in caplog.records if r.name == "fmoe.serve"] == [
            "POST /v1/chat/completions cancelled at shutdown"]
        assert not any(r.exc_info for r in caplog.records)
    finally:
        own.stop()


def test_a_second_ctrl_c_ends_the_answer_at_once_as_a_stream(chat_run, server, gate):
    import signal

    own = Server(start_service(chat_run.session, "demo", ServeOptions(port=0, grace_s=WAIT_S)))
    try:
        conn = raw_stream(own, {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "stream": True})
        gate.release(2)
        wait_for(lambda: gate.arrivals == 3, "two tokens out, the third held")
        for _ in range(2):
            own.server.handle_exit(signal.SIGINT, None)
        events = sse_events(conn.getresponse().read().decode())
        assert events[-1] == "[DONE]" and "shutting down" in events[-2]["error"]["message"]
        assert stream_content(events)  # what was answered before is there
        job = own.service.worker.current
        assert job.cancelled.is_set()
        gate.open()
        wait_for(lambda: own.service.worker.current is None, "the engine to be free")
        assert job.generated == job.generated_at_cancel == 3  # the token in progress, then no more
        own.thread.join(WAIT_S)
        assert not own.thread.is_alive()
    finally:
        own.stop()


# --- pure logic: stop strings and the queue -----------------------------------------------


from fmoe_cli.serve.protocol import StopText, first_stop  # noqa: E402
from fmoe_cli.serve.worker import Done, Failed, Job, QueueFull, Worker  # noqa: E402


@settings(max_examples=500, deadline=None)
@given(text=st.text("abc", max_size=30), stops=st.lists(st.text("abc", min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_stop_text_cuts_at_the_first_stop_however_the_text_is_split(text, stops, cuts):
    pieces = [text[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(text)])]
    matcher, shown, hit = StopText(tuple(stops)), [], False
    for piece in pieces:
        out, hit = matcher.add(piece)
        shown.append(out)
        if hit:
            break
    if not hit:
        shown.append(matcher.flush())
    first = None  # where generation stops, one character at a time: the first prefix holding a stop string
    for end in range(1, len(text) + 1):
        found = [i for i in (text[:end].find(s) for s in stops) if i >= 0]
        if found:
            first = min(found)
            break
    assert first == first_stop(text, stops)
    assert hit == (first is not None)
    assert "".join(shown) == (text if first is None else text[:first])
    assert not any(s in "".join(shown) for s in stops)  # no stop string is ever shown


def test_worker_is_fifo_refuses_when_full_and_runs_idle_only_with_an_empty_queue():
    release, order, idle_seen = threading.Event(), [], []
    worker = None

    def handle(job: Job) -> None:
        release.wait(WAIT_S)
        order.append(job.ids[0])
        job.emit(Done("eos", "", None))

    def idle() -> None:
        idle_seen.append((worker.queue_length, worker.current))

    worker = Worker(handle, max_queue=2, idle=idle).start()
    got = {}
    jobs = [Job([i], 1, None, lambda m, i=i: got.update({i: m})) for i in range(4)]
    worker.submit(jobs[0])
    wait_for(lambda: worker.current is jobs[0], "the first job to run")
    worker.submit(jobs[1])
    worker.submit(jobs[2])
    with pytest.raises(QueueFull) as full:
        worker.submit(jobs[3])
    assert full.value.retry_after >= 1
    worker.cancel(jobs[1])  # its client went away while it waited
    assert worker.queue_length == 1
    release.set()
    wait_for(lambda: worker.answered == 2 and idle_seen, "the jobs to finish")
    assert order == [0, 2] and idle_seen == [(0, None)]  # idle once, after the last job, nothing waiting
    hold = Job([5], 1, None, lambda m: got.update({5: m}))
    release.clear()
    worker.submit(Job([4], 1, None, lambda m: got.update({4: m})))
    wait_for(lambda: worker.current is not None, "a job to run")
    worker.submit(hold)
    worker.close()
    assert isinstance(got[5], Failed) and got[5].status == 503  # the waiting one is refused at shutdown
    release.set()
    worker.join(WAIT_S)
    assert isinstance(got[4], Done) and order == [0, 2, 4]


def test_worker_counts_reserved_places_against_the_queue():
    from fmoe_cli.serve.worker import Closed

    release = threading.Event()
    worker = Worker(lambda job: release.wait(WAIT_S) and job.emit(Done("eos", "", None)), max_queue=2).start()
    running = Job([0], 1, None, lambda m: None)
    worker.submit(running)
    wait_for(lambda: worker.current is running, "a job to run")
    worker.reserve()  # a prompt being tokenised
    worker.submit(Job([1], 1, None, lambda m: None))
    assert worker.queue_length == 2
    with pytest.raises(QueueFull):
        worker.reserve()
    worker.release()  # its body was bad: the place is free again
    worker.reserve()
    worker.close()
    with pytest.raises(Closed):
        worker.submit(Job([2], 1, None, lambda m: None), reserved=True)  # tokenised while the server closed
    with pytest.raises(Closed):
        worker.reserve()
    assert worker.queue_length == 0
    release.set()
    worker.join(WAIT_S)


# --- the command ------------------------------------------------------------------------


def test_exposure_warning_names_the_address():
    assert ServeOptions(host="0.0.0.0").exposure_warning().startswith("serving on 0.0.0.0 without an API key")
    assert ServeOptions(host="0.0.0.0", api_key="k").exposure_warning() is None
    assert ServeOptions(host="::1").exposure_warning() is None and ServeOptions(host="localhost").loopback


def test_serve_option_errors_are_one_line_and_fast():
    import subprocess
    import sys

    for argv, fragment in ((["--port", "70000"], "--port must be in"), (["--max-queue", "-1"], "--max-queue"),
                           (["--grace", "-2"], "--grace")):
        start = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "fmoe_cli.cli", "serve", "demo", *argv], capture_output=True,
                                text=True, timeout=WAIT_S)
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and fragment in result.stderr, result.stderr
        assert "torch" not in result.stderr
        assert time.monotonic() - start < WAIT_S


def test_a_port_in_use_is_one_line_before_torch():
    import subprocess
    import sys

    busy = ServeOptions(port=0).bind()  # a port in use: one line, before torch is imported (let alone the model)
    used = busy.getsockname()[1]
    probe = ("import sys\nfrom fmoe_cli.cli import main\nsys.argv = ['fmoe', 'serve', 'demo', '--port', sys.argv[1]]\n"
             "try:\n    main()\nexcept SystemExit as exc:\n    print('torch' in sys.modules, exc.code)\n")
    result = subprocess.run([sys.executable, "-c", probe, str(used)], capture_output=True, text=True, timeout=WAIT_S)
    busy.close()
    assert result.stderr.strip() == f"error: cannot listen on 127.0.0.1:{used}: Address already in use", result.stderr
    assert result.stdout.split() == ["False", "2"], result.stdout


COMMAND_KEY = "from-env"
COMMAND_GRACE_S = 0.5


class Command:
    """`fmoe serve demo` in a process of its own (the key from the environment, reachable from other
    machines), its log read as it comes. Started once for the module, again if a test stopped it."""

    def __init__(self, config_dir) -> None:
        self.config_dir, self.proc, self.lines = config_dir, None, []

    def running(self) -> Command:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        return self

    def _start(self) -> None:
        import os
        import subprocess
        import sys

        env = dict(os.environ, FMOE_API_KEY=COMMAND_KEY, XDG_CONFIG_HOME=str(self.config_dir))
        self.proc = subprocess.Popen([sys.executable, "-m", "fmoe_cli.cli", "serve", "demo", "--port", "0", "--device",
                                      "cpu", "--host", "0.0.0.0", "--policy", "lru",  # a fixed plan: no timing at start-up
                                      "--grace", str(COMMAND_GRACE_S)],
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.lines = []
        while not any("listening on" in line for line in self.lines):
            line = self.proc.stderr.readline()
            assert line, "".join(self.lines)
            self.lines.append(line)
        self.port = int(self.lines[-1].split("http://")[1].split("/")[0].rsplit(":", 1)[1])
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self.reader.start()  # the pipe never fills

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def request(self, method: str, path: str, body: bytes | str | None = None):
        return http_request(self.port, method, path, body, {"Authorization": f"Bearer {COMMAND_KEY}"})

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(WAIT_S)


@pytest.fixture(scope="module")
def command(tmp_path_factory):
    c = Command(tmp_path_factory.mktemp("serve-config"))
    yield c
    c.stop()


def test_fmoe_serve_command_takes_its_key_from_the_environment(command):
    command.running()
    assert not any("warning" in line for line in command.lines)  # a key is set: no exposure warning
    client = openai.OpenAI(base_url=command.url, api_key=COMMAND_KEY, max_retries=0)
    assert client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=3).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=command.url, api_key="nope", max_retries=0).models.list()


def test_fmoe_serve_command_answers_hostile_bodies_with_openai_errors(command):
    command.running()
    for path, body, status, fragment in (
            ("/v1/chat/completions", "[" * 10_000 + "]" * 10_000, 400, "nested more than 32 levels"),
            ("/v1/completions", b'{"prompt": "caf\xe9"}', 400, "not UTF-8"),
            ("/v1/completions", '{"prompt": "x", "max_tokens": 1' + "0" * 5000 + "}", 400, "not valid JSON"),
            ("/v1/completions", json.dumps({"prompt": "x" * (5 * 1024**2)}), 413, "larger than")):
        got, headers, reply = command.request("POST", path, body)
        assert got == status and headers["Content-Type"] == "application/json", (got, reply)
        assert set(reply["error"]) == {"message", "type", "param", "code"} and fragment in reply["error"]["message"]
    assert command.request("GET", "/health")[0] == 200  # and it goes on
    assert not any("Traceback" in line or "RecursionError" in line for line in command.lines)


def test_fmoe_serve_command_memory_returns_after_a_burst_of_oversized_prompts(command):
    """Three 2 MB prompts at a time, three rounds of each endpoint: each is refused by its length in characters,
    never tokenised (tokenising one took ~1 GB at its peak and left ~300 MB behind), and RSS ends where it began."""
    from concurrent.futures import ThreadPoolExecutor

    import psutil

    process = psutil.Process(command.running().proc.pid)
    command.request("POST", "/v1/completions", json.dumps({"prompt": "In the beginning", "max_tokens": 2}))
    before = peak = process.memory_info().rss
    prompt = "and " * 500_000
    bodies = [("/v1/completions", json.dumps({"prompt": prompt})),
              ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": prompt}]}))]
    with ThreadPoolExecutor(3) as pool:
        for path, body in bodies * 3:
            replies = [pool.submit(command.request, "POST", path, body) for _ in range(3)]
            while not all(r.done() for r in replies):
                peak = max(peak, process.memory_info().rss)  # sampled while the burst is in the server
                time.sleep(0.005)
            for status, _, reply in (r.result() for r in replies):
                assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
                assert "characters" in reply["error"]["message"]
    after = process.memory_info().rss
    mib = 1024**2
    assert (peak - before) / mib < 100 and (after - before) / mib < 32, (before / mib, peak / mib, after / mib)


def test_fmoe_serve_command_sigterm_mid_stream_ends_it_as_a_stream_and_saves_statistics(command):
    import signal

    command.running()
    conn = http.client.HTTPConnection("127.0.0.1", command.port, timeout=WAIT_S)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "In the beginning", "max_tokens": 1000,
                                                        "temperature": 0, "stream": True}),
                 {"Authorization": f"Bearer {COMMAND_KEY}"})  # 1000 tokens: seconds of work, far beyond the grace
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: {")
    waiting = in_thread(command.request, "POST", "/v1/chat/completions",
                        json.dumps({"messages": MESSAGES, "stream": True}))
    wait_for(lambda: "fmoe_queue_length 1.0" in command.request("GET", "/metrics")[2], "a request to wait")
    sent = time.monotonic()
    command.proc.send_signal(signal.SIGTERM)
    status, headers, reply = waiting()
    assert status == 503 and headers["Content-Type"] == "application/json" and "shutting down" in reply["error"]["message"]
    events = sse_events(response.read().decode())  # read() returns: the chunked body was ended properly
    ended = time.monotonic() - sent
    assert events[-1] == "[DONE]", events[-3:]
    assert events[-2]["error"]["message"].startswith("the server is shutting down: the answer was stopped after")
    assert all("choices" in e for e in events[:-2])
    assert ended < COMMAND_GRACE_S + SHUTDOWN_SLACK_S  # ended by fmoe at the grace's end, not cut by uvicorn after it
    assert command.proc.wait(WAIT_S) == 0
    command.reader.join(WAIT_S)  # the last lines, up to the pipe's end
    log = "".join(command.lines)
    assert "statistics saved" in log and "Traceback" not in log and "CancelledError" not in log, log
    assert list(command.config_dir.rglob("*.stats.json"))  # the routing statistics of the answers, saved on the way out


def test_failures_are_one_log_line_and_openai_errors_and_the_engine_recovers(server, reference, monkeypatch, caplog):
    import logging

    import fmoe_cli.serve.app as app_module

    def broken_encode(*args):
        raise RuntimeError("template on fire\nsecond line")

    monkeypatch.setattr(app_module, "encode_messages", broken_encode)
    with caplog.at_level(logging.ERROR):
        status, _, reply = server.request("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES}))
        assert status == 500 and reply["error"]["type"] == "server_error" and "fire" not in reply["error"]["message"]
        # the line is written once the response has gone (the error passes the 500 on its way out)
        wait_for(lambda: any(r.levelno >= logging.ERROR for r in caplog.records), "the log line")
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "template on fire" in errors[0].getMessage() and errors[0].exc_info is None
    assert "second line" not in errors[0].getMessage()
    monkeypatch.undo()

    real = session_module.stream_generate

    def failing(*args, **kwargs):
        for i, event in enumerate(real(*args, **kwargs)):
            if i == 2:
                raise RuntimeError("device on fire")
            yield event

    monkeypatch.setattr(session_module, "stream_generate", failing)
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        status, _, reply = server.request("POST", "/v1/chat/completions",
                                          json.dumps({"messages": MESSAGES, "max_tokens": 6}))
        assert status == 500 and "device on fire" in reply["error"]["message"]
        conn = raw_stream(server, {"messages": MESSAGES, "max_tokens": 6, "stream": True})
        lines = [line for line in conn.getresponse().read().decode().splitlines() if line.startswith("data: ")]
        assert json.loads(lines[-2][6:])["error"]["message"].endswith("device on fire")  # an error event ends it
        assert lines[-1] == "data: [DONE]"
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 2
    monkeypatch.undo()
    assert server.service.session._kv is None  # dropped: the forward stopped half-way
    expected = reference(chat_ids(server, MESSAGES), 6)
    assert chat_text(server, MESSAGES, 6) == decode(server, expected)  # the engine was rebuilt and answers exactly


def test_a_seed_makes_a_sampled_answer_reproducible(server):
    client = server.client()

    def sample(seed: int) -> str:
        return client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=12, temperature=1.5,
                                              seed=seed).choices[0].message.content

    first = sample(7)
    assert sample(7) == first  # the KV cache of the previous request in between changes nothing
    assert len({first, sample(8), sample(9)}) > 1  # and the seed is what decides


def test_context_bounds_the_answer_and_is_reported(server, monkeypatch):
    monkeypatch.setattr(server.service.session, "context", 40)  # as --context 40
    assert server.client().models.retrieve("demo").model_extra["context_length"] == 40
    status, _, reply = server.request("POST", "/v1/chat/completions",
                                      json.dumps({"messages": MESSAGES, "max_tokens": 39}))
    assert status == 400 and "context is 40 tokens" in reply["error"]["message"]
    room = 40 - len(chat_ids(server, MESSAGES))
    done = server.client().chat.completions.create(model="demo", messages=MESSAGES, max_tokens=room, temperature=0)
    assert done.usage.prompt_tokens + done.usage.completion_tokens <= 40
