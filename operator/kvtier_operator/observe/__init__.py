"""What the operator observes: small, immutable views of pods and evictor runs, as kopf
indexes keep them. Built from watch events; never written back to the cluster."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier_evictor.report import EvictionReport
from kvtier_operator import names


@dataclass(frozen=True)
class PodView:
    namespace: str
    name: str
    uid: str  # "" where the server gave none; a recreated pod keeps its name, not its uid
    labels: tuple[tuple[str, str], ...]
    cache: str | None  # the kvtier.dev/cache annotation
    config_hash: str | None
    active: bool  # not finished, not being deleted
    owner_kind: str | None
    owner_name: str | None
    ip: str | None = None  # status.podIP
    metrics_port: int | None = None  # the annotation, or a port named metrics or http
    # The engines (Launcher.label) some container of the pod runs: set by the operator's
    # pod index (engines.registry.engines_in), which knows the engines.
    engines: frozenset[str] = frozenset()

    def metrics_url(self, default_port: int | None) -> str | None:
        port = self.metrics_port or default_port
        if not self.ip or port is None:
            return None
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"http://{host}:{port}/metrics"

    @property
    def label_dict(self) -> dict[str, str]:
        return dict(self.labels)

    @property
    def identity(self) -> tuple[str, str]:
        return self.name, self.uid

    @property
    def opted_in_to(self) -> str | None:
        """The cache whose rollout the pod's workload owner allowed (its label)."""
        return self.label_dict.get(names.LABEL_CACHE)

    @property
    def opted_out(self) -> bool:
        return self.label_dict.get(names.LABEL_OPT_OUT) == "false"


def _metrics_port(meta: dict[str, Any], spec: dict[str, Any]) -> int | None:
    """The pod's kvtier.dev/metrics-port annotation, else its container port named
    metrics, else http; None: the engine's default."""
    annotated = str((meta.get("annotations") or {}).get(names.ANNOTATION_METRICS_PORT, ""))
    if annotated.isdigit() and 0 < int(annotated) < 65536:
        return int(annotated)
    ports = {p.get("name"): p.get("containerPort") for c in spec.get("containers") or []
             for p in c.get("ports") or [] if isinstance(p, dict)}
    for name in ("metrics", "http"):
        port = ports.get(name)
        if isinstance(port, int):
            return port
    return None


def pod_view(body: dict[str, Any]) -> PodView:
    meta = body.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    phase = (body.get("status") or {}).get("phase")
    owner: dict[str, Any] = next(
        (o for o in meta.get("ownerReferences") or [] if o.get("controller")), {})
    return PodView(
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        labels=tuple(sorted((meta.get("labels") or {}).items())),
        cache=annotations.get(names.ANNOTATION_CACHE),
        config_hash=annotations.get(names.ANNOTATION_CONFIG_HASH),
        active=phase not in ("Succeeded", "Failed") and not meta.get("deletionTimestamp"),
        owner_kind=owner.get("kind"),
        owner_name=owner.get("name"),
        ip=(body.get("status") or {}).get("podIP") or None,
        metrics_port=_metrics_port(meta, body.get("spec") or {}),
    )


@dataclass(frozen=True)
class EvictorRun:
    """One finished evictor pod: its report, or why there is none."""

    namespace: str
    cache: str
    pod: str
    job: str | None
    finished_at: str
    exit_code: int | None
    report: EvictionReport | None
    problem: str | None  # why the report could not be read


def evictor_run(body: dict[str, Any]) -> EvictorRun | None:
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    cache = labels.get(names.LABEL_CACHE)
    if cache is None:
        return None
    statuses = (body.get("status") or {}).get("containerStatuses") or []
    terminated = next(((s.get("state") or {}).get("terminated") for s in statuses
                       if s.get("name") == "evictor" and (s.get("state") or {}).get("terminated")),
                      None)
    if terminated is None:
        return None  # still running or never started: nothing to report yet
    report, problem = None, None
    message = terminated.get("message") or ""
    try:
        report = EvictionReport.from_json(message)
    except ValueError as err:
        problem = (f"the evictor's termination message is not its JSON report ({err}); "
                   "check the pod's logs")
    return EvictorRun(
        namespace=meta.get("namespace", ""), cache=cache, pod=meta.get("name", ""),
        job=labels.get("job-name") or labels.get("batch.kubernetes.io/job-name"),
        finished_at=terminated.get("finishedAt") or "", exit_code=terminated.get("exitCode"),
        report=report, problem=problem,
    )
