"""The `gpu-share` command: run (the daemon), mps, discover, config check, extender, demo, simulate."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

# Only light imports here: each command imports what it needs, so `config check` and `discover` never load
# grpc, prometheus or kubernetes, and `run` registers with the kubelet before the heavy parts load.
from .. import __version__, defaults
from ..config.types import ConfigError
from ..errors import StartupError
from ..health.monitor import DEFAULT_IGNORED_XIDS, DEFAULT_RESET_XIDS, HealthSettings
from ..discovery.inventory import InventoryError
from ..runtime.signals import SHUTDOWN_GRACE, catch_signals, raise_fd_limit, wait_for_signal
from ..runtime.startup import FlagError, check_directory, check_executable, check_plugin_dir, check_readable_file

log = logging.getLogger("gpu-share")

BUILTIN = Path(__file__).parent.parent / "builtin"

if TYPE_CHECKING:
    from ..model.node import NodeInfo
    from ..obs.http import MetricsServer
    from ..runtime.options import DaemonOptions
    from ..model.devices import Resource


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"must be true or false, got {text!r}")


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0-65535 (0 disables), got {text!r}")
    return int(text)


def _ip_address(text: str) -> str:
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an IP address such as 0.0.0.0, :: or 10.1.2.3, got {text!r}") from None


def _xid_list(text: str) -> frozenset[int]:
    try:
        return frozenset(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated XID numbers, got {text!r}") from None


def _dir_list(text: str) -> tuple[str, ...]:
    dirs = tuple(d.strip() for d in text.split(",") if d.strip())
    if not dirs or not all(d.startswith("/") for d in dirs):
        raise argparse.ArgumentTypeError(f"must be comma-separated absolute directories, got {text!r}")
    return dirs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu-share", description="Kubernetes device plugin that shares GPUs safely.")
    parser.add_argument("--version", action="version", version=f"gpu-share {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_logging(command: argparse.ArgumentParser, level: str = "info") -> None:
        command.add_argument("--log-level", default=level, choices=["debug", "info", "warning", "error"])
        command.add_argument("--log-format", default="text", choices=["text", "json"])

    def add_plan(command: argparse.ArgumentParser) -> None:
        command.add_argument("--config", help="config file (default: every GPU shared, 10 shares each)")
        command.add_argument("--node", help="simulated node description file (default: real GPUs through NVML)")
        command.add_argument("--profile", help="config profile to serve (default: the node label <domain>/gpu-share.config, else defaultProfile)")
        command.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config, then ~/.kube/config)")

    run = sub.add_parser("run", help="run the device plugin daemon")
    add_logging(run)
    add_plan(run)
    run.add_argument("--reload-interval", type=_positive_float, default=10.0, metavar="SECONDS",
                     help="seconds between checks of the config file and the profile label (default 10)")
    run.add_argument("--plugin-dir", default=defaults.PLUGIN_DIR, help=f"kubelet device-plugin directory (default {defaults.PLUGIN_DIR})")
    run.add_argument("--watch-interval", type=_positive_float, default=defaults.WATCH_INTERVAL, help="seconds between kubelet-restart checks")
    run.add_argument("--register-timeout", type=_positive_float, default=defaults.REGISTER_TIMEOUT, help="deadline of one Register call")
    run.add_argument("--shutdown-grace", type=_positive_float, default=SHUTDOWN_GRACE, metavar="SECONDS",
                     help=f"after SIGTERM/SIGINT, exit anyway once this long has passed (default {SHUTDOWN_GRACE:g}, inside the pod's 30 s)")
    run.add_argument("--backoff-max", type=_positive_float, default=defaults.BACKOFF_MAX, help="longest wait between registration attempts")
    run.add_argument("--fail-on-init-error", type=_bool, default=True, metavar="BOOL",
                     help="exit at once when GPUs cannot be discovered (default true); false keeps running, advertising nothing")
    run.add_argument("--health-checks", type=_bool, default=True, metavar="BOOL", help="watch XIDs and GPU queries (default true)")
    run.add_argument("--ignore-xids", type=_xid_list, default=DEFAULT_IGNORED_XIDS, metavar="LIST",
                     help="XIDs that do not make a GPU unhealthy (default: %s)" % ",".join(map(str, sorted(DEFAULT_IGNORED_XIDS))))
    run.add_argument("--reset-xids", type=_xid_list, default=DEFAULT_RESET_XIDS, metavar="LIST",
                     help="XIDs that keep a GPU unhealthy until it is reset (default: %s)" % ",".join(map(str, sorted(DEFAULT_RESET_XIDS))))
    run.add_argument("--health-recovery", type=_positive_float, default=HealthSettings.recovery_period, metavar="SECONDS",
                     help="quiet period after which an unhealthy GPU is Healthy again (default 300)")
    run.add_argument("--health-interval", type=_positive_float, default=HealthSettings.check_interval, metavar="SECONDS",
                     help="seconds between GPU query checks (default 1)")
    run.add_argument("--profile-label-interval", type=_positive_float, default=60.0, metavar="SECONDS",
                     help="seconds between reads of the node's profile label (default 60)")
    run.add_argument("--metrics-port", type=_port, default=defaults.METRICS_PORT, metavar="PORT", help=f"Prometheus /metrics, /healthz, /readyz (default {defaults.METRICS_PORT}; 0 disables)")
    run.add_argument("--metrics-bind-address", type=_ip_address, default="0.0.0.0", metavar="IP",
                     help="address for the metrics port (default 0.0.0.0, every IPv4 interface; :: for IPv6, or the pod IP)")
    run.add_argument("--pod-resources-socket", default=defaults.POD_RESOURCES_SOCKET, help=f"the kubelet's pod-resources socket (default {defaults.POD_RESOURCES_SOCKET})")
    run.add_argument("--pod-resources-interval", type=_positive_float, default=defaults.POD_RESOURCES_INTERVAL, metavar="SECONDS",
                     help="seconds between pod-resources polls (default 10)")
    run.add_argument("--cdi-spec-dirs", type=_dir_list, default=defaults.CDI_SPEC_DIRS, metavar="DIRS",
                     help="comma-separated CDI spec directories checked in CDI mode (default /etc/cdi,/var/run/cdi)")
    run.add_argument("--proc-root", default=defaults.PROC_ROOT, help=f"the host's /proc, for mapping GPU processes to containers (default {defaults.PROC_ROOT})")
    run.add_argument("--mps-control", default=defaults.MPS_CONTROL_BINARY,
                     help=f"control client asked whether each MPS pool's daemon answers (default {defaults.MPS_CONTROL_BINARY})")
    run.set_defaults(func=cmd_run)

    mps = sub.add_parser("mps", help="run and supervise the MPS control daemons of the MPS pools")
    add_logging(mps)
    add_plan(mps)
    mps.add_argument("--mps-control", default=defaults.MPS_CONTROL_BINARY, help=f"the control binary (default {defaults.MPS_CONTROL_BINARY})")
    mps.add_argument("--backoff-max", type=_positive_float, default=30.0, help="longest wait before restarting a daemon (default 30)")
    mps.set_defaults(func=cmd_mps)

    config = sub.add_parser("config", help="config file tools")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser("check", help="validate a config and show what it yields on a node")
    add_logging(check, level="error")  # the plugin's warnings are shown under each profile
    check.add_argument("file", help="config file")
    check.add_argument("--node", help="node description file, or `discover --json` output (default: only validate)")
    which = check.add_mutually_exclusive_group()
    which.add_argument("--profile", help="profile to check on the node (default: defaultProfile, as `run --profile` would serve)")
    which.add_argument("--all-profiles", action="store_true", help="check every profile on the node and report each one's result")
    check.set_defaults(func=cmd_config_check)

    discover = sub.add_parser("discover", help="show the node's GPUs, MIG instances, topology and health")
    add_logging(discover, level="warning")
    discover.add_argument("--node", help="simulated node description file (default: real GPUs through NVML)")
    discover.add_argument("--json", action="store_true", help="print JSON instead of a table")
    discover.set_defaults(func=cmd_discover)

    extender = sub.add_parser("extender", help="run the kube-scheduler extender (filter, prioritize) for share pods")
    add_logging(extender)
    extender.add_argument("--domain", default="example.com", help="resources <domain>/* are managed; reads the <domain>/gpu-share.inventory annotation")
    extender.add_argument("--port", type=_port, default=8888, metavar="PORT", help="HTTP port of /filter, /prioritize, /metrics, /healthz, /readyz (default 8888)")
    extender.add_argument("--policy", default="binpack", help="cluster placement policy scoring the nodes: binpack (default), bestfit, dotproduct, gpupacking, spread, fgd, fgdstrand")
    extender.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config, then ~/.kube/config)")
    extender.add_argument("--reservation-ttl", type=_positive_float, default=30.0, metavar="SECONDS",
                          help="how long a pod passed by the filter counts on its nodes before its binding shows (default 30)")
    extender.set_defaults(func=cmd_extender)

    demo = sub.add_parser("demo", help="run the plugin against the built-in kubelet on a simulated node")
    add_logging(demo, level="error")
    demo.add_argument("--node", default=str(BUILTIN / "demo-node.yaml"), help="simulated node description file")
    demo.add_argument("--config", default=str(BUILTIN / "demo-config.yaml"), help="config file")
    demo.add_argument("--profile", help="config profile to serve (default: defaultProfile)")
    demo.set_defaults(func=cmd_demo)

    from ..cluster.report import add_arguments as add_simulate_arguments

    simulate = sub.add_parser("simulate", help="replay a GPU-sharing trace through the cluster packing policies (FGD paper's protocol)")
    add_logging(simulate, level="warning")
    add_simulate_arguments(simulate)
    simulate.set_defaults(func=cmd_simulate)
    return parser


def _plan(args: argparse.Namespace, node: "NodeInfo") -> list["Resource"]:
    from ..kube.client import NodeClient
    from ..runtime.reload import ProfileSource, load_plan

    client = NodeClient.connect(kubeconfig=args.kubeconfig) if not args.profile else None
    _, profile, resources = load_plan(args.config, node, ProfileSource(args.profile, client))
    log.info("serving profile %s", profile or "(default)")
    return resources


def _node_name() -> str:
    """The node's name for the metrics' `node` label: NODE_NAME (the DaemonSet sets it), else the host name."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


def _not_ready_endpoint(args: argparse.Namespace, reason: str) -> "MetricsServer | None":
    if not args.metrics_port:
        return None
    from prometheus_client import CollectorRegistry

    from ..model.node import NodeInfo
    from ..obs.metrics import MetricSources, StateCollector
    from ..obs.http import MetricsServer

    registry = CollectorRegistry()
    registry.register(StateCollector(MetricSources(NodeInfo(gpus=()), nvml_up=False)))  # every plugin metric, at 0
    server = MetricsServer(
        registry, lambda: (True, "ok"), lambda: (False, f"not ready: {reason}"), args.metrics_port, args.metrics_bind_address, node=_node_name()
    )
    server.start()
    return server


def _check_plan_flags(args: argparse.Namespace) -> None:
    for flag, value in (("--config", args.config), ("--node", args.node), ("--kubeconfig", args.kubeconfig)):
        if value:
            check_readable_file(flag, value)


def _daemon_options(args: argparse.Namespace) -> "DaemonOptions":
    from ..runtime.options import AgentSettings, DaemonOptions
    from ..plugin.server import Timings

    return DaemonOptions(
        config_file=args.config,
        profile=args.profile,
        plugin_dir=Path(args.plugin_dir),
        pod_resources_socket=Path(args.pod_resources_socket),
        metrics_port=args.metrics_port,
        node_name=_node_name(),
        metrics_host=args.metrics_bind_address,
        proc_root=args.proc_root,
        cdi_spec_dirs=args.cdi_spec_dirs,
        reload_interval=args.reload_interval,
        profile_label_interval=args.profile_label_interval,
        timings=Timings(register_timeout=args.register_timeout, backoff_max=args.backoff_max, watch_interval=args.watch_interval),
        health=HealthSettings(
            enabled=args.health_checks,
            ignored_xids=args.ignore_xids,
            reset_xids=args.reset_xids,
            recovery_period=args.health_recovery,
            check_interval=args.health_interval,
        ),
        agent=AgentSettings(interval=args.pod_resources_interval),
        mps_control=args.mps_control,
    )


def cmd_run(args: argparse.Namespace) -> int:
    catch_signals(args.shutdown_grace)
    raise_fd_limit()
    _check_plan_flags(args)
    check_plugin_dir(args.plugin_dir)
    check_directory("--proc-root", args.proc_root, "the host's /proc, for mapping GPU processes to pods")
    from ..config.parse import load_config
    from ..discovery.backend import open_inventory

    if args.config:
        load_config(args.config)  # a bad config fails before NVML is touched
    try:
        inventory = open_inventory(args.node)
    except InventoryError as err:
        if args.fail_on_init_error:
            raise
        log.error("%s; running without devices (--fail-on-init-error=false)", err)
        endpoint = _not_ready_endpoint(args, str(err))
        wait_for_signal()
        if endpoint:
            endpoint.stop()
        return 0
    from ..kube.client import NodeClient
    from ..runtime.serving import plan_serving

    options = _daemon_options(args)
    try:
        serving = plan_serving(inventory, options, lambda: NodeClient.connect(kubeconfig=args.kubeconfig))
    except BaseException:
        inventory.close()
        raise
    try:
        serving.manager.start()  # serve and register first: the API client, exporter and agent load afterwards
        from ..runtime.daemon import PluginDaemon

        daemon = PluginDaemon(inventory, options, serving.client or NodeClient.connect(kubeconfig=args.kubeconfig), serving=serving)
        daemon.start()
    except BaseException:
        serving.manager.stop()
        inventory.close()
        raise
    wait_for_signal()
    daemon.stop()
    return 0


def cmd_mps(args: argparse.Namespace) -> int:
    catch_signals()
    _check_plan_flags(args)
    check_executable("--mps-control", args.mps_control, "it comes with the NVIDIA driver's user-space tools")
    from ..discovery.backend import open_inventory
    from ..mps.control import MpsDaemon

    inventory = open_inventory(args.node)
    try:
        resources = _plan(args, inventory.discover())
    finally:
        inventory.close()
    daemons = [
        MpsDaemon(r, r.settings.mps_root, binary=args.mps_control, backoff_max=args.backoff_max) for r in resources if r.pool.mps
    ]
    if not daemons:
        log.warning("the config has no pool with backend mps on this node; nothing to run")
    for daemon in daemons:
        daemon.start()
    wait_for_signal()
    for daemon in daemons:
        daemon.stop()
    return 0


def cmd_config_check(args: argparse.Namespace) -> int:
    from ..alloc.check import check_config

    return check_config(args.file, args.node, args.profile, args.all_profiles)


def cmd_discover(args: argparse.Namespace) -> int:
    from ..discovery.backend import open_inventory
    from ..discovery.report import render_json, render_table

    inventory = open_inventory(args.node)
    try:
        node = inventory.discover()
        print(render_json(node, inventory) if args.json else render_table(node, inventory))
    finally:
        inventory.close()
    return 0


def cmd_extender(args: argparse.Namespace) -> int:
    from ..extender.service import run_extender

    catch_signals()
    return run_extender(args, wait_for_signal)


def cmd_demo(args: argparse.Namespace) -> int:
    from ..sim.demo import run_demo

    return run_demo(args.node, args.config, profile=args.profile)


def cmd_simulate(args: argparse.Namespace) -> int:
    from ..cluster.report import run_simulate

    return run_simulate(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # gRPC's C core logs every GOAWAY of a restarting kubelet at INFO on stderr, outside our log format and
    # levels; keep it to errors unless the operator asks for more.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from ..logs import setup_logging

    setup_logging(args.log_level, args.log_format)
    try:
        return args.func(args)
    except (ConfigError, FlagError) as err:
        print(f"gpu-share: error: {err}", file=sys.stderr)
        return 2
    except (InventoryError, StartupError) as err:
        print(f"gpu-share: error: {err}", file=sys.stderr)
        return 1
    except (OSError, RuntimeError) as err:  # anything else at start-up: one line, the traceback only at debug level
        log.debug("start-up failed", exc_info=True)
        print(f"gpu-share: error: start-up failed: {err} (--log-level debug shows where)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
