"""A minimal Kubernetes REST client for the node daemons (the DRA driver, `gpu-share run`): JSON in and out as plain
dicts over urllib3, without the `kubernetes` package (45.7 MiB and ~0.4 s to import).

Connection: in-cluster (`KUBERNETES_SERVICE_HOST`/`_PORT`, the service account's CA, and its token file, read again
when it changes: projected tokens rotate) or a kubeconfig file's current context: `server`, `certificate-authority`
(`-data`), `insecure-skip-tls-verify`, `tls-server-name`, and a user's `token`, `tokenFile`, `client-certificate(-data)`
and `client-key(-data)`. Any other user field (an exec or auth-provider plugin, a username) is an ApiAccessError naming
it, and so is a field of the wrong type, bad base64, a CA with insecure-skip-tls-verify, a token that is not one line of
printable ASCII (at most 64 KiB), or credentials for a plain http:// server that is not loopback. The `-data` fields
are kept in memory: the CA is loaded from it, the client certificate and key from files in a private directory removed
as soon as they are loaded (the SSL context keeps them; a reconnect reads no file).

Every call: no retries (urllib3's are off), one `timeout` for the whole call: connect (each of the server name's
addresses with what is left; resolving the name is not bounded), the wait for the headers and the body share one
deadline, past which a deadline thread (one for all calls) shuts the call's socket, so a server that trickles bytes
cannot stretch it (ApiTimeout). A body is read up to `max_bytes` (ResponseTooLarge above), and any
non-2xx answer is an ApiError carrying the status and the Kubernetes Status message. A watch is opened (connect,
headers) within the timeout and returns the open response, for `kube.watch.watch_events` to read, each read waiting at
most its `silence`.
"""

from __future__ import annotations

import base64
import binascii
import heapq
import ipaddress
import itertools
import json
import logging
import os
import socket
import ssl
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import urllib3
import yaml

from ..logs import safe_text
from .watch import ResponseTooLarge

log = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TIMEOUT = 10.0  # seconds for one call, unless the caller gives its own
MAX_BYTES = 16 * 1024 * 1024  # one response body, unless the caller gives its own
MAX_ERROR_BYTES = 64 * 1024  # an error answer's body (its Status)
MAX_TOKEN = 64 * 1024  # a bearer token's characters
MAX_PAGES = 1000  # pages() of one list, unless the caller gives its own
CHUNK = 64 * 1024
POOL_SIZE = 16  # kept-alive connections (the DRA driver reads 16 claims at once; more may open, closed after use)
PATCH_TYPES = {
    "merge": "application/merge-patch+json",
    "strategic": "application/strategic-merge-patch+json",
    "apply": "application/apply-patch+yaml",
    "json": "application/json-patch+json",
}
USER_FIELDS = {"token", "tokenFile", "client-certificate", "client-certificate-data", "client-key", "client-key-data"}
CLUSTER_FIELDS = {
    "server",
    "certificate-authority",
    "certificate-authority-data",
    "insecure-skip-tls-verify",
    "tls-server-name",
    "extensions",
}


class ApiAccessError(RuntimeError):
    """No usable Kubernetes client configuration; str() is the reason."""


class ApiError(Exception):
    """A non-2xx answer: `status` (0: no answer, e.g. a timeout), `reason` (the Status reason or HTTP reason) and
    `message` (the Status message, bounded)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}" + (f": {message}" if message else ""))
        self.status, self.reason, self.message = status, reason, message


class ApiTimeout(ApiError):
    """The call did not finish within its timeout (no retry was made)."""

    def __init__(self, what: str, timeout: float) -> None:
        super().__init__(0, "Timeout", f"{what}: no answer within {timeout:g}s")


@dataclass(frozen=True)
class Connection:
    """Where the API server is and how to sign in. `token_file` is read on each call whose file changed; the `_data`
    fields are the PEM (or DER) contents of a kubeconfig's `-data` fields, used instead of the files."""

    server: str
    ca_file: str | None = None
    verify: bool = True
    server_name: str | None = None
    token: str | None = field(default=None, repr=False)
    token_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    ca_data: bytes | None = field(default=None, repr=False)
    cert_data: bytes | None = field(default=None, repr=False)
    key_data: bytes | None = field(default=None, repr=False)


def token_fault(token: str) -> str:
    """Why `token` cannot be sent as a bearer token ("" when it can); never the token itself."""
    if not token:
        return "it is empty"
    if len(token) > MAX_TOKEN:
        return f"it is over {MAX_TOKEN} characters"
    if not all("!" <= ch <= "~" for ch in token):
        return "it holds a space, a line break, a control or a non-ASCII character"
    return ""


def in_cluster() -> Connection:
    """The pod's service account; ApiAccessError outside a pod."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise ApiAccessError("not in a cluster: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set")
    token, ca = SERVICE_ACCOUNT / "token", SERVICE_ACCOUNT / "ca.crt"
    for path in (token, ca):
        if not path.is_file():
            raise ApiAccessError(f"in-cluster config: {path} is missing")
    server_host = f"[{host}]" if ":" in host else host
    return Connection(f"https://{server_host}:{port}", ca_file=str(ca), token_file=str(token))


def load_kubeconfig(path: str | os.PathLike[str]) -> Connection:
    """The current context of a kubeconfig file; ApiAccessError naming the file and the field it cannot use."""
    where = str(path)
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ApiAccessError(f"kubeconfig {where}: {safe_text(str(err), 200)}") from None
    if not isinstance(doc, dict):
        raise ApiAccessError(f"kubeconfig {where}: not a mapping")
    base = Path(path).resolve().parent
    name = doc.get("current-context")
    if not name:
        raise ApiAccessError(f"kubeconfig {where}: current-context is not set")
    context = _named(doc, "contexts", "context", name, where)
    cluster = _named(doc, "clusters", "cluster", context.get("cluster"), where)
    user = _named(doc, "users", "user", context.get("user"), where) if context.get("user") else {}
    for fields, entry, what in ((CLUSTER_FIELDS, cluster, "cluster"), (USER_FIELDS, user, "user")):
        unknown = sorted(set(entry) - fields)
        if unknown:
            raise ApiAccessError(
                f"kubeconfig {where}: {what} field {unknown[0]!r} is not supported "
                f"(supported: {', '.join(sorted(fields))})"
            )

    def refuse(key: str, why: str) -> ApiAccessError:
        entry = "clusters[].cluster" if key in CLUSTER_FIELDS else "users[].user"
        return ApiAccessError(f"kubeconfig {where}: {entry}.{key} {why}")

    def text(entry: Mapping[str, Any], key: str) -> str | None:
        value = entry.get(key)
        if value is None or value == "":
            return None
        if not isinstance(value, str):
            raise refuse(key, "must be a string")
        return value

    def data(entry: Mapping[str, Any], key: str) -> bytes | None:
        value = text(entry, key)
        if value is None:
            return None
        try:
            return base64.b64decode("".join(value.split()), validate=True)
        except binascii.Error:
            raise refuse(key, "is not base64") from None

    def file(entry: Mapping[str, Any], key: str) -> str | None:
        value = text(entry, key)
        return str(base / value) if value else None

    server = text(cluster, "server")
    split = urlsplit(server or "")
    try:
        split.port  # noqa: B018 - a port that is not a number raises
    except ValueError:
        split = urlsplit("")
    if split.scheme not in ("https", "http") or not split.hostname:
        raise refuse("server", f"must be an https:// URL, not {safe_text(repr(server), 100)}")
    insecure = cluster.get("insecure-skip-tls-verify", False)
    if not isinstance(insecure, bool):
        raise refuse("insecure-skip-tls-verify", "must be true or false (a YAML boolean, not a string)")
    ca_data, ca_file = data(cluster, "certificate-authority-data"), file(cluster, "certificate-authority")
    if insecure and (ca_data or ca_file):
        raise refuse("insecure-skip-tls-verify", "is true beside a certificate-authority(-data): not allowed")
    token = text(user, "token")
    if token and token_fault(token):
        raise refuse("token", f"is not a usable bearer token: {token_fault(token)}")
    cert_data, cert_file = data(user, "client-certificate-data"), file(user, "client-certificate")
    key_data, key_file = data(user, "client-key-data"), file(user, "client-key")
    if bool(cert_data or cert_file) != bool(key_data or key_file):
        raise refuse("client-certificate", "and client-key(-data) go together: one is missing")
    token_file = file(user, "tokenFile")
    if split.scheme == "http" and (token or token_file or cert_data or cert_file) and not _loopback(split.hostname):
        raise refuse(
            "server",
            f"is plain http:// to {safe_text(split.hostname, 100)}: the user's credentials would go in clear "
            "(http:// is used with credentials only to a loopback address; use https://)",
        )
    return Connection(
        server=server.rstrip("/") if server else "",
        ca_file=None if ca_data else ca_file,
        verify=not insecure,
        server_name=text(cluster, "tls-server-name"),
        token=token,
        token_file=token_file,
        cert_file=None if cert_data else cert_file,
        key_file=None if key_data else key_file,
        ca_data=ca_data,
        cert_data=cert_data,
        key_data=key_data,
    )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _named(doc: Mapping[str, Any], section: str, key: str, name: Any, where: str) -> Mapping[str, Any]:
    for entry in doc.get(section) or ():
        if isinstance(entry, dict) and entry.get("name") == name:
            value = entry.get(key) or {}
            if not isinstance(value, dict):
                raise ApiAccessError(f"kubeconfig {where}: {section} {name!r}: {key} is not a mapping")
            return value
    raise ApiAccessError(f"kubeconfig {where}: no {section} entry named {name!r}")


def connect(kubeconfig: str | None = None, timeout: float = TIMEOUT) -> RestClient:
    """A client from `kubeconfig` when given, else the in-cluster config, else $KUBECONFIG or ~/.kube/config."""
    if kubeconfig:
        return RestClient(load_kubeconfig(kubeconfig), timeout)
    try:
        return RestClient(in_cluster(), timeout)
    except ApiAccessError as err:
        fallback = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or str(Path.home() / ".kube" / "config")
        if not Path(fallback).is_file():
            raise ApiAccessError(f"{err}; and no kubeconfig at {fallback}") from None
        return RestClient(load_kubeconfig(fallback), timeout)


# --- the per-call deadline -----------------------------------------------------------------------
class _Call:
    """One call's deadline and the sockets it uses (its own duplicates of them: shut when the deadline passes, a
    blocked read or handshake fails at once; closed when the call ends, or when a connection goes back to the pool
    (`release`), so a descriptor reused later, or a connection another call took from the pool, is not touched)."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.expired = False
        self._done = False
        self._sockets: list[tuple[object, socket.socket]] = []  # (the connection, our duplicate of its socket)
        self._lock = threading.Lock()

    def attach(self, conn: object, sock: socket.socket) -> None:
        try:
            own = socket.fromfd(sock.fileno(), sock.family, sock.type)
        except OSError:
            return  # already closed: nothing to wait on
        with self._lock:
            if not self._done:
                self._sockets.append((conn, own))
                if self.expired:
                    _shut(own)
                return
        own.close()

    def expire(self) -> None:
        with self._lock:
            if not self._done:
                self.expired = True
                for _, sock in self._sockets:
                    _shut(sock)

    def release(self, conn: object) -> bool:
        """`conn` goes back to the pool: this call no longer shuts it; whether the deadline already shut it."""
        with self._lock:
            mine = [own for c, own in self._sockets if c is conn]
            self._sockets = [(c, own) for c, own in self._sockets if c is not conn]
            shut = bool(mine) and self.expired
        for own in mine:
            own.close()
        return shut

    def finish(self) -> bool:
        """The call is over; whether its deadline passed first."""
        with self._lock:
            self._done = True
            sockets, self._sockets = self._sockets, []
        for _, sock in sockets:
            sock.close()
        return self.expired


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Deadlines:
    """One thread (started with the first call) expiring every call at its deadline."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Nothing due and no thread (a forked child has neither the parent's thread nor, maybe, a free lock)."""
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, _Call]] = []  # a finished call stays until its deadline: bounded by the rate
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, call: _Call) -> None:
        with self._cond:
            heapq.heappush(self._due, (call.deadline, next(self._order), call))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kube-rest-deadlines", daemon=True)
                self._thread.start()
            if self._due[0][2] is call:
                self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                while self._due and self._due[0][0] <= now:
                    heapq.heappop(self._due)[2].expire()
                self._cond.wait(self._due[0][0] - now if self._due else None)


_DEADLINES = _Deadlines()
os.register_at_fork(after_in_child=_DEADLINES.reset)
_current = threading.local()  # .call: the _Call this thread is making


def _attach(conn: object, sock: socket.socket) -> None:
    call: _Call | None = getattr(_current, "call", None)
    if call is not None:
        call.attach(conn, sock)


@contextmanager
def _deadline(budget: float, what: str) -> Iterator[None]:
    """The block as one call of at most `budget` seconds: past it, its sockets are shut and it raises ApiTimeout,
    whatever the shut socket made it raise (or return)."""
    call = _Call(time.monotonic() + budget)
    _DEADLINES.add(call)
    _current.call = call
    try:
        yield
    except Exception:
        if call.finish():
            raise ApiTimeout(what, budget) from None
        raise
    finally:
        _current.call = None
        expired = call.finish()
    if expired:
        raise ApiTimeout(what, budget)


class _DeadlineConnection(urllib3.connection.HTTPConnection):
    """A connection whose socket the current call's deadline shuts: a new one as soon as it is connected (before any
    TLS handshake), one kept alive from an earlier call when a request starts on it. Connecting, each of the
    server name's addresses is tried with what is left of the call's time (urllib3 gives each the whole timeout, so a
    name with N addresses that do not answer took N timeouts); the name's resolution is not bounded."""

    def _new_conn(self) -> socket.socket:
        call: _Call | None = getattr(_current, "call", None)
        if call is None:
            return super()._new_conn()
        host, timeout = self._dns_host, self.timeout
        try:
            found = socket.getaddrinfo(
                host.strip("[]"), self.port, urllib3.util.connection.allowed_gai_family(), socket.SOCK_STREAM
            )
        except socket.gaierror as err:
            raise urllib3.exceptions.NameResolutionError(self.host, self, err) from err
        failed: Exception | None = None
        try:
            for *_, address in found:
                left = call.deadline - time.monotonic()
                if left <= 0:  # the call's time is spent: a timeout, whatever an earlier address said
                    failed = None
                    break
                self._dns_host = str(address[0])  # one address: urllib3 connects to it alone
                self.timeout = min(left, timeout) if isinstance(timeout, (int, float)) else left
                try:
                    sock = super()._new_conn()
                except urllib3.exceptions.ConnectTimeoutError as err:  # NewConnectionError too: the next address
                    failed = err
                    continue
                _attach(self, sock)
                return sock
        finally:
            self._dns_host, self.timeout = host, timeout
        raise failed or urllib3.exceptions.ConnectTimeoutError(self, f"Connection to {self.host} timed out")

    def request(self, *args: Any, **kwargs: Any) -> None:
        if self.sock is not None:
            _attach(self, self.sock)
        super().request(*args, **kwargs)


class _DeadlineTLSConnection(_DeadlineConnection, urllib3.connection.HTTPSConnection):
    pass


class _DeadlinePool(urllib3.HTTPConnectionPool):
    """A pool whose connection, put back (urllib3 does so once a body is read, before the call ends), is first out of
    the current call's reach: its deadline cannot shut it under the next call to take it; one it already shut is
    closed, never reused."""

    ConnectionCls = _DeadlineConnection

    def _put_conn(self, conn: Any) -> None:
        call: _Call | None = getattr(_current, "call", None)
        if conn is not None and call is not None and call.release(conn):
            conn.close()
        super()._put_conn(conn)


class _DeadlineTLSPool(_DeadlinePool, urllib3.HTTPSConnectionPool):
    ConnectionCls = _DeadlineTLSConnection


class RestClient:
    """JSON calls to one API server (thread-safe: urllib3's pool is)."""

    def __init__(self, connection: Connection, timeout: float = TIMEOUT, max_bytes: int = MAX_BYTES) -> None:
        self.connection = connection
        self.timeout = timeout
        self.max_bytes = max_bytes
        self._token = connection.token
        self._token_stamp: tuple[int, int] | None = None
        self._token_lock = threading.Lock()
        split = urlsplit(connection.server)
        self._base = split.path.rstrip("/")
        kw: dict[str, Any] = {"maxsize": POOL_SIZE, "retries": False}
        if split.scheme == "https":
            try:
                kw["ssl_context"] = self._ssl_context()
            except (OSError, ssl.SSLError, ValueError) as err:
                raise ApiAccessError(f"TLS config for {connection.server}: {safe_text(str(err), 200)}") from None
            if connection.server_name:
                kw["server_hostname"] = connection.server_name
            if not connection.verify:  # asked for (insecure-skip-tls-verify): said once here, not on every call
                kw["assert_hostname"] = False
                warnings.filterwarnings("ignore", category=urllib3.exceptions.InsecureRequestWarning)
                log.warning(
                    "%s: the server's certificate is not verified (insecure-skip-tls-verify)", connection.server
                )
        url = urllib3.util.parse_url(f"{split.scheme}://{split.netloc}")
        https = split.scheme == "https"
        pool = _DeadlineTLSPool if https else _DeadlinePool
        self._pool: urllib3.HTTPConnectionPool = pool(url.host or "", port=url.port or (443 if https else 80), **kw)

    def _ssl_context(self) -> ssl.SSLContext:
        """The context every connection uses (urllib3 is given no file names): the `_data` fields from memory, a client
        certificate and key from data through files in a private directory, removed once loaded."""
        c = self.connection
        cadata: str | bytes | None = None
        if c.ca_data is not None:
            cadata = c.ca_data.decode() if c.ca_data.lstrip().startswith(b"-----") else c.ca_data  # PEM text, or DER
        context = ssl.create_default_context(cafile=c.ca_file, cadata=cadata)
        if not c.verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if c.cert_data is None and c.key_data is None:
            if c.cert_file:
                context.load_cert_chain(c.cert_file, c.key_file)
            return context
        with tempfile.TemporaryDirectory(prefix="gpu-share-tls-") as private:  # mode 0700, gone on leaving

            def place(data: bytes | None, path: str | None, name: str) -> str | None:
                if data is None:
                    return path
                path = os.path.join(private, name)
                with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                    f.write(data)
                return path

            cert = place(c.cert_data, c.cert_file, "cert.pem")
            if cert:
                context.load_cert_chain(cert, place(c.key_data, c.key_file, "key.pem"))
        return context

    def _bearer(self) -> str | None:
        path = self.connection.token_file
        if not path:
            return self._token
        with self._token_lock:
            try:
                st = os.stat(path)
                stamp = (st.st_ino, st.st_mtime_ns)
                if stamp != self._token_stamp:
                    with open(path, "rb") as f:
                        token = f.read(MAX_TOKEN + 2).strip().decode(errors="replace")  # +2: one line break, one over
                    fault = token_fault(token)
                    if fault:  # the file is read again on the next call, and it fails again until it is fixed
                        raise ApiError(0, "BadToken", f"token file {path}: not a usable bearer token: {fault}")
                    self._token, self._token_stamp = token, stamp
            except OSError:
                pass  # a token file mid-rotation: the last token read, and the API server says if it is no good
            return self._token

    # --- the calls -------------------------------------------------------------------------------
    def get(
        self,
        path: str,
        query: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        max_bytes: int | None = None,
    ) -> dict[str, Any]:
        return self.request("GET", path, query, timeout=timeout, max_bytes=max_bytes)

    def list(
        self,
        path: str,
        *,
        field_selector: str | None = None,
        label_selector: str | None = None,
        limit: int | None = None,
        continue_: str | None = None,
        resource_version: str | None = None,
        timeout: float | None = None,
        max_bytes: int | None = None,
    ) -> dict[str, Any]:
        """One page of a list (`metadata.continue` names the next one)."""
        query = {
            "fieldSelector": field_selector,
            "labelSelector": label_selector,
            "limit": limit,
            "continue": continue_,
            "resourceVersion": resource_version,
        }
        return self.get(path, query, timeout, max_bytes)

    def pages(self, path: str, *, limit: int, max_pages: int = MAX_PAGES, **kw: Any) -> Iterator[dict[str, Any]]:
        """Every page of a list, one at a time (each read bounded as one call); ResponseTooLarge naming `max_pages`
        when the server names a page past it."""
        token: str | None = None
        for _ in range(max_pages):
            page = self.list(path, limit=limit, continue_=token, **kw)
            yield page
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return
        raise ResponseTooLarge(f"list {path}: more than max_pages={max_pages} pages of {limit}")

    def create(self, path: str, body: Mapping[str, Any], timeout: float | None = None) -> dict[str, Any]:
        return self.request("POST", path, body=body, timeout=timeout)

    def replace(self, path: str, body: Mapping[str, Any], timeout: float | None = None) -> dict[str, Any]:
        return self.request("PUT", path, body=body, timeout=timeout)

    def patch(
        self,
        path: str,
        body: Any,
        kind: str = "merge",
        *,
        field_manager: str | None = None,
        force: bool = False,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """A patch of `kind` merge, strategic, apply (server-side apply: `field_manager` required) or json."""
        if kind not in PATCH_TYPES:
            raise ValueError(f"patch kind {kind!r}: one of {', '.join(PATCH_TYPES)}")
        query = {"fieldManager": field_manager, "force": "true" if force else None}
        return self.request("PATCH", path, query, body=body, content_type=PATCH_TYPES[kind], timeout=timeout)

    def delete(self, path: str, body: Mapping[str, Any] | None = None, timeout: float | None = None) -> dict[str, Any]:
        return self.request("DELETE", path, body=body, timeout=timeout)

    def watch(
        self,
        path: str,
        resource_version: str,
        *,
        field_selector: str | None = None,
        label_selector: str | None = None,
        seconds: int = 300,
        silence: float | None = None,
    ) -> Any:
        """The open watch response (read it with `kube.watch.watch_events`, then `release_conn()`), bookmarks on; the
        server ends it after `seconds`. Opening it (connect, the answer's headers, an error's body) is one call of the
        client's timeout; then a read of the stream waits at most `silence` seconds (default: the server's end, plus
        the timeout)."""
        query = {
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": seconds,
            "fieldSelector": field_selector,
            "labelSelector": label_selector,
        }
        read = silence if silence is not None else seconds + self.timeout
        response = None
        try:
            with _deadline(self.timeout, f"GET {path}"):
                response = self._open(
                    "GET", path, query, None, None, urllib3.Timeout(connect=self.timeout, read=read), self.timeout
                )
                self._raise_for_status(response, "GET", path, self.timeout)
        except ApiTimeout:
            if response is not None:  # opened, then the deadline passed: its socket is shut
                response.close()
                response.release_conn()
            raise
        return response

    def request(
        self,
        method: str,
        path: str,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: float | None = None,
        max_bytes: int | None = None,
    ) -> dict[str, Any]:
        """One call; its JSON answer (a 2xx's body; {} when empty). ApiError for any other answer, ApiTimeout past
        `timeout`, ResponseTooLarge over `max_bytes`."""
        budget = self.timeout if timeout is None else timeout
        what = f"{method} {path}"
        with _deadline(budget, what):
            response = self._open(method, path, query, body, content_type, urllib3.Timeout(total=budget), budget)
            try:
                self._raise_for_status(response, method, path, budget)
                data = self._read(response, self.max_bytes if max_bytes is None else max_bytes, budget, what)
            except BaseException:
                response.close()  # a body left unread: the connection is not reused
                raise
            finally:
                response.release_conn()
        if not data.strip():
            return {}
        try:
            found = json.loads(data)
        except ValueError as err:
            raise ApiError(response.status, "BadResponse", f"{what}: not JSON: {err}") from None
        if not isinstance(found, dict):
            raise ApiError(response.status, "BadResponse", f"{what}: not a JSON object")
        return found

    # --- the wire --------------------------------------------------------------------------------
    def _open(
        self,
        method: str,
        path: str,
        query: Mapping[str, Any] | None,
        body: Any,
        content_type: str | None,
        timeout: urllib3.Timeout,
        budget: float,
    ) -> Any:
        params = {k: v for k, v in (query or {}).items() if v is not None and v != ""}
        url = self._base + path + (f"?{urlencode(params)}" if params else "")
        headers = {"Accept": "application/json", "User-Agent": "gpu-share"}
        token = self._bearer()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        payload = None
        if body is not None:
            payload = body if isinstance(body, (bytes, str)) else json.dumps(body)
            headers["Content-Type"] = content_type or "application/json"
        try:
            return self._pool.urlopen(
                method,
                url,
                body=payload,
                headers=headers,
                timeout=timeout,
                retries=False,
                redirect=False,
                preload_content=False,
            )
        except urllib3.exceptions.NewConnectionError as err:  # refused, unresolvable: a urllib3 TimeoutError, not one
            raise ApiError(0, "ConnectionError", f"{method} {path}: {safe_text(str(err), 200)}") from None
        except (urllib3.exceptions.TimeoutError, TimeoutError):
            raise ApiTimeout(f"{method} {path}", budget) from None
        except urllib3.exceptions.HTTPError as err:
            raise ApiError(0, "ConnectionError", f"{method} {path}: {safe_text(str(err), 200)}") from None

    def _raise_for_status(self, response: Any, method: str, path: str, budget: float) -> None:
        if 200 <= response.status <= 299:
            return
        try:
            data = self._read(response, MAX_ERROR_BYTES, budget, f"{method} {path}", truncate=True)
        finally:
            response.close()  # the rest of a long error body is not read: the connection is not reused
            response.release_conn()
        reason, message = response.reason or "", data.decode(errors="replace")
        try:
            status = json.loads(data)
            if isinstance(status, dict) and status.get("kind") == "Status":
                reason, message = str(status.get("reason") or reason), str(status.get("message") or "")
        except ValueError:
            pass
        raise ApiError(response.status, reason, safe_text(message, 300))

    @staticmethod
    def _read(response: Any, max_bytes: int, budget: float, what: str, truncate: bool = False) -> bytes:
        """The body up to `max_bytes` (the call's deadline bounds the reads: `_deadline`)."""
        parts: list[bytes] = []
        size = 0
        try:
            while True:
                chunk = response.read1(min(CHUNK, max_bytes + 1 - size), decode_content=True)
                if not chunk:
                    return b"".join(parts)
                parts.append(chunk)
                size += len(chunk)
                if size > max_bytes:
                    if truncate:
                        return b"".join(parts)[:max_bytes]
                    raise ResponseTooLarge(f"{what}: response over {max_bytes} bytes")
        except (urllib3.exceptions.TimeoutError, TimeoutError):
            raise ApiTimeout(what, budget) from None
        except (urllib3.exceptions.HTTPError, OSError) as err:
            raise ApiError(0, "ConnectionError", f"{what}: {safe_text(str(err), 200)}") from None
