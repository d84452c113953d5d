"""`gpu-share run`: the device plugin daemon (serve and register first; the API client, exporter and agent after)."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from .. import defaults
from ..discovery.inventory import Inventory, InventoryError
from ..errors import StartupError
from ..health.monitor import DEFAULT_IGNORED_XIDS, DEFAULT_RESET_XIDS, HealthSettings
from ..runtime.startup import check_directory, check_plugin_dir
from ..signals import catch_signals, exit_now, raise_fd_limit, stop_requested, wait_for_signal
from . import flags

if TYPE_CHECKING:
    from ..obs.http import MetricsServer
    from ..runtime.instance import InstanceLock
    from ..runtime.options import DaemonOptions

log = logging.getLogger("gpu-share")

HELP = "run the device plugin daemon (or, with --api dra, the DRA driver)"


def add_arguments(run: argparse.ArgumentParser) -> None:
    flags.add_logging(run)
    flags.add_plan(run)
    seconds = flags.positive_float
    run.add_argument(
        "--api",
        choices=["deviceplugin", "dra"],
        default="deviceplugin",
        help="the kubelet API to serve: the device-plugin API (default) or a DRA driver (Kubernetes 1.34+)",
    )
    run.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME"),
        help="the Kubernetes node: its labels, annotation and Events, the DRA driver's pool (default"
        " $NODE_NAME; the metrics' node label and the pool fall back to the host name, labels and"
        " Events are off without it)",
    )
    add_dra_arguments(run)
    run.add_argument(
        "--reload-interval",
        type=seconds,
        default=defaults.RELOAD_INTERVAL,
        metavar="SECONDS",
        help="seconds between checks of the config file and the profile label (default %(default)g)",
    )
    run.add_argument(
        "--plugin-dir", default=defaults.PLUGIN_DIR, help="kubelet device-plugin directory (default %(default)s)"
    )
    run.add_argument(
        "--watch-interval",
        type=seconds,
        default=defaults.WATCH_INTERVAL,
        help="seconds between kubelet-restart checks (default %(default)g)",
    )
    run.add_argument(
        "--pending-interval",
        type=seconds,
        default=defaults.PENDING_INTERVAL,
        help="seconds between checks whether a GPU a reload waits for is released (default %(default)g)",
    )
    run.add_argument(
        "--instance-conflict",
        choices=["wait", "exit"],
        default="wait",
        help="when another instance serves --plugin-dir: stand by and take over once it stops (wait, the "
        "default), or exit 1",
    )
    run.add_argument(
        "--instance-lock",
        default=None,
        metavar="PATH",
        help="directory or file whose flock makes one instance per plugin directory (default: --plugin-dir "
        "itself); for a filesystem that refuses flock",
    )
    run.add_argument(
        "--standby-timeout",
        type=seconds,
        default=defaults.STANDBY_TIMEOUT,
        metavar="SECONDS",
        help="a standing-by instance answers /readyz ready this long, then not ready with the lock holder "
        "(default %(default)g)",
    )
    run.add_argument(
        "--register-timeout",
        type=seconds,
        default=defaults.REGISTER_TIMEOUT,
        help="deadline of one Register call (default %(default)g)",
    )
    run.add_argument(
        "--shutdown-grace",
        type=seconds,
        default=defaults.SHUTDOWN_GRACE,
        metavar="SECONDS",
        help="after SIGTERM/SIGINT, exit anyway once this long has passed (default %(default)g, inside the pod's 30 s)",
    )
    run.add_argument(
        "--backoff-max",
        type=seconds,
        default=defaults.BACKOFF_MAX,
        help="longest wait between registration attempts (default %(default)g)",
    )
    run.add_argument(
        "--fail-on-init-error",
        type=flags.boolean,
        default=True,
        metavar="BOOL",
        help="exit at once when GPUs cannot be discovered (default true); false keeps running, advertising nothing",
    )
    run.add_argument(
        "--health-checks",
        type=flags.boolean,
        default=True,
        metavar="BOOL",
        help="watch XIDs and GPU queries (default true)",
    )
    run.add_argument(
        "--ignore-xids",
        type=flags.xid_list,
        default=DEFAULT_IGNORED_XIDS,
        metavar="LIST",
        help=f"XIDs that do not make a GPU unhealthy (default: {','.join(map(str, sorted(DEFAULT_IGNORED_XIDS)))})",
    )
    run.add_argument(
        "--reset-xids",
        type=flags.xid_list,
        default=DEFAULT_RESET_XIDS,
        metavar="LIST",
        help="XIDs that keep a GPU unhealthy until it is reset "
        f"(default: {','.join(map(str, sorted(DEFAULT_RESET_XIDS)))})",
    )
    run.add_argument(
        "--health-recovery",
        type=seconds,
        default=HealthSettings.recovery_period,
        metavar="SECONDS",
        help="quiet period after which an unhealthy GPU is Healthy again (default %(default)g)",
    )
    run.add_argument(
        "--health-interval",
        type=seconds,
        default=HealthSettings.check_interval,
        metavar="SECONDS",
        help="seconds between GPU query checks (default %(default)g)",
    )
    run.add_argument(
        "--profile-label-interval",
        type=seconds,
        default=defaults.PROFILE_LABEL_INTERVAL,
        metavar="SECONDS",
        help="seconds between reads of the node's profile label (default %(default)g)",
    )
    run.add_argument(
        "--metrics-port",
        type=flags.port,
        default=defaults.METRICS_PORT,
        metavar="PORT",
        help="Prometheus /metrics, /healthz, /readyz (default %(default)s; 0 disables)",
    )
    run.add_argument(
        "--metrics-bind-address",
        type=flags.ip_address,
        default=defaults.METRICS_HOST,
        metavar="IP",
        help="address for the metrics port (default %(default)s, every IPv4 interface; :: for IPv6, or the pod IP)",
    )
    run.add_argument(
        "--pod-resources-socket",
        default=defaults.POD_RESOURCES_SOCKET,
        help="the kubelet's pod-resources socket (default %(default)s)",
    )
    run.add_argument(
        "--pod-resources-interval",
        type=seconds,
        default=defaults.POD_RESOURCES_INTERVAL,
        metavar="SECONDS",
        help="seconds between pod-resources polls (default %(default)g)",
    )
    run.add_argument(
        "--cdi-spec-dirs",
        type=flags.dir_list,
        default=defaults.CDI_SPEC_DIRS,
        metavar="DIRS",
        help=f"comma-separated CDI spec directories checked in CDI mode (default {','.join(defaults.CDI_SPEC_DIRS)})",
    )
    run.add_argument(
        "--proc-root",
        default=defaults.PROC_ROOT,
        help="the host's /proc, for mapping GPU processes to containers (default %(default)s)",
    )
    run.add_argument(
        "--mps-control",
        default=defaults.MPS_CONTROL_BINARY,
        help="control client asked whether each MPS pool's daemon answers (default %(default)s)",
    )


def add_dra_arguments(run: argparse.ArgumentParser) -> None:
    """The flags of `--api dra`, named as NVIDIA's DRA driver names them; each has an environment twin."""
    dra = run.add_argument_group("DRA driver (--api dra)")
    dra.add_argument(
        "--kubelet-root",
        default=os.environ.get("KUBELET_ROOT", defaults.KUBELET_ROOT),
        metavar="DIR",
        help="the kubelet's root directory (default $KUBELET_ROOT, else %(default)s)",
    )
    dra.add_argument(
        "--kubelet-registrar-directory-path",
        default=os.environ.get("KUBELET_REGISTRAR_DIRECTORY_PATH"),
        metavar="DIR",
        help="where the kubelet looks for registration sockets (default $KUBELET_REGISTRAR_DIRECTORY_PATH, else "
        "<kubelet-root>/plugins_registry)",
    )
    dra.add_argument(
        "--kubelet-plugins-directory-path",
        default=os.environ.get("KUBELET_PLUGINS_DIRECTORY_PATH"),
        metavar="DIR",
        help="parent of the driver's directory with its DRA socket and checkpoint (default "
        "$KUBELET_PLUGINS_DIRECTORY_PATH, else <kubelet-root>/plugins)",
    )
    dra.add_argument(
        "--cdi-root",
        default=os.environ.get("CDI_ROOT", defaults.DRA_CDI_ROOT),
        metavar="DIR",
        help="where a CDI spec per prepared claim is written (default $CDI_ROOT, else %(default)s)",
    )
    dra.add_argument(
        "--pod-uid",
        default=os.environ.get("POD_UID", ""),
        metavar="UID",
        help="put this UID in the socket names, so two driver pods can overlap in a rolling update (kubelet "
        "1.33+; default $POD_UID)",
    )
    dra.add_argument(
        "--claim-cache",
        type=flags.boolean,
        default=True,
        metavar="BOOL",
        help="serve prepare from a watch of the ResourceClaims allocated on this node (default true); false: one "
        "GET per claim",
    )
    dra.add_argument(
        "--health-stream-interval",
        type=flags.positive_float,
        default=defaults.DRA_HEALTH_INTERVAL,
        metavar="SECONDS",
        help="seconds between full device-health lists to the kubelet when nothing changes (default %(default)g)",
    )


def node_name(args: argparse.Namespace) -> str:
    """The node's name: --node-name (default $NODE_NAME, which the DaemonSets set, read once as the flag's default),
    else the host name. The `node` label of the metrics, the DRA driver's pool."""
    return args.node_name or socket.gethostname()


def _not_ready_endpoint(args: argparse.Namespace, reason: str) -> MetricsServer | None:
    """/healthz ok, /readyz not ready with `reason`, every plugin metric at 0: a plugin serving nothing."""
    return _idle_endpoint(args, lambda: (False, f"not ready: {reason}"))


def _idle_endpoint(
    args: argparse.Namespace, readyz: Callable[[], tuple[bool, str]], standby: bool = False
) -> MetricsServer | None:
    """/healthz ok, /readyz as `readyz` says, every plugin metric at 0 (`gpushare_instance_standby` as `standby`)."""
    if not args.metrics_port:
        return None
    from prometheus_client import CollectorRegistry

    from ..model.node import NodeInfo
    from ..obs.http import MetricsServer
    from ..obs.metrics import MetricSources, StateCollector

    registry = CollectorRegistry()
    registry.register(
        StateCollector(MetricSources(NodeInfo(gpus=()), nvml_up=False, standby=standby))
    )  # every plugin metric, at 0
    node = node_name(args)
    server = MetricsServer(
        registry, lambda: (True, "ok"), readyz, args.metrics_port, args.metrics_bind_address, node=node
    )
    try:
        server.start()
    except OSError as err:  # the port is the serving instance's while this one stands by
        log.warning("no metrics endpoint on port %d (%s)", args.metrics_port, err)
        return None
    return server


def _one_instance(args: argparse.Namespace) -> InstanceLock | None:
    """Hold the plugin directory's instance lock: at once, or after standing by (None: a signal came meanwhile)."""
    from ..runtime.instance import InstanceLock, conflict_message

    lock = InstanceLock(Path(args.plugin_dir), Path(args.instance_lock) if args.instance_lock else None)
    if lock.try_acquire():
        return lock
    conflict = conflict_message(lock)
    if args.instance_conflict == "exit":
        raise StartupError(f"{conflict}; exiting (--instance-conflict=exit): one instance per plugin directory")
    log.warning(
        "%s: standing by, serving nothing; this instance takes over within %gs of it stopping "
        "(--instance-conflict=wait)",
        conflict,
        args.watch_interval,
    )
    endpoint = _idle_endpoint(
        args, functools.partial(_standby_readiness, lock, time.monotonic(), args.standby_timeout), standby=True
    )
    try:
        if not lock.wait(stop_requested, args.watch_interval):
            return None
    finally:
        if endpoint:
            endpoint.stop()
    log.info("the other instance stopped: this one serves %s now", args.plugin_dir)
    return lock


def _standby_readiness(lock: InstanceLock, since: float, bound: float) -> tuple[bool, str]:
    """Ready for `bound` seconds of standing by (a surge rollout goes on and stops the old pod), then not ready: a
    holder that outlives the rollout serves nothing here, and the node would serve no GPUs unseen."""
    from ..runtime.instance import conflict_message

    waited = time.monotonic() - since
    if waited < bound:
        return True, f"standby: {conflict_message(lock)}"
    return (
        False,
        f"not ready: standing by for {waited:.0f}s (over --standby-timeout {bound:g}s), serving "
        f"nothing: {conflict_message(lock)}",
    )


def daemon_options(args: argparse.Namespace) -> DaemonOptions:
    from ..agent.settings import AgentSettings
    from ..plugin.server import Timings
    from ..runtime.options import DaemonOptions

    return DaemonOptions(
        config_file=args.config,
        profile=args.profile,
        plugin_dir=Path(args.plugin_dir),
        pod_resources_socket=Path(args.pod_resources_socket),
        metrics_port=args.metrics_port,
        node_name=node_name(args),
        metrics_host=args.metrics_bind_address,
        proc_root=args.proc_root,
        cdi_spec_dirs=args.cdi_spec_dirs,
        reload_interval=args.reload_interval,
        profile_label_interval=args.profile_label_interval,
        timings=Timings(
            register_timeout=args.register_timeout,
            backoff_max=args.backoff_max,
            watch_interval=args.watch_interval,
            pending_interval=args.pending_interval,
        ),
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


def run(args: argparse.Namespace) -> NoReturn:
    """Serve until SIGTERM/SIGINT, stop, and end the process at once (signals.exit_now); a start-up failure raises."""
    catch_signals(args.shutdown_grace)
    raise_fd_limit()
    flags.check_plan_flags(args)
    exit_now(run_dra(args) if args.api == "dra" else run_device_plugin(args))


def _open_inventory(args: argparse.Namespace) -> Inventory | None:
    """The node's GPUs (NVML, or --node); where they cannot be discovered, InventoryError, or with
    --fail-on-init-error=false a not-ready endpoint until SIGTERM/SIGINT, then None. Both APIs."""
    from ..discovery.backend import open_inventory

    try:
        return open_inventory(args.node)
    except InventoryError as err:
        if args.fail_on_init_error:
            raise
        log.error("%s; running without devices (--fail-on-init-error=false)", err)
        endpoint = _not_ready_endpoint(args, str(err))
        wait_for_signal()
        if endpoint:
            endpoint.stop()
        return None


def run_device_plugin(args: argparse.Namespace) -> int:
    """`gpu-share run`: the device plugin daemon until SIGTERM/SIGINT; the exit status."""
    check_plugin_dir(args.plugin_dir)
    check_directory("--proc-root", args.proc_root, "the host's /proc, for mapping GPU processes to pods")
    from ..runtime.plan import read_config

    start = read_config(args.config)  # a bad config fails before NVML is touched
    lock = _one_instance(args)
    if lock is None:
        return 0
    inventory = _open_inventory(args)
    if inventory is None:
        return 0
    from ..kube.client import NodeClient
    from ..runtime.serving import plan_serving

    options = daemon_options(args)
    connect = functools.cache(lambda: NodeClient.connect(args.node_name, args.kubeconfig))  # one client for both phases
    try:
        serving = plan_serving(inventory, options, connect, start)
    except BaseException:
        inventory.close()
        raise
    try:
        # a health pass, then serve and register first: the API client, exporter and agent load afterwards
        serving.start()
        from ..runtime.daemon import PluginDaemon

        daemon = PluginDaemon(serving, connect())
        daemon.start()
    except BaseException:
        serving.manager.stop()
        inventory.close()
        raise
    wait_for_signal()
    daemon.stop()
    lock.release()
    return 0


def run_dra(args: argparse.Namespace) -> int:
    """`gpu-share run --api dra`: the DRA driver until SIGTERM/SIGINT (runtime.dra)."""
    from ..dra.kubeletplugin import PluginSettings
    from ..runtime.plan import read_config

    root = Path(args.kubelet_root)
    registrar = Path(args.kubelet_registrar_directory_path or root / "plugins_registry")
    check_plugin_dir(str(registrar), "--kubelet-registrar-directory-path")
    start = read_config(args.config)
    inventory = _open_inventory(args)
    if inventory is None:
        return 0
    from ..kube.client import NodeClient
    from ..kube.rest import ApiAccessError, connect
    from ..runtime.dra import DraDaemon, DraOptions

    try:
        api = connect(args.kubeconfig)
    except ApiAccessError as err:
        inventory.close()
        raise StartupError(f"the DRA driver needs the Kubernetes API (ResourceClaims, ResourceSlices): {err}") from None
    dra = DraOptions(
        registrar_dir=registrar,
        plugins_dir=Path(args.kubelet_plugins_directory_path or root / "plugins"),
        cdi_root=Path(args.cdi_root),
        instance=args.pod_uid,
        claim_cache=args.claim_cache,
        plugin=PluginSettings(health_interval=args.health_stream_interval),
    )
    options = daemon_options(args)
    try:
        # The node's client: its labels and annotation, the watchdog's Events, and the pod directory (list Pods on this
        # node) that maps GPU processes to containers for the node agent.
        daemon = DraDaemon(inventory, options, dra, api, start, client=NodeClient(api, options.node_name))
    except BaseException:
        inventory.close()
        raise
    try:
        daemon.start()
    except BaseException:
        daemon.stop()
        raise
    wait_for_signal()
    daemon.stop()
    return 0
