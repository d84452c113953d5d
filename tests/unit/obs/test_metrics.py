"""What /metrics serves never holds two series of one name and label set, nor two families of one name, whatever the
collectors yield; the per-container series are one per label set even from a usage map that repeats a holding."""

from __future__ import annotations

from collections.abc import Iterator

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from deviceplugin.agent.observe import Observation
from deviceplugin.model.usage import ContainerShare, Usage
from deviceplugin.obs.metrics import MetricSources, StateCollector, exposed_registry
from deviceplugin.state import NodeState
from tests.conftest import node

T4 = node("2xT4")
MIB = 1024 * 1024


def series(text: str) -> list[tuple[str, tuple[tuple[str, str], ...]]]:
    return [(s.name, tuple(sorted(s.labels.items()))) for f in text_string_to_metric_families(text) for s in f.samples]


class Replay(Collector):
    """Yields the families it is given, as a buggy collector might."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


LABEL = st.sampled_from(["a", "b", "node"])
VALUE = st.sampled_from(["x", "y", ""])


@st.composite
def families(draw) -> list[Metric]:
    out = []
    for _ in range(draw(st.integers(0, 5))):
        name = draw(st.sampled_from(["gpushare_one", "gpushare_two"]))
        kind = draw(st.sampled_from(["gauge", "untyped"]))
        family = Metric(name, "help", kind)
        for _ in range(draw(st.integers(0, 5))):
            labels = draw(st.dictionaries(LABEL, VALUE, max_size=3))
            family.add_sample(name, labels, draw(st.floats(-10, 10, allow_nan=False)))
        out.append(family)
    return out


@settings(max_examples=300, deadline=None)
@given(families(), st.sampled_from([None, "n1"]))
def test_the_exposition_never_repeats_a_series_or_a_family(given_families, node_name):
    inner = CollectorRegistry()
    inner.register(Replay(given_families))
    text = generate_latest(exposed_registry(inner, node_name)).decode()
    found = series(text)
    assert len(found) == len(set(found))
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types))
    if node_name:
        assert all(dict(labels)["node"] == node_name for _, labels in found)
    wanted = {
        (s.name, tuple(sorted({**s.labels, **({"node": node_name} if node_name else {})}.items())))
        for f in given_families
        for s in f.samples
    }
    assert set(found) == wanted  # nothing but the repeats left out


def share(shares: int, limit: int, container: str = "app") -> ContainerShare:
    gpu = T4.gpus[0].uuid
    return ContainerShare(
        "ns", "p", container, "example.com/gpu-share", "s", gpu, gpu, (f"{gpu}::{shares}",), shares, limit, True
    )


def test_holdings_of_one_label_set_add_up_to_one_series():
    state = NodeState()
    state.set_observation(Observation(usage=Usage(shares=(share(1, 1536), share(2, 3072), share(1, 1536, "other")))))
    registry = CollectorRegistry()
    registry.register(StateCollector(MetricSources(T4, state)))
    text = generate_latest(exposed_registry(registry, "n1")).decode()
    found = series(text)
    assert len(found) == len(set(found))
    values = {
        (s.name, s.labels["container"]): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if "container" in s.labels
    }
    assert (
        values[("gpushare_container_shares", "app")] == 3
        and values[("gpushare_container_memory_limit_bytes", "app")] == 4608 * MIB
    )
    assert values[("gpushare_container_shares", "other")] == 1
