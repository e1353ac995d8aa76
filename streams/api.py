"""REST API of the streams app (Django REST framework): the stream catalog."""

from __future__ import annotations

from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import generics, serializers

from access.rest import principal_of, readable
from streams.models import Stream
from streams.protocol.offsets import Offset

# Paths under this prefix are internal (PROTOCOL.md 6 reserves it; the Yjs app keeps its
# documents' streams there).
INTERNAL_PREFIX = "__ds/"


class StreamSerializer(serializers.ModelSerializer):
    tail_offset = serializers.SerializerMethodField()
    ttl_seconds = serializers.IntegerField(read_only=True)
    expires_at = serializers.DateTimeField(read_only=True)

    class Meta:
        model = Stream
        fields = ["path", "content_type", "tail_offset", "closed", "created_at", "ttl_seconds",
                  "expires_at"]  # fmt: skip

    def get_tail_offset(self, stream: Stream) -> str:
        return str(Offset(stream.next_seq, stream.next_pos))


@extend_schema(
    parameters=[
        OpenApiParameter("prefix", OpenApiTypes.STR, description="Only paths starting with it")
    ]
)
class StreamCatalog(generics.ListAPIView):
    """Live streams (not expired or deleted), by path, that the caller may read; internal
    streams (``__ds/``, behind the Yjs endpoint) are not listed."""

    serializer_class = StreamSerializer

    def get_queryset(self) -> QuerySet[Stream]:
        streams = (
            Stream.objects.filter(deleted_at__isnull=True)
            .with_expired()
            .filter(expired=False)  # type: ignore[misc]  # annotated by with_expired()
            .exclude(path__startswith=INTERNAL_PREFIX)
            .order_by("path")
        )
        prefix = self.request.query_params.get("prefix")
        if prefix:
            streams = streams.filter(path__startswith=prefix)
        return readable(streams, principal_of(self.request), "path")
