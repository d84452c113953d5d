"""Kubernetes watch streams, read the one bounded way: newline-delimited JSON events, each at most `max_bytes`
(`watch_events`); a list's body is bounded by `kube.rest` (ResponseTooLarge).

The one list-then-watch loop (`kube.listwatch`) reads its events here, for the extender's Nodes, Pods, slices,
claims and templates (`extender/watch.py`), the DRA driver's ResourceClaims (`dra/claims.py`) and its own
ResourceSlices (`dra/slices.py`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from ..logs import safe_text

STREAM_CHUNK = 64 * 1024


class Gone(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


class Silent(Exception):
    """A read of the stream timed out: nothing (no event, no bookmark) arrived within the read timeout, which a
    caller sets to its silence bound."""


class EventTooLarge(RuntimeError):
    pass


class ResponseTooLarge(RuntimeError):
    pass


def watch_events(response: Any, max_bytes: int, stop: threading.Event | None = None) -> Iterator[dict[str, Any]]:
    """The events of a watch response (a urllib3 response opened with `_preload_content=False`) as JSON objects.
    EventTooLarge when one is over `max_bytes`, Silent when a read times out; the stream ends when `stop` is set
    (checked after each chunk)."""
    from urllib3.exceptions import ReadTimeoutError

    buffer = b""
    chunks = response.stream(STREAM_CHUNK, decode_content=True)
    while True:
        try:
            chunk = next(chunks)
        except StopIteration:
            return
        except ReadTimeoutError:
            raise Silent("no event or bookmark within the read timeout") from None
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield json.loads(line)
        if len(buffer) > max_bytes:
            raise EventTooLarge(f"a watch event over {max_bytes} bytes")
        if stop is not None and stop.is_set():
            return


def raise_for_error(event_object: Mapping[str, Any], what: str) -> None:
    """An ERROR event's Status as an exception: Gone for 410, else RuntimeError naming `what` (bounded)."""
    code = event_object.get("code")
    if code == 410:
        raise Gone()
    raise RuntimeError(f"watch {what}: error {code}: {safe_text(str(event_object.get('message')), 200)}")
