"""atomic_write: the new content or the old, never a mix, and no temporary file left behind a failed write."""

from __future__ import annotations

import pytest

from deviceplugin.atomicfile import TMP, atomic_write


def test_the_file_is_replaced_whole(tmp_path):
    target = tmp_path / "record.json"
    atomic_write(target, b"old")
    atomic_write(target, b"new", durable=False)
    assert target.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "record.json"
    atomic_write(target, b"old")
    (tmp_path / "blocker").mkdir()
    with pytest.raises(IsADirectoryError):
        atomic_write(tmp_path / "blocker", b"new")  # the rename onto a directory fails after the write
    assert target.read_bytes() == b"old"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(TMP)]
