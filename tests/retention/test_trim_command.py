"""``manage.py trim_streams``, alone (PROTOCOL.md 4; docs/gaps.md, Retention).

In a module of its own: the command purges every stream waiting for a purge, and so does every
server's retention sweep. The sweeping servers of test_policies.py (a sweep every 0.2 s) took the
purge of the command's trim from under it now and then, and the command rightly reported 0
messages purged; here only the session's test server runs, sweeping once a minute.
"""

from __future__ import annotations

from typing import Any

import httpx

from tests.conftest import command_env, manage
from tests.retention.support import append_all, create, start_of, stored_seqs


def test_trim_streams_command_enforces_policies_with_progress(
    client: httpx.Client, stream_path: str, database_url: str, pg: Any
) -> None:
    """``manage.py trim_streams`` trims streams over their policy and purges their rows,
    saying what it does. (The stream has no policy of its own and the command a server-wide
    default of 10 bytes, which the test server does not have: the trim is the command's.)"""
    create(client, stream_path)
    offsets = append_all(client, stream_path, ["aaaaa", "bbbbb", "ccccc", "ddddd"])
    env = command_env(database_url, DS_RETENTION__MAX_BYTES="10")
    args = ["trim_streams", "--stream", stream_path]
    result = manage(database_url, *args, env=env)
    assert result.returncode == 0, result.stderr
    assert f"trimmed {stream_path}: {offsets[0]} -> {offsets[2]}" in result.stdout
    assert f"purged {stream_path}: 2 messages" in result.stdout
    assert "1 trimmed, 2 messages purged" in result.stdout
    assert start_of(client, stream_path) == offsets[2]
    assert stored_seqs(pg, stream_path) == [2, 3]
    again = manage(database_url, *args, env=env)
    assert again.returncode == 0 and "0 trimmed" in again.stdout
