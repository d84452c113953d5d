"""Log setup (human text or one JSON object per line) and bounded log text.

Nothing a client or a file controls may make a log line or an error grow without bound: `safe_text` escapes and
shortens one value, `brief` shortens a list of IDs to its first few and a count, and `RepeatLimiter` turns a storm
of identical events into one line and a "repeated N times" summary per window.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

MAX_SHOWN_ID_CHARS = 80


def safe_text(text: str, limit: int = MAX_SHOWN_ID_CHARS) -> str:
    """`text` with control and non-ASCII characters escaped and cut to `limit` characters: a crafted ID cannot forge a
    log line.

    Only the first `limit` characters are escaped, so a 4 MiB ID costs as little as a short one.
    """
    head = text[:limit].encode("ascii", "backslashreplace").decode("ascii")
    escaped = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in head)
    return escaped if len(escaped) <= limit and len(text) <= limit else f"{escaped[:limit]}...({len(text)} chars)"


def brief(items: Iterable[str], limit: int = 5) -> str:
    """At most `limit` items, each escaped and bounded, then 'and N more': log lines and error messages stay short."""
    items = list(items)
    shown = ", ".join(safe_text(i) for i in items[:limit])
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit} more"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


@dataclass
class _Window:
    started: float
    level: int
    text: str  # the latest occurrence, for the summary
    repeats: int = 0


class RepeatLimiter:
    """Logs the first of a run of identical events (same key) and then, per `window` seconds, one summary.

    `log()` writes the event when its key has no open window and counts it otherwise; the summary
    (`<latest message> (repeated N times in 60s)`) is written when the window has ended, at the next event of the key
    or at `flush()`, which the owner calls periodically. At most `max_keys` keys are followed (the oldest window is
    summarised and dropped to make room), so memory stays bounded whatever the keys.
    """

    def __init__(
        self,
        logger: logging.Logger,
        window: float = 60.0,
        max_keys: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.window = window
        self.max_keys = max_keys
        self.clock = clock
        self._windows: dict[Hashable, _Window] = {}

    def log(self, level: int, key: Hashable, msg: str, *args: object) -> None:
        now = self.clock()
        text = msg % args if args else msg
        current = self._windows.get(key)
        if current is not None and now - current.started < self.window:
            current.repeats += 1
            current.level, current.text = level, text
            return
        if current is not None:
            self._close(key)
        elif len(self._windows) >= self.max_keys:
            self.flush()
            if len(self._windows) >= self.max_keys:
                self._close(next(iter(self._windows)))
        self.logger.log(level, "%s", text)
        self._windows[key] = _Window(now, level, text)

    def flush(self, force: bool = False) -> None:
        """Summarise and forget every window that has ended (every window with `force`)."""
        now = self.clock()
        for key in [k for k, w in self._windows.items() if force or now - w.started >= self.window]:
            self._close(key)

    def _close(self, key: Hashable) -> None:
        window = self._windows.pop(key)
        if window.repeats:
            self.logger.log(
                window.level,
                "%s (repeated %d times in %.0fs)",
                window.text,
                window.repeats,
                self.clock() - window.started,
            )
