"""The ``__registry__`` stream: every stream create and delete, recorded as State Protocol
events in the same transaction (by ``sql/state.sql``), so its materialized state is the live
catalog of streams."""

REGISTRY_PATH = "__registry__"
