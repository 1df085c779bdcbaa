"""Which command lines injection edits, how, and the conflicts it reports instead."""

from __future__ import annotations

import copy
import json

import pytest

from kvtier_operator import names
from kvtier_operator.context import RenderContext
from kvtier_operator.engines.cmdline.argv import MAX_COMMAND_CHARS
from kvtier_operator.engines.vllm.launch import kv_transfer_json as _json
from kvtier_operator.engines.vllm.launch import runs_vllm
from kvtier_operator.render.connector import kv_transfer_config
from kvtier_operator.render.pod import inject
from kvtier_operator.validation import parse_tpc
from tests.helpers import tpc_doc, vllm_pod


def kv_transfer_json(t):
    """The --kv-transfer-config JSON vLLM gets for a cache."""
    return _json(kv_transfer_config(t))

CTX = RenderContext(offload_image="reg/kvtier-offload:1", evictor_image="reg/kvtier:1")
OPTION = '--kv-transfer-config "$KVTIER_KV_TRANSFER_CONFIG"'


def tpc(spec=None):
    return parse_tpc(tpc_doc(spec))


def injected(pod, spec=None):
    result = inject(tpc(spec), pod, CTX)
    assert result.changed and not result.conflicts, result.conflicts
    return result.pod["spec"]["containers"][0]


def conflicts(pod, spec=None) -> str:
    result = inject(tpc(spec), pod, CTX)
    assert not result.changed and result.pod == pod
    assert names.ANNOTATION_CONFIG_HASH not in (pod.get("metadata") or {}).get("annotations", {})
    assert result.conflicts
    return "\n".join(result.conflicts)


def env_value(container, name):
    return next(e["value"] for e in container["env"] if e["name"] == name)


def test_exec_form_doubles_every_dollar_for_the_kubelet():
    t = parse_tpc(tpc_doc())
    storage = t.spec.storage.model_copy(update={"mount_path": "/mnt/$(HF_TOKEN)"})
    t = t.model_copy(update={"spec": t.spec.model_copy(update={"storage": storage})})
    c = inject(t, vllm_pod(), CTX).pod["spec"]["containers"][0]
    written = c["args"][c["args"].index("--kv-transfer-config") + 1]
    assert "/mnt/$$(HF_TOKEN)" in written
    assert written.replace("$$", "$") == kv_transfer_json(t)
    assert env_value(c, names.ENV_KV_TRANSFER_CONFIG) == written


def test_shell_form_gets_only_constant_text_and_the_env_var():
    pod = vllm_pod(command=["bash", "-lc"], args=["set -e\nexec vllm serve m --port 8000"])
    c = injected(pod)
    assert c["args"] == [f"set -e\nexec vllm serve m --port 8000 {OPTION}"]
    assert json.loads(env_value(c, names.ENV_KV_TRANSFER_CONFIG)) == json.loads(
        kv_transfer_json(tpc()))


SWEEP = list(names.SHM_SWEEP_PREFIX)


@pytest.mark.parametrize(("command", "args", "expected_command", "expected_args"), [
    # the /dev/shm sweep goes right before the program, past the launcher
    (["tini", "--", "vllm", "serve"], ["m"], ["tini", "--", *SWEEP, "vllm", "serve"],
     ["m", "--kv-transfer-config", None]),
    (["tini", "--", "sh", "-c", "exec vllm serve m"], None,
     ["tini", "--", *SWEEP, "sh", "-c", f"exec vllm serve m {OPTION}"], None),
    (["env", "A=1", "python3", "-u", "-m", "vllm.entrypoints.openai.api_server"], None,
     ["env", "A=1", *SWEEP, "python3", "-u", "-m", "vllm.entrypoints.openai.api_server"],
     ["--kv-transfer-config", None]),
    (["sh", "-e", "-c"], ["exec vllm serve m", "name"], [*SWEEP, "sh", "-e", "-c"],
     [f"exec vllm serve m {OPTION}", "name"]),
])
def test_launchers_and_options_are_read(command, args, expected_command, expected_args):
    c = injected(vllm_pod(command=command, args=args))
    assert c["command"] == expected_command
    if expected_args is None:
        assert not c.get("args")
    else:
        assert [a for a in c["args"] if not a.startswith("{")] == [
            a for a in expected_args if a is not None]


@pytest.mark.parametrize(("command", "args", "needle"), [
    (["uv", "run", "vllm", "serve", "m"], None, "cannot tell how container 'vllm' starts vLLM"),
    (["vllm", "serve"], ["m", "--", "x"], "passes '--' to vLLM"),
    (["bash", "--rcfile", "x", "-c", "exec vllm serve m"], None, "--rcfile"),
    (["sh", "-c", 'echo "starting vllm serve"; exec vllm serve m'], None, "also mentions"),
    (["bash", "-lc", "sh -c 'exec vllm serve m'"], None, "only where kvtier cannot edit"),
    (["sh", "-c", "cat <<EOF\nx\nEOF\nexec vllm serve m"], None, "here-document"),
    (["sh", "-c", "export T=$(HF_TOKEN); exec vllm serve m"], None,
     "has $(HF_TOKEN) before vLLM's entry point"),
])
def test_what_it_cannot_read_with_certainty_is_a_conflict_naming_the_fix(command, args, needle):
    pod = vllm_pod(command=command, args=args,
                   env=[{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "s"}}}])
    found = conflicts(pod)
    assert needle in found
    if "passes '--'" not in found:
        assert "start a line of the script with `exec vllm serve`" in found


@pytest.mark.parametrize("script", [
    'exec vllm serve m "--kv-transfer-config={}"',
    "exec vllm serve m '--kv_offloading_size' 10",
    'exec vllm serve m --kv-offloading-backend="native"',
    # vLLM reads '_' and '-' alike in a flag's name, dotted sub-keys included
    "exec vllm serve m --kv-transfer_config.kv_connector X",
    "exec vllm serve m --kv_transfer-config '{}'",
    "exec vllm serve m --kv-offloading_backend native",
])
def test_own_offload_flags_are_found_however_quoted(script):
    assert "already passes" in conflicts(vllm_pod(command=["sh", "-c", script], args=None))


@pytest.mark.parametrize(("command", "args"), [
    (["sh", "-c", "KVTIER_KV_TRANSFER_CONFIG={}; exec vllm serve m"], None),
    (["sh", "-c", "unset KVTIER_KV_TRANSFER_CONFIG\nexec vllm serve m"], None),
    (["env", "KVTIER_KV_TRANSFER_CONFIG=x", "sh", "-c", "exec vllm serve m"], None),
])
def test_a_command_line_that_touches_the_config_env_var_is_a_conflict(command, args):
    """A script that sets or unsets the variable kvtier passes the config in would start
    vLLM without it: left alone, with the reason."""
    assert "mentions KVTIER_KV_TRANSFER_CONFIG" in conflicts(vllm_pod(command=command,
                                                                      args=args))


def test_a_user_set_config_env_var_is_a_conflict_unless_it_matches():
    pod = vllm_pod(env=[{"name": names.ENV_KV_TRANSFER_CONFIG, "value": "{}"}])
    found = conflicts(pod)
    assert f"sets {names.ENV_KV_TRANSFER_CONFIG}={{}}; kvtier needs the --kv-transfer-config JSON" \
        in found
    same = vllm_pod(env=[{"name": names.ENV_KV_TRANSFER_CONFIG,
                          "value": kv_transfer_json(tpc()).replace("$", "$$")}])
    assert injected(same)


def test_overlong_command_lines_are_not_read():
    long_arg = "x" * MAX_COMMAND_CHARS
    pod = vllm_pod(args=["m", long_arg])
    assert f"longer than the {MAX_COMMAND_CHARS} characters kvtier reads" in conflicts(pod)
    named = copy.deepcopy(pod)
    assert "shorten it" in conflicts(named, {"containerName": "vllm"})


@pytest.mark.parametrize(("container", "runs"), [
    ({"command": ["bash", "-lc", "echo hi; exec vllm serve m"]}, True),
    ({"command": ["tini", "--", "vllm", "serve", "m"]}, True),
    ({"command": ["python3", "-u", "-m", "vllm.entrypoints.openai.api_server"]}, True),
    ({"command": ["sh", "-c", "exec 'vllm' serve m"]}, True),  # found, then refused
    ({"command": ["vllm", "bench", "serve"]}, False),
    ({"command": ["vllm-router", "serve"]}, False),
])
def test_runs_vllm(container, runs):
    assert runs_vllm(container) is runs
