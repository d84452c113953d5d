"""Hot reload cannot die: a failing round is counted and the next valid change applies; the file is read only when
it changed and applied only once it has settled; a missing file or a symlink loop is named as such."""

from __future__ import annotations

import threading

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from deviceplugin.config.parse import load_config
from deviceplugin.obs.metrics import MetricSources, StateCollector
from deviceplugin.runtime.plan import ProfileSource
from deviceplugin.runtime.reload import ConfigReloader
from tests.support.clock import ManualClock

from .conftest import node, registered

RESOURCE = "example.com/gpu-share"
T4 = node("2xT4")


def write(path, replicas: int) -> None:
    path.write_text(yaml.safe_dump({"version": "v1", "pools": [{"name": "s", "mode": "shared", "replicas": replicas}]}))


class FlakyProfiles(ProfileSource):
    """The node's profile source, failing while `broken` is set (as a Kubernetes client bug would)."""

    broken = False

    def current(self, config):
        if self.broken:
            raise RuntimeError("injected: the label lookup blew up")
        return super().current(config)


class Watched(ConfigReloader):
    """A reloader whose rounds the test waits for: each one that ends wakes `wait_for`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._rounds = threading.Condition()

    def check(self) -> bool:
        try:
            return super().check()
        finally:
            with self._rounds:
                self._rounds.notify_all()

    def wait_for(self, predicate, timeout: float = 5.0) -> bool:
        """Block until `predicate()` holds after a round (or before any); False on timeout."""
        with self._rounds:
            return self._rounds.wait_for(predicate, timeout)


def _started(path, kubelet, start_plugin, profiles: ProfileSource, interval: float, clock=None) -> Watched:
    write(path, 2)
    manager = start_plugin(load_config(path))
    assert kubelet.wait_for(registered(RESOURCE), timeout=10)
    reloader = Watched(str(path), T4, profiles, interval, [manager], clock=clock or ManualClock())
    reloader.start(load_config(path))
    return reloader


@pytest.fixture
def served(tmp_path, kubelet, start_plugin):
    """(config path, started reloader, manager) for 2 shares per GPU on the 2xT4 node; rounds on the reloader's
    thread, every 20 ms."""
    reloader = _started(tmp_path / "config.yaml", kubelet, start_plugin, FlakyProfiles(None, None), interval=0.02)
    yield tmp_path / "config.yaml", reloader, reloader.consumers[0]
    reloader.stop()


@pytest.fixture
def by_hand(tmp_path, kubelet, start_plugin):
    """Like `served`, with an interval so long that rounds run only when the test calls check()."""
    reloader = _started(tmp_path / "config.yaml", kubelet, start_plugin, ProfileSource(None, None), interval=3600)
    yield tmp_path / "config.yaml", reloader
    reloader.stop()


def gauge(reloader, manager, sample: str) -> float:
    """The value of one sample (`name` or `name{labels}`) as the metrics endpoint renders it."""
    registry = CollectorRegistry()
    registry.register(StateCollector(MetricSources(T4, manager.state, manager, reloader=reloader)))
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{sample} not exposed")


def test_reloader_survives_an_injected_exception_and_applies_the_next_change(served, kubelet, caplog):
    path, reloader, manager = served
    reloader.profiles.broken = True
    write(path, 3)
    assert reloader.wait_for(lambda: reloader.errors >= 3)  # every round fails while the label lookup does
    assert gauge(reloader, manager, 'gpushare_config_reloads_total{result="error"}') >= 3
    assert gauge(reloader, manager, "gpushare_config_in_sync") == 0
    assert kubelet.resources()[RESOURCE].capacity == 4  # the last good config keeps serving
    failures = [r.getMessage() for r in caplog.records if "config reload failed" in r.getMessage()]
    assert failures == [
        "config reload failed, still serving the last good config: RuntimeError: injected: the label lookup blew up"
    ]  # repeats summarised
    reloader.profiles.broken = False
    write(path, 5)
    assert kubelet.wait_for(lambda st: st[RESOURCE].capacity == 10 and st[RESOURCE].registered, timeout=5)
    assert reloader.wait_for(lambda: reloader.reloads == 1 and reloader.in_sync)
    errors = reloader.errors
    assert (
        not reloader.check() and reloader.errors == errors and gauge(reloader, manager, "gpushare_config_in_sync") == 1
    )


def test_repeated_failures_are_summarised_once_per_interval_of_the_reloaders_clock(
    tmp_path, kubelet, start_plugin, caplog
):
    clock, profiles = ManualClock(), FlakyProfiles(None, None)
    reloader = _started(tmp_path / "config.yaml", kubelet, start_plugin, profiles, interval=3600, clock=clock)
    try:
        profiles.broken = True
        for _ in range(3):
            assert not reloader.check()
        clock.advance(3599)  # the summary window: the reload interval, at least a minute
        assert not reloader.check()
        failed = (
            "config reload failed, still serving the last good config: RuntimeError: injected: the label lookup blew up"
        )
        assert [r.getMessage() for r in caplog.records if "config reload failed" in r.getMessage()] == [failed]
        clock.advance(1)
        assert not reloader.check() and reloader.errors == 5
        assert [r.getMessage() for r in caplog.records if "config reload failed" in r.getMessage()] == [
            failed,
            f"{failed} (repeated 3 times in 3600s)",
            failed,
        ]
    finally:
        reloader.stop()


def test_unchanged_file_is_neither_read_nor_parsed_again(by_hand):
    path, reloader = by_hand
    for _ in range(50):
        assert not reloader.check()
    assert (reloader.reads, reloader.parses) == (1, 0)
    path.write_text(path.read_text())  # same content, new mtime: read, hashed, not parsed
    for _ in range(3):
        assert not reloader.check()
    assert (reloader.reads, reloader.parses, reloader.reloads) == (2, 0, 0) and reloader.in_sync


def test_a_change_is_applied_only_once_it_has_settled(by_hand, kubelet):
    path, reloader = by_hand
    write(path, 3)
    assert not reloader.check() and not reloader.in_sync  # seen once: wait one interval
    assert kubelet.resources()[RESOURCE].capacity == 4 and reloader.parses == 0
    assert reloader.check()
    assert kubelet.wait_for(lambda st: st[RESOURCE].capacity == 6, timeout=5) and reloader.in_sync
    # A write caught half-way (valid YAML, one pool fewer) is not applied when the rest follows in the next interval.
    path.write_text("version: v1\npools: [{name: s, mode: exclusive}]\n")
    assert not reloader.check()
    write(path, 4)
    assert not reloader.check()
    assert reloader.check() and reloader.parses == 2
    assert kubelet.wait_for(lambda st: st[RESOURCE].capacity == 8, timeout=5)
    assert "example.com/gpu" not in kubelet.resources()


@pytest.mark.parametrize(
    "break_it, cause",
    [
        (lambda target, link: target.unlink(), "file: cannot read: no such file (deleted, or not mounted)"),
        (
            lambda target, link: (link.unlink(), link.symlink_to(link)),
            "file: cannot read: symlink loop (too many levels of symbolic links)",
        ),
        (
            lambda target, link: target.write_text("pools: " + "{a: " * 5000),
            "line 1, column 129: nested deeper than 32 levels",
        ),
    ],
)
def test_a_broken_file_names_its_cause_and_keeps_serving(tmp_path, kubelet, start_plugin, caplog, break_it, cause):
    target = tmp_path / "real.yaml"
    write(target, 2)
    link = tmp_path / "config.yaml"  # a ConfigMap mount is a symlink to the real file
    link.symlink_to(target)
    manager = start_plugin(load_config(link))
    assert kubelet.wait_for(registered(RESOURCE), timeout=10)
    reloader = ConfigReloader(str(link), T4, ProfileSource(None, None), 3600, [manager])
    reloader.start(load_config(link))
    try:
        break_it(target, link)
        assert not reloader.check() and not reloader.check()  # seen; then, settled, refused
        assert reloader.errors == 1 and not reloader.in_sync
        assert f"config change rejected, still serving the last good config: {link}: {cause}" in caplog.text
        assert "not valid YAML" not in caplog.text
        if link.is_symlink() and link.readlink() == link:
            link.unlink()
            link.symlink_to(target)
        write(target, 3)
        assert not reloader.check() and reloader.check()
        assert kubelet.wait_for(lambda st: st[RESOURCE].capacity == 6 and st[RESOURCE].registered, timeout=5)
        assert reloader.in_sync and reloader.errors == 1
    finally:
        reloader.stop()


class Recorder:
    """A reload consumer that keeps the replicas and resource names it was given, or fails while `fail` is set."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.seen: list[tuple[int, list[str]]] = []

    def on_config(self, config, resources) -> None:
        if self.fail:
            raise RuntimeError("injected: a consumer failed")
        self.seen.append((resources[0].units[0].replicas, [r.name for r in resources]))


def test_a_reload_reaches_the_consumers_in_order_and_a_failing_one_fails_the_round(tmp_path, kubelet, start_plugin):
    path = tmp_path / "config.yaml"
    write(path, 2)
    manager = start_plugin(load_config(path))
    assert kubelet.wait_for(registered(RESOURCE), timeout=10)
    first, failing, last = Recorder(), Recorder(fail=True), Recorder()
    reloader = ConfigReloader(str(path), T4, ProfileSource(None, None), 3600, [manager, first, failing, last])
    reloader.start(load_config(path))
    try:
        write(path, 3)
        assert not reloader.check() and not reloader.check()  # seen; then applied up to the failing consumer
        assert first.seen == [(3, [RESOURCE])] and last.seen == [] and reloader.errors == 1 and not reloader.in_sync
        assert kubelet.wait_for(lambda st: st[RESOURCE].allocatable == 6, timeout=5)  # the manager, first, served it
        failing.fail = False
        write(path, 4)
        assert not reloader.check() and reloader.check()
        assert first.seen[-1] == last.seen[-1] == (4, [RESOURCE]) and reloader.in_sync and reloader.reloads == 1
    finally:
        reloader.stop()
