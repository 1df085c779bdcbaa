"""One reconcile of a TieredPrefixCache: render, apply through the gateway, observe, and
compute the status. Idempotent: running it twice changes nothing the second time.

Kopf handlers and the drift loop both call `reconcile()`; they only differ in how they
write the status and post the events it returns.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from kvtier_operator import names
from kvtier_operator.api.quantity import quantity_bytes
from kvtier_operator.api.v1alpha1 import (
    ClaimStatus,
    DeletePolicy,
    RolloutPolicy,
    RouterCapacityStatus,
    TieredPrefixCache,
    TieredPrefixCacheStatus,
)
from kvtier_operator.context import RenderContext
from kvtier_operator.engines.registry import adapter_for
from kvtier_operator.gateway import ApiRejected, Gateway
from kvtier_operator.observe import EvictorRun, PodView
from kvtier_operator.observe.observer import CacheObservation
from kvtier_operator.render.cronjob import render_cronjob
from kvtier_operator.render.event_pods import render_event_pods_configmap
from kvtier_operator.render.object_evictor import render_object_evictor
from kvtier_operator.render.pod import config_hash
from kvtier_operator.render.pvc import render_pvc
from kvtier_operator.render.router import PLUGINS_FILE, render_router_configmap
from kvtier_operator.rollout import RolloutResult, roll
from kvtier_operator.status import (
    CONDITION_TYPES,
    ENGINE_VERSION,
    EVICTOR_HEALTHY,
    INJECTED,
    METRICS_READABLE,
    PREREQUISITES_READY,
    READY,
    STORAGE_READY,
    TIERS_EFFECTIVE,
    Cond,
    StorageObservation,
    conditions,
    count_pods,
    engine_version_condition,
    eviction_status,
    evictor_condition,
    injected_condition,
    latest_run,
    observed_tiers,
    opt_in_condition,
    prerequisites_condition,
    ready_condition,
    status_doc,
)
from kvtier_operator.validation import InvalidResource, deprecations, parse_tpc


@dataclass
class Outcome:
    status: TieredPrefixCacheStatus
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    pending_pods: list[str] = field(default_factory=list)
    ok: bool = True  # False when something the spec asks for could not be done
    # What the renderers were given for this cache (observed_cpu_blocks among it).
    render_context: RenderContext | None = None
    # Advice that changed (type, reason, message): the handlers post these, rate-limited.
    advice_events: list[tuple[str, str, str]] = field(default_factory=list)

    @cached_property
    def status_doc(self) -> dict[str, Any]:
        """The status as written to the API (camelCase JSON), serialised once."""
        return status_doc(self.status)


def _event(events: list[tuple[str, str, str]], action: str, obj: dict[str, Any]) -> None:
    if action != "unchanged":
        events.append(("Normal", action.capitalize(), f"{action} {obj['kind']} "
                                                      f"{obj['metadata']['name']}"))


def _rejected(events: list[tuple[str, str, str]], err: ApiRejected) -> str:
    events.append(("Warning", "ApplyFailed", str(err)))
    return f"the API server refused {err.what}: {err.message}"


def _claim_owner_refs(tpc: TieredPrefixCache, live: dict[str, Any]) -> list[dict] | None:
    """The claim's ownerReferences as the delete policy wants them, or None if right."""
    refs = (live.get("metadata") or {}).get("ownerReferences") or []
    uid = tpc.metadata.uid
    ours = [r for r in refs if r.get("uid") == uid]
    others = [r for r in refs if r.get("uid") != uid]
    assert tpc.spec.storage is not None and tpc.spec.storage.pvc is not None
    want_owned = tpc.spec.storage.pvc.delete_policy == DeletePolicy.Delete and bool(uid)
    if want_owned and not ours:
        return [*others, names.owner_reference(tpc)]
    if not want_owned and ours:
        return others
    return None


def reconcile_storage(tpc: TieredPrefixCache, gw: Gateway,
                      events: list[tuple[str, str, str]]) -> StorageObservation:
    storage = tpc.spec.storage
    if storage is None:
        return StorageObservation()
    claim = names.claim_name(tpc)
    assert claim is not None
    obs = StorageObservation(claim=claim)
    notes: list[str] = []
    desired = render_pvc(tpc)
    live = gw.get("PersistentVolumeClaim", tpc.namespace, claim)
    if desired is not None and live is None:
        try:
            live = gw.create(desired)
            _event(events, "created", desired)
        except ApiRejected as err:
            obs.condition = Cond("False", "ClaimRejected", _rejected(events, err))
            return obs
    elif desired is not None and live is not None:
        size: str = desired["spec"]["resources"]["requests"]["storage"]  # spec.storage.pvc.size
        want = quantity_bytes(size)
        have_text = ((live.get("spec") or {}).get("resources") or {}).get(
            "requests", {}).get("storage", "0")
        have = quantity_bytes(have_text)
        if want > have:
            try:
                live = gw.patch("PersistentVolumeClaim", tpc.namespace, claim, {
                    "spec": {"resources": {"requests": {"storage": size}}}})
                events.append(("Normal", "Resized", f"asked to grow claim {claim} from "
                                                    f"{have_text} to {size}"))
            except ApiRejected as err:
                notes.append(f"cannot grow the claim to {size}: {err.message} "
                             "(does its StorageClass allow volume expansion?)")
                events.append(("Warning", "ResizeRefused", str(err)))
        elif want < have:
            notes.append(f"spec.storage.pvc.size {size} is below the claim's "
                         f"{have_text}; kvtier never shrinks a claim")
        refs = _claim_owner_refs(tpc, live)
        if refs is not None:
            try:
                live = gw.patch("PersistentVolumeClaim", tpc.namespace, claim,
                                {"metadata": {"ownerReferences": refs}})
            except ApiRejected as err:
                notes.append(_rejected(events, err))
    elif live is None:  # existingClaim that does not exist
        obs.condition = Cond("False", "ClaimNotFound",
                             f"spec.storage.existingClaim {claim} does not exist in namespace "
                             f"{tpc.namespace}; create it or fix the name")
        return obs
    live_status = live.get("status") or {}
    obs.phase = live_status.get("phase") or "Pending"
    obs.capacity = (live_status.get("capacity") or {}).get("storage")
    if obs.phase == "Bound":
        obs.condition = Cond("True", "Bound" if not notes else "BoundWithWarnings",
                             "; ".join(notes) or f"claim {claim} is bound ({obs.capacity})")
    elif obs.phase == "Lost":
        obs.condition = Cond("False", "ClaimLost", "; ".join(
            [f"claim {claim} lost its volume", *notes]))
    else:
        why = ""
        recent = gw.events_for(tpc.namespace, "PersistentVolumeClaim", claim)
        if recent:
            last = recent[-1]
            why = f": {last.get('reason', '')}: {last.get('message', '')}"
        obs.condition = Cond("False", "ClaimPending", "; ".join(
            [f"claim {claim} is {obs.phase}{why}", *notes]))
    return obs


def check_prerequisites(tpc: TieredPrefixCache, gw: Gateway,
                        reference_namespaces: frozenset[str] = frozenset()) -> Cond:
    """Whether the objects the engine needs (and others manage) exist: a named field and
    the missing object in the condition, instead of pods that crash-loop.

    An object in another namespace is looked up only where the install allows references
    (`reference_namespaces`, the chart's referenceNamespaces); elsewhere the answer is the
    same whether or not it exists, so a cache author learns nothing about namespaces they
    cannot read (audit N7)."""
    missing: list[str] = []
    unknown: list[str] = []
    refused: list[str] = []
    wanted = adapter_for(tpc.spec).prerequisites(tpc)
    for need in wanted:
        what = f"{need.kind} {need.namespace}/{need.name} ({need.field})"
        if need.namespace != tpc.namespace and need.namespace not in reference_namespaces:
            refused.append(f"{what}: namespace {need.namespace} is neither this cache's nor "
                           "one the kvtier install allows references to (Helm value "
                           "referenceNamespaces); move the object here or ask the cluster "
                           "admin to allow it")
            continue
        try:
            live = gw.get(need.kind, need.namespace, need.name)
        except ApiRejected as err:
            unknown.append(f"cannot read {what}: {err.message}")
            continue
        if live is None:
            missing.append(f"{what} does not exist")
        elif need.key is not None and need.key not in (live.get("data") or {}):
            missing.append(f"{what} has no key {need.key!r}")
        elif need.key is not None and need.check is not None:
            text = str((live.get("data") or {})[need.key])
            missing += [f"{what} key {need.key!r}: {p}" for p in need.check(text)]
    return prerequisites_condition(missing, unknown, len(wanted), refused)


def _apply_owned(tpc: TieredPrefixCache, gw: Gateway, desired: dict[str, Any] | None,
                 kind: str, name: str, events: list[tuple[str, str, str]]) -> str | None:
    """Create/patch the object, or delete it when the spec no longer wants it; returns
    the server's refusal message, if any."""
    try:
        if desired is None:
            uid = tpc.metadata.uid
            if uid and gw.delete_owned(kind, tpc.namespace, name, uid):
                events.append(("Normal", "Deleted", f"deleted {kind} {name}"))
            return None
        action, _ = gw.ensure(desired)
        _event(events, action, desired)
    except ApiRejected as err:
        return _rejected(events, err)
    return None


def _drop_renamed(tpc: TieredPrefixCache, gw: Gateway, kind: str, component: str,
                  keep: str | None, events: list[tuple[str, str, str]]) -> str | None:
    """Delete what this cache owns of kind and component under any name but keep (the
    spec renamed it, or no longer wants it); returns the server's refusal, if any."""
    if not tpc.metadata.uid:
        return None  # nothing can be owned by a cache the server has not stored
    try:
        for name in gw.owned_names(kind, tpc.namespace, names.owned_labels(tpc, component),
                                   tpc.metadata.uid):
            if name != keep and gw.delete(kind, tpc.namespace, name):
                why = f"renamed to {keep}" if keep else "no longer wanted"
                events.append(("Normal", "Deleted", f"deleted {kind} {name} ({why})"))
    except ApiRejected as err:
        return _rejected(events, err)
    return None


def invalid_status(body: dict[str, Any], err: InvalidResource,
                   now: str) -> TieredPrefixCacheStatus:
    """Every condition False with InvalidSpec; the rest of the last status stays."""
    meta = body.get("metadata") or {}
    message = "; ".join(err.messages)
    cond = Cond("False", "InvalidSpec", message)
    new = {t: cond for t in CONDITION_TYPES}
    generation = meta.get("generation")
    return TieredPrefixCacheStatus(
        observed_generation=generation if isinstance(generation, int) else None,
        conditions=conditions(new, (body.get("status") or {}).get("conditions"),
                              generation if isinstance(generation, int) else None, now))


def _router_capacity(tpc: TieredPrefixCache, router: dict[str, Any] | None,
                     observed_blocks: int | None) -> RouterCapacityStatus | None:
    """The CPU-tier capacity the rendered router config carries, and whether it is the
    engine's own figure: read back from the render, so status says what was used."""
    if router is None:
        return None
    text = router.get("data", {}).get(PLUGINS_FILE, "")
    found = re.search(r"lruCapacityPerServer: (\d+)", text)
    if found is None:
        return None
    blocks = int(found.group(1))
    engine = observed_blocks is not None and blocks == observed_blocks
    return RouterCapacityStatus(cpu_blocks=blocks, source="engine" if engine else "computed")


def _injected_pod_ips(tpc: TieredPrefixCache, pods: list[PodView]) -> list[str]:
    """The addresses of the pods this cache injected that run (the evictor's event
    pods); a pod without an address yet joins at a later reconcile."""
    return [pod.ip for pod in pods
            if pod.namespace == tpc.namespace and pod.cache == tpc.name and pod.active
            and not pod.opted_out and pod.ip]


def reconcile(body: dict[str, Any], gw: Gateway, ctx: RenderContext, pods: list[PodView],
              runs: list[EvictorRun], now: str,
              conflicts: dict[str, str] | None = None,
              observed: CacheObservation | None = None,
              observing: bool = False,
              reference_namespaces: frozenset[str] = frozenset()) -> Outcome:
    """conflicts: pods the webhook left alone, with why (pod name: reason); observed: the
    latest observation round's figures for this cache; observing: whether the operator
    observes at all (off: the tier conditions say so); reference_namespaces: where
    references to other namespaces may point (check_prerequisites)."""
    try:
        tpc = parse_tpc(body)
    except InvalidResource as err:
        return Outcome(status=invalid_status(body, err, now),
                       events=[("Warning", "InvalidSpec", str(err))], ok=False)
    events: list[tuple[str, str, str]] = [
        ("Warning", "DeprecatedField", message) for message in deprecations(tpc)]
    prerequisites = check_prerequisites(tpc, gw, reference_namespaces)
    adapter = adapter_for(tpc.spec)
    run = latest_run(runs, tpc)
    _, usage = eviction_status(run)
    tiers = observed_tiers(tpc, adapter.offloaded_tiers(tpc.spec), observed, usage, observing,
                           run)
    observed_blocks = None if tiers.cpu_capacity_tokens is None else \
        tiers.cpu_capacity_tokens // adapter.router_block_size(tpc.spec)
    if observed_blocks and tpc.spec.cpu is not None:  # under one block: the computed one
        ctx = replace(ctx, observed_cpu_blocks=observed_blocks)
    storage = reconcile_storage(tpc, gw, events)
    cronjob = render_cronjob(tpc, ctx)
    # The pods' identities the evictor publishes its removals under: updated as pods come
    # and go (every reconcile; unchanged content is no write), gone with the CronJob.
    event_pods_error = _apply_owned(
        tpc, gw, render_event_pods_configmap(tpc, _injected_pod_ips(tpc, pods))
        if cronjob is not None else None,
        "ConfigMap", names.event_pods_configmap_name(tpc), events)
    cron_error = _apply_owned(tpc, gw, cronjob, "CronJob", names.cronjob_name(tpc), events)
    cron_error = event_pods_error or cron_error
    object_cron_error = _apply_owned(tpc, gw, render_object_evictor(tpc, ctx), "CronJob",
                                     names.object_evictor_name(tpc), events)
    cron_error = cron_error or object_cron_error
    router = render_router_configmap(tpc, ctx.observed_cpu_blocks)
    router_name = names.router_configmap_name(tpc)
    router_error = _apply_owned(tpc, gw, router, "ConfigMap", router_name, events) or \
        _drop_renamed(tpc, gw, "ConfigMap", "router", router_name if router else None, events)
    digest = config_hash(tpc, ctx)
    counts = count_pods(tpc, pods, digest)
    conflicts = conflicts or {}
    if counts.pending or conflicts:
        # kopf's pod index keeps a pod whose deletion it never saw (a watch restarted across
        # it): report, restart workloads for, and keep conflicts of only the pods the
        # server still has.
        live = gw.pod_identities(tpc.namespace, tpc.spec.selector.query())
        pods = [p for p in pods if p.namespace != tpc.namespace or p.identity in live]
        counts = count_pods(tpc, pods, digest)
        live_names = {name for name, _ in live}
        conflicts = {pod: why for pod, why in conflicts.items() if pod in live_names}
    injected = injected_condition(counts, [f"pod {pod}: {why}"
                                           for pod, why in sorted(conflicts.items())])
    if counts.pending and tpc.spec.rollout == RolloutPolicy.Auto and not conflicts:
        # Only workloads whose owner opted in (their pod template's label) are restarted.
        opted_in = set(counts.pending) - set(counts.not_opted_in)
        pending = [p for p in pods if p.namespace == tpc.namespace and p.name in opted_in]
        if pending:
            result = roll(gw, tpc.namespace, tpc.name, pending, digest)
            not_opted = (f"; {len(counts.not_opted_in)} more lack the opt-in label "
                         f"{names.LABEL_CACHE}: {tpc.name}" if counts.not_opted_in else "")
            injected = Cond("False", "RollingOut", f"{len(counts.pending)} pod(s) pending: "
                                                   f"{result.message}{not_opted}")
        else:
            result = RolloutResult("no pending pod opted in")
            injected = opt_in_condition(tpc, counts)
        if result.restarted is not None:
            events.append(("Normal", "RolloutStarted", f"restarting {result.restarted.kind} "
                                                       f"{result.restarted.name}"))
    if router_error:
        injected = Cond("False", "RouterConfigRejected", router_error)
    evictor = evictor_condition(tpc, run)
    if cron_error:
        evictor = Cond("False", "CronJobRejected", cron_error)
    ready = ready_condition(storage.condition, injected, evictor, prerequisites)
    last_eviction, usage = eviction_status(run)
    generation = tpc.metadata.generation
    previous = {c.get("type"): c for c in (body.get("status") or {}).get("conditions") or []}
    advice_events = [
        ("Normal" if c.status == "True" else "Warning", c.reason, c.message)
        for kind, c in ((METRICS_READABLE, tiers.metrics), (TIERS_EFFECTIVE, tiers.advice))
        if c is not None and (previous.get(kind) or {}).get("reason") != c.reason]
    status = TieredPrefixCacheStatus(
        observed_generation=generation,
        conditions=conditions({READY: ready, STORAGE_READY: storage.condition,
                               INJECTED: injected, EVICTOR_HEALTHY: evictor,
                               PREREQUISITES_READY: prerequisites,
                               ENGINE_VERSION: engine_version_condition(tpc),
                               **({METRICS_READABLE: tiers.metrics} if tiers.metrics else {}),
                               **({TIERS_EFFECTIVE: tiers.advice} if tiers.advice else {})},
                              (body.get("status") or {}).get("conditions"), generation, now),
        config_hash=digest,
        injected_pods=counts.injected,
        pending_pods=len(counts.pending),
        pvc=ClaimStatus(name=storage.claim, phase=storage.phase, capacity=storage.capacity)
        if storage.claim else None,
        usage=usage,
        last_eviction=last_eviction,
        hit_percent=tiers.hit_percent,
        tiers=tiers.tiers,
        recompute=tiers.recompute,
        observation=tiers.observation,
        router_capacity=_router_capacity(tpc, router, ctx.observed_cpu_blocks),
    )
    ok = not (cron_error or router_error) and storage.condition.reason not in (
        "ClaimRejected", "ClaimNotFound")
    return Outcome(status=status, events=events, pending_pods=counts.pending, ok=ok,
                   render_context=ctx, advice_events=advice_events)
