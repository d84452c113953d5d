"""A simulated nvidia-cuda-mps-control for `gpu-share demo`: the commands gpu-share sends, without a GPU.

`-f`: the control daemon in the foreground. It makes $CUDA_MPS_PIPE_DIRECTORY/control (a FIFO), answers
`get_server_list` (no servers), keeps the `set_default_*` limits it is given in $CUDA_MPS_LOG_DIRECTORY/limits (one
command a line, what the demo shows) and exits on `quit`. No arguments: the client, forwarding stdin to the FIFO
and printing the answer, or failing as the real one does when no daemon runs.
Run as `python -m deviceplugin.sim.mps_control [-f]`; the demo puts a two-line wrapper on its path.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

LIMITS_FILE = "limits"  # in the log directory: the limit commands the daemon holds


def _pipe() -> Path:
    return Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"]) / "control"


def daemon() -> int:
    control, logs = _pipe(), Path(os.environ["CUDA_MPS_LOG_DIRECTORY"])
    logs.mkdir(parents=True, exist_ok=True)
    control.unlink(missing_ok=True)
    os.mkfifo(control)
    try:
        while True:
            with open(control) as fifo:  # blocks until a client writes
                data = fifo.read()
            replies, quit_ = [], False  # clients that wrote at once share one read
            for line in data.splitlines():
                if line.startswith("@"):
                    replies.append(line[1:])
                elif line.startswith("set_default_"):
                    with open(logs / LIMITS_FILE, "a") as held:
                        held.write(line.strip() + "\n")
                quit_ |= line.strip() == "quit"
            for reply in replies:
                Path(reply).write_text("")  # get_server_list: no servers; the limits: accepted
            if quit_:
                return 0
    finally:
        control.unlink(missing_ok=True)


def client() -> int:
    control = _pipe()
    if not control.exists():
        print("Cannot find MPS control daemon process", file=sys.stderr)
        return 1
    commands = sys.stdin.read()
    reply = control.parent / f"reply-{os.getpid()}"
    os.mkfifo(reply)
    try:
        with open(control, "w") as fifo:  # one write, under PIPE_BUF: messages of clients never interleave
            fifo.write(f"@{reply}\n{commands}")
        sys.stdout.write(reply.read_text())
        return 0
    finally:
        reply.unlink(missing_ok=True)


def wrapper(directory: Path) -> Path:
    """An executable `nvidia-cuda-mps-control` in `directory` running this module with this interpreter."""
    path = directory / "nvidia-cuda-mps-control"
    path.write_text(f"#!{sys.executable}\nfrom deviceplugin.sim.mps_control import main\nraise SystemExit(main())\n")
    path.chmod(0o755)
    return path


def main() -> int:
    if sys.argv[1:] == ["-f"]:
        return daemon()
    if not sys.argv[1:]:
        return client()
    print(f"unsupported arguments {sys.argv[1:]}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
