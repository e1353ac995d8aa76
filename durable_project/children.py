"""Work that would hold Python's global lock too long, done in a child process under a deadline.

Some libraries hold the lock for the whole of a call whose time grows with what it is given
(jsonschema-rs for schema checks, Yrs through pycrdt for Yjs updates): run in a thread of the
server, one such call stops every request of its worker, and past 5 s uvicorn kills the worker
(docs/reliability.md). ``state.checker`` and ``yjs.engine`` hand that work to a ``Child``: one
spawned process answering requests over a pipe, one at a time, each request under a deadline.

* A child is started, and ready (its imports done), within ``SETUP_SECS`` before the first
  request's deadline begins: starting is not the request's doing, but it is bounded
  (``ChildUnavailable`` past it).
* Past a request's deadline the process is killed (``ChildTimeout``); the next request starts
  a new one. A process that dies, or cannot be started, raises ``ChildUnavailable``.
* ``serve`` is the child's side: each request answered by a handler as ``(kind, detail)``, an
  exception of the handler as ``("error", its description)`` (the child goes on), until the
  parent goes away. The kinds are the caller's and its handler's to agree on.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

# Starting a child (a Python process importing the server's code and the library): not within
# a request's deadline, but bounded.
SETUP_SECS = 30.0

Answer = tuple[str, Any]


class ChildTimeout(Exception):
    """The request overran its deadline (seconds, the message); the process was killed."""


class ChildUnavailable(Exception):
    """The process could not be started or made ready in time, or it died."""


class Child:
    """One child process running ``target(conn, *args)`` (a function of a module, which
    ``spawn`` imports again in the child, calling ``serve``). Not thread-safe: its callers take
    turns. Killed, it starts afresh with the next request."""

    def __init__(self, name: str, target: Callable[..., None], *args: Any) -> None:
        self.name = name
        self._target = target
        self._args = args
        self._process: Any = None
        self._conn: Connection | None = None

    def request(self, message: tuple[Any, ...], deadline: float) -> Answer:
        """Blocking: the child's answer to ``message`` within ``deadline`` seconds."""
        conn = self._started()
        try:
            conn.send(message)
            if not conn.poll(deadline):
                self.kill()
                raise ChildTimeout(f"{deadline:.1f}")
            answer: Answer = conn.recv()
        except (OSError, EOFError) as exc:
            self.kill()
            raise ChildUnavailable(f"{type(exc).__name__}: {exc}") from None
        return answer

    def kill(self) -> None:
        """Kill the process (a thread still waiting on its pipe then reads EOF), reaped off the
        caller's thread."""
        process, self._process, self._conn = self._process, None, None
        if process is not None:
            with contextlib.suppress(Exception):
                process.kill()
            threading.Thread(target=process.join, daemon=True).start()

    def _started(self) -> Connection:
        if self._conn is not None:
            return self._conn
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(
            target=self._target, args=(child, *self._args), name=self.name, daemon=True
        )
        try:
            process.start()
        except OSError as exc:
            raise ChildUnavailable(f"cannot start: {exc}") from None
        finally:
            child.close()
        self._process, self._conn = process, parent
        try:
            parent.send(("ping",))
            if not parent.poll(SETUP_SECS):
                raise EOFError(f"not ready within {SETUP_SECS} s")
            parent.recv()
        except (OSError, EOFError) as exc:
            self.kill()
            raise ChildUnavailable(f"cannot start: {exc}") from None
        return parent


def serve(conn: Connection, handle: Callable[[tuple[Any, ...]], Answer]) -> None:
    """The child's loop: answer each request with ``handle`` until the parent goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's shutdown ends it (EOF)
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request[0] == "ping":
            conn.send(("ok", None))
            continue
        try:
            answer = handle(request)
        except Exception as exc:  # noqa: BLE001 - answered; the child goes on
            answer = ("error", f"{type(exc).__name__}: {exc}")
        conn.send(answer)
