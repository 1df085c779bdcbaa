"""Every engine + connector kvtier supports, registered once.

`ADAPTERS` is the only list: the spec's validation (`check_spec`), the CRD's CEL rules
(`cel_rules`), the renderers, the webhook and the docs all read it. Adding an engine
means one adapter module, one line here, the enum value in models.py, and its tests.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier_operator.engines.base import Adapter
from kvtier_operator.engines.sglang_hicache import SglangHicache
from kvtier_operator.engines.vllm_gpu import VllmLmcache, VllmNative
from kvtier_operator.engines.vllm_kvbm import VllmKvbm
from kvtier_operator.engines.vllm_mooncake import VllmMooncakeStore
from kvtier_operator.engines.vllm_tpu import VllmTpuNative
from kvtier_operator.models import TieredPrefixCacheSpec

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
DEFAULT_ENGINE, DEFAULT_CONNECTOR = "vllm", "native"  # the models' defaults, for CEL
SETTINGS_BLOCKS = tuple(sorted({a.settings_block for a in ADAPTERS if a.settings_block}))


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


def check_spec(spec: TieredPrefixCacheSpec) -> None:
    """Refuse what the spec's adapter cannot do, naming the field and what is allowed."""
    adapter = adapter_for(spec)
    for block in SETTINGS_BLOCKS:
        given = getattr(spec, block) is not None
        if given and adapter.settings_block != block:
            owners = [a for a in ADAPTERS if a.settings_block == block]
            raise ValueError(f"spec.{block} applies only to {allowed_pairs_text(owners)}; "
                             f"remove it with {adapter.describe()}")
        if not given and adapter.settings_block == block:
            raise ValueError(f"spec.{block} is required with {adapter.describe()} "
                             f"(see `kubectl explain tpc.spec.{block}`)")
    if spec.storage is not None and not adapter.takes_storage:
        with_storage = [a for a in ADAPTERS if a.takes_storage]
        raise ValueError(
            f"spec.storage: {adapter.describe()} has no shared file tier kvtier manages "
            f"({adapter.title}); remove spec.storage, or use {allowed_pairs_text(with_storage)}")
    adapter.validate(spec)
    backend = spec.storage.backend if spec.storage is not None else None
    if backend is not None and backend not in adapter.storage_backends:
        allowed = ", ".join(str(b) for b in adapter.storage_backends) or "none (leave it unset)"
        raise ValueError(f"spec.storage.backend {backend} is not possible with "
                         f"{adapter.describe()}; allowed: {allowed}")


# ------------------------------------------------------------------- CEL

_ENGINE = f"(has(self.engine) ? self.engine : '{DEFAULT_ENGINE}')"
_CONNECTOR = f"(has(self.connector) ? self.connector : '{DEFAULT_CONNECTOR}')"
_PAIR = f"{_ENGINE} + '/' + {_CONNECTOR}"


def _pairs(adapters: Iterable[Adapter]) -> str:
    return "[" + ", ".join(f"'{a.engine}/{a.connector}'" for a in adapters) + "]"


def cel_rules() -> list[dict[str, str]]:
    """The API server's share of check_spec: the same refusals, as CEL on spec."""
    rules = [{
        "rule": f"{_PAIR} in {_pairs(ADAPTERS)}",
        "message": f"spec.connector is not possible with this spec.engine; allowed: "
                   f"{allowed_pairs_text()}",
    }]
    with_storage = [a for a in ADAPTERS if a.takes_storage]
    rules.append({
        "rule": f"!has(self.storage) || {_PAIR} in {_pairs(with_storage)}",
        "message": "spec.storage: a shared file tier kvtier manages exists only with "
                   f"{allowed_pairs_text(with_storage)}; remove spec.storage",
    })
    backends = [f"'{a.engine}/{a.connector}/{b}'" for a in ADAPTERS for b in a.storage_backends]
    rules.append({
        "rule": "!has(self.storage) || !has(self.storage.backend) || "
                f"{_PAIR} + '/' + self.storage.backend in [{', '.join(backends)}]",
        "message": "spec.storage.backend is not possible with this engine and connector; "
                   "allowed: " + "; ".join(
                       f"{a.engine}/{a.connector}: {', '.join(map(str, a.storage_backends))}"
                       for a in ADAPTERS if a.storage_backends) + "; others: leave it unset",
    })
    for block in SETTINGS_BLOCKS:
        owners = [a for a in ADAPTERS if a.settings_block == block]
        rules.append({
            "rule": f"has(self.{block}) == ({_PAIR} in {_pairs(owners)})",
            "message": f"spec.{block} is required with, and applies only to, "
                       f"{allowed_pairs_text(owners)}",
        })
    return rules
