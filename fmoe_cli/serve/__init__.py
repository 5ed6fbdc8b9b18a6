"""`fmoe serve`: an OpenAI-compatible HTTP server on the same run and generation loop as chat.

This module is light (no torch, no FastAPI): the command line checks the server's own
options here before anything slow is imported. docs/serve.md describes the server.
"""

from __future__ import annotations

import ipaddress
import math
import socket
from dataclasses import dataclass

from fmoe_cli.errors import FmoeError

HOST = "127.0.0.1"
PORT = 8000
MAX_QUEUE = 16  # requests waiting behind the one being answered; more get a 429
GRACE_S = 10.0  # on Ctrl-C / SIGTERM: how long the answer in progress may take to finish before it is cancelled
MAX_BODY = 4 * 1024**2  # bytes of a request body (a long conversation in JSON is well under this)
API_KEY_ENV = "FMOE_API_KEY"


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
