"""agent.watchdog with a kill check (the DRA driver's): `kill` runs only where the check passes, is asked again when
a reload switches to `kill`, and otherwise reports each episode once, saying why it did not kill."""

from __future__ import annotations

from typing import Any

from deviceplugin.agent.watchdog import ContainerMemory, MemoryWatchdog
from deviceplugin.config.parse import parse_config
from deviceplugin.model.usage import ContainerShare

SHARE = ContainerShare("ns", "p", "c", "example.com/gpu-share", "s", "GPU-0", "GPU-0", ("d",), 2, 7680, True)
OVER = [ContainerMemory(SHARE, 9000, (501, 502))]


def _config(policy: str) -> Any:
    return parse_config(
        {
            "version": "v1",
            "memoryWatchdog": {"policy": policy},
            "pools": [{"name": "s", "mode": "shared", "replicas": 4}],
        }
    )


def test_kill_blocked_reports_once_per_episode_and_says_why() -> None:
    events: list[tuple[str, str, str, str]] = []
    killed: list[int] = []
    watchdog = MemoryWatchdog(
        "kill", events=lambda *e: events.append(e), kill=killed.append, kill_check=lambda: "no hostPID"
    )
    watchdog.review(OVER)
    watchdog.review(OVER)  # the same episode: no second Event
    assert killed == [] and watchdog.kills == 0 and watchdog.kills_refused == 1
    ((namespace, pod, reason, message),) = events
    assert (namespace, pod, reason) == ("ns", "p", "GPUMemoryOverLimit") and message.endswith(
        "; not killed: no hostPID"
    )


def test_the_check_is_asked_when_a_reload_switches_to_kill_and_a_passing_check_kills() -> None:
    asked: list[str] = []
    killed: list[int] = []

    def check() -> str | None:
        asked.append("asked")
        return None

    watchdog = MemoryWatchdog("report", kill=killed.append, kill_check=check)
    assert asked == []  # report needs no check
    watchdog.on_config(_config("kill"), [])
    watchdog.on_config(_config("kill"), [])  # no change: not asked again
    assert asked == ["asked"] and watchdog.kill_blocked is None
    watchdog.review(OVER)
    assert killed == [501, 502] and watchdog.kills == 2 and watchdog.kills_refused == 0
