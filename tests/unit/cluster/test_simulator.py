"""The packing simulator on toy traces: inflation, tie-breaking, the 130 % reading, --replicas (the command and parallel
runs: tests/test_simulate.py)."""

from __future__ import annotations

import io
import random
from pathlib import Path

import pytest

from deviceplugin.cluster import MILLI, POLICIES, Node, PodDemand
from deviceplugin.cluster.report import ProgressBar, parse_seeds
from deviceplugin.cluster.simulator import Experiment, arrivals, node_order, share_rounded
from deviceplugin.cluster.traces import TraceError, find_trace_dir, load_nodes, load_pods, resolve
from tests.conftest import ROOT

TRACES = ROOT / "tests" / "traces"
TOY_NODES = load_nodes(TRACES / "toy_nodes.csv")
TOY_PODS = load_pods(TRACES / "openb_pod_list_toy.csv")


def test_toy_trace_loads_with_models_and_cpu_only_pods():
    assert [(n.name, n.cpu_milli, len(n.gpu_free), n.model) for n in TOY_NODES][2] == (
        "toy-node-2",
        16000,
        4,
        "V100M16",
    )
    pods = {p.name: p for p in TOY_PODS}
    assert pods["toy-pod-11"].gpu_models == frozenset({"T4", "P100"})
    assert pods["toy-pod-03"].num_gpu == 0 and pods["toy-pod-04"].gpu_request == 2000


def test_inflation_appends_resampled_pods_until_the_next_per_gpu_request_would_pass_the_target():
    pods = [
        PodDemand(100, 100, 1, 500, name="half"),
        PodDemand(100, 100, 2, MILLI, name="two"),
        PodDemand(100, 100, name="cpu"),
    ]
    for seed in range(20):
        out = arrivals(pods, 10 * MILLI, 1.3, random.Random(seed))
        total = sum(p.gpu_request for p in out)
        assert out[:3] != [] and {p.name for p in out[:3]} == {
            "half",
            "two",
            "cpu",
        }  # the original list, shuffled, comes first
        # Stops only when the next pod's per-GPU milli would pass 13000: at most 1000 short, a multi-GPU pod may
        # overshoot by 1000.
        assert 13_000 - MILLI < total <= 13_000 + MILLI


def test_inflation_drops_random_pods_when_the_list_exceeds_the_target():
    pods = [PodDemand(100, 100, 1, MILLI, name=f"p{i}") for i in range(40)]
    out = arrivals(pods, 10 * MILLI, 1.3, random.Random(1))
    assert sum(p.gpu_request for p in out) == 13_000 and len({p.name for p in out}) == 13


def test_ties_go_to_the_first_node_of_the_per_run_shuffled_order():
    nodes = [Node.empty(f"n{i}", 64_000, 256_000, 2, "T4") for i in range(6)]
    pods = [PodDemand(1000, 1000, 1, 500, name=f"p{i}") for i in range(4)]
    experiment = Experiment(nodes, pods, inflate=0.2)  # 0.2 x 12000 = 2400: the 4 pods (2000), a fifth would pass it
    for seed in (1, 2, 3):
        rng = random.Random(seed)
        arrived = arrivals(experiment.pods, 12 * MILLI, 0.2, rng)
        first = nodes[node_order(len(nodes), rng)[0]].name
        result = experiment.run("bestfit", seed)
        # Every pod ties on the empty nodes, then packs onto the same one: all land on the first node in the order.
        assert [p[1] for p in result.placements] == [first] * len(arrived)
    firsts = {experiment.run("bestfit", s).placements[0][1] for s in range(8)}
    assert len(firsts) > 1  # the order is reshuffled per seed


def test_the_kpi_is_read_when_arrived_demand_reaches_the_target():
    nodes = [Node.empty("only", 64_000, 256_000, 2, "T4")]
    pods = [PodDemand(1000, 1000, 1, MILLI, name="whole")]
    result = Experiment(nodes, pods, inflate=1.3).run("fgd", 7)
    # 2 GPUs, target 2600: two pods arrive (a third would pass it); demand never reads 130 %, so the last arrival's
    # ratio counts.
    assert result.allocation == 1.0 and result.failed_pods == result.arrived_pods - 2
    assert result.unallocated_gpus == 0
    assert result.curve[50] == 0.5 and result.curve[100] == 1.0


def test_every_policy_runs_on_the_toy_trace_and_respects_the_fit_rules():
    experiment = Experiment(TOY_NODES, TOY_PODS)
    by_name = {n.name: n for n in TOY_NODES}
    models = {p.name: p.gpu_models for p in TOY_PODS}
    for policy in POLICIES:
        result = experiment.run(policy, 42)
        assert 0 < result.allocation <= 1 and result.arrived_pods > len(TOY_PODS)
        for pod, node, _ in result.placements:
            if node and models[pod]:
                assert by_name[node].model in models[pod], (policy, pod, node)
        assert experiment.run(policy, 42).placements == result.placements  # reproducible per seed


@pytest.mark.parametrize(
    "milli, replicas, expected",
    [
        (470, 10, 500),
        (470, 4, 500),
        (230, 4, 250),
        (810, 20, 850),
        (100, 10, 100),
        (1, 100, 10),
        (334, 3, 666),
        (333, 3, 333),
        (999, 2, 1000),
    ],
)
def test_replicas_round_fractional_requests_up_to_whole_shares(milli, replicas, expected):
    assert share_rounded(PodDemand(100, 100, 1, milli), replicas).gpu_milli == expected


def test_replicas_leave_whole_gpus_and_cpu_only_pods_alone():
    assert share_rounded(PodDemand(100, 100, 2, MILLI), 3) == PodDemand(100, 100, 2, MILLI)
    assert share_rounded(PodDemand(100, 100), 3) == PodDemand(100, 100)
    assert share_rounded(PodDemand(100, 100, 1, 470), None).gpu_milli == 470


def test_rounding_costs_packing_and_the_kpi_counts_what_pods_asked_for():
    nodes = [Node.empty("one", 64_000, 256_000, 1, "T4")]
    pods = [PodDemand(100, 100, 1, 300, name="third")]
    exact = Experiment(nodes, pods, inflate=1.3).run("bestfit", 1)
    halves = Experiment(nodes, pods, inflate=1.3, replicas=2).run("bestfit", 1)
    assert exact.allocation == pytest.approx(0.9)  # three 300s on the GPU
    assert halves.allocation == pytest.approx(0.6)  # each rounded to 500: two fit, 600 milli of requests served


def test_bad_experiments_are_refused():
    with pytest.raises(ValueError, match="replicas must be"):
        Experiment(TOY_NODES, TOY_PODS, replicas=0)
    with pytest.raises(ValueError, match="inflate"):
        Experiment(TOY_NODES, TOY_PODS, inflate=0)
    with pytest.raises(ValueError, match="no GPUs"):
        Experiment([Node.empty("cpu", 1000, 1000, 0)], TOY_PODS)


def test_seed_lists():
    assert parse_seeds("42-45") == [42, 43, 44, 45]
    assert parse_seeds("3,1,2-3") == [3, 1, 2]
    for bad in ("x", "5-1", "1-100000"):
        with pytest.raises(Exception, match="seeds"):
            parse_seeds(bad)


def test_progress_bar_draws_on_its_stream():
    stream = io.StringIO()
    bar = ProgressBar(4, stream, width=8)
    for _ in range(4):
        bar.advance()
    assert "\r[##......] 1/4 runs" in stream.getvalue() and stream.getvalue().endswith("4/4 runs, 0 s\n")


def test_trace_errors_name_the_file_line_and_column(tmp_path: Path):
    with pytest.raises(TraceError, match=r"bad_pods.csv:3: column memory_mib: not an integer: 'lots'"):
        load_pods(TRACES / "bad_pods.csv")
    (tmp_path / "nodes.csv").write_text("sn,cpu_milli,gpu\nx,1,1\n")
    with pytest.raises(TraceError, match="missing column"):
        load_nodes(tmp_path / "nodes.csv")
    with pytest.raises(TraceError, match="does not exist"):
        find_trace_dir(str(tmp_path / "nowhere"))
    with pytest.raises(TraceError) as err:
        resolve("nosuch", str(TRACES), "openb_pod_list_{}.csv")
    assert (
        str(err.value)
        == f"trace file {TRACES / 'openb_pod_list_nosuch.csv'} does not exist; the names {TRACES} has for "
        "openb_pod_list_<name>.csv: toy"
    )
    with pytest.raises(TraceError) as err:  # no file of that pattern: its CSVs, and where the trace comes from
        resolve("gpu_node", str(TRACES), "openb_node_list_{}.csv")
    assert str(err.value).startswith(
        f"trace file {TRACES / 'openb_node_list_gpu_node.csv'} does not exist, and {TRACES} has no "
        f"openb_node_list_<name>.csv (its CSVs: bad_pods.csv, openb_pod_list_toy.csv, toy_nodes.csv; "
        f"give one as a path, e.g. {TRACES / 'bad_pods.csv'}). The CSVs are not shipped"
    ), err.value
    assert "https://github.com/alibaba/clusterdata (docs/packing.md#getting-the-trace)" in str(err.value)


def test_replicas_that_change_no_request_change_nothing():
    # Every toy request is a multiple of 10 milli: 100 shares per GPU round nothing, so every choice is the same.
    assert Experiment(TOY_NODES, TOY_PODS, replicas=100).shapes.shapes == Experiment(TOY_NODES, TOY_PODS).shapes.shapes
    for policy in ("fgd", "fgdstrand", "bestfit"):
        exact = Experiment(TOY_NODES, TOY_PODS).run(policy, 3)
        assert Experiment(TOY_NODES, TOY_PODS, replicas=100).run(policy, 3).placements == exact.placements


def test_failed_pods_read_as_a_count():
    from deviceplugin.cluster.report import _count

    assert (_count(2607.0), _count(3.5)) == ("2607", "3.5")  # a mean over seeds: whole when every run failed as many


def test_no_trace_directory_says_where_the_trace_comes_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from deviceplugin.cluster import traces

    monkeypatch.delenv(traces.TRACE_DIR_ENV, raising=False)
    monkeypatch.setattr(traces, "trace_dir_candidates", lambda: [tmp_path / "nowhere"])
    with pytest.raises(TraceError) as err:
        find_trace_dir()
    assert f"no trace directory found (tried {tmp_path / 'nowhere'}); pass --trace-dir" in str(err.value)
    assert "csv/ folder of cluster-trace-gpu-v2023 in https://github.com/alibaba/clusterdata" in str(err.value)
