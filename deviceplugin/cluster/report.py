"""`gpu-share simulate`: run the packing experiment and print, save and plot what it found."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from .policies import POLICIES
from .traces import CITATION, DEFAULT_NODES, POD_FILE, TraceError, load_nodes, load_pods, resolve

if TYPE_CHECKING:  # the simulator (and multiprocessing) load only when a simulation runs, not with the CLI parser
    from .simulator import RunResult

MAX_SEEDS = 1000

# The allocation ratio (%) at 130 % the paper's authors published, mean of seeds 42-51, per variant they published
# (docs/packing.md#reproduction-and-results).
PUBLISHED = {
    "default": {"random": 87.47, "dotproduct": 90.85, "gpupacking": 92.00, "bestfit": 93.08, "fgd": 95.39},
    "cpu050": {"random": 91.24, "dotproduct": 93.27, "gpupacking": 93.72, "bestfit": 93.79, "fgd": 95.21},
    "cpu100": {"random": 89.11, "dotproduct": 91.95, "gpupacking": 92.72, "bestfit": 93.44, "fgd": 95.35},
    "gpushare60": {"random": 83.65, "dotproduct": 87.11, "gpupacking": 87.45, "bestfit": 89.36, "fgd": 91.40},
    "gpushare100": {"random": 79.44, "dotproduct": 82.42, "gpupacking": 82.57, "bestfit": 85.01, "fgd": 86.90},
    "gpuspec20": {"random": 87.24, "dotproduct": 89.97, "gpupacking": 92.94, "bestfit": 93.30, "fgd": 94.84},
    "multigpu30": {"random": 89.27, "dotproduct": 93.28, "gpupacking": 94.87, "bestfit": 94.72, "fgd": 96.46},
}


def parse_seeds(text: str) -> list[int]:
    """`42-51`, `1,5,9` or a mix: the seeds, in order, without repeats."""
    seeds: list[int] = []
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            first, last = int(low), int(high or low)
            if last < first:
                raise ValueError
            seeds.extend(range(first, last + 1))
            if len(seeds) > MAX_SEEDS:
                raise argparse.ArgumentTypeError(f"at most {MAX_SEEDS} seeds, got more in {text!r}")
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be seeds like 42-51 or 1,2,3, got {text!r}") from None
    return list(dict.fromkeys(seeds))


def parse_policies(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown policy {', '.join(unknown) or '(none)'}; choose from {', '.join(POLICIES)}"
        )
    return list(dict.fromkeys(names))


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace-dir",
        help="folder with the openb CSVs (default: $GPU_SHARE_TRACE_DIR, else shared/traces/alibaba-gpu-v2023 "
        "here or beside the checkout)",
    )
    parser.add_argument(
        "--nodes", default=DEFAULT_NODES, metavar="CSV", help=f"node list (default {DEFAULT_NODES} in the trace folder)"
    )
    parser.add_argument(
        "--pods",
        default="default",
        metavar="CSV|NAME",
        help="pod list: a CSV file, or NAME for openb_pod_list_NAME.csv in the trace folder (default: default)",
    )
    parser.add_argument(
        "--policy",
        type=parse_policies,
        default=["fgd"],
        metavar="LIST",
        help=f"comma-separated policies: {', '.join(POLICIES)} (default fgd)",
    )
    parser.add_argument(
        "--seeds",
        type=parse_seeds,
        default=list(range(42, 52)),
        metavar="SEEDS",
        help="seeds, e.g. 42-51 (the paper's; default) or 1,2,3",
    )
    parser.add_argument(
        "--inflate",
        type=float,
        default=1.3,
        metavar="X",
        help="demand as a multiple of GPU capacity, read there (default 1.3)",
    )
    parser.add_argument(
        "--replicas",
        type=positive_int,
        metavar="N",
        help="round every fractional request up to whole shares of 1/N GPU",
    )
    parser.add_argument("--jobs", type=positive_int, default=1, metavar="N", help="runs in parallel (default 1)")
    parser.add_argument("--json", metavar="FILE", help="also write every run's figures to this JSON file")
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw allocation against arrived demand, one line per policy (needs the [plot] extra)",
    )


@dataclass(frozen=True)
class Summary:
    policy: str
    mean: float  # allocation ratio %, mean over seeds
    stdev: float
    low: float
    high: float
    unallocated_gpus: float
    failed_pods: float
    seconds: float  # mean wall time per run

    @classmethod
    def of(cls, runs: list[RunResult]) -> Summary:
        ratios = [100 * r.allocation for r in runs]
        return cls(
            runs[0].policy,
            statistics.fmean(ratios),
            statistics.stdev(ratios) if len(ratios) > 1 else 0.0,
            min(ratios),
            max(ratios),
            statistics.fmean(r.unallocated_gpus for r in runs),
            statistics.fmean(r.failed_pods for r in runs),
            statistics.fmean(r.seconds for r in runs),
        )


def summarize(results: list[RunResult]) -> list[Summary]:
    by_policy: dict[str, list[RunResult]] = {}
    for r in results:
        by_policy.setdefault(r.policy, []).append(r)
    return [Summary.of(runs) for runs in by_policy.values()]


def render(summaries: list[Summary], trace: str, published: dict[str, float]) -> str:
    head = (
        f"{'policy':<12} {'alloc %':>8} {'sd':>5} {'min':>6} {'max':>6} {'paper':>6} "
        f"{'unalloc GPUs':>12} {'failed pods':>11} {'s/run':>6}"
    )
    lines = [head]
    for s in summaries:
        paper = f"{published[s.policy]:6.2f}" if s.policy in published else f"{'-':>6}"
        lines.append(
            f"{s.policy:<12} {s.mean:8.2f} {s.stdev:5.2f} {s.low:6.2f} {s.high:6.2f} {paper} "
            f"{s.unallocated_gpus:12.1f} {_count(s.failed_pods):>11} {s.seconds:6.2f}"
        )
    if published:
        lines.append(f"paper: the published mean for trace {trace}.")
    lines.append(CITATION)
    return "\n".join(lines)


class ProgressBar:
    """`[#####.....] 12/70 runs, 34 s` on one stderr line; silent when the stream is not a terminal."""

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 30) -> None:
        self.total, self.done, self.width = total, 0, width
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = stream is not None or sys.stderr.isatty()
        self.started = time.monotonic()

    def advance(self, _result: RunResult | None = None) -> None:
        self.done += 1
        if not self.enabled:
            return
        filled = self.width * self.done // self.total
        self.stream.write(
            f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
            f"runs, {time.monotonic() - self.started:.0f} s"
        )
        if self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


def write_json(path: str, results: list[RunResult], summaries: list[Summary], about: dict) -> None:
    document = {
        **about,
        "citation": CITATION,
        "summary": [vars(s) for s in summaries],
        "runs": [
            {
                "policy": r.policy,
                "seed": r.seed,
                "allocation_percent": 100 * r.allocation,
                "unallocated_gpus": r.unallocated_gpus,
                "failed_pods": r.failed_pods,
                "arrived_pods": r.arrived_pods,
                "seconds": r.seconds,
            }
            for r in results
        ],
    }
    Path(path).write_text(json.dumps(document, indent=2) + "\n")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TraceError("--plot needs matplotlib: pip install 'gpu-share[plot]'") from None
    return plt


def plot(path: str, results: list[RunResult], title: str) -> None:
    """Mean allocation ratio over seeds against arrived demand, one line per policy."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.5))
    by_policy: dict[str, list[RunResult]] = {}
    for r in results:
        by_policy.setdefault(r.policy, []).append(r)
    for policy, runs in by_policy.items():
        length = min(len(r.curve) for r in runs)
        mean = [100 * statistics.fmean(r.curve[k] for r in runs) for k in range(length)]
        axes.plot(range(length), mean, label=f"{policy} ({statistics.fmean(100 * r.allocation for r in runs):.2f} %)")
    axes.set_xlabel("arrived GPU demand (% of capacity)")
    axes.set_ylabel("GPU allocation ratio (%)")
    axes.set_title(title, fontsize=9)
    axes.set_xlim(60, None)
    axes.set_ylim(60, 100)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="lower right")
    figure.text(0.01, 0.01, "Trace: Weng et al., USENIX ATC 2023 (Alibaba openb)", fontsize=7, alpha=0.7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _count(mean: float) -> str:
    """A mean of counts over the seeds: whole when every run had the same (2607, not 2607.0)."""
    return f"{mean:.0f}" if mean.is_integer() else f"{mean:.1f}"


def run_simulate(args: argparse.Namespace) -> int:
    """The `gpu-share simulate` command."""
    from .simulator import Experiment, run_all

    try:
        nodes_path = resolve(args.nodes, args.trace_dir, "openb_node_list_{}.csv")
        pods_path = resolve(args.pods, args.trace_dir, POD_FILE)
        nodes, pods = load_nodes(nodes_path), load_pods(pods_path)
        experiment = Experiment(nodes, pods, args.inflate, args.replicas)
        if args.plot:
            _pyplot()  # fail before the runs, not after
    except (TraceError, ValueError) as err:
        print(f"gpu-share: error: {err}", file=sys.stderr)
        return 2
    trace = pods_path.stem.removeprefix("openb_pod_list_")
    rounding = f", requests rounded to 1/{args.replicas} GPU" if args.replicas else ""
    about = {
        "nodes": str(nodes_path),
        "pods": str(pods_path),
        "node_count": len(nodes),
        "gpus": experiment.gpus,
        "pod_count": len(pods),
        "inflate": args.inflate,
        "replicas": args.replicas,
        "seeds": args.seeds,
    }
    print(
        f"{len(nodes)} nodes, {experiment.gpus} GPUs; {len(pods)} pods ({pods_path.name}); "
        f"demand {100 * args.inflate:.0f} %{rounding}; "
        f"seeds {args.seeds[0]}-{args.seeds[-1]} ({len(args.seeds)})",
        flush=True,
    )
    bar = ProgressBar(len(args.policy) * len(args.seeds))
    results = run_all(experiment, args.policy, args.seeds, args.jobs, bar.advance)
    summaries = summarize(results)
    print(render(summaries, trace, {} if args.replicas or args.inflate != 1.3 else PUBLISHED.get(trace, {})))
    try:
        if args.json:
            write_json(args.json, results, summaries, about)
        if args.plot:
            plot(
                args.plot,
                results,
                f"{trace}: {len(nodes)} nodes, {experiment.gpus} GPUs, "
                f"seeds {args.seeds[0]}-{args.seeds[-1]}{rounding}",
            )
    except (OSError, TraceError) as err:
        print(f"gpu-share: error: {err}", file=sys.stderr)
        return 1
    return 0
