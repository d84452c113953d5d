"""Errors that end `gpu-share` with one line and exit status 1 (not a config error, not a traceback)."""

from __future__ import annotations


class StartupError(RuntimeError):
    """Something the node or a flag does not allow: the message names it and the cause."""
