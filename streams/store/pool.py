"""The async PostgreSQL connection pool of this server process (DESIGN.md, Request path).

One pool per process, opened on first use inside the running event loop. Connections are taken
only for the duration of a statement or transaction: an idle live reader holds none.
"""

from __future__ import annotations

import asyncio
import logging

from django.conf import settings
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool

logger = logging.getLogger(__name__)

_pool: AsyncConnectionPool | None = None
_pool_lock: asyncio.Lock | None = None


def conninfo(alias: str = "default") -> str:
    """libpq connection string for a Django database alias."""
    db = settings.DATABASES[alias]
    params: dict[str, str | int] = {"dbname": db["NAME"]}
    for key, name in (
        ("USER", "user"),
        ("PASSWORD", "password"),
        ("HOST", "host"),
        ("PORT", "port"),
    ):
        if db.get(key):
            params[name] = db[key]
    for key, value in (db.get("OPTIONS") or {}).items():
        if isinstance(value, str | int):
            params[key] = value
    params.setdefault("application_name", "durable-streams")
    return make_conninfo(**params)


async def get_pool() -> AsyncConnectionPool:
    global _pool, _pool_lock
    if _pool is not None:
        return _pool
    if _pool_lock is None:
        _pool_lock = asyncio.Lock()
    async with _pool_lock:
        if _pool is None:
            pool = AsyncConnectionPool(
                conninfo(),
                min_size=settings.DS_DB_POOL_MIN_SIZE,
                max_size=settings.DS_DB_POOL_MAX_SIZE,
                kwargs={"autocommit": True},
                open=False,
                name="durable-streams",
            )
            await pool.open(wait=True, timeout=30)
            _pool = pool
            logger.info("database pool open (max %d connections)", settings.DS_DB_POOL_MAX_SIZE)
    return _pool
