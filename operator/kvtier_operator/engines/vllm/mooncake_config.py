"""Mooncake's client config (the JSON in the ConfigMap spec.mooncake names), read the way
vLLM 0.32/0.33 reads it (vllm/distributed/mooncake_store.py, MooncakeStoreConfig), and
checked against the spec: the memory the pod lends, the protocol, and the SSD variant.

vLLM reads sizes as strings with a unit, and its GB is 1024**3 bytes (a GiB): "80GB" in
the config is 80 GiB, 7% more than cpu.size 80G. A test reads the sizes back with vLLM's
own parser (tests/operator/engines/test_engine_definitions.py).

Pure; the reconcile hands in the ConfigMap's text (bounded below) and turns the problems
into the PrerequisitesReady condition.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvtier_operator.api.v1alpha1 import TieredPrefixCacheSpec

# vLLM's defaults when a key is missing.
DEFAULT_SEGMENT_BYTES = 4 * 2**30
DEFAULT_LOCAL_BUFFER_BYTES = 4 * 2**30
DEFAULT_PROTOCOL = "rdma"
# A client config is a few hundred bytes; anything much larger is not one.
MAX_CONFIG_CHARS = 64 * 1024
_UNITS = {"gb": 2**30, "mb": 2**20, "kb": 2**10, "b": 1}
_SIZE = re.compile(r"\s*([0-9.]+)\s*(gb|mb|kb|b)?\s*", re.ASCII)


def size_bytes(value: Any) -> int:
    """A size the way vLLM's _parse_size reads it: an integer is bytes; a string is a
    decimal number with an optional unit GB, MB, KB or B (any case), each a power of
    1024, truncated to whole bytes."""
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        try:
            return int(value)
        except (TypeError, ValueError) as err:
            raise TypeError(f"unsupported type for a size: {type(value).__name__}") from err
    match = _SIZE.fullmatch(value.strip().lower())
    if not match:
        raise ValueError(f"invalid size {value[:40]!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2) or "b"])


@dataclass(frozen=True)
class ClientConfig:
    protocol: str
    mode: str
    segment_bytes: int  # global_segment_size: host memory lent to the store
    local_buffer_bytes: int  # local_buffer_size: the client's transfer buffer
    enable_offload: bool

    @property
    def lent_bytes(self) -> int:
        """Host memory the vLLM process registers with Mooncake."""
        return self.segment_bytes + self.local_buffer_bytes


def parse(text: str) -> ClientConfig:
    """The client config; ValueError/TypeError say what is wrong with it."""
    if len(text) > MAX_CONFIG_CHARS:
        raise ValueError(f"it is over {MAX_CONFIG_CHARS} characters, not a client config")
    doc = json.loads(text)
    if not isinstance(doc, dict):
        raise ValueError("it is not a JSON object")
    return ClientConfig(
        protocol=str(doc.get("protocol", DEFAULT_PROTOCOL)),
        mode=str(doc.get("mode", "embedded")),
        segment_bytes=size_bytes(doc.get("global_segment_size", DEFAULT_SEGMENT_BYTES)),
        local_buffer_bytes=size_bytes(doc.get("local_buffer_size",
                                              DEFAULT_LOCAL_BUFFER_BYTES)),
        enable_offload=bool(doc.get("enable_offload", False)),
    )


def problems(spec: TieredPrefixCacheSpec, text: str) -> list[str]:
    """What in the client config disagrees with the spec (empty: nothing)."""
    mooncake = spec.mooncake
    assert mooncake is not None
    try:
        config = parse(text)
    except (ValueError, TypeError) as err:
        return [f"cannot read it as Mooncake's client config: {err}"]
    out = []
    if config.protocol != str(mooncake.protocol):
        out.append(f"its protocol is {config.protocol[:20]!r} but spec.mooncake.protocol "
                   f"is {mooncake.protocol} (which decides the pods' RDMA device): make "
                   "them agree")
    if mooncake.offload is not None:
        if config.mode != "standalone-store" or config.segment_bytes != 0 \
                or not config.enable_offload:
            out.append("spec.mooncake.offload needs mode standalone-store, "
                       "global_segment_size 0 and enable_offload true (the client "
                       "DaemonSet owns the pool and its SSD tier)")
    elif config.mode == "standalone-store":
        out.append("its mode is standalone-store, which needs the client DaemonSet: set "
                   "spec.mooncake.offload, or use mode embedded")
    if config.lent_bytes > spec.cpu_bytes:
        out.append(f"global_segment_size plus local_buffer_size is {config.lent_bytes} "
                   f"bytes (vLLM reads GB as 1024**3), more than spec.cpu.size "
                   f"({spec.cpu_bytes} bytes), which the pods' memory is sized for: raise "
                   "cpu.size or lower them")
    return out
