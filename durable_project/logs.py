"""Log records of the project: a request id on every line, as text or JSON.

The request id is the one the lean endpoints and the Django guard give each request
(``streams.http.observe``): taken from ``X-Request-Id`` or generated, returned in the response,
and kept in a context variable, so the lines of the work a request causes carry it too (tasks
started by a request inherit it).
"""

from __future__ import annotations

import json
import logging
import re
import time
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

request_id: ContextVar[str] = ContextVar("request_id", default="-")

# What every record would otherwise collect and no line here shows (the Python logging
# documentation's "Optimization"): the calling function (a walk up the stack), the thread, the
# process id (a system call) and the multiprocessing name. One line per request: measured
# in-process, 10-12 us a line with them, 8-10 us without.
logging._srcfile = None
logging.logThreads = False
logging.logProcesses = False
logging.logMultiprocessing = False

# Attributes of a record that describe it, not the event; everything else given as `extra`
# is the event's own field.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message", "asctime", "request_id",
}  # fmt: skip


class RequestIdFilter(logging.Filter):
    """Gives a record the id of the request whose work logs it, unless it was made with one
    (the request lines, logged after their request: ``streams.http.observe``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request id, the event's fields
    and, for errors, the traceback."""

    def request_line(
        self, when: float, name: str, request_id: str, message: str, fields: dict[str, Any]
    ) -> str:
        """What ``format`` makes of an INFO record of logger ``name`` with these values, made
        without the record (streams.http.observe: request lines)."""
        line = {
            "time": datetime.fromtimestamp(when, UTC).isoformat(timespec="milliseconds"),
            "level": "INFO",
            "logger": name,
            "message": message,
            "request_id": request_id,
        }
        line.update(fields)
        return json.dumps(line, default=str)

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", "-"),
        }
        line.update((key, value) for key, value in record.__dict__.items() if key not in _STANDARD)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


# Characters a client may get into a message (a path decoded from its percent-encoding, a
# header) that would let it write lines of its own into the log: a newline, then a forged line;
# a carriage return or a terminal escape hiding what came before (found by a probe); a
# bidirectional control (U+061C, U+200E-U+200F, U+202A-U+202E, U+2066-U+2069) showing the rest
# of the line in another order than it was written (probe 7d).
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\\]")


def printable(text: str) -> str:
    """``text`` with its unprintable characters (and backslashes, so the escapes cannot be
    forged either) written as Python escapes: one record, one line."""
    if _UNPRINTABLE.search(text) is None:
        return text
    return _UNPRINTABLE.sub(lambda found: found.group().encode("unicode_escape").decode(), text)


class TextFormatter(logging.Formatter):
    """``time LEVEL logger [request id]: message key=value...``"""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s")
        self._second = -1
        self._second_text = ""

    def request_line(
        self, when: float, name: str, request_id: str, message: str, fields: dict[str, Any]
    ) -> str:
        """What ``format`` makes of an INFO record of logger ``name`` with these values, made
        without the record (streams.http.observe: request lines)."""
        second = int(when)
        if second != self._second:  # the same second's lines share its text
            self._second_text = time.strftime(self.default_time_format, self.converter(when))
            self._second = second
        asctime = (self.default_msec_format or "%s,%03d") % (
            self._second_text,
            (when - second) * 1000,
        )
        text = f"{asctime} INFO {name} [{request_id}]: {message}"
        if not fields:
            return text
        return f"{text} {' '.join(f'{k}={v}' for k, v in fields.items())}"

    def formatMessage(self, record: logging.LogRecord) -> str:
        # Whatever a message quotes stays on its line (a traceback follows on lines of its own).
        record.message = printable(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = [f"{k}={v}" for k, v in record.__dict__.items() if k not in _STANDARD]
        return f"{text} {' '.join(fields)}" if fields else text
