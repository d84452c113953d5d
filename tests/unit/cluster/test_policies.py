"""The cluster model's fit rule and each placement policy's choice on small hand-made clusters."""

from __future__ import annotations

import random

import pytest

from deviceplugin.cluster import MILLI, POLICIES, Choice, Node, PodDemand, TaskShapes, fits, make_policy, place
from deviceplugin.cluster.policies import fgd_score
from deviceplugin.cluster.shapes import Shape, shape_of


def gpu_node(
    name: str, free: list[int], cpu: int = 64_000, memory: int = 256_000, model: str = "T4", cpu_free: int = -1
) -> Node:
    return Node(name, cpu, memory, model, list(free), cpu_free=cpu_free)


def best(policy, pod: PodDemand, nodes: list[Node]) -> tuple[str, tuple[int, ...]] | None:
    """What a scheduler does with a policy: the highest score, ties to the first node."""
    top: tuple[Choice, Node] | None = None
    for node in nodes:
        choice = policy.score(pod, node)
        if choice is not None and (top is None or choice.score > top[0].score):
            top = (choice, node)
    return None if top is None else (top[1].name, top[0].gpus)


@pytest.mark.parametrize(
    "pod, node, expected",
    [
        (PodDemand(1000, 1024), gpu_node("n", [0, 0]), True),  # CPU-only: needs no GPU
        (PodDemand(1000, 1024), gpu_node("n", [], cpu=1000), True),
        (PodDemand(2000, 1024), gpu_node("n", [MILLI], cpu=1000), False),  # CPU
        (PodDemand(1000, 300_000, 1, 500), gpu_node("n", [MILLI]), False),  # memory
        (PodDemand(1000, 1024, 1, 500, frozenset({"V100M16"})), gpu_node("n", [MILLI]), False),  # model filter
        (PodDemand(1000, 1024, 1, 500, frozenset({"V100M16", "T4"})), gpu_node("n", [MILLI]), True),
        (PodDemand(1000, 1024, 1, 500), gpu_node("n", [400, 499]), False),  # no GPU with 500 free
        (PodDemand(1000, 1024, 1, 500), gpu_node("n", [400, 500]), True),
        (PodDemand(1000, 1024, 2, MILLI), gpu_node("n", [MILLI, 900, MILLI]), True),  # multi-GPU: two free GPUs
        (PodDemand(1000, 1024, 3, MILLI), gpu_node("n", [MILLI, 900, MILLI]), False),
        (PodDemand(1000, 1024, 1, MILLI), gpu_node("n", [999, 999]), False),  # a whole GPU needs a fully free one
    ],
)
def test_fit_rules(pod: PodDemand, node: Node, expected: bool):
    assert fits(pod, node) is expected


def test_pod_slots_limit_cpu_only_pods_too():
    node = Node("n", 64_000, 256_000, "T4", [MILLI], max_pods=1)
    place(PodDemand(100, 100), node, ())
    assert not fits(PodDemand(100, 100), node)


def test_place_takes_resources_and_refuses_what_does_not_fit():
    node = gpu_node("n", [MILLI, MILLI], cpu=8000, memory=1000)
    place(PodDemand(3000, 400, 1, 300), node, (1,))
    assert (node.cpu_free, node.memory_free, node.gpu_free, node.pods) == (5000, 600, [MILLI, 700], 1)
    with pytest.raises(ValueError, match="does not fit"):
        place(PodDemand(1000, 100, 1, 800), node, (1,))
    with pytest.raises(ValueError, match="needs 2 GPUs"):
        place(PodDemand(1000, 100, 2, MILLI), node, (0,))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"cpu_milli": -1, "memory_mib": 0}, "cpu_milli must be >= 0"),
        ({"cpu_milli": 0, "memory_mib": 0, "num_gpu": 1, "gpu_milli": 1500}, "at most 1000"),
        ({"cpu_milli": 0, "memory_mib": 0, "num_gpu": 1, "gpu_milli": 0}, "both be 0"),
        ({"cpu_milli": 0, "memory_mib": 0, "num_gpu": 2, "gpu_milli": 500}, "fractional request"),
    ],
)
def test_bad_pods_are_refused_with_the_field_named(fields, message):
    with pytest.raises(ValueError, match=message):
        PodDemand(**fields)


def test_bad_node_free_milli_is_refused():
    with pytest.raises(ValueError, match="free milli per GPU"):
        Node("n", 1000, 1000, "T4", [1200])


# --- policies on hand-made clusters -------------------------------------------------------------


def test_bestfit_takes_the_node_with_the_least_left_over():
    nodes = [gpu_node("roomy", [MILLI] * 4), gpu_node("tight", [MILLI, 300]), gpu_node("cpu-short", [MILLI], cpu=500)]
    assert best(make_policy("bestfit"), PodDemand(4000, 1024, 1, 200), nodes) == ("tight", (1,))
    # Its score is the paper's formula, truncated.
    score = make_policy("bestfit").score(PodDemand(4000, 1024, 1, 200), nodes[1])
    assert score == Choice(int(100 * (1 - (0.5 * 60_000 / 128_000 + 0.5 * 1100 / 8000))), (1,))


def test_dotproduct_avoids_nodes_rich_in_what_the_pod_asks_for():
    gpu_rich = gpu_node("gpu-rich", [MILLI] * 8, cpu=96_000, cpu_free=8000)
    cpu_rich = gpu_node("cpu-rich", [MILLI], cpu=96_000)
    # A GPU-heavy pod goes where little GPU is free; a CPU-heavy pod where little CPU is free.
    assert best(make_policy("dotproduct"), PodDemand(1000, 1024, 1, MILLI), [gpu_rich, cpu_rich])[0] == "cpu-rich"
    assert best(make_policy("dotproduct"), PodDemand(6000, 1024), [cpu_rich, gpu_rich])[0] == "gpu-rich"


def test_gpupacking_prefers_shared_gpus_then_used_nodes_then_small_free_nodes():
    free_big, free_small = gpu_node("free8", [MILLI] * 8), gpu_node("free2", [MILLI] * 2)
    used = gpu_node("used", [MILLI, MILLI, 0, 0])
    shared = gpu_node("shared", [MILLI, 600, MILLI, 300])
    policy = make_policy("gpupacking")
    pod = PodDemand(1000, 1024, 1, 250)
    assert best(policy, pod, [free_big, free_small, used, shared]) == ("shared", (3,))
    assert best(policy, pod, [free_big, free_small, used]) == ("used", (0,))
    assert best(policy, pod, [free_big, free_small]) == ("free2", (0,))
    # Scores by case: shared GPU in [50, 100], free GPU of a used node in [33, 50], free node below 33.
    assert policy.score(pod, shared).score == 100 - 30 // 10
    assert policy.score(PodDemand(1000, 1024, 1, MILLI), used).score == 49
    assert policy.score(pod, free_big).score == 33 - 8
    assert policy.score(PodDemand(1000, 1024), shared).score == 0  # CPU-only pods: no preference


def test_binpack_and_spread_choose_opposite_gpus_and_nodes():
    nodes = [gpu_node("empty", [MILLI, MILLI]), gpu_node("half", [MILLI, 400])]
    pod = PodDemand(1000, 1024, 1, 300)
    assert best(make_policy("binpack"), pod, nodes) == ("half", (1,))
    assert best(make_policy("spread"), pod, nodes) == ("empty", (0,))
    assert make_policy("spread").score(pod, nodes[1]).gpus == (0,)


def test_whole_and_multi_gpu_requests_take_the_first_free_gpus_by_index():
    node = gpu_node("n", [500, MILLI, 0, MILLI, MILLI])
    shapes = TaskShapes([(Shape(1000, 1, MILLI, frozenset()), 1.0)])
    for name in POLICIES:
        policy = make_policy(name, shapes=shapes, rng=random.Random(1))
        assert policy.score(PodDemand(1000, 1024, 2, MILLI), node).gpus == (1, 3), name


def test_random_scores_only_fitting_nodes_and_is_reproducible():
    nodes = [gpu_node("a", [200, 700, 900]), gpu_node("b", [100])]
    pod = PodDemand(1000, 1024, 1, 600)
    first = [make_policy("random", rng=random.Random(5)).score(pod, n) for n in nodes]
    again = [make_policy("random", rng=random.Random(5)).score(pod, n) for n in nodes]
    assert first == again and first[1] is None and first[0].gpus[0] in (1, 2)


def test_unknown_policy_and_missing_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="unknown policy 'tetris'"):
        make_policy("tetris")
    with pytest.raises(ValueError, match="needs the task-shape distribution"):
        make_policy("fgd")


# --- FGD -------------------------------------------------------------------------------------------


def brute_force_fragmentation(node: Node, shapes: TaskShapes) -> float:
    """The paper's definition: for each shape, all idle milli if it cannot run (or uses no GPU), else the idle milli it
    cannot use."""
    idle = sum(node.gpu_free)
    total = 0.0
    for shape, p in shapes.shapes:
        pod = PodDemand(shape.cpu_milli, 0, shape.num_gpu, shape.gpu_milli, shape.gpu_models)
        runs = node.cpu_free >= pod.cpu_milli and (
            pod.num_gpu == 0 or fits(pod, Node("x", node.cpu_milli, 1, node.model, node.gpu_free, node.cpu_free, 1))
        )
        usable = runs and shape.num_gpu > 0  # a CPU-only shape can use no idle GPU
        total += p * (sum(f for f in node.gpu_free if f < shape.gpu_milli) if usable else idle)
    return total


def test_fgd_fragmentation_matches_a_brute_force_computation():
    rng = random.Random(3)
    shapes = TaskShapes(
        [
            (Shape(8000, 1, MILLI, frozenset()), 0.4),
            (Shape(4000, 1, 500, frozenset()), 0.2),
            (Shape(2000, 1, 250, frozenset({"V100M16"})), 0.1),
            (Shape(16_000, 2, MILLI, frozenset()), 0.1),
            (Shape(6000, 0, 0, frozenset()), 0.2),
        ]
    )
    for _ in range(500):
        gpus = rng.choice([0, 1, 2, 4, 8])
        node = Node(
            "n",
            64_000,
            256_000,
            rng.choice(["T4", "V100M16"]),
            [rng.choice([0, 100, 250, 499, 500, 750, MILLI]) for _ in range(gpus)],
            cpu_free=rng.choice([0, 1999, 2000, 5000, 8000, 64_000]),
        )
        assert shapes.fragmentation(node) == pytest.approx(brute_force_fragmentation(node, shapes))


def test_fgd_fragmentation_by_hand():
    shapes = TaskShapes([(Shape(1000, 1, 500, frozenset()), 1.0)])
    assert shapes.fragmentation(gpu_node("n", [300, 600, 200])) == 500  # 300 + 200 cannot host a 500
    assert shapes.fragmentation(gpu_node("n", [300, 200])) == 500  # cannot run at all: all idle milli
    assert shapes.fragmentation(gpu_node("n", [MILLI], cpu_free=999)) == 1000  # no CPU for it


def test_fgd_keeps_whole_gpus_whole_when_whole_gpu_pods_are_popular():
    shapes = TaskShapes([(Shape(1000, 1, MILLI, frozenset()), 0.7), (Shape(1000, 1, 500, frozenset()), 0.3)])
    fgd = make_policy("fgd", shapes=shapes)
    nodes = [gpu_node("whole", [MILLI, MILLI]), gpu_node("broken", [MILLI, 500])]
    # A half-GPU pod fills the broken GPU instead of breaking a whole one.
    assert best(fgd, PodDemand(1000, 1024, 1, 500), nodes) == ("broken", (1,))
    # Within one node too: the 500-free GPU, though GPU 0 comes first.
    assert fgd.score(PodDemand(1000, 1024, 1, 500), nodes[1]).gpus == (1,)


def test_fgd_score_is_the_sigmoid_of_the_fragmentation_decrease():
    assert fgd_score(1000.0, 1000.0) == 50
    assert fgd_score(1000.0, 0.0) == int(100 / (1 + 2.718281828459045**-1))
    assert fgd_score(0.0, 8000.0) == 0


def test_task_shapes_cover_the_popular_pods_and_include_cpu_only_ones():
    pods = (
        [PodDemand(1000, 10, 1, MILLI)] * 60
        + [PodDemand(2000, 10)] * 30
        + [PodDemand(500, 10, 1, 300)] * 7
        + [PodDemand(3000, 10, 1, 100)] * 3
    )
    shapes = TaskShapes.from_pods(pods, coverage=0.95)
    assert [s for s, _ in shapes.shapes] == [shape_of(pods[0]), shape_of(pods[60]), shape_of(pods[90])]
    assert [round(p, 4) for _, p in shapes.shapes] == [round(60 / 97, 4), round(30 / 97, 4), round(7 / 97, 4)]
    with pytest.raises(ValueError, match="coverage"):
        TaskShapes.from_pods(pods, coverage=0)


# --- fgdstrand -------------------------------------------------------------------------------------


def test_fgdstrand_keeps_cpu_where_idle_gpus_need_it():
    pods = [PodDemand(8000, 32_000, 1, MILLI)] * 9 + [PodDemand(4000, 8000)]
    shapes = TaskShapes.from_pods(pods)
    assert shapes.cpu_per_gpu_milli == pytest.approx(76_000 / 9000)
    gpu_hungry = gpu_node("idle-gpus", [MILLI] * 8, cpu=96_000, cpu_free=40_000)  # 8 idle GPUs want ~68 cores
    gpus_full = gpu_node("gpus-full", [0] * 8, cpu=96_000, cpu_free=40_000)
    cpu_only = PodDemand(8000, 1024)
    # FGD sees no fragmentation change on either (its shapes still run): the tie goes to the first node.
    assert best(make_policy("fgd", shapes=shapes), cpu_only, [gpu_hungry, gpus_full])[0] == "idle-gpus"
    # fgdstrand sees the CPU-only pod strand GPUs on the first node.
    assert best(make_policy("fgdstrand", shapes=shapes), cpu_only, [gpu_hungry, gpus_full])[0] == "gpus-full"
    # Memory counts the same way.
    assert make_policy("fgdstrand", shapes=shapes).measure("T4", [MILLI] * 8, 96_000, 1000) > make_policy(
        "fgd", shapes=shapes
    ).measure("T4", [MILLI] * 8, 96_000, 1000)


def test_fgdstrand_without_stranding_scores_like_fgd():
    shapes = TaskShapes([(Shape(1000, 1, MILLI, frozenset()), 0.7), (Shape(1000, 1, 500, frozenset()), 0.3)])
    nodes = [gpu_node("a", [MILLI, 500]), gpu_node("b", [MILLI, MILLI]), gpu_node("c", [300, 700, 500])]
    for pod in (
        PodDemand(1000, 1024, 1, 500),
        PodDemand(1000, 1024, 1, 200),
        PodDemand(1000, 1024, 1, MILLI),
        PodDemand(1000, 1024),
    ):
        for n in nodes:
            assert make_policy("fgdstrand", shapes=shapes).score(pod, n) == make_policy("fgd", shapes=shapes).score(
                pod, n
            )


def test_share_shapes_are_every_share_count_equally_popular():
    shapes = TaskShapes.shares(4)
    assert [(s.gpu_milli, p) for s, p in shapes.shapes] == [(250, 0.25), (500, 0.25), (750, 0.25), (1000, 0.25)]
    with pytest.raises(ValueError, match="replicas"):
        TaskShapes.shares(0)


def test_fgdstrand_scores_a_cpu_only_pod_only_where_it_strands_gpus():
    """strand_score: every node where the pod strands nothing scores alike (kube-scheduler's own scores decide there),
    a node where it strands idle GPUs less, by how much it strands."""
    shapes = TaskShapes.from_pods([PodDemand(8000, 32_000, 1, MILLI)] * 9 + [PodDemand(4000, 8000)])
    policy = make_policy("fgdstrand", shapes=shapes)
    cpu_only = PodDemand(8000, 1024)
    roomy = gpu_node("roomy", [MILLI] * 2, cpu=96_000, cpu_free=90_000)
    full = gpu_node("full", [0] * 8, cpu=96_000, cpu_free=40_000)
    no_gpus = gpu_node("no-gpus", [], cpu=96_000, cpu_free=10_000)
    one_idle = gpu_node("one-idle", [MILLI] + [0] * 7, cpu=96_000, cpu_free=14_000)
    eight_idle = gpu_node("eight-idle", [MILLI] * 8, cpu=96_000, cpu_free=40_000)
    scores = {n.name: policy.strand_score(cpu_only, n) for n in (roomy, full, no_gpus, one_idle, eight_idle)}
    assert scores["roomy"] == scores["full"] == scores["no-gpus"] == 100
    assert 1 <= scores["eight-idle"] < scores["one-idle"] < 100
    assert policy.strand_score(PodDemand(200_000, 1024), roomy) is None  # does not fit
    # cpu_only_score: the same order first, then the fewer idle GPUs (no GPUs or all in use alike, ahead of roomy).
    ranked = {n.name: policy.cpu_only_score(cpu_only, n) for n in (roomy, full, no_gpus, one_idle, eight_idle)}
    assert ranked["full"] == ranked["no-gpus"] > ranked["roomy"] > ranked["one-idle"] > ranked["eight-idle"] > 0
    assert policy.cpu_only_score(PodDemand(200_000, 1024), roomy) is None
