"""The sweep's pure parts: what `--configs shipped` runs, the summary, the trace variants (no control plane)."""

from __future__ import annotations

import random

import pytest

from benchmarks.kube_scheduler import config_keys, republish_delay, sample, settings, shipped_entry
from benchmarks.standin import MODEL_LABEL, model_affinity
from benchmarks.sweep import summarise
from benchmarks.trace_variants import variant
from deviceplugin.cluster import MILLI, PodDemand


def test_shipped_configs_are_read_from_the_shipped_files():
    assert shipped_entry() == {"share": 20, "every": 20, "strategy": "LeastAllocated"}
    assert settings("dra-shipped")[2] == {
        "share": 0,
        "every": 20,
        "strategy": "LeastAllocated",
    }  # DRA: the every-pod entry only
    assert config_keys("shipped,dra-shipped") == ["dp-shipped", "dra-shipped"]


def test_unknown_config_is_an_error_naming_it():
    with pytest.raises(SystemExit, match="unknown dp-bogus"):
        config_keys("dp-none,dp-bogus")


def _result(config: str, at100: float, at130: float, failed: int = 0) -> dict:
    return {
        "config": config,
        "label": config,
        "allocation_100": at100,
        "allocation_130": at130,
        "failed_admissions": failed,
    }


def test_summary_reports_mean_and_worst_against_simulate_and_the_plain_scheduler():
    samples = [
        {
            "simulated": {"100": 90.0, "130": 91.0, "orders100": 89.0, "orders130": 92.0},
            "results": [_result("dp-none", 85.0, 86.0, 20), _result("dp-shipped", 90.5, 91.5)],
        },
        {
            "simulated": {"100": 92.0, "130": 93.0, "orders100": 91.5, "orders130": 92.5},
            "results": [_result("dp-none", 89.0, 90.0, 30), _result("dp-shipped", 91.0, 92.0)],
        },
    ]
    rows = {r["config"]: r for r in summarise(samples)}
    shipped = rows["dp-shipped"]
    assert (shipped["mean130"], shipped["worst130"], shipped["worst100"]) == pytest.approx((-0.25, -1.0, -1.0))
    assert (shipped["mean_orders"], shipped["worst_orders"]) == pytest.approx((-0.5, -0.5))  # simulate's tie-order mean
    assert (shipped["mean_orders100"], shipped["worst_orders100"]) == pytest.approx((0.5, -0.5))
    assert shipped["over_plain"] == pytest.approx(2.0) and shipped["failed"] == 0
    assert rows["dp-none"]["failed"] == 50 and list(rows) == ["dp-shipped", "dp-none"]  # best worst case first


def _default() -> list[PodDemand]:
    rng = random.Random(1)
    pods = [PodDemand(4000, 8000)] * 100
    pods += [PodDemand(8000, 16000, 1, rng.choice([250, 500, 700])) for _ in range(300)]
    pods += [PodDemand(8000, 16000, 1, MILLI)] * 300 + [PodDemand(64000, 128000, 8, MILLI)] * 20
    return pods


def _share(pods: list[PodDemand]) -> float:
    gpu = [p for p in pods if p.num_gpu]
    return sum(p.gpu_milli for p in gpu if p.num_gpu == 1 and p.gpu_milli < MILLI) / sum(
        p.num_gpu * p.gpu_milli for p in gpu
    )


def test_variants_follow_the_fgd_rules():
    default = _default()
    share = variant(default, "gpushare60", random.Random(0))
    assert len(share) == len(default) and _share(share) == pytest.approx(0.6, abs=0.01)
    assert sum(1 for p in share if not p.num_gpu) == 100  # CPU-only pods kept
    multi = variant(default, "multigpu50", random.Random(0))
    gpu = [p for p in multi if p.num_gpu]
    assert sum(p.num_gpu * p.gpu_milli for p in gpu if p.num_gpu > 1) / sum(
        p.num_gpu * p.gpu_milli for p in gpu
    ) == pytest.approx(0.5, abs=0.02)
    cpu = variant(default, "cpu200", random.Random(0))
    assert sum(p.cpu_milli for p in cpu if not p.num_gpu) == 2 * 100 * 4000 and sum(1 for p in cpu if p.num_gpu) == 620
    with pytest.raises(SystemExit, match="gpuspec33"):
        variant(default, "gpuspec33", random.Random(0))


def test_gpu_model_constraints_reach_the_scheduler_and_the_simulator(tmp_path):
    """A gpuspec pod asks for its models by node affinity on the model label; simulate applies the same rule."""
    (tmp_path / "openb_node_list_gpu_node.csv").write_text(
        "sn,cpu_milli,memory_mib,gpu,model\nn-t4,32000,131072,1,T4\nn-v100,32000,131072,1,V100M16\n"
    )
    pods = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n" + "".join(
        f"p{i},1000,1024,1,1000,T4\n" for i in range(4)
    )
    (tmp_path / "openb_pod_list_t4only.csv").write_text(pods)
    data = sample(str(tmp_path), 2, 1, "t4only")
    assert {n.model for n in data.nodes} == {"T4", "V100M16"}
    assert all(p.gpu_models == {"T4"} for p in data.pods)
    assert data.simulated["130"] == pytest.approx(50.0)  # only the T4 is ever used: 1 of 2 GPUs
    term = model_affinity(data.pods[0].gpu_models)["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"] == [
        {"matchExpressions": [{"key": MODEL_LABEL, "operator": "In", "values": ["T4"]}]}
    ]


def test_republish_delay_defaults_to_none_when_paced_and_is_bounded():
    assert republish_delay(None, paced=False) == (2.0, 5.0)
    assert republish_delay(None, paced=True) == (0.0, 0.0)
    assert republish_delay("0.5,1", paced=True) == (0.5, 1.0)
    for bad in ("1", "2,1", "-1,1", "0,61", "a,b"):
        with pytest.raises(SystemExit, match="--republish"):
            republish_delay(bad, paced=False)
