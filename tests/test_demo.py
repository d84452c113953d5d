"""`gpu-share demo` on every shipped node and config: sample pods built from what the config yields there."""

from __future__ import annotations

import re

import pytest

from deviceplugin.cli.config_check import check_config
from deviceplugin.cli.demo import BUILTIN
from deviceplugin.config.types import ConfigError
from deviceplugin.sim.demo import run_demo

from .conftest import EXAMPLES

NODES = sorted((EXAMPLES / "nodes").glob("*.yaml")) + [BUILTIN / "demo-node.yaml"]
CONFIGS = sorted((EXAMPLES / "config").glob("*.yaml")) + [BUILTIN / "demo-config.yaml"]


def config_check_passes(node, config) -> bool:
    try:
        return check_config(str(config), str(node), None, False, out=lambda text: None) == 0
    except ConfigError:
        return False


def demo(node, config) -> tuple[int, list[str]]:
    lines: list[str] = []
    rc = run_demo(str(node), str(config), out=lambda text: lines.extend(str(text).splitlines()))
    return rc, lines


@pytest.mark.parametrize("node", NODES, ids=lambda p: p.stem)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_demo_runs_on_every_shipped_node_and_config(node, config):
    rc, lines = demo(node, config)
    text = "\n".join(lines)
    if not config_check_passes(node, config):  # the demo agrees with `config check`, and says why
        assert rc == 2, text
        assert lines[0].startswith("The plugin refuses this config on node") or lines[-1].startswith(
            "Nothing to show"
        ), text
        return
    assert rc == 0, text
    assert lines[-1] == "Done: sockets removed, temporary directory cleaned up."
    pods = text.split("Admitting sample pods built from these resources:")[1].split("\n\n")[0]
    advertised = set(re.findall(r"^  (\S+/\S+)\s+\d+\s+\d+$", text, flags=re.M))
    requested = set(re.findall(r" (\S+/\S+): \d+ ", pods))
    assert requested and requested <= advertised, (requested, advertised)  # only resources the node really has
    assert re.search(r"^  too-big .* REFUSED: ", pods, flags=re.M), pods  # the pod that cannot fit
    admission = re.search(
        r"^  too-big \((\d+) shares\) (.*)$", text, flags=re.M
    )  # the scheduler step, shared resources only
    if admission:
        assert f"more shares ({admission[1]}) than" in pods and "None" not in admission[2], (
            text
        )  # the same pod, a real answer
    if any(re.search(r"/mig-\d+g\.", r) for r in advertised):  # a mig-mode resource
        assert re.search(
            r"^  isolated +one MIG instance .* MIG instance +NVIDIA_VISIBLE_DEVICES=MIG-", pods, flags=re.M
        ), pods
    assert "GPU memory use is simulated" in text
    usage = text.split("USED MiB (simulated)")[1]
    for row in re.findall(r"^  (\S+) +main +\S+ +\d+ +(\d+) +(\d+)(.*)$", usage, flags=re.M):
        name, limit, used, over = row
        assert int(used) <= int(limit) * 1.1 + 1, row  # scaled to what the pod was given, never made up
        assert ("OVER LIMIT" in over) == (name == "chat-large"), row


def test_default_demo_shows_every_kind_of_pod():
    rc, lines = demo(BUILTIN / "demo-node.yaml", BUILTIN / "demo-config.yaml")
    assert rc == 0
    text = "\n".join(lines)
    for expected in (
        "  trainer     a whole GPU       ",
        "  isolated    one MIG instance  ",
        "  chat-small  one share         ",
        "  chat-large  3 shares, using more memory than they allow  example.com/gpu-share: 3",
        "shares 3/10, 24576 MiB, 30% compute",
        "  too-big     more shares (11) than one GPU has",
        "  too-big (11 shares) is refused at creation: container server asks for 11 "
        "example.com/gpu-share",  # the same pod
        "span 2 GPUs",
        "example.com/gpu-share GPU 2: 4/10 shares used",
    ):
        assert expected in text, text
    usage = text.split("USED MiB (simulated)")[1]
    assert re.search(r"chat-large +main +example.com/gpu-share +3 +24576 +27033 +OVER LIMIT", usage), usage
    assert re.search(r"trainer +main +example.com/gpu +1 +81920 +69632", usage), usage


def test_demo_shows_the_plugins_warnings():
    rc, lines = demo(EXAMPLES / "nodes" / "8xH100-80GB.yaml", EXAMPLES / "config" / "by-model.yaml")
    assert rc == 0
    assert "  warning: pool t4-shares has no usable GPU on this node; example.com/t4-share is not advertised" in lines


def test_demo_names_the_configs_allocation_policy():
    rc, lines = demo(
        EXAMPLES / "nodes" / "2xT4.yaml", EXAMPLES / "config" / "by-model.yaml"
    )  # allocationPolicy: spread
    assert rc == 0
    assert "Shares in use per GPU (spread puts each container on the emptiest GPU):" in lines


@pytest.mark.parametrize("limits", ["proportional", "strict"])
def test_demo_runs_mps_pools_with_a_simulated_control_daemon_and_shows_their_limits(limits, tmp_path):
    config = tmp_path / "mps.yaml"
    config.write_text(
        f"version: v1\npools: [{{name: mps, mode: shared, backend: mps, mpsLimits: {limits}, replicas: 4}}]\n"
    )
    rc, lines = demo(EXAMPLES / "nodes" / "2xT4.yaml", config)
    text = "\n".join(lines)
    assert rc == 0 and lines[-1] == "Done: sockets removed, temporary directory cleaned up.", text
    header = (
        "  MPS pool mps (example.com/gpu-share, mpsLimits "
        + limits
        + "): a simulated control daemon serves GPUs 0, 1; daemon-wide limits: "
    )
    small = next(line for line in lines if line.startswith("  chat-small"))
    if limits == "strict":  # the daemon holds 1/4 of the threads and of each T4's 15360 MiB
        assert (
            header + "set_default_active_thread_percentage 25; set_default_device_pinned_mem_limit 0 3840M; "
            "set_default_device_pinned_mem_limit 1 3840M" in lines
        )
        assert small.endswith("shares 1/4, 3840 MiB, 25% compute; MPS enforces the daemon-wide limits"), small
        assert "uses MPS with strict limits: one share per container, got 3" in text
    else:  # each client its own, from its shares
        assert header + "none (each client gets its own CUDA_MPS_* limits)" in lines
        assert small.endswith(
            "MPS enforces CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=3840M"
        ), small
        large = next(line for line in lines if line.startswith("  chat-large"))
        assert large.endswith(
            "MPS enforces CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=75 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=11520M"
        ), large
        assert "asking more memory than they allow: MPS holds them to it" in large
        used = next(line for line in lines if re.match(r"^  chat-large +main ", line)).split()
        assert used[4] == used[5] == "11520" and "OVER LIMIT" not in text  # MPS enforces: used never above the limit
    assert "Two other simulated nodes, not the one above: node-a and node-b, each two NVIDIA L4s" in text


def test_demo_with_a_node_and_no_config_serves_runs_default():
    import subprocess

    from .conftest import GPU_CLI

    proc = subprocess.run(
        [*GPU_CLI, "demo", "--node", str(EXAMPLES / "nodes" / "2xT4.yaml")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "config the default (every GPU shared in 10, as `gpu-share run` without --config)" in text
    assert re.search(r"^  example.com/gpu-share +20 +20$", text, flags=re.M), text
    assert "shares 1/10, 1536 MiB, 10% compute (time-sliced: a fair turn, not enforced)" in text


def test_demo_under_another_domain_never_says_example_com(tmp_path):
    config = tmp_path / "acme.yaml"
    config.write_text("version: v1\ndomain: acme.io\npools: [{name: s, mode: shared, replicas: 4}]\n")
    rc, lines = demo(EXAMPLES / "nodes" / "2xT4.yaml", config)
    text = "\n".join(lines)
    assert rc == 0 and "example.com" not in text, text
    assert "node-a: skipped: gpu-share: container server asks for 6 shares of acme.io/gpu-share on one GPU" in text
