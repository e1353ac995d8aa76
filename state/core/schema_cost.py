"""What checking a value against a JSON Schema can cost, worked out from the schema alone.

A schema is client input (registering one needs only ``manage``), and jsonschema-rs checks a
value while holding Python's global lock: nothing else of the process runs meanwhile, threads
or not. Two ways a schema made that unbounded (docs/reliability.md):

* ``$ref`` shared down a chain: ``a1 = allOf[a0, a0]``, ``a2 = allOf[a1, a1]`` ... checks
  ``a0`` 2^n times on every value, and a chain 40 long compiles at once and then holds a worker
  for hours on a three-character string;
* many keywords on one large value: 50 patterns in an ``anyOf`` against an 8 MiB string took
  0.2 s to judge and 3.4 s to explain (the explanation quoted the string in every branch).

The cost of a schema is the most evaluations of subschemas it makes at any one place of a value
nested at most ``COST_DEPTH`` deep: at a place, every subschema applied there in place
(``allOf``, ``$ref``, ``if``/``then``/``else`` ... each counted once per way it is reached),
each weighing its keywords; below it, for a member of an object the most costly of its
``properties`` plus every ``patternProperties``, ``additionalProperties`` and
``unevaluatedProperties`` (any may apply to it), for an item likewise, and what the subschemas
applied in place apply below. Checking a value takes about that cost times the value's size:
that product is what ``state.core.schemas`` bounds.

So that this module and jsonschema-rs agree on what a ``$ref`` names, a schema may refer only
within itself by fragment (``#/$defs/x``, ``#anchor``) and may not embed resources (``$id`` or
draft 4's ``id`` below the root); a schema applying itself to the same place again without end
(a ``$ref`` cycle that never goes into the value) has no cost. Those are refused. Only the
keywords of drafts 4 to 2020-12 that apply subschemas are followed, as jsonschema-rs follows
them (other keywords are annotations, never applied).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from jsonschema.exceptions import SchemaError

# Values are assumed nested at most this deep when a schema applies itself again below itself
# (a recursive schema: a tree of comments); deeper values of such a schema are not checked.
COST_DEPTH = 64
# Costs are counted up to this, and anything above it is as bad as it.
_CAP = 1 << 62

# Applied in place, to the same part of the value: one subschema, or a list of them.
_IN_PLACE = frozenset({"not", "if", "then", "else", "allOf", "anyOf", "oneOf"})
# Applied in place, a map of subschemas (dependencies: draft 4-7, its arrays are names).
_IN_PLACE_MAP = frozenset({"dependentSchemas", "dependencies"})
_REFS = frozenset({"$ref", "$dynamicRef", "$recursiveRef"})
# Applied to any member of an object, or to any item of an array (one subschema each).
_ANY_MEMBER = frozenset({"additionalProperties", "unevaluatedProperties"})
_ANY_ITEM = frozenset({"additionalItems", "unevaluatedItems", "contains"})
# Subschemas only reached by reference.
_DEFINITIONS = frozenset({"$defs", "definitions"})
# Every keyword holding subschemas: one or a list of them, or a map of them.
_ONE_OR_LIST = _IN_PLACE | _ANY_MEMBER | _ANY_ITEM | {"items", "prefixItems", "propertyNames"}
_MAPS = _IN_PLACE_MAP | _DEFINITIONS | {"properties", "patternProperties"}
_ARRAY_INDEX = re.compile(r"0|[1-9][0-9]*")


@dataclass(frozen=True, slots=True)
class SchemaCost:
    cost: int  # evaluations of subschemas at one place of a value nested COST_DEPTH deep
    recursive: bool  # applies itself below itself: deeper values would cost more
    # Only keywords whose work is a small constant per byte of what they look at (no
    # pattern, format, multipleOf, uniqueItems, contains): the cost bound holds for them.
    plain: bool = True


# Keywords whose work is a small constant per byte of the value they look at: checks of
# schemas made only of these may run in the server's process (state.validation).
PLAIN_KEYWORDS = frozenset(
    {
        "$schema", "$id", "id", "$comment", "$anchor", "$dynamicAnchor", "$recursiveAnchor",
        "$ref", "$dynamicRef", "$recursiveRef", "$defs", "definitions", "$vocabulary",
        "title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
        "type", "enum", "const", "required", "properties", "additionalProperties",
        "unevaluatedProperties", "propertyNames", "dependentRequired", "dependentSchemas",
        "dependencies", "minProperties", "maxProperties", "items", "prefixItems",
        "additionalItems", "unevaluatedItems", "minItems", "maxItems", "minLength",
        "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
        "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "contentEncoding",
        "contentMediaType", "contentSchema",
    }
)  # fmt: skip


def schema_cost(schema: dict[str, Any] | bool) -> SchemaCost:
    """The cost of checking a value against ``schema``; SchemaError when it has none or
    refers in ways this module does not follow (above)."""
    graph = _Graph(schema)
    order = graph.in_place_order()
    own: dict[int, int] = {}
    for node in order:
        children = [own[child] for child in graph.in_place[node]]
        if node in graph.choices:
            own[node] = max(children)
        else:
            own[node] = min(graph.weight[node] + sum(children), _CAP)
    # Per node, the most it makes evaluated at one place below its own, for each kind of place
    # there (a member of an object, a key, an item of an array: a value is one of them).
    below: dict[int, tuple[int, int, int]] = {node: (0, 0, 0) for node in order}
    for _ in range(COST_DEPTH):
        deeper: dict[int, tuple[int, int, int]] = {}
        for node in order:
            parts = [deeper[child] for child in graph.in_place[node]]
            if node in graph.choices:
                member, key, item = (max(part[k] for part in parts) for k in range(3))
            else:
                own_below = graph.below_cost(node, own, below)
                member, key, item = (
                    min(sum(part[k] for part in parts) + own_below[k], _CAP) for k in range(3)
                )
            deeper[node] = (member, key, item)
        if deeper == below:  # deeper values cost no more
            return SchemaCost(max(own[graph.root], *below[graph.root]), False, graph.plain)
        below = deeper
    return SchemaCost(max(own[graph.root], *below[graph.root]), True, graph.plain)


def nested_deeper_than(value: Any, depth: int) -> bool:
    """Whether ``value`` holds containers more than ``depth`` levels deep (the value itself
    is level 0)."""
    level = [value]
    for _ in range(depth + 1):
        level = [
            part
            for item in level
            if isinstance(item, dict | list)
            for part in (item.values() if isinstance(item, dict) else item)
        ]
        if not level:
            return False
    return True


class _Graph:
    """Every subschema a check can reach from the root, by id: its weight (its keywords), what
    it applies in place, and what it applies to the members and items below."""

    def __init__(self, schema: dict[str, Any] | bool) -> None:
        self.root_schema = schema
        self.draft4 = isinstance(schema, dict) and "draft-04" in str(schema.get("$schema", ""))
        self.anchors: dict[str, Any] = {}
        self.dynamic: dict[str, list[Any]] = {}
        self.recursive_anchors: list[Any] = [schema]
        self._index()
        self.root = id(schema)
        self.plain = True
        self._kept: list[_Choice] = []  # alive while the graph is: keyed by id()
        self.choices: set[int] = set()
        self.weight: dict[int, int] = {}
        self.in_place: dict[int, list[int]] = {}
        # (named members, any member, key names, indexed items, any item): ids of subschemas.
        self.below: dict[int, tuple[list[int], list[int], list[int], list[int], list[int]]] = {}
        pending = [schema]
        while pending:
            node = pending.pop()
            if id(node) in self.in_place:
                continue
            if isinstance(node, _Choice):
                self.choices.add(id(node))
                self.weight[id(node)] = 0
                self.in_place[id(node)] = [id(t) for t in node.targets]
                self.below[id(node)] = ([], [], [], [], [])
                pending.extend(node.targets)
                continue
            in_place, below = self._applied(node)
            if isinstance(node, dict) and not PLAIN_KEYWORDS.issuperset(node):
                self.plain = False
            self.weight[id(node)] = _weight(node)
            self.in_place[id(node)] = [id(n) for n in in_place]
            self.below[id(node)] = tuple([id(n) for n in group] for group in below)  # type: ignore[assignment]
            for group in (in_place, *below):
                pending.extend(group)

    def below_cost(
        self, node: int, own: dict[int, int], below: dict[int, tuple[int, int, int]]
    ) -> tuple[int, int, int]:
        """What ``node``'s own keywords make evaluated at the costliest member, key and item
        below its place, given each subschema's cost at its place (``own``) and below it."""

        def cost(child: int) -> int:
            return max(own[child], *below[child])

        named, any_member, keys, indexed, any_item = self.below[node]
        member = max((cost(c) for c in named), default=0) + sum(cost(c) for c in any_member)
        item = max((cost(c) for c in indexed), default=0) + sum(cost(c) for c in any_item)
        return (member, sum(cost(c) for c in keys), item)

    def _index(self) -> None:
        """The anchors of the document, and a refusal of resources embedded in it. Every
        object of the document is looked at, whatever keyword holds it (jsonschema-rs finds
        resources under ``contentSchema`` too, which is never applied: found by review), so
        no ``$id`` can move the base a ``$ref`` is resolved against."""
        stack: list[tuple[Any, bool]] = [(self.root_schema, True)]
        while stack:
            node, is_root = stack.pop()
            if isinstance(node, list):
                stack.extend((item, False) for item in node)
                continue
            if not isinstance(node, dict):
                continue
            for key in ("id", "$id") if self.draft4 else ("$id",):
                if not is_root and isinstance(node.get(key), str):
                    raise SchemaError(
                        f"{key} below the root (an embedded resource) is not supported"
                    )
            for key in ("$anchor", "$dynamicAnchor"):
                name = node.get(key)
                if not isinstance(name, str):
                    continue
                if self.anchors.setdefault(name, node) is not node:
                    raise SchemaError(f"anchor {name!r} is defined more than once")
                if key == "$dynamicAnchor":
                    self.dynamic.setdefault(name, []).append(node)
            if node.get("$recursiveAnchor") is True:
                self.recursive_anchors.append(node)
            stack.extend((child, False) for child in node.values())

    def _applied(self, node: Any) -> tuple[list[Any], tuple[list[Any], ...]]:
        """The subschemas ``node`` applies in place, and below it: (named members, any member,
        key names, indexed items, any item)."""
        in_place: list[Any] = []
        named: list[Any] = []
        any_member: list[Any] = []
        keys: list[Any] = []
        indexed: list[Any] = []
        any_item: list[Any] = []
        if not isinstance(node, dict):
            return in_place, (named, any_member, keys, indexed, any_item)
        for key, value in node.items():
            if key in _REFS:
                in_place.extend(self._targets(key, value))
            elif key in _IN_PLACE:
                in_place.extend(_schemas(value))
            elif key in _IN_PLACE_MAP:
                if isinstance(value, dict):
                    in_place.extend(s for v in value.values() for s in _schemas(v))
            elif key == "properties":
                if isinstance(value, dict):
                    named.extend(s for v in value.values() for s in _schemas(v))
            elif key == "patternProperties":
                if isinstance(value, dict):
                    any_member.extend(s for v in value.values() for s in _schemas(v))
            elif key in _ANY_MEMBER:
                any_member.extend(_schemas(value))
            elif key == "propertyNames":
                keys.extend(_schemas(value))
            elif key == "prefixItems" or (key == "items" and isinstance(value, list)):
                indexed.extend(_schemas(value))
            elif key == "items" or key in _ANY_ITEM:
                any_item.extend(_schemas(value))
        if "unevaluatedProperties" in node or "unevaluatedItems" in node:
            # Evaluated again to find what they evaluated: counted twice.
            in_place = in_place * 2
        return in_place, (named, any_member, keys, indexed, any_item)

    def _targets(self, key: str, ref: Any) -> list[Any]:
        if not isinstance(ref, str):
            raise SchemaError(f"{key} must be a string")
        if not ref.startswith("#"):
            raise SchemaError(
                f"{key} {ref!r}: only references within the schema (#/..., #anchor) are supported"
            )
        targets = [self._resolve(ref)]
        if key == "$dynamicRef":
            targets.extend(self.dynamic.get(unquote(ref[1:]), []))
        elif key == "$recursiveRef":
            targets.extend(self.recursive_anchors)
        unique = list({id(t): t for t in targets}.values())
        if len(unique) == 1:
            return unique
        # One reference is one evaluation, of whichever of its targets the scope picks.
        choice = _Choice(unique)
        self._kept.append(choice)
        return [choice]

    def _resolve(self, ref: str) -> Any:
        fragment = unquote(ref[1:])
        if not fragment:
            return self.root_schema
        if not fragment.startswith("/"):
            target = self.anchors.get(fragment)
            if target is None:
                raise SchemaError(f"$ref {ref!r} names no anchor of this schema")
            return target
        target = self.root_schema
        for token in fragment.split("/")[1:]:
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and token in target:
                target = target[token]
            elif (
                isinstance(target, list)
                and _ARRAY_INDEX.fullmatch(token)
                and int(token) < len(target)
            ):
                target = target[int(token)]
            else:
                raise SchemaError(f"$ref {ref!r} is not to a part of this schema")
        if not isinstance(target, dict | bool):
            raise SchemaError(f"$ref {ref!r} is not to a schema")
        return target

    def in_place_order(self) -> list[int]:
        """The subschemas, each after everything it applies in place (so costs can be added
        up in this order); SchemaError if one applies itself in place again."""
        order: list[int] = []
        state: dict[int, int] = {}  # 1: being visited, 2: done
        for start in self.in_place:
            if state.get(start) == 2:
                continue
            stack: list[tuple[int, Iterator[int]]] = [(start, iter(self.in_place[start]))]
            state[start] = 1
            while stack:
                node, children = stack[-1]
                child = next(children, None)
                if child is None:
                    stack.pop()
                    state[node] = 2
                    order.append(node)
                elif state.get(child) == 1:
                    raise SchemaError(
                        "the schema applies itself to the same value again without end "
                        "(a $ref cycle that never goes into the value)"
                    )
                elif state.get(child) is None:
                    state[child] = 1
                    stack.append((child, iter(self.in_place[child])))
        return order


class _Choice:
    """A dynamic reference's possible targets: one of them is evaluated."""

    __slots__ = ("targets",)

    def __init__(self, targets: list[Any]) -> None:
        self.targets = targets


def _schemas(value: Any) -> list[Any]:
    """The subschemas in a keyword's value: a schema, or a list of them."""
    if isinstance(value, dict | bool):
        return [value]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, dict | bool)]
    return []


# A multipleOf that is not a whole number is checked in arbitrary precision: about 1.5 us per
# number, and 33 us against 1e300, where a pattern takes about 2 ns a byte.
_FRACTIONAL_MULTIPLE_WEIGHT = 2048


def _weight(node: Any) -> int:
    """A subschema's own work at a place: its keywords, and each name or value a keyword lists
    (``required``, ``enum``, ``dependentRequired`` ...), one each."""
    if not isinstance(node, dict):
        return 1
    weight = max(1, len(node))
    for key, value in node.items():
        if key in _ONE_OR_LIST or key in _MAPS:
            continue
        if isinstance(value, list):
            weight += len(value)
        elif isinstance(value, dict):
            weight += sum(len(v) if isinstance(v, list) else 1 for v in value.values())
    multiple = node.get("multipleOf")
    if isinstance(multiple, float) and not multiple.is_integer():
        weight += _FRACTIONAL_MULTIPLE_WEIGHT
    return weight
