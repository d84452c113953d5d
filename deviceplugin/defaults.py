"""Every default location, port and interval of the `gpu-share` commands, defined once (the settings and the CLI read
them)."""

from __future__ import annotations

PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
METRICS_PORT = 9410
PROC_ROOT = "/proc"
CDI_SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")  # where CDI specs live (the CDI spec's own directories)
POD_RESOURCES_INTERVAL = 10.0  # seconds between pod-resources polls
MPS_CONTROL_BINARY = "nvidia-cuda-mps-control"
# The kubelet link (server.Timings)
REGISTER_TIMEOUT = 30.0  # above the kubelet's own 10 s dial timeout
BACKOFF_MAX = 5.0
WATCH_INTERVAL = 0.2  # the polling safety net beside inotify
STANDBY_TIMEOUT = (
    30.0  # seconds a standing-by instance answers /readyz ready (a surge rollout goes on), not ready after
)
PENDING_INTERVAL = (
    2.0  # seconds between looks at whether a GPU kept in its old shape is released (one pod-resources List)
)
# `gpu-share run`
METRICS_HOST = "0.0.0.0"  # every IPv4 interface, as exporters do
RELOAD_INTERVAL = (
    10.0  # seconds between checks of the config file (and the profile label, at most every PROFILE_LABEL_INTERVAL)
)
PROFILE_LABEL_INTERVAL = 60.0  # seconds between reads of the node's profile label
LABEL_INTERVAL = 5.0  # at most one patch of the node's labels and annotations per this many seconds
POD_RESOURCES_BACKOFF_MAX = 80.0  # longest poll interval after RESOURCE_EXHAUSTED
SHUTDOWN_GRACE = 20.0  # seconds from SIGTERM/SIGINT to a forced exit, inside the pod's default 30 s
# `gpu-share run --api dra`
# holds plugins_registry/ (registration sockets) and plugins/<driver>/ (the DRA socket, checkpoint)
KUBELET_ROOT = "/var/lib/kubelet"
DRA_CDI_ROOT = "/var/run/cdi"  # where the driver writes one CDI spec per prepared claim
DRA_HEALTH_INTERVAL = (
    10.0  # seconds between full health lists on an idle stream (below the 30 s timeout each device declares)
)
DRA_HEALTH_TIMEOUT = 30  # health_check_timeout_seconds per device: the kubelet reads a device Unknown after it
# `gpu-share mps`
MPS_BACKOFF_MAX = 30.0  # longest wait before restarting a control daemon
# `gpu-share extender`
EXTENDER_PORT = 8888
EXTENDER_POLICY = "binpack"
RESERVATION_TTL = 30.0  # seconds a pod passed by the filter counts on its nodes before its binding shows
