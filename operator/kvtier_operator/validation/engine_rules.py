"""The checks that need an engine's knowledge, from the adapter registry: `check_spec`
for the webhook, reconcile and the CLI (through validation.parse_tpc), and the same
refusals as the CRD's CEL rules on spec (`spec_rules`)."""

from __future__ import annotations

from collections.abc import Iterable

from kvtier_operator.api.v1alpha1 import RouterScoring, StorageBackend, TieredPrefixCacheSpec
from kvtier_operator.engines.base import Adapter
from kvtier_operator.engines.registry import (
    ADAPTERS,
    DEFAULT_CONNECTOR,
    DEFAULT_ENGINE,
    SETTINGS_BLOCKS,
    adapter_for,
    allowed_pairs_text,
)
from kvtier_operator.engines.versions import cel_at_least
from kvtier_operator.validation.immutable import transition_rules


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
    for field, given, able in _chained(spec):
        if given and adapter not in able:
            raise ValueError(
                f"spec.{field}: {adapter.describe()} cannot chain this tier behind its own "
                f"({adapter.title}); remove spec.{field}, or use {allowed_pairs_text(able)}")
    if spec.router.scoring == RouterScoring.precise and not adapter.publishes_kv_events:
        raise ValueError(
            f"spec.router.scoring precise: kvtier cannot make {adapter.describe()} publish "
            f"KV events; use scoring approximate, or {allowed_pairs_text(_publishers())}")
    if spec.sync_load_budget is not None and not adapter.sync_loads:
        able = [a for a in ADAPTERS if a.sync_loads]
        raise ValueError(f"spec.syncLoadBudget applies only to {allowed_pairs_text(able)}; "
                         f"remove it with {adapter.describe()}")
    adapter.validate(spec)
    refusal = adapter.version_refusal(spec)
    if refusal:
        raise ValueError(refusal)
    backend = spec.storage.backend if spec.storage is not None else None
    if backend is not None and backend not in adapter.storage_backends:
        allowed = ", ".join(str(b) for b in adapter.storage_backends) or "none (leave it unset)"
        raise ValueError(f"spec.storage.backend {backend} is not possible with "
                         f"{adapter.describe()}; allowed: {allowed}")
    if spec.storage is not None and spec.storage.store_nice is not None and \
            adapter.storage_backend(spec) != StorageBackend.kvtier:
        raise ValueError(f"spec.storage.storeNice applies to kvtier's backend only (storage."
                         f"backend kvtier); remove it with {adapter.describe()}"
                         + (f" and backend {adapter.storage_backend(spec)}"
                            if adapter.storage_backend(spec) else ""))


def _chained(spec: TieredPrefixCacheSpec | None = None
             ) -> list[tuple[str, bool, list[Adapter]]]:
    """(field, whether the spec gives it, the adapters that take it) for the tiers
    chained behind the CPU tier."""
    return [
        ("localDisk", spec is not None and spec.local_disk is not None,
         [a for a in ADAPTERS if a.takes_local_disk]),
        ("objectStore", spec is not None and spec.object_store is not None,
         [a for a in ADAPTERS if a.takes_object_store]),
    ]


def _publishers() -> list[Adapter]:
    return [a for a in ADAPTERS if a.publishes_kv_events]


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
    for field, _, able in _chained():
        rules.append({
            "rule": f"!has(self.{field}) || {_PAIR} in {_pairs(able)}",
            "message": f"spec.{field}: kvtier chains this tier only with "
                       f"{allowed_pairs_text(able)}; remove spec.{field}",
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
    rules.append({
        "rule": "!has(self.router) || !has(self.router.scoring) || "
                f"self.router.scoring != 'precise' || {_PAIR} in {_pairs(_publishers())}",
        "message": "spec.router.scoring precise needs an engine kvtier makes publish KV "
                   f"events: {allowed_pairs_text(_publishers())}; use approximate",
    })
    rules += version_rules()
    for block in SETTINGS_BLOCKS:
        owners = [a for a in ADAPTERS if a.settings_block == block]
        rules.append({
            "rule": f"has(self.{block}) == ({_PAIR} in {_pairs(owners)})",
            "message": f"spec.{block} is required with, and applies only to, "
                       f"{allowed_pairs_text(owners)}",
        })
    return rules


def version_rules() -> list[dict[str, str]]:
    """spec.engineVersion: only where the adapter has a version table, not below its
    oldest, and not below a feature's minimum where a field asks for that feature;
    spec.syncLoadBudget only where the adapter takes it."""
    versioned = [a for a in ADAPTERS if a.versions is not None]
    rules = [{
        "rule": f"!has(self.engineVersion) || {_PAIR} in {_pairs(versioned)}",
        "message": "spec.engineVersion applies only to "
                   f"{allowed_pairs_text(versioned)}; remove it",
    }]
    able = [a for a in ADAPTERS if a.sync_loads]
    rules.append({
        "rule": f"!has(self.syncLoadBudget) || {_PAIR} in {_pairs(able)}",
        "message": f"spec.syncLoadBudget applies only to {allowed_pairs_text(able)}; remove it",
    })
    tables = {a.versions for a in versioned if a.versions is not None}
    for table in sorted(tables, key=lambda t: t.engine):
        owners = [a for a in versioned if a.versions == table]
        rules.append({
            "rule": f"!has(self.engineVersion) || !({_PAIR} in {_pairs(owners)}) || "
                    + cel_at_least("self.engineVersion", table.oldest),
            "message": f"spec.engineVersion: kvtier supports {table.engine} {table.oldest} "
                       "and later",
        })
        for f in table.features:
            if f.cel_asked is None or f.minimum <= table.oldest:
                continue  # every version kvtier accepts has it
            rules.append({
                "rule": f"!has(self.engineVersion) || !({_PAIR} in {_pairs(owners)}) || "
                        f"!({f.cel_asked}) || "
                        + cel_at_least("self.engineVersion", f.minimum),
                "message": f"{f.title} needs {table.engine} {f.minimum} or later "
                           f"({f.source}); spec.engineVersion is older: raise it or remove "
                           "the field that asks for it",
            })
    return rules


def _is(field: str, value: str, default: bool) -> str:
    """CEL: the (optional) field has this value, an unset one counting as its default."""
    if default:
        return f"(!has(self.{field}) || self.{field} == '{value}')"
    return f"(has(self.{field}) && self.{field} == '{value}')"


def no_cpu_tier_rules() -> list[dict[str, str]]:
    """spec.cpu may be left out only where an adapter serves without a CPU tier, on the
    shared tier's backend that does (vLLM native on kvtier's backend)."""
    able = [a for a in ADAPTERS if a.no_cpu_tier is not None]
    if not able:
        return [{"rule": "has(self.cpu)", "message": "spec.cpu is required"}]
    terms = []
    for a in able:
        assert a.no_cpu_tier is not None
        backend = a.no_cpu_tier.backend
        terms.append(
            "(" + " && ".join([
                _is("engine", str(a.engine), str(a.engine) == DEFAULT_ENGINE),
                _is("connector", str(a.connector), str(a.connector) == DEFAULT_CONNECTOR),
                "has(self.storage)",
                _is("storage.backend", str(backend), backend == a.storage_backends[0]),
            ]) + ")")
    return [{"rule": "has(self.cpu) || " + " || ".join(terms),
             "message": "; ".join(dict.fromkeys(a.no_cpu_tier.message for a in able
                                                if a.no_cpu_tier is not None))}]


def spec_rules(neutral: list[dict[str, str]]) -> list[dict[str, str]]:
    """Every CEL rule on spec, in the CRD's order: which specs may leave out the CPU tier,
    the API's engine-neutral rules (`neutral`), the registry's, and the transition rules
    that keep the engine fixed on a live cache."""
    return no_cpu_tier_rules() + neutral + cel_rules() + transition_rules()
