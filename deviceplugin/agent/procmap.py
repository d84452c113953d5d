"""Which container a GPU process belongs to: /proc/<pid>/cgroup gives the pod UID and container ID,
the pod directory (the Kubernetes API) turns them into namespace, pod and container names."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from .. import defaults
from ..model.pods import PodDirectory, PodRef

log = logging.getLogger(__name__)

# kubepods[-burstable|-besteffort]/pod<uid>/<id> (cgroupfs) or
# kubepods-pod<uid_with_underscores>.slice/cri-containerd-<id>.scope (systemd)
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_CONTAINER_ID = re.compile(r"(?:^|[-/])([0-9a-f]{64})(?:\.scope)?$")


@dataclass(frozen=True)
class Owner:
    """Who a GPU process belongs to, as far as the evidence goes."""

    key: tuple[str, str, str] | None = None  # (namespace, pod, container) of a container the API knows
    ended: str = ""  # non-empty: why the process is known to belong to an ended pod or container
    unknown: str = ""  # non-empty: why it cannot be attributed (host process, no host /proc, unknown container)


def cgroup_owner(pid: int, proc_root: str | Path = defaults.PROC_ROOT) -> tuple[str, str] | None:
    """(pod UID, container ID) of a process, or None for a process outside any pod."""
    try:
        text = (Path(proc_root) / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        uid = _POD_UID.search(path)
        container = _CONTAINER_ID.search(path.rstrip("/"))
        if uid and container:
            return uid.group(1).replace("_", "-"), container.group(1)
    return None


class ProcessMapper:
    """Maps PIDs to (namespace, pod, container) through cgroups and the pod directory."""

    def __init__(self, directory: PodDirectory, proc_root: str | Path = defaults.PROC_ROOT) -> None:
        self.directory = directory
        self.proc_root = proc_root
        self._by_uid: dict[str, PodRef] = {}

    def refresh(self) -> None:
        self._by_uid = {p.uid: p for p in self.directory.pods()}

    def owner(self, pid: int) -> Owner:
        """The evidence for one PID: a known container, an ended one, or why it is unknown."""
        found = cgroup_owner(pid, self.proc_root)
        if found is None:
            return Owner(unknown="no pod cgroup: a host process, or --proc-root is not the host's /proc")
        uid, container = found
        pod = self._by_uid.get(uid)
        if pod is None:
            return Owner(ended=f"pod {uid} no longer exists")
        if pod.finished or container in pod.ended:
            return Owner(ended=f"container {container[:12]} of pod {pod.namespace}/{pod.name} has ended")
        if container not in pod.containers:
            return Owner(
                unknown=f"container {container[:12]} is not (yet) in the status of pod {pod.namespace}/{pod.name}"
            )
        return Owner(key=(pod.namespace, pod.name, pod.containers[container]))
