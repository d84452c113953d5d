"""gpu-share: a Kubernetes device plugin that shares GPUs safely.

Data flows discovery (inventory, simulated, nvml) -> config -> resources/allocator
-> server (one gRPC DevicePlugin server per resource) <-> kubelet; manager ties the
servers to the kubelet's lifecycle, cli is the entry point.
"""

__version__ = "0.1.0"
