"""The extender's TLS: its certificate, reloaded when the files change (a mounted Secret rotates), the handshake under
a deadline, and who may call the verbs (a client certificate signed by the client CA, optionally with an allowed name).

Client certificates are asked for, not required, at the handshake: the probes and the metrics scraper connect without
one and may only GET. A certificate the client CA did not sign fails the handshake; a verb called without a verified
certificate is answered 401, with one whose names are not allowed 403, before its body is read.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import FlagError, check_readable_file

log = logging.getLogger(__name__)

_POLL = 0.05  # how often a handshake that waits for the client looks at the deadline and the queue


@dataclass(frozen=True)
class TLSSettings:
    cert_file: str  # PEM, the certificate (and its chain) the extender serves
    key_file: str
    client_ca_file: str = ""  # "": no client certificates asked for, the verbs are not authenticated
    client_names: frozenset[str] = (
        frozenset()
    )  # a verified client's subject CN or a DNS/URI SAN must be one; empty: any

    @property
    def authenticates(self) -> bool:
        return bool(self.client_ca_file)


class ServerTLS:
    """The current SSLContext: rebuilt on the next connection after any of its files changed on disk.

    A rebuild that fails (a half-written Secret, a key that does not match) keeps the context in use and logs once
    per change; at start-up the same failure is a FlagError naming the flag.
    """

    def __init__(self, settings: TLSSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._signature = self._stat()
        self._context = self._load()
        self._failed: tuple | None = None

    def context(self) -> ssl.SSLContext:
        with self._lock:
            signature = self._stat()
            if signature != self._signature and signature != self._failed:
                try:
                    self._context, self._signature, self._failed = self._load(), signature, None
                    log.info("extender TLS: %s reloaded", ", ".join(self._files()))
                except FlagError as err:
                    self._failed = signature
                    log.warning("extender TLS: keeping the certificate in use: %s", err)
            return self._context

    def handshake(self, sock: socket.socket, seconds: float, give_up: Callable[[float], bool]) -> ssl.SSLSocket:
        """`sock` as TLS, the handshake done within `seconds` in all however slowly the client sends it (TimeoutError
        otherwise), or earlier when `give_up(seconds waited)`; ssl.SSLError for a refused client certificate."""
        tls = self.context().wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        try:
            tls.setblocking(False)
            started = time.monotonic()
            while True:
                try:
                    tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    wanted: tuple[list, list] = ([tls], [])
                except ssl.SSLWantWriteError:
                    wanted = ([], [tls])
                waited = time.monotonic() - started
                if waited >= seconds or give_up(waited):
                    raise TimeoutError("the client did not finish the TLS handshake in time")
                select.select(*wanted, [], min(_POLL, seconds - waited))
            tls.setblocking(True)
            return tls
        except BaseException:
            tls.close()
            raise

    def refusal(self, tls: socket.socket) -> tuple[int, str] | None:
        """None when the peer may call the verbs; else (401 or 403, why)."""
        if not self.settings.authenticates:
            return None
        cert = tls.getpeercert() if isinstance(tls, ssl.SSLSocket) else None
        if not cert:
            return 401, "a client certificate signed by the extender's --client-ca-file is required"
        names = client_names(cert)
        if self.settings.client_names and not names & self.settings.client_names:
            return 403, f"client certificate {', '.join(sorted(names)) or '(no names)'} is not one of --client-names"
        return None

    def _files(self) -> tuple[str, ...]:
        s = self.settings
        return (s.cert_file, s.key_file) + ((s.client_ca_file,) if s.client_ca_file else ())

    def _stat(self) -> tuple:
        out: list[tuple[int, int, int] | None] = []
        for path in self._files():
            try:
                st = os.stat(path)  # follows the Secret volume's ..data symlink: a rotation is a new inode
                out.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                out.append(None)
        return tuple(out)

    def _load(self) -> ssl.SSLContext:
        s = self.settings
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        for flag, path in (("--tls-cert-file", s.cert_file), ("--tls-private-key-file", s.key_file)):
            check_readable_file(flag, path)
        try:
            context.load_cert_chain(s.cert_file, s.key_file)
        except OSError as err:  # ssl.SSLError, or a file gone since (a rotation under way)
            raise FlagError(
                "--tls-cert-file",
                s.cert_file,
                f"not a PEM certificate whose key is --tls-private-key-file {s.key_file} ({_why(err)})",
            ) from None
        if s.client_ca_file:
            check_readable_file("--client-ca-file", s.client_ca_file)
            try:
                context.load_verify_locations(cafile=s.client_ca_file)
            except OSError as err:
                raise FlagError(
                    "--client-ca-file", s.client_ca_file, f"not PEM CA certificates ({_why(err)})"
                ) from None
            context.verify_mode = ssl.CERT_OPTIONAL
        return context


def client_names(cert: dict) -> set[str]:
    """A verified peer certificate's subject common names and DNS/URI subject alternative names."""
    names = {value for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"}
    return names | {value for kind, value in cert.get("subjectAltName", ()) if kind in ("DNS", "URI")}


def _why(err: OSError) -> str:
    return str(getattr(err, "reason", None) or err.strerror or err)
