"""The task that checks a document's POSTs (yjs.replicas) answers every POST waiting for it,
whatever stops it: a POST never waits for ever. (A module left out of a commit once made the
task fail before its first round, and every POST to the document hung.)"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from streams.errors import ProtocolError
from streams.store.types import AppendRequest
from yjs import replicas

PATH = "__ds/yjs/unit/docs/hang"


def _request() -> AppendRequest:
    return AppendRequest(
        path=PATH,
        media_type="application/octet-stream",
        messages=[b"\x00"],
        close=False,
        producer=None,
        stream_seq=None,
    )


def _broken(*args: Any) -> Any:
    raise RuntimeError("a defect")


async def _three_posts() -> list[Any]:
    posts = [replicas.append_checked(PATH, _request(), [b"\x00"], 1) for _ in range(3)]
    # A guard against the hang this is about, not a timing: the answers come at once.
    return await asyncio.wait_for(asyncio.gather(*posts, return_exceptions=True), 30)


@pytest.mark.parametrize("where", ["_fitting", "_round"])
def test_a_defect_in_the_task_answers_every_waiting_post(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    monkeypatch.setattr(replicas, where, _broken)
    monkeypatch.setattr(replicas, "_documents", replicas.OrderedDict())
    answers = asyncio.run(_three_posts())
    assert [type(a) for a in answers] == [ProtocolError] * 3, answers
    assert {a.status for a in answers} == {500}
