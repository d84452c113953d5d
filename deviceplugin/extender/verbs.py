"""The extender's two verbs on decoded JSON, shaped as kube-scheduler's extender/v1 types.

ExtenderArgs `{"Pod", "Nodes", "NodeNames"}` in (nodeCacheCapable: `Nodes` is null, `NodeNames` lists the
candidates); ExtenderFilterResult `{"NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}` or
HostPriorityList `[{"Host", "Score"}]` (0-10) out. The Go types carry no JSON tags: the field names are Go's.

Two modes, one per extender entry of the scheduler configuration: the device-plugin mode judges a pod's extended
resources (`<domain>/*`; kube-scheduler calls it only for pods asking for them), the DRA mode (`dra=True`, the
`/dra/` paths) judges only what the pod's ResourceClaims ask of the gpu-share driver; kube-scheduler calls that
entry for every pod (DRA pods request no extended resource), so a pod without claims is answered at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from .cache import ClusterCache, NodeView
from .fit import NO_INVENTORY, place
from .metrics import ExtenderMetrics
from .model import InputError, PodRequest, pod_request
from .score import NO_ROOM, Scorer, ranked

MAX_NODE_NAMES = 50_000


class Extender:
    def __init__(self, cache: ClusterCache, scorer: Scorer, managed: Callable[[str], bool], metrics: ExtenderMetrics | None = None) -> None:
        self.cache = cache
        self.scorer = scorer
        self.managed = managed
        self.metrics = metrics

    def filter(self, args: dict, dra: bool = False) -> dict:
        try:
            request, names = self._args(args, dra)
        except InputError as err:
            return {"NodeNames": None, "FailedNodes": {}, "FailedAndUnresolvableNodes": {}, "Error": str(err)}
        passed: list[str] = []
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        refused: dict[str, int] = {}  # reason -> nodes
        if request.empty:  # asks for none of our resources: nothing to judge
            return {"NodeNames": names, "FailedNodes": {}, "FailedAndUnresolvableNodes": {}, "Error": ""}
        self.cache.forget_reservation(request.uid)  # filtered again: its old reservation is stale
        resource, count = _single(request) or ("", 0)
        for view in self.cache.views(names, exclude=request.uid):
            if count and view.room.get(resource, -1) >= count:  # the common pod, the common case
                passed.append(view.name)
                continue
            if view.inventory is None:
                unresolvable[view.name] = f"gpu-share: {view.error}"
                refused[NO_INVENTORY] = refused.get(NO_INVENTORY, 0) + 1
                continue
            fit = place(request, view.inventory, dict(view.free))  # a copy: filtering takes nothing
            if fit.ok:
                passed.append(view.name)
                continue
            (unresolvable if fit.unresolvable else failed)[view.name] = f"gpu-share: {fit.reason}"
            refused[fit.category] = refused.get(fit.category, 0) + 1
        self.cache.reserve(request, passed)
        if self.metrics is not None:
            for reason, count in refused.items():
                self.metrics.filtered_out.labels(reason).inc(count)
        return {"NodeNames": passed, "FailedNodes": failed, "FailedAndUnresolvableNodes": unresolvable, "Error": ""}

    def prioritize(self, args: dict, dra: bool = False) -> list[dict]:
        """Scores for the nodes the pod fits; nodes it does not fit score 0 (the filter already refused them)."""
        request, names = self._args(args, dra)  # InputError: the HTTP layer answers 400
        if request.empty:
            return [{"Host": name, "Score": 0} for name in names]
        views = self.cache.views(names, exclude=request.uid)
        resource, count = _single(request) or ("", 0)
        raw = [s if s != NO_ROOM and _fits(request, view, resource, count) else NO_ROOM for view, s in zip(views, self.scorer.raw_scores(request, views))]
        return [{"Host": view.name, "Score": score} for view, score in zip(views, ranked(raw))]

    def _args(self, args: dict, dra: bool) -> tuple[PodRequest, list[str]]:
        if not isinstance(args, dict):
            raise InputError("ExtenderArgs: must be a JSON object")
        names = args.get("NodeNames")
        if names is None:
            raise InputError("ExtenderArgs.NodeNames: missing; configure the extender with nodeCacheCapable: true")
        if not isinstance(names, list) or len(names) > MAX_NODE_NAMES or not all(isinstance(n, str) for n in names):
            raise InputError(f"ExtenderArgs.NodeNames: must be a list of at most {MAX_NODE_NAMES} node names")
        pod = args.get("Pod")
        if not dra:
            return pod_request(pod, self.managed), names
        if not isinstance(pod, dict) or not (pod.get("spec") or {}).get("resourceClaims"):
            return NOTHING, names  # not a DRA pod: not this entry's business
        return replace(pod_request(pod, _none), together=self.cache.dra_request(pod)), names


NOTHING = PodRequest("", "", "", (), ())


def _none(name: str) -> bool:
    return False


def _fits(request: PodRequest, view: NodeView, resource: str, count: int) -> bool:
    """Does the pod fit the node; (resource, count): the fast path's single request, count 0 if none."""
    if count and view.room.get(resource, -1) >= count:
        return True
    return view.inventory is not None and place(request, view.inventory, dict(view.free)).ok


def _single(request: PodRequest) -> tuple[str, int] | None:
    """(resource, count) when the pod is one container asking for one resource: the fast path."""
    if request.alone or len(request.together) != 1 or len(request.together[0].shares) != 1:
        return None
    return request.together[0].shares[0]
