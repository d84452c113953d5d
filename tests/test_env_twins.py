"""Environment twins of the flags DaemonSets set: GPU_SHARE_<FLAG>, NVIDIA's names where the meaning is the same."""

from __future__ import annotations

import os
import subprocess

import pytest

from deviceplugin.cli import flags
from deviceplugin.cli.main import _subcommand, build_parser
from deviceplugin.errors import FlagError

from .conftest import EXAMPLES, GPU_CLI


def parse(command: str, environ: dict[str, str], *words: str):
    parser = build_parser()
    flags.apply_env_twins(_subcommand(parser, command), environ)
    return parser.parse_args([command, *words])


def test_twins_set_defaults_and_the_command_line_wins():
    args = parse(
        "run",
        {
            "CONFIG_FILE": "/etc/gpu-share/config.yaml",
            "FAIL_ON_INIT_ERROR": "false",
            "GPU_SHARE_METRICS_PORT": "0",
            "GPU_SHARE_RELOAD_INTERVAL": "2.5",
            "GPU_SHARE_LOG_FORMAT": "json",
        },
    )
    assert (args.config, args.fail_on_init_error, args.metrics_port, args.reload_interval, args.log_format) == (
        "/etc/gpu-share/config.yaml",
        False,
        0,
        2.5,
        "json",
    )
    args = parse(
        "run",
        {"GPU_SHARE_METRICS_PORT": "0", "CONFIG_FILE": "/a.yaml"},
        "--metrics-port",
        "9999",
        "--config-file",
        "/b.yaml",
    )
    assert (args.metrics_port, args.config) == (9999, "/b.yaml")
    assert (
        parse("run", {"GPU_SHARE_CONFIG": "/own.yaml", "CONFIG_FILE": "/nvidia.yaml"}).config == "/own.yaml"
    )  # ours first
    assert parse("extender", {"GPU_SHARE_DOMAIN": "acme.io", "GPU_SHARE_PORT": "8080"}).domain == "acme.io"
    assert parse("mps", {"GPU_SHARE_BACKOFF_MAX": "7"}).backoff_max == 7


@pytest.mark.parametrize(
    "environ, message",
    [
        (
            {"FAIL_ON_INIT_ERROR": "maybe"},
            "FAIL_ON_INIT_ERROR 'maybe': must be true or false, got 'maybe' (the environment twin of "
            "--fail-on-init-error)",
        ),
        (
            {"GPU_SHARE_LOG_FORMAT": "xml"},
            "GPU_SHARE_LOG_FORMAT 'xml': must be one of text, json (the environment twin of --log-format)",
        ),
        (
            {"GPU_SHARE_HEALTH_INTERVAL": "-1"},
            "GPU_SHARE_HEALTH_INTERVAL '-1': must be > 0, got -1 (the environment twin of --health-interval)",
        ),
    ],
)
def test_a_bad_twin_is_refused_naming_the_variable(environ, message):
    with pytest.raises(FlagError) as err:
        parse("run", environ)
    assert str(err.value) == message
    proc = subprocess.run([*GPU_CLI, "run"], env={**os.environ, **environ}, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and proc.stderr == f"gpu-share: error: {message}\n"


def test_only_the_daemons_read_twins():
    """`config check` and the other tools an operator runs by hand take their flags from the command line only."""
    proc = subprocess.run(
        [*GPU_CLI, "config", "check", str(EXAMPLES / "config" / "default.yaml")],
        env={**os.environ, "GPU_SHARE_LOG_FORMAT": "xml"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
