"""Reading the Alibaba openb node and pod lists (the FGD paper's trace) into the cluster model.

The CSVs are not shipped with gpu-share (where to get them: docs/packing.md#getting-the-trace): they are read
from a trace directory, `--trace-dir`, else $GPU_SHARE_TRACE_DIR, else the first folder found at the search
location `shared/traces/alibaba-gpu-v2023` in or beside the working directory or the source checkout.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

from .capacity import MILLI, Node, PodDemand

TRACE_DIR_ENV = "GPU_SHARE_TRACE_DIR"
TRACE_SUBDIR = Path(
    "shared/traces/alibaba-gpu-v2023"
)  # a search location for the CSVs (trace_dir_candidates), not a shipped folder
DEFAULT_NODES = "openb_node_list_gpu_node.csv"
POD_FILE = "openb_pod_list_{}.csv"
MAX_ROWS = 1_000_000
MAX_GPUS_PER_NODE = 64

CITATION = (
    'Trace and protocol: Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing Workloads with '
    'Fragmentation Gradient Descent", USENIX ATC 2023 (Alibaba openb trace, cluster-trace-gpu-v2023).'
)


WHERE = (
    "The CSVs are not shipped: they are the csv/ folder of cluster-trace-gpu-v2023 in "
    "https://github.com/alibaba/clusterdata (docs/packing.md#getting-the-trace)."
)


class TraceError(Exception):
    """A trace file or directory that cannot be used; the message names the file, line and column."""


def trace_dir_candidates() -> list[Path]:
    cwd = Path.cwd()
    checkout = Path(__file__).resolve().parents[2]
    return [cwd / TRACE_SUBDIR, cwd.parent / TRACE_SUBDIR, checkout / TRACE_SUBDIR, checkout.parent / TRACE_SUBDIR]


def find_trace_dir(explicit: str | None = None) -> Path:
    """The trace directory: `explicit`, else $GPU_SHARE_TRACE_DIR, else the first candidate that exists."""
    given = explicit or os.environ.get(TRACE_DIR_ENV)
    if given:
        path = Path(given)
        if not path.is_dir():
            source = "--trace-dir" if explicit else f"${TRACE_DIR_ENV}"
            raise TraceError(f"trace directory {path} ({source}) does not exist or is not a directory")
        return path
    candidates = trace_dir_candidates()
    for path in candidates:
        if path.is_dir():
            return path
    tried = ", ".join(str(p) for p in dict.fromkeys(candidates))
    raise TraceError(
        f"no trace directory found (tried {tried}); pass --trace-dir or set ${TRACE_DIR_ENV} "
        f"to the folder holding openb_node_list_*.csv and openb_pod_list_*.csv. {WHERE}"
    )


def resolve(name_or_path: str, trace_dir: str | None, template: str) -> Path:
    """A path (with a directory part, or an existing file), else a file of the trace directory: the
    name itself when it ends in .csv, else `template` filled with it."""
    if os.sep in name_or_path or Path(name_or_path).is_file():
        path = Path(name_or_path)
        if not path.is_file():
            raise TraceError(f"trace file {path} does not exist")
        return path
    folder = find_trace_dir(trace_dir)
    path = folder / (name_or_path if name_or_path.endswith(".csv") else template.format(name_or_path))
    if not path.is_file():
        prefix, suffix = template.split("{}")
        names = sorted(p.name[len(prefix) : -len(suffix)] for p in folder.glob(template.format("*")))
        if names:  # what the flag takes there
            raise TraceError(
                f"trace file {path} does not exist; the names {folder} has "
                f"for {template.format('<name>')}: {', '.join(names)}"
            )
        others = sorted(p.name for p in folder.glob("*.csv"))[:20]
        listed = f" (its CSVs: {', '.join(others)}; give one as a path, e.g. {folder / others[0]})" if others else ""
        raise TraceError(
            f"trace file {path} does not exist, and {folder} has no {template.format('<name>')}{listed}. {WHERE}"
        )
    return path


def _rows(path: Path, required: tuple[str, ...], what: str) -> list[tuple[int, dict[str, str]]]:
    """(line number, row) of a CSV with these columns; at least one row of `what`."""
    try:
        with path.open(newline="") as handle:
            reader = csv.DictReader(handle)
            missing = [c for c in required if c not in (reader.fieldnames or [])]
            if missing:
                raise TraceError(
                    f"{path}: missing column(s) {', '.join(missing)} (header: {','.join(reader.fieldnames or [])})"
                )
            rows: list[tuple[int, dict[str, str]]] = []
            for row in reader:
                if len(rows) >= MAX_ROWS:
                    raise TraceError(f"{path}: more than {MAX_ROWS} rows")
                rows.append((reader.line_num, row))
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise TraceError(f"{path}: cannot read: {err}") from None
    if not rows:
        raise TraceError(f"{path}: no {what}")
    return rows


def _int(path: Path, line: int, row: dict[str, str], column: str, low: int = 0, high: int | None = None) -> int:
    text = (row.get(column) or "").strip()
    try:
        value = int(text)
    except ValueError:
        raise TraceError(f"{path}:{line}: column {column}: not an integer: {text!r}") from None
    if value < low or (high is not None and value > high):
        bound = f"{low}-{high}" if high is not None else f">= {low}"
        raise TraceError(f"{path}:{line}: column {column}: must be {bound}, got {value}")
    return value


def load_nodes(path: Path) -> list[Node]:
    """Nodes from `sn,cpu_milli,memory_mib,gpu,model`, every GPU free."""
    nodes = []
    for line, row in _rows(path, ("sn", "cpu_milli", "memory_mib", "gpu", "model"), "nodes"):
        gpus = _int(path, line, row, "gpu", 0, MAX_GPUS_PER_NODE)
        nodes.append(
            Node.empty(
                row["sn"],
                _int(path, line, row, "cpu_milli"),
                _int(path, line, row, "memory_mib"),
                gpus,
                row["model"].strip(),
            )
        )
    return nodes


def load_pods(path: Path) -> list[PodDemand]:
    """Pods from `name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec]`; `gpu_spec` lists accepted models,
    `|`-separated."""
    pods = []
    for line, row in _rows(path, ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"), "pods"):
        num_gpu = _int(path, line, row, "num_gpu", 0, MAX_GPUS_PER_NODE)
        gpu_milli = _int(path, line, row, "gpu_milli", 0, MILLI)
        models = frozenset(m.strip() for m in (row.get("gpu_spec") or "").split("|") if m.strip())
        try:
            pods.append(
                PodDemand(
                    _int(path, line, row, "cpu_milli"),
                    _int(path, line, row, "memory_mib"),
                    num_gpu,
                    gpu_milli,
                    models,
                    row["name"],
                )
            )
        except ValueError as err:
            raise TraceError(f"{path}:{line}: {err}") from None
    return pods
