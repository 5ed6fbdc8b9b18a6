"""`fmoe serve`: an OpenAI-compatible HTTP server on the same run and generation loop as chat.

This module is light (no torch, no FastAPI): the command line checks the server's own
options here before anything slow is imported. docs/serve.md describes the server.
"""

from __future__ import annotations

import ctypes
import functools
import ipaddress
import math
import socket
import sys
from dataclasses import dataclass

from fmoe_cli.errors import FmoeError

HOST = "127.0.0.1"
PORT = 8000
MAX_QUEUE = 16  # requests waiting behind the one being answered; more get a 429
GRACE_S = 10.0  # on Ctrl-C / SIGTERM: how long the answer in progress may take to finish before it is cancelled
MAX_BODY = 4 * 1024**2  # bytes of a request body (a long conversation in JSON is well under this)
API_KEY_ENV = "FMOE_API_KEY"
MALLOC_ARENAS = 2  # glibc's malloc arenas in `fmoe serve` (its default: 8 a core; see limit_malloc_arenas)
M_ARENA_MAX = -8  # mallopt's parameter number (malloc.h)


@dataclass(frozen=True)
class ServeOptions:
    """What only a server has (the run's options are chat's): the defaults live here."""

    host: str = HOST
    port: int = PORT  # 0: any free port (the one bound is printed)
    api_key: str | None = None
    max_queue: int = MAX_QUEUE
    grace_s: float = GRACE_S
    max_body: int = MAX_BODY

    def check(self) -> None:
        """Refuse bad options in one line, before the model is loaded."""
        if not self.host.strip():
            raise FmoeError("--host must not be empty")
        if not 0 <= self.port <= 65535:
            raise FmoeError(f"--port must be in 0..65535 (0: any free port), got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise FmoeError(f"the API key (--api-key or {API_KEY_ENV}) must not be empty")
        if self.max_queue < 0:
            raise FmoeError(f"--max-queue must be ≥ 0, got {self.max_queue}")
        if not (0 <= self.grace_s < math.inf):
            raise FmoeError(f"--grace must be a number of seconds ≥ 0, got {self.grace_s}")

    @property
    def loopback(self) -> bool:
        """Whether the address is reachable from this machine only."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # a host name other than localhost: it may resolve to anything
            return False

    def exposure_warning(self) -> str | None:
        """The warning for an address others can reach without a key, else None."""
        if self.loopback or self.api_key:
            return None
        return (f"serving on {self.host} without an API key: anyone who can reach this address can use the model "
                f"(set --api-key or {API_KEY_ENV})")

    def bind(self) -> socket.socket:
        """The listening socket, bound now (before the model loads): a port in use is one line, not a
        traceback after a minute of loading."""
        try:
            infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as exc:
            raise FmoeError(f"--host {self.host}: {exc.strerror or exc}") from None
        family, _, _, _, address = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise FmoeError(f"cannot listen on {self.host}:{self.port}: {exc.strerror or exc}") from None
        sock.setblocking(False)
        return sock


# --- the allocator: memory a burst of large requests used goes back ------------------------------


@functools.cache
def _glibc():
    """glibc through ctypes, or None elsewhere (macOS, musl: nothing to tune there)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim, libc.mallopt  # noqa: B018 - both exist, or this is not glibc
    except (OSError, AttributeError):
        return None
    return libc


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> None:
    """At most `arenas` malloc arenas (as MALLOC_ARENA_MAX). glibc gives a thread that finds the arenas
    busy one of its own, up to 8 a core, and keeps what each held: the server's threads (the event
    loop, the tokenizer's, the worker, torch's) would each keep their peak. An arena is made when a
    thread first needs one, so this must run before the threads start: `fmoe serve` calls it before
    importing torch."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_ARENA_MAX, arenas)


def return_freed_memory() -> None:
    """Give the pages that free() kept back to the system (malloc_trim): after a large request the
    tokenizer's buffers are freed but stay in the process's heap otherwise."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
