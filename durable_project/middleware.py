"""Django middleware of the project."""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from django.conf import settings
from django.db import connections
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import reverse
from django.utils.cache import patch_vary_headers
from psycopg_pool import PoolTimeout

from streams.http.responses import cors_headers, preflight
from streams.store.failures import refusal_for
from streams.store.pool import RETRY_AFTER_SECS, is_connection_failure

logger = logging.getLogger(__name__)


# Methods of the REST API (`/v1/` routes Django serves) a CORS preflight allows.
API_METHODS = "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"


class ApiHeadersMiddleware:
    """The REST API's answers as the protocol endpoints' are for browsers and caches: a CORS
    preflight answered without credentials, CORS headers on every answer
    (``DS_HTTP__CORS_ORIGINS``), and ``Cache-Control: no-store`` where a view set none (a
    list of one key's streams, or a page read with a signed URL, kept by a shared cache).
    Found by a probe: preflights were 401 and answers had neither."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if not request.path.startswith("/v1/"):
            return self.get_response(request)
        origin = request.headers.get("Origin")
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            answer = preflight(request.headers.get("Access-Control-Request-Headers"))
            response = HttpResponse(status=answer.status)
            del response["Content-Type"]
            for name, value in answer.headers.items():
                response[name] = value
            response["Access-Control-Allow-Methods"] = response["Allow"] = API_METHODS
        else:
            response = self.get_response(request)
            if "Cache-Control" not in response:
                response["Cache-Control"] = "no-store"
        for raw_name, raw_value in cors_headers(origin):
            name, value = raw_name.decode(), raw_value.decode("latin-1")
            if name == "vary":
                patch_vary_headers(response, [value])
            else:
                response[name] = value
        return response


class ReleaseDatabaseMiddleware:
    """Gives a request's database connection back to the pool once its answer is made, before
    it is sent (the outermost middleware: the others' work on the answer, a session saved, is
    done by then). Django gives it back when the request finishes, after the last byte went
    out: a client taking a large answer slowly, as slow links do and the write deadline allows
    (durable_project.protocol), held one of the process's few pooled connections meanwhile,
    and a few such clients made every other Django-served request wait for one and fail (503).
    A streamed answer, which may read the database as it goes, keeps its connection; none of
    the project's answers is one."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if not response.streaming:
            for connection in connections.all(initialized_only=True):
                if not connection.in_atomic_block:
                    connection.close()
        return response


class DatabaseErrorMiddleware:
    """Database errors of Django-served URLs as the answers the protocol endpoints give:
    unreachable (no pooled connection in time, a failed connection) is 503 with Retry-After,
    a value the database refused because of the request's input is a 4xx. Anything else
    stays a 500."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        # Django wraps the driver's errors; the driver's own is the cause.
        cause = exception.__cause__ or exception
        if is_connection_failure(cause):
            # A pool whose connections are all taken is a busy server, not a database gone
            # (probe 9a: the answer said the database was unavailable).
            busy = isinstance(cause, PoolTimeout)
            logger.warning(
                "database %s for %s: %s", "busy" if busy else "unavailable", request.path, cause
            )
            detail = "the server is busy" if busy else "the database is unavailable"
            response = JsonResponse(
                {"detail": f"{detail}; retry later", "code": "UNAVAILABLE"}, status=503
            )
            response["Retry-After"] = str(RETRY_AFTER_SECS)
            return response
        refusal = refusal_for(cause)
        if refusal is not None:
            # A 503's Retry-After included (a lock or statement timeout, a conflict).
            return JsonResponse(
                {"detail": refusal.message, "code": refusal.code},
                status=refusal.status,
                headers=refusal.headers,
            )
        return None


class SignInThrottleMiddleware:
    """Sign-ins to the admin (whose login guards the console and API key management too),
    bounded per process: at most ``DS_AUTH__SIGN_INS_AT_ONCE`` password checks at a time (one
    more is answered 429 at once), and an address with ``DS_AUTH__SIGN_IN_FAILURES`` refused
    sign-ins within ``DS_AUTH__SIGN_IN_WINDOW_SECS`` is answered 429 until the oldest of them
    leaves the window. Nothing throttled them (probe 10h): one client guessed about seven
    passwords a second, and 64 connections of guesses held the process's few database
    connections (a check is about 250 ms of hashing), so the real admin's sign-in and other
    users' pages waited seconds or failed 503. Only addresses are counted, never accounts, so
    nobody can lock the admin out from elsewhere. It runs before sessions are loaded: a refusal
    costs no database connection."""

    # Addresses whose failures are remembered at most (the oldest forgotten first).
    MAX_ADDRESSES = 10_000

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response
        self._checking = threading.BoundedSemaphore(max(1, settings.DS_AUTH_SIGN_INS_AT_ONCE))
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.method != "POST" or request.path != self._login_path:
            return self.get_response(request)
        address = request.META.get("REMOTE_ADDR") or ""
        wait = self._barred_for(address)
        if wait > 0:
            return _too_many("too many refused sign-ins from this address", wait)
        if not self._checking.acquire(blocking=False):
            return _too_many("too many sign-ins at once; retry", 1)
        try:
            response = self.get_response(request)
        finally:
            self._checking.release()
        if response.status_code == 200:  # the form again: refused
            self._refused(address)
        return response

    @functools.cached_property
    def _login_path(self) -> str:
        return reverse("admin:login")

    def _barred_for(self, address: str) -> float:
        """Seconds until ``address`` may try again (0: now)."""
        now = time.monotonic()
        with self._lock:
            failures = self._failures.get(address)
            if failures is None:
                return 0.0
            while failures and failures[0] <= now - settings.DS_AUTH_SIGN_IN_WINDOW_SECS:
                failures.popleft()
            if not failures:
                del self._failures[address]
                return 0.0
            if len(failures) < settings.DS_AUTH_SIGN_IN_FAILURES:
                return 0.0
            return failures[0] + settings.DS_AUTH_SIGN_IN_WINDOW_SECS - now

    def _refused(self, address: str) -> None:
        with self._lock:
            failures = self._failures.pop(address, None) or deque()
            failures.append(time.monotonic())
            while len(failures) > settings.DS_AUTH_SIGN_IN_FAILURES:
                failures.popleft()
            self._failures[address] = failures
            while len(self._failures) > self.MAX_ADDRESSES:
                self._failures.popitem(last=False)


def _too_many(message: str, wait: float) -> HttpResponse:
    response = HttpResponse(f"{message}\n", status=429, content_type="text/plain; charset=utf-8")
    response["Retry-After"] = str(max(1, math.ceil(wait)))
    response["Cache-Control"] = "no-store"
    return response
