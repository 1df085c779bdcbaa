"""kopf wiring: thin handlers around `reconcile()`, pod indexes, and the drift loop.

No finalizer, because cleanup needs none: the CronJob, the router ConfigMap and a
deletePolicy-Delete claim carry owner references, so the garbage collector removes them
with the resource, and a retained claim has none. (kopf runs delete handlers only on
objects its own finalizer holds, so there is no delete handler either.) Drift repair is
the operator's own periodic loop, not a kopf timer, which would add a finalizer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf

from kvtier_operator import GROUP, PLURAL, VERSION, metrics, names
from kvtier_operator.cache_registry import CacheRegistry
from kvtier_operator.conflict_log import ConflictLog
from kvtier_operator.context import RenderContext
from kvtier_operator.engines.registry import adapter_for, engines_in
from kvtier_operator.gateway import ApiRejected, Gateway, RetryableError
from kvtier_operator.observe import EvictorRun, PodView, evictor_run, pod_view
from kvtier_operator.observe.observer import CacheTargets, Observer, ObserveSettings, Target
from kvtier_operator.reconcile import Outcome, reconcile
from kvtier_operator.render.pod import config_hash

log = logging.getLogger("kvtier_operator")
TPC = (GROUP, VERSION, PLURAL)


@dataclass
class OperatorConfig:
    render: RenderContext
    drift_interval: float = 60.0
    retry_delay: float = 10.0
    caches: CacheRegistry = field(default_factory=CacheRegistry)  # shared with the webhook
    conflicts: ConflictLog = field(default_factory=ConflictLog)
    observe: ObserveSettings = field(default_factory=ObserveSettings)
    # Namespaces besides a cache's own that its references (spec.mooncake.masterService)
    # may point into: the chart's referenceNamespaces.
    reference_namespaces: frozenset[str] = frozenset()
    # Watching named namespaces only (the chart's watchNamespaces): kopf then neither lists
    # namespaces nor watches CRDs, so the install needs no cluster-scoped rights at all.
    namespaced: bool = False
    observer: Observer | None = None  # built from `observe` at first use
    # Advice Events: at most one per cache and reason in this many seconds.
    advice_event_gap: float = 600.0
    _advice_posted: dict[tuple[str, str, str], float] = field(default_factory=dict)

    def the_observer(self) -> Observer:
        if self.observer is None:
            self.observer = Observer(self.observe)
        return self.observer

    def advice_due(self, namespace: str, name: str, reason: str) -> bool:
        """Whether an advice Event for this reason may be posted now (rate limit)."""
        key, now = (namespace, name, reason), time.monotonic()
        last = self._advice_posted.get(key)
        if last is not None and now - last < self.advice_event_gap:
            return False
        self._advice_posted[key] = now
        return True


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _flatten(index: Any, key: Any = None) -> list[Any]:
    """All values of a kopf index (or of one key of it)."""
    if key is not None:
        return list(index.get(key, ()))
    return [value for store in index.values() for value in store]


def run_reconcile(body: dict[str, Any], gw: Gateway, config: OperatorConfig,
                  pods: Iterable[PodView], runs: Iterable[EvictorRun]) -> Outcome:
    meta = body.get("metadata") or {}
    pods = list(pods)
    conflicts = config.conflicts.for_cache(meta.get("namespace", ""), meta.get("name", ""),
                                           [p.name for p in pods if p.active])
    observer = config.the_observer()
    observed = observer.snapshot(meta.get("namespace", ""), meta.get("name", ""))
    start = time.perf_counter()
    try:
        outcome = reconcile(body, gw, config.render, pods, list(runs), now_iso(), conflicts,
                            observed=observed, observing=config.observe.enabled,
                            reference_namespaces=config.reference_namespaces)
    except RetryableError:
        metrics.RECONCILES.labels("retry").inc()
        metrics.ERRORS.labels("retryable").inc()
        raise
    except ApiRejected:
        metrics.RECONCILES.labels("error").inc()
        metrics.ERRORS.labels("rejected").inc()
        raise
    finally:
        metrics.RECONCILE_SECONDS.observe(time.perf_counter() - start)
    invalid = any(c.reason == "InvalidSpec" for c in outcome.status.conditions or [])
    metrics.RECONCILES.labels("invalid" if invalid else "ok" if outcome.ok else "degraded").inc()
    metrics.export_status((meta.get("namespace", ""), meta.get("name", "")), outcome.status,
                          valid=not invalid)
    return outcome


def observe_targets(config: OperatorConfig, pods: Callable[[str], list[PodView]]
                    ) -> list[CacheTargets]:
    """Every valid cache's injected, running pods, with the URL of their metrics."""
    out = []
    for ns, caches in config.caches.view().by_namespace.items():
        in_ns = pods(ns)
        for tpc in caches:
            adapter = adapter_for(tpc.spec)
            port = adapter.launcher.metrics_port
            digest = config_hash(tpc, config.render)
            targets = []
            for pod in in_ns:
                # A pod without an address is not serving yet: nothing to read, no problem.
                if pod.cache != tpc.name or not pod.active or pod.opted_out or not pod.ip:
                    continue
                url = pod.metrics_url(port)
                targets.append(Target(pod=pod.name, uid=pod.uid, url=url, problem=None if url
                                      else "no metrics port known: set the pod annotation "
                                      "kvtier.dev/metrics-port",
                                      current_config=pod.config_hash == digest))
            out.append(CacheTargets(ns, tpc.name, adapter, adapter.offloaded_tiers(tpc.spec),
                                    tuple(targets)))
    return out


def _post(body: dict[str, Any], outcome: Outcome, config: OperatorConfig | None = None) -> None:
    meta = body.get("metadata") or {}
    advice = [(kind, reason, message) for kind, reason, message in outcome.advice_events
              if config is None or config.advice_due(meta.get("namespace", ""),
                                                     meta.get("name", ""), reason)]
    for kind, reason, message in [*outcome.events, *advice]:
        try:
            # kopf annotates objs as kopf.Body but reads any mapping (.get), as plain dicts
            # are.
            kopf.event(body, type=kind, reason=reason,  # type: ignore[arg-type]
                       message=message)
        except LookupError:
            # Outside kopf's per-object processing (the drift loop is a task of our own)
            # kopf has no event queue to post to: the same facts are in the status; say
            # them in the log rather than fail the repair.
            log.info("%s/%s %s %s: %s", meta.get("namespace"), meta.get("name"), kind,
                     reason, message)


def register(registry: kopf.OperatorRegistry, config: OperatorConfig,
             gateway: Callable[[], Gateway]) -> None:
    """Register every handler on registry; gateway() builds the API gateway lazily."""

    @kopf.index("pods", id="kvtier_pods", registry=registry)
    def kvtier_pods(body: kopf.Body, **_: Any) -> dict[str, PodView]:
        view = pod_view(dict(body))  # pods are namespaced: kopf's namespace is this one
        view = dataclasses.replace(view, engines=engines_in(body.get("spec")))
        return {view.namespace: view}

    @kopf.index("pods", labels={names.LABEL_COMPONENT: "evictor"}, id="kvtier_evictor_runs",
                registry=registry)
    def kvtier_evictor_runs(body: kopf.Body, **_: Any) -> dict[tuple[str, str], EvictorRun] | None:
        run = evictor_run(dict(body))
        return {(run.namespace, run.cache): run} if run else None

    @kopf.on.event(*TPC, id="kvtier_cache_registry", registry=registry)
    def observe_cache(type: str | None, body: kopf.Body, **_: Any) -> None:
        config.caches.observe(type or "ADDED", dict(body))
        if type == "DELETED":  # no delete handler (no finalizer): the watch says so
            meta = body.get("metadata") or {}
            metrics.forget_cache((meta.get("namespace", ""), meta.get("name", "")))

    state: dict[str, asyncio.Task[None] | None] = {"drift": None, "observe": None}

    async def handle(body: kopf.Body, patch: kopf.Patch, namespace: str, name: str,
                     kvtier_pods: kopf.Index, kvtier_evictor_runs: kopf.Index,
                     **_: Any) -> None:
        try:
            outcome = await asyncio.to_thread(
                run_reconcile, dict(body), gateway(), config, _flatten(kvtier_pods, namespace),
                _flatten(kvtier_evictor_runs, (namespace, name)))
        except RetryableError as err:
            kopf.warn(body, reason="Retrying", message=str(err))
            raise kopf.TemporaryError(str(err), delay=config.retry_delay) from err
        patch.status.update(outcome.status_doc)
        _post(dict(body), outcome, config)

    for cause in ("create", "update", "resume"):
        getattr(kopf.on, cause)(*TPC, id=f"reconcile-on-{cause}", registry=registry)(handle)

    async def drift_loop(kvtier_pods: kopf.Index, kvtier_evictor_runs: kopf.Index) -> None:
        while True:
            await asyncio.sleep(config.drift_interval)
            watched = config.caches.names()  # invalid ones get their status from handlers
            metrics.MANAGED_CACHES.set(len(watched))
            for ns, name in watched:
                try:
                    # The index may lag a deletion; act only on what the server has now.
                    body = await asyncio.to_thread(gateway().get_cache, ns, name)
                    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
                        continue
                    outcome = await asyncio.to_thread(
                        run_reconcile, body, gateway(), config, _flatten(kvtier_pods, ns),
                        _flatten(kvtier_evictor_runs, (ns, name)))
                    await asyncio.to_thread(gateway().patch_status, ns, name, outcome.status_doc)
                    _post(body, outcome, config)
                except (RetryableError, ApiRejected) as err:
                    log.warning("drift repair of %s/%s: %s", ns, name, err)
                except Exception:  # one bad resource never stops the loop or the others
                    metrics.ERRORS.labels("unexpected").inc()
                    log.exception("drift repair of %s/%s failed", ns, name)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **indexes: Any) -> None:
        # kopf passes every index as a keyword argument named by its id (its ActivityFn
        # type knows only its own arguments).
        kvtier_pods: kopf.Index = indexes["kvtier_pods"]
        kvtier_evictor_runs: kopf.Index = indexes["kvtier_evictor_runs"]
        configure(settings)
        if config.namespaced:
            settings.scanning.disabled = True
        # The indexes are live views: empty now, filled as the watches list and stream.
        state["drift"] = asyncio.create_task(drift_loop(kvtier_pods, kvtier_evictor_runs),
                                             name="kvtier-drift-loop")
        if config.observe.enabled:
            # Off the reconcile path: reconciles read the observer's latest snapshot.
            state["observe"] = asyncio.create_task(config.the_observer().run(
                lambda: observe_targets(config, lambda ns: _flatten(kvtier_pods, ns)),
                now_iso), name="kvtier-observe-loop")

    @kopf.on.cleanup(registry=registry)
    async def shutdown(**_: Any) -> None:
        for task in state.values():
            if task is not None:
                task.cancel()

    @kopf.on.probe(id="managedCaches", registry=registry)
    def probe_caches(**_: Any) -> int:
        return len(config.caches.names())


def configure(settings: kopf.OperatorSettings) -> None:
    """kvtier.dev/ prefixes for everything kopf stores on objects."""
    settings.persistence.finalizer = names.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=names.PREFIX, key="last-handled-configuration")
    settings.posting.level = logging.INFO
    # The server ends a watch after server_timeout; the client gives up on a silent one a
    # little later (a half-open connection would otherwise hang the watch for ever), and
    # on a connection that takes longer than connect_timeout to open.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
