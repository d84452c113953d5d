"""Every bound on the config file, in one place (each is listed in docs/configuration.md#limits).

One ConfigMap is shared by every GPU node, so a typo or a hostile edit must cost a node milliseconds and a few
MiB, never the plugin: the file, its YAML structure and every key are bounded before anything is built.
"""

from __future__ import annotations

# The file and its YAML: a ConfigMap holds at most 1 MiB. libyaml scans a MiB in milliseconds; composing costs about
# 8 us and 400 bytes per node, so the node count bounds the worst file to tens of milliseconds and a few MiB, still
# 50 times a large fleet config.
MAX_CONFIG_BYTES = 1024 * 1024
MAX_YAML_DEPTH = 32  # a config needs 8 levels (profiles.<name>.pools[i].gpus.indexes[j])
MAX_YAML_NODES = 10_000  # scalars, sequences and mappings, aliases and merged keys counted
MAX_STRING_LENGTH = 256  # every string value

# Keys.
MAX_PROFILES = 64
MAX_POOLS = 64  # per profile
MAX_REPLICAS = 1024  # shares per GPU or MIG instance, given as replicas or computed from memoryPerShare
MAX_SELECTOR_ITEMS = 256  # entries in each of gpus.indexes, gpus.uuids and gpus.models
MAX_GPU_INDEX = 1023
MIN_USEFUL_SHARE_MIB = 256  # below this a share cannot hold a CUDA context (~250-500 MiB): a warning, not an error
MPS_MAX_CLIENTS = 48  # clients of one MPS server per GPU (Volta and later); also keeps 100 % / replicas >= 1

# The node. The kubelet receives at most 4 MiB per ListAndWatch message; every resource stays well below it.
LIST_BUDGET_BYTES = 2 * 1024 * 1024

# Problems listed in one error (the rest are counted).
MAX_REPORTED_PROBLEMS = 20
