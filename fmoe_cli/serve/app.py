"""`fmoe serve`: the FastAPI app (routes, API key, body limit, errors in OpenAI's shape,
Prometheus metrics) and the command (load once as chat does, serve with uvicorn, shut down
cleanly). docs/serve.md is the user's description."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from rich.console import Console
from rich.text import Text
from starlette.exceptions import HTTPException as StarletteHTTPException

from fmoe_cli.chat import MAX_NEW_TOKENS, ChatOptions, pick_sampling
from fmoe_cli.chat.repl import open_chat
from fmoe_cli.chat.session import ChatSession
from fmoe_cli.errors import FmoeError
from fmoe_cli.generate import SamplingParams, encode_messages, encode_text
from fmoe_cli.models.config import sampling_defaults
from fmoe_cli.offload.engine import Counters
from fmoe_cli.options import RunOptions
from fmoe_cli.serve import ServeOptions, return_freed_memory
from fmoe_cli.serve.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Reply,
    answer_budget,
    decode_body,
    error_body,
    parse,
    refuse_long_conversation,
    refuse_long_prompt,
)
from fmoe_cli.serve.worker import Closed, Done, Failed, Job, Piece, QueueFull, Started, Stopped, Worker, answer

log = logging.getLogger("fmoe.serve")
OPEN = ("/health",)  # the paths that need no API key
SHUTDOWN_SLACK_S = 2.0  # after --grace, how long uvicorn still waits for connections before it cancels them
TRIM_AFTER_BYTES = 256 * 1024  # a body this large: the memory its reading and tokenising used goes back after
# Histogram buckets, seconds: TTFT from a prompt's arrival (queue wait included); TPOT per decode step.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    """The server's Prometheus metrics (a registry of its own). Engine figures are over the
    server's life: hit rate, exposed load time per generated token, bytes over the link."""

    def __init__(self, queue_length) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("fmoe_requests", "HTTP requests answered, by path and status code",
                                ["path", "status"], registry=r)
        self.prompt_tokens = Counter("fmoe_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.cached_tokens = Counter("fmoe_prompt_cached_tokens",
                                     "Prompt tokens whose KV cache was reused from the previous request", registry=r)
        self.completion_tokens = Counter("fmoe_completion_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("fmoe_time_to_first_token_seconds",
                              "From a request's arrival (queue wait included) to its first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("fmoe_time_per_output_token_seconds", "Decode steps after the first token",
                              buckets=TPOT_BUCKETS, registry=r)
        self.link_bytes = Counter("fmoe_link_bytes", "Bytes of experts moved host to device", registry=r)
        self.totals = Counters()
        self.tokens = 0
        Gauge("fmoe_expert_hit_rate", "Activated experts found on the device (whole or top segment)",
              registry=r).set_function(lambda: self.totals.hit_rate)
        Gauge("fmoe_exposed_load_ms_per_token", "Time the compute waited on the link, per generated token (ms)",
              registry=r).set_function(lambda: self.totals.exposed_s * 1000 / self.tokens if self.tokens else 0.0)
        Gauge("fmoe_queue_length", "Requests waiting behind the one being answered",
              registry=r).set_function(queue_length)

    def observe(self, job: Job, events: list, cached: int) -> None:
        """One answer's figures (called by the worker thread)."""
        self.prompt_tokens.inc(len(job.ids))
        self.cached_tokens.inc(cached)
        self.completion_tokens.inc(len(events))
        if events:
            self.ttft.observe(job.started + events[0].latency_s - job.arrived)
        for event in events[1:]:
            self.tpot.observe(event.latency_s)
        counters = sum((e.counters for e in events if e.counters is not None), Counters())
        self.totals = self.totals + counters
        self.tokens += len(events)
        self.link_bytes.inc(counters.bytes_moved)

    def text(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class Service:
    """What the routes need: the session (model, tokenizer, engine), the queue, the limits."""

    session: ChatSession
    worker: Worker
    model_id: str  # as given on the command line
    options: ServeOptions = field(default_factory=ServeOptions)
    metrics: Metrics | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    longest_token: int | None = None  # characters of the tokenizer's longest token (None: no tokenizer)
    # Reading, checking and tokenising a request's body, one request at a time, each admitted as the queue admits.
    preparing: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="fmoe-tokenize"))
    inboxes: set = field(default_factory=set)  # of the requests in progress (event-loop side)
    closing: bool = False  # shutdown has begun
    # the sampling the model's generation_config.json recommends (models/config.py `sampling_defaults`): what a
    # request that leaves a field out gets, else OpenAI's defaults (OPENAI_SAMPLING)
    recommended: dict = field(default_factory=dict)

    @property
    def context(self) -> int | None:
        return self.session.context_limit

    def end_answers(self) -> None:
        """The grace period is over: the answer in progress stops (within one token) and every
        response still open ends now (a stream with its final event and [DONE])."""
        self.worker.close(cancel_current=True)
        for inbox in list(self.inboxes):
            inbox.put_nowait(Stopped())


OPENAI_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,  # (top_k, min_p: off)
                   "repetition_penalty": 1.0}  # (off)


def request_sampling(req, recommended: dict) -> SamplingParams:
    """A request's sampling: each of temperature, top_p, top_k, min_p and repetition_penalty as the request gives it,
    else as the model recommends, else OpenAI's default (as vLLM serves a model's generation_config.json)."""
    chosen = pick_sampling({key: getattr(req, key) for key in OPENAI_SAMPLING}, recommended, OPENAI_SAMPLING)
    chosen["top_k"] = max(chosen["top_k"], 0)  # (vLLM's -1 is off, as 0)
    return SamplingParams(**chosen, seed=req.seed)


def longest_token(tokenizer) -> int | None:
    """Characters of the vocabulary's longest entry: no token stands for more characters of a prompt
    (a byte-level entry has a character a byte, so at least one a character; a SentencePiece
    entry's ▁ is its space)."""
    if tokenizer is None:
        return None
    return max(map(len, tokenizer.get_vocab()), default=None)


def start_service(session: ChatSession, model_id: str, options: ServeOptions, idle=None) -> Service:
    """The worker thread started on `session`, with its metrics."""
    service = Service(session, None, model_id, options)  # type: ignore[arg-type]
    service.longest_token = longest_token(session.lm.tokenizer)
    service.recommended = sampling_defaults(session.lm.path)
    metrics = Metrics(lambda: service.worker.queue_length)

    def handle(job: Job) -> None:
        job.started = time.perf_counter()
        answer(session, job, metrics.observe)

    service.worker = Worker(handle, options.max_queue, idle).start()
    service.metrics = metrics
    return service


# --- the ASGI layer --------------------------------------------------------------


class Gate:
    """Pure ASGI middleware (streams pass through untouched): the API key on every path but
    /health (`Authorization: Bearer`, compared in constant time), and requests counted by status."""

    def __init__(self, app, service: Service) -> None:
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = {"code": 500}

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
            await send(message)

        try:
            key = self.service.options.api_key
            if key is not None and path not in OPEN and not self._authorized(scope, key):
                response = JSONResponse(error_body("a valid API key is required: Authorization: Bearer KEY",
                                                   code="invalid_api_key"), status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, counted)
            await self.app(scope, receive, counted)
        except Exception as exc:  # the response (a 500 in OpenAI's shape) is sent; the log gets one line, no traceback
            first = str(exc).splitlines()[0] if str(exc) else ""
            log.error("%s %s failed: %s: %s", scope.get("method"), path, exc.__class__.__name__, first)
        except asyncio.CancelledError:
            if not self.service.closing:
                raise
            # uvicorn cancels what still runs SHUTDOWN_SLACK_S after the grace period (a body still arriving):
            # a 503 if nothing was sent yet, one log line, and the request ends here (no traceback)
            log.warning("%s %s cancelled at shutdown", scope.get("method"), path)
            if not status.get("started"):
                response = JSONResponse(error_body("the server is shutting down", "server_error"), status_code=503)
                with contextlib.suppress(Exception):
                    await response(scope, receive, counted)
        finally:
            if self.service.metrics is not None:
                known = path if path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health",
                                         "/metrics") else "other"
                self.service.metrics.requests.labels(known, str(status["code"])).inc()

    @staticmethod
    def _authorized(scope, key: str) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, given = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), key.encode())


async def read_body(request: Request, limit: int) -> bytearray:
    """The body's bytes, at most `limit` (413 beyond, on the declared length and as it arrives)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    return body


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def until_disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="fmoe", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = "no such endpoint" if exc.status_code == 404 else str(exc.detail)
        return JSONResponse(error_body(message), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:  # logged by Gate, in one line
        return JSONResponse(error_body("internal error (the server log says more)", "server_error"), status_code=500)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(service)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        if model != service.model_id:
            raise ApiError(404, f"the model {model!r} does not exist: this server serves {service.model_id!r}",
                           code="model_not_found", param="model")
        return model_card(service)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    async def generation(request: Request, kind, encode, prompt_of) -> Response:
        raw = await read_body(request, service.options.max_body)
        admit(service)  # a place in the queue before anything that grows with what the body asks for
        try:
            req, ids, max_tokens = await asyncio.get_running_loop().run_in_executor(
                service.preparing, prepare, service, raw, kind, encode, prompt_of)
        except BaseException:
            service.worker.release()
            raise
        del raw  # not kept while the request waits and is answered
        return await respond(service, request, req, ids, max_tokens, Reply(chat=kind is ChatRequest,
                                                                           model=service.model_id))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generation(request, ChatRequest, encode_messages, ChatRequest.conversation)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation(request, CompletionRequest, encode_text, CompletionRequest.text)

    return Gate(app, service)


def model_card(service: Service) -> dict:
    return {"id": service.model_id, "object": "model", "created": service.created, "owned_by": "fmoe",
            "context_length": service.context}


def admit(service: Service) -> None:
    """Reserve a place in the queue (429 when it is full, 503 when the server is closing)."""
    try:
        service.worker.reserve()
    except QueueFull as exc:
        raise ApiError(429, f"the server is busy: {service.worker.queue_length} requests wait; retry after "
                            f"{exc.retry_after} s", kind="rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(exc.retry_after)}) from None
    except Closed:
        raise ApiError(503, "the server is shutting down", kind="server_error") from None


def prepare(service: Service, raw: bytes, kind, encode, prompt_of) -> tuple:
    """(request, prompt ids, longest answer) from a body, on the one tokenising thread: the JSON read and
    checked; a prompt that cannot fit refused by its number of messages, then of characters, before it is
    templated and tokenised. After a large body the memory its reading used goes back to the system."""
    try:
        body = decode_body(raw)
        if kind is ChatRequest:
            refuse_long_conversation(body, service.context)
        req = parse(kind, body, service.model_id)
        del body
        prompt = prompt_of(req)
        chars = len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)
        param = "messages" if kind is ChatRequest else "prompt"
        refuse_long_prompt(chars, service.context, service.longest_token, param)
        lm = service.session.lm
        try:
            ids = encode(lm.tokenizer, prompt, lm.model_id)
        except FmoeError as exc:
            raise ApiError(400, str(exc), param=param) from None
        return req, ids, answer_budget(req.requested_tokens(), len(ids), service.context, MAX_NEW_TOKENS)
    finally:
        if len(raw) > TRIM_AFTER_BYTES:
            return_freed_memory()


async def next_message(inbox: asyncio.Queue, watcher: asyncio.Future):
    """The worker's next message, or `watcher` itself if it is done first (the client has gone)."""
    if not inbox.empty():
        return inbox.get_nowait()
    getter = asyncio.ensure_future(inbox.get())
    try:
        await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not getter.done():
            getter.cancel()
    return getter.result() if getter.done() and not getter.cancelled() else watcher


def shutdown_error(job: Job) -> ApiError:
    return ApiError(503, f"the server is shutting down: the answer was stopped after {job.generated} tokens",
                    kind="server_error")


async def respond(service: Service, request: Request, req, ids: list[int], max_tokens: int, reply: Reply) -> Response:
    """Queue the request (its place is reserved) and answer it: one JSON body, or an SSE stream whose
    headers go out when the worker takes it (a request refused while it waits is a plain error)."""
    sampling = request_sampling(req, service.recommended)
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()

    def emit(message) -> None:  # from the worker thread
        try:
            loop.call_soon_threadsafe(inbox.put_nowait, message)
        except RuntimeError:  # the event loop has closed (the server stopped): nobody is listening
            job.cancelled.set()

    job = Job(ids, max_tokens, sampling, emit, stops=req.stop_strings())
    try:
        service.worker.submit(job, reserved=True)
    except Closed:
        raise ApiError(503, "the server is shutting down", kind="server_error") from None
    service.inboxes.add(inbox)
    watcher = asyncio.ensure_future(until_disconnected(request))
    streaming = finished = False
    try:
        pieces = []
        while True:
            message = await next_message(inbox, watcher)
            if message is watcher:  # the client has gone: nobody to answer
                return Response(status_code=499)
            if isinstance(message, Started) and req.stream:
                streaming = True
                return StreamingResponse(stream(service, job, inbox, reply, req.include_usage),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            if isinstance(message, Piece):
                pieces.append(message.text)
            elif isinstance(message, Failed):
                finished = True
                raise ApiError(message.status, message.message, kind="server_error")
            elif isinstance(message, Stopped) or isinstance(message, Done) and message.finish == "cancelled":
                finished = True
                raise shutdown_error(job)
            elif isinstance(message, Done):
                finished = True
                return JSONResponse(reply.whole(message.text, message.finish, message.usage))
    finally:
        watcher.cancel()
        if not streaming:
            service.inboxes.discard(inbox)
            if not finished:
                service.worker.cancel(job)


async def stream(service: Service, job: Job, inbox: asyncio.Queue, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    """The SSE chunks of one answer, then `[DONE]`; an answer that fails or is stopped at shutdown ends
    with an error event, then `[DONE]`. If the client goes, Starlette cancels this generator: the job is
    cancelled (within one token)."""
    finished = False
    try:
        if reply.chat:
            yield sse(reply.chunk(role=True, include_usage=include_usage))
        while True:
            message = await inbox.get()
            if isinstance(message, Piece):
                yield sse(reply.chunk(message.text, include_usage=include_usage))
                continue
            finished = True
            if isinstance(message, Failed):
                yield sse(error_body(message.message, "server_error"))
            elif isinstance(message, Stopped) or message.finish == "cancelled":
                yield sse(shutdown_error(job).body())
            else:
                yield sse(reply.chunk(finish=message.finish, include_usage=include_usage))
                if include_usage:
                    yield sse(reply.chunk(usage=message.usage))
            yield sse("[DONE]")
            return
    finally:
        service.inboxes.discard(inbox)
        if not finished:
            service.worker.cancel(job)


# --- the command -------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn's server, but: on shutdown the queue closes first (waiting requests get a 503), the answer
    in progress has the grace period and then ends as a response should (a stream with its final event and
    [DONE]), and a Ctrl-C or SIGTERM ends `fmoe serve` with code 0 after the statistics are saved (uvicorn
    would re-raise the signal instead). A second Ctrl-C ends the grace period at once."""

    def __init__(self, config, service: Service) -> None:
        super().__init__(config)
        self.service = service

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets=None) -> None:
        self.service.closing = True
        self.service.worker.close()  # the requests still waiting: a 503 each
        ender = asyncio.ensure_future(self._end_answers_after(self.service.options.grace_s))
        try:
            await super().shutdown(sockets)  # waits for the connections, at most --grace + SHUTDOWN_SLACK_S
            if self.force_exit:  # a second Ctrl-C: uvicorn waits no more; the answers still end as responses
                self.service.end_answers()
                await self._connections_closed(SHUTDOWN_SLACK_S)
        finally:
            ender.cancel()

    async def _end_answers_after(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(min(0.05, deadline - time.monotonic()))
        self.service.end_answers()

    async def _connections_closed(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.server_state.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.01)


def serve_in(service: Service, sock, *, log_level: str = "info") -> _Server:
    """The uvicorn server of `service` on the bound socket `sock` (not yet running)."""
    config = uvicorn.Config(create_app(service), log_level=log_level,
                            timeout_graceful_shutdown=service.options.grace_s + SHUTDOWN_SLACK_S,
                            lifespan="off", access_log=True)  # one line per request (uvicorn prints it at info)
    return _Server(config, service)


def run_serve(run: RunOptions, options: ServeOptions, sock: socket.socket, err_console: Console) -> None:
    """`fmoe serve` on `sock` (bound by the command, so that a port in use is said before anything slow): load and
    plan as chat does, serve until Ctrl-C or SIGTERM, save the statistics. The socket is closed on the way out."""
    try:
        chat = open_chat(ChatOptions(run), err_console)
    except BaseException:
        sock.close()
        raise
    try:
        session = chat.session
        service = start_service(session, run.model, options, chat.idle)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        lm = session.lm
        err_console.print(f"fmoe serve · {lm.label} · {lm.device} · {chat.link_label} · plan {session.settings.plan.summary()}",
                          highlight=False, soft_wrap=True)
        if (warning := options.exposure_warning()) is not None:
            err_console.print(Text.assemble(("warning:", "bold yellow"), " ", warning), highlight=False, soft_wrap=True)
        err_console.print(f"listening on http://{shown}:{port}/v1 (model id {run.model!r}); Ctrl-C stops",
                          highlight=False, soft_wrap=True)
        server = serve_in(service, sock)
        server.run(sockets=[sock])
        service.worker.close(cancel_current=True)
        service.preparing.shutdown(wait=False, cancel_futures=True)
        service.worker.join()
    finally:
        sock.close()
        chat.close()  # saves the statistics
    err_console.print(f"stopped after {service.worker.answered} requests; statistics saved", highlight=False)
