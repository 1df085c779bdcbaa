"""Injected pods run under a real shell: a hostile mount path never runs, and vLLM gets
exactly the config, or the pod is left alone as a conflict (audit D1, D2, D8).

Each case injects a TieredPrefixCache whose storage.mountPath is forced past validation
(so the renderer alone is on trial), applies Kubernetes' `$(VAR)` expansion to the
container's env and command line as the kubelet does, and runs the command line with
stub `vllm`/`python3`/`python` programs first on PATH that record their argv.
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvtier_operator import names
from kvtier_operator.api.v1alpha1 import TieredPrefixCache
from kvtier_operator.context import RenderContext
from kvtier_operator.render.connector import connector_env, kv_transfer_config
from kvtier_operator.render.pod import inject
from kvtier_operator.validation import parse_tpc
from tests.helpers import example, tpc_doc, vllm_pod

CTX = RenderContext(offload_image="reg/kvtier-offload:1", evictor_image="reg/kvtier:1")
SECRET = "hf_SECRET_VALUE"  # what the kubelet would put in for the HF_TOKEN secret
MARK = "PWNED"  # every payload tries to create this file in the working directory

HOSTILE_PATHS = [
    "/mnt/ok",
    f"/mnt/$(touch {MARK})",
    f"/mnt/`touch {MARK}`",
    f"/mnt/'$(touch {MARK})'",
    f'/mnt/"$(touch {MARK})"',
    f'/mnt/\\"$(touch {MARK})',
    f"/mnt/x;touch {MARK}",
    f"/mnt/x && touch {MARK}",
    f"/mnt/x\ntouch {MARK}",
    f"/mnt/${{IFS}}touch${{IFS}}{MARK}",
    f"/mnt/${{x:-$(touch {MARK})}}",
    f"/mnt/x'; touch {MARK}; echo '",
    f'/mnt/x"; touch {MARK}; echo "',
    f"/mnt/x|touch {MARK}",
    f"/mnt/$$(touch {MARK})",
    "/mnt/$(HF_TOKEN)",
]

# (name, container command, container args, expected): "inject" shapes must be injected;
# "either" shapes may instead be a conflict. "{stub}" is the stub directory (bash -l
# resets PATH from /etc/profile).
EXAMPLE = example("vllm-deployment.yaml")["spec"]["template"]["spec"]["containers"][0]
SHAPES: list[tuple[str, list[str] | None, list[str] | None, str]] = [
    ("exec", ["vllm", "serve"], ["Qwen/Qwen3-32B", "--tensor-parallel-size=2"], "inject"),
    ("exec-python-module", ["python3", "-m", "vllm.entrypoints.openai.api_server"],
     ["--model", "m"], "inject"),
    ("exec-cli-module", ["python", "-m", "vllm.entrypoints.cli.main", "serve", "m"], None,
     "inject"),
    ("sh-c-one-line", ["sh", "-c", "exec vllm serve m --port 8000"], None, "inject"),
    ("example-multi-line", EXAMPLE["command"], EXAMPLE["args"], "inject"),
    ("bash-lc", ["bash", "-lc"], ["exec {stub}/vllm serve m"], "inject"),
    ("bash-ec", ["bash", "-ec", "exec vllm serve m"], None, "inject"),
    ("sh-e-c", ["sh", "-e", "-c", "exec vllm serve m"], None, "inject"),
    ("sh-xe-c", ["/bin/sh", "-xe", "-c", "vllm serve m"], None, "inject"),
    ("bash-o-pipefail-c", ["bash", "-o", "pipefail", "-c", "vllm serve m 2>&1 | cat"], None,
     "inject"),
    ("set-e-then-exec", ["/bin/bash", "-c"],
     ["set -e\nexport VLLM_LOGGING_LEVEL=INFO\nexec vllm serve m \\\n  --port 8000\n"],
     "inject"),
    ("comment-first", ["sh", "-c", "# start vllm serve below\nexec vllm serve m"], None,
     "inject"),
    ("command-substitution-first", ["dash", "-c"],
     ['H=$(echo host); exec vllm serve m --host "$H"'], "inject"),
    ("sh-c-python-module",
     ["sh", "-c", "exec python3 -m vllm.entrypoints.openai.api_server --model m"], None,
     "inject"),
    ("shell-env-model", ["sh", "-c", 'exec vllm serve "$MODEL" --served-model-name x'],
     None, "inject"),
    # the kubelet rewrites $(MODEL) inside the very command kvtier edits: its value could
    # end that command early, so this is a conflict (the message says to write $MODEL)
    ("kube-reference-in-command", ["sh", "-c", "exec vllm serve $(MODEL) --port 8000"], None,
     "either"),
    ("echo-first", ["sh", "-c", 'echo "starting vllm serve"; exec vllm serve m'], None,
     "either"),
    ("echo-first-single", ["bash", "-c", "echo 'vllm serve' && exec vllm serve m"], None,
     "either"),
    ("nested-sh-single", ["sh", "-c", "sh -c 'exec vllm serve m'"], None, "either"),
    ("nested-sh-double", ["sh", "-c", 'sh -c "exec vllm serve m"'], None, "either"),
    ("two-entry-points", ["sh", "-c", "vllm serve a || vllm serve b"], None, "either"),
    ("after-keyword", ["sh", "-c", "if true; then exec vllm serve m; fi"], None, "either"),
    ("kube-reference-first", ["sh", "-c", "echo $(HF_TOKEN); exec vllm serve m"], None,
     "either"),
]


def kube_expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's expansion: `$(NAME)` of a known NAME becomes its value, `$$` becomes
    `$`, anything else (unknown names, a lone or unclosed `$(`) stays as written."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                close = text.find(")", i + 2)
                if close >= 0:
                    name = text[i + 2:close]
                    out.append(env[name] if name in env else text[i:close + 1])
                    i = close + 1
                    continue
            out.append(text[i:i + 2])
            i += 2
            continue
        out.append(text[i])
        i += 1
    return "".join(out)


def test_kube_expand_is_the_kubelets():
    env = {"A": "x", "B": "$(A)"}
    assert kube_expand("$(A)/$(C)/$$(A)/$$$(A)/$/a$b/$(", env) == "x/$(C)/$(A)/$x/$/a$b/$("
    assert kube_expand("$(B)", env) == "$(A)"  # a value is not expanded again


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """The env the process gets: each value expanded with the entries before it."""
    env: dict[str, str] = {}
    for entry in container.get("env") or []:
        if "valueFrom" in entry:
            env[entry["name"]] = SECRET
        else:
            env[entry["name"]] = kube_expand(entry.get("value", ""), env)
    return env


def with_mount_path(tpc: TieredPrefixCache, path: str) -> TieredPrefixCache:
    """tpc with storage.mountPath set to path, skipping validation on purpose."""
    storage = tpc.spec.storage
    assert storage is not None
    spec = tpc.spec.model_copy(update={"storage": storage.model_copy(update={"mount_path": path})})
    return tpc.model_copy(update={"spec": spec})


@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> Path:
    """A directory of programs that record their argv, one file per call; `python3 -m
    kvtier_offload sweep-shm -- CMD...` (the /dev/shm sweep kvtier puts before vLLM with
    a CPU tier) execs CMD, as the real one does after sweeping."""
    root = tmp_path_factory.mktemp("stubs")
    sweep = ('if [ "$1" = -m ] && [ "$2" = kvtier_offload ] && [ "$3" = sweep-shm ] && '
             '[ "$4" = -- ]; then shift 4; exec "$@"; fi\n')
    for program in ("vllm", "python3", "python"):
        stub = root / program
        stub.write_text('#!/bin/sh\n' + (sweep if program.startswith("python") else "")
                        + 'printf \'%s\\0\' "$0" "$@" > "$STUB_CALLS/call.$$"\n')
        stub.chmod(0o755)
    return root


def run_container(container: dict[str, Any], stubs: Path, workdir: Path) -> list[list[str]]:
    """Run the container's command line as the kubelet would; the argv of each stub call."""
    env = container_env(container)
    words = [kube_expand(str(w), env)
             for w in (container.get("command") or []) + (container.get("args") or [])]
    words = [w.replace("{stub}", str(stubs)) for w in words]
    calls = workdir / "calls"
    calls.mkdir()
    process_env = {**env, "PATH": f"{stubs}:/usr/bin:/bin", "STUB_CALLS": str(calls),
                   "HOME": str(workdir)}
    subprocess.run(words, cwd=workdir, env=process_env, timeout=20, check=False,
                   stdin=subprocess.DEVNULL, capture_output=True)
    return [f.read_bytes().decode().split("\0")[:-1] for f in sorted(calls.iterdir())]


def pod_for(shape: tuple[str, list[str] | None, list[str] | None, str]) -> dict[str, Any]:
    _, command, args, _ = shape
    return vllm_pod(command=copy.deepcopy(command), args=copy.deepcopy(args),
                    env=[*copy.deepcopy(EXAMPLE["env"]), {"name": "MODEL", "value": "m"}])


def check_case(tpc: TieredPrefixCache, shape, stubs: Path, workdir: Path) -> str:
    """'' when the case is safe and correct, else what went wrong."""
    expected = shape[3]
    pod = pod_for(shape)
    result = inject(tpc, pod, CTX)
    if result.conflicts:
        annotations = result.pod.get("metadata", {}).get("annotations") or {}
        if names.ANNOTATION_CONFIG_HASH in annotations or result.pod != pod:
            return "conflict, yet the pod was changed or marked injected"
        if expected == "inject":
            return f"conflict on an ordinary shape: {result.conflicts}"
        return ""
    container = result.pod["spec"]["containers"][0]
    calls = run_container(container, stubs, workdir)
    if (workdir / MARK).exists():
        return "PAYLOAD RAN"
    if len(calls) != 1:
        return f"vLLM started {len(calls)} times: {calls}"
    argv = calls[0]
    if argv.count("--kv-transfer-config") != 1:
        return f"vLLM got {argv}"
    got = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    if got != kv_transfer_config(tpc):
        return f"vLLM got the config {got}"
    if result.pod["metadata"]["annotations"].get(names.ANNOTATION_CONFIG_HASH) is None:
        return "injected without the config-hash annotation"
    env = container_env(container)
    for key, value in connector_env(tpc).items():
        if env.get(key) != value:
            return f"env {key} is {env.get(key)!r}, not {value!r}"
    return ""


def hostile_cases(tpc: TieredPrefixCache, shape, stubs: Path, tmp_path: Path) -> list[str]:
    failures = []
    for i, path in enumerate(HOSTILE_PATHS):
        workdir = tmp_path / f"case{i}"
        workdir.mkdir()
        problem = check_case(with_mount_path(tpc, path), shape, stubs, workdir)
        if problem:
            failures.append(f"{shape[0]} x {path!r}: {problem}")
    return failures


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.slow  # runs the container's command line in a shell, per case
def test_hostile_mount_path_never_runs_and_config_arrives_intact(shape, stubs, tmp_path):
    failures = hostile_cases(parse_tpc(tpc_doc()), shape, stubs, tmp_path)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("spec", [{"cpu": None},
                                  {"connector": "lmcache", "storage": {"pvc": {"size": "1T"}}}],
                         ids=["gpu-direct", "lmcache-disk"])
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[0] in ("exec", "example-multi-line")],
                         ids=["exec", "example-multi-line"])
@pytest.mark.slow  # runs the container's command line in a shell, per case
def test_other_connectors_carry_the_path_intact(spec, shape, stubs, tmp_path):
    failures = hostile_cases(parse_tpc(tpc_doc(spec)), shape, stubs, tmp_path)
    assert not failures, "\n".join(failures)

