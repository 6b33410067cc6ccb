"""A real coordinator on a real loopback port, in a background thread with its
own event loop: for tests (sync or async) and the SDK's pytest fixture.

    with ServerThread(db_path, clock=ManualClock()) as srv:
        srv.address        # "127.0.0.1:PORT"
        srv.clock.advance(61_000)
        srv.restart()      # graceful stop + start on the same file and port

``db_path`` may also be a ``postgresql://`` URL (the PostgreSQL store); with a
``ManualClock`` the clock bound (``max_clock_skew``) is then off by default.
"""

from __future__ import annotations

import asyncio
import io
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from ..app import App
from ..clock import Clock, SystemClock
from ..config import Settings
from ..storage import is_url
from .clock import ManualClock

T = TypeVar("T")


class ServerThread:
    def __init__(
        self,
        db_path: str | Path,
        clock: Clock | None = None,
        listen: str = "127.0.0.1:0",
        *,
        wait_leading: float = 30.0,
        **settings: Any,
    ) -> None:
        """``db_path``: a SQLite file or a PostgreSQL URL; with a URL, ``start``
        waits up to ``wait_leading`` seconds for this coordinator to lead
        (0: return at once, e.g. for a standby)."""
        self.db_path = str(db_path)
        self.wait_leading = wait_leading
        self.clock: Any = clock or SystemClock()
        if isinstance(self.clock, ManualClock) and is_url(self.db_path):
            # a test clock is nowhere near the database's: the clock bound would
            # keep this coordinator from ever leading
            settings.setdefault("max_clock_skew", "0")
        self._listen = listen
        settings.setdefault("http_listen", "127.0.0.1:0")  # the dashboard on a free port
        self._settings = settings
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="fencepost-server", daemon=True
        )
        self._thread.start()
        self.app: App | None = None
        self.port = 0

    def call(self, fn: Callable[[], Awaitable[T]], timeout: float = 30) -> T:
        """Run a coroutine on the server's loop and wait for its result."""
        fut: Future[T] = asyncio.run_coroutine_threadsafe(fn(), self._loop)  # type: ignore[arg-type]
        try:
            return fut.result(timeout)
        except TimeoutError:
            raise TimeoutError(f"the server's loop did not finish within {timeout:g} s; "
                               f"what it was waiting for:\n{self._stacks()}") from None

    def _stacks(self) -> str:
        """Every task's stack on the server's loop, and every thread's (a
        diagnosis for a call that timed out; read from outside the loop)."""
        out = io.StringIO()
        for task in list(asyncio.all_tasks(self._loop)):
            out.write(f"--- {task!r}\n")
            for frame in task.get_stack(limit=12):  # frames of compiled code lack line numbers
                code = frame.f_code
                out.write(f"  {code.co_filename}:{frame.f_lineno} in {code.co_name}\n")
        for ident, frame in sys._current_frames().items():
            out.write(f"--- thread {ident}\n{''.join(traceback.format_stack(frame, limit=12))}")
        return out.getvalue()

    def start(self) -> ServerThread:
        listen = self._listen if not self.port else f"127.0.0.1:{self.port}"
        settings = Settings(listen=listen, db_path=self.db_path, **self._settings)
        self.app = self.call(lambda: App(settings, self.clock).start())
        self.port = self.app.port
        if self.app.leadership is not None and self.wait_leading:
            deadline = time.monotonic() + self.wait_leading
            while not self.app.serving:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not leading after {self.wait_leading:g} s")
                time.sleep(0.01)
        if self.app.http_port and self._settings["http_listen"].endswith(":0"):
            self._settings["http_listen"] = f"127.0.0.1:{self.app.http_port}"  # same on restart
        return self

    def stop(self, grace: float = 1.0) -> None:
        if self.app is not None:
            app, self.app = self.app, None
            self.call(lambda: app.stop(grace))

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        """The dashboard's base URL, e.g. http://127.0.0.1:PORT."""
        assert self.app is not None
        return f"http://127.0.0.1:{self.app.http_port}"

    @property
    def writer(self) -> Any:
        assert self.app is not None and self.app.writer is not None
        return self.app.writer

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
