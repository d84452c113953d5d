"""Children of a process serving gRPC start reliably: gRPC's fork support would abort some of them (grpc/grpc#43055)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILDREN = 150

SCRIPT = textwrap.dedent(
    f"""
    import deviceplugin  # first, as every entry point does: it turns gRPC's fork support off before grpc loads
    import asyncio, sys, tempfile, threading
    from pathlib import Path
    import grpc, grpc.aio
    from deviceplugin.mps.control import MpsError, control
    from deviceplugin.mps.paths import MpsPaths

    socket = Path(tempfile.mkdtemp()) / "busy.sock"

    def busy() -> None:  # a server and a client calling it without pause: gRPC's poller always has work
        async def main() -> None:
            server = grpc.aio.server()
            server.add_insecure_port(f"unix:{{socket}}")
            await server.start()
            async with grpc.aio.insecure_channel(f"unix:{{socket}}") as channel:
                call = channel.unary_unary("/probe.Busy/Call")
                while True:
                    try:
                        await call(b"", timeout=0.05)
                    except grpc.aio.AioRpcError:
                        pass
        asyncio.run(main())

    threading.Thread(target=busy, daemon=True).start()
    paths = MpsPaths.of(tempfile.mkdtemp(), "pool")
    failures = []
    for _ in range({CHILDREN}):
        try:
            control("true", paths, ["get_server_list"], timeout=10)  # how the liveness probe spawns its client
        except MpsError as err:
            failures.append(str(err))
    print(len(failures), failures[:1])
    """
)


def test_control_clients_spawned_beside_a_busy_grpc_server_all_start():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[0] == "0", proc.stdout
