"""dra.claimstatus: what status.devices[].data holds, and that the writes are bounded: a queue of at most MAX_QUEUED
claims (the oldest dropped and counted), at most MAX_ATTEMPTS attempts per claim with a backoff capped at
BACKOFF_MAX, a claim given up logged and counted; `post` never blocks or raises, so a prepare never waits on the API.
The API here is a real `kube.rest` client against a port nothing listens on (every attempt: connection refused).
The writes that reach a real API server are in tests/e2e (test_dra_manifests.py, test_dra_node.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from deviceplugin.dra import claimstatus
from deviceplugin.dra.checkpoint import PreparedClaim, PreparedDevice
from deviceplugin.dra.claimstatus import BACKOFF_MAX, MAX_ATTEMPTS, ClaimStatusWriter, device_status
from deviceplugin.obs.drametrics import STATUS_RESULTS, DraMetrics
from tests.conftest import free_port, node
from tests.support.clock import ManualClock
from tests.support.dra import DRIVER, make_driver

T4 = node("2xT4")


def _claim(name: str = "c", device: str = "gpu-1", shares: int = 3) -> PreparedClaim:
    return PreparedClaim(
        f"uid-{name}",
        "ns",
        name,
        (PreparedDevice("gpu", "2xT4", device, ("cdi",), "share-1", shares, shares * 3840),),
        "",
    )


def _nowhere() -> Any:
    from deviceplugin.kube.rest import Connection, RestClient

    return RestClient(
        Connection(f"http://127.0.0.1:{free_port()}")
    )  # nothing listens: every request is refused at once


def _counts(registry: CollectorRegistry) -> dict[str, float]:
    return {
        r: registry.get_sample_value("gpushare_dra_claim_status_writes_total", {"result": r}) or 0.0
        for r in STATUS_RESULTS
    }


def test_the_data_names_the_unit_its_shares_and_memory_limit_of_this_drivers_devices(tmp_path: Path) -> None:
    driver = make_driver(tmp_path)
    devices = {d.name: d for d in driver.devices}
    gone = PreparedDevice("gpu", "2xT4", "gpu-9", (), None, 1, 100)  # a device a reload removed: no entry
    claim = PreparedClaim("u", "ns", "c", (*_claim().devices, gone), "")
    assert device_status(claim, devices, DRIVER) == [
        {
            "driver": DRIVER,
            "pool": "2xT4",
            "device": "gpu-1",
            "shareID": "share-1",
            "data": {
                "version": 1,
                "uuid": T4.gpus[1].uuid,
                "gpu": 1,
                "shares": 3,
                "totalShares": 4,
                "memoryLimitMiB": 11520,
            },
        }
    ]


def test_a_failing_write_is_retried_with_a_capped_backoff_then_given_up_logged_and_counted(
    tmp_path: Path, caplog: Any
) -> None:
    registry = CollectorRegistry()
    clock = ManualClock()
    writer = ClaimStatusWriter(_nowhere(), make_driver(tmp_path), DraMetrics(registry), clock=clock)
    writer.post([_claim()])
    waits = []
    for _ in range(MAX_ATTEMPTS):
        assert writer.write_due() == 0.0  # one attempt made
        wait = writer.write_due()
        waits.append(wait)
        clock.advance(wait)
    assert waits[:-1] == [0.5, 1.0, 2.0, 4.0] and all(w <= BACKOFF_MAX for w in waits[:-1])
    assert waits[-1] == claimstatus.IDLE_WAIT and writer.queued == 0  # given up after the last attempt
    assert _counts(registry) == {"ok": 0, "retried": MAX_ATTEMPTS - 1, "failed": 1, "gone": 0, "dropped": 0}
    (line,) = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == claimstatus.__name__
    ]
    assert line.startswith(f"cannot write status.devices of claim ns/c (attempt {MAX_ATTEMPTS} of {MAX_ATTEMPTS}): ")


def test_the_queue_is_bounded_and_post_returns_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(claimstatus, "MAX_QUEUED", 3)
    registry = CollectorRegistry()
    writer = ClaimStatusWriter(_nowhere(), make_driver(tmp_path), DraMetrics(registry), clock=ManualClock())
    writer.post([_claim(str(i)) for i in range(5)])
    assert writer.queued == 3 and _counts(registry)["dropped"] == 2
