"""gpu-share: a Kubernetes device plugin that shares GPUs safely.

Data flows one way: discovery -> config -> alloc -> plugin (one gRPC DevicePlugin server per
resource, the manager tying them to the kubelet's lifecycle) <-> kubelet; health and agent write
the NodeState (state.py), which the servers, kube labels and obs metrics read; runtime wires it
all, cli is the entry point (docs/architecture.md).
"""

import os

# gRPC's fork support restarts its poller thread in every forked child; a child that then closes its inherited fds
# before exec (subprocess's close_fds) closes the poller's epoll fd and crashes (grpc/grpc#43055): one MPS control
# client in seven died so while a gRPC server ran. The plugin forks only to exec, so fork support is off; this
# must be set before grpc is imported, hence here (an operator's own setting wins).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__version__ = "0.2.0"
