"""A stand-in for nvidia-cuda-mps-control that speaks the commands gpu-share uses.

`-f`: the control daemon in the foreground. It makes $CUDA_MPS_PIPE_DIRECTORY/control (a FIFO), writes its
pid and $CUDA_VISIBLE_DEVICES to $CUDA_MPS_LOG_DIRECTORY, appends every command it reads to
control.log there, and exits on `quit`.
No arguments: the client. It forwards stdin to the FIFO, or fails like the real one when no daemon runs.
"""

import os
import sys
from pathlib import Path

pipe = Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
logs = Path(os.environ["CUDA_MPS_LOG_DIRECTORY"])
control = pipe / "control"

if sys.argv[1:] == ["-f"]:
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "daemon.pid").write_text(str(os.getpid()))
    with open(logs / "control.log", "a") as log:
        log.write(f"start CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')}\n")
    control.unlink(missing_ok=True)
    os.mkfifo(control)
    try:
        while True:
            with open(control) as fifo:  # blocks until a client writes
                for line in fifo:
                    with open(logs / "control.log", "a") as log:
                        log.write(line)
                    if line.strip() == "quit":
                        sys.exit(0)
    finally:
        control.unlink(missing_ok=True)
elif not sys.argv[1:]:
    if not control.exists():
        print("Cannot find MPS control daemon process", file=sys.stderr)
        sys.exit(1)
    with open(control, "w") as fifo:
        fifo.write(sys.stdin.read())
else:
    print(f"unsupported arguments {sys.argv[1:]}", file=sys.stderr)
    sys.exit(2)
