"""Start uvicorn on a socket bound here (so that ``--port 0`` can say which port it got)."""

from __future__ import annotations

import socket
import sys
from typing import Any

from app.errors import LlmchatError, os_error


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise LlmchatError(
            f"Cannot listen on {host}: {err.strerror}.",
            "pass --host with an address of this machine, e.g. 127.0.0.1",
        ) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as err:
        sock.close()
        raise os_error(
            err, f"Cannot listen on {host}:{port}", "pick another --port (0: any free one)"
        ) from None
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_server(app: Any, sock: socket.socket, *, log_level: str = "info", announce: bool = True) -> None:
    """Serve ``app`` on ``sock`` until SIGINT/SIGTERM (uvicorn's graceful shutdown, 5 s at most)."""
    import uvicorn

    if announce:
        print(
            f"llmchat serve: listening on {url_of(sock)}/v1 (OpenAI-compatible; Ctrl+C stops)",
            file=sys.stderr,
            flush=True,
        )
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])
