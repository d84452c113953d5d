"""The `gpu-share` command: run (the daemon), discover, demo."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

from .config import Config, ConfigError, default_config, load_config
from .discovery import open_inventory, render_json, render_table
from .health import DEFAULT_IGNORED_XIDS, HealthMonitor, HealthSettings
from .inventory import InventoryError
from .manager import PluginManager
from .resources import build_resources
from .server import Timings

log = logging.getLogger("gpu-share")

DEFAULT_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
BUILTIN = Path(__file__).parent / "builtin"


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


def _xid_list(text: str) -> frozenset[int]:
    try:
        return frozenset(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated XID numbers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu-share", description="Kubernetes device plugin that shares GPUs safely.")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_logging(command: argparse.ArgumentParser, level: str = "info") -> None:
        command.add_argument("--log-level", default=level, choices=["debug", "info", "warning", "error"])
        command.add_argument("--log-format", default="text", choices=["text", "json"])

    run = sub.add_parser("run", help="run the device plugin daemon")
    add_logging(run)
    run.add_argument("--config", help="config file (default: every GPU shared, 10 shares each)")
    run.add_argument("--node", help="simulated node description file (default: real GPUs through NVML)")
    run.add_argument("--plugin-dir", default=DEFAULT_PLUGIN_DIR, help=f"kubelet device-plugin directory (default {DEFAULT_PLUGIN_DIR})")
    run.add_argument("--watch-interval", type=_positive_float, default=Timings.watch_interval, help="seconds between kubelet-restart checks")
    run.add_argument("--register-timeout", type=_positive_float, default=Timings.register_timeout, help="deadline of one Register call")
    run.add_argument("--backoff-max", type=_positive_float, default=Timings.backoff_max, help="longest wait between registration attempts")
    run.add_argument("--fail-on-init-error", type=_bool, default=True, metavar="BOOL",
                     help="exit at once when GPUs cannot be discovered (default true); false keeps running, advertising nothing")
    run.add_argument("--health-checks", type=_bool, default=True, metavar="BOOL", help="watch XIDs and GPU queries (default true)")
    run.add_argument("--ignore-xids", type=_xid_list, default=DEFAULT_IGNORED_XIDS, metavar="LIST",
                     help="XIDs that do not make a GPU unhealthy (default: %s)" % ",".join(map(str, sorted(DEFAULT_IGNORED_XIDS))))
    run.add_argument("--health-recovery", type=_positive_float, default=HealthSettings.recovery_period, metavar="SECONDS",
                     help="quiet period after which an unhealthy GPU is Healthy again (default 300)")
    run.add_argument("--health-interval", type=_positive_float, default=HealthSettings.check_interval, metavar="SECONDS",
                     help="seconds between GPU query checks (default 1)")
    run.set_defaults(func=cmd_run)

    discover = sub.add_parser("discover", help="show the node's GPUs, MIG instances, topology and health")
    add_logging(discover, level="warning")
    discover.add_argument("--node", help="simulated node description file (default: real GPUs through NVML)")
    discover.add_argument("--json", action="store_true", help="print JSON instead of a table")
    discover.set_defaults(func=cmd_discover)

    demo = sub.add_parser("demo", help="run the plugin against the built-in kubelet on a simulated node")
    add_logging(demo, level="error")
    demo.add_argument("--node", default=str(BUILTIN / "demo-node.yaml"), help="simulated node description file")
    demo.add_argument("--config", default=str(BUILTIN / "demo-config.yaml"), help="config file")
    demo.set_defaults(func=cmd_demo)
    return parser


def load(config_file: str | None) -> Config:
    return load_config(config_file) if config_file else default_config()


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    stop.wait()
    log.info("signal received, shutting down")


def cmd_run(args: argparse.Namespace) -> int:
    config = load(args.config)  # a bad config fails before NVML is touched
    try:
        inventory = open_inventory(args.node)
    except InventoryError as err:
        if args.fail_on_init_error:
            raise
        log.error("%s; running without devices (--fail-on-init-error=false)", err)
        _wait_for_signal()
        return 0
    try:
        node = inventory.discover()
        resources = build_resources(config, node)
        timings = Timings(register_timeout=args.register_timeout, backoff_max=args.backoff_max, watch_interval=args.watch_interval)
        manager = PluginManager(resources, Path(args.plugin_dir), timings)
        settings = HealthSettings(
            enabled=args.health_checks, ignored_xids=args.ignore_xids, recovery_period=args.health_recovery, check_interval=args.health_interval
        )
        monitor = HealthMonitor(inventory, node, manager.set_unhealthy, settings)
        manager.start()
        monitor.start()
        for resource in resources:
            log.info("%s: %d devices on %d GPUs", resource.name, len(resource.devices), len(resource.gpus))
        _wait_for_signal()
        monitor.stop()
        manager.stop()
    finally:
        inventory.close()
    return 0


def cmd_discover(args: argparse.Namespace) -> int:
    inventory = open_inventory(args.node)
    try:
        node = inventory.discover()
        print(render_json(node, inventory) if args.json else render_table(node, inventory))
    finally:
        inventory.close()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args.node, args.config)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .logs import setup_logging

    setup_logging(args.log_level, args.log_format)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"gpu-share: error: {err}", file=sys.stderr)
        return 2
    except InventoryError as err:
        print(f"gpu-share: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
