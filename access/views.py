"""REST API of access control: who am I, and signed read URLs."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from django.conf import settings
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from access import signing
from access.grants import Operation
from access.rest import principal_of
from streams.errors import BadRequest, Forbidden
from streams.rest import StrictIntegerField


class WhoAmISerializer(serializers.Serializer):
    kind = serializers.CharField()
    id = serializers.CharField()
    name = serializers.CharField()
    grants = serializers.ListField(child=serializers.CharField())
    unrestricted = serializers.BooleanField()


class WhoAmI(APIView):
    """The credentials of the request, as the server sees them."""

    @extend_schema(responses=WhoAmISerializer)
    def get(self, request: Request) -> Response:
        principal = principal_of(request)
        return Response(
            {
                "kind": principal.kind,
                "id": principal.id,
                "name": principal.name,
                "grants": [str(grant) for grant in principal.grants],
                "unrestricted": principal.unrestricted,
            }
        )


class SignedUrlRequestSerializer(serializers.Serializer):
    stream = serializers.CharField(required=False, help_text="One stream's path")
    prefix = serializers.CharField(
        required=False, help_text="A resource prefix instead, e.g. 'stream/rooms/'"
    )
    expires_in = StrictIntegerField(
        min_value=1, default=3600, help_text="Seconds the URL stays valid"
    )


class SignedUrlSerializer(serializers.Serializer):
    query = serializers.CharField()
    url = serializers.CharField(allow_null=True)
    expires_at = serializers.DateTimeField()


class SignedUrls(APIView):
    """Mint a signed read URL (for EventSource and CDNs) for one stream or a prefix the API
    key may read. It grants only read, only until it expires, only while the key is valid."""

    @extend_schema(request=SignedUrlRequestSerializer, responses=SignedUrlSerializer)
    def post(self, request: Request) -> Response:
        payload = SignedUrlRequestSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        data: dict[str, Any] = payload.validated_data
        principal = principal_of(request)
        if principal.kind != "key":
            raise Forbidden("signed URLs are minted with an API key")
        if ("stream" in data) == ("prefix" in data):
            raise BadRequest("give either stream or prefix")
        if data["expires_in"] > settings.DS_AUTH_SIGNED_URL_MAX_SECS:
            raise BadRequest(f"expires_in is at most {settings.DS_AUTH_SIGNED_URL_MAX_SECS}")
        exact = "stream" in data
        scope = signing.scope_of(data.get("stream"), data.get("prefix"))
        principal.require(scope, Operation.READ)
        expires = int(time.time()) + data["expires_in"]
        query = signing.query_string(
            signing.sign(principal.id, scope, exact=exact, expires=expires)
        )
        url = (
            request.build_absolute_uri(f"/v1/stream/{quote(data['stream'])}") + "?" + query
            if exact
            else None
        )
        return Response(
            {"query": query, "url": url, "expires_at": datetime.fromtimestamp(expires, UTC)},
            status=201,
        )
