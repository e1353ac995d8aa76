"""What the console changes: it appends a message typed by a staff user, through the same
service as a client's POST (group commit, validation of state streams, live readers woken)."""

from __future__ import annotations

import asyncio

from access.grants import Grant, Operation, Principal, stream_resource
from streams import services
from streams.errors import Forbidden
from streams.extensions import READ_ONLY_PATHS
from streams.store.types import AppendResult

# Streams only the server writes: the Yjs documents' (their POSTs are checked Yjs updates,
# through /v1/yjs/) and the read-only ones (the registry).
INTERNAL_PREFIX = "__ds/"


def staff_principal(username: str, path: str) -> Principal:
    """A staff user acting through the console: read and append on this one stream."""
    operations = frozenset({Operation.READ, Operation.APPEND})
    grant = Grant(stream_resource(path), operations, exact=True)
    return Principal("console", id=username, name=username, grants=(grant,))


async def append_message(*, username: str, path: str, text: str) -> AppendResult:
    """Append ``text`` (UTF-8) to the stream at ``path`` with the stream's own content type:
    a JSON stream takes it as JSON (an array appends its elements), others as bytes."""
    if path.startswith(INTERNAL_PREFIX) or path in READ_ONLY_PATHS:
        raise Forbidden(f"{path!r} is written by the server only")
    principal = staff_principal(username, path)
    meta = await services.stream_info(path=path, principal=principal)
    # Django cancels a view whose client leaves; the append, once begun, is seen through
    # (a lone append is written in its caller's task: streams.store.group_commit).
    return await asyncio.shield(
        services.append(
            path=path, principal=principal, body=text.encode(), content_type=meta.content_type
        )
    )
