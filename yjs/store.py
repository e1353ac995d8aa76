"""SQL of the Yjs endpoint (async, through the streams app's pool). Streams themselves are
created, appended to and deleted by the streams app's write functions."""

from __future__ import annotations

from django.conf import settings

from streams.errors import NotFound
from streams.protocol.offsets import Offset
from streams.store import create_commit
from streams.store.pool import carried, connection
from streams.store.types import CreateRequest, CreateResult
from yjs.paths import DocRef

OCTET_STREAM = "application/octet-stream"

# From the stream, so a document whose row is missing (a create interrupted between its two
# statements; the next PUT adds it) still reads as a document without a snapshot.
_SNAPSHOT_POINTER_SQL = (
    "SELECT s.seq, s.pos FROM ds_stream AS st"
    " LEFT JOIN yjs_document AS d ON d.stream_id = st.id"
    " LEFT JOIN yjs_snapshot AS s ON s.id = d.snapshot_id"
    " WHERE st.path = %s AND st.deleted_at IS NULL"
)
_SNAPSHOT_DATA_SQL = (
    "SELECT s.data FROM yjs_snapshot AS s JOIN yjs_document AS d ON d.stream_id = s.document_id"
    " WHERE d.service = %s AND d.path = %s AND s.seq = %s AND s.pos = %s"
)


async def _create_stream(path: str, *, ttl_seconds: int | None) -> CreateResult:
    """An open, empty binary stream; idempotent."""
    request = CreateRequest(
        path,
        OCTET_STREAM,
        ttl_seconds=ttl_seconds,
        expires_at=None,
        closed=False,
        messages=[],
    )
    return await create_commit.create(request)


async def create_document(doc: DocRef) -> CreateResult:
    """Create the document's update stream, its default awareness stream and its row
    (YJS-PROTOCOL.md 5.1); idempotent. Returns the update stream's creation."""
    result = await _create_stream(doc.updates_stream, ttl_seconds=None)
    async with connection() as conn:
        await conn.execute(
            "INSERT INTO yjs_document (stream_id, service, path, compactions, created_at)"
            " VALUES (%s, %s, %s, 0, now()) ON CONFLICT DO NOTHING",
            (result.stream_id, doc.service, doc.doc_path),
        )
    await create_awareness(doc, "default")
    return result


async def create_awareness(doc: DocRef, name: str) -> bool:
    """Create an awareness stream (1 h sliding TTL); idempotent. Returns whether it is new."""
    result = await _create_stream(
        doc.awareness_stream(name), ttl_seconds=settings.YJS_AWARENESS_TTL_SECS
    )
    return result.created


async def snapshot_pointer(doc: DocRef) -> Offset | None:
    """The position the current snapshot covers, or None without one. NotFound when the
    document does not exist."""
    async with connection() as conn:
        cur = await conn.execute(_SNAPSHOT_POINTER_SQL, (doc.updates_stream,))
        row = await cur.fetchone()
    if row is None:
        raise NotFound("document does not exist")
    seq, pos = row
    return Offset(seq, pos) if seq is not None else None


async def snapshot_data(doc: DocRef, covers: Offset) -> bytes | None:
    async with connection() as conn:
        cur = await conn.execute(
            _SNAPSHOT_DATA_SQL, (doc.service, doc.doc_path, covers.seq, covers.pos), binary=True
        )
        row = await cur.fetchone()
        if row:
            carried(conn, len(row[0]))
    return bytes(row[0]) if row else None


async def delete_document(doc: DocRef) -> bool:
    """Delete the update stream, snapshots, row and every awareness stream of a document
    (YJS-PROTOCOL.md 5.9), in one transaction. False when there was no document."""
    async with connection() as conn, conn.transaction():
        cur = await conn.execute("SELECT ds_delete(%s)", (doc.updates_stream,))
        outcome = (await cur.fetchone())[0]  # type: ignore[index]
        await conn.execute(
            "DELETE FROM yjs_snapshot WHERE document_id IN"
            " (SELECT stream_id FROM yjs_document WHERE service = %s AND path = %s)",
            (doc.service, doc.doc_path),
        )
        await conn.execute(
            "DELETE FROM yjs_document WHERE service = %s AND path = %s",
            (doc.service, doc.doc_path),
        )
        # Awareness streams of this document: the prefix, then a name without '/'. PostgreSQL
        # calls the volatile ds_delete after sorting, so rows are locked in path order.
        prefix = doc.awareness_prefix
        await conn.execute(
            "SELECT ds_delete(path) FROM ds_stream WHERE starts_with(path, %s)"
            " AND position('/' IN substr(path, %s)) = 0 ORDER BY path",
            (prefix, len(prefix) + 1),
        )
    return outcome not in ("not_found", "gone")
