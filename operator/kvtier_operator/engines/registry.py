"""Every engine + connector kvtier supports, registered once.

`ADAPTERS` is the only list: the spec's validation and the CRD's CEL rules
(validation/engine_rules.py), the renderers, the webhook and the docs all read it. Adding
an engine means one adapter package, one line here, the enum value in
api/v1alpha1/settings.py, and its tests.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvtier_operator.api.v1alpha1 import TieredPrefixCacheSpec
from kvtier_operator.engines.base import Adapter
from kvtier_operator.engines.cmdline.argv import MAX_COMMAND_CHARS, command_line
from kvtier_operator.engines.sglang.adapter import SglangHicache
from kvtier_operator.engines.tpu.adapter import VllmTpuNative
from kvtier_operator.engines.vllm.gpu import VllmLmcache, VllmNative
from kvtier_operator.engines.vllm.kvbm import VllmKvbm
from kvtier_operator.engines.vllm.mooncake import VllmMooncakeStore

ADAPTERS: tuple[Adapter, ...] = (
    VllmNative(),
    VllmLmcache(),
    VllmMooncakeStore(),
    VllmKvbm(),
    VllmTpuNative(),
    SglangHicache(),
)
_BY_PAIR: dict[tuple[str, str], Adapter] = {(str(a.engine), str(a.connector)): a
                                            for a in ADAPTERS}
if len(_BY_PAIR) != len(ADAPTERS):
    raise RuntimeError("two adapters registered for one engine and connector")
# The API's defaults (an unset engine or connector), for CEL and the webhook.
DEFAULT_ENGINE = str(TieredPrefixCacheSpec.model_fields["engine"].default)
DEFAULT_CONNECTOR = str(TieredPrefixCacheSpec.model_fields["connector"].default)
SETTINGS_BLOCKS = tuple(sorted({a.settings_block for a in ADAPTERS if a.settings_block}))


def engines_in(pod_spec: Any) -> frozenset[str]:
    """The engines (Launcher.label) whose server or multi-host worker some container of
    the pod runs; a command line longer than kvtier reads counts as none."""
    containers = pod_spec.get("containers") if isinstance(pod_spec, dict) else None
    found: set[str] = set()
    launchers = {a.launcher.label: a.launcher for a in ADAPTERS}
    for container in containers if isinstance(containers, list) else []:
        if not isinstance(container, dict) or len(command_line(container)) > MAX_COMMAND_CHARS:
            continue
        found.update(label for label, launcher in launchers.items()
                     if launcher.runs_server(container) or launcher.runs_worker(container))
    return frozenset(found)


def engines() -> list[str]:
    return list(dict.fromkeys(str(a.engine) for a in ADAPTERS))


def connectors_of(engine: str) -> list[str]:
    return [str(a.connector) for a in ADAPTERS if str(a.engine) == engine]


def allowed_pairs_text(adapters: Iterable[Adapter] = ADAPTERS) -> str:
    """'engine vllm with connector native, lmcache...; engine vllm-tpu with ...'."""
    by_engine: dict[str, list[str]] = {}
    for a in adapters:
        by_engine.setdefault(str(a.engine), []).append(str(a.connector))
    return "; ".join(f"engine {e} with connector {', '.join(c)}" for e, c in by_engine.items())


def adapter_for(spec: TieredPrefixCacheSpec) -> Adapter:
    """The spec's adapter (check_spec has refused specs without one)."""
    adapter = _BY_PAIR.get((str(spec.engine), str(spec.connector)))
    if adapter is None:
        raise ValueError(_no_adapter(str(spec.engine), str(spec.connector)))
    return adapter


def _no_adapter(engine: str, connector: str) -> str:
    return (f"spec.connector: engine {engine} takes connector "
            f"{' or '.join(connectors_of(engine))}, not {connector} (allowed: "
            f"{allowed_pairs_text()})")
