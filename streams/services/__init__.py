"""The service layer of the base protocol (STYLE.md: services and selectors).

The request path is handler -> service -> store -> live:

* handlers (``streams.http``, ``yjs.http``) parse a request into typed values, make one call
  here, and render the answer;
* services authorize (``access.grants``: one check at the entry of each), judge in the
  protocol's order of precedence, decode large bodies off the event loop, revalidate against
  an app's extra rules, go through group commit, and wake live readers after a commit;
* the store (``streams.store``) holds all SQL and never imports live delivery or extensions;
* live delivery (``streams.live``) wakes readers.

Other apps (Yjs, state) call these functions, never a handler's internals.
"""

from streams.services.reads import (
    expiry_deadline,
    live_read,
    long_poll,
    next_read,
    read,
    stream_info,
)
from streams.services.retention import retention_of, trim_stream
from streams.services.writes import (
    TOGETHER_MAX_WEIGHT,
    append,
    append_together,
    append_weight,
    byte_append,
    create_stream,
    delete_stream,
)

__all__ = [
    "TOGETHER_MAX_WEIGHT",
    "append",
    "append_together",
    "append_weight",
    "byte_append",
    "create_stream",
    "delete_stream",
    "expiry_deadline",
    "live_read",
    "long_poll",
    "next_read",
    "read",
    "retention_of",
    "stream_info",
    "trim_stream",
]
