"""Starting and stopping the aiohttp server on a host and port (0 = a free port)."""

from __future__ import annotations

import logging
import socket

from aiohttp import web

from hsgen.serve.app import ServerState, create_app

log = logging.getLogger(__name__)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (``SO_REUSEADDR``); ``OSError`` when the port is taken."""
    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=1024)


class ServerRunner:
    """One running server; :meth:`start` returns its base URL (``http://host:port``)."""

    def __init__(self, state: ServerState, *, shutdown_timeout: float = 5.0):
        self.state = state
        self.app = create_app(state)
        # vLLM aborts a request whose client disconnected; so do we (handler_cancellation).
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout
        )
        self.base_url: str | None = None

    async def start(self, host: str, port: int, *, sock: socket.socket | None = None) -> str:
        """Listen on ``host:port`` (or on ``sock``, already bound); returns the base URL."""
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port) if sock is None else web.SockSite(self._runner, sock)
        await site.start()
        bound_host, bound_port = self._runner.addresses[0][:2]
        shown = host if host not in ("0.0.0.0", "::", "") else bound_host
        self.base_url = f"http://{shown}:{bound_port}"
        return self.base_url

    async def stop(self) -> None:
        await self._runner.cleanup()
