"""The settings of `gpu-share run`, apart from the config file: paths, ports and intervals."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import defaults
from ..agent.settings import AgentSettings
from ..health.monitor import HealthSettings
from ..plugin.server import Timings


@dataclass(frozen=True)
class DaemonOptions:
    config_file: str | None = None
    profile: str | None = None
    plugin_dir: Path = Path(defaults.PLUGIN_DIR)
    pod_resources_socket: Path = Path(defaults.POD_RESOURCES_SOCKET)
    metrics_port: int = defaults.METRICS_PORT  # 0: no endpoint
    metrics_host: str = defaults.METRICS_HOST
    node_name: str = ""  # the `node` label of every metric (default: the discovered node's name)
    proc_root: str = defaults.PROC_ROOT
    cdi_spec_dirs: tuple[str, ...] = defaults.CDI_SPEC_DIRS  # read in CDI mode to check every device has a spec
    reload_interval: float = defaults.RELOAD_INTERVAL
    profile_label_interval: float = defaults.PROFILE_LABEL_INTERVAL
    label_interval: float = defaults.LABEL_INTERVAL
    timings: Timings = Timings()
    health: HealthSettings = HealthSettings()
    agent: AgentSettings = AgentSettings()
    mps_control: str = defaults.MPS_CONTROL_BINARY  # asked whether each MPS pool's control daemon answers
