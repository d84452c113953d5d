"""The extender's two verbs on decoded JSON, shaped as kube-scheduler's extender/v1 types.

ExtenderArgs `{"Pod", "Nodes", "NodeNames"}` in (nodeCacheCapable: `Nodes` is null, `NodeNames` lists the
candidates); ExtenderFilterResult `{"NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}` or
HostPriorityList `[{"Host", "Score"}]` (0-10) out. The Go types carry no JSON tags: the field names are Go's.

Two modes, one per extender entry of the scheduler configuration. The share mode judges a pod's extended resources
(`<domain>/*`; kube-scheduler calls that entry only for pods asking for them). The every-pod mode (`every_pod=True`,
the `/all/` paths; an entry without managedResources, which kube-scheduler calls for every pod) judges what a pod's
ResourceClaims ask of the gpu-share DRA driver, and scores a pod that asks for no share at all (CPU-only) by the
GPUs it would strand, as the simulator places CPU-only pods; a share pod is answered at once (the share entry
judges it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from .cache import CandidateNode, ClusterCache
from .fit import NO_INVENTORY, place
from .inputs import InputError, PodRequest, pod_request
from .metrics import ExtenderMetrics
from .score import NO_ROOM, Scorer, ranked

MAX_NODE_NAMES = 50_000


class Extender:
    def __init__(
        self,
        cache: ClusterCache,
        scorer: Scorer,
        managed: Callable[[str], bool],
        metrics: ExtenderMetrics | None = None,
        model_label: str = "",
    ) -> None:
        self.cache = cache
        self.scorer = scorer
        self.managed = managed
        self.metrics = metrics
        self.model_label = model_label  # the node label of the GPU model pods' node affinity names ("": not read)

    def filter(self, args: dict, every_pod: bool = False) -> dict:
        try:
            request, names = self._args(args, every_pod)
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

    def prioritize(self, args: dict, every_pod: bool = False) -> list[dict]:
        """Scores for the nodes the pod fits; nodes it does not fit score 0 (the filter already refused them)."""
        request, names = self._args(args, every_pod)  # InputError: the HTTP layer answers 400
        if request is NOTHING or (request.empty and not every_pod):
            return [{"Host": name, "Score": 0} for name in names]
        views = self.cache.views(names, exclude=request.uid)
        raw = self.scorer.raw_scores(request, views)
        if not request.empty:  # a CPU-only pod fits wherever kube-scheduler's own filters let it
            resource, count = _single(request) or ("", 0)
            raw = [
                s if s != NO_ROOM and _fits(request, view, resource, count) else NO_ROOM
                for view, s in zip(views, raw, strict=True)
            ]
        # A tie winner only for a pod asking for GPUs: a CPU-only pod's ties are kube-scheduler's (its own spread,
        # affinity and taint preferences) wherever the policy sees no difference.
        scores = ranked(raw, [view.name for view in views] if not request.empty else ())
        return [{"Host": view.name, "Score": score} for view, score in zip(views, scores, strict=True)]

    def _args(self, args: dict, every_pod: bool) -> tuple[PodRequest, list[str]]:
        if not isinstance(args, dict):
            raise InputError("ExtenderArgs: must be a JSON object")
        names = args.get("NodeNames")
        if names is None:
            raise InputError("ExtenderArgs.NodeNames: missing; configure the extender with nodeCacheCapable: true")
        if not isinstance(names, list) or len(names) > MAX_NODE_NAMES or not all(isinstance(n, str) for n in names):
            raise InputError(f"ExtenderArgs.NodeNames: must be a list of at most {MAX_NODE_NAMES} node names")
        pod = args.get("Pod")
        request = pod_request(pod, self.managed, self.model_label)
        if not every_pod:
            return request, names
        if not request.empty:
            return NOTHING, names  # a share pod: the share entry's business
        claims = (
            self.cache.dra_request(pod)
            if isinstance(pod, dict) and (pod.get("spec") or {}).get("resourceClaims")
            else ()
        )
        return replace(request, together=claims), names  # no claims of ours: a CPU-only pod


NOTHING = PodRequest("", "", "", (), ())  # answered at once


def _fits(request: PodRequest, view: CandidateNode, resource: str, count: int) -> bool:
    """Does the pod fit the node; (resource, count): the fast path's single request, count 0 if none."""
    if count and view.room.get(resource, -1) >= count:
        return True
    return view.inventory is not None and place(request, view.inventory, dict(view.free)).ok


def _single(request: PodRequest) -> tuple[str, int] | None:
    """(resource, count) when the pod is one container asking for one resource: the fast path."""
    if request.alone or len(request.together) != 1 or len(request.together[0].shares) != 1:
        return None
    return request.together[0].shares[0]
