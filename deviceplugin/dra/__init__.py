"""The DRA driver: the node's GPUs as ResourceSlices that kube-scheduler allocates from, prepared for containers by a
kubelet plugin (docs/dra.md)."""
