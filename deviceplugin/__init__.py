"""gpu-share: a Kubernetes device plugin that shares GPUs safely.

Data flows one way: discovery -> config -> alloc -> plugin (one gRPC DevicePlugin server per
resource, the manager tying them to the kubelet's lifecycle) <-> kubelet; health and agent write
the NodeState (state.py), which the servers, kube labels and obs metrics read; runtime wires it
all, cli is the entry point (docs/architecture.md).
"""

__version__ = "0.1.0"
