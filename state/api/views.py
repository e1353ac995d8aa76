"""REST API of the state app: registrations and materialized entities."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.paginator import Page, Paginator
from django.db import connection, transaction
from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import generics, status
from rest_framework.request import Request
from rest_framework.response import Response

from access.grants import Operation, stream_resource
from access.rest import principal_of, readable
from state.api.serializers import (
    EntitySerializer,
    RegistrationRequestSerializer,
    StateStreamSerializer,
)
from state.models import EntityState, StateStream
from state.services import (
    CompactionPolicy,
    catch_up_state_stream,
    register_state_stream,
    unregister_state_stream,
)
from streams.errors import BadRequest, NotFound, PayloadTooLarge
from streams.http.request import check_stream_path
from streams.rest import Pagination


class StateStreamList(generics.ListAPIView):
    """State streams, each with the offset its entities are materialized to.

    POST registers a JSON stream (201; 200 when the same registration exists; 404 unknown
    stream; 409 not a JSON stream, or registered with other schemas or compaction) and
    materializes what it already holds. ``compaction: true`` has the server compact it
    (``tombstone_seconds``: how long deletes are kept)."""

    serializer_class = StateStreamSerializer

    def get_queryset(self) -> QuerySet[StateStream]:
        registrations = StateStream.objects.select_related("stream").order_by("stream__path")
        return readable(registrations, principal_of(self.request), "stream__path")

    @extend_schema(request=RegistrationRequestSerializer, responses=StateStreamSerializer)
    def post(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        payload = RegistrationRequestSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        path = check_stream_path(payload.validated_data["stream"])
        principal = principal_of(request)
        principal.require(stream_resource(path), Operation.MANAGE)
        data = payload.validated_data
        compaction = None
        if data["compaction"] is not None or data["tombstone_seconds"] is not None:
            compaction = CompactionPolicy(bool(data["compaction"]), data["tombstone_seconds"])
        registered = register_state_stream(
            path=path,
            schemas=data["schemas"],
            registered_by=principal.label,
            compaction=compaction,
        )
        return Response(
            StateStreamSerializer(registered.registration).data,
            status=status.HTTP_201_CREATED if registered.created else status.HTTP_200_OK,
        )


class StateStreamDetail(generics.RetrieveDestroyAPIView):
    """One registration. DELETE drops it and its materialized state (the stream stays)."""

    serializer_class = StateStreamSerializer

    def get_object(self) -> StateStream:
        path = check_stream_path(self.kwargs["stream"])
        principal_of(self.request).require(stream_resource(path), Operation.READ)
        # Catch up first: report where the state is now, not before the last append.
        caught_up = catch_up_state_stream(path=path)
        registrations = StateStream.objects.select_related("stream")
        registration = registrations.filter(pk=caught_up.stream_id).first() if caught_up else None
        if registration is None:  # not registered, or unregistered since the catch-up
            raise NotFound(f"stream {path!r} is not a state stream")
        return registration

    def destroy(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        path = check_stream_path(self.kwargs["stream"])
        principal_of(request).require(stream_resource(path), Operation.MANAGE)
        unregister_state_stream(path=path)
        return Response(status=status.HTTP_204_NO_CONTENT)


class _EntityPaginator(Paginator):
    """Pages of entities whose values together hold at most about DS_READ__MAX_CHUNK_BYTES
    (always at least one entity): a page of 1,000 values of 2 MB was built whole in the
    process, 1.9 GB for four at once, kept by the allocator afterwards, and other clients
    waited (probe 10b). A page past it is refused before its values are read (their sizes are
    kept as they are written: ``value_bytes``), saying how many entities would fit."""

    def page(self, number: int | str) -> Page:
        page = super().page(number)  # its entities not read yet
        ids = list(page.object_list.values_list("pk", flat=True))  # type: ignore[attr-defined]
        if len(ids) > 1:
            with connection.cursor() as cursor:
                cursor.execute("SELECT id, value_bytes FROM ds_entity WHERE id = ANY(%s)", [ids])
                sizes = dict(cursor.fetchall())
            budget, fits, total = settings.DS_MAX_READ_BYTES, 0, 0
            for pk in ids:
                total += sizes.get(pk, 0)
                fits += total <= budget
            if total > budget:
                raise PayloadTooLarge(
                    f"this page's entities hold {total} bytes, past {budget}: ask for at most"
                    f" {max(fits, 1)} per page (page_size)"
                )
        return page


class _EntityPages(Pagination):
    django_paginator_class = _EntityPaginator


@extend_schema(
    parameters=[
        OpenApiParameter("stream", OpenApiTypes.STR, required=True, description="Stream path"),
        OpenApiParameter("type", OpenApiTypes.STR, description="Entity type"),
        OpenApiParameter("key", OpenApiTypes.STR, description="Entity key"),
    ]
)
class EntityList(generics.ListAPIView):
    """The materialized state of a state stream: entities by type and key. It reflects every
    append acknowledged before the request (the stream is caught up first), and one page is one
    snapshot of the state (its count and results are read in one repeatable-read transaction,
    so a concurrent swap by a bulk job is seen entirely or not at all)."""

    serializer_class = EntitySerializer
    pagination_class = _EntityPages

    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        path = request.query_params.get("stream")
        if not path:
            raise BadRequest("the stream query parameter is required")
        path = check_stream_path(path)
        principal_of(request).require(stream_resource(path), Operation.READ)
        # Read-your-writes: reflect every acknowledged append.
        caught_up = catch_up_state_stream(path=path)
        if caught_up is None:
            raise NotFound(f"stream {path!r} is not a state stream")
        self.stream_id = caught_up.stream_id
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            return super().list(request, *args, **kwargs)

    def get_queryset(self) -> QuerySet[EntityState]:
        params = self.request.query_params
        entities = EntityState.objects.filter(stream_id=self.stream_id)
        if params.get("type") is not None:
            entities = entities.filter(entity_type=params["type"])
        if params.get("key") is not None:
            entities = entities.filter(key=params["key"])
        return entities.order_by("entity_type", "key")
