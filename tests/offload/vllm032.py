"""Test-only: the few vLLM 0.32 types kvtier's GPU-direct worker needs, for machines with
CUDA torch and no vLLM (the GPU machines this project borrows: vLLM 0.32 pins torch 2.13
and is far too large to carry there). install() puts this module in sys.modules as
`vllm.v1.kv_offload.base` where vLLM itself does not import, so kvtier_offload.vllm_spec,
the device-phase tests (tests/offload/gpu) and benchmarks/gpu.py run with torch alone.

Written from vLLM 0.32's `vllm/v1/kv_offload/base.py` interface, not copied: only what
the worker and its tests use. tests/offload/test_vllm032_shim.py checks it against the
real module on CPU (every name kvtier_offload.vllm_spec imports, the dataclass fields and
their defaults, the constructor parameters, the abstract methods), so a vLLM change that
the shim would hide fails there.
"""

from __future__ import annotations

import enum
import importlib.util
import sys
import types
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, NewType

import numpy as np

SHIM = True  # vllm.v1.kv_offload.base.SHIM: which one was imported

OffloadKey = NewType("OffloadKey", bytes)


class Medium(enum.Enum):
    CPU = "CPU"
    STORAGE = "STORAGE"


class Locality(enum.Enum):
    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


@dataclass
class OffloadingEvent:
    keys: list[OffloadKey]
    medium: Medium
    removed: bool  # True: the blocks were removed; False: stored
    locality: Locality | None = None
    ownership: str | None = None  # the secondary tier that sent it; None: the primary
    removal_expected: bool = False


class LookupResult(enum.Enum):
    MISS = enum.auto()
    HIT = enum.auto()
    HIT_PENDING = enum.auto()
    RETRY = enum.auto()


@dataclass
class ReqContext:
    req_id: str
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class RequestOffloadingContext:
    pass


class ScheduleEndContext(NamedTuple):
    """What a manager's on_schedule_end is told after each scheduler step."""

    new_req_ids: Collection[str]
    preempted_req_ids: Collection[str]


class LoadStoreSpec:
    """Where a transfer's blocks are on the offloaded side."""


@dataclass
class PrepareStoreOutput:
    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


class OffloadingManager(ABC):
    """The scheduler's side: what a manager must implement (kvtier's does)."""

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult: ...

    @abstractmethod
    def prepare_load(self, keys: Collection[OffloadKey],
                     req_context: ReqContext) -> LoadStoreSpec: ...

    @abstractmethod
    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext) -> PrepareStoreOutput | None: ...

    @abstractmethod
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext: ...

    def shutdown(self) -> None:
        return


class GPULoadStoreSpec(LoadStoreSpec):
    """GPU block ids of a transfer, grouped by KV cache group."""

    def __init__(self, block_ids: list[int], group_sizes: Sequence[int],
                 block_indices: Sequence[int]) -> None:
        if sum(group_sizes) != len(block_ids) or len(block_indices) != len(group_sizes):
            raise ValueError("group_sizes must sum to the block ids, one index per group")
        self.block_ids = np.array(block_ids, dtype=np.int32)
        self.group_sizes = group_sizes
        self.block_indices = block_indices


@dataclass
class CanonicalKVCacheTensor:
    tensor: Any  # torch.Tensor
    page_size_bytes: int


@dataclass
class CanonicalKVCaches:
    tensors: list[CanonicalKVCacheTensor]
    group_data_refs: list[list[Any]]


@dataclass
class TransferResult:
    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None


class OffloadingWorker(ABC):
    @abstractmethod
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool: ...

    @abstractmethod
    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    dst_spec: GPULoadStoreSpec) -> bool: ...

    @abstractmethod
    def get_finished(self) -> list[TransferResult]: ...

    @abstractmethod
    def wait(self, job_ids: set[int]) -> None: ...

    def shutdown(self) -> None:
        return


class OffloadingSpec(ABC):
    def __init__(self, config: Any) -> None:
        self.config = config
        self.extra_config = config.extra_config
        self.replicated_layout = False
        self.blocks_per_chunk = config.cache.blocks_per_chunk

    @abstractmethod
    def get_manager(self) -> OffloadingManager: ...

    @abstractmethod
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker: ...


def install() -> bool:
    """Make `vllm.v1.kv_offload.base` this module where vLLM is not installed; True when
    the shim was installed, False when vLLM is there (nothing changes)."""
    hidden = "vllm" in sys.modules and sys.modules["vllm"] is None  # import blocked
    if not hidden and ("vllm" in sys.modules or importlib.util.find_spec("vllm") is not None):
        return False  # found without importing it (vLLM takes seconds to import)
    names = ("vllm", "vllm.v1", "vllm.v1.kv_offload")
    for name in names:
        package = types.ModuleType(name, "kvtier's test shim (tests/offload/vllm032.py)")
        package.__path__ = []  # a package, with nothing else in it
        sys.modules[name] = package
    sys.modules["vllm.v1.kv_offload.base"] = sys.modules[__name__]
    sys.modules["vllm"].v1 = sys.modules["vllm.v1"]  # type: ignore[attr-defined]
    sys.modules["vllm.v1"].kv_offload = sys.modules["vllm.v1.kv_offload"]  # type: ignore[attr-defined]
    sys.modules["vllm.v1.kv_offload"].base = sys.modules[__name__]  # type: ignore[attr-defined]
    return True


def is_shim() -> bool:
    """Whether `vllm.v1.kv_offload.base` is this shim (not vLLM itself)."""
    base = sys.modules.get("vllm.v1.kv_offload.base")
    return bool(getattr(base, "SHIM", False))
