"""Where an MPS pool's control daemon keeps its pipes, logs and shared memory (shared by the plugin and `gpu-share
mps`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config.paths import pool_dir


@dataclass(frozen=True)
class MpsPaths:
    root: Path  # <mpsRoot>/<pool>

    @classmethod
    def of(cls, mps_root: str, pool: str) -> MpsPaths:
        """ValueError for a pool name that could leave mps_root (the config refuses those before)."""
        return cls(Path(pool_dir(mps_root, pool)))

    @property
    def pipe(self) -> Path:
        return self.root / "pipe"

    @property
    def log(self) -> Path:
        return self.root / "log"

    @property
    def shm(self) -> Path:
        """Mounted at /dev/shm in the daemon's container and in every client container."""
        return self.root / "shm"

    @property
    def ready(self) -> Path:
        """Exists while the control daemon runs with its limits set."""
        return self.root / "ready"
