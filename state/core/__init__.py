"""The State Protocol as plain Python (STATE-PROTOCOL.md, state-protocol-0.1.md).

No Django here: any Python program reading a stream can parse and validate State Events and
materialize them with ``MaterializedState``.
"""

from state.core.events import (
    CHANGE_OPERATIONS,
    CONTROLS,
    ChangeEvent,
    ControlEvent,
    InvalidEvent,
    StateEvent,
    is_change_event,
    is_control_event,
    parse_event,
)
from state.core.materialized import MaterializedState

__all__ = [
    "CHANGE_OPERATIONS",
    "CONTROLS",
    "ChangeEvent",
    "ControlEvent",
    "InvalidEvent",
    "MaterializedState",
    "StateEvent",
    "is_change_event",
    "is_control_event",
    "parse_event",
]
