"""vLLM's command line: find the container that starts it and pass --kv-transfer-config.

Every vLLM adapter (GPU, TPU, LMCache, Mooncake, KVBM) configures its connector through
the one --kv-transfer-config JSON, so they share this launcher.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from kvtier_operator import names
from kvtier_operator.engines.base import Launcher
from kvtier_operator.engines.cmdline import kube_expansion, shell
from kvtier_operator.engines.cmdline.argv import (
    MAX_COMMAND_CHARS,
    command_line,
    program_start,
    words,
)
from kvtier_operator.engines.figures import PodFigures, Samples
from kvtier_operator.engines.vllm import entry as vllm_entry
from kvtier_operator.engines.vllm import metrics

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
# What a `sh -c` script gets after the command that starts vLLM: constant text. The JSON
# stays in the env var, which the shell expands inside double quotes as one word and
# never reads as shell text, whatever the CR says.
SCRIPT_OPTION = f' {KV_TRANSFER_FLAG} "${names.ENV_KV_TRANSFER_CONFIG}"'
KV_EVENTS_FLAG = "--kv-events-config"
EVENTS_SCRIPT_OPTION = f' {KV_EVENTS_FLAG} "${names.ENV_KV_EVENTS_CONFIG}"'
_OWN_EVENTS_FLAG = re.compile(r"--kv[-_]events[-_]config(?![A-Za-z0-9_\-])")
_FIX = ("run vLLM in exec form (command: [vllm, serve, ...]), or start a line of the "
        "script with `exec vllm serve`")


def runs_vllm(container: dict[str, Any]) -> bool:
    """Whether the container's command line starts vLLM's server or mentions its entry
    point anywhere (injection then decides whether it can edit it with certainty)."""
    w = words(container)
    if vllm_entry.entry_point_end(w, program_start(w)) is not None:
        return True
    return vllm_entry.mentions_entry_point(command_line(container))


def kv_transfer_json(config: dict[str, Any]) -> str:
    return json.dumps(config, separators=(",", ":"), sort_keys=False)


def add_kv_transfer_config(container: dict[str, Any], config_json: str) -> str:
    """Pass the config to vLLM: the JSON (with every `$` doubled for the kubelet) as two
    more argv words in exec form, or SCRIPT_OPTION after the command that starts vLLM in
    a `sh -c` script. Returns why not (and changes nothing) when kvtier cannot be certain
    where."""
    return _add_json_flag(container, KV_TRANSFER_FLAG, names.ENV_KV_TRANSFER_CONFIG,
                          SCRIPT_OPTION, config_json)


def add_kv_events_config(container: dict[str, Any], config_json: str) -> str:
    """Pass --kv-events-config the same way (after --kv-transfer-config was added); a
    flag of the user's own is a conflict, never overridden."""
    if _OWN_EVENTS_FLAG.search(command_line(container)):
        return (f"container {container.get('name')!r} already passes {KV_EVENTS_FLAG}; "
                "kvtier will not override it for precise routing: remove it, or use "
                "spec.router.scoring approximate")
    return _add_json_flag(container, KV_EVENTS_FLAG, names.ENV_KV_EVENTS_CONFIG,
                          EVENTS_SCRIPT_OPTION, config_json)


def _add_json_flag(container: dict[str, Any], flag: str, env_name: str, script_option: str,
                   config_json: str) -> str:
    name = container.get("name")
    command = [str(p) for p in container.get("command") or []]
    args = [str(p) for p in container.get("args") or []]
    all_words = command + args
    line = " ".join(all_words)  # command_line(container), built once
    if len(line) > MAX_COMMAND_CHARS:
        return (f"the command line of container {name!r} is longer than the "
                f"{MAX_COMMAND_CHARS} characters kvtier reads: shorten it")
    if env_name in line:
        return (f"the command line of container {name!r} mentions "
                f"{env_name}, which kvtier sets for vLLM: remove it")
    start = program_start(all_words)
    script_at = shell.script_index(all_words, start)
    if isinstance(script_at, str):
        return f"container {name!r}: {script_at}; {_FIX}"
    if script_at is not None:
        script = all_words[script_at]
        found = shell.find_entry_point(script, vllm_entry.ENTRY_POINT)
        if found.insert_at is None:
            return (f"container {name!r} runs a shell script kvtier will not edit: "
                    f"{found.problem}; {_FIX}")
        defined = {e.get("name") for e in container.get("env") or []}
        rewritten = kube_expansion.first_rewrite(script, defined, found.insert_at)
        if rewritten is not None:
            return (f"container {name!r}'s script has {rewritten} before vLLM's entry point, "
                    "which Kubernetes rewrites before the shell runs; write $NAME for an env "
                    f"var instead, or {_FIX}")
        script = script[:found.insert_at] + script_option + script[found.insert_at:]
        if script_at < len(command):
            command[script_at] = script
            container["command"] = command
        else:
            args[script_at - len(command)] = script
            container["args"] = args
        return ""
    end = vllm_entry.entry_point_end(all_words, start)
    if end is None:
        return (f"cannot tell how container {name!r} starts vLLM (its command line is neither "
                f"an entry point kvtier knows nor a `sh -c` script); {_FIX}")
    if "--" in all_words[end + 1:]:
        return (f"container {name!r} passes '--' to vLLM, after which kvtier's options "
                "would be read as arguments: remove it")
    container["args"] = [*args, flag, kube_expansion.escape(config_json)]
    return ""


class VllmLauncher(Launcher):
    """`vllm serve` / `python -m vllm.entrypoints...`, in exec form or a `sh -c` script;
    options: the --kv-transfer-config dict."""

    label: ClassVar[str] = "vLLM"
    script_option: ClassVar[str] = SCRIPT_OPTION
    command_words: ClassVar[str] = "'vllm serve' or vLLM's OpenAI server module"

    def runs_server(self, container: dict[str, Any]) -> bool:
        return runs_vllm(container)

    def own_offload_flags(self, line: str) -> list[str]:
        return sorted({m.group(0) for m in _OWN_FLAG.finditer(line)})

    def options_env(self, options: Any) -> dict[str, str]:
        return {names.ENV_KV_TRANSFER_CONFIG: kv_transfer_json(options)}

    def add_options(self, container: dict[str, Any], options: Any) -> str:
        return add_kv_transfer_config(container, kv_transfer_json(options))

    def events_env(self, config: dict[str, Any] | None) -> dict[str, str]:
        return {} if config is None else {names.ENV_KV_EVENTS_CONFIG: kv_transfer_json(config)}

    def add_events(self, container: dict[str, Any], config: dict[str, Any]) -> str:
        return add_kv_events_config(container, kv_transfer_json(config))

    serving_port: ClassVar[int | None] = 8000  # the OpenAI server's --port default
    metrics_port: ClassVar[int | None] = serving_port
    metric_families: ClassVar[frozenset[str]] = metrics.FAMILIES

    def read_metrics(self, samples: Samples, offloaded: tuple[str, ...]) -> PodFigures | None:
        return metrics.read(samples, offloaded)


VLLM = VllmLauncher()
