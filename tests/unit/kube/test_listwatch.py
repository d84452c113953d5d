"""The one list-then-watch loop against a fake API server over real HTTP (`tests.support.fake_kube.FakeCluster`):
every page listed, events applied, a dropped stream and 410 Gone listed again, a silent stream not trusted, a
relist after every stream when asked, a clean stop. The byte bound of a list page: `tests/e2e/test_rest.py`."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.kube.listwatch import ListWatch
from deviceplugin.kube.rest import RestClient, load_kubeconfig
from tests.support.fake_kube import FakeCluster


def wait_until(check: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return bool(check())


class Nodes(ListWatch):
    """Node names, as listed and watched."""

    def __init__(self, api: RestClient, **kw: Any) -> None:
        kw = {"backoff_initial": 0.05, "backoff_max": 0.2, "watch_seconds": 2, **kw}
        super().__init__(
            "test-nodes",
            "nodes",
            api,
            "/api/v1/nodes",
            page=500,
            max_page_bytes=1 << 20,
            max_event_bytes=1 << 20,
            request_timeout=5.0,
            **kw,
        )
        self.names: set[str] = set()
        self.lists = 0
        self.restarts = 0
        self.current_at_restart: list[bool] = []  # current() as each restart begins

    def _listed(self, kept: list[dict[str, Any]]) -> None:
        self.lists += 1
        self.names = {o["metadata"]["name"] for o in kept}

    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        (self.names.discard if kind == "DELETED" else self.names.add)(name)

    def _restarting(self) -> None:
        self.current_at_restart.append(self.current())
        self.restarts += 1


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[FakeCluster, RestClient]]:
    fake = FakeCluster(page=2).start()
    yield fake, RestClient(load_kubeconfig(fake.write_kubeconfig(tmp_path / "kubeconfig")))
    fake.stop()


def _node(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name}}


def test_every_page_then_events_and_a_dropped_stream_lists_again(cluster: Any, caplog: Any) -> None:
    fake, api = cluster
    for i in range(5):  # three pages of two
        fake.put("nodes", _node(f"n{i}"))
    watch = Nodes(api)
    watch.start()
    try:
        assert wait_until(lambda: watch.synced.is_set() and watch.current())
        assert watch.names == {f"n{i}" for i in range(5)} and fake.lists == 3
        fake.put("nodes", _node("added"))
        fake.delete("nodes", "n0")
        assert wait_until(lambda: "added" in watch.names and "n0" not in watch.names)
        fake.drop_watches()  # cut mid-stream: a failure, listed again after the back-off
        fake.put("nodes", _node("after-drop"))
        assert wait_until(lambda: "after-drop" in watch.names and watch.restarts >= 1)
        assert "nodes watch failed (" in caplog.text
    finally:
        watch.stop()
    assert not watch.running


def test_410_gone_lists_again_at_once(cluster: Any, caplog: Any) -> None:
    fake, api = cluster
    fake.put("nodes", _node("n0"))
    fake.put("nodes", _node("n1"))
    watch = Nodes(api, watch_seconds=1)
    with caplog.at_level(logging.INFO, logger="deviceplugin.kube.listwatch"):
        watch.start()
        try:
            assert wait_until(lambda: watch.lists == 1 and watch.streams >= 1)
            fake.delete("nodes", "n1")
            assert wait_until(lambda: "n1" not in watch.names)
            fake.put("pods", {"metadata": {"name": "p", "uid": "p"}})  # a version the nodes watch never sees
            fake.compact()  # so the stream's clean end resumes from a version now too old: 410 Gone
            assert wait_until(lambda: "nodes watch: resourceVersion expired, listing again" in caplog.text)
            assert wait_until(lambda: watch.lists == 2 and watch.current())
            assert watch.restarts == 1 and "watch failed" not in caplog.text
        finally:
            watch.stop()


def test_a_silent_stream_is_not_current_and_lists_again(cluster: Any, caplog: Any) -> None:
    fake, api = cluster
    fake.put("nodes", _node("n0"))
    watch = Nodes(api, silence=0.5, watch_seconds=30)  # no event, no bookmark: the fake sends none
    with caplog.at_level(logging.INFO, logger="deviceplugin.kube.listwatch"):
        watch.start()
        try:
            assert wait_until(watch.current)
            assert wait_until(lambda: watch.lists >= 2 and watch.current())
            assert watch.current_at_restart and not any(watch.current_at_restart)  # silent: not current, then relisted
            assert "nodes watch silent for 0s (no event or bookmark); listing again" in caplog.text
            assert "watch failed" not in caplog.text  # silence is not a failure
        finally:
            watch.stop()


def test_one_page_and_a_list_after_every_stream(cluster: Any) -> None:
    fake, api = cluster
    for i in range(5):
        fake.put("nodes", _node(f"n{i}"))
    watch = Nodes(api, resume=False, list_pages=1, watch_seconds=1)
    watch.start()
    try:
        assert wait_until(lambda: watch.lists >= 1)
        assert watch.names == {"n0", "n1"}  # the first page only
        assert wait_until(lambda: watch.lists >= 2 and watch.streams >= 2, timeout=5)  # each clean end lists again
        assert watch.restarts == 0  # a clean end is no restart
    finally:
        watch.stop()


def test_a_stop_ends_a_blocked_watch_at_once_and_without_a_warning(cluster: Any, caplog: Any) -> None:
    _, api = cluster
    watch = Nodes(api, watch_seconds=300)
    watch.start()
    assert wait_until(lambda: watch.streams == 1)
    started = time.monotonic()
    watch.stop()
    assert time.monotonic() - started < 2.0 and not watch.running
    assert "watch failed" not in caplog.text


def test_no_api_is_a_failure_retried_never_a_crash(caplog: Any) -> None:
    watch = ListWatch(
        "test-none",
        "nothing",
        None,
        "/x",
        page=1,
        max_page_bytes=1,
        max_event_bytes=1,
        request_timeout=1.0,
        backoff_initial=0.01,
        backoff_max=0.02,
    )
    watch.start()
    try:
        assert wait_until(lambda: "no Kubernetes API configured" in watch.last_error)
        assert watch.running and not watch.synced.is_set()
    finally:
        watch.stop()
