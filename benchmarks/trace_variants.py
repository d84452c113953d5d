"""Pod-list variants of the openb trace, drawn from the default list by the rules the FGD paper's variants follow
(measured on its published lists; Weng et al., USENIX ATC 2023):

    python -m benchmarks.trace_variants gpushare40 [--seed 0] [--out DIR]   # writes DIR/openb_pod_list_gpushare40.csv

- gpushare<N>: the CPU-only pods kept; as many GPU pods, drawn with replacement from the default list's fractional
  pods (one GPU, under 1000 milli) and whole-GPU pods so that the fractional ones ask N % of the GPU milli.
- multigpu<N>: the default list plus multi-GPU pods drawn from its own until they ask N % of the GPU milli.
- cpu<N>: the GPU pods kept; CPU-only pods drawn from the default list's until their CPU is N % of the default
  CPU-only pods' CPU (the published cpu<N> lists scale it alike, not on this exact base).
gpuspec<N> lists add GPU-model constraints, which the real-scheduler benchmark drops: for it they are the default list.
"""

from __future__ import annotations

import argparse
import csv
import random
import re
import sys
from pathlib import Path

from deviceplugin.cluster import MILLI, PodDemand
from deviceplugin.cluster.traces import POD_FILE, load_pods, resolve


def _milli(p: PodDemand) -> int:
    return p.num_gpu * p.gpu_milli


def variant(pods: list[PodDemand], name: str, rng: random.Random) -> list[PodDemand]:
    """The pod list `name` (gpushareN, multigpuN, cpuN) drawn from `pods` (the default list)."""
    match = re.fullmatch(r"(gpushare|multigpu|cpu)(\d{1,3})", name)
    if match is None:
        raise SystemExit(f"variant {name!r}: expected gpushare<N>, multigpu<N> or cpu<N>")
    family, percent = match[1], int(match[2]) / 100
    cpu_only = [p for p in pods if not p.num_gpu]
    gpu = [p for p in pods if p.num_gpu]
    if family == "gpushare":
        share = [p for p in gpu if p.num_gpu == 1 and p.gpu_milli < MILLI]
        other = [p for p in gpu if p not in share]
        out: list[PodDemand] = []
        share_milli = total = 0
        for _ in gpu:
            pick = rng.choice(share if other == [] or share_milli < percent * total else other)
            share_milli += _milli(pick) if pick.gpu_milli < MILLI and pick.num_gpu == 1 else 0
            total += _milli(pick)
            out.append(pick)
        return cpu_only + out
    if family == "multigpu":
        multi = [p for p in gpu if p.num_gpu > 1]
        total, multi_milli, extra = sum(map(_milli, gpu)), sum(map(_milli, multi)), []
        while multi_milli < percent * total and percent < 1:
            pick = rng.choice(multi)
            extra.append(pick)
            total, multi_milli = total + _milli(pick), multi_milli + _milli(pick)
        return pods + extra
    target, drawn, cpu = percent * sum(p.cpu_milli for p in cpu_only), [], 0
    while cpu < target:
        pick = rng.choice(cpu_only)
        drawn.append(pick)
        cpu += pick.cpu_milli
    return gpu + drawn


def write(pods: list[PodDemand], path: Path) -> None:
    with path.open("w", newline="") as handle:
        out = csv.writer(handle)
        out.writerow(["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"])
        for i, p in enumerate(pods):
            out.writerow([f"openb-pod-{i:04d}", p.cpu_milli, p.memory_mib, p.num_gpu, p.gpu_milli])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="gpushare<N>, multigpu<N> or cpu<N>")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace-dir")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    pods = load_pods(resolve("default", args.trace_dir, POD_FILE))
    path = args.out / POD_FILE.format(args.name)
    made = variant(pods, args.name, random.Random(args.seed))
    rng = random.Random(args.seed + 1)
    rng.shuffle(made)
    write(made, path)
    print(f"{path}: {len(made)} pods")
    return 0


if __name__ == "__main__":
    sys.exit(main())
