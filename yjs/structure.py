"""An update's structure read before pycrdt decodes it: ids, clocks and nesting within bounds.

Two things Yrs does not refuse and should never see (found by a probe, docs/reliability.md):

* Yrs decodes nested values (lib0 ``Any``: arrays and objects a client sets in a map or array)
  by recursion: one update of 30,000 nested one-element arrays, 60 KB, overflowed the stack of
  the process decoding it, a server worker (SIGSEGV: every connection of the worker cut).
* Yjs, in JavaScript, reads client ids and clocks as doubles, exact only up to 2^53 - 1; Yrs
  reads them as 64-bit integers. An update with a client id or clock past that is read
  differently by the two: a JavaScript client that read the document from the start and one
  that joined from the snapshot (written by Yrs) saw different text, for good.

``check_structure`` walks an update's v1 encoding as Yjs reads it (``readClientsStructRefs``,
``readItemContent``, lib0's ``readAny`` for values; the delete set after the structs), without
recursion, and refuses (``InvalidStructure``) values nested deeper than ``MAX_NESTING``, ids
and clocks (a struct's clock plus its length) past ``MAX_SAFE_INTEGER``, content and value
kinds Yjs does not have, and bytes cut short. Strings and binaries are skipped, not decoded:
a string's length in clocks (UTF-16 units) is at most its length in bytes, which is what the
clock bound counts. Bytes after the delete set are left to Yrs, as before.
"""

from __future__ import annotations

from yjs.framing import FramingError, read_var_uint

# JavaScript's Number.MAX_SAFE_INTEGER: the largest id or clock every client reads exactly.
MAX_SAFE_INTEGER = 2**53 - 1
# How deep a value may nest (an array in an object in ...): far below where Yrs' recursion
# overflows a thread's stack (about 30,000 levels; 20,000 read in a thread of the server), and
# where JavaScript's lib0, recursive too, would (some thousands).
MAX_NESTING = 1000

# Content kinds (the low five bits of a struct's info byte).
_GC, _DELETED, _JSON, _BINARY, _STRING, _EMBED, _FORMAT, _TYPE, _ANY, _DOC, _SKIP = range(11)
# Type kinds of a ContentType whose name follows (YXmlElement, YXmlHook); the last kind.
_NAMED_TYPES = (3, 5)
_LAST_TYPE = 6


class InvalidStructure(ValueError):
    """An update Yjs cannot read, or one outside the bounds above (the message says which)."""


class _Reader:
    __slots__ = ("data", "index")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.index = 0

    def byte(self) -> int:
        if self.index >= len(self.data):
            raise InvalidStructure("the update is cut short")
        value = self.data[self.index]
        self.index += 1
        return value

    def uint(self) -> int:
        """A lib0 var-uint; past 2^53 - 1 it is no count, clock or id any client reads exactly."""
        try:
            value, self.index = read_var_uint(self.data, self.index)
        except FramingError:
            raise InvalidStructure("a number of the update is cut short or past 2^53") from None
        if value > MAX_SAFE_INTEGER:
            raise InvalidStructure("a number of the update is past 2^53 - 1")
        return value

    def var_int(self) -> None:
        """Skip a lib0 var-int (sign and six bits in the first byte, seven in the others)."""
        for _ in range(9):
            if self.byte() < 0x80:
                return
        raise InvalidStructure("an integer of the update is past 2^53")

    def skip(self, length: int) -> None:
        if length > len(self.data) - self.index:
            raise InvalidStructure("the update is cut short")
        self.index += length

    def blob(self) -> int:
        """Skip a length-prefixed string or binary; its length in bytes."""
        length = self.uint()
        self.skip(length)
        return length

    def identifier(self) -> None:
        """An id (client, clock), both within MAX_SAFE_INTEGER (``uint``)."""
        self.uint()
        self.uint()


def check_structure(update: bytes) -> None:
    """InvalidStructure unless ``update`` (v1 encoding) is one Yjs reads exactly: see above."""
    reader = _Reader(update)
    for _ in range(reader.uint()):
        structs = reader.uint()
        reader.uint()  # the client
        clock = reader.uint()
        for _ in range(structs):
            clock += _struct(reader)
            if clock > MAX_SAFE_INTEGER:
                raise InvalidStructure("a clock of the update is past 2^53 - 1")
    for _ in range(reader.uint()):  # the delete set: per client, (clock, length) ranges
        reader.uint()
        for _ in range(reader.uint()):
            if reader.uint() + reader.uint() > MAX_SAFE_INTEGER:
                raise InvalidStructure("a deleted range of the update is past 2^53 - 1")


def _struct(reader: _Reader) -> int:
    """Read one struct; its length in clocks (at most: a string's counted in bytes)."""
    info = reader.byte()
    kind = info & 0x1F
    if kind in (_GC, _SKIP):
        return reader.uint()
    if info & 0x80:
        reader.identifier()  # origin
    if info & 0x40:
        reader.identifier()  # right origin
    if not info & 0xC0:  # no origins: the parent is written
        if reader.uint() == 1:
            reader.blob()  # a root type's name
        else:
            reader.identifier()  # a type's item
        if info & 0x20:
            reader.blob()  # the key in a map
    return _content(reader, kind)


def _content(reader: _Reader, kind: int) -> int:
    if kind == _DELETED:
        return reader.uint()
    if kind == _JSON:
        count = reader.uint()
        for _ in range(count):
            reader.blob()
        return count
    if kind in (_BINARY, _EMBED):
        reader.blob()
        return 1
    if kind == _STRING:
        return reader.blob()
    if kind == _FORMAT:
        reader.blob()
        reader.blob()
        return 1
    if kind == _TYPE:
        type_ref = reader.uint()
        if type_ref > _LAST_TYPE:
            raise InvalidStructure(f"unknown type kind {type_ref}")
        if type_ref in _NAMED_TYPES:
            reader.blob()
        return 1
    if kind == _ANY:
        count = reader.uint()
        _values(reader, count)
        return count
    if kind == _DOC:
        reader.blob()  # its guid
        _values(reader, 1)  # its options
        return 1
    raise InvalidStructure(f"unknown content kind {kind}")


def _values(reader: _Reader, count: int) -> None:
    """Skip ``count`` lib0 values, refusing nesting past MAX_NESTING: a stack of the values
    left at each open array or object (and whether it is an object: a key before each)."""
    left = [count]
    keyed = [False]
    while left:
        if not left[-1]:
            left.pop()
            keyed.pop()
            continue
        left[-1] -= 1
        if keyed[-1]:
            reader.blob()
        tag = reader.byte()
        if tag in (127, 126, 121, 120):  # undefined, null, false, true
            continue
        if tag == 125:
            reader.var_int()
        elif tag == 124:
            reader.skip(4)  # float32
        elif tag in (123, 122):
            reader.skip(8)  # float64, bigint64
        elif tag in (119, 116):
            reader.blob()  # string, bytes
        elif tag in (118, 117):  # object, array
            if len(left) > MAX_NESTING:
                raise InvalidStructure(f"a value of the update nests deeper than {MAX_NESTING}")
            left.append(reader.uint())
            keyed.append(tag == 118)
        else:
            raise InvalidStructure(f"unknown value type {tag}")
