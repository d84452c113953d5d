"""The pods of the node as the process mapper needs them: UIDs, names, their containers' runtime IDs and which ended."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class PodRef:
    uid: str
    namespace: str
    name: str
    containers: dict[str, str] = field(default_factory=dict)  # bare container ID -> container name
    ended: frozenset[str] = frozenset()  # bare IDs of containers known to have ended (terminated, earlier restarts)
    finished: bool = False  # phase Succeeded or Failed: every container of the pod has ended


class PodDirectory(Protocol):
    def pods(self) -> list[PodRef]:
        """Pods on this node with their containers' runtime IDs."""
        ...


def bare_container_id(container_id: str) -> str:
    """`containerd://abc…` -> `abc…`."""
    return container_id.split("://", 1)[-1]
