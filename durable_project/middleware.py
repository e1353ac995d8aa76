"""Django middleware of the project."""

from __future__ import annotations

import logging
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, JsonResponse

from streams.store.failures import refusal_for
from streams.store.pool import RETRY_AFTER_SECS, is_connection_failure

logger = logging.getLogger(__name__)


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
            logger.warning("database unavailable for %s: %s", request.path, cause)
            response = JsonResponse(
                {"detail": "the database is unavailable; retry later", "code": "UNAVAILABLE"},
                status=503,
            )
            response["Retry-After"] = str(RETRY_AFTER_SECS)
            return response
        refusal = refusal_for(cause)
        if refusal is not None:
            return JsonResponse(
                {"detail": refusal.message, "code": refusal.code}, status=refusal.status
            )
        return None
