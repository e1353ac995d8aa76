"""Wire rules of the base protocol, with no storage or Django imports (STYLE.md).

Each module parses or formats one thing: offsets, headers, producer tuples, JSON mode, SSE
frames, cursors, stream paths. They raise ``streams.errors.ProtocolError`` subclasses on bad
input and are unit-tested without a database.
"""
