"""A minimal Kubernetes REST client for the node daemons (the DRA driver, `gpu-share run`): JSON in and out as plain
dicts over urllib3, without the `kubernetes` package (45.7 MiB and ~0.4 s to import).

Connection: in-cluster (`KUBERNETES_SERVICE_HOST`/`_PORT`, the service account's CA, and its token file, read again
when it changes: projected tokens rotate) or a kubeconfig file's current context: `server`, `certificate-authority`
(`-data`), `insecure-skip-tls-verify`, and a user's `token`, `tokenFile`, `client-certificate(-data)` and
`client-key(-data)`. Any other user field (an exec or auth-provider plugin, a username) is an ApiAccessError naming it.

Every call: no retries (urllib3's are off), one `timeout` for the whole call (connect and the wait for the headers
share it, and the body is read against the same deadline), a body read up to `max_bytes` (ResponseTooLarge above),
and any non-2xx answer an ApiError carrying the status and the Kubernetes Status message. A watch returns the open
response, for `kube.watch.watch_events` to read bounded.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import ssl
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
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
    """Where the API server is and how to sign in. `token_file` is read on each call whose file changed."""

    server: str
    ca_file: str | None = None
    verify: bool = True
    server_name: str | None = None
    token: str | None = None
    token_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None


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
    server = cluster.get("server")
    if not isinstance(server, str) or urlsplit(server).scheme not in ("https", "http"):
        raise ApiAccessError(f"kubeconfig {where}: cluster.server must be an https:// URL, not {server!r}")

    def file_of(key: str, holder: Mapping[str, Any]) -> str | None:
        data, file = holder.get(f"{key}-data"), holder.get(key)
        if data:
            return _private_file(base64.b64decode(str(data)), key)
        return str(base / file) if file else None

    token_file = user.get("tokenFile")
    return Connection(
        server=server.rstrip("/"),
        ca_file=file_of("certificate-authority", cluster),
        verify=not cluster.get("insecure-skip-tls-verify", False),
        server_name=cluster.get("tls-server-name"),
        token=user.get("token"),
        token_file=str(base / token_file) if token_file else None,
        cert_file=file_of("client-certificate", user),
        key_file=file_of("client-key", user),
    )


def _named(doc: Mapping[str, Any], section: str, key: str, name: Any, where: str) -> Mapping[str, Any]:
    for entry in doc.get(section) or ():
        if isinstance(entry, dict) and entry.get("name") == name:
            value = entry.get(key) or {}
            if not isinstance(value, dict):
                raise ApiAccessError(f"kubeconfig {where}: {section} {name!r}: {key} is not a mapping")
            return value
    raise ApiAccessError(f"kubeconfig {where}: no {section} entry named {name!r}")


def _private_file(data: bytes, what: str) -> str:
    """`data` in a file only this user reads (ssl loads certificates and keys from files), removed at exit."""
    import atexit

    fd, path = tempfile.mkstemp(prefix=f"gpu-share-{what}-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    atexit.register(lambda: Path(path).unlink(missing_ok=True))
    return path


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
            except (OSError, ssl.SSLError) as err:
                raise ApiAccessError(f"TLS config for {connection.server}: {err}") from None
            if connection.server_name:
                kw["server_hostname"] = connection.server_name
            if not connection.verify:  # asked for (insecure-skip-tls-verify): said once here, not on every call
                kw["assert_hostname"] = False
                warnings.filterwarnings("ignore", category=urllib3.exceptions.InsecureRequestWarning)
                log.warning(
                    "%s: the server's certificate is not verified (insecure-skip-tls-verify)", connection.server
                )
        self._pool = urllib3.connection_from_url(f"{split.scheme}://{split.netloc}", **kw)

    def _ssl_context(self) -> ssl.SSLContext:
        c = self.connection
        context = ssl.create_default_context(cafile=c.ca_file)
        if not c.verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if c.cert_file:
            context.load_cert_chain(c.cert_file, c.key_file)
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
                    self._token, self._token_stamp = Path(path).read_text().strip(), stamp
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

    def pages(self, path: str, *, limit: int, **kw: Any) -> Iterator[dict[str, Any]]:
        """Every page of a list, one at a time (each read bounded as one call)."""
        token: str | None = None
        while True:
            page = self.list(path, limit=limit, continue_=token, **kw)
            yield page
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return

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
        server ends it after `seconds`. A read waits at most `silence` seconds (default: the server's end, plus the
        timeout), connecting at most the client's timeout."""
        query = {
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": seconds,
            "fieldSelector": field_selector,
            "labelSelector": label_selector,
        }
        read = silence if silence is not None else seconds + self.timeout
        response = self._open(
            "GET", path, query, None, None, urllib3.Timeout(connect=self.timeout, read=read), self.timeout
        )
        self._raise_for_status(response, "GET", path, time.monotonic() + self.timeout, self.timeout)
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
        deadline = time.monotonic() + budget
        response = self._open(method, path, query, body, content_type, urllib3.Timeout(total=budget), budget)
        try:
            self._raise_for_status(response, method, path, deadline, budget)
            data = self._read(
                response, self.max_bytes if max_bytes is None else max_bytes, deadline, budget, f"{method} {path}"
            )
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
            raise ApiError(response.status, "BadResponse", f"{method} {path}: not JSON: {err}") from None
        if not isinstance(found, dict):
            raise ApiError(response.status, "BadResponse", f"{method} {path}: not a JSON object")
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
        except (urllib3.exceptions.TimeoutError, TimeoutError):
            raise ApiTimeout(f"{method} {path}", budget) from None
        except urllib3.exceptions.HTTPError as err:
            raise ApiError(0, "ConnectionError", f"{method} {path}: {safe_text(str(err), 200)}") from None

    def _raise_for_status(self, response: Any, method: str, path: str, deadline: float, budget: float) -> None:
        if 200 <= response.status <= 299:
            return
        try:
            data = self._read(response, MAX_ERROR_BYTES, deadline, budget, f"{method} {path}", truncate=True)
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
    def _read(
        response: Any, max_bytes: int, deadline: float, budget: float, what: str, truncate: bool = False
    ) -> bytes:
        """The body up to `max_bytes`, each read waiting at most for what is left of the call's time."""
        parts: list[bytes] = []
        size = 0
        sock = getattr(response.connection, "sock", None)
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ApiTimeout(what, budget)
                if sock is not None:
                    sock.settimeout(left)
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
