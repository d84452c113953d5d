"""Errors that end `gpu-share` with one line and exit status 1 (not a config error, not a traceback)."""

from __future__ import annotations


class StartupError(RuntimeError):
    """Something the node or a flag does not allow: the message names it and the cause."""


class FlagError(ValueError):
    """A flag's value cannot work; str() is `--flag PATH: cause (hint)`."""

    def __init__(self, flag: str, value: str, cause: str, hint: str = "") -> None:
        super().__init__(f"{flag} {value}: {cause}" + (f" ({hint})" if hint else ""))


def check_readable_file(flag: str, value: str, hint: str = "") -> None:
    """FlagError unless the file a flag names opens for reading (the other start-up checks: runtime/startup.py)."""
    try:
        with open(value, "rb"):
            pass
    except IsADirectoryError:
        raise FlagError(flag, value, "is a directory, not a file", hint) from None
    except OSError as err:
        raise FlagError(flag, value, err.strerror or str(err), hint) from None
