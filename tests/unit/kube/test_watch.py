"""The one reader of watch streams: events split across chunks, each bounded, a read timeout as Silent, an
ERROR event as Gone or a bounded error."""

from __future__ import annotations

import io
import json
import threading

import pytest
from urllib3 import HTTPResponse

from deviceplugin.kube.watch import STREAM_CHUNK, EventTooLarge, Gone, Silent, raise_for_error, watch_events


def _response(body: io.RawIOBase | bytes) -> HTTPResponse:
    return HTTPResponse(body=io.BytesIO(body) if isinstance(body, bytes) else body, preload_content=False)


def _event(kind: str, name: str, pad: int = 0) -> bytes:
    return json.dumps({"type": kind, "object": {"metadata": {"name": name}, "pad": "x" * pad}}).encode() + b"\n"


def test_events_across_chunk_boundaries_and_blank_lines() -> None:
    body = _event("ADDED", "a", pad=STREAM_CHUNK) + b"\n" + _event("BOOKMARK", "b") + _event("DELETED", "c")
    events = list(watch_events(_response(body), max_bytes=4 * STREAM_CHUNK))
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "a"),
        ("BOOKMARK", "b"),
        ("DELETED", "c"),
    ]


def test_an_event_over_the_bound_is_refused() -> None:
    with pytest.raises(EventTooLarge, match="a watch event over 100000 bytes"):
        list(watch_events(_response(_event("ADDED", "big", pad=200_000)), max_bytes=100_000))


def test_a_read_timeout_is_silence() -> None:
    class Quiet(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
            raise TimeoutError("timed out")  # what a socket with a read timeout raises

    with pytest.raises(Silent):
        list(watch_events(_response(Quiet()), max_bytes=1024))


def test_a_stop_ends_the_stream_after_the_chunk_in_hand() -> None:
    stop = threading.Event()
    stop.set()
    body = _event("ADDED", "a") + _event("ADDED", "b", pad=2 * STREAM_CHUNK)
    assert [e["object"]["metadata"]["name"] for e in watch_events(_response(body), 4 * STREAM_CHUNK, stop)] == ["a"]


def test_error_events() -> None:
    with pytest.raises(Gone):
        raise_for_error({"code": 410, "message": "too old resource version"}, "pods")
    with pytest.raises(RuntimeError, match=r"watch pods: error 500: x{200}\.\.\.\(5000 chars\)"):
        raise_for_error({"code": 500, "message": "x" * 5000}, "pods")
