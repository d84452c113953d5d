"""Regenerate the committed gRPC stubs in deviceplugin/api from proto/*.proto.

Usage: python proto/generate.py            (rewrites deviceplugin/api)
       python proto/generate.py --check    (exits 1 when the committed stubs are stale)

Needs grpcio-tools (the `test` extra pins the version the stubs were made with).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
API_DIR = PROTO_DIR.parent / "deviceplugin" / "api"
PROTOS = (
    "deviceplugin.proto",
    "podresources.proto",
    "dra_v1.proto",  # k8s.io.kubelet.pkg.apis.dra.v1
    "dra_v1beta1.proto",  # k8s.io.kubelet.pkg.apis.dra.v1beta1
    "dra_health_v1alpha1.proto",  # v1alpha1.DRAResourceHealth
    "pluginregistration_v1.proto",  # pluginregistration.Registration
)


def generate(out_dir: Path) -> list[Path]:
    """Run protoc for every proto into out_dir; return the files written."""
    from grpc_tools import protoc  # imported here: only the generator needs grpcio-tools

    out_dir.mkdir(parents=True, exist_ok=True)
    for proto in PROTOS:
        args = [
            "protoc",
            f"-I{PROTO_DIR}",
            f"-I{Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(PROTO_DIR / proto),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
    written = sorted(out_dir.glob("*_pb2*.py*"))
    for path in written:
        # protoc emits top-level imports; the stubs live inside a package.
        text = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", path.read_text(), flags=re.M)
        path.write_text(text)
    return written


def stale_files() -> list[str]:
    """Names of committed stubs that differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_text() for p in generate(Path(tmp))}
    committed = {p.name: p.read_text() for p in API_DIR.glob("*_pb2*.py*")}
    return sorted(n for n in fresh.keys() | committed.keys() if fresh.get(n) != committed.get(n))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale stubs")
    if parser.parse_args().check:
        stale = stale_files()
        for name in stale:
            print(f"stale: deviceplugin/api/{name}")
        return 1 if stale else 0
    for path in generate(API_DIR):
        print(f"wrote {path.relative_to(PROTO_DIR.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
