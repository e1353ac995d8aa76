"""Shared Django REST framework pieces (kept apart from the views: DRF imports its settings,
and with them these classes, while its generic views are still loading)."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers
from rest_framework.exceptions import ParseError
from rest_framework.pagination import PageNumberPagination
from rest_framework.parsers import JSONParser
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from streams.errors import ProtocolError
from streams.protocol.headers import ascii_digits


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """The one place where domain errors (``streams.errors``) become API responses. Database
    errors go on to ``durable_project.middleware.DatabaseErrorMiddleware``."""
    if isinstance(exc, ProtocolError):
        return Response(
            {"detail": exc.message, "code": exc.code}, status=exc.status, headers=exc.headers
        )
    return drf_exception_handler(exc, context)


class BoundedJSONParser(JSONParser):
    """DRF's JSON parser, refusing documents nested too deep for the decoder (400, not the
    RecursionError DRF lets through as a 500)."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - nested too deep") from None


class Pagination(PageNumberPagination):
    """DRF page-number pagination (``count``, ``next``, ``previous``, ``results``)."""

    page_size = 100
    page_size_query_param = "page_size"
    max_page_size = 1000


class StrictIntegerField(serializers.IntegerField):
    """An integer as JSON writes one, or a string of ASCII digits. DRF's own takes whatever
    Python's int() takes: " 30 ", "٣٠٠" (other scripts' digits), "1_0", "30.0" (probe 9b)."""

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, int | str):
            self.fail("invalid")
        if isinstance(data, str) and not ascii_digits(data.removeprefix("-")):
            self.fail("invalid")
        return int(super().to_internal_value(data))
