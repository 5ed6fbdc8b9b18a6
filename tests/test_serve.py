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
from rich.console import Console
from transformers import AutoModelForCausalLM

import fmoe_cli.chat.session as session_module
from fmoe_cli.chat.repl import ChatOptions, open_chat
from fmoe_cli.generate import encode_messages, encode_text
from fmoe_cli.models.demo import SHIPPED
from fmoe_cli.run import RunOptions
from fmoe_cli.serve import ServeOptions
from fmoe_cli.serve.app import serve_in, start_service

WAIT_S = 60  # a generous bound on waiting for an event (a failing test, not a slow one, reaches it)


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


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
        """(status, headers, decoded JSON or text) over plain HTTP."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=WAIT_S)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            response = conn.getresponse()
            data = response.read().decode()
            try:
                data = json.loads(data)
            except json.JSONDecodeError:
                pass
            return response.status, dict(response.getheaders()), data
        finally:
            conn.close()

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
