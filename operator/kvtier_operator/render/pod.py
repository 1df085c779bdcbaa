"""Inject a TieredPrefixCache into a model-server pod (or a workload's pod template).

`inject_plan()` applies a cache's pod plan (plan.py) and only reads it; `inject()` builds
the plan first. Both are pure: they return a new pod and never edit the one given. When anything
would override the user's own settings it changes nothing and lists the conflicts, so
the caller can report them instead of silently rewriting a pod.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier_operator import names
from kvtier_operator.api.quantity import MAX_BYTES, format_bytes, quantity_bytes
from kvtier_operator.api.v1alpha1 import TieredPrefixCache
from kvtier_operator.context import RenderContext
from kvtier_operator.engines.base import PodRole
from kvtier_operator.engines.chained_tiers import SecretEnv
from kvtier_operator.engines.cmdline import kube_expansion
from kvtier_operator.engines.cmdline.argv import MAX_COMMAND_CHARS, command_line, prefix_program
from kvtier_operator.plan import PodPlan, pod_plan


@dataclass
class Injection:
    pod: dict[str, Any]
    changed: bool
    container: str | None
    config_hash: str
    conflicts: list[str] = field(default_factory=list)


def config_hash(tpc: TieredPrefixCache, ctx: RenderContext) -> str:
    """The config hash pods of this cache must carry (the plan's; see plan.py)."""
    return pod_plan(tpc, ctx).hash()


class UnreadablePod(ValueError):
    """A value in the pod kvtier must read or change and cannot: a conflict naming the
    field, never the webhook's catch-all."""


# Fields kvtier reads or writes, where an explicit `null` means the same as leaving the
# field out (the API server's decoding drops it; a raw review may still carry it).
_POD_FIELDS = ("containers", "initContainers", "volumes")
_CONTAINER_FIELDS = ("env", "volumeMounts", "resources", "command", "args")
_RESOURCE_FIELDS = ("requests", "limits")


def _drop_nulls(obj: dict[str, Any], fields: tuple[str, ...]) -> None:
    for key in fields:
        if key in obj and obj[key] is None:
            del obj[key]


def _without_nulls(pod: dict[str, Any]) -> None:
    """Treat `null` as absent in every field kvtier touches (in place, on its copy)."""
    for key in ("metadata", "spec"):
        if key in pod and pod[key] is None:
            del pod[key]
    meta = pod.get("metadata")
    if isinstance(meta, dict):
        _drop_nulls(meta, ("annotations", "labels"))
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        return
    _drop_nulls(spec, _POD_FIELDS)
    for key in ("containers", "initContainers"):
        containers = spec.get(key)
        if not isinstance(containers, list):
            continue
        for container in containers:
            if not isinstance(container, dict):
                raise UnreadablePod(f"spec.{key} holds {type(container).__name__} "
                                    "where a container object belongs")
            _drop_nulls(container, _CONTAINER_FIELDS)
            resources = container.get("resources")
            if isinstance(resources, dict):
                _drop_nulls(resources, _RESOURCE_FIELDS)


def _container_bytes(container: dict[str, Any], field_path: str, value: Any) -> int:
    """A quantity from the pod, or UnreadablePod naming the container's field."""
    try:
        return quantity_bytes(value)
    except ValueError as err:
        raise UnreadablePod(f"container {container.get('name')!r} {field_path}: {err}; "
                            "kvtier adds the CPU tier to it and cannot read it") from None


def _raised(container: dict[str, Any], field_path: str, value: Any, increase: int) -> str:
    """The quantity at field_path raised by `increase`, still a Kubernetes quantity."""
    total = _container_bytes(container, field_path, value) + increase
    if total > MAX_BYTES:
        raise UnreadablePod(f"container {container.get('name')!r} {field_path}: {value!r} plus "
                            f"the {format_bytes(increase)} kvtier adds is more than 2^63-1 "
                            "bytes (8Ei); lower it")
    return format_bytes(total)


def find_container(plan: PodPlan, pod_spec: dict[str, Any]
                   ) -> tuple[dict | None, PodRole, str]:
    """The container to inject, its role (the engine's server, or a multi-host worker
    that only gets env and memory), or None and why not."""
    launcher = plan.adapter.launcher
    containers = pod_spec.get("containers") or []
    wanted = plan.container_name
    if wanted:
        for c in containers:
            if c.get("name") == wanted:
                worker = launcher.runs_worker(c) and not launcher.runs_server(c)
                return c, PodRole.worker if worker else PodRole.server, ""
        # A multi-host worker pod names its container differently from the leader's
        # (llm-d: modelserver-leader, modelserver-worker): its one worker container.
        workers = [c for c in containers if launcher.runs_worker(c)
                   and not launcher.runs_server(c)]
        if len(workers) == 1:
            return workers[0], PodRole.worker, ""
        have = ", ".join(c.get("name", "?") for c in containers) or "none"
        return None, PodRole.server, (
            f"no container named {wanted!r} (containers: {have}); fix spec.containerName"
        )
    too_long = [c.get("name", "?") for c in containers
                if len(command_line(c)) > MAX_COMMAND_CHARS]
    if too_long:
        return None, PodRole.server, (
            f"the command line of container {too_long[0]!r} is longer than the "
            f"{MAX_COMMAND_CHARS} characters kvtier reads; set spec.containerName"
        )
    found = [c for c in containers if launcher.runs_server(c)]
    role = PodRole.server
    if not found:
        found, role = [c for c in containers if launcher.runs_worker(c)], PodRole.worker
    if len(found) == 1:
        return found[0], role, ""
    if not found:
        return None, role, (
            f"no container runs {launcher.command_words}; set spec.containerName to the "
            "model-server container"
        )
    listed = ", ".join(c.get("name", "?") for c in found)
    what = launcher.label if role == PodRole.server else "a multi-host worker"
    return None, role, f"several containers run {what} ({listed}); set spec.containerName"


def _memory(container: dict[str, Any], increase: int) -> None:
    resources = container.setdefault("resources", {})
    requests = resources.setdefault("requests", {})
    limits = resources.get("limits") or {}
    if "memory" in limits:
        limits["memory"] = _raised(container, "resources.limits.memory", limits["memory"],
                                   increase)
    if "memory" in requests:
        requests["memory"] = _raised(container, "resources.requests.memory",
                                     requests["memory"], increase)
    elif "memory" not in limits:
        # Without a limit the request would default to nothing; with one, Kubernetes
        # defaults the request to the (raised) limit.
        requests["memory"] = format_bytes(increase)
    if not requests:
        resources.pop("requests")


def _devices(resources: dict[str, Any], wanted: Mapping[str, str]) -> None:
    """Request and limit each extended resource the container does not ask for yet (an
    extended resource's request must equal its limit)."""
    for name, count in wanted.items():
        limits = resources.get("limits") or {}
        requests = resources.get("requests") or {}
        have = limits.get(name, requests.get(name))
        if have is not None:
            continue  # the pod's own count stands
        resources.setdefault("limits", {})[name] = count
        resources.setdefault("requests", {})[name] = count


def _merge_env(container: dict[str, Any], wanted: dict[str, str], conflicts: list[str]) -> None:
    env = container.setdefault("env", [])
    by_name = {e.get("name"): e for e in env}
    for name, value in wanted.items():
        have = by_name.get(name)
        written = kube_expansion.escape(value)
        if have is None:
            env.append({"name": name, "value": written})
        elif have.get("value") != written:
            shown = have.get("value", "<from valueFrom>")
            needed = ("the --kv-transfer-config JSON" if name == names.ENV_KV_TRANSFER_CONFIG
                      else value)
            hint = " or set spec.hashSeed to it" if name == "PYTHONHASHSEED" else ""
            conflicts.append(
                f"container {container.get('name')!r} sets {name}={shown}; kvtier needs "
                f"{needed}: remove it from the pod{hint}"
            )


def _merge_secret_env(container: dict[str, Any], wanted: tuple[SecretEnv, ...],
                      conflicts: list[str]) -> None:
    """Env from Secret references (never values); one the pod sets otherwise conflicts."""
    env = container.setdefault("env", [])
    by_name = {e.get("name"): e for e in env}
    for ref in wanted:
        entry = ref.entry()
        have = by_name.get(ref.name)
        if have is None:
            env.append(entry)
        elif have != entry:
            conflicts.append(
                f"container {container.get('name')!r} sets {ref.name} itself; kvtier takes "
                f"it from Secret {ref.secret!r} (spec.objectStore.credentialsSecret): "
                "remove it from the pod")


def _ephemeral_storage(container: dict[str, Any], increase: int) -> None:
    """Grow the ephemeral-storage request (and a limit, where one is set) by increase, so
    the scheduler finds room and the kubelet does not evict the pod for the emptyDir. An
    unreadable or overflowing quantity in the pod is a named conflict (UnreadablePod)."""
    if not increase:
        return
    resources = container.setdefault("resources", {})
    requests = resources.setdefault("requests", {})
    limits = resources.get("limits") or {}
    if "ephemeral-storage" in limits:
        limits["ephemeral-storage"] = _raised(
            container, "resources.limits.ephemeral-storage", limits["ephemeral-storage"],
            increase)
    have = requests.get("ephemeral-storage")
    requests["ephemeral-storage"] = format_bytes(increase) if have is None else _raised(
        container, "resources.requests.ephemeral-storage", have, increase)


def _prepend_pythonpath(container: dict[str, Any], conflicts: list[str]) -> None:
    env = container.setdefault("env", [])
    for entry in env:
        if entry.get("name") == "PYTHONPATH":
            if "valueFrom" in entry:
                conflicts.append(
                    f"container {container.get('name')!r} takes PYTHONPATH from valueFrom; "
                    "kvtier must prepend its package path: set it as a plain value"
                )
            elif names.SITE_MOUNT not in entry.get("value", "").split(":"):
                entry["value"] = f"{names.SITE_MOUNT}:{entry['value']}".rstrip(":")
            return
    env.append({"name": "PYTHONPATH", "value": names.SITE_MOUNT})


def _mount(container: dict[str, Any], volume: str, path: str, conflicts: list[str],
           read_only: bool = False) -> None:
    mounts = container.setdefault("volumeMounts", [])
    for m in mounts:
        if m.get("mountPath") == path:
            if m.get("name") != volume:
                conflicts.append(
                    f"container {container.get('name')!r} already mounts volume "
                    f"{m.get('name')!r} at {path}; remove it or pick another "
                    "spec.storage.mountPath"
                )
            return
    mount: dict[str, Any] = {"name": volume, "mountPath": path}
    if read_only:
        mount["readOnly"] = True
    mounts.append(mount)


def _add_volume(pod_spec: dict[str, Any], volume: dict[str, Any], conflicts: list[str]) -> None:
    volumes = pod_spec.setdefault("volumes", [])
    for v in volumes:
        if v.get("name") == volume["name"]:
            if v != volume:
                conflicts.append(f"the pod already has a different volume named {v['name']!r}")
            return
    volumes.append(volume)


def _shm(pod_spec: dict[str, Any], container: dict[str, Any], plan: PodPlan,
         role: PodRole, conflicts: list[str]) -> int:
    """Size a memory-backed /dev/shm where the engine keeps its CPU tier there (resize the
    pod's own if it has one, else add ours); returns the memory request increase."""
    before: int | None = None
    empty_dir: dict[str, Any] | None = None
    for m in container.get("volumeMounts") or []:
        if m.get("mountPath") != names.SHM_MOUNT:
            continue
        volume = next((v for v in pod_spec.get("volumes") or [] if v.get("name") == m.get("name")),
                      None)
        empty_dir = (volume or {}).get("emptyDir")
        if empty_dir is None or empty_dir.get("medium") != "Memory":
            result = plan.adapter.pod_sizing(plan.tpc.spec, None, container, role)
            if result.shm_bytes is not None:
                conflicts.append(
                    f"container {container.get('name')!r} mounts /dev/shm from volume "
                    f"{m.get('name')!r}, which is not a memory-backed emptyDir; kvtier sizes "
                    "/dev/shm for the CPU tier: remove that mount"
                )
            return result.memory_increase_bytes
        before = (_container_bytes(container, f"/dev/shm volume {m.get('name')!r} sizeLimit",
                                   empty_dir["sizeLimit"])
                  if empty_dir.get("sizeLimit") else None)
        break
    result = plan.adapter.pod_sizing(plan.tpc.spec, before, container, role)
    if result.shm_bytes is None:
        return result.memory_increase_bytes  # the engine keeps nothing in /dev/shm
    if empty_dir is not None:
        empty_dir["sizeLimit"] = format_bytes(result.shm_bytes)
        return result.memory_increase_bytes
    _add_volume(pod_spec, {"name": names.VOLUME_SHM,
                           "emptyDir": {"medium": "Memory",
                                        "sizeLimit": format_bytes(result.shm_bytes)}}, conflicts)
    _mount(container, names.VOLUME_SHM, names.SHM_MOUNT, conflicts)
    return result.memory_increase_bytes


def init_container(image: str, pull_policy: str) -> dict[str, Any]:
    return {
        "name": names.INIT_CONTAINER,
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": ["python3", "-m", "kvtier_offload", "install", "--target", names.SITE_MOUNT],
        "volumeMounts": [{"name": names.VOLUME_SITE, "mountPath": names.SITE_MOUNT}],
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"},
                      "limits": {"memory": "128Mi"}},
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }


def prepare_container(plan: PodPlan) -> dict[str, Any]:
    """The opt-in init container that prepares the tier's directory on a fresh volume
    (spec.storage.permissions.prepareDirectory; kvtier_offload/tier_dir.py). Root, since
    the volume's root is root's; only the capabilities to create one directory in it,
    give it to the group and set its mode, nothing else."""
    assert plan.prepare_command is not None and plan.mount_path is not None
    return {
        "name": names.PREPARE_CONTAINER,
        "image": plan.prepare_image,
        "imagePullPolicy": plan.image_pull_policy,
        "command": list(plan.prepare_command),
        "volumeMounts": [{"name": names.VOLUME_CACHE, "mountPath": plan.mount_path}],
        "resources": {"requests": {"cpu": "50m", "memory": "32Mi"},
                      "limits": {"memory": "64Mi"}},
        "securityContext": {
            "runAsUser": 0,
            "runAsNonRoot": False,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "DAC_OVERRIDE", "FOWNER"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }


def _fs_group(pod_spec: dict[str, Any], group: int, conflicts: list[str]) -> None:
    security = pod_spec.setdefault("securityContext", {})
    have = security.get("fsGroup")
    if have is not None and have != group:
        conflicts.append(
            f"the pod sets securityContext.fsGroup {have}; spec.storage.permissions.fsGroup "
            f"is {group}: make them agree")
        return
    security["fsGroup"] = group
    # Where the driver applies fsGroup, only a volume whose root is not the group's yet is
    # walked (a shared volume may hold millions of files).
    security.setdefault("fsGroupChangePolicy", "OnRootMismatch")


def inject(tpc: TieredPrefixCache, pod: dict[str, Any], ctx: RenderContext,
           workload: dict[str, Any] | None = None) -> Injection:
    """inject_plan with the cache's plan (computed here: callers that inject many pods
    for one cache build the plan once and call inject_plan)."""
    return inject_plan(pod_plan(tpc, ctx), pod, workload)


def inject_plan(plan: PodPlan, pod: dict[str, Any],
                workload: dict[str, Any] | None = None) -> Injection:
    """The pod with the plan injected, or the pod unchanged plus the conflicts.
    `workload`: the workload whose pod template `pod` is (None: `pod` is a real pod)."""
    digest = plan.hash()
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    if annotations.get(names.ANNOTATION_CONFIG_HASH) == digest:
        return Injection(pod=pod, changed=False, container=None, config_hash=digest)

    out = copy.deepcopy(pod)
    try:
        return _inject_copy(plan, pod, out, digest, workload)
    except UnreadablePod as err:
        return Injection(pod=pod, changed=False, container=None, config_hash=digest,
                         conflicts=[str(err)])


def _inject_copy(plan: PodPlan, pod: dict[str, Any], out: dict[str, Any], digest: str,
                 workload: dict[str, Any] | None) -> Injection:
    """inject_plan's work on `out`, a copy of `pod`."""
    _without_nulls(out)
    pod_spec = out.setdefault("spec", {})
    container, role, why = find_container(plan, pod_spec)
    if container is None:
        return Injection(pod=pod, changed=False, container=None, config_hash=digest,
                         conflicts=[why])
    adapter = plan.adapter
    conflicts: list[str] = []
    if plan.refusal is not None:
        conflicts.append(plan.refusal)
    group = adapter.group_conflict(plan.tpc.spec, pod, workload)
    if group:
        conflicts.append(group)
    if role == PodRole.server:
        version = adapter.version_conflict(plan.tpc.spec, container)
        if version:
            conflicts.append(version)
        contradicted = adapter.container_conflict(plan.tpc.spec, container)
        if contradicted:
            conflicts.append(contradicted)
        own = adapter.launcher.own_offload_flags(command_line(container))
        if own:
            conflicts.append(
                f"container {container.get('name')!r} already passes {', '.join(own)}; "
                "kvtier will not override hand-made offloading: remove those flags"
            )
        else:
            problem = adapter.launcher.add_options(container, plan.launch_options)
            if not problem and plan.kv_events is not None:
                problem = adapter.launcher.add_events(container, plan.kv_events)
            if problem:
                conflicts.append(problem)
        if plan.command_prefix is not None:
            # After add_options, which reads the command as the user wrote it.
            why = prefix_program(container, plan.command_prefix)
            if why:
                conflicts.append(f"ShmSweepUncertain: {why}; kvtier runs its /dev/shm "
                                 "sweep before the engine and will not start it otherwise")
    _merge_env(container, plan.env(role), conflicts)
    increase = _shm(pod_spec, container, plan, role, conflicts)
    _memory(container, increase)
    _devices(container.setdefault("resources", {}), plan.device_resources)
    if role == PodRole.server:
        _merge_secret_env(container, plan.secret_env, conflicts)
        _ephemeral_storage(container, plan.ephemeral_storage_bytes)
    if plan.claim is not None and plan.mount_path is not None:
        _add_volume(pod_spec, {"name": names.VOLUME_CACHE,
                               "persistentVolumeClaim": {"claimName": plan.claim}}, conflicts)
        _mount(container, names.VOLUME_CACHE, plan.mount_path, conflicts)
    for extra in plan.extra_volumes:
        _add_volume(pod_spec, extra.volume, conflicts)
        _mount(container, extra.volume["name"], extra.mount_path, conflicts,
               read_only=extra.read_only)
    if plan.fs_group is not None:
        _fs_group(pod_spec, plan.fs_group, conflicts)
    if plan.prepare_command is not None:
        inits = pod_spec.setdefault("initContainers", [])
        if not any(c.get("name") == names.PREPARE_CONTAINER for c in inits):
            inits.insert(0, prepare_container(plan))
    if plan.offload_image is not None:
        _add_volume(pod_spec, {"name": names.VOLUME_SITE, "emptyDir": {}}, conflicts)
        _mount(container, names.VOLUME_SITE, names.SITE_MOUNT, conflicts, read_only=True)
        _prepend_pythonpath(container, conflicts)
        inits = pod_spec.setdefault("initContainers", [])
        if not any(c.get("name") == names.INIT_CONTAINER for c in inits):
            inits.append(init_container(plan.offload_image, plan.image_pull_policy))
    if conflicts:
        return Injection(pod=pod, changed=False, container=container.get("name"),
                         config_hash=digest, conflicts=conflicts)
    meta = out.setdefault("metadata", {})
    meta_annotations = meta.setdefault("annotations", {})
    meta_annotations[names.ANNOTATION_CACHE] = plan.tpc.name
    meta_annotations[names.ANNOTATION_CONFIG_HASH] = digest
    return Injection(pod=out, changed=True, container=container.get("name"), config_hash=digest)


# Where each workload kind keeps its pod template(s).
TEMPLATE_PATHS: dict[str, tuple[tuple[str, ...], ...]] = {
    "Pod": ((),),
    "Deployment": (("spec", "template"),),
    "StatefulSet": (("spec", "template"),),
    "ReplicaSet": (("spec", "template"),),
    "DaemonSet": (("spec", "template"),),
    "Job": (("spec", "template"),),
    "LeaderWorkerSet": (
        ("spec", "leaderWorkerTemplate", "leaderTemplate"),
        ("spec", "leaderWorkerTemplate", "workerTemplate"),
    ),
}


def inject_workload(tpc: TieredPrefixCache, obj: dict[str, Any],
                    ctx: RenderContext) -> tuple[dict[str, Any], list[str]]:
    """Inject into a Pod or every pod template of a workload; (object, conflicts)."""
    kind = obj.get("kind", "")
    paths = TEMPLATE_PATHS.get(kind)
    if paths is None:
        raise ValueError(
            f"kind {kind!r} has no pod template kvtier knows; give a Pod or one of "
            + ", ".join(k for k in TEMPLATE_PATHS if k != "Pod")
        )
    out = copy.deepcopy(obj)
    conflicts: list[str] = []
    plan = pod_plan(tpc, ctx)
    for path in paths:
        parent: Any = out
        for key in path[:-1]:
            parent = parent.get(key) or {}
        template = parent.get(path[-1]) if path else out
        if template is None:
            continue
        result = inject_plan(plan, template, workload=None if kind == "Pod" else obj)
        conflicts += result.conflicts
        if path:
            parent[path[-1]] = result.pod
        else:
            out = result.pod
    return out, conflicts
