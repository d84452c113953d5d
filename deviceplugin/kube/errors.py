"""API errors as one log line: a `kube.rest.ApiError` as it is, and an ApiException (the extender's `kubernetes`
client), whose str() spans many lines (every response header, the whole body), as its status and Status message."""

from __future__ import annotations

import json

from ..logs import safe_text
from .rest import ApiError


def error_line(err: BaseException) -> str:
    """`<status> <reason>: <the Status message>` for an API error, else the error's first line; at most ~300
    characters."""
    if isinstance(err, ApiError):
        return safe_text(str(err), 300)
    status = getattr(err, "status", None)
    if (
        status is not None and hasattr(err, "reason") and hasattr(err, "body")
    ):  # kubernetes.client.exceptions.ApiException
        message = ""
        try:
            body = json.loads(err.body or b"{}")
            message = str(body.get("message") or "") if isinstance(body, dict) else ""
        except (ValueError, TypeError):
            pass
        return safe_text(f"{status} {err.reason}" + (f": {message}" if message else ""), 300)
    text = str(err)
    return safe_text(f"{type(err).__name__}: {text.splitlines()[0] if text else ''}", 300)
