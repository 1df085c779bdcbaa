"""Inject a TieredPrefixCache into a model-server pod (or a workload's pod template).

`inject()` is pure: it returns a new pod and never edits the one given. When anything
would override the user's own settings it changes nothing and lists the conflicts, so
the caller can report them instead of silently rewriting a pod.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from kvtier_operator.models import StorageBackend, TieredPrefixCache
from kvtier_operator.quantity import format_bytes, quantity_bytes
from kvtier_operator.render import kube_expansion, names, shell, sizing, vllm_entry
from kvtier_operator.render.connector import connector_env, kv_transfer_config, kv_transfer_json
from kvtier_operator.render.context import RenderContext

# Flags that mean the user already configured KV offloading by hand.
OWN_OFFLOAD_FLAGS = (
    "--kv-transfer-config",
    "--kv_transfer_config",
    "--kv-offloading-backend",
    "--kv_offloading_backend",
    "--kv-offloading-size",
    "--kv_offloading_size",
)
# Any of them, however quoted (a literal head: Python's search skips to "--kv" in C).
# vLLM reads '_' and '-' alike inside a flag's name, so any mix of them counts.
_OWN_FLAG = re.compile("(?:" + "|".join(sorted({"--" + f[2:].replace("_", "-").replace(
    "-", "[-_]") for f in OWN_OFFLOAD_FLAGS})) + ")" r"(?![A-Za-z0-9_\-])")
KV_TRANSFER_FLAG = "--kv-transfer-config"
# What a `sh -c` script gets after the command that starts vLLM: constant text. The JSON stays
# in the env var, which the shell expands inside double quotes as one word and never
# reads as shell text, whatever the CR says.
SCRIPT_OPTION = f' {KV_TRANSFER_FLAG} "${names.ENV_KV_TRANSFER_CONFIG}"'
# Container command lines longer than this are not read (this runs in the webhook; the
# mention search takes up to ~25 ms per MiB; a `sh -c` script is capped lower still).
MAX_COMMAND_CHARS = 256 * 1024
FORMAT_VERSION = "2"  # bump when injection changes for an unchanged spec
_FIX = ("run vLLM in exec form (command: [vllm, serve, ...]), or start a line of the "
        "script with `exec vllm serve`")


@dataclass
class Injection:
    pod: dict[str, Any]
    changed: bool
    container: str | None
    config_hash: str
    conflicts: list[str] = field(default_factory=list)


def config_hash(tpc: TieredPrefixCache, ctx: RenderContext) -> str:
    """Hash of everything injection puts into a pod for this spec; a pod carrying another
    hash (or none) is pending a restart."""
    spec = tpc.spec
    doc = {
        "format": FORMAT_VERSION,
        "kvTransferConfig": kv_transfer_config(tpc),
        "env": injected_env(tpc),
        "scriptOption": SCRIPT_OPTION,
        "cpu": spec.cpu_bytes,
        "claim": names.claim_name(tpc),
        "mountPath": spec.storage.mount_path if spec.storage else None,
        "sidecarImage": ctx.sidecar_image if spec.storage_backend == StorageBackend.kvtier
        else None,
        "containerName": spec.container_name,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def injected_env(tpc: TieredPrefixCache) -> dict[str, str]:
    """The env vars injection sets, by name, as the process sees them (unescaped)."""
    return connector_env(tpc) | {names.ENV_KV_TRANSFER_CONFIG: kv_transfer_json(tpc)}


def command_line(container: dict[str, Any]) -> str:
    return " ".join(_words(container))


def _words(container: dict[str, Any]) -> list[str]:
    return [str(p) for p in (container.get("command") or []) + (container.get("args") or [])]


def runs_vllm(container: dict[str, Any]) -> bool:
    """Whether the container's command line starts vLLM's server or mentions its entry
    point anywhere (injection then decides whether it can edit it with certainty)."""
    words = _words(container)
    if vllm_entry.entry_point_end(words, vllm_entry.program_start(words)) is not None:
        return True
    return vllm_entry.mentions_entry_point(command_line(container))


def find_container(tpc: TieredPrefixCache, pod_spec: dict[str, Any]) -> tuple[dict | None, str]:
    containers = pod_spec.get("containers") or []
    wanted = tpc.spec.container_name
    if wanted:
        for c in containers:
            if c.get("name") == wanted:
                return c, ""
        have = ", ".join(c.get("name", "?") for c in containers) or "none"
        return None, (
            f"no container named {wanted!r} (containers: {have}); fix spec.containerName"
        )
    too_long = [c.get("name", "?") for c in containers
                if len(command_line(c)) > MAX_COMMAND_CHARS]
    if too_long:
        return None, (
            f"the command line of container {too_long[0]!r} is longer than the "
            f"{MAX_COMMAND_CHARS} characters kvtier reads; set spec.containerName"
        )
    found = [c for c in containers if runs_vllm(c)]
    if len(found) == 1:
        return found[0], ""
    if not found:
        return None, (
            "no container runs 'vllm serve' or vLLM's OpenAI server module; set "
            "spec.containerName to the model-server container"
        )
    listed = ", ".join(c.get("name", "?") for c in found)
    return None, f"several containers run vLLM ({listed}); set spec.containerName"


def _add_kv_transfer_config(container: dict[str, Any], config_json: str) -> str:
    """Pass the config to vLLM: the JSON (with every `$` doubled for the kubelet) as two
    more argv words in exec form, or SCRIPT_OPTION after the command that starts vLLM in
    a `sh -c` script. Returns why not (and changes nothing) when kvtier cannot be certain where."""
    name = container.get("name")
    command = [str(p) for p in container.get("command") or []]
    args = [str(p) for p in container.get("args") or []]
    words = command + args
    line = " ".join(words)  # command_line(container), built once
    if len(line) > MAX_COMMAND_CHARS:
        return (f"the command line of container {name!r} is longer than the "
                f"{MAX_COMMAND_CHARS} characters kvtier reads: shorten it")
    if names.ENV_KV_TRANSFER_CONFIG in line:
        return (f"the command line of container {name!r} mentions "
                f"{names.ENV_KV_TRANSFER_CONFIG}, which kvtier sets for vLLM: remove it")
    start = vllm_entry.program_start(words)
    script_at = shell.script_index(words, start)
    if isinstance(script_at, str):
        return f"container {name!r}: {script_at}; {_FIX}"
    if script_at is not None:
        script = words[script_at]
        found = shell.find_entry_point(script)
        if found.insert_at is None:
            return (f"container {name!r} runs a shell script kvtier will not edit: "
                    f"{found.problem}; {_FIX}")
        defined = {e.get("name") for e in container.get("env") or []}
        rewritten = kube_expansion.first_rewrite(script, defined, found.insert_at)
        if rewritten is not None:
            return (f"container {name!r}'s script has {rewritten} before vLLM's entry point, "
                    "which Kubernetes rewrites before the shell runs; write $NAME for an env "
                    f"var instead, or {_FIX}")
        script = script[:found.insert_at] + SCRIPT_OPTION + script[found.insert_at:]
        if script_at < len(command):
            command[script_at] = script
            container["command"] = command
        else:
            args[script_at - len(command)] = script
            container["args"] = args
        return ""
    end = vllm_entry.entry_point_end(words, start)
    if end is None:
        return (f"cannot tell how container {name!r} starts vLLM (its command line is neither "
                f"an entry point kvtier knows nor a `sh -c` script); {_FIX}")
    if "--" in words[end + 1:]:
        return (f"container {name!r} passes '--' to vLLM, after which kvtier's options "
                "would be read as arguments: remove it")
    container["args"] = [*args, KV_TRANSFER_FLAG, kube_expansion.escape(config_json)]
    return ""


def _memory(resources: dict[str, Any], increase: int) -> None:
    requests = resources.setdefault("requests", {})
    limits = resources.get("limits") or {}
    if "memory" in limits:
        limits["memory"] = format_bytes(quantity_bytes(limits["memory"]) + increase)
    if "memory" in requests:
        requests["memory"] = format_bytes(quantity_bytes(requests["memory"]) + increase)
    elif "memory" not in limits:
        # Without a limit the request would default to nothing; with one, Kubernetes
        # defaults the request to the (raised) limit.
        requests["memory"] = format_bytes(increase)
    if not requests:
        resources.pop("requests")


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


def _worker_processes(tpc: TieredPrefixCache, container: dict[str, Any]) -> int:
    """vLLM worker processes in the container, where it matters: without a CPU tier each
    pins its own staging. A command line too long to read is a conflict anyway."""
    if not tpc.spec.gpu_direct or len(command_line(container)) > MAX_COMMAND_CHARS:
        return 1
    return sizing.worker_processes(container)


def _shm(pod_spec: dict[str, Any], container: dict[str, Any], tpc: TieredPrefixCache,
         conflicts: list[str]) -> sizing.PodSizing:
    """Size a memory-backed /dev/shm: resize the pod's own if it has one, else add ours."""
    workers = _worker_processes(tpc, container)
    for m in container.get("volumeMounts") or []:
        if m.get("mountPath") != names.SHM_MOUNT:
            continue
        volume = next((v for v in pod_spec.get("volumes") or [] if v.get("name") == m.get("name")),
                      None)
        empty_dir = (volume or {}).get("emptyDir")
        if empty_dir is None or empty_dir.get("medium") != "Memory":
            conflicts.append(
                f"container {container.get('name')!r} mounts /dev/shm from volume "
                f"{m.get('name')!r}, which is not a memory-backed emptyDir; kvtier sizes "
                "/dev/shm for the CPU tier: remove that mount"
            )
            return sizing.pod_sizing(tpc.spec, None, workers)
        before = quantity_bytes(empty_dir["sizeLimit"]) if empty_dir.get("sizeLimit") else None
        result = sizing.pod_sizing(tpc.spec, before, workers)
        empty_dir["sizeLimit"] = format_bytes(result.shm_bytes)
        return result
    result = sizing.pod_sizing(tpc.spec, None, workers)
    _add_volume(pod_spec, {"name": names.VOLUME_SHM,
                           "emptyDir": {"medium": "Memory",
                                        "sizeLimit": format_bytes(result.shm_bytes)}}, conflicts)
    _mount(container, names.VOLUME_SHM, names.SHM_MOUNT, conflicts)
    return result


def init_container(ctx: RenderContext) -> dict[str, Any]:
    return {
        "name": names.INIT_CONTAINER,
        "image": ctx.sidecar_image,
        "imagePullPolicy": ctx.image_pull_policy,
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


def inject(tpc: TieredPrefixCache, pod: dict[str, Any], ctx: RenderContext) -> Injection:
    """The pod with the cache injected, or the pod unchanged plus the conflicts."""
    digest = config_hash(tpc, ctx)
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    if annotations.get(names.ANNOTATION_CONFIG_HASH) == digest:
        return Injection(pod=pod, changed=False, container=None, config_hash=digest)

    out = copy.deepcopy(pod)
    pod_spec = out.setdefault("spec", {})
    container, why = find_container(tpc, pod_spec)
    if container is None:
        return Injection(pod=pod, changed=False, container=None, config_hash=digest,
                         conflicts=[why])
    conflicts: list[str] = []
    own = sorted({m.group(0) for m in _OWN_FLAG.finditer(command_line(container))})
    if own:
        conflicts.append(
            f"container {container.get('name')!r} already passes {', '.join(own)}; kvtier "
            "will not override hand-made offloading: remove those flags"
        )
    spec = tpc.spec
    if not own:
        problem = _add_kv_transfer_config(container, kv_transfer_json(tpc))
        if problem:
            conflicts.append(problem)
    _merge_env(container, injected_env(tpc), conflicts)
    pod_sizing = _shm(pod_spec, container, tpc, conflicts)
    _memory(container.setdefault("resources", {}), pod_sizing.memory_increase_bytes)
    claim = names.claim_name(tpc)
    if spec.storage is not None and claim is not None:
        _add_volume(pod_spec, {"name": names.VOLUME_CACHE,
                               "persistentVolumeClaim": {"claimName": claim}}, conflicts)
        _mount(container, names.VOLUME_CACHE, spec.storage.mount_path, conflicts)
    if spec.storage_backend == StorageBackend.kvtier:
        _add_volume(pod_spec, {"name": names.VOLUME_SITE, "emptyDir": {}}, conflicts)
        _mount(container, names.VOLUME_SITE, names.SITE_MOUNT, conflicts, read_only=True)
        _prepend_pythonpath(container, conflicts)
        inits = pod_spec.setdefault("initContainers", [])
        if not any(c.get("name") == names.INIT_CONTAINER for c in inits):
            inits.append(init_container(ctx))
    if conflicts:
        return Injection(pod=pod, changed=False, container=container.get("name"),
                         config_hash=digest, conflicts=conflicts)
    meta = out.setdefault("metadata", {})
    meta_annotations = meta.setdefault("annotations", {})
    meta_annotations[names.ANNOTATION_CACHE] = tpc.name
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
    for path in paths:
        parent: Any = out
        for key in path[:-1]:
            parent = parent.get(key) or {}
        template = parent.get(path[-1]) if path else out
        if template is None:
            continue
        result = inject(tpc, template, ctx)
        conflicts += result.conflicts
        if path:
            parent[path[-1]] = result.pod
        else:
            out = result.pod
    return out, conflicts
