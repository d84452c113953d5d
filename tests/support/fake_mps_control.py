"""A stand-in for nvidia-cuda-mps-control that speaks the commands gpu-share uses.

`-f`: the control daemon in the foreground. It makes $CUDA_MPS_PIPE_DIRECTORY/control (a FIFO), writes its
pid to $CUDA_MPS_LOG_DIRECTORY/daemon.pid (and appends it to daemons.log there), appends every command it reads to
control.log, answers `get_server_list` (no servers: an empty list), stops reading after `hang` (alive but not
answering, like a wedged daemon), and exits on `quit`, refusing clients that wrote together with it. A SIGKILLed daemon
leaves its FIFO behind, as the real one leaves its pipe: a client then blocks on it.
No arguments: the client. It forwards stdin to the FIFO and prints the daemon's answers, or fails like the real
one when no daemon runs. Test hooks: $FAKE_MPS_FAIL=<command> makes the client fail that command,
$FAKE_MPS_SLOW=<command> makes it hang on that command.
"""

import os
import sys
import time
from pathlib import Path

pipe = Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
logs = Path(os.environ["CUDA_MPS_LOG_DIRECTORY"])
control = pipe / "control"


def daemon() -> None:
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "daemon.pid").write_text(str(os.getpid()))
    with open(logs / "daemons.log", "a") as log:
        log.write(f"{os.getpid()}\n")
    with open(logs / "control.log", "a") as log:
        log.write(f"start CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')}\n")
    control.unlink(missing_ok=True)
    os.mkfifo(control)
    try:
        done = False
        while not done:
            with open(control) as fifo:  # blocks until a client writes
                data = fifo.read()
            for reply_path, commands in messages(data):  # clients that wrote at once arrive in one read
                if done:  # after `quit`: refused, as a quitting daemon refuses clients
                    answer(reply_path, "!the MPS control daemon is shutting down")
                    continue
                answers = []
                for line in commands:
                    with open(logs / "control.log", "a") as log:
                        log.write(line + "\n")
                    command = line.strip()
                    done |= command == "quit"
                    if command == "hang":
                        while True:
                            time.sleep(3600)
                    if command == "get_server_list":
                        answers.append("")
                answer(reply_path, "\n".join(answers))
        sys.exit(0)
    finally:
        control.unlink(missing_ok=True)


def messages(data: str) -> list[tuple[str | None, list[str]]]:
    """One read of the FIFO as the clients' messages: each starts with its `@<reply FIFO>` line (each client writes
    its message with one write, under PIPE_BUF, so messages never interleave; several can share a read)."""
    found: list[tuple[str | None, list[str]]] = []
    for line in data.splitlines():
        if line.startswith("@"):
            found.append((line[1:], []))
        elif found:
            found[-1][1].append(line)
        else:
            found.append((None, [line]))  # a writer without a reply FIFO
    return found


def answer(reply_path: str | None, text: str) -> None:
    if reply_path:
        with open(reply_path, "w") as reply:
            reply.write(text)


def client() -> None:
    if not control.exists():
        print("Cannot find MPS control daemon process", file=sys.stderr)
        sys.exit(1)
    commands = sys.stdin.read()
    for line in commands.splitlines():
        if line.strip() and line.split()[0] == os.environ.get("FAKE_MPS_FAIL"):
            print(f"{line.split()[0]} failed", file=sys.stderr)
            sys.exit(1)
        if line.strip() and line.split()[0] == os.environ.get("FAKE_MPS_SLOW"):
            time.sleep(3600)
    reply = pipe / f"reply-{os.getpid()}"
    os.mkfifo(reply)
    try:
        with open(control, "w") as fifo:  # blocks while no daemon reads the pipe
            fifo.write(f"@{reply}\n{commands}")
        with open(reply) as answered:
            text = answered.read()
        if text.startswith("!"):  # the daemon refused this client
            print(text[1:], file=sys.stderr)
            sys.exit(1)
        sys.stdout.write(text)
    finally:
        reply.unlink(missing_ok=True)


if sys.argv[1:] == ["-f"]:
    daemon()
elif not sys.argv[1:]:
    client()
else:
    print(f"unsupported arguments {sys.argv[1:]}", file=sys.stderr)
    sys.exit(2)
