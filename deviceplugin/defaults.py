"""Every default location and port of the node plugin, defined once."""

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
