"""Shared Django REST framework pieces (kept apart from the views: DRF imports its settings,
and with them these classes, while its generic views are still loading)."""

from __future__ import annotations

from typing import Any

from rest_framework.pagination import PageNumberPagination
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from streams.errors import ProtocolError


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """The one place where domain errors (``streams.errors``) become API responses."""
    if isinstance(exc, ProtocolError):
        return Response({"detail": exc.message, "code": exc.code}, status=exc.status)
    return drf_exception_handler(exc, context)


class Pagination(PageNumberPagination):
    """DRF page-number pagination (``count``, ``next``, ``previous``, ``results``)."""

    page_size = 100
    page_size_query_param = "page_size"
    max_page_size = 1000
