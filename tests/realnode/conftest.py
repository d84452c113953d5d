"""One real node (kubelet + containerd) per test session, on the session's API server; see tests/support/realnode.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.realnode import RealNode, cannot_run, scripts_dir


@pytest.fixture(scope="session")
def realnode(controlplane: Any) -> Iterator[RealNode]:
    scripts = scripts_dir()
    if scripts is None:
        pytest.skip(
            "needs a real node's scripts: set REALNODE_DIR to a directory with up.sh, down.sh, nsexec.sh (.ci/run does)"
        )
    reason = cannot_run()
    if reason:
        pytest.skip(f"this machine cannot start a real node: {reason}")
    started = time.monotonic()
    node = RealNode.start(scripts, controlplane)
    print(f"\nreal node {node.name} up in {time.monotonic() - started:.1f} s")
    yield node
    node.stop()
