"""A tiny Kubernetes API server over real HTTP on loopback: one Node (get, patch), Events (create) and a pod LIST.

Enough for the `kubernetes` client to read labels, patch labels/annotations, post Events and list the node's
pods, so the plugin's API paths run for real in tests. `pod_queries` keeps the query parameters of every pod LIST.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class JsonHandler(BaseHTTPRequestHandler):
    """A quiet handler that answers JSON: what both fake API servers share."""

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class FakeKube:
    def __init__(self, node_name: str = "gpu-node-1", labels: dict[str, str] | None = None) -> None:
        self.node_name = node_name
        self.labels: dict[str, str] = dict(labels or {})
        self.annotations: dict[str, str] = {}
        self.patches: list[dict] = []
        self.events: list[dict] = []
        self.pods: list[dict] = []  # V1Pod JSON bodies, each with spec.nodeName
        self.pod_queries: list[dict[str, list[str]]] = []
        self.requests = 0
        self.fail_with: int | None = None  # answer every request with this status
        self.delay = 0.0  # seconds every request hangs before it is answered (a slow API server)
        self.in_flight = 0  # requests being answered now
        self.lock = threading.Lock()
        fake = self

        class Handler(JsonHandler):
            def _body(self) -> dict:
                return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")

            def _route(self, method: str) -> None:
                with fake.lock:
                    fake.in_flight += 1
                try:
                    time.sleep(fake.delay)
                    self._answer(method)
                finally:
                    with fake.lock:
                        fake.in_flight -= 1

            def _answer(self, method: str) -> None:
                with fake.lock:
                    fake.requests += 1
                    if fake.fail_with:
                        return self._send(
                            fake.fail_with, {"kind": "Status", "code": fake.fail_with, "message": "forbidden"}
                        )
                    node_path = f"/api/v1/nodes/{fake.node_name}"
                    if self.path.split("?")[0] == node_path and method == "GET":
                        return self._send(200, fake.node())
                    if self.path.split("?")[0] == node_path and method == "PATCH":
                        patch = self._body()
                        fake.patches.append(patch)
                        meta = patch.get("metadata", {})
                        for store, key in ((fake.labels, "labels"), (fake.annotations, "annotations")):
                            for k, v in (meta.get(key) or {}).items():
                                if v is None:
                                    store.pop(k, None)
                                else:
                                    store[k] = v
                        return self._send(200, fake.node())
                    path, _, query = self.path.partition("?")
                    if path == "/api/v1/pods" and method == "GET":
                        params = urllib.parse.parse_qs(query)
                        fake.pod_queries.append(params)
                        return self._send(200, fake.pod_list(params.get("fieldSelector", [""])[0]))
                    if (
                        self.path.startswith("/api/v1/namespaces/")
                        and self.path.split("?")[0].endswith("/events")
                        and method == "POST"
                    ):
                        event = self._body()
                        fake.events.append(event)
                        return self._send(201, event)
                    return self._send(
                        404, {"kind": "Status", "code": 404, "message": f"{method} {self.path} not found"}
                    )

            def do_GET(self) -> None:
                self._route("GET")

            def do_PATCH(self) -> None:
                self._route("PATCH")

            def do_POST(self) -> None:
                self._route("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def node(self) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.node_name,
                "labels": dict(self.labels),
                "annotations": dict(self.annotations),
                "resourceVersion": "1",
            },
        }

    def pod_list(self, field_selector: str) -> dict:
        """Pods matching a `spec.nodeName=<node>` selector (the only selector the plugin sends)."""
        wanted = dict(part.split("=", 1) for part in field_selector.split(",") if "=" in part)
        items = [
            p for p in self.pods if "spec.nodeName" not in wanted or p["spec"]["nodeName"] == wanted["spec.nodeName"]
        ]
        return {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "7"}, "items": items}

    def write_kubeconfig(self, path: Path) -> Path:
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "users": [{"name": "fake", "user": {"token": "test"}}],
                    "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                    "current-context": "fake",
                }
            )
        )
        return path

    def start(self) -> FakeKube:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class FakeCluster:
    """A fake API server over real HTTP for the scheduler extender: Nodes and Pods, listed (paged) and watched.

    `put`/`delete` record events; `drop_watches()` cuts every open watch mid-stream (the connection closes
    without the server's usual end); `compact()` forgets old events, so a watch from before answers 410 Gone.
    """

    def __init__(self, page: int = 2) -> None:
        self.page = page
        self.objects: dict[str, dict[str, dict]] = {"nodes": {}, "pods": {}}
        self.events: list[tuple[int, str, str, dict]] = []  # (resourceVersion, kind, type, object)
        self.version = 1
        self.oldest = 0  # events before this resourceVersion are forgotten
        self.watches = 0  # watch requests served
        self.lists = 0
        self.cond = threading.Condition()
        self.generation = 0  # bumped by drop_watches()
        fake = self

        class Handler(JsonHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                path, _, query = self.path.partition("?")
                params = dict(p.split("=", 1) for p in query.split("&") if "=" in p)
                kind = {"/api/v1/nodes": "nodes", "/api/v1/pods": "pods"}.get(path)
                if kind is None:
                    return self._send(404, {"kind": "Status", "code": 404, "message": f"GET {path} not found"})
                if params.get("watch") in ("true", "1", "True"):
                    return self._watch(
                        kind, int(params.get("resourceVersion") or 0), float(params.get("timeoutSeconds", 300))
                    )
                with fake.cond:
                    fake.lists += 1
                    names = sorted(fake.objects[kind])
                    start = int(params.get("continue", 0) or 0)
                    chunk = names[start : start + fake.page] if "limit" in params else names[start:]
                    rest = start + len(chunk) < len(names)
                    self._send(
                        200,
                        {
                            "kind": "List",
                            "metadata": {
                                "resourceVersion": str(fake.version),
                                "continue": str(start + len(chunk)) if rest else "",
                            },
                            "items": [fake.objects[kind][n] for n in chunk],
                        },
                    )

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def _watch(self, kind: str, since: int, timeout: float) -> None:
                """Events as the API server streams them: chunked JSON lines; a drop ends without the last chunk."""
                with fake.cond:
                    fake.watches += 1
                    generation = fake.generation
                    gone = since < fake.oldest
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()  # kept alive after a clean end, as kube-apiserver (Go's net/http) keeps it
                if gone:
                    line = {
                        "type": "ERROR",
                        "object": {
                            "kind": "Status",
                            "code": 410,
                            "reason": "Expired",
                            "message": "too old resource version",
                        },
                    }
                    self._chunk(json.dumps(line).encode() + b"\n")
                    self._chunk(b"")
                    return
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    with fake.cond:
                        fake.cond.wait_for(
                            lambda since=since: fake.generation != generation or fake.version > since, timeout=0.05
                        )
                        if fake.generation != generation:
                            self.close_connection = True
                            self.connection.shutdown(socket.SHUT_RDWR)  # dropped mid-stream
                            return
                        new = [e for e in fake.events if e[0] > since and e[1] == kind]
                        since = max(since, fake.version)
                    for _, _, event, obj in new:
                        self._chunk(json.dumps({"type": event, "object": obj}).encode() + b"\n")
                self._chunk(b"")  # the server's watch timeout: a clean end

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    url = FakeKube.url
    write_kubeconfig = FakeKube.write_kubeconfig

    def put(self, kind: str, obj: dict) -> None:
        with self.cond:
            self.version += 1
            name = obj["metadata"].get("uid") if kind == "pods" else obj["metadata"]["name"]
            event = "MODIFIED" if name in self.objects[kind] else "ADDED"
            obj = json.loads(json.dumps(obj))
            obj["metadata"]["resourceVersion"] = str(self.version)
            self.objects[kind][name] = obj
            self.events.append((self.version, kind, event, obj))
            self.cond.notify_all()

    def delete(self, kind: str, name: str) -> None:
        with self.cond:
            self.version += 1
            obj = self.objects[kind].pop(name)
            self.events.append((self.version, kind, "DELETED", obj))
            self.cond.notify_all()

    def drop_watches(self) -> None:
        with self.cond:
            self.generation += 1
            self.cond.notify_all()

    def compact(self) -> None:
        with self.cond:
            self.oldest = self.version
            self.events.clear()

    def start(self) -> FakeCluster:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.drop_watches()
        self.server.shutdown()
        self.server.server_close()
