"""The `gpu-share` command: run (the daemon), demo."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

from .config import Config, ConfigError, default_config, load_config
from .inventory import Inventory, InventoryError
from .manager import PluginManager
from .resources import build_resources
from .server import Timings
from .simulated import SimulatedInventory

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
    run.set_defaults(func=cmd_run)

    demo = sub.add_parser("demo", help="run the plugin against the built-in kubelet on a simulated node")
    add_logging(demo, level="error")
    demo.add_argument("--node", default=str(BUILTIN / "demo-node.yaml"), help="simulated node description file")
    demo.add_argument("--config", default=str(BUILTIN / "demo-config.yaml"), help="config file")
    demo.set_defaults(func=cmd_demo)
    return parser


def open_inventory(node_file: str | None) -> Inventory:
    if node_file:
        return SimulatedInventory.from_file(node_file)
    raise InventoryError("no --node given and real NVML discovery is not available in this build")


def load(config_file: str | None) -> Config:
    return load_config(config_file) if config_file else default_config()


def cmd_run(args: argparse.Namespace) -> int:
    inventory = open_inventory(args.node)
    try:
        resources = build_resources(load(args.config), inventory.discover())
        timings = Timings(register_timeout=args.register_timeout, backoff_max=args.backoff_max, watch_interval=args.watch_interval)
        manager = PluginManager(resources, Path(args.plugin_dir), timings)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: stop.set())
        manager.start()
        for resource in resources:
            log.info("%s: %d devices on %d GPUs", resource.name, len(resource.devices), len(resource.gpus))
        stop.wait()
        log.info("signal received, shutting down")
        manager.stop()
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
    except (ConfigError, InventoryError) as err:
        print(f"gpu-share: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
