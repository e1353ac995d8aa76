"""Database errors a request's own input caused, as the answers they deserve.

Every input the server knows to be bad is refused before it reaches the database. What slips
through anyway (a value PostgreSQL cannot store, an index row too large) surfaces as an error
of the statement; it is the request's fault, so it is a 4xx, never a 500, and it must not be
confused with the database being unreachable (``pool.is_connection_failure``: 503). A timeout
or a lock conflict is nobody's fault: 503 with Retry-After, never 500 either.
"""

from __future__ import annotations

import logging

import psycopg

from streams.errors import BadRequest, PayloadTooLarge, ProtocolError, ServiceUnavailable
from streams.store.pool import is_connection_failure


def refusal_for(exc: BaseException) -> ProtocolError | None:
    """The answer to a statement that failed on the request's data; None for anything else
    (a bug or an outage, which the caller handles)."""
    if not isinstance(exc, psycopg.Error):
        return None
    sqlstate = exc.sqlstate or ""
    # Data exceptions: a value out of range, a NUL in text... PostgreSQL's (SQLSTATE 22), or
    # psycopg's own when it will not even send a value (a NUL in a text parameter: no SQLSTATE).
    if sqlstate.startswith("22") or isinstance(exc, psycopg.DataError):
        why = f"SQLSTATE {sqlstate}" if sqlstate else str(exc).strip()[:100]
        return BadRequest(f"the request holds a value the store cannot keep ({why})")
    if sqlstate.startswith("54"):  # program limit exceeded: an index row or array too large
        return PayloadTooLarge(f"the request exceeds a limit of the store (SQLSTATE {sqlstate})")
    if sqlstate in ("57014", "55P03"):  # statement or lock timeout
        return ServiceUnavailable("the store is busy; retry later")
    # Insufficient resources: the disk full, out of memory or connections, a limit such as
    # temp_file_limit. Nobody's input is at fault, and it passes when the operator acts: a
    # 500 and a traceback for every request was a log flood on a full disk (probe 10j).
    if sqlstate.startswith("53"):
        return ServiceUnavailable(
            f"the store is out of resources (SQLSTATE {sqlstate}); retry later"
        )
    # A deadlock or serialization failure that retries did not get past (streams.store.
    # conflicts): nothing was done, the request may be sent again.
    if sqlstate in ("40P01", "40001"):
        return ServiceUnavailable("the store is busy with conflicting writes; retry later")
    return None


def unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database is unavailable or busy (work to try again later);
    Django's database errors carry psycopg's as their cause."""
    found: BaseException | None = exc
    for _ in range(2):
        if found is None:
            return False
        if (
            is_connection_failure(found)
            or isinstance(found, ServiceUnavailable)
            or isinstance(refusal_for(found), ServiceUnavailable)
        ):
            return True
        found = found.__cause__
    return False


def log_failure(logger: logging.Logger, what: str, exc: Exception) -> None:
    """Log a failure of background work: the database unavailable or busy (it will be tried
    again) in one line, anything else with its traceback."""
    if unavailable(exc):
        logger.warning("%s failed: the database is unavailable or busy (%s)", what, exc)
    else:
        logger.error("%s failed", what, exc_info=exc)
