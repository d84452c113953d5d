"""The `gpu-share` command: the parser and the dispatch to one module per subcommand.

Only light imports here and at the top of each subcommand module: a command imports what it needs when it runs,
so `config check` and `discover` never load grpc, prometheus or kubernetes, and `run` registers with the kubelet
before the heavy parts load.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from types import ModuleType

from .. import __version__
from ..config.types import ConfigError
from ..discovery.inventory import InventoryError
from ..errors import FlagError, StartupError
from . import admission_params, config_check, demo, discover, extender, flags, mps, run, simulate

log = logging.getLogger("gpu-share")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with `only` (a command name), only that command's arguments are built: the others' modules
    may import more to describe their flags (`simulate` loads the cluster package), which `run` must not pay for."""
    parser = argparse.ArgumentParser(prog="gpu-share", description="Kubernetes device plugin that shares GPUs safely.")
    parser.add_argument("--version", action="version", version=f"gpu-share {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(
        commands: argparse._SubParsersAction[argparse.ArgumentParser],
        name: str,
        module: ModuleType,
        top: str | None = None,
    ) -> None:
        command = commands.add_parser(name, help=module.HELP)
        if only is None or only == (top or name):
            module.add_arguments(command)
            command.set_defaults(func=module.run)

    add(sub, "run", run)
    add(sub, "mps", mps)
    config = sub.add_parser("config", help="config file tools")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    add(config_commands, "check", config_check, top="config")
    add(config_commands, "admission-params", admission_params, top="config")
    add(sub, "discover", discover)
    add(sub, "extender", extender)
    add(sub, "demo", demo)
    add(sub, "simulate", simulate)
    return parser


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _command(argv: list[str]) -> str | None:
    """The command named on the line (the first word not an option), or None (`--help`, `--version`, nothing)."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    command = _command(words)
    parser = build_parser(only=command)
    if command in flags.ENV_TWIN_COMMANDS:
        try:
            flags.apply_env_twins(_subcommand(parser, command))
        except FlagError as err:
            print(f"gpu-share: error: {err}", file=sys.stderr)
            return 2
    args = parser.parse_args(words)
    # gRPC's C core logs every GOAWAY of a restarting kubelet at INFO on stderr, outside our log format and
    # levels; keep it to errors unless the operator asks for more.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from ..logs import setup_logging

    setup_logging(args.log_level, args.log_format)
    try:
        return args.func(args)
    except BrokenPipeError:  # `gpu-share demo | head`: the reader is gone; nothing more to say, and no traceback
        os.dup2(
            os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno()
        )  # the interpreter's final flush must not fail again
        return 0
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
