"""Never the wrong GPU: a claim's first prepare and a re-allocation are prepared from the API's answer, not a
cached copy; a damaged record fences its claim's devices; twins see each other's records whatever the timestamps."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from deviceplugin.atomicfile import atomic_write
from deviceplugin.dra.devices import ClaimError
from deviceplugin.dra.prepare import GONE, UNKNOWN, Driver, prepare_claims
from tests.support.dra import MemoryClaims, claim, make_driver, result


def _prepare(driver: Driver, source: MemoryClaims, ref) -> tuple[list[str], str]:
    outcome = asyncio.run(prepare_claims(driver, source, [ref]))[ref.uid]
    return [d.device for d in outcome.claim.devices] if outcome.claim else [], outcome.error


def test_a_stale_cache_never_prepares_the_gpu_the_claim_no_longer_has(tmp_path: Path) -> None:
    """The watch stalled: the cache still shows the claim on gpu-0, the API re-allocated it (same UID) to gpu-1."""
    driver, source = make_driver(tmp_path), MemoryClaims()
    ref, old = claim([result("gpu-0", shares=4)])
    _, new = claim([result("gpu-1", shares=4)], uid=ref.uid)
    source.cache[ref.uid] = old
    source.api[ref.uid] = new
    assert _prepare(driver, source, ref) == (["gpu-1"], "") and source.gets == [
        ref.uid
    ]  # the first prepare reads the API
    assert driver.ledger() == {"gpu-1": 4}


def test_a_re_allocated_claim_is_prepared_from_its_new_allocation_and_its_record_replaced(tmp_path: Path) -> None:
    driver, source = make_driver(tmp_path), MemoryClaims()
    ref, old = claim([result("gpu-0", shares=4)])
    source.put(old)
    assert _prepare(driver, source, ref) == (["gpu-0"], "")
    source.gets.clear()
    assert (
        _prepare(driver, source, ref) == (["gpu-0"], "") and source.gets == []
    )  # a current cache agreeing with the record
    _, new = claim([result("gpu-1", shares=3)], uid=ref.uid)
    source.put(new)  # the cache (current) shows the new allocation: confirmed with a GET, then prepared from it
    assert _prepare(driver, source, ref) == (["gpu-1"], "") and source.gets == [ref.uid]
    assert driver.ledger() == {"gpu-1": 3} and driver.reallocated == 1
    restarted = make_driver(tmp_path)  # the record on disk is the new one
    assert restarted.ledger() == {"gpu-1": 3} and [d.device for d in restarted.checkpoint.get(ref.uid).devices] == [
        "gpu-1"
    ]


def test_a_cache_that_is_not_current_is_not_used_for_a_prepared_claim(tmp_path: Path) -> None:
    driver, source = make_driver(tmp_path), MemoryClaims()
    ref, old = claim([result("gpu-0", shares=2)])
    source.put(old)
    _prepare(driver, source, ref)
    _, new = claim([result("gpu-1", shares=2)], uid=ref.uid)
    source.api[ref.uid] = new  # the cache missed the re-allocation and its watch went quiet
    source.current = False
    assert _prepare(driver, source, ref) == (["gpu-1"], "")


def _damage(tmp_path: Path, uid: str) -> None:
    record = tmp_path / "claims" / f"{uid}.json"
    record.write_bytes(record.read_bytes()[:20])


def test_a_damaged_record_fences_its_claims_devices_until_the_kubelet_unprepares_it(tmp_path: Path, caplog) -> None:
    driver = make_driver(tmp_path)
    held = claim([result("gpu-0", shares=1)])
    driver.prepare(*held)
    spec = Path(driver.checkpoint.get(held[0].uid).cdi_spec)
    _damage(tmp_path, held[0].uid)
    restarted = make_driver(tmp_path)
    assert held[0].uid in restarted.checkpoint.damaged and restarted.checkpoint.quarantined == 1
    assert "stay fenced" in caplog.text
    from prometheus_client import CollectorRegistry

    from deviceplugin.obs.drametrics import DraCollector

    registry = CollectorRegistry()
    registry.register(DraCollector(restarted, lambda: True))
    assert registry.get_sample_value("gpushare_dra_damaged_records") == 1
    assert registry.get_sample_value("gpushare_dra_records_quarantined_total") == 1
    # The API's view of that UID cannot be told: every device is fenced.
    for device in ("gpu-0", "gpu-1"):
        with pytest.raises(
            ClaimError, match=f"device {device} is fenced: the checkpoint record of claim {held[0].uid} is damaged"
        ):
            restarted.prepare(*claim([result(device, shares=1)]))
    # The API allocates gpu-0 to that UID: gpu-0 stays fenced, gpu-1 is free.
    restarted.find_claim = lambda uid: held[1] if uid == held[0].uid else GONE
    with pytest.raises(ClaimError, match="device gpu-0 is fenced"):
        restarted.prepare(*claim([result("gpu-0", shares=1)]))
    assert restarted.prepare(*claim([result("gpu-1", shares=1)])).devices[0].device == "gpu-1"
    # The kubelet unprepares the damaged claim: its spec goes, its devices are free, the record stays for the operator.
    restarted.unprepare(held[0])
    assert not spec.exists() and not restarted.checkpoint.damaged
    assert (tmp_path / "claims" / f"{held[0].uid}.json.corrupt.released").exists()
    assert restarted.prepare(*claim([result("gpu-0", shares=4)])).devices[0].shares == 4
    assert not make_driver(tmp_path).checkpoint.damaged  # a restart does not fence it again


def test_a_damaged_claim_gone_from_the_api_is_released_and_its_own_re_prepare_succeeds(tmp_path: Path) -> None:
    driver = make_driver(tmp_path)
    gone, kept = claim([result("gpu-0", shares=1)]), claim([result("gpu-1", shares=1)])
    driver.prepare(*gone)
    driver.prepare(*kept)
    _damage(tmp_path, gone[0].uid)
    _damage(tmp_path, kept[0].uid)
    restarted = make_driver(tmp_path)
    restarted.find_claim = lambda uid: GONE if uid == gone[0].uid else UNKNOWN
    assert restarted.prepare(*kept).devices[0].device == "gpu-1"  # the kubelet's re-prepare of the damaged claim itself
    assert not restarted.checkpoint.damaged and restarted.ledger() == {"gpu-1": 1}
    assert restarted.prepare(*claim([result("gpu-0", shares=4)])).devices[0].shares == 4


def _overcommit_rounds(root: Path, rounds: int, force_mtime: bool) -> int:
    """Two instances, each preparing a 3-share claim on one 4-share GPU per round; how many rounds over-commit."""
    over = 0
    for i in range(rounds):
        directory = root / f"r{i}"
        one, two = make_driver(directory), make_driver(directory)
        seen = os.stat(directory / "claims")
        prepared = 0
        for driver in (one, two):
            try:
                driver.prepare(*claim([result("gpu-0", shares=3)]))
                prepared += 1
            except ClaimError:
                pass
            if force_mtime:
                os.utime(directory / "claims", ns=(seen.st_atime_ns, seen.st_mtime_ns))  # within one timestamp tick
        over += prepared > 1
        one.lock.close()
        two.lock.close()
    return over


def test_twins_never_hold_more_shares_than_a_gpu_has_when_timestamps_do_not_move(tmp_path: Path) -> None:
    assert _overcommit_rounds(tmp_path, 20, force_mtime=True) == 0


def test_twins_never_over_commit_on_ext4_with_one_second_timestamps(tmp_path: Path) -> None:
    """128-byte inodes keep only seconds: a loop-mounted image (needs root and mkfs.ext4)."""
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        pytest.skip("needs root and mkfs.ext4 to loop-mount an ext4 image with 128-byte inodes")
    image = tmp_path / "ext4.img"
    image.write_bytes(b"")
    os.truncate(image, 16 * 1024 * 1024)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-I", "128", str(image)], check=True, capture_output=True)
    mount = Path(tempfile.mkdtemp(prefix="gs-ext4-"))
    done = subprocess.run(["mount", "-o", "loop", str(image), str(mount)], capture_output=True, text=True)
    if done.returncode:
        mount.rmdir()
        pytest.skip(f"cannot loop-mount an ext4 image here: {done.stderr.strip()[:200]}")
    try:
        assert _overcommit_rounds(mount, 40, force_mtime=False) == 0
    finally:
        subprocess.run(["umount", str(mount)], check=False)
        mount.rmdir()


def test_failed_writes_leave_no_temporary_files_and_a_start_removes_those_a_crash_left(tmp_path: Path) -> None:
    driver = make_driver(tmp_path)
    leftover = [tmp_path / "claims" / ".x.json.tmp", tmp_path / "cdi" / f".{driver.name}_x.json.tmp"]
    for path in leftover:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("cut")
    other = tmp_path / "cdi" / ".another-driver_x.json.tmp"
    other.write_text("not ours")
    make_driver(tmp_path)
    assert not any(p.exists() for p in leftover) and other.exists()
    target = tmp_path / "claims" / "blocked.json"  # a rename that fails (as on a full disk): onto a non-empty directory
    (target / "inside").mkdir(parents=True)
    with pytest.raises(OSError):
        atomic_write(target, b"{}")
    assert not list((tmp_path / "claims").glob(".*.tmp"))


def test_a_hung_read_fails_only_its_own_claim_before_the_deadline(tmp_path: Path) -> None:
    """One claim's read hangs: a cached claim is prepared, the hung one gets its own error within the call's budget."""
    import time

    driver, source = make_driver(tmp_path), MemoryClaims()
    cached, hung = claim([result("gpu-0", shares=1)]), claim([result("gpu-1", shares=1)])
    source.put(cached[1])
    source.put(hung[1])
    assert _prepare(driver, source, cached[0])[1] == ""  # prepared once: its re-prepare is served from the cache
    source.hang[hung[0].uid] = release = threading.Event()
    source.gets.clear()
    reads = ThreadPoolExecutor(2)  # not asyncio.run's default executor, which it would wait for
    outcomes = asyncio.run(
        prepare_claims(driver, source, [hung[0], cached[0]], deadline=time.monotonic() + 0.5, reads=reads)
    )
    assert not release.is_set() and source.gets == [hung[0].uid]
    assert outcomes[cached[0].uid].claim is not None and not outcomes[cached[0].uid].error
    assert "not prepared" in outcomes[hung[0].uid].error and outcomes[hung[0].uid].claim is None
    release.set()
    reads.shutdown()


def test_a_twins_gauges_follow_the_other_instances_prepares(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry

    from deviceplugin.obs.drametrics import DraCollector

    one, two = make_driver(tmp_path), make_driver(tmp_path)
    registry = CollectorRegistry()
    registry.register(DraCollector(two, lambda: True))
    held = claim([result("gpu-0", shares=2)])
    one.prepare(*held)
    assert registry.get_sample_value("gpushare_dra_prepared_claims") == 1
    one.unprepare(held[0])
    assert registry.get_sample_value("gpushare_dra_prepared_claims") == 0
