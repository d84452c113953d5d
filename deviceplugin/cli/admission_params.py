"""`gpu-share config admission-params`: the admission policy's params for a config over the fleet's nodes
(alloc/admission.py), as the kustomization's params (daemonset/admission/params.yaml) or the chart's `admission`
values."""

from __future__ import annotations

import argparse

from . import flags

HELP = "print the admission policy's params (the largest shares per unit of each shared resource) for a config"


def add_arguments(command: argparse.ArgumentParser) -> None:
    flags.add_logging(command, level="error")
    command.add_argument("file", help="config file")
    command.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="FILE",
        help="a node description or `discover --json` output, once per GPU model of the fleet (repeatable; "
        "needed for memoryPerShare pools)",
    )
    command.add_argument(
        "--chart-values",
        action="store_true",
        help="print the Helm chart's `admission` values (limits and the config's digest) instead of the "
        "kustomization's params",
    )


def run(args: argparse.Namespace) -> int:
    print(admission_params(args.file, args.node, args.chart_values), end="")
    return 0


def admission_params(file: str, node_files: list[str], chart_values: bool) -> str:
    """The params as YAML text; ConfigError when the config is invalid or a memoryPerShare pool has no node."""
    import yaml

    from ..alloc.admission import PARAMS_NAME, config_sha256, fleet_limits
    from ..config.parse import parse_config_bytes, read_config_bytes
    from ..discovery.simulated import SimulatedInventory

    data = read_config_bytes(file)
    config = parse_config_bytes(data, file)
    nodes = [SimulatedInventory.from_file(path).discover() for path in node_files]
    fleet = fleet_limits(config, nodes)
    seen = ", ".join(n.name for n in nodes) or "no node (replicas pools only)"
    header = [
        f"# gpu-share config admission-params {file}: the largest shares of one GPU or MIG instance per shared "
        "resource,",
        f"# over every profile on: {seen}",
    ] + [f"# left out: {line}" for line in fleet.skipped]
    body: dict[str, object]
    if chart_values:
        limits = {name: str(count) for name, count in fleet.in_domain().items()}
        body = {"admission": {"configSha256": config_sha256(data.decode()), "limits": limits}}
    else:  # kustomize-only (local-config): daemonset/admission copies `limits` into the policy
        body = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": PARAMS_NAME, "annotations": {"config.kubernetes.io/local-config": "true"}},
            "data": {"limits": fleet.cel()},
        }
    return "\n".join(header) + "\n" + yaml.safe_dump(body, sort_keys=False)
