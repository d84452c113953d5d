"""`gpu-share simulate` and the packing benchmark as subprocesses, and the simulator's parallel runs (worker
processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deviceplugin.cluster.simulator import Experiment, run_all
from deviceplugin.cluster.traces import load_nodes, load_pods

from .conftest import GPU_CLI, ROOT

TRACES = ROOT / "tests" / "traces"
TOY_NODES = load_nodes(TRACES / "toy_nodes.csv")
TOY_PODS = load_pods(TRACES / "openb_pod_list_toy.csv")


def test_parallel_runs_match_serial_ones():
    experiment = Experiment(TOY_NODES, TOY_PODS)
    serial = run_all(experiment, ["fgd", "bestfit"], [1, 2])
    parallel = run_all(experiment, ["fgd", "bestfit"], [1, 2], jobs=2)
    assert [(r.policy, r.seed, r.placements) for r in serial] == [(r.policy, r.seed, r.placements) for r in parallel]


def test_simulate_command_prints_the_table_and_writes_json(tmp_path: Path):
    out = tmp_path / "runs.json"
    done = subprocess.run(
        [
            *GPU_CLI,
            "simulate",
            "--trace-dir",
            str(TRACES),
            "--nodes",
            "toy_nodes.csv",
            "--pods",
            "toy",
            "--policy",
            "fgd,bestfit",
            "--seeds",
            "1-3",
            "--replicas",
            "4",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "4 nodes, 9 GPUs; 12 pods" in done.stdout and "requests rounded to 1/4 GPU" in done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(("fgd ", "bestfit "))]
    assert [r[0] for r in rows] == ["fgd", "bestfit"] and all(0 < float(r[1]) <= 100 for r in rows)
    assert "Beware of Fragmentation" in done.stdout
    document = json.loads(out.read_text())
    assert document["replicas"] == 4 and len(document["runs"]) == 6 and document["gpus"] == 9


def test_simulate_command_explains_a_missing_trace_directory(tmp_path: Path):
    done = subprocess.run(
        [*GPU_CLI, "simulate", "--trace-dir", str(tmp_path / "nowhere"), "--seeds", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "trace directory" in done.stderr and "Traceback" not in done.stderr


def test_simulate_command_plots(tmp_path: Path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "curve.png"
    done = subprocess.run(
        [
            *GPU_CLI,
            "simulate",
            "--trace-dir",
            str(TRACES),
            "--nodes",
            "toy_nodes.csv",
            "--pods",
            "toy",
            "--policy",
            "fgd,random",
            "--seeds",
            "1-2",
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_packing_benchmark_runs_on_the_toy_trace(tmp_path: Path):
    out = tmp_path / "packing.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.packing",
            "--trace-dir",
            str(TRACES),
            "--nodes",
            "toy_nodes.csv",
            "--variants",
            "toy",
            "--policies",
            "fgd,fgdstrand,bestfit",
            "--seeds",
            "1-2",
            "--replicas",
            "4",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert (
        "| trace | fgd | fgdstrand | bestfit |" in done.stdout and "| toy | " in done.stdout and "| 4 | " in done.stdout
    )
    assert len(json.loads(out.read_text())["runs"]) == 12
