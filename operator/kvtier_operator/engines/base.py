"""The adapter interface: what kvtier must know about one engine + connector.

An `Adapter` is one small object per (engine, connector) pair, registered once in
registry.py. Everything engine-specific the renderers, the webhook, the evictor CronJob,
the router config, the status and the docs need comes from it; nothing else branches
on the engine. A `Launcher` is the engine's command-line knowledge (recognise the
container that starts it, or a multi-host worker; see flags the user set by hand; pass
it options), shared by the adapters of one engine.

Adapters are pure, like every renderer: spec in, values out.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

from kvtier_operator.api.v1alpha1 import (
    Connector,
    Engine,
    StorageBackend,
    TieredPrefixCache,
    TieredPrefixCacheSpec,
)
from kvtier_operator.engines.figures import PodFigures, Samples
from kvtier_operator.engines.sizing import PodSizing
from kvtier_operator.engines.versions import Asked, Version, VersionTable

ROUTER_BLOCK_TOKENS = 16  # llm-d's approx prefix producer default (DefaultBlockSizeTokens)

# A prefix hit's worth on each tier relative to a GPU hit, from the tiers' speeds: a GPU
# hit costs nothing; a CPU-tier hit one PCIe copy (about 25 GB/s against HBM's 2-3 TB/s,
# still far cheaper than recomputing: 0.8, the llm-d router's own CPU default); a hit on
# the shared volume a network read at a tenth of that (2-5 GB/s per pod) before the same
# copy: 0.4 (the router's own default for llm-d's shared-storage tier). Overridden per
# tier by spec.router.tierWeights. docs/modes.md "Routing" documents the table.
# A local-disk hit (kvtier's local tier on the pod's own NVMe, 3-7 GB/s, no network) sits
# between the two: 0.6; an object-store hit (HTTP GETs, tens to hundreds of ms a block)
# below the shared volume: 0.2.
DEFAULT_TIER_WEIGHTS = {"gpu": 1.0, "cpu": 0.8, "localDisk": 0.6, "storage": 0.4,
                        "objectStore": 0.2}


@dataclass(frozen=True)
class RouterTier:
    """One tier as the router's precise scorer sees it: kvtier's tier name (gpu, cpu,
    storage: the keys of spec.router.tierWeights), the medium the engine puts in its KV
    events, and the weight of a hit there."""

    tier: str
    medium: str
    weight: float

    @property
    def router_name(self) -> str:
        """The name kvCacheBackendConfigs matches: the router lowercases each event's
        medium before it looks up the weight (llm-d-router pkg/kvevents/pool.go)."""
        return self.medium.lower()


class PodRole(StrEnum):
    server = "server"  # runs the engine's server: gets its options, env and sizing
    worker = "worker"  # a multi-host worker (no server): env and sizing only


@dataclass(frozen=True)
class Prerequisite:
    """An object the engine needs that someone else manages; the operator checks it exists
    and names it in the PrerequisitesReady condition instead of letting pods crash-loop."""

    kind: str  # "ConfigMap" | "Service" | "DaemonSet"
    namespace: str
    name: str
    field: str  # the spec field that names it, e.g. spec.mooncake.configMapName
    key: str | None = None  # a ConfigMap key that must be present
    # What is wrong with that key's text (pure, bounded; empty: nothing).
    check: Callable[[str], list[str]] | None = None


@dataclass(frozen=True)
class NoCpuTier:
    """An adapter that serves without spec.cpu: only on this shared-tier backend; the
    refusal otherwise names what to add."""

    backend: StorageBackend
    message: str


@dataclass(frozen=True)
class ExtraVolume:
    """A volume the engine needs mounted (beyond the shared tier's claim)."""

    volume: dict[str, Any]
    mount_path: str
    read_only: bool = True


class Launcher(ABC):
    """How an engine is started in a container."""

    label: ClassVar[str]  # the engine's name in messages ("vLLM", "SGLang")
    # Text the launcher writes into a `sh -c` script that no spec field shows: part of the
    # config hash, so a change to it restarts pods.
    script_option: ClassVar[str]
    command_words: ClassVar[str]  # how its start reads, for messages ("vllm serve")

    @abstractmethod
    def runs_server(self, container: dict[str, Any]) -> bool:
        """Whether the container's command line starts (or mentions) the server."""

    def runs_worker(self, container: dict[str, Any]) -> bool:
        """Whether the container is a multi-host worker of the engine (no server)."""
        return False

    @abstractmethod
    def own_offload_flags(self, line: str) -> list[str]:
        """Offloading flags the user already passes by hand, however quoted."""

    @abstractmethod
    def options_env(self, options: Any) -> dict[str, str]:
        """Env vars that carry the options to the command line (may be empty)."""

    @abstractmethod
    def add_options(self, container: dict[str, Any], options: Any) -> str:
        """Pass options to the server in place; returns why not (changing nothing)."""

    def events_env(self, config: dict[str, Any] | None) -> dict[str, str]:
        """Env vars that carry the KV-events config (Adapter.kv_events_config)."""
        return {}

    def add_events(self, container: dict[str, Any], config: dict[str, Any]) -> str:
        """Make the server publish KV events; returns why not (changing nothing)."""
        return f"kvtier cannot pass a KV-events config to {self.label}"

    # The port the server takes requests on unless told otherwise (its --port default):
    # what an InferencePool targets by default, and so the router's name of a pod,
    # <pod IP>:<port>, unless spec.router.targetPorts says otherwise.
    serving_port: ClassVar[int | None] = None
    # Where the server serves /metrics unless the pod says otherwise (observe: a
    # kvtier.dev/metrics-port annotation, a container port named metrics or http).
    metrics_port: ClassVar[int | None] = None
    # The metric families read_metrics reads (names without _total, _bucket, ...): the
    # observer parses only these lines of a page. Empty: every family.
    metric_families: ClassVar[frozenset[str]] = frozenset()

    def read_metrics(self, samples: Samples, offloaded: tuple[str, ...]) -> PodFigures | None:
        """The tier figures on one pod's metrics page (engines/figures.py); None: kvtier
        reads no figures from this engine."""
        return None


class Adapter(ABC):
    """One engine + connector. Subclasses set the class attributes and override what
    differs; the defaults describe a vLLM-style engine with a CPU tier only."""

    engine: ClassVar[Engine]
    connector: ClassVar[Connector]
    title: ClassVar[str]  # one line for docs and messages
    launcher: ClassVar[Launcher]
    # Shared file tier: whether spec.storage is possible, and the spec.storage.backend
    # values it takes (the first is the default; empty: backend must stay unset).
    takes_storage: ClassVar[bool] = False
    storage_backends: ClassVar[tuple[StorageBackend, ...]] = ()
    # The spec block only this adapter reads, required with it (e.g. "tpu", "mooncake").
    settings_block: ClassVar[str | None] = None
    # Whether spec.cpu may be left out (files straight from accelerator memory), and on
    # which backend; validation turns it into the CRD's rule.
    no_cpu_tier: ClassVar[NoCpuTier | None] = None
    # The engine's versions and features (None: spec.engineVersion does not apply).
    versions: ClassVar[VersionTable | None] = None
    # Whether spec.syncLoadBudget (the engine's in-step loads) is possible.
    sync_loads: ClassVar[bool] = False
    # Whether the adapter chains more secondary tiers behind the CPU tier: the node-local
    # disk (spec.localDisk) and an object store (spec.objectStore).
    takes_local_disk: ClassVar[bool] = False
    takes_object_store: ClassVar[bool] = False

    # ---------------------------------------------------------------- the spec
    def validate(self, spec: TieredPrefixCacheSpec) -> None:
        """Raise ValueError naming the field and the fix for what this adapter refuses
        beyond the generic checks (validation/engine_rules.check_spec)."""
        if spec.cpu is None:
            raise ValueError(f"spec.cpu is required with {self.describe()}; add cpu.size, "
                             "e.g. 100Gi")

    def asked_features(self, spec: TieredPrefixCacheSpec) -> list[Asked]:
        """The versioned features (self.versions) this spec makes kvtier render."""
        return []

    def declared_version(self, spec: TieredPrefixCacheSpec) -> Version | None:
        return None if spec.engine_version is None else Version.parse(spec.engine_version)

    def version_refusal(self, spec: TieredPrefixCacheSpec) -> str | None:
        """Why spec.engineVersion is refused: another engine, below the oldest supported,
        or lacking a feature the spec asks for (naming both); None: fine."""
        if spec.engine_version is None:
            return None
        table = self.versions
        if table is None:
            return (f"spec.engineVersion applies to engine vllm only; remove it with "
                    f"{self.describe()}")
        version = self.declared_version(spec)
        assert version is not None  # the API's pattern
        if version < table.oldest:
            return (f"spec.engineVersion {spec.engine_version}: kvtier supports "
                    f"{table.engine} {table.oldest} and later")
        for a in table.missing(version, self.asked_features(spec)):
            return (f"{a.by} asks for {a.feature.title}, which needs {table.engine} "
                    f"{a.feature.minimum} or later ({a.feature.source}); spec.engineVersion "
                    f"is {spec.engine_version}: raise it or remove {a.by}")
        return None

    def container_conflict(self, spec: TieredPrefixCacheSpec,
                           container: dict[str, Any]) -> str | None:
        """Why the engine as this container starts it cannot run what the spec renders
        (a flag in its command line that the rendered config contradicts); None: fine."""
        return None

    def version_conflict(self, spec: TieredPrefixCacheSpec,
                         container: dict[str, Any]) -> str | None:
        """Why the engine in this container cannot have what the spec asks for: its
        image's release tag (else spec.engineVersion, else the oldest supported version)
        lacks a feature; None: fine."""
        table = self.versions
        if table is None:
            return None
        asked = self.asked_features(spec)
        if not asked:
            return None
        image = container.get("image")
        version = table.image_version(image)
        source = f"image {image} says {table.engine} {version}"
        if version is None:
            version = self.declared_version(spec)
            source = f"spec.engineVersion is {version}"
        if version is None:
            version = table.oldest
            source = (f"the {table.engine} version is unknown (image {image} has no "
                      f"{table.engine} release tag and spec.engineVersion is unset), so "
                      f"kvtier assumes the oldest it supports, {version}")
        missing = table.missing(version, asked)
        if not missing:
            return None
        a = missing[0]
        return (f"EngineVersionConflict: container {container.get('name')!r}: {a.by} asks "
                f"for {a.feature.title}, which needs {table.engine} {a.feature.minimum} or "
                f"later ({a.feature.source}); {source}: use such an image, set "
                f"spec.engineVersion, or remove {a.by}")

    def storage_backend(self, spec: TieredPrefixCacheSpec) -> StorageBackend | None:
        if spec.storage is None or not self.storage_backends:
            return None
        return StorageBackend(spec.storage.backend or self.storage_backends[0])

    def describe(self) -> str:
        return f"engine {self.engine} and connector {self.connector}"

    # ---------------------------------------------------------------- the pod
    @abstractmethod
    def launch_options(self, tpc: TieredPrefixCache) -> Any:
        """What the launcher passes on the command line (vLLM: the kv-transfer JSON)."""

    def env(self, tpc: TieredPrefixCache, role: PodRole) -> dict[str, str]:
        """Env vars the connector needs, by name, as the process sees them."""
        return {"PYTHONHASHSEED": str(tpc.hash_seed)}

    @abstractmethod
    def pod_sizing(self, spec: TieredPrefixCacheSpec, existing_shm_bytes: int | None,
                   container: dict[str, Any], role: PodRole) -> PodSizing:
        """/dev/shm size (None: leave it alone) and the memory request increase."""

    def group_conflict(self, spec: TieredPrefixCacheSpec, pod: dict[str, Any],
                       workload: dict[str, Any] | None = None) -> str | None:
        """Why the pod's group (e.g. the LeaderWorkerSet it belongs to) does not fit the
        spec, or None. `workload`: the workload whose template `pod` is (kvtier render),
        else `pod` is a real pod (the webhook)."""
        return None

    def fingerprint(self, tpc: TieredPrefixCache) -> dict[str, Any]:
        """The config hash's inputs beyond the pod plan's (plan.py): what the launcher
        writes that no spec field shows, and settings that only this engine reads."""
        return {"scriptOption": self.launcher.script_option}

    def extra_volumes(self, tpc: TieredPrefixCache) -> list[ExtraVolume]:
        return []

    def device_resources(self, spec: TieredPrefixCacheSpec) -> dict[str, str]:
        """Extended resources (a device plugin's, e.g. rdma/ib) the model-server container
        requests and limits; a container that already asks for one keeps its count."""
        return {}

    def sweeps_shm(self, spec: TieredPrefixCacheSpec) -> bool:
        """Whether the engine keeps a region in /dev/shm that a killed engine leaves
        behind: its command is then prefixed with kvtier's sweep (needs the offload
        package)."""
        return False

    def needs_offload_package(self, spec: TieredPrefixCacheSpec) -> bool:
        """Whether pods get kvtier's offload package (init container + PYTHONPATH)."""
        return False

    # ------------------------------------------------- evictor, router, status
    def tier_directory(self, spec: TieredPrefixCacheSpec) -> str:
        """The directory the engine writes the shared tier in, relative to
        spec.storage.mountPath ('': the mount itself); what prepareDirectory prepares."""
        return ""

    def evictor_layout(self, spec: TieredPrefixCacheSpec) -> str | None:
        """The evictor's --layout for the shared tier; None: no evictor CronJob (no
        shared tier, or the engine evicts on its own)."""
        return None

    def router_block_size(self, spec: TieredPrefixCacheSpec) -> int:
        return spec.router.block_size or ROUTER_BLOCK_TOKENS

    def router_target_ports(self, spec: TieredPrefixCacheSpec) -> list[int]:
        """The ports the router names a pod by (its InferencePool's targetPorts):
        spec.router.targetPorts, else the server's default port; empty where neither is
        known."""
        if spec.router.target_ports:
            return list(spec.router.target_ports)
        port = self.launcher.serving_port
        return [] if port is None else [port]

    def router_cpu_blocks(self, spec: TieredPrefixCacheSpec) -> int | None:
        """The router's CPU-tier LRU capacity per replica, in router blocks; None: no
        CPU-tier scorer."""
        return spec.cpu_bytes // (spec.model.bytes_per_token * self.router_block_size(spec))

    # The KV-event medium of each tier the engine has (vLLM: GPU, CPU, STORAGE), in order
    # from the fastest; the adapter says which tiers a spec configures (router_tier_names).
    router_media: ClassVar[dict[str, str]] = {"gpu": "GPU", "cpu": "CPU", "localDisk": "STORAGE",
                                              "storage": "STORAGE", "objectStore": "STORAGE"}
    # Whether kvtier can make the engine publish KV events (spec.router.scoring precise).
    publishes_kv_events: ClassVar[bool] = False

    def router_tier_names(self, spec: TieredPrefixCacheSpec) -> list[str]:
        """The tiers this spec configures, fastest first."""
        return ["gpu", *self.offloaded_tiers(spec)]

    def router_tiers(self, spec: TieredPrefixCacheSpec) -> list[RouterTier]:
        """Every medium the spec's tiers announce, with its weight (the spec's override,
        else DEFAULT_TIER_WEIGHTS): none is left for the router to score 0. The router
        weighs by medium alone, so tiers that announce the same one (vLLM's local disk,
        shared volume and object store all say STORAGE) share one entry, weighted as the
        fastest of them: a block a pod announces there is one it can load at that speed
        at best."""
        overrides = spec.router.tier_weights
        out: list[RouterTier] = []
        for name in self.router_tier_names(spec):
            medium = self.router_media[name]
            if any(t.medium == medium for t in out):
                continue
            weight = overrides.of(name)
            out.append(RouterTier(name, medium,
                                  DEFAULT_TIER_WEIGHTS[name] if weight is None else weight))
        return out

    def kv_events_config(self, tpc: TieredPrefixCache) -> dict[str, Any] | None:
        """The engine's KV-events config for precise scoring (vLLM: --kv-events-config);
        None: nothing to pass."""
        return None

    def router_server_labels(self, tpc: TieredPrefixCache) -> dict[str, str] | None:
        """Labels the router must add to its model-server selector (e.g. leaders only on
        multi-host); None: the selector as the user has it."""
        return None

    def prerequisites(self, tpc: TieredPrefixCache) -> list[Prerequisite]:
        return []

    def offloaded_tiers(self, spec: TieredPrefixCacheSpec) -> tuple[str, ...]:
        """The tiers below HBM the spec configures, nearest first (status.tiers)."""
        present = {"cpu": spec.cpu, "localDisk": spec.local_disk, "storage": spec.storage,
                   "objectStore": spec.object_store}
        return tuple(name for name, tier in present.items() if tier is not None)
