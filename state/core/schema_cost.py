"""What checking a value against a JSON Schema can cost, worked out from the schema alone.

A schema is client input (registering one needs only ``manage``), and jsonschema-rs checks a
value while holding Python's global lock: nothing else of the process runs meanwhile, threads
or not. Two ways a schema made that unbounded (docs/reliability.md):

* ``$ref`` shared down a chain: ``a1 = allOf[a0, a0]``, ``a2 = allOf[a1, a1]`` ... checks
  ``a0`` 2^n times on every value, and a chain 40 long compiles at once and then holds a worker
  for hours on a three-character string;
* many keywords on one large value: 50 patterns in an ``anyOf`` against an 8 MiB string took
  0.2 s to judge and 3.4 s to explain (the explanation quoted the string in every branch).

The cost of a schema here is how many keywords it applies to one place of a value, counting
every way ``$ref``, ``allOf`` and the other in-place applicators reach them, plus what the
keywords below it apply to the places under that one, for values nested at most
``COST_DEPTH`` deep. Checking a value takes time in proportion to about that cost times the
value's size: that product is what ``state.core.schemas`` bounds. A schema that applies
itself again to the same place without end (a ``$ref`` cycle that never goes down into the
value) has no cost: it is refused, as is a ``$ref`` this module cannot follow (jsonschema-rs
compiles offline, so such a reference could only be to the document itself).

Keywords this module does not know are counted as if they applied their subschemas in place:
an overestimate, never an underestimate.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urldefrag, urljoin

from jsonschema.exceptions import SchemaError

# Values are assumed nested at most this deep when a schema applies itself again below itself
# (a recursive schema: a tree of comments); deeper values of such a schema are not checked.
COST_DEPTH = 64
# Costs are counted up to this, and anything above it is as bad as it.
_CAP = 1 << 62

_DEFAULT_BASE = "https://schema.invalid/root.json"
# Applied in place, to the same part of the value.
_IN_PLACE = frozenset({"not", "if", "then", "else", "allOf", "anyOf", "oneOf"})
_IN_PLACE_MAP = frozenset({"dependentSchemas"})
# Applied to the parts below (members, items, property names).
_BELOW_ONE = frozenset(
    {
        "additionalProperties",
        "unevaluatedProperties",
        "propertyNames",
        "additionalItems",
        "unevaluatedItems",
        "contains",
    }
)
_BELOW_MAP = frozenset({"properties", "patternProperties"})
# Data or annotations, never applied as schemas; schemas only reached through $ref.
_NOT_APPLIED = frozenset(
    {"$defs", "definitions", "enum", "const", "examples", "default", "contentSchema"}
)
_REFS = frozenset({"$ref", "$dynamicRef", "$recursiveRef"})


@dataclass(frozen=True, slots=True)
class SchemaCost:
    cost: int  # keywords applied per place of a value nested at most COST_DEPTH deep
    recursive: bool  # applies itself below itself: deeper values would cost more


def schema_cost(schema: dict[str, Any] | bool) -> SchemaCost:
    """The cost of checking a value against ``schema``; SchemaError when it has none (a
    ``$ref`` cycle in place, a ``$ref`` it cannot follow)."""
    graph = _Graph(schema)
    order = graph.in_place_order()
    previous: dict[int, int] = {}
    for depth in range(COST_DEPTH + 1):
        costs: dict[int, int] = {}
        for node in order:
            in_place, below = graph.edges[node]
            total = graph.weight[node] + sum(costs[child] for child in in_place)
            if depth:
                total += sum(previous[child] for child in below)
            costs[node] = min(total, _CAP)
        if costs == previous:  # deeper values cost no more: not recursive
            return SchemaCost(costs[graph.root], recursive=False)
        previous = costs
    return SchemaCost(previous[graph.root], recursive=True)


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
    """Every subschema a check can reach from the root, by id: its weight (its keywords) and
    what it applies, in place and below."""

    def __init__(self, schema: dict[str, Any] | bool) -> None:
        self.nodes: dict[int, Any] = {}
        self.resources: dict[str, Any] = {}
        self.anchors: dict[tuple[str, str], Any] = {}
        self.dynamic: dict[str, list[Any]] = {}
        self.recursive_anchors: list[Any] = []
        self.bases: dict[int, str] = {}
        self._index(schema, _DEFAULT_BASE)
        self.resources.setdefault(_DEFAULT_BASE, schema)
        self.root = id(schema)
        self.weight: dict[int, int] = {}
        self.edges: dict[int, tuple[list[int], list[int]]] = {}
        pending = [schema]
        while pending:
            node = pending.pop()
            if id(node) in self.edges:
                continue
            self.nodes[id(node)] = node
            in_place, below = self._applied(node)
            self.weight[id(node)] = _weight(node)
            self.edges[id(node)] = ([id(n) for n in in_place], [id(n) for n in below])
            for child in (*in_place, *below):
                self.nodes.setdefault(id(child), child)
                pending.append(child)

    def _index(self, node: Any, base: str) -> None:
        """Record the base URI of every object of the document, its resources ($id) and its
        anchors, so that $ref can be followed as jsonschema-rs follows it."""
        stack = [(node, base)]
        while stack:
            current, current_base = stack.pop()
            if isinstance(current, list):
                stack.extend((item, current_base) for item in current)
                continue
            if not isinstance(current, dict):
                continue
            own_id = current.get("$id", current.get("id"))
            if isinstance(own_id, str):
                uri, fragment = urldefrag(urljoin(current_base, own_id))
                if uri:
                    current_base = uri
                    self.resources[uri] = current
                if fragment:  # draft 6-7: "$id": "#name" names an anchor
                    self.anchors[(current_base, fragment)] = current
            self.bases[id(current)] = current_base
            for key, kind in (("$anchor", None), ("$dynamicAnchor", "dynamic")):
                name = current.get(key)
                if isinstance(name, str):
                    self.anchors[(current_base, name)] = current
                    if kind:
                        self.dynamic.setdefault(name, []).append(current)
            if current.get("$recursiveAnchor") is True:
                self.recursive_anchors.append(current)
            for key, child in current.items():
                if key not in ("enum", "const", "examples", "default"):
                    stack.append((child, current_base))

    def _applied(self, node: Any) -> tuple[list[Any], list[Any]]:
        """The subschemas ``node`` applies to the same place and to the places below."""
        in_place: list[Any] = []
        below: list[Any] = []
        if not isinstance(node, dict):
            return in_place, below
        base = self.bases.get(id(node), _DEFAULT_BASE)
        for key, value in node.items():
            if key in _NOT_APPLIED:
                continue
            if key in _REFS:
                in_place.extend(self._targets(key, value, base))
            elif key in _IN_PLACE:
                in_place.extend(_schemas(value))
            elif key in _IN_PLACE_MAP or key == "dependencies":
                if isinstance(value, dict):
                    in_place.extend(s for v in value.values() for s in _schemas(v))
            elif key in _BELOW_ONE or key in ("items", "prefixItems"):
                below.extend(_schemas(value))
            elif key in _BELOW_MAP:
                if isinstance(value, dict):
                    below.extend(s for v in value.values() for s in _schemas(v))
            elif isinstance(value, dict | list):
                in_place.extend(_schemas(value))  # unknown: counted as applied in place
        if "unevaluatedProperties" in node or "unevaluatedItems" in node:
            # Evaluated again to find what they evaluated: counted twice.
            in_place = in_place * 2
        return in_place, below

    def _targets(self, key: str, ref: Any, base: str) -> list[Any]:
        if not isinstance(ref, str):
            raise SchemaError(f"{key} must be a string")
        targets = [self._resolve(ref, base)]
        if key == "$dynamicRef":
            _, name = urldefrag(ref)
            targets.extend(self.dynamic.get(name, []))
        elif key == "$recursiveRef":
            targets.extend(self.recursive_anchors)
        return targets

    def _resolve(self, ref: str, base: str) -> Any:
        uri, fragment = urldefrag(urljoin(base, ref))
        resource = self.resources.get(uri)
        if resource is None:
            raise SchemaError(f"$ref {ref!r} is not to a part of this schema")
        if not fragment:
            return resource
        if not fragment.startswith("/"):
            target = self.anchors.get((uri, fragment))
            if target is None:
                raise SchemaError(f"$ref {ref!r} names no anchor of this schema")
            return target
        target = resource
        for token in unquote(fragment).split("/")[1:]:
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and token in target:
                target = target[token]
            elif isinstance(target, list) and token.isdigit() and int(token) < len(target):
                target = target[int(token)]
            else:
                raise SchemaError(f"$ref {ref!r} is not to a part of this schema")
        return target

    def in_place_order(self) -> list[int]:
        """The subschemas, each after everything it applies in place (so costs can be added
        up in this order); SchemaError if one applies itself in place again."""
        order: list[int] = []
        state: dict[int, int] = {}  # 1: being visited, 2: done
        for start in self.edges:
            if state.get(start) == 2:
                continue
            stack: list[tuple[int, Iterator[int]]] = [(start, iter(self.edges[start][0]))]
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
                    stack.append((child, iter(self.edges[child][0])))
        return order


def _schemas(value: Any) -> list[Any]:
    """The subschemas in a keyword's value: a schema, or a list of them."""
    if isinstance(value, dict | bool):
        return [value]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, dict | bool)]
    return []


def _weight(node: Any) -> int:
    """A subschema's own keywords (an enum counts each of its values)."""
    if not isinstance(node, dict):
        return 1
    enum = node.get("enum")
    return max(1, len(node)) + (len(enum) if isinstance(enum, list) else 0)
