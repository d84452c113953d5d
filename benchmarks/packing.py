"""Packing: every policy on openb trace variants (the FGD paper's protocol), the cost of `replicas`, time per run.

    python -m benchmarks.packing                                   # the five variants of docs/packing.md, seeds 42-51
    python -m benchmarks.packing --variants default --plot docs/packing-default.png
    python -m benchmarks.packing --variants default --policies fgd,fgdstrand --replicas 10,20,100
    python -m benchmarks.packing --trace-dir tests/traces --nodes toy_nodes.csv --variants toy --seeds 1-2   # seconds

Prints a Markdown table (allocation ratio % at 130 % demand, mean of the seeds, the paper's published mean
beside it) and, with --replicas, what rounding requests to 1/N-GPU shares costs. Trace: Weng et al.,
"Beware of Fragmentation", USENIX ATC 2023.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from deviceplugin.cluster.report import PUBLISHED, parse_policies, parse_seeds, plot, summarize
from deviceplugin.cluster.simulator import Experiment, RunResult, run_all
from deviceplugin.cluster.traces import CITATION, DEFAULT_NODES, POD_FILE, load_nodes, load_pods, resolve

VARIANTS = ("default", "cpu050", "gpushare60", "gpuspec20", "multigpu30")
POLICIES = "random,dotproduct,gpupacking,bestfit,fgd,fgdstrand,binpack,spread"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace-dir")
    parser.add_argument("--nodes", default=DEFAULT_NODES)
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated pod lists (openb_pod_list_NAME.csv)"
    )
    parser.add_argument("--policies", type=parse_policies, default=parse_policies(POLICIES))
    parser.add_argument("--seeds", type=parse_seeds, default=list(range(42, 52)))
    parser.add_argument("--replicas", default="", help="also run with requests rounded to 1/N shares, e.g. 10,20,100")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--plot", help="PNG of allocation against demand for the first variant")
    parser.add_argument("--json", help="write every run's figures here")
    args = parser.parse_args(argv)
    nodes = load_nodes(resolve(args.nodes, args.trace_dir, "openb_node_list_{}.csv"))
    replicas = [int(r) for r in args.replicas.split(",") if r.strip()]
    runs: list[dict] = []
    print(f"{len(nodes)} nodes; seeds {args.seeds[0]}-{args.seeds[-1]} ({len(args.seeds)}); demand 130 %; {CITATION}\n")
    header = "| trace | " + " | ".join(args.policies) + " |"
    print(header)
    print("|---" * (len(args.policies) + 1) + "|")
    first_results: list[RunResult] = []
    seconds: dict[str, list[float]] = {}
    for variant in args.variants.split(","):
        pods = load_pods(resolve(variant, args.trace_dir, POD_FILE))
        results = run_all(Experiment(nodes, pods), args.policies, args.seeds, args.jobs)
        first_results = first_results or results
        cells = []
        published = PUBLISHED.get(variant, {})
        for s in summarize(results):
            paper = f" ({published[s.policy]:.2f})" if s.policy in published else ""
            cells.append(f"{s.mean:.2f} ± {s.stdev:.2f}{paper}")
            seconds.setdefault(s.policy, []).append(s.seconds)
        print(f"| {variant} | " + " | ".join(cells) + " |", flush=True)
        runs += [_row(variant, None, r) for r in results]
    print("\nmean ± sd over seeds; (the paper's published mean)")
    print(
        "seconds per run (wall, mean over variants): "
        + ", ".join(f"{p} {statistics.fmean(v):.1f}" for p, v in seconds.items())
    )
    if replicas:
        variant = args.variants.split(",")[0]
        pods = load_pods(resolve(variant, args.trace_dir, POD_FILE))
        exact = {s.policy: s.mean for s in summarize(first_results)}
        print(f"\nreplicas on {variant}: allocation % of what pods asked for (loss against exact requests)")
        print("| replicas | " + " | ".join(args.policies) + " |")
        print("|---" * (len(args.policies) + 1) + "|")
        for n in replicas:
            results = run_all(Experiment(nodes, pods, replicas=n), args.policies, args.seeds, args.jobs)
            cells = [f"{s.mean:.2f} ({s.mean - exact[s.policy]:+.2f})" for s in summarize(results)]
            print(f"| {n} | " + " | ".join(cells) + " |", flush=True)
            runs += [_row(variant, n, r) for r in results]
    if args.plot:
        variant = args.variants.split(",")[0]
        plot(args.plot, first_results, f"openb {variant}: {len(nodes)} nodes, seeds {args.seeds[0]}-{args.seeds[-1]}")
        print(f"\nfigure: {args.plot}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"citation": CITATION, "seeds": args.seeds, "runs": runs}, indent=1) + "\n"
        )
    return 0


def _row(variant: str, replicas: int | None, r: RunResult) -> dict:
    return {
        "trace": variant,
        "replicas": replicas,
        "policy": r.policy,
        "seed": r.seed,
        "allocation_percent": 100 * r.allocation,
        "failed_pods": r.failed_pods,
        "seconds": round(r.seconds, 2),
    }


if __name__ == "__main__":
    started = time.perf_counter()
    code = main()
    print(f"\n({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    sys.exit(code)
