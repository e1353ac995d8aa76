"""``MaterializedState``: the state a sequence of State Events describes
(state-protocol-0.1.md 5-6).

Inserts and updates set ``(type, key)`` to the event's value, deletes remove it, later events
win. ``reset`` clears everything (the events after it are a new epoch); the other control
events change nothing. Invalid events raise ``InvalidEvent`` and change nothing; ``apply_batch``
is all-or-nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

from state.core.events import ChangeEvent, ControlEvent, StateEvent, parse_event


class MaterializedState:
    def __init__(self) -> None:
        self._types: dict[str, dict[str, Any]] = {}

    # -- applying events -------------------------------------------------------------------

    def apply(self, event: StateEvent | dict[str, Any]) -> None:
        """Apply one event (parsed, or a decoded JSON object, which is validated first)."""
        self._apply(_parsed(event))

    def apply_batch(self, events: Iterable[StateEvent | dict[str, Any]]) -> None:
        """Apply events in order, as ``apply`` one by one would; if any is invalid, raise
        before changing anything."""
        parsed = [_parsed(event) for event in events]
        for event in parsed:
            self._apply(event)

    def _apply(self, event: StateEvent) -> None:
        if isinstance(event, ControlEvent):
            if event.control == "reset":
                self.clear()
            return
        if event.operation == "delete":
            entities = self._types.get(event.type)
            if entities is not None:
                entities.pop(event.key, None)
                if not entities:
                    del self._types[event.type]
        else:
            self._types.setdefault(event.type, {})[event.key] = event.value

    def clear(self) -> None:
        self._types.clear()

    # -- reading state ---------------------------------------------------------------------

    def get(self, type: str, key: str) -> Any | None:
        """The value at ``(type, key)``, or None when there is none."""
        return self._types.get(type, {}).get(key)

    def has(self, type: str, key: str) -> bool:
        return key in self._types.get(type, {})

    def get_type(self, type: str) -> Mapping[str, Any]:
        """A read-only view of every ``key -> value`` of one type."""
        return MappingProxyType(self._types.get(type, {}))

    @property
    def types(self) -> list[str]:
        """Types that currently hold at least one entity, sorted."""
        return sorted(self._types)

    def type_count(self, type: str) -> int:
        return len(self._types.get(type, {}))

    def items(self) -> Iterator[tuple[str, str, Any]]:
        """Every ``(type, key, value)``, by type then key."""
        for type_name in sorted(self._types):
            entities = self._types[type_name]
            for key in sorted(entities):
                yield type_name, key, entities[key]

    def __len__(self) -> int:
        return sum(len(entities) for entities in self._types.values())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MaterializedState) and self._types == other._types

    __hash__ = None  # type: ignore[assignment]  # mutable


def _parsed(event: StateEvent | dict[str, Any]) -> StateEvent:
    if isinstance(event, ChangeEvent | ControlEvent):
        return event
    return parse_event(event)
