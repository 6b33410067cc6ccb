"""A TCP proxy in front of a test server, to cut one client off the network
while the server (and every other client) keeps running."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any


class Proxy:
    """``127.0.0.1:PORT`` forwarding to ``target`` ("host:port").

    ``cut()`` resets every open connection and refuses new ones (accepted,
    then closed at once: the client sees UNAVAILABLE), ``mend()`` lets
    connections through again. ``hold_replies()`` keeps passing what clients
    send but drops what the server answers: requests are applied, their
    answers lost (until ``cut()``). Runs on its own loop thread, so it works
    the same under sync and async tests."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="test-proxy",
                                        daemon=True)
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self.down = False
        self.replies_held = False
        self.port = 0

    def __enter__(self) -> Proxy:
        self._thread.start()
        self._server = self._call(self._listen())
        return self

    def __exit__(self, *exc: object) -> None:
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self) -> None:
        self._call(self._cut())

    def mend(self) -> None:
        self.down = False

    def hold_replies(self) -> None:
        self.replies_held = True

    # -- on the proxy's loop ------------------------------------------------------------

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(5)

    async def _listen(self) -> asyncio.Server:
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        return server

    async def _cut(self) -> None:
        self.down = True
        self.replies_held = False
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    async def _shutdown(self) -> None:
        await self._cut()
        if self._server is not None:
            self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        await asyncio.gather(self._pipe(reader, up_writer),
                             self._pipe(up_reader, writer, replies=True))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    replies: bool = False) -> None:
        try:
            while data := await reader.read(65536):
                if replies and self.replies_held:
                    continue  # the server's answer never reaches the client
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self._writers.discard(writer)
            with contextlib.suppress(Exception):
                writer.transport.abort()
