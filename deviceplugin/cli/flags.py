"""Flag types and the flag groups several subcommands share (logging, the node's plan)."""

from __future__ import annotations

import argparse
import ipaddress
import os
from collections.abc import Mapping

from ..errors import FlagError, check_readable_file

# NVIDIA's device plugin's environment variables where a flag means the same (its --config-file, --fail-on-init-error).
NVIDIA_ENV = {"--config": "CONFIG_FILE", "--fail-on-init-error": "FAIL_ON_INIT_ERROR"}
ENV_TWIN_COMMANDS = ("run", "mps", "extender")  # what DaemonSets and Deployments run


def env_twin(option: str) -> str:
    """The environment twin of a flag: `--reload-interval` -> GPU_SHARE_RELOAD_INTERVAL."""
    return "GPU_SHARE_" + option[2:].upper().replace("-", "_")


def apply_env_twins(command: argparse.ArgumentParser, environ: Mapping[str, str] = os.environ) -> None:
    """Defaults from the environment for every flag of `command` that takes a value: GPU_SHARE_<FLAG>, or NVIDIA's name
    (NVIDIA_ENV) where it has one; a flag on the command line still wins. A bad value is a FlagError naming the
    variable."""
    for action in command._actions:
        option = next((o for o in action.option_strings if o.startswith("--")), None)
        if option is None or action.nargs == 0:
            continue
        for name in (env_twin(option), NVIDIA_ENV.get(option)):
            if name is None or name not in environ:
                continue
            value = environ[name]
            try:
                converted = action.type(value) if callable(action.type) else value
            except (argparse.ArgumentTypeError, ValueError) as err:
                raise FlagError(name, repr(value), str(err), f"the environment twin of {option}") from None
            if action.choices is not None and converted not in action.choices:
                raise FlagError(
                    name,
                    repr(value),
                    f"must be one of {', '.join(map(str, action.choices))}",
                    f"the environment twin of {option}",
                )
            action.default = converted
            break


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def boolean(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"must be true or false, got {text!r}")


def port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0-65535 (0 disables), got {text!r}")
    return int(text)


def ip_address(text: str) -> str:
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an IP address such as 0.0.0.0, :: or 10.1.2.3, got {text!r}"
        ) from None


def xid_list(text: str) -> frozenset[int]:
    try:
        return frozenset(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated XID numbers, got {text!r}") from None


def name_list(text: str) -> frozenset[str]:
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"must be comma-separated pool names, got {text!r}")
    return names


def dir_list(text: str) -> tuple[str, ...]:
    dirs = tuple(d.strip() for d in text.split(",") if d.strip())
    if not dirs or not all(d.startswith("/") for d in dirs):
        raise argparse.ArgumentTypeError(f"must be comma-separated absolute directories, got {text!r}")
    return dirs


def add_logging(command: argparse.ArgumentParser, level: str = "info") -> None:
    command.add_argument("--log-level", default=level, choices=["debug", "info", "warning", "error"])
    command.add_argument("--log-format", default="text", choices=["text", "json"])


def add_plan(command: argparse.ArgumentParser) -> None:
    """What `run` and `mps` plan from: the config, the node, the profile (and the API, for the profile label)."""
    command.add_argument(
        "--config",
        "--config-file",
        dest="config",
        help="config file (default: every GPU shared, 10 shares each); "
        "--config-file is NVIDIA's name for it (a gpu-share config, not NVIDIA's format: docs/migration.md)",
    )
    command.add_argument("--node", help="simulated node description file (default: real GPUs through NVML)")
    command.add_argument(
        "--profile",
        help="config profile to serve (default: the node label <domain>/gpu-share.config, else defaultProfile)",
    )
    command.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config, then ~/.kube/config)")


def check_plan_flags(args: argparse.Namespace) -> None:
    for flag, value in (("--config", args.config), ("--node", args.node), ("--kubeconfig", args.kubeconfig)):
        if value:
            check_readable_file(flag, value)
