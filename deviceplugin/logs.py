"""Log setup: human text or one JSON object per line."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterable

MAX_SHOWN_ID_CHARS = 80


def safe_text(text: str, limit: int = MAX_SHOWN_ID_CHARS) -> str:
    """`text` with control and non-ASCII characters escaped and cut to `limit` characters: a crafted ID cannot forge a log line."""
    escaped = text.encode("ascii", "backslashreplace").decode("ascii")
    escaped = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in escaped)
    return escaped if len(escaped) <= limit else f"{escaped[:limit]}...({len(text)} chars)"


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
