"""The extender's ranking and where fgd's task shapes come from (deviceplugin/extender/score.py)."""

from __future__ import annotations

import pytest

from deviceplugin.cluster import PodDemand, TaskShapes
from deviceplugin.errors import FlagError
from deviceplugin.extender.score import NO_ROOM, Scorer, ranked, tie_winner
from deviceplugin.extender.service import workload_shapes


def test_the_policy_best_score_is_ranked_10_the_next_distinct_scores_lower():
    assert ranked([70, NO_ROOM, 90, 70, 10]) == [9, 0, 10, 9, 8]
    assert ranked([NO_ROOM, NO_ROOM], ["a", "b"]) == [0, 0]


def test_one_node_of_the_best_score_alone_is_on_top_in_one_fixed_order_of_the_nodes():
    names = [f"node-{k}" for k in range(16)]
    winners = set()
    for k in range(15):
        tied = [k, k + 1]
        raw = [80 if i in tied else 50 for i in range(16)]
        out = ranked(raw, names)
        assert out == ranked(raw, names)  # the same answer on a retry
        assert sorted(out[i] for i in tied) == [9, 10] and {out[i] for i in range(16) if i not in tied} == {8}
        winners.add(names[out.index(10)])
    assert len(winners) > 2  # a pseudo-random order, not always the first or the last name
    # Unkeyed blake2b of the name: the same winner in every process and extender replica, and not the name order's.
    assert tie_winner(list(range(16)), names) == 8 and min(names) == "node-0"
    # One order for every pod: of any equals, the winner is the node that wins against each of the others.
    full = ranked([80] * 16, names)
    assert full.count(10) == 1
    assert all(
        ranked([80, 80], [names[full.index(10)], other]) == [10, 9] for other in names if other != names[full.index(10)]
    )
    assert ranked([80, 50], names[:2]) == [10, 9]  # a single best: nothing shifts


def test_task_shapes_from_a_workload_file_score_at_once_and_are_never_relearned():
    learned = []
    shapes = TaskShapes.from_pods([PodDemand(8_000, 64_000, 8, 1000)] * 3 + [PodDemand(2_000, 8_000, 1, 500)])
    scorer = Scorer("fgdstrand", workload=lambda: learned.append(1) or [], shapes=shapes, size=lambda: 10**6)
    assert scorer.policy.name == "fgdstrand" and scorer.policy is scorer.policy
    assert learned == []
    with pytest.raises(ValueError, match="--workload: the binpack policy uses no task shapes"):
        Scorer("binpack", shapes=shapes)


def test_learned_shapes_are_learned_again_when_the_cluster_has_doubled_or_halved_before_the_refresh():
    pods = [PodDemand(1_000, 1_000, 1, 500)]
    size = [1]
    calls = []
    scorer = Scorer("fgd", workload=lambda: calls.append(size[0]) or pods, refresh=3600, clock=lambda: 0.0,
                    size=lambda: size[0])  # fmt: skip
    first = scorer.policy
    assert calls == [1] and scorer.policy is first  # not doubled: kept
    size[0] = 2
    assert scorer.policy is not first and calls == [1, 2]
    size[0] = 3
    assert scorer.policy is not None
    assert calls == [1, 2]
    size[0] = 4
    assert scorer.policy is not None
    assert calls == [1, 2, 4]
    size[0] = 1  # emptied: learned again
    assert scorer.policy is not None
    assert calls == [1, 2, 4, 1]


def test_a_workload_file_is_a_pod_list_its_gpu_models_kept(tmp_path):
    good = tmp_path / "pods.csv"
    good.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\na,8000,65536,8,1000,A100\nb,2000,8192,1,300,\n"
    )
    shapes = workload_shapes(str(good))
    assert {s.gpu_models for s, _ in shapes.shapes} == {frozenset({"A100"}), frozenset()}  # <domain>/gpu.product values
    assert {(s.num_gpu, s.gpu_milli) for s, _ in shapes.shapes} == {(8, 1000), (1, 300)}
    bad = tmp_path / "bad.csv"
    bad.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,8000,65536,8,1500\n")
    with pytest.raises(FlagError, match=r"--workload .*bad.csv:2: column gpu_milli: must be 0-1000, got 1500"):
        workload_shapes(str(bad))
    (tmp_path / "cpu.csv").write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,8000,65536,0,0\n")
    with pytest.raises(FlagError, match="--workload .*cpu.csv: no pod of the list asks for a GPU"):
        workload_shapes(str(tmp_path / "cpu.csv"))
    with pytest.raises(FlagError, match="--workload .*missing column"):
        (tmp_path / "cols.csv").write_text("name,cpu\n")
        workload_shapes(str(tmp_path / "cols.csv"))


def _affinity(*terms: list[dict]) -> dict:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": t} for t in terms]}}}  # fmt: skip


LABEL = "example.com/gpu.product"


def test_a_pods_gpu_models_are_what_its_node_selector_or_every_required_affinity_term_admits():
    from deviceplugin.extender.inputs import MAX_MODELS, gpu_models

    def of(spec: dict) -> frozenset[str]:
        return gpu_models(spec, LABEL)

    assert of({"nodeSelector": {LABEL: "A100"}}) == {"A100"}
    a100, zone = (
        {"key": LABEL, "operator": "In", "values": ["A100"]},
        {"key": "zone", "operator": "In", "values": ["a"]},
    )
    both = _affinity([a100], [zone, {"key": LABEL, "operator": "In", "values": ["H100"]}])
    assert of({"affinity": both}) == {"A100", "H100"}  # the terms are ORed
    anywhere = _affinity([a100], [zone])
    assert of({"affinity": anywhere}) == frozenset()  # one term admits any model
    assert of({"affinity": _affinity([{"key": LABEL, "operator": "NotIn", "values": ["T4"]}])}) == frozenset()
    many = _affinity([{"key": LABEL, "operator": "In", "values": [f"m{i}" for i in range(MAX_MODELS + 1)]}])
    assert of({"affinity": many}) == frozenset()  # over the bound: any model (kube-scheduler still filters)
    assert of({"affinity": {"nodeAffinity": "junk"}}) == of({"affinity": []}) == of({}) == frozenset()
    assert gpu_models({"nodeSelector": {LABEL: "A100"}}, "other/gpu.product") == frozenset()


def test_the_extender_scores_a_node_by_its_gpu_model_as_the_workload_shapes_name_it():
    """Half the workload is 8-GPU pods that run only on A100s. A 1-GPU pod that runs anywhere goes to the V100 node:
    on the A100 node it would leave 7 GPUs no 8-GPU pod can use. Blind to models, the two nodes were alike."""
    from prometheus_client import CollectorRegistry

    from deviceplugin.extender.cache import ClusterCache
    from deviceplugin.extender.inputs import HostCapacity, pod_request
    from deviceplugin.extender.metrics import ExtenderMetrics
    from deviceplugin.extender.verbs import Extender
    from tests.support.extender import SHARE, annotation, args, managed, pod

    a100 = frozenset(["A100"])
    shapes = TaskShapes.from_pods(
        [PodDemand(8_000, 64_000, 8, 1000, a100)] * 5 + [PodDemand(8_000, 64_000, 1, 1000)] * 5
    )
    cache = ClusterCache()
    for name, model in (("a100-node", "A100"), ("v100-node", "V100")):
        cache.set_node(name, annotation(*[(10, 0)] * 8), HostCapacity(96_000, 512_000, 110, model))
    ext = Extender(cache, Scorer("fgd", shapes=shapes), managed, ExtenderMetrics(CollectorRegistry(), cache.counts),
                   LABEL)  # fmt: skip
    one = pod("one", {SHARE: 10})
    views = cache.views(["a100-node", "v100-node"], exclude="uid-one")
    on_a100, on_v100 = ext.scorer.raw_scores(pod_request(one, managed, LABEL), views)
    assert on_a100 < on_v100  # not a tie broken by the hash
    assert {s["Host"]: s["Score"] for s in ext.prioritize(args(one, "a100-node", "v100-node"))} == {
        "v100-node": 10,
        "a100-node": 9,
    }


def test_a_scorer_rebuilding_its_policy_makes_the_other_workers_wait_for_the_new_one():
    """HTTP workers score at once: one that reads the policy while another rebuilds it gets the new policy and its
    generation together, never the old policy under the new generation (its scores would stay in the memo)."""
    import threading

    size = [1]
    entered, gate = threading.Event(), threading.Event()

    def workload() -> list[PodDemand]:
        if size[0] == 2:
            entered.set()
            assert gate.wait(10)
        return [PodDemand(1_000, 1_000, 1, 500 * size[0])]

    scorer = Scorer("fgd", workload=workload, refresh=3600, clock=lambda: 0.0, size=lambda: size[0])
    old = scorer._current()
    size[0] = 2
    got: dict[str, tuple] = {}
    rebuilding = threading.Thread(target=lambda: got.setdefault("a", scorer._current()))
    rebuilding.start()
    assert entered.wait(10)
    b_done = threading.Event()
    reading = threading.Thread(target=lambda: (got.setdefault("b", scorer._current()), b_done.set()))
    reading.start()
    assert not b_done.wait(0.2)  # it waits for the rebuild
    gate.set()
    rebuilding.join(10)
    reading.join(10)
    assert got["a"] != old and got["b"] == got["a"]
