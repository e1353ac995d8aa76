"""The REST API's authentication: the same credentials as the protocol endpoints."""

from __future__ import annotations

from typing import Any, TypeVar

from django.db.models import Model, Q, QuerySet
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.authentication import BaseAuthentication
from rest_framework.exceptions import NotAuthenticated
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from access.auth import authenticate_sync
from access.grants import ANONYMOUS, Principal

M = TypeVar("M", bound=Model)


class BearerAuthentication(BaseAuthentication):
    """``request.auth`` is the ``Principal``; 401 for bad credentials (never None, so views
    always have a principal to check: anonymous, open, or who the credentials name)."""

    def authenticate(self, request: Request) -> tuple[None, Principal]:
        query = {name: request.query_params.getlist(name) for name in request.query_params}
        return None, authenticate_sync(request.headers.get("Authorization"), query)

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="durable-streams"'


class BearerAuthenticationScheme(OpenApiAuthenticationExtension):
    """How the API's schema describes ``BearerAuthentication`` (without it, each build of the
    schema printed a warning per view that it could not)."""

    target_class = "access.rest.BearerAuthentication"
    name = "bearer"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "An API key, or a JWT of the identity provider (README, Access control)",
        }


def principal_of(request: Any) -> Principal:
    auth = getattr(request, "auth", None)
    return auth if isinstance(auth, Principal) else ANONYMOUS


def readable(queryset: QuerySet[M], principal: Principal, path_field: str) -> QuerySet[M]:
    """The rows of ``queryset`` whose stream (at ``path_field``) the principal may read."""
    prefixes = principal.readable_stream_prefixes()
    if prefixes is None or "" in prefixes:
        return queryset
    allowed = Q(pk__in=[])
    for prefix in prefixes:
        allowed |= Q(**{f"{path_field}__startswith": prefix})
    return queryset.filter(allowed)


class HasCredentials(BasePermission):
    """Requests without credentials are refused with 401 in ``keys`` mode; what each view
    then may do is its grants' business (``Principal.require``)."""

    def has_permission(self, request: Request, view: Any) -> bool:
        principal = principal_of(request)
        if principal.authenticated or principal.unrestricted:
            return True
        raise NotAuthenticated("this server requires an API key: send Authorization: Bearer <key>")
