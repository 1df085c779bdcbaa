"""rollout: Auto — restart the workloads of pods still running an old config.

One workload at a time, never while one is still rolling. The restart is a pod-template
annotation set to the config hash, so asking twice for the same config restarts once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier_operator import names
from kvtier_operator.gateway import ApiRejected, Gateway
from kvtier_operator.observe import PodView

LWS = ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")


@dataclass(frozen=True)
class Workload:
    kind: str  # Deployment | StatefulSet | LeaderWorkerSet
    name: str


@dataclass
class RolloutResult:
    message: str
    restarted: Workload | None = None


def owner(gw: Gateway, pod: PodView) -> Workload | None:
    """The workload that owns the pod (through its ReplicaSet or StatefulSet)."""
    if pod.owner_kind == "ReplicaSet" and pod.owner_name:
        rs = gw.get("ReplicaSet", pod.namespace, pod.owner_name) or {}
        ref = _controller(rs)
        return Workload("Deployment", ref["name"]) if ref.get("kind") == "Deployment" else None
    if pod.owner_kind == "StatefulSet" and pod.owner_name:
        sts = gw.get("StatefulSet", pod.namespace, pod.owner_name) or {}
        ref = _controller(sts)
        if ref.get("kind") == "LeaderWorkerSet":
            return Workload("LeaderWorkerSet", ref["name"])
        return Workload("StatefulSet", pod.owner_name)
    return None


def _controller(obj: dict[str, Any]) -> dict[str, Any]:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return next((r for r in refs if r.get("controller")), {})


def _read(gw: Gateway, namespace: str, w: Workload) -> dict[str, Any]:
    if w.kind == "LeaderWorkerSet":
        return gw.get_custom(*LWS, namespace, w.name) or {}
    return gw.get(w.kind, namespace, w.name) or {}


def _templates(w: Workload, obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec") or {}
    if w.kind == "LeaderWorkerSet":
        lwt = spec.get("leaderWorkerTemplate") or {}
        return [t for t in (lwt.get("leaderTemplate"), lwt.get("workerTemplate")) if t]
    return [spec.get("template") or {}]


def restarted_for(w: Workload, obj: dict[str, Any], digest: str) -> bool:
    return any(((t.get("metadata") or {}).get("annotations") or {}).get(
        names.ANNOTATION_RESTARTED_AT) == digest for t in _templates(w, obj))


def rolling(w: Workload, obj: dict[str, Any]) -> bool:
    """Whether the workload's own controller is still replacing pods."""
    meta, spec, st = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    if (st.get("observedGeneration") or 0) < (meta.get("generation") or 0):
        return True
    want = spec.get("replicas", 1)
    if w.kind == "Deployment":
        return (st.get("updatedReplicas") or 0) < want or (st.get("unavailableReplicas") or 0) > 0
    if w.kind == "StatefulSet":
        return (st.get("currentRevision") != st.get("updateRevision")
                or (st.get("readyReplicas") or 0) < want)
    return (st.get("updatedReplicas") or 0) < want or (st.get("readyReplicas") or 0) < want


def _patch(w: Workload, digest: str) -> dict[str, Any]:
    stamp = {"metadata": {"annotations": {names.ANNOTATION_RESTARTED_AT: digest}}}
    if w.kind == "LeaderWorkerSet":
        return {"spec": {"leaderWorkerTemplate": {"leaderTemplate": stamp,
                                                  "workerTemplate": stamp}}}
    return {"spec": {"template": stamp}}


def opted_in(w: Workload, obj: dict[str, Any], cache: str) -> bool:
    """Whether every pod template of the workload carries the opt-in label for `cache`:
    only the workload's owner can set it, so only they let a cache restart it."""
    templates = _templates(w, obj)
    return bool(templates) and all(
        ((t.get("metadata") or {}).get("labels") or {}).get(names.LABEL_CACHE) == cache
        for t in templates)


def roll(gw: Gateway, namespace: str, cache: str, pending: list[PodView],
         digest: str) -> RolloutResult:
    """Restart the next workload of the pending pods, among those that opted in to
    `cache` (opted_in); one at a time."""
    workloads: list[Workload] = []
    bare: list[str] = []
    for pod in pending:
        w = owner(gw, pod)
        if w is None:
            bare.append(pod.name)
        elif w not in workloads:
            workloads.append(w)
    note = (f"; {len(bare)} pod(s) have no workload to restart ({', '.join(bare[:3])}): "
            "delete them to recreate them") if bare else ""
    live = {w: _read(gw, namespace, w) for w in sorted(workloads, key=lambda w: (w.kind, w.name))}
    refused = [w for w, obj in live.items() if not opted_in(w, obj, cache)]
    if refused:
        note += (f"; {len(refused)} workload(s) lack the label {names.LABEL_CACHE}: {cache} "
                 f"on their pod template ({', '.join(f'{w.kind} {w.name}' for w in refused[:3])})"
                 " and are not restarted")
        live = {w: obj for w, obj in live.items() if w not in refused}
    for w, obj in live.items():
        if rolling(w, obj) or restarted_for(w, obj, digest):
            return RolloutResult(f"waiting for {w.kind} {w.name} to finish rolling out{note}")
    for w in live:
        try:
            if w.kind == "LeaderWorkerSet":
                gw.patch_custom(*LWS, namespace, w.name, _patch(w, digest))
            else:
                gw.patch(w.kind, namespace, w.name, _patch(w, digest))
        except ApiRejected as err:
            return RolloutResult(f"cannot restart {w.kind} {w.name}: {err.message}{note}")
        return RolloutResult(f"restarting {w.kind} {w.name} ({len(live)} workload(s) to go, "
                             f"one at a time){note}", restarted=w)
    return RolloutResult(f"nothing to restart{note}")
