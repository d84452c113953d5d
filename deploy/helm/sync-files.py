#!/usr/bin/env python3
"""Copy the kustomization's files the chart reads into deploy/helm/gpu-share/files/ (no symlinks: a packaged or
copied chart carries them). `--check`: exit 1, naming each file that differs, instead of writing.
Run after editing any source below; tests/test_chart.py runs `--check`."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILES = ROOT / "deploy" / "helm" / "gpu-share" / "files"
SOURCES = {  # the chart's file: its source under daemonset/
    "admission-policy.yaml": "admission/policy.yaml",
    "config.yaml": "config/config.yaml",
    "gpu-share-dashboard.json": "grafana/gpu-share-dashboard.json",
    "dra/01-rbac.yaml": "dra/01-rbac.yaml",
    "dra/02-deviceclasses.yaml": "dra/02-deviceclasses.yaml",
    "dra/04-slice-policy.yaml": "dra/04-slice-policy.yaml",
    "dra/05-share-mapping-policy.yaml": "dra/05-share-mapping-policy.yaml",
    "dra/06-capacity-policy.yaml": "dra/06-capacity-policy.yaml",
    "dra/07-node-patch-policy.yaml": "dra/07-node-patch-policy.yaml",
    "dra/dra-only-policy.yaml": "dra/optional/dra-only/share-requests-policy.yaml",
}


def main(argv: list[str]) -> int:
    check = argv == ["--check"]
    stale = []
    for name, source in SOURCES.items():
        target, data = FILES / name, (ROOT / "daemonset" / source).read_bytes()
        if target.is_symlink() or not target.is_file() or target.read_bytes() != data:
            stale.append(f"{target.relative_to(ROOT)} (from daemonset/{source})")
            if not check:
                target.unlink(missing_ok=True)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
    if check and stale:
        print("stale, run deploy/helm/sync-files.py: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
