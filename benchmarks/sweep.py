"""Scheduler settings across trace families and seeds: benchmarks/kube_scheduler.py on each sample, each against
`gpu-share simulate` (fgdstrand) on the same sample.

    python -m benchmarks.sweep --quick   # development: default and gpushare60, seed 44, 16 nodes, 3 configurations
    python -m benchmarks.sweep [--traces default,cpu235,gpushare60,gpuspec25,multigpu40] [--seeds 42,43,44] \
        [--nodes 32] [--configs dp-none,shipped,dra-shipped,...] [--pace] [--shapes trace|learned] [--json FILE]
        # ~40 s a configuration and sample on 2 cores

Per configuration: the mean and the worst (lowest) allocation % minus simulate's at 100 % and 130 % demand over
every sample, the same against the mean of simulate over 8 other node orders (simulate breaks ties by its node
order, and one draw is itself up to ~2 points off that mean at 130 %, up to ~8 at 100 %), the fewest points above
the plain scheduler (dp-none / dra-none, when run), and failed admissions summed. A trace is a pod-list name of the
trace directory (openb_pod_list_<name>.csv) or a CSV path: an operator passes their own pods
(name,cpu_milli,memory_mib,num_gpu,gpu_milli) to choose weights for their cluster.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from . import kube_scheduler

QUICK = {"traces": "default,gpushare60", "seeds": "44", "nodes": 16, "configs": "dp-none,shipped,dra-shipped"}
FULL = {
    "traces": "default,cpu235,gpushare60,gpuspec25,multigpu40",
    "seeds": "42,43,44",
    "nodes": 32,
    "configs": "dp-none,dp-shipped,dp-w5-least,dp-w20e20-least,dra-none,dra-shipped",
}


def summarise(samples: list[dict]) -> list[dict]:
    """Per configuration over the samples: mean and worst gap to simulate at 100 % and 130 %, and at 130 % to the
    mean of simulate over other node orders (its tie-breaks), the worst margin over the plain scheduler of its path
    at 130 %, failed admissions."""
    rows: dict[str, dict] = {}
    for data in samples:
        by_key = {r["config"]: r for r in data["results"]}
        for r in data["results"]:
            row = rows.setdefault(
                r["config"],
                {
                    "config": r["config"],
                    "label": r["label"],
                    "gap100": [],
                    "gap130": [],
                    "gap_orders100": [],
                    "gap_orders": [],
                    "over_plain": [],
                    "failed": 0,
                },
            )
            row["gap100"].append(r["allocation_100"] - data["simulated"]["100"])
            row["gap130"].append(r["allocation_130"] - data["simulated"]["130"])
            row["gap_orders100"].append(r["allocation_100"] - data["simulated"]["orders100"])
            row["gap_orders"].append(r["allocation_130"] - data["simulated"]["orders130"])
            plain = by_key.get("dra-none" if r["config"].startswith("dra") else "dp-none")
            if plain is not None:
                row["over_plain"].append(r["allocation_130"] - plain["allocation_130"])
            row["failed"] += r["failed_admissions"]
    out = []
    for row in rows.values():
        out.append(
            {
                "config": row["config"],
                "label": row["label"],
                "samples": len(row["gap130"]),
                "mean100": sum(row["gap100"]) / len(row["gap100"]),
                "worst100": min(row["gap100"]),
                "mean130": sum(row["gap130"]) / len(row["gap130"]),
                "worst130": min(row["gap130"]),
                "mean_orders100": sum(row["gap_orders100"]) / len(row["gap_orders100"]),
                "worst_orders100": min(row["gap_orders100"]),
                "mean_orders": sum(row["gap_orders"]) / len(row["gap_orders"]),
                "worst_orders": min(row["gap_orders"]),
                "over_plain": min(row["over_plain"]) if row["over_plain"] else None,
                "failed": row["failed"],
            }
        )
    return sorted(out, key=lambda r: -r["worst130"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"the development subset: {QUICK}")
    parser.add_argument("--traces", help=f"comma-separated pod lists (default {FULL['traces']})")
    parser.add_argument("--seeds", help=f"comma-separated (default {FULL['seeds']})")
    parser.add_argument("--nodes", type=int, help=f"nodes a sample (default {FULL['nodes']})")
    parser.add_argument("--configs", help=f"kube_scheduler configurations (default {FULL['configs']})")
    parser.add_argument("--trace-dir")
    parser.add_argument("--pace", action="store_true", help="paced arrivals (kube_scheduler --pace): rank by policy")
    parser.add_argument(
        "--shapes", choices=("trace", "learned"), default="trace", help="the extender's task shapes (kube_scheduler)"
    )
    parser.add_argument("--logs", type=Path, help="each sample's logs (kube_scheduler --logs) in FOLDER/TRACE-SEED")
    parser.add_argument("--json", type=Path, help="write every sample's results and the summary here")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else FULL
    traces = (args.traces or base["traces"]).split(",")
    seeds = [int(s) for s in (args.seeds or base["seeds"]).split(",")]
    nodes = args.nodes or int(base["nodes"])
    configs = args.configs or str(base["configs"])
    kube_scheduler.config_keys(configs)  # an unknown key fails before any sample runs
    samples = []
    with tempfile.TemporaryDirectory() as work:
        for trace in traces:
            for seed in seeds:
                out = Path(work) / f"{len(samples)}.json"
                extra = (["--trace-dir", args.trace_dir] if args.trace_dir else []) + (["--pace"] if args.pace else [])
                extra += ["--shapes", args.shapes]
                extra += ["--logs", str(args.logs / f"{Path(trace).stem}-{seed}")] if args.logs else []
                kube_scheduler.main(
                    [
                        "--trace",
                        trace,
                        "--seed",
                        str(seed),
                        "--nodes",
                        str(nodes),
                        "--configs",
                        configs,
                        "--json",
                        str(out),
                        *extra,
                    ]
                )
                if not out.exists():  # skipped: no control-plane binaries
                    return 0
                samples.append(json.loads(out.read_text()))
    summary = summarise(samples)
    print(
        f"\nsweep: {len(samples)} samples ({', '.join(traces)} x seeds {', '.join(map(str, seeds))}, {nodes} nodes, "
        f"extender task shapes: {args.shapes}); points against simulate"
    )
    print(
        "| configuration | mean at 100 % | worst at 100 % | mean at 130 % | worst at 130 % "
        "| mean / worst against simulate's tie-order mean at 100 % | at 130 % | worst over the plain scheduler (130 %) "
        "| failed admissions |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in summary:
        plain = "–" if r["over_plain"] is None else f"{r['over_plain']:+.2f}"
        print(
            f"| {r['label']} | {r['mean100']:+.2f} | {r['worst100']:+.2f} | {r['mean130']:+.2f} "
            f"| {r['worst130']:+.2f} | {r['mean_orders100']:+.2f} / {r['worst_orders100']:+.2f} "
            f"| {r['mean_orders']:+.2f} / {r['worst_orders']:+.2f} | {plain} | {r['failed']} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"samples": samples, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
